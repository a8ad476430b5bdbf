//===- Rows.cpp - Row movement: put, dispatch gather, combine -------------===//

#include "runtime/cpu/Rows.h"

#include "base/Memory.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#define MOEC_ROWS_X86 1
#include <immintrin.h>
// GCC 12 reports the undefined vectors its own AVX-512 headers start some
// intrinsics from as (maybe) uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace moec::cpu {

namespace {

/// Columns widened to fp32 at a time.
constexpr int64_t kChunk = 256;
/// Columns per block of the loops below, and partial sums of a dot
/// product. It divides kChunk, so column h of a row always adds into the
/// partial sum h % kLanes.
constexpr int64_t kLanes = 16;

/// Calls f(c) for c in [0, n): in blocks of kLanes, whose fixed trip count
/// lets the compiler put each block in vectors (at -O2 it leaves a loop of
/// unknown length scalar), then the rest one by one.
template <typename F> inline void forEachColumn(int64_t n, F f) {
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l)
      f(c + l);
  for (; c < n; ++c)
    f(c);
}

/// Copies `cols` elements from `src` to `dst`, converting the storage type.
void copyRow(const void *src, Elt srcElt, void *dst, Elt dstElt, int64_t cols) {
  if (srcElt == dstElt) {
    std::memcpy(dst, src, size_t(cols) * dtypeSize(srcElt));
    return;
  }
  float buffer[kChunk];
  for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
    const int64_t n = std::min(kChunk, cols - c0);
    loadFloats(static_cast<const char *>(src) + c0 * int64_t(dtypeSize(srcElt)), srcElt, buffer,
               size_t(n));
    storeFloats(buffer, static_cast<char *>(dst) + c0 * int64_t(dtypeSize(dstElt)), dstElt,
                size_t(n));
  }
}

/// Loads `n` columns from c0 of row `row` of z into `out` as fp32: the sum,
/// in block order, of its `parts` partial rows `partStride` rows apart.
void loadRow(ConstMatrix z, int64_t row, int64_t c0, int64_t n, int64_t parts, int64_t partStride,
             float *out) {
  loadFloats(z.address(row, c0), z.elt, out, size_t(n));
  float part[kChunk];
  for (int64_t p = 1; p < parts; ++p) {
    loadFloats(z.address(row + p * partStride, c0), z.elt, part, size_t(n));
    forEachColumn(n, [&](int64_t c) { out[c] += part[c]; });
  }
}

} // namespace

#ifdef MOEC_ROWS_X86

namespace {

#define MOEC_ROWS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

/// dst[0, cols) = src[0, cols) (times *weight where not null), both of type
/// `elt`, the math and rounding of gatherTokenRows' loop below (a product
/// in fp32, rounded once to bf16), with non-temporal stores: dst is a line-
/// aligned row of the rows a rank sends, which a put reads next, not this
/// core, so its lines need not come from memory before they are written.
MOEC_ROWS_AVX512 void streamRow(const void *src, void *dst, Elt elt, int64_t cols,
                                const float *weight) {
  char *out = static_cast<char *>(dst);
  const char *in = static_cast<const char *>(src);
  if (!weight) {
    streamCopy(out, in, size_t(cols) * dtypeSize(elt));
    return;
  }
  const int64_t perLine = elt == Elt::BF16 ? 32 : 16;
  int64_t c = 0;
  const __m512 w = _mm512_set1_ps(*weight);
  if (elt == Elt::BF16) {
    const uint16_t *from = reinterpret_cast<const uint16_t *>(in);
    for (; c + perLine <= cols; c += perLine) {
      const __m512 lo = loadFloats16(from + c, elt), hi = loadFloats16(from + c + 16, elt);
      const __m256i l = _mm512_cvtepi32_epi16(bf16Bits16(_mm512_mul_ps(lo, w)));
      const __m256i h = _mm512_cvtepi32_epi16(bf16Bits16(_mm512_mul_ps(hi, w)));
      _mm512_stream_si512(reinterpret_cast<__m512i *>(out + c * 2),
                          _mm512_inserti64x4(_mm512_castsi256_si512(l), h, 1));
    }
  } else {
    const float *from = reinterpret_cast<const float *>(in);
    for (; c + perLine <= cols; c += perLine)
      _mm512_stream_ps(reinterpret_cast<float *>(out) + c,
                       _mm512_mul_ps(_mm512_loadu_ps(from + c), w));
  }
  // The last partial line, as the loop below makes it.
  for (; c < cols; ++c)
    storeFloat(dst, elt, c, loadFloat(src, elt, c) * *weight);
}

/// combineRows' sums of one token over columns [c0, c0 + 16 * vectors), in
/// vectors, the same products and adds in the same order (a multiply, then
/// an add: no fused multiply-add, as the scalar loop's).
/// (fp-contract off: GCC would fuse the multiply and the add otherwise.)
MOEC_ROWS_AVX512 __attribute__((optimize("fp-contract=off"))) void
combineToken16(ConstMatrix z, const int64_t *position, const float *weights, int64_t t,
               int64_t topK, Matrix y, int64_t c0, int64_t vectors) {
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t c = c0 + 16 * v;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < topK; ++k) {
      const int64_t id = t * topK + k;
      const __m512 w = _mm512_set1_ps(weights ? weights[id] : 1.0f);
      sum = _mm512_add_ps(sum, _mm512_mul_ps(w, loadFloats16(z.address(position[id], c), z.elt)));
    }
    storeFloats16(y.address(t, c), y.elt, sum);
  }
}

/// combineWeightGrad's 16 partial sums of one row over columns [0, 16 *
/// vectors): column c into lane c % 16, in column order, each a multiply
/// then an add, as the scalar loop's.
MOEC_ROWS_AVX512 __attribute__((optimize("fp-contract=off"))) void
weightGradLanes16(const void *dy, Elt dyElt, const void *z, Elt zElt, int64_t vectors,
                  float *lanes) {
  const char *g = static_cast<const char *>(dy), *r = static_cast<const char *>(z);
  const int64_t gStep = 16 * int64_t(dtypeSize(dyElt)), rStep = 16 * int64_t(dtypeSize(zElt));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t v = 0; v < vectors; ++v)
    sum = _mm512_add_ps(
        sum, _mm512_mul_ps(loadFloats16(g + v * gStep, dyElt), loadFloats16(r + v * rStep, zElt)));
  _mm512_storeu_ps(lanes, sum);
}

} // namespace

#endif // MOEC_ROWS_X86

void gatherTokenRows(ConstMatrix src, const int64_t *rowIds, int64_t topK, const float *weights,
                     Matrix dst, int64_t rows, int64_t cols) {
  if (cols <= 0)
    return;
  float buffer[kChunk];
  // Two rows ahead: a row takes about as long to copy as memory takes to
  // answer.
  constexpr int64_t kAhead = 2;
  const int64_t rowBytes = cols * int64_t(dtypeSize(src.elt));
#ifdef MOEC_ROWS_X86
  // Rows streamed past the caches where they are whole lines (streamRow).
  const bool stream = cpuHasAvx512() && src.elt == dst.elt &&
                      (reinterpret_cast<uintptr_t>(dst.data) & 63) == 0 &&
                      (dst.ld * int64_t(dtypeSize(dst.elt))) % 64 == 0;
#endif
  for (int64_t i = 0; i < std::min(rows, kAhead); ++i)
    prefetchBytes(src.address(rowIds[i] / topK, 0), rowBytes);
  for (int64_t i = 0; i < rows; ++i) {
    if (i + kAhead < rows)
      prefetchBytes(src.address(rowIds[i + kAhead] / topK, 0), rowBytes);
    const int64_t id = rowIds[i];
    const void *from = src.address(id / topK, 0);
#ifdef MOEC_ROWS_X86
    if (stream) {
      streamRow(from, dst.address(i, 0), dst.elt, cols, weights ? weights + id : nullptr);
      continue;
    }
#endif
    if (!weights) {
      copyRow(from, src.elt, dst.address(i, 0), dst.elt, cols);
      continue;
    }
    const float w = weights[id];
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      loadFloats(src.address(id / topK, c0), src.elt, buffer, size_t(n));
      forEachColumn(n, [&](int64_t c) { buffer[c] *= w; });
      storeFloats(buffer, dst.address(i, c0), dst.elt, size_t(n));
    }
  }
#ifdef MOEC_ROWS_X86
  // The streamed stores are ordered before whatever tells a put to read
  // them.
  if (stream)
    streamFence();
#endif
}

void combineRows(ConstMatrix z, const int64_t *position, const float *weights, int64_t topK,
                 Matrix y, Range tokens, Range cols, int64_t parts, int64_t partStride) {
  float sum[kChunk], row[kChunk];
  const int64_t elt = int64_t(dtypeSize(z.elt));
#ifdef MOEC_ROWS_X86
  // Whole vectors of 16 columns on AVX-512 (a row's parts summed first, as
  // loadRow does, stay on the loop below).
  const int64_t whole = parts == 1 && cpuHasAvx512() ? cols.size() / kLanes : 0;
#else
  const int64_t whole = 0;
#endif
  for (int64_t t = tokens.begin; t < tokens.end; ++t) {
#ifdef MOEC_ROWS_X86
    if (whole)
      combineToken16(z, position, weights, t, topK, y, cols.begin, whole);
#endif
    for (int64_t c0 = cols.begin + kLanes * whole; c0 < cols.end; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols.end - c0);
      // The next token's rows, a chunk at a time, a token ahead.
      if (t + 1 < tokens.end)
        for (int64_t k = 0; k < topK; ++k)
          prefetchBytes(z.address(position[(t + 1) * topK + k], c0), n * elt);
      std::fill(sum, sum + n, 0.0f);
      for (int64_t k = 0; k < topK; ++k) {
        const int64_t id = t * topK + k;
        const float w = weights ? weights[id] : 1.0f;
        loadRow(z, position[id], c0, n, parts, partStride, row);
        forEachColumn(n, [&](int64_t c) { sum[c] += w * row[c]; });
      }
      storeFloats(sum, y.address(t, c0), y.elt, size_t(n));
    }
  }
}

void combineWeightGrad(ConstMatrix dy, ConstMatrix z, const int64_t *position, int64_t topK,
                       Range tokens, int64_t cols, float *dweights, int64_t parts,
                       int64_t partStride) {
  float grad[kChunk], row[kChunk];
  const int64_t rowBytes = cols * int64_t(dtypeSize(z.elt));
  for (int64_t t = tokens.begin; t < tokens.end; ++t) {
    for (int64_t k = 0; k < topK; ++k) {
      const int64_t id = t * topK + k;
      // The next routed row, whole, while this one is summed.
      if (id + 1 < tokens.end * topK)
        prefetchBytes(z.address(position[id + 1], 0), rowBytes);
      // Column c adds into lane c % kLanes, in column order; the lanes are
      // then summed pairwise. A fixed order (the same bits on every thread
      // count), and independent lanes the compiler keeps in vectors: one
      // running sum would chain every add on the one before.
      float lanes[kLanes] = {};
      int64_t start = 0;
#ifdef MOEC_ROWS_X86
      if (parts == 1 && cpuHasAvx512()) { // whole vectors of 16 columns
        start = cols / kLanes * kLanes;
        weightGradLanes16(dy.address(t, 0), dy.elt, z.address(position[id], 0), z.elt,
                          cols / kLanes, lanes);
      }
#endif
      for (int64_t c0 = start; c0 < cols; c0 += kChunk) {
        const int64_t n = std::min(kChunk, cols - c0);
        loadFloats(dy.address(t, c0), dy.elt, grad, size_t(n));
        loadRow(z, position[id], c0, n, parts, partStride, row);
        int64_t c = 0;
        for (; c + kLanes <= n; c += kLanes)
          for (int64_t l = 0; l < kLanes; ++l)
            lanes[l] += grad[c + l] * row[c + l];
        for (int64_t l = 0; c + l < n; ++l)
          lanes[l] += grad[c + l] * row[c + l];
      }
      for (int64_t width = kLanes / 2; width > 0; width /= 2)
        for (int64_t l = 0; l < width; ++l)
          lanes[l] += lanes[l + width];
      dweights[id] = lanes[0];
    }
  }
}

} // namespace moec::cpu
