//===- LayerRun.cpp - A whole layer bound to a context and run ------------===//
//
// See LayerRun.h: LayerRun (the inputs in the binary's storage types, bound
// to every local rank of a context, run forward and backward, the outputs
// read back) and roundWeightsToFormat.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/LayerRun.h"

#include "format/TaskBinary.h"
#include "runtime/comm/Fabric.h"
#include "runtime/cpu/Element.h"
#include "runtime/cpu/Fp8.h"
#include "runtime/cpu/Quant.h"
#include "runtime/tooling/Parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

namespace moec::tooling {

using format::DType;

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

void LayerRun::place(Buffer &b) {
  if (!memory || b.size() == 0 || !failure.empty())
    return;
  if (!b.placed) {
    void *at = nullptr;
    if (std::string e = memory->allocate(b.size(), &at); !e.empty()) {
      failure = e;
      return;
    }
    TensorMemory *owner = memory;
    b.placed = std::shared_ptr<void>(at, [owner](void *p) { owner->release(p); });
  }
  if (std::string e = memory->copy(b.placed.get(), b.host(), b.size()); !e.empty())
    failure = e;
}

void LayerRun::fetch(Buffer &b) {
  if (!b.placed || !failure.empty())
    return;
  if (std::string e = memory->copy(b.host(), b.placed.get(), b.size()); !e.empty())
    failure = e;
}

void LayerRun::Buffer::copyOut(float *out) const {
  if (dtype == DType::BF16)
    cpu::bf16ToFloat(bf16.data(), out, bf16.size());
  else
    std::copy(f32.begin(), f32.end(), out);
}

namespace {
enum Slot {
  kX,
  kY,
  kW1,
  kW2,
  kDy,
  kDx,
  kDw1,
  kDw2,
  kW1Scale,
  kW2Scale,
  kDtopk,
  kLora, ///< the LoRA tensors: A, B of w1's adapter, of w2's, then their gradients
  kSlotsPerRank = kLora + 8
};

/// The slot of a LoRA tensor.
int loraSlot(const LoraTensor &t) { return kLora + (t.grad ? 4 : 0) + 2 * t.p + (t.b ? 1 : 0); }

/// Where TP slice `t` of `T` lies in one expert's matrix: `run(full, part,
/// n)` for each run of n values, at offset `full` in the matrix and `part`
/// in the slice. `gateUp`: a [other, 2I] matrix whose columns are I gate
/// values then I up values (w1, B of w1's adapter), whose slice is its gate
/// columns then its up columns, [other, 2I / T]. Otherwise an [I, other]
/// matrix (w2, A of w2's adapter), whose slice is its rows [t I / T,
/// (t + 1) I / T).
template <class Run>
void tpSliceRuns(bool gateUp, int64_t other, int64_t I, int64_t T, int64_t t, Run run) {
  const int64_t Is = I / T;
  if (!gateUp)
    return run(t * Is * other, int64_t(0), Is * other);
  for (int64_t h = 0; h < other; ++h)
    for (int64_t half = 0; half < 2; ++half)
      run(h * 2 * I + half * I + t * Is, h * 2 * Is + half * Is, Is);
}

/// TP slice `t` of experts [first, first + count) of `d`'s w1 and w2 into
/// w1 [count, H, 2I/T], w2 [count, I/T, H].
void sliceExperts(const LayerData &d, int64_t first, int64_t count, int64_t t, float *w1,
                  float *w2) {
  const int64_t H = d.hidden, I = d.inter, Is = I / d.tp;
  for (int64_t l = 0; l < count; ++l) {
    const float *from1 = d.w1.data() + (first + l) * H * 2 * I;
    const float *from2 = d.w2.data() + (first + l) * I * H;
    float *to1 = w1 + l * H * 2 * Is, *to2 = w2 + l * Is * H;
    tpSliceRuns(true, H, I, d.tp, t,
                [&](int64_t f, int64_t q, int64_t n) { std::copy_n(from1 + f, n, to1 + q); });
    tpSliceRuns(false, H, I, d.tp, t,
                [&](int64_t f, int64_t q, int64_t n) { std::copy_n(from2 + f, n, to2 + q); });
  }
}

/// The inverse of sliceExperts for gradients: writes TP slice `t` of
/// experts [first, first + count) into full dw1 [E, H, 2I], dw2 [E, I, H].
void unsliceExperts(const LayerData &d, int64_t first, int64_t count, int64_t t,
                    const float *dw1, const float *dw2, float *full1, float *full2) {
  const int64_t H = d.hidden, I = d.inter, Is = I / d.tp;
  for (int64_t l = 0; l < count; ++l) {
    const float *from1 = dw1 + l * H * 2 * Is, *from2 = dw2 + l * Is * H;
    float *to1 = full1 + (first + l) * H * 2 * I, *to2 = full2 + (first + l) * I * H;
    tpSliceRuns(true, H, I, d.tp, t,
                [&](int64_t f, int64_t q, int64_t n) { std::copy_n(from1 + q, n, to1 + f); });
    tpSliceRuns(false, H, I, d.tp, t,
                [&](int64_t f, int64_t q, int64_t n) { std::copy_n(from2 + q, n, to2 + f); });
  }
}

/// A LoRA tensor's values of experts [first, first + count) as TP slice `t`
/// holds them (LoraTensor::sliced: its slice; else all of them), from
/// `full` [E, ...] into `part`.
void loraPart(const LoraTensor &lora, const LayerData &d, int64_t first, int64_t count, int64_t t,
              const float *full, float *part) {
  const int64_t n = lora.perExpert(d), m = lora.perExpertOnRank(d), r = d.loraRank;
  for (int64_t l = 0; l < count; ++l) {
    const float *f = full + (first + l) * n;
    float *q = part + l * m;
    if (!lora.sliced())
      std::copy_n(f, n, q);
    else
      tpSliceRuns(lora.b, r, d.inter, d.tp, t,
                  [&](int64_t fo, int64_t qo, int64_t k) { std::copy_n(f + fo, k, q + qo); });
  }
}

/// The inverse of loraPart for gradients: a slice written to its place in
/// `full`, a whole tensor's partial sum added to it.
void addLoraPart(const LoraTensor &lora, const LayerData &d, int64_t first, int64_t count,
                 int64_t t, const float *part, float *full) {
  const int64_t n = lora.perExpert(d), m = lora.perExpertOnRank(d), r = d.loraRank;
  for (int64_t l = 0; l < count; ++l) {
    float *f = full + (first + l) * n;
    const float *q = part + l * m;
    if (!lora.sliced())
      for (int64_t i = 0; i < n; ++i)
        f[i] += q[i];
    else
      tpSliceRuns(lora.b, r, d.inter, d.tp, t,
                  [&](int64_t fo, int64_t qo, int64_t k) { std::copy_n(q + qo, k, f + fo); });
  }
}

/// dst [cols, rows] = src [rows, cols] transposed, in blocks that stay in
/// the cache.
void transposeInto(const float *src, int64_t rows, int64_t cols, float *dst) {
  constexpr int64_t kBlock = 64;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock)
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock)
      for (int64_t i = i0; i < std::min(rows, i0 + kBlock); ++i)
        for (int64_t j = j0; j < std::min(cols, j0 + kBlock); ++j)
          dst[j * rows + i] = src[i * cols + j];
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
  if (transposed)
    transposeInto(m, rows, cols, stored.data());
  else
    std::copy_n(m, rows * cols, stored.data());
  cpu::quantize(q, stored.data(), q.cols, codes, scales);
  if (!round)
    return;
  q.codes = codes;
  q.scales = scales;
  cpu::dequantize(q, 0, q.rows, 0, q.cols, stored.data(), DType::F32, q.cols);
  if (transposed)
    transposeInto(stored.data(), cols, rows, m);
  else
    std::copy_n(stored.data(), rows * cols, m);
}

/// The product of `dims`.
int64_t count(const std::vector<int64_t> &dims) {
  int64_t n = 1;
  for (int64_t d : dims)
    n *= d;
  return n;
}

/// One expert's matrix as stored ([rows, cols]: its codes, and its scales,
/// each covering `rowsPer` x `colsPer` of it, `unit` floats a scale), the
/// part of it a TP rank holds: `rowRanges` of its rows ([begin, end) each,
/// in order) and `colRange` of its columns.
struct StoredPart {
  int64_t rows, cols;
  double codeBytes; ///< a value's bytes (0.5: int4, two a byte)
  int64_t rowsPer, colsPer, unit;
  std::vector<std::pair<int64_t, int64_t>> rowRanges;
  std::pair<int64_t, int64_t> colRange;

  /// The scales' grid.
  int64_t scaleRows() const { return (rows + rowsPer - 1) / rowsPer; }
  int64_t scaleCols() const { return (cols + colsPer - 1) / colsPer; }
  /// Copies the part of `codes` and `scales` (the whole matrix's) to
  /// `codesOut` and `scalesOut`, row by row.
  void copy(const uint8_t *codes, const float *scales, uint8_t *codesOut, float *scalesOut) const {
    const int64_t rowBytes = int64_t(double(cols) * codeBytes);
    const int64_t c0 = int64_t(double(colRange.first) * codeBytes),
                  c1 = int64_t(double(colRange.second) * codeBytes);
    for (const auto &[r0, r1] : rowRanges)
      for (int64_t r = r0; r < r1; ++r, codesOut += c1 - c0)
        std::memcpy(codesOut, codes + r * rowBytes + c0, size_t(c1 - c0));
    // A scale covering the whole row (int8's) is kept whole.
    const int64_t s0 = colRange.first / colsPer, s1 = (colRange.second + colsPer - 1) / colsPer;
    for (const auto &[r0, r1] : rowRanges)
      for (int64_t r = r0 / rowsPer; r < (r1 + rowsPer - 1) / rowsPer;
           ++r, scalesOut += (s1 - s0) * unit)
        std::copy_n(scales + (r * scaleCols() + s0) * unit, (s1 - s0) * unit, scalesOut);
  }
};

/// Each of `count` row-major [rows, cols] matrices at `m`, transposed in
/// place to [cols, rows] (a binary that stores its weights transposed).
void transposeEach(float *m, int64_t count, int64_t rows, int64_t cols) {
  forEachOnThreads(count, [&](int64_t l) {
    float *at = m + l * rows * cols;
    const std::vector<float> one(at, at + rows * cols);
    transposeInto(one.data(), rows, cols, at);
  });
}
} // namespace

StoredWeights storedWeights(const rt::LayerShape &shape, const LayerData &d, int64_t rank) {
  const int64_t H = d.hidden, I = shape.inter, L = shape.localExperts, T = d.tp;
  StoredWeights out;
  out.dtype = shape.weightDType();
  const std::array<int64_t, 3> w1Dims = shape.w1Dims(), w2Dims = shape.w2Dims();
  out.w1Dims = shape.storedDims(w1Dims);
  out.w2Dims = shape.storedDims(w2Dims);
  std::vector<float> w1(size_t(L * H * 2 * I)), w2(size_t(L * I * H));
  sliceExperts(d, rank / T * L, L, rank % T, w1.data(), w2.data());
  if (shape.weightFormat == WeightFormat::Dense) {
    if (shape.weightsTransposed) { // w1 [L, 2I, H], w2 [L, H, I]
      transposeEach(w1.data(), L, H, 2 * I);
      transposeEach(w2.data(), L, I, H);
    }
    for (auto [from, to] : {std::pair{&w1, &out.w1}, std::pair{&w2, &out.w2}}) {
      to->resize(from->size() * dtypeSize(out.dtype));
      cpu::storeFloats(from->data(), to->data(), out.dtype, from->size());
    }
    return out;
  }
  // Codes and scales of each expert's matrix as stored.
  out.w1ScaleDims = shape.scaleDims(w1Dims);
  out.w2ScaleDims = shape.scaleDims(w2Dims);
  if (T > 1) {
    // Each expert quantized whole, as a checkpoint stores it, then the TP
    // rank's slice of its codes and scales: w1's gate and up rows, w2's
    // columns ([out, in] as the format stores them).
    const int64_t t = rank % T, Is = I, Iw = I * T;
    const double value = shape.weightFormat == WeightFormat::Int4Group ? 0.5 : 1.0;
    const auto part = [&](int64_t rows, int64_t cols) {
      StoredPart p{rows, cols, value, 1, cols, 1, {}, {0, cols}};
      if (shape.weightFormat == WeightFormat::Fp8Block128)
        p.rowsPer = p.colsPer = 128;
      else if (shape.weightFormat == WeightFormat::Int4Group) {
        p.colsPer = shape.weightGroup;
        p.unit = shape.weightZeroPoints ? 2 : 1;
      }
      return p;
    };
    StoredPart w1Part = part(2 * Iw, H), w2Part = part(H, Iw);
    w1Part.rowRanges = {{t * Is, (t + 1) * Is}, {Iw + t * Is, Iw + (t + 1) * Is}};
    w2Part.rowRanges = {{0, H}};
    w2Part.colRange = {t * Is, (t + 1) * Is};
    const int64_t first = rank / T * L;
    for (const auto &[full, p, codes, scales, dims, rows, cols] :
         {std::tuple{&d.w1, &w1Part, &out.w1, &out.w1Scale, w1Dims, H, 2 * Iw},
          std::tuple{&d.w2, &w2Part, &out.w2, &out.w2Scale, w2Dims, Iw, H}}) {
      const int64_t codeBytes = count(shape.storedDims(dims)) / L,
                    scaleCount = count(shape.scaleDims(dims)) / L;
      const int64_t wholeBytes = int64_t(double(rows * cols) * p->codeBytes),
                    wholeScales = p->scaleRows() * p->scaleCols() * p->unit;
      codes->assign(size_t(L * codeBytes), 0);
      scales->assign(size_t(L * scaleCount), 0.0f);
      forEachOnThreads(L, [&, full = full, p = p, codes = codes, scales = scales, rows = rows,
                           cols = cols](int64_t l) {
        std::vector<float> m(full->begin() + (first + l) * rows * cols,
                             full->begin() + (first + l + 1) * rows * cols);
        std::vector<uint8_t> wholeCodes(static_cast<size_t>(wholeBytes));
        std::vector<float> whole(static_cast<size_t>(wholeScales));
        quantizeStored(shape, m.data(), rows, cols, true, wholeCodes.data(), whole.data(), false);
        p->copy(wholeCodes.data(), whole.data(), codes->data() + l * codeBytes,
                scales->data() + l * scaleCount);
      });
    }
    return out;
  }
  for (const auto &[w, codes, scales, dims, rows, cols] :
       {std::tuple{&w1, &out.w1, &out.w1Scale, w1Dims, H, 2 * I},
        std::tuple{&w2, &out.w2, &out.w2Scale, w2Dims, I, H}}) {
    const int64_t codeBytes = count(shape.storedDims(dims)) / L,
                  scaleCount = count(shape.scaleDims(dims)) / L;
    codes->assign(size_t(L * codeBytes), 0);
    scales->assign(size_t(L * scaleCount), 0.0f);
    forEachOnThreads(L, [&, w = w, codes = codes, scales = scales, rows = rows,
                         cols = cols](int64_t l) {
      quantizeStored(shape, w->data() + l * rows * cols, rows, cols, shape.weightsTransposed,
                     codes->data() + l * codeBytes, scales->data() + l * scaleCount, false);
    });
  }
  return out;
}

Status roundWeightsToFormat(const rt::LayerShape &shape, LayerData *d) {
  if (shape.weightFormat == WeightFormat::Dense)
    return Status::success();
  // Whole experts, as a checkpoint stores them: the TP ranks slice their
  // codes and scales (storedWeights).
  const int64_t H = d->hidden, I = d->inter;
  for (const auto &[w, rows, cols] : {std::tuple{&d->w1, H, 2 * I}, std::tuple{&d->w2, I, H}}) {
    const int64_t E = int64_t(w->size()) / std::max<int64_t>(rows * cols, 1);
    const std::array<int64_t, 3> one =
        shape.weightsTransposed ? std::array<int64_t, 3>{1, cols, rows}
                                : std::array<int64_t, 3>{1, rows, cols};
    const size_t codeBytes = size_t(count(shape.storedDims(one))),
                 scaleCount = size_t(count(shape.scaleDims(one)));
    forEachOnThreads(E, [&, w = w, rows = rows, cols = cols](int64_t e) {
      std::vector<uint8_t> codes(codeBytes);
      std::vector<float> scales(scaleCount);
      quantizeStored(shape, w->data() + e * rows * cols, rows, cols, shape.weightsTransposed,
                     codes.data(), scales.data(), true);
    });
  }
  return Status::success();
}

Status LayerRun::bind(rt::Context &context, const LayerData &d) {
  const rt::LayerShape &shape = context.shape();
  if (d.loraTargets != shape.loraTargets ||
      (shape.loraTargets && (d.loraRank != shape.loraRank || d.loraScale != shape.loraScaling)))
    return Status::error(fmt::format(
        "the inputs have LoRA adapters on {} of rank {} (scale {}); the binary on {} of rank {} "
        "(scale {})",
        d.loraTargets, d.loraRank, d.loraScale, shape.loraTargets, shape.loraRank,
        shape.loraScaling));
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
  const bool backward = context.backwardShape() != nullptr;
  if (backward && d.dy.size() != size_t(d.ranks * S * H))
    return Status::error(fmt::format("dy holds {} values; the backward pass needs {} ({} x {} x {})",
                                     d.dy.size(), d.ranks * S * H, d.ranks, S, H));
  const size_t ranks = size_t(context.ranks());
  buffers.assign(ranks * kSlotsPerRank, Buffer());
  failure.clear();
  ids.assign(ranks, {});
  weights.assign(ranks, {});
  const int64_t first = context.firstLocalRank(), last = first + context.localRanks();
  for (int64_t r = first; r < last; ++r) {
    Buffer *b = &buffers[size_t(r) * kSlotsPerRank];
    // A tensor's memory, bound: with a TensorMemory, its copy there.
    const auto at = [&](Buffer &buffer) {
      place(buffer);
      return buffer.data();
    };
    const size_t tokensH = size_t(S * H), w1n = size_t(L * H * 2 * I), w2n = size_t(L * I * H);
    const int64_t e = r / T;
    b[kX].assign(d.x.data() + e * S * H, tokensH, act);
    b[kY].zeros(tokensH, act);
    StoredWeights stored = storedWeights(shape, d, r);
    b[kW1].dtype = b[kW2].dtype = stored.dtype;
    b[kW1].bytes = std::move(stored.w1);
    b[kW2].bytes = std::move(stored.w2);
    b[kW1Scale].dtype = b[kW2Scale].dtype = DType::F32;
    b[kW1Scale].f32 = std::move(stored.w1Scale);
    b[kW2Scale].f32 = std::move(stored.w2Scale);
    ids[size_t(r)].assign(d.ids.begin() + e * S * K, d.ids.begin() + (e + 1) * S * K);
    weights[size_t(r)].assign(d.weights.begin() + e * S * K, d.weights.begin() + (e + 1) * S * K);
    const uint32_t rank = uint32_t(r);
    if (Status s = context.setRouting(rank, rt::makeTensor(ids[size_t(r)].data(), DType::I64, {S, K}),
                                      rt::makeTensor(weights[size_t(r)].data(), DType::F32, {S, K}));
        !s)
      return s;
    std::vector<std::pair<std::string, rt::Tensor>> tensors = {
        {"x", rt::makeTensor(at(b[kX]), act, {S, H})},
        {"y", rt::makeTensor(at(b[kY]), act, {S, H})},
        {"w1", rt::makeTensor(at(b[kW1]), b[kW1].dtype, stored.w1Dims)},
        {"w2", rt::makeTensor(at(b[kW2]), b[kW2].dtype, stored.w2Dims)},
    };
    if (shape.weightFormat != WeightFormat::Dense) {
      tensors.push_back(
          {"w1_scale", rt::makeTensor(at(b[kW1Scale]), DType::F32, stored.w1ScaleDims)});
      tensors.push_back(
          {"w2_scale", rt::makeTensor(at(b[kW2Scale]), DType::F32, stored.w2ScaleDims)});
    }
    // The adapters of this rank's experts (global experts e * L .. e * L + L - 1).
    // With TP, this TP rank's part of them (LoraTensor::sliced).
    const auto bindLora = [&](const LoraTensor &t, DType type) {
      std::vector<int64_t> dims = t.dims(d);
      dims[0] = L;
      if (t.sliced())
        dims[t.b ? 2 : 1] /= T;
      const size_t count = size_t(L * t.perExpertOnRank(d));
      Buffer &buffer = b[loraSlot(t)];
      if (t.grad) {
        buffer.zeros(count, type);
      } else {
        std::vector<float> part(count);
        loraPart(t, d, e * L, L, r % T, t.of(d).data(), part.data());
        buffer.assign(part.data(), count, type);
      }
      tensors.push_back({t.name(), rt::makeTensor(at(buffer), type, dims)});
    };
    for (const LoraTensor &t : loraTensors(shape.loraTargets, false))
      bindLora(t, act);
    if (backward) {
      // The weight-gradient dtype is the backward binary's; a context
      // without one refuses these bindings, which is the error to report.
      const rt::LayerShape *bs = context.backwardShape();
      const DType grad = bs ? bs->weightGrads : act;
      b[kDy].assign(d.dy.data() + e * S * H, tokensH, act);
      b[kDx].zeros(tokensH, act);
      b[kDtopk].zeros(size_t(S * K), DType::F32);
      tensors.insert(tensors.end(),
                     {{"dy", rt::makeTensor(at(b[kDy]), act, {S, H})},
                      {"dx", rt::makeTensor(at(b[kDx]), act, {S, H})},
                      {"dtopk_weights", rt::makeTensor(at(b[kDtopk]), DType::F32, {S, K})}});
      for (const LoraTensor &t : loraTensors(bs ? bs->loraTargets : 0, true))
        bindLora(t, grad);
      if (!(bs && bs->frozen)) {
        b[kDw1].zeros(w1n, grad);
        b[kDw2].zeros(w2n, grad);
        tensors.insert(tensors.end(), {{"dw1", rt::makeTensor(at(b[kDw1]), grad, {L, H, 2 * I})},
                                       {"dw2", rt::makeTensor(at(b[kDw2]), grad, {L, I, H})}});
      }
    }
    if (!failure.empty())
      return Status::error(fmt::format("rank {}: the layer's tensors: {}", r, failure));
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
         ++r) {
      Buffer *b = &buffers[size_t(r) * kSlotsPerRank];
      for (Slot slot : {kDw1, kDw2})
        b[slot].clear(), place(b[slot]);
      for (const LoraTensor &t : loraTensors(3, true))
        b[loraSlot(t)].clear(), place(b[loraSlot(t)]);
    }
    if (!failure.empty())
      return Status::error("the weight gradients' tensors: " + failure);
    if (Status s = context.backward(); !s)
      return s;
  }
  // Per rank first (R = P x T ranks, a rank's slice I / T wide), then put
  // together per EP rank.
  const int64_t R = context.ranks(), T = d->tp, S = d->tokens, K = d->topK, H = d->hidden,
                I = context.shape().inter;
  const int64_t L = context.shape().localExperts;
  const bool weightGrads = backward && !context.backwardShape()->frozen;
  // The LoRA adapters' gradients, per rank [L, K, r] or [L, r, N], each TP
  // rank's part (LoraTensor::sliced): rank r's experts are r / T * L ..
  // r / T * L + L - 1.
  const std::vector<LoraTensor> loraGrads =
      loraTensors(backward ? context.backwardShape()->loraTargets : 0, true);
  std::vector<std::vector<float>> loraAll(loraGrads.size());
  std::vector<int64_t> loraPerRank(loraGrads.size());
  for (size_t i = 0; i < loraGrads.size(); ++i) {
    loraPerRank[i] = L * loraGrads[i].perExpertOnRank(*d);
    loraAll[i].resize(size_t(R * loraPerRank[i]));
  }
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
    Buffer *b = &buffers[size_t(r) * kSlotsPerRank];
    for (int slot = 0; slot < kSlotsPerRank; ++slot)
      if (slot == kY || slot == kDx || slot == kDtopk || slot == kDw1 || slot == kDw2 ||
          slot >= kLora + 4)
        fetch(b[slot]);
    if (!failure.empty())
      return Status::error(fmt::format("rank {}: the layer's outputs: {}", r, failure));
    b[kY].copyOut(y.data() + r * S * H);
    if (!backward)
      continue;
    b[kDx].copyOut(dx.data() + r * S * H);
    b[kDtopk].copyOut(dtopkAll.data() + r * S * K);
    for (size_t i = 0; i < loraGrads.size(); ++i)
      b[loraSlot(loraGrads[i])].copyOut(loraAll[i].data() + r * loraPerRank[i]);
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
    for (size_t i = 0; i < loraGrads.size(); ++i)
      if (Status s = collect(loraAll[i], loraPerRank[i]); !s)
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
  d->dLoraA = {};
  d->dLoraB = {};
  // The TP ranks' parts put together: slices in their places, the partial
  // sums of whole tensors added in TP rank order.
  for (size_t i = 0; i < loraGrads.size(); ++i) {
    std::vector<float> &full = loraGrads[i].of(*d);
    full.assign(size_t(d->experts * loraGrads[i].perExpert(*d)), 0.0f);
    for (int64_t r = 0; r < R; ++r)
      addLoraPart(loraGrads[i], *d, r / T * L, L, r % T, loraAll[i].data() + r * loraPerRank[i],
                  full.data());
  }
  if (!weightGrads)
    return Status::success();
  d->dw1.assign(size_t(d->experts * H * 2 * d->inter), 0.0f);
  d->dw2.assign(size_t(d->experts * d->inter * H), 0.0f);
  for (int64_t r = 0; r < R; ++r)
    unsliceExperts(*d, r / T * L, L, r % T, dw1.data() + r * L * H * 2 * I,
                   dw2.data() + r * L * I * H, d->dw1.data(), d->dw2.data());
  return Status::success();
}

} // namespace moec::tooling
