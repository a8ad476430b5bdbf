//===- LayerData.cpp - The layer's inputs: made at random, read and written ===//
//
// See LayerRun.h: randomLayerData, and the .npy files of a run's inputs and
// outputs (readLayerInputs, writeLayerInputs, writeLayerOutputs).
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/LayerRun.h"

#include "runtime/cpu/Element.h"
#include "runtime/tooling/Npy.h"
#include "runtime/tooling/Parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

namespace moec::tooling {

using format::DType;

namespace {

/// SplitMix64's finalizer: a bijection of 64-bit words that mixes every bit.
uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// A float uniform in [-1, 1) on a grid of 2^-23 (24 random bits), from
/// value `index` of the stream `key`.
float uniformAt(uint64_t key, uint64_t index) {
  return float(int64_t(mix64(key ^ mix64(index)) >> 40)) * 0x1p-23f - 1.0f;
}

} // namespace

std::string LoraTensor::name() const {
  return fmt::format("{}lora_{}{}", grad ? "d" : "", b ? "b" : "a", p + 1);
}

std::vector<int64_t> LoraTensor::dims(const LayerData &d) const {
  const int64_t K = p == 0 ? d.hidden : d.inter, N = p == 0 ? 2 * d.inter : d.hidden;
  return b ? std::vector<int64_t>{d.experts, d.loraRank, N}
           : std::vector<int64_t>{d.experts, K, d.loraRank};
}

int64_t LoraTensor::perExpert(const LayerData &d) const {
  const std::vector<int64_t> all = dims(d);
  return all[1] * all[2];
}

std::vector<float> &LoraTensor::of(LayerData &d) const {
  return const_cast<std::vector<float> &>(of(static_cast<const LayerData &>(d)));
}

const std::vector<float> &LoraTensor::of(const LayerData &d) const {
  return grad ? (b ? d.dLoraB : d.dLoraA)[size_t(p)] : (b ? d.loraB : d.loraA)[size_t(p)];
}

std::vector<LoraTensor> loraTensors(uint8_t targets, bool grads) {
  std::vector<LoraTensor> out;
  for (int p = 0; p < 2; ++p)
    if (targets >> p & 1)
      for (bool b : {false, true})
        out.push_back(LoraTensor{p, b, grads});
  return out;
}

namespace {

/// `d`'s LoRA fields as `shape` says (no tensors).
void setLora(const rt::LayerShape &shape, LayerData &d) {
  d.loraTargets = shape.loraTargets;
  d.loraRank = shape.loraTargets ? shape.loraRank : 0;
  d.loraScale = shape.loraTargets ? shape.loraScaling : 0.0f;
}

} // namespace

void randomLayerData(const rt::LayerShape &shape, const RandomOptions &options, LayerData *out) {
  LayerData d;
  d.ranks = shape.epRanks();
  d.tp = shape.tp;
  d.tokens = shape.tokens;
  d.topK = shape.topK;
  d.experts = shape.experts();
  d.hidden = shape.hidden;
  d.inter = shape.inter * shape.tp;
  // Value i of tensor `stream` is a hash of (seed, stream, i), so the
  // tensors are filled in pieces on every hardware thread (hundreds of
  // millions of weights at a real model's shapes), the same values for any
  // thread count.
  const auto fill = [&](std::vector<float> &v, size_t n, float scale, uint64_t stream) {
    v.resize(n);
    const uint64_t key = mix64(options.seed ^ mix64(stream));
    constexpr int64_t kPiece = int64_t(1) << 20;
    forEachOnThreads((int64_t(n) + kPiece - 1) / kPiece, [&](int64_t piece) {
      const size_t end = std::min(n, size_t(piece + 1) * size_t(kPiece));
      for (size_t i = size_t(piece) * size_t(kPiece); i < end; ++i) {
        const float value = uniformAt(key, i) * scale;
        v[i] = options.bf16 ? cpu::roundToBf16(value) : value;
      }
    });
  };
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden, I = d.inter;
  fill(d.x, size_t(R * S * H), 1.0f, 1);
  fill(d.dy, size_t(R * S * H), 1.0f, 2);
  fill(d.w1, size_t(E * H * 2 * I), 1.0f / std::sqrt(float(std::max<int64_t>(H, 1))), 3);
  fill(d.w2, size_t(E * I * H), 1.0f / std::sqrt(float(std::max<int64_t>(I, 1))), 4);
  setLora(shape, d);
  for (const LoraTensor &t : loraTensors(d.loraTargets, false)) {
    const int64_t fanIn = t.dims(d)[1]; // K of A, r of B
    fill(t.of(d), size_t(E * t.perExpert(d)), 1.0f / std::sqrt(float(std::max<int64_t>(fanIn, 1))),
         uint64_t(5 + 2 * t.p + t.b));
  }
  // The routing from one stream of the seed.
  std::mt19937_64 rng(options.seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  d.ids.resize(size_t(R * S * K));
  d.weights.resize(size_t(R * S * K));
  std::vector<int64_t> experts(static_cast<size_t>(E));
  std::uniform_real_distribution<double> share(0.0, 1.0);
  for (int64_t row = 0; row < R * S; ++row) {
    std::iota(experts.begin(), experts.end(), 0);
    // A partial Fisher-Yates shuffle picks K distinct experts.
    for (int64_t k = 0; k < K; ++k)
      std::swap(experts[size_t(k)], experts[size_t(k + int64_t(rng() % uint64_t(E - k)))]);
    if (options.hotShare > 0 && share(rng) < options.hotShare) {
      auto hot = std::find(experts.begin(), experts.end(), 0);
      std::swap(*hot, experts[0]);
    }
    for (int64_t k = 0; k < K; ++k) {
      d.ids[size_t(row * K + k)] = experts[size_t(k)];
      d.weights[size_t(row * K + k)] = 0.2f + 0.4f * (uni(rng) + 1.0f);
    }
  }
  *out = std::move(d);
}

namespace {

std::string npyPath(const std::string &dir, const char *name) { return dir + "/" + name + ".npy"; }

/// Reads DIR/NAME.npy as floats of shape `dims` (float32 or float64 files).
Status readFloats(const std::string &dir, const char *name, const std::vector<int64_t> &dims,
                  std::vector<float> *out) {
  const std::string path = npyPath(dir, name);
  npy::NpyArray array;
  if (Status s = npy::readNpy(path, &array); !s)
    return s;
  if (array.shape != dims)
    return Status::error(fmt::format("{}: shape {}; expected {}", path,
                                     npy::formatShape(array.shape), npy::formatShape(dims)));
  out->resize(size_t(array.elements()));
  if (array.type == npy::NpyType::F32)
    std::copy(array.as<float>(), array.as<float>() + array.elements(), out->begin());
  else if (array.type == npy::NpyType::F64)
    std::transform(array.as<double>(), array.as<double>() + array.elements(), out->begin(),
                   [](double v) { return float(v); });
  else
    return Status::error(
        fmt::format("{}: {}; expected float32", path, npy::npyTypeName(array.type)));
  return Status::success();
}

} // namespace

std::vector<std::string> layerInputFiles(bool backward, uint8_t loraTargets) {
  std::vector<std::string> names = {"x.npy", "topk_ids.npy", "topk_weights.npy", "w1.npy",
                                    "w2.npy"};
  if (backward)
    names.push_back("dy.npy");
  for (const LoraTensor &t : loraTensors(loraTargets, false))
    names.push_back(t.name() + ".npy");
  return names;
}

Status readLayerInputs(const std::string &dir, const rt::LayerShape &shape, bool backward,
                       bool handMade, LayerData *out) {
  std::optional<std::set<std::string>> listed;
  if (!handMade)
    if (Status s = checkRunManifest(dir, &listed); !s)
      return s;
  // A folder with a manifest is one run's: a file it does not list (left by
  // an earlier run, or put there since) is not read as that run's.
  if (listed)
    for (const std::string &name : layerInputFiles(backward, shape.loraTargets))
      if (!listed->count(name))
        return Status::error(fmt::format(
            "{}/{}: not listed in {}/{}, so it is not of the run that wrote the folder; give "
            "--hand-made to use the folder's files as they are, or another --inputs folder",
            dir, name, dir, kRunManifest));
  LayerData d;
  d.ranks = shape.epRanks();
  d.tp = shape.tp;
  d.experts = shape.experts();
  d.hidden = shape.hidden;
  d.inter = shape.inter * shape.tp;
  // S and K come from topk_ids.
  const std::string idsPath = npyPath(dir, "topk_ids");
  npy::NpyArray ids;
  if (Status s = npy::readNpy(idsPath, &ids); !s)
    return s;
  if (ids.shape.size() != 3 || ids.shape[0] != d.ranks)
    return Status::error(fmt::format("{}: shape {}; expected ({}, S, K) for the binary's {} EP "
                                     "ranks",
                                     idsPath, npy::formatShape(ids.shape), d.ranks, d.ranks));
  d.tokens = ids.shape[1];
  d.topK = ids.shape[2];
  d.ids.resize(size_t(ids.elements()));
  if (ids.type == npy::NpyType::I64)
    std::copy(ids.as<int64_t>(), ids.as<int64_t>() + ids.elements(), d.ids.begin());
  else if (ids.type == npy::NpyType::I32)
    std::copy(ids.as<int32_t>(), ids.as<int32_t>() + ids.elements(), d.ids.begin());
  else
    return Status::error(
        fmt::format("{}: {}; expected int32 or int64", idsPath, npy::npyTypeName(ids.type)));
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden, I = d.inter;
  if (Status s = readFloats(dir, "topk_weights", {R, S, K}, &d.weights); !s)
    return s;
  if (Status s = readFloats(dir, "x", {R, S, H}, &d.x); !s)
    return s;
  if (Status s = readFloats(dir, "w1", {E, H, 2 * I}, &d.w1); !s)
    return s;
  if (Status s = readFloats(dir, "w2", {E, I, H}, &d.w2); !s)
    return s;
  if (backward)
    if (Status s = readFloats(dir, "dy", {R, S, H}, &d.dy); !s)
      return s;
  setLora(shape, d);
  for (const LoraTensor &t : loraTensors(d.loraTargets, false))
    if (Status s = readFloats(dir, t.name().c_str(), t.dims(d), &t.of(d)); !s)
      return s;
  *out = std::move(d);
  return Status::success();
}

namespace {

/// One .npy file of a layer's data.
struct NpyFile {
  std::string name;
  npy::NpyType type;
  std::vector<int64_t> dims;
  const void *data;
};

/// Writes each of `files` to DIR/NAME.npy and appends its file name to
/// *written.
Status writeNpyFiles(const std::string &dir, const std::vector<NpyFile> &files,
                     std::vector<std::string> *written) {
  for (const NpyFile &f : files) {
    if (Status s = npy::writeNpy(npyPath(dir, f.name.c_str()), f.type, f.dims, f.data); !s)
      return s;
    written->push_back(f.name + ".npy");
  }
  return Status::success();
}

} // namespace

Status writeLayerInputs(const std::string &dir, const LayerData &d, bool backward,
                        std::vector<std::string> *written) {
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden, I = d.inter;
  using npy::NpyType;
  std::vector<NpyFile> files = {
      {"x", NpyType::F32, {R, S, H}, d.x.data()},
      {"topk_ids", NpyType::I64, {R, S, K}, d.ids.data()},
      {"topk_weights", NpyType::F32, {R, S, K}, d.weights.data()},
      {"w1", NpyType::F32, {E, H, 2 * I}, d.w1.data()},
      {"w2", NpyType::F32, {E, I, H}, d.w2.data()},
  };
  if (backward)
    files.push_back({"dy", NpyType::F32, {R, S, H}, d.dy.data()});
  for (const LoraTensor &t : loraTensors(d.loraTargets, false))
    files.push_back({t.name(), NpyType::F32, t.dims(d), t.of(d).data()});
  return writeNpyFiles(dir, files, written);
}

Status writeLayerOutputs(const std::string &dir, const LayerData &d, bool backward,
                         std::vector<std::string> *written) {
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden, I = d.inter;
  using npy::NpyType;
  std::vector<NpyFile> files = {{"y", NpyType::F32, {R, S, H}, d.y.data()}};
  if (backward) {
    files.push_back({"dx", NpyType::F32, {R, S, H}, d.dx.data()});
    files.push_back({"dtopk_weights", NpyType::F32, {R, S, K}, d.dtopk.data()});
    // A frozen layer's backward has no weight gradients.
    if (!d.dw1.empty()) {
      files.push_back({"dw1", NpyType::F32, {E, H, 2 * I}, d.dw1.data()});
      files.push_back({"dw2", NpyType::F32, {E, I, H}, d.dw2.data()});
    }
    for (const LoraTensor &t : loraTensors(d.loraTargets, true))
      if (!t.of(d).empty())
        files.push_back({t.name(), NpyType::F32, t.dims(d), t.of(d).data()});
  }
  return writeNpyFiles(dir, files, written);
}

} // namespace moec::tooling
