//===- LayerRun.cpp - Inputs, runs and checks of a whole layer ------------===//
//
// See LayerRun.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/LayerRun.h"

#include "base/File.h"
#include "runtime/cpu/Element.h"
#include "runtime/cpu/Fp8.h"
#include "runtime/cpu/Quant.h"
#include "format/Crc32.h"
#include "format/TaskBinary.h"
#include "runtime/comm/Fabric.h"
#include "runtime/tooling/Reference.h"
#include "runtime/tooling/Npy.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <set>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/fs.h>

namespace moec::tooling {

using format::DType;

void randomLayerData(const rt::LayerShape &shape, const RandomOptions &options, LayerData *out) {
  LayerData d;
  d.ranks = shape.epRanks();
  d.tp = shape.tp;
  d.tokens = shape.tokens;
  d.topK = shape.topK;
  d.experts = shape.experts();
  d.hidden = shape.hidden;
  d.inter = shape.inter * shape.tp;
  std::mt19937_64 rng(options.seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const auto fill = [&](std::vector<float> &v, size_t n, float scale) {
    v.resize(n);
    for (float &e : v) {
      const float value = uni(rng) * scale;
      e = options.bf16 ? cpu::roundToBf16(value) : value;
    }
  };
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden,
                I = d.inter;
  fill(d.x, size_t(R * S * H), 1.0f);
  fill(d.dy, size_t(R * S * H), 1.0f);
  fill(d.w1, size_t(E * H * 2 * I), 1.0f / std::sqrt(float(std::max<int64_t>(H, 1))));
  fill(d.w2, size_t(E * I * H), 1.0f / std::sqrt(float(std::max<int64_t>(I, 1))));
  d.ids.resize(size_t(R * S * K));
  d.weights.resize(size_t(R * S * K));
  std::vector<int64_t> experts(static_cast<size_t>(E));
  std::uniform_real_distribution<double> share(0.0, 1.0);
  for (int64_t row = 0; row < R * S; ++row) {
    std::iota(experts.begin(), experts.end(), 0);
    // A partial Fisher-Yates shuffle picks K distinct experts.
    for (int64_t k = 0; k < K; ++k)
      std::swap(experts[size_t(k)],
                experts[size_t(k + int64_t(rng() % uint64_t(E - k)))]);
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

std::string npyPath(const std::string &dir, const char *name) {
  return dir + "/" + name + ".npy";
}

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
    return Status::error(fmt::format("{}: {}; expected float32", path,
                                     npy::npyTypeName(array.type)));
  return Status::success();
}

} // namespace

std::vector<std::string> layerInputFiles(bool backward) {
  std::vector<std::string> names = {"x.npy", "topk_ids.npy", "topk_weights.npy", "w1.npy",
                                    "w2.npy"};
  if (backward)
    names.push_back("dy.npy");
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
    for (const std::string &name : layerInputFiles(backward))
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
    return Status::error(fmt::format("{}: {}; expected int32 or int64", idsPath,
                                     npy::npyTypeName(ids.type)));
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden,
                I = d.inter;
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
  *out = std::move(d);
  return Status::success();
}

namespace {

/// One .npy file of a layer's data.
struct NpyFile {
  const char *name;
  npy::NpyType type;
  std::vector<int64_t> dims;
  const void *data;
};

/// Writes each of `files` to DIR/NAME.npy and appends its file name to
/// *written.
Status writeNpyFiles(const std::string &dir, const std::vector<NpyFile> &files,
                     std::vector<std::string> *written) {
  for (const NpyFile &f : files) {
    if (Status s = npy::writeNpy(npyPath(dir, f.name), f.type, f.dims, f.data); !s)
      return s;
    written->push_back(std::string(f.name) + ".npy");
  }
  return Status::success();
}

} // namespace

Status writeLayerInputs(const std::string &dir, const LayerData &d, bool backward,
                        std::vector<std::string> *written) {
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden,
                I = d.inter;
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
  return writeNpyFiles(dir, files, written);
}

Status writeLayerOutputs(const std::string &dir, const LayerData &d, bool backward,
                         std::vector<std::string> *written) {
  const int64_t R = d.ranks, S = d.tokens, K = d.topK, E = d.experts, H = d.hidden,
                I = d.inter;
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
  }
  return writeNpyFiles(dir, files, written);
}

//===----------------------------------------------------------------------===//
// Run folders
//===----------------------------------------------------------------------===//

namespace {

std::string crcText(const std::vector<uint8_t> &bytes) {
  return fmt::format("{:08x}", format::crc32(bytes.data(), bytes.size()));
}

} // namespace

/// Every name a run writes into its folder, inputs (of --random) and
/// outputs.
std::vector<std::string> runFolderFiles(bool backward, bool inputs) {
  std::vector<std::string> names = {"y.npy"};
  if (backward)
    names.insert(names.end(), {"dx.npy", "dtopk_weights.npy", "dw1.npy", "dw2.npy"});
  if (inputs)
    for (const std::string &name : layerInputFiles(backward))
      names.push_back(name);
  names.push_back(kRunManifest);
  return names;
}

bool isRunFileName(const std::string &name) {
  const std::vector<std::string> all = runFolderFiles(true, true);
  return std::find(all.begin(), all.end(), name) != all.end();
}

Status RunFolder::open(const std::string &dir, const std::vector<std::string> &writes,
                       const std::vector<std::string> &inputs, std::unique_ptr<RunFolder> *out) {
  if (dir.empty())
    return Status::error("--outputs: an empty path names no folder");
  std::unique_ptr<RunFolder> folder(new RunFolder());
  folder->dir = dir;
  std::error_code ec;
  struct stat link {};
  if (::lstat(dir.c_str(), &link) == 0 && S_ISLNK(link.st_mode) &&
      !std::filesystem::exists(dir, ec))
    return Status::error(fmt::format(
        "{}: cannot be the outputs folder: it is a symbolic link to nothing (or a loop)", dir));
  const bool existed = std::filesystem::exists(dir, ec);
  if (!existed && !std::filesystem::create_directories(dir, ec) && ec)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir, ec.message()));
  folder->created = !existed;
  folder->fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder->fd < 0)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir,
                                     std::strerror(errno)));
  if (::flock(folder->fd, LOCK_EX | LOCK_NB) != 0)
    return Status::error(fmt::format(
        "{}: another moec run is writing this folder now; give this run another --outputs "
        "folder, or wait for that run to end",
        dir));
  // The folder is replaced whole at the end: it may hold a run's files
  // only, none of them an input of this run under another name.
  for (const std::filesystem::directory_entry &entry :
       std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string(), path = dir + "/" + name;
    struct stat info {};
    if (::lstat(path.c_str(), &info) != 0)
      continue;
    if (std::find(writes.begin(), writes.end(), name) != writes.end() && !S_ISREG(info.st_mode))
      return Status::error(fmt::format(
          "{}: is {}; the run writes {} as a file of the outputs folder, so move that away "
          "or give another --outputs folder",
          path, S_ISLNK(info.st_mode) ? "a symbolic link" : "not a regular file", name));
    for (const std::string &input : inputs)
      if (sameFile(path, input))
        return Status::error(fmt::format(
            "{}: is the input {}; the run would write over it, so give another --outputs folder",
            path, input));
    if (!isRunFileName(name))
      return Status::error(fmt::format(
          "{}: holds '{}', which no run writes; a run replaces its outputs folder whole (a new "
          "folder beside it, swapped in when every file is written), so give a folder of its "
          "own: new, empty, or one that a run wrote",
          dir, name));
  }
  if (ec)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir, ec.message()));
  // The new folder goes beside the real one (through a symbolic link).
  const std::filesystem::path real = std::filesystem::canonical(dir, ec);
  if (ec)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir, ec.message()));
  folder->target = real.string();
  const std::string parent = real.parent_path().string(),
                    prefix = "." + real.filename().string() + ".moec-new.";
  removeStaleTemporaries(parent, prefix);
  folder->staging = parent + "/" + prefix + std::to_string(::getpid());
  std::filesystem::remove_all(folder->staging, ec);
  if (!std::filesystem::create_directory(folder->staging, ec))
    return Status::error(fmt::format("{}: cannot make the new outputs folder {} beside it: {}",
                                     dir, folder->staging,
                                     ec ? ec.message() : std::string("it exists")));
  *out = std::move(folder);
  return Status::success();
}

Status RunFolder::named(const Status &status) const {
  if (status || staging.empty())
    return status;
  std::string message = status.message();
  for (size_t at = message.find(staging); at != std::string::npos;
       at = message.find(staging, at + dir.size()))
    message.replace(at, staging.size(), dir);
  return Status::error(message, status.code());
}

RunFolder::~RunFolder() {
  std::error_code ec;
  if (!staging.empty()) // a failed run leaves the folder as it was
    std::filesystem::remove_all(staging, ec);
  if (created) // and none that it made
    std::filesystem::remove_all(dir, ec);
  if (fd >= 0)
    ::close(fd); // and the lock with it
}

Status RunFolder::finish(const std::vector<std::string> &files, const std::string &run,
                         const std::vector<std::string> &kept) {
  // Files of the folder that are this run's too (inputs read from it):
  // linked into the new folder, or copied where links cannot be made.
  for (const std::string &name : kept) {
    const std::string from = target + "/" + name, to = staging + "/" + name;
    std::error_code ec;
    std::filesystem::create_hard_link(from, to, ec);
    if (ec) {
      ec.clear();
      std::filesystem::copy_file(from, to, ec);
    }
    if (ec)
      return Status::error(fmt::format("{}: cannot carry it into the new outputs folder: {}",
                                       from, ec.message()));
  }
  nlohmann::ordered_json manifest;
  manifest["run"] = run;
  manifest["files"] = nlohmann::ordered_json::array();
  for (const std::string &name : files) {
    std::vector<uint8_t> bytes;
    if (Status s = readWholeFile(staging + "/" + name, &bytes); !s)
      return s;
    manifest["files"].push_back({{"name", name}, {"bytes", bytes.size()}, {"crc32", crcText(bytes)}});
  }
  const std::string text = manifest.dump(2) + "\n";
  if (Status s = writeFileAtomically(staging + "/" + kRunManifest, {{text.data(), text.size()}});
      !s)
    return s;
  // Swapped in at once: a reader sees the earlier run's folder or this one,
  // never a mix; then the earlier one (now at the new folder's name) goes.
  if (::syscall(SYS_renameat2, AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(),
                RENAME_EXCHANGE) != 0)
    return Status::error(fmt::format("{}: cannot put the new outputs folder in its place: {}",
                                     dir, std::strerror(errno)));
  if (int parent = ::open(std::filesystem::path(target).parent_path().c_str(),
                          O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      parent >= 0) {
    ::fsync(parent);
    ::close(parent);
  }
  created = false; // the run's folder now
  return Status::success();
}

Status checkRunManifest(const std::string &dir, std::optional<std::set<std::string>> *listed) {
  const std::string path = dir + "/" + kRunManifest;
  std::error_code ec;
  if (listed)
    listed->reset();
  if (!std::filesystem::is_directory(dir, ec))
    return Status::error(fmt::format("{}: {}", dir,
                                     std::filesystem::exists(dir, ec)
                                         ? "is not a folder; --inputs takes the folder of a run"
                                         : "no such folder"));
  if (!std::filesystem::exists(path, ec))
    return Status::error(fmt::format(
        "{}: has no {}, so it is not a folder that a moec run wrote whole (a run killed while "
        "it wrote, or files made by hand or by another tool); if you made it, say so with "
        "--hand-made (the files are then read as they are)",
        dir, kRunManifest));
  std::vector<uint8_t> text;
  if (Status s = readWholeFile(path, &text, kMaxTextBytes); !s)
    return s;
  std::set<std::string> names;
  const nlohmann::json manifest = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_array())
    return Status::error(path + ": not a run manifest (an object with a 'files' list)");
  for (const nlohmann::json &file : manifest["files"]) {
    if (!file.is_object() || !file.contains("name") || !file["name"].is_string() ||
        !file.contains("crc32") || !file["crc32"].is_string() || !file.contains("bytes") ||
        !file["bytes"].is_number_unsigned())
      return Status::error(path + ": a 'files' entry lacks its 'name', 'bytes' or 'crc32'");
    const std::string name = file["name"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      return Status::error(fmt::format(
          "{}: lists '{}', which is not the name of a file in the folder", path, name));
    names.insert(name);
    std::vector<uint8_t> bytes;
    if (Status s = readWholeFile(dir + "/" + name, &bytes); !s)
      return s.withPrefix(path + " lists " + name + ", but ");
    if (bytes.size() != file["bytes"].get<uint64_t>())
      return Status::error(fmt::format(
          "{}/{}: holds {} bytes; {} says {}: the file was cut short or changed after its run; "
          "to use the files as they are, give --hand-made",
          dir, name, bytes.size(), kRunManifest, file["bytes"].get<uint64_t>()));
    if (crcText(bytes) != file["crc32"].get<std::string>())
      return Status::error(fmt::format(
          "{}/{}: does not match {} (CRC-32 {}, the manifest says {}): the folder mixes files of "
          "two runs, or one was changed after its run; to use the files as they are, give "
          "--hand-made",
          dir, name, kRunManifest, crcText(bytes), file["crc32"].get<std::string>()));
  }
  if (listed)
    *listed = std::move(names);
  return Status::success();
}

//===----------------------------------------------------------------------===//
// LayerRun
//===----------------------------------------------------------------------===//

void LayerRun::Buffer::assign(const float *values, size_t count, DType type) {
  dtype = type;
  if (type == DType::BF16) {
    bf16.resize(count);
    cpu::floatToBf16(values, bf16.data(), count);
  } else {
    f32.assign(values, values + count);
  }
}

void LayerRun::Buffer::zeros(size_t count, DType type) {
  dtype = type;
  if (type == DType::BF16)
    bf16.assign(count, 0);
  else
    f32.assign(count, 0.0f);
}

void LayerRun::Buffer::clear() {
  std::fill(f32.begin(), f32.end(), 0.0f);
  std::fill(bf16.begin(), bf16.end(), uint16_t(0));
}

void LayerRun::Buffer::copyOut(float *out) const {
  if (dtype == DType::BF16)
    cpu::bf16ToFloat(bf16.data(), out, bf16.size());
  else
    std::copy(f32.begin(), f32.end(), out);
}

namespace {
enum Slot { kX, kY, kW1, kW2, kDy, kDx, kDw1, kDw2, kW1Scale, kW2Scale, kSlotsPerRank };

/// The I / T columns of TP slice `t` of an expert's w1 [H, 2I] (gate
/// columns, then up columns) and rows of its w2 [I, H], for experts
/// [first, first + count) of `d`, into w1 [count, H, 2I/T], w2 [count, I/T, H].
void sliceExperts(const LayerData &d, int64_t first, int64_t count, int64_t t, float *w1,
                  float *w2) {
  const int64_t H = d.hidden, I = d.inter, Is = I / d.tp;
  for (int64_t l = 0; l < count; ++l) {
    const float *full1 = d.w1.data() + (first + l) * H * 2 * I;
    for (int64_t h = 0; h < H; ++h) {
      float *row = w1 + (l * H + h) * 2 * Is;
      std::copy_n(full1 + h * 2 * I + t * Is, Is, row);
      std::copy_n(full1 + h * 2 * I + I + t * Is, Is, row + Is);
    }
    std::copy_n(d.w2.data() + ((first + l) * I + t * Is) * H, Is * H, w2 + l * Is * H);
  }
}

/// The inverse of sliceExperts for gradients: writes TP slice `t` of
/// experts [first, first + count) into full dw1 [E, H, 2I], dw2 [E, I, H].
void unsliceExperts(const LayerData &d, int64_t first, int64_t count, int64_t t,
                    const float *dw1, const float *dw2, float *full1, float *full2) {
  const int64_t H = d.hidden, I = d.inter, Is = I / d.tp;
  for (int64_t l = 0; l < count; ++l) {
    float *to1 = full1 + (first + l) * H * 2 * I;
    for (int64_t h = 0; h < H; ++h) {
      const float *row = dw1 + (l * H + h) * 2 * Is;
      std::copy_n(row, Is, to1 + h * 2 * I + t * Is);
      std::copy_n(row + Is, Is, to1 + h * 2 * I + I + t * Is);
    }
    std::copy_n(dw2 + l * Is * H, Is * H, full2 + ((first + l) * I + t * Is) * H);
  }
}

/// Expert `e`'s matrix [rows, cols] at `m` (row-major, or stored transposed
/// [cols, rows] with `transposed`) quantized in `shape`'s weight format, of
/// the form stored: its codes and scales (shape.storedDims and scaleDims of
/// one expert), and with `round` the matrix replaced by its dequantized
/// values.
void quantizeStored(const rt::LayerShape &shape, float *m, int64_t rows, int64_t cols,
                    bool transposed, void *codes, float *scales, bool round) {
  std::vector<float> stored(size_t(rows * cols));
  cpu::QuantizedMatrix q;
  q.format = shape.weightFormat;
  q.rows = transposed ? cols : rows;
  q.cols = transposed ? rows : cols;
  q.group = shape.weightGroup;
  q.zeroPoints = shape.weightZeroPoints;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      stored[size_t(transposed ? j * rows + i : i * cols + j)] = m[i * cols + j];
  cpu::quantize(q, stored.data(), q.cols, codes, scales);
  if (!round)
    return;
  q.codes = codes;
  q.scales = scales;
  cpu::dequantize(q, 0, q.rows, 0, q.cols, stored.data(), DType::F32, q.cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      m[i * cols + j] = stored[size_t(transposed ? j * rows + i : i * cols + j)];
}

/// A runtime tensor of `dims` (at most four) at `data`.
rt::Tensor tensorOf(void *data, DType dtype, const std::vector<int64_t> &dims) {
  rt::Tensor t = rt::makeTensor(data, dtype, {});
  for (int64_t d : dims)
    t.dims[t.ndim++] = d;
  return t;
}

/// The product of `dims`.
int64_t count(const std::vector<int64_t> &dims) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  return n;
}

/// Each of `count` row-major [rows, cols] matrices at `m`, transposed in
/// place to [cols, rows] (a binary that stores its weights transposed).
void transposeEach(float *m, int64_t count, int64_t rows, int64_t cols) {
  std::vector<float> one(size_t(rows * cols));
  for (int64_t l = 0; l < count; ++l) {
    float *at = m + l * rows * cols;
    std::copy_n(at, rows * cols, one.data());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        at[j * rows + i] = one[size_t(i * cols + j)];
  }
}
} // namespace

Status roundWeightsToFormat(const rt::LayerShape &shape, LayerData *d) {
  if (shape.weightFormat == WeightFormat::Dense)
    return Status::success();
  if (shape.tp > 1)
    return Status::error(fmt::format("{} weights with tensor parallelism ({} TP ranks) are not "
                                     "supported: their scales are of a whole expert",
                                     shape.weightFormatName(), shape.tp));
  const int64_t H = d->hidden, I = d->inter;
  for (const auto &[w, rows, cols] : {std::tuple{&d->w1, H, 2 * I}, std::tuple{&d->w2, I, H}}) {
    const int64_t E = int64_t(w->size()) / std::max<int64_t>(rows * cols, 1);
    const std::array<int64_t, 3> one =
        shape.weightsTransposed ? std::array<int64_t, 3>{1, cols, rows}
                                : std::array<int64_t, 3>{1, rows, cols};
    std::vector<uint8_t> codes(size_t(count(shape.storedDims(one))));
    std::vector<float> scales(size_t(count(shape.scaleDims(one))));
    for (int64_t e = 0; e < E; ++e)
      quantizeStored(shape, w->data() + e * rows * cols, rows, cols, shape.weightsTransposed,
                     codes.data(), scales.data(), true);
  }
  return Status::success();
}

Status LayerRun::bind(rt::Context &context, const LayerData &d) {
  const rt::LayerShape &shape = context.shape();
  if (shape.loraTargets)
    return Status::error(
        "the binary has LoRA adapters on the experts, and this tool makes no adapter inputs: "
        "run it through the torch op (moec_torch.MoeFFN(lora_rank=...)) or bind lora_a1 .. "
        "dlora_b2 through the runtime API");
  if (d.ranks != shape.epRanks() || d.tp != shape.tp || d.hidden != shape.hidden ||
      d.inter != shape.inter * shape.tp || d.experts != shape.experts())
    return Status::error(fmt::format(
        "the inputs are for {} x {} ranks (EP x TP), {} experts, H = {}, I = {}; the binary is "
        "for {} x {} ranks, {} experts, H = {}, I = {}",
        d.ranks, d.tp, d.experts, d.hidden, d.inter, shape.epRanks(), shape.tp, shape.experts(),
        shape.hidden, shape.inter * shape.tp));
  const DType act = shape.activations;
  const int64_t S = d.tokens, K = d.topK, H = d.hidden, I = shape.inter,
                L = shape.localExperts, T = d.tp;
  // The context's passes decide what is bound (dy is empty at S = 0 tokens).
  const std::array<int64_t, 3> w1Dims = shape.w1Dims(), w2Dims = shape.w2Dims();
  const bool backward = context.backwardShape() != nullptr;
  if (backward && d.dy.size() != size_t(d.ranks * S * H))
    return Status::error(fmt::format("dy holds {} values; the backward pass needs {} ({} x {} x {})",
                                     d.dy.size(), d.ranks * S * H, d.ranks, S, H));
  const size_t ranks = size_t(context.ranks());
  buffers.assign(ranks * kSlotsPerRank, Buffer());
  dtopk.assign(ranks, std::vector<float>(size_t(S * K)));
  ids.assign(ranks, {});
  weights.assign(ranks, {});
  const int64_t first = context.firstLocalRank(), last = first + context.localRanks();
  for (int64_t r = first; r < last; ++r) {
    Buffer *b = &buffers[size_t(r) * kSlotsPerRank];
    const size_t tokensH = size_t(S * H), w1n = size_t(L * H * 2 * I), w2n = size_t(L * I * H);
    const int64_t e = r / T, t = r % T;
    b[kX].assign(d.x.data() + e * S * H, tokensH, act);
    b[kY].zeros(tokensH, act);
    std::vector<float> w1(w1n), w2(w2n);
    sliceExperts(d, e * L, L, t, w1.data(), w2.data());
    if (shape.weightFormat != WeightFormat::Dense) {
      // Codes and scales of each expert's matrix as stored.
      for (const auto &[w, slot, scale, rows, cols] :
           {std::tuple{&w1, kW1, kW1Scale, H, 2 * I}, std::tuple{&w2, kW2, kW2Scale, I, H}}) {
        const std::array<int64_t, 3> dims = slot == kW1 ? shape.w1Dims() : shape.w2Dims();
        const int64_t codeBytes = count(shape.storedDims(dims)) / L,
                      scaleCount = count(shape.scaleDims(dims)) / L;
        Buffer &codes = b[slot], &scales = b[scale];
        codes.dtype = shape.weightDType();
        codes.bytes.assign(size_t(L * codeBytes), 0);
        scales.zeros(size_t(L * scaleCount), DType::F32);
        for (int64_t l = 0; l < L; ++l)
          quantizeStored(shape, w->data() + l * rows * cols, rows, cols, shape.weightsTransposed,
                         codes.bytes.data() + l * codeBytes, scales.f32.data() + l * scaleCount,
                         false);
      }
    } else {
      if (shape.weightsTransposed) { // w1 [L, 2I, H], w2 [L, H, I]
        transposeEach(w1.data(), L, H, 2 * I);
        transposeEach(w2.data(), L, I, H);
      }
      b[kW1].assign(w1.data(), w1n, act);
      b[kW2].assign(w2.data(), w2n, act);
    }
    ids[size_t(r)].assign(d.ids.begin() + e * S * K, d.ids.begin() + (e + 1) * S * K);
    weights[size_t(r)].assign(d.weights.begin() + e * S * K, d.weights.begin() + (e + 1) * S * K);
    const uint32_t rank = uint32_t(r);
    if (Status s = context.setRouting(rank, rt::makeTensor(ids[size_t(r)].data(), DType::I64, {S, K}),
                                      rt::makeTensor(weights[size_t(r)].data(), DType::F32, {S, K}));
        !s)
      return s;
    std::vector<std::pair<const char *, rt::Tensor>> tensors = {
        {"x", rt::makeTensor(b[kX].data(), act, {S, H})},
        {"y", rt::makeTensor(b[kY].data(), act, {S, H})},
        {"w1", tensorOf(b[kW1].data(), b[kW1].dtype, shape.storedDims(w1Dims))},
        {"w2", tensorOf(b[kW2].data(), b[kW2].dtype, shape.storedDims(w2Dims))},
    };
    if (shape.weightFormat != WeightFormat::Dense) {
      tensors.push_back(
          {"w1_scale", tensorOf(b[kW1Scale].data(), DType::F32, shape.scaleDims(w1Dims))});
      tensors.push_back(
          {"w2_scale", tensorOf(b[kW2Scale].data(), DType::F32, shape.scaleDims(w2Dims))});
    }
    if (backward) {
      // The weight-gradient dtype is the backward binary's; a context
      // without one refuses these bindings, which is the error to report.
      const rt::LayerShape *bs = context.backwardShape();
      const DType grad = bs ? bs->weightGrads : act;
      b[kDy].assign(d.dy.data() + e * S * H, tokensH, act);
      b[kDx].zeros(tokensH, act);
      tensors.insert(tensors.end(),
                     {{"dy", rt::makeTensor(b[kDy].data(), act, {S, H})},
                      {"dx", rt::makeTensor(b[kDx].data(), act, {S, H})},
                      {"dtopk_weights", rt::makeTensor(dtopk[size_t(r)].data(), DType::F32, {S, K})}});
      if (!(bs && bs->frozen)) {
        b[kDw1].zeros(w1n, grad);
        b[kDw2].zeros(w2n, grad);
        tensors.insert(tensors.end(),
                       {{"dw1", rt::makeTensor(b[kDw1].data(), grad, {L, H, 2 * I})},
                        {"dw2", rt::makeTensor(b[kDw2].data(), grad, {L, I, H})}});
      }
    }
    for (const auto &[name, tensor] : tensors)
      if (Status s = context.bind(rank, name, tensor); !s)
        return s;
  }
  return Status::success();
}

Status LayerRun::run(rt::Context &context, bool backward, LayerData *d) {
  if (Status s = context.forward(); !s)
    return s;
  if (backward) {
    // A main_grad binary adds its weight gradients into dw1 and dw2: each
    // run starts them from zero, so that a repeated run gives one step's.
    for (int64_t r = context.firstLocalRank(); r < context.firstLocalRank() + context.localRanks();
         ++r)
      for (Slot slot : {kDw1, kDw2})
        buffers[size_t(r) * kSlotsPerRank + slot].clear();
    if (Status s = context.backward(); !s)
      return s;
  }
  // Per rank first (R = P x T ranks, a rank's slice I / T wide), then put
  // together per EP rank.
  const int64_t R = context.ranks(), T = d->tp, S = d->tokens, K = d->topK, H = d->hidden,
                I = context.shape().inter;
  const int64_t L = context.shape().localExperts;
  const bool weightGrads = backward && !context.backwardShape()->frozen;
  std::vector<float> y(size_t(R * S * H)), dx, dtopkAll, dw1, dw2;
  if (backward) {
    dx.resize(size_t(R * S * H));
    dtopkAll.resize(size_t(R * S * K));
  }
  if (weightGrads) {
    dw1.resize(size_t(R * L * H * 2 * I));
    dw2.resize(size_t(R * L * I * H));
  }
  const int64_t first = context.firstLocalRank(), local = context.localRanks();
  for (int64_t r = first; r < first + local; ++r) {
    const Buffer *b = &buffers[size_t(r) * kSlotsPerRank];
    b[kY].copyOut(y.data() + r * S * H);
    if (!backward)
      continue;
    b[kDx].copyOut(dx.data() + r * S * H);
    std::copy(dtopk[size_t(r)].begin(), dtopk[size_t(r)].end(), dtopkAll.begin() + r * S * K);
    if (!weightGrads)
      continue;
    b[kDw1].copyOut(dw1.data() + r * L * H * 2 * I);
    b[kDw2].copyOut(dw2.data() + r * L * I * H);
  }
  if (local != R) {
    // Ranks in other processes: the process of rank 0 collects every
    // rank's outputs.
    comm::Fabric &fabric = context.fabric();
    const auto collect = [&](std::vector<float> &all, int64_t perRank) {
      std::vector<float> mine(all.begin() + first * perRank,
                              all.begin() + (first + local) * perRank);
      return fabric.gather(mine.data(), size_t(perRank * local) * sizeof(float), all.data());
    };
    for (const auto &[out, perRank] : {std::pair<std::vector<float> *, int64_t>{&y, S * H},
                                       {&dx, S * H},
                                       {&dtopkAll, S * K},
                                       {&dw1, L * H * 2 * I},
                                       {&dw2, L * I * H}})
      if (Status s = out->empty() ? Status::success() : collect(*out, perRank); !s)
        return s;
    if (first != 0)
      return Status::success(); // the outputs are rank 0's to report
  }
  // The tokens' outputs: TP rank 0's, which every TP rank must equal.
  const auto tokens = [&](const std::vector<float> &all, int64_t perRank, const char *name,
                          std::vector<float> *out) {
    out->assign(size_t(R / T * perRank), 0.0f);
    for (int64_t e = 0; e < R / T; ++e) {
      const float *mine = all.data() + e * T * perRank;
      for (int64_t t = 1; t < T; ++t)
        if (std::memcmp(mine, mine + t * perRank, size_t(perRank) * sizeof(float)) != 0)
          return Status::error(fmt::format(
              "{}: TP rank {} of EP rank {} (rank {}) differs from its TP rank 0 (rank {}); the "
              "TP ranks of an EP rank sum the same partials in the same order",
              name, t, e, e * T + t, e * T));
      std::copy_n(mine, perRank, out->data() + e * perRank);
    }
    return Status::success();
  };
  if (Status s = tokens(y, S * H, "y", &d->y); !s || !backward)
    return s;
  if (Status s = tokens(dx, S * H, "dx", &d->dx); !s)
    return s;
  if (Status s = tokens(dtopkAll, S * K, "dtopk_weights", &d->dtopk); !s)
    return s;
  d->dw1.clear();
  d->dw2.clear();
  if (!weightGrads)
    return Status::success();
  d->dw1.assign(size_t(d->experts * H * 2 * d->inter), 0.0f);
  d->dw2.assign(size_t(d->experts * d->inter * H), 0.0f);
  for (int64_t r = 0; r < R; ++r)
    unsliceExperts(*d, r / T * L, L, r % T, dw1.data() + r * L * H * 2 * I,
                   dw2.data() + r * L * I * H, d->dw1.data(), d->dw2.data());
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Verification
//===----------------------------------------------------------------------===//

namespace {

/// The max error of `out` against `want` (values at `index` in `out`).
OutputError compareOutput(const char *name, double tolerance, const std::vector<double> &want,
                          const std::function<float(size_t)> &out) {
  OutputError e;
  e.name = name;
  e.tolerance = tolerance;
  double scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double got = double(out(i));
    e.nonFinite += !std::isfinite(got);
    if (!std::isfinite(got) || !std::isfinite(want[i])) {
      // A NaN equals nothing; an infinity only the same infinity.
      e.mismatched += !(got == want[i]);
      continue;
    }
    e.maxAbs = std::max(e.maxAbs, std::abs(got - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  e.maxRel = scale > 0 ? e.maxAbs / scale : e.maxAbs;
  return e;
}

moec::reference::LayerShape referenceShape(const LayerData &d) {
  moec::reference::LayerShape shape;
  shape.ranks = uint32_t(d.ranks);
  shape.localExperts = uint32_t(d.experts / d.ranks);
  shape.hidden = d.hidden;
  shape.inter = d.inter;
  shape.topK = d.topK;
  shape.tokens = d.tokens;
  return shape;
}

/// Picks `count` distinct tokens of the group at random (all of them when
/// there are fewer), and for each expert they route to one random unit.
moec::reference::Sample pickSample(const LayerData &d, int64_t count, uint64_t seed) {
  moec::reference::Sample sample;
  const int64_t T = d.ranks * d.tokens;
  std::mt19937_64 rng(seed);
  if (count >= T) {
    for (int64_t g = 0; g < T; ++g)
      sample.tokens.push_back(g);
  } else {
    // Floyd's algorithm: `count` distinct values of 0..T-1.
    std::set<int64_t> chosen;
    for (int64_t j = T - count; j < T; ++j) {
      const int64_t t = std::uniform_int_distribution<int64_t>(0, j)(rng);
      chosen.insert(chosen.count(t) ? j : t);
    }
    sample.tokens.assign(chosen.begin(), chosen.end());
  }
  if (d.inter <= 0)
    return sample;
  std::set<int64_t> experts;
  for (int64_t g : sample.tokens)
    for (int64_t k = 0; k < d.topK; ++k)
      experts.insert(d.ids[size_t(g * d.topK + k)]);
  for (int64_t e : experts)
    sample.units.push_back({e, std::uniform_int_distribution<int64_t>(0, d.inter - 1)(rng)});
  return sample;
}

Status verifySample(const LayerData &d, const std::vector<float> &x, const VerifyOptions &options,
                    std::vector<OutputError> *errors, SampleSummary *summary) {
  namespace ref = moec::reference;
  const ref::LayerShape shape = referenceShape(d);
  ref::InputView<float> in;
  in.x = x.data();
  in.topkIds = d.ids.data();
  in.topkWeights = d.weights.data();
  in.w1 = d.w1.data();
  in.w2 = d.w2.data();
  in.dy = options.backward ? d.dy.data() : nullptr;
  ref::Sample sample = pickSample(d, options.sampleTokens, options.seed);
  if (!options.backward || d.dw1.empty())
    sample.units.clear(); // no weight gradients to check
  ref::SampleOutputs<double> want;
  if (Status s = ref::sampled(shape, in, sample, &want, options.progress); !s)
    return s.withPrefix("reference: ");
  if (summary) {
    summary->tokens = int64_t(sample.tokens.size());
    summary->units = int64_t(sample.units.size());
  }
  const double tolerance = options.bf16 ? 5e-2 : 1e-4;
  const int64_t H = d.hidden, K = d.topK, I = d.inter;
  const auto perToken = [&](const std::vector<float> &out, int64_t width) {
    return [&out, &sample, width](size_t i) {
      return out[size_t(sample.tokens[i / size_t(width)] * width) + i % size_t(width)];
    };
  };
  errors->push_back(compareOutput("y", tolerance, want.y, perToken(d.y, H)));
  if (!options.backward)
    return Status::success();
  errors->push_back(compareOutput("dx", tolerance, want.dx, perToken(d.dx, H)));
  errors->push_back(compareOutput("dtopk_weights", tolerance, want.dtopk, perToken(d.dtopk, K)));
  if (sample.units.empty())
    return Status::success();
  errors->push_back(compareOutput("dw1", tolerance, want.dw1, [&](size_t i) {
    const auto [e, unit] = sample.units[i / size_t(2 * H)];
    const int64_t h = int64_t(i % size_t(2 * H)) / 2, column = unit + (i % 2 ? I : 0);
    return d.dw1[size_t((e * H + h) * 2 * I + column)];
  }));
  errors->push_back(compareOutput("dw2", tolerance, want.dw2, [&](size_t i) {
    const auto [e, unit] = sample.units[i / size_t(H)];
    return d.dw2[size_t((e * I + unit) * H) + i % size_t(H)];
  }));
  return Status::success();
}

} // namespace

double verifyBytes(const rt::LayerShape &shape, bool backward) {
  const double R = shape.ranks, K = double(shape.topK), S = double(shape.rowCapacity) / std::max(1.0, K),
               E = double(shape.experts()), H = double(shape.hidden), I = double(shape.inter);
  // Copies of the inputs and the outputs, in double.
  double values = R * S * H * (backward ? 2 : 1) + 2 * R * S * K + 3 * E * H * I;
  values += R * S * H * 2; // y and its joined copy
  // Per dispatched row: X, Y, A, Z (H + 2I + I + H) and its source (3 int64).
  values += R * S * K * (2 * H + 3 * I + 3);
  if (backward) {
    values += R * S * H * 2 + R * S * K * 2 + 3 * E * H * I; // dx, dtopk (joined too), dw1, dw2
    // The largest expert's dZ, dA, dY: at most every row.
    values += R * S * K * (H + 3 * I);
  }
  return 8 * values;
}

/// x as the experts of an FP8 dispatch see it: each token's row quantized
/// (e4m3 codes, an fp32 scale per 128 values) and dequantized to the
/// compute dtype.
std::vector<float> fp8RoundTrip(const LayerData &d, bool bf16) {
  const int64_t rows = int64_t(d.x.size()) / std::max<int64_t>(1, d.hidden), H = d.hidden;
  const DType act = bf16 ? DType::BF16 : DType::F32;
  std::vector<uint8_t> codes(size_t(rows * fp8RowBytes(H)));
  cpu::quantizeRows(d.x.data(), DType::F32, H, codes.data(), fp8RowBytes(H), 0, rows, H);
  std::vector<char> back(size_t(rows * H) * dtypeSize(act));
  cpu::dequantizeRows(codes.data(), fp8RowBytes(H), back.data(), act, H, 0, rows, H);
  std::vector<float> x(size_t(rows * H));
  cpu::loadFloats(back.data(), act, x.data(), x.size());
  return x;
}

Status verifyLayer(const LayerData &d, const VerifyOptions &options,
                   std::vector<OutputError> *errors, SampleSummary *summary) {
  std::vector<float> rounded;
  if (options.fp8Dispatch)
    rounded = fp8RoundTrip(d, options.bf16);
  const std::vector<float> &x = options.fp8Dispatch ? rounded : d.x;
  if (options.sampleTokens > 0)
    return verifySample(d, x, options, errors, summary);
  namespace ref = moec::reference;
  const ref::LayerShape shape = referenceShape(d);
  const bool backward = options.backward;
  const int64_t S = d.tokens, K = d.topK, H = d.hidden;
  std::vector<ref::RankInputs<double>> inputs(size_t(d.ranks));
  std::vector<std::vector<double>> dy(size_t(d.ranks));
  for (int64_t r = 0; r < d.ranks; ++r) {
    inputs[size_t(r)].x.assign(x.begin() + r * S * H, x.begin() + (r + 1) * S * H);
    inputs[size_t(r)].topkIds.assign(d.ids.begin() + r * S * K, d.ids.begin() + (r + 1) * S * K);
    inputs[size_t(r)].topkWeights.assign(d.weights.begin() + r * S * K,
                                         d.weights.begin() + (r + 1) * S * K);
    if (backward)
      dy[size_t(r)].assign(d.dy.begin() + r * S * H, d.dy.begin() + (r + 1) * S * H);
  }
  ref::Weights<double> weights{std::vector<double>(d.w1.begin(), d.w1.end()),
                               std::vector<double>(d.w2.begin(), d.w2.end())};
  // The forward pass is about a third of the work with backward.
  const double forwardShare = backward ? 1.0 / 3 : 1.0;
  ref::Progress progress;
  if (options.progress)
    progress = [&](double done) { options.progress(done * forwardShare); };
  ref::Forward<double> fwd;
  if (Status s = ref::forward(shape, inputs, weights, &fwd, progress); !s)
    return s.withPrefix("reference: ");
  const double tolerance = options.bf16 ? 5e-2 : 1e-4;
  const auto compare = [&](const char *name, const std::vector<float> &out,
                           const std::vector<double> &want) {
    errors->push_back(compareOutput(name, tolerance, want, [&out](size_t i) { return out[i]; }));
  };
  const auto joined = [](const std::vector<std::vector<double>> &parts) {
    std::vector<double> all;
    for (const auto &p : parts)
      all.insert(all.end(), p.begin(), p.end());
    return all;
  };
  compare("y", d.y, joined(fwd.y));
  if (!backward)
    return Status::success();
  if (options.progress)
    progress = [&](double done) { options.progress(forwardShare + done * (1 - forwardShare)); };
  ref::Backward<double> bwd;
  if (Status s = ref::backward(shape, inputs, weights, fwd, dy, &bwd, progress); !s)
    return s.withPrefix("reference: ");
  compare("dx", d.dx, joined(bwd.dx));
  compare("dtopk_weights", d.dtopk, joined(bwd.dtopkWeights));
  if (!d.dw1.empty()) { // a frozen layer's backward has none
    compare("dw1", d.dw1, bwd.dw1);
    compare("dw2", d.dw2, bwd.dw2);
  }
  return Status::success();
}

} // namespace moec::tooling
