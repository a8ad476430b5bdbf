//===- Tile.cpp - moec's own AVX-512 GEMM tile ----------------------------===//

#include "runtime/cpu/Tile.h"

#include "runtime/cpu/TilePack.h"

#include "base/Env.h"
#include "base/Memory.h"
#include "runtime/cpu/Element.h"
#include "runtime/cpu/Peak.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#if defined(__x86_64__) || defined(__i386__)
#define MOEC_TILE_X86 1
#include <immintrin.h>
// GCC 12 reports the undefined vectors its own AVX-512 headers start some
// intrinsics from (_mm512_undefined_*) as (maybe) uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#endif

namespace moec::cpu::tile {

using namespace detail;

namespace {

/// Rows of C per micro-kernel call.
constexpr int kRows = 8;

/// Rows of op(A) per panel when it is packed (`transA`): one 16-lane vector
/// of a unit, two row blocks of the micro-kernel.
constexpr int64_t kAPanel = 16;

/// m rounded up to whole panels of packed op(A).
int64_t packedARowUnits(int64_t m) { return ceilDiv(m, kAPanel) * kAPanel; }

/// Rows of A and rows of B (columns of C) of one block of the dot form:
/// 16 accumulators, one per element of a 4 x 4 block of C.
constexpr int kDotRows = 4;
constexpr int kDotCols = 4;

/// Rows of A staged at once: its stage (128 rows of the qwen3 depths, 384
/// or 512 KiB) stays in L2 while every block of B's rows passes over it.
constexpr int64_t kDotRowBlock = 128;

/// bf16 values of one step of the dot form: a 64-byte vector of a row.
constexpr int64_t kDotStep = 32;

/// Columns of C from which the dot form stages A's rows (below, A is read
/// in place: a narrow C, such as a LoRA adapter's rank-r product, reads
/// each of A's rows too few times to pay for a copy).
constexpr int64_t kDotStagedColumns = 64;

/// Steps of a dot-form depth of k values (a LowRank's after A's).
int64_t dotSteps(int64_t k) { return ceilDiv(k, kDotStep); }

/// The row stride, in bf16 values, of the dot form's stage of B's rows:
/// whole steps and one more, so that its rows do not lie a multiple of 4
/// KiB apart.
int64_t dotStageLd(int64_t steps) { return (steps + 1) * kDotStep; }

/// Bytes of the dot form's working memory: A's stage (kDotRowBlock rows at
/// most, in blocks of kDotRows), B's stage (kDotCols rows) and, with a
/// decoder, one panel's depth block of decoded units.
size_t dotBytes(int64_t m, int64_t k, bool decodedB, int64_t lowK) {
  const int64_t steps = dotSteps(k + lowK);
  const int64_t rows = ceilDiv(std::min(m, kDotRowBlock), kDotRows) * kDotRows;
  return size_t(rows * steps * kDotStep * 2 + kDotCols * dotStageLd(steps) * 2) +
         (decodedB ? size_t(kBlockUnits * kPanel * 4) : 0);
}

/// Whether gemm computes a C of n columns in its narrow form: a bf16 C at
/// most 16 columns wide (a LoRA adapter's rank-r product), kNarrowRows rows
/// a call on one vector of a panel.
bool narrowC(bool bf16, int64_t n) { return bf16 && n <= 16; }

/// The deepest depth (in units) that gemm takes as one block where it makes
/// B's panels itself from a plain B. A weight gradient's depth is an
/// expert's rows, about 128 at the qwen3 shapes and often a few more: in
/// blocks of kBlockUnits, an expert of 139 rows took a second block of 11
/// units, for which the first block's fp32 sums went to C and came back
/// through memory before the last block streamed it (the fp32 dw1 tile,
/// 2048 x 1536, a Xeon core: 94.5 GFLOP/s at 139 rows against 161.7 at
/// 128; in one block 145.8-155.4 at 117, 128 and 139 rows).
constexpr int64_t kOneBlockUnits = 2 * kBlockUnits;

/// Units of a depth block of the panels gemm makes from a plain B, over a
/// depth of `allUnits` units: the whole depth where it is deeper than
/// kBlockUnits and at most kOneBlockUnits (not a narrow C's, whose stage
/// of A holds kBlockUnits), else kBlockUnits.
int64_t madeBlockUnits(int64_t allUnits, bool narrow) {
  return !narrow && allUnits > kBlockUnits && allUnits <= kOneBlockUnits ? allUnits : kBlockUnits;
}

/// Bytes of one block's packed B panels, `blockUnits` deep, rounded to cache
/// lines: a decoder's are made kPackedBlockUnits deep where it writes them
/// straight (DecodedB::panel; packBytes does not know which decoder), others
/// `blockUnits` (madeBlockUnits; a B packed beforehand is read in place).
size_t panelBytes(int64_t n, bool decodedB, int64_t blockUnits) {
  return size_t(ceilDiv(n, kPanel) * kPanel * (decodedB ? kPackedBlockUnits : blockUnits)) * 4;
}

/// Bytes of a decoded B's working memory on the AVX-512 micro-kernel: one
/// panel's part of B, either form.
size_t decodedAvx512Bytes() { return std::max(decodedBytes(true), decodedBytes(false)); }

/// Bytes of the fp32 partial sums gemm keeps apart from C (`apart`: a bf16
/// C, or one the last block adds them onto) deeper than one depth block (m x
/// the column group's width), else none.
size_t partialBytes(int64_t m, int64_t n, int64_t k, bool bf16, bool apart) {
  return apart && k > kBlockUnits * perUnit(bf16) ? size_t(m * std::min(n, kGroup)) * 4 : 0;
}

} // namespace

/// Bytes of op(A) packed (transA), rounded to cache lines.
size_t packedABytes(int64_t m, int64_t k, bool transA, bool bf16) {
  return transA ? size_t(ceilDiv(k, perUnit(bf16)) * packedARowUnits(m)) * 4 : 0;
}

size_t packedBBytes(int64_t n, int64_t k, bool bf16) {
  return size_t(ceilDiv(n, kPanel) * kPanel * ceilDiv(k, perUnit(bf16))) * 4;
}

namespace {

/// Whether gemm may compute C as its transpose (gemm's comment says when).
bool narrowTransposed(int64_t m, int64_t n, bool transA, bool decodedB, bool addScaled) {
  return transA && n <= 16 && m > 16 && !decodedB && !addScaled;
}

/// Row stride in elements of the transpose of an m-column C: whole 64-byte
/// lines of either element size.
int64_t transposedLd(int64_t m) { return ceilDiv(m, 32) * 32; }

/// Bytes of that transpose (n rows), whole lines.
size_t transposedBytes(int64_t m, int64_t n, bool cBf16) {
  return size_t(n * transposedLd(m)) * (cBf16 ? 2 : 4);
}

/// Bytes of a LowRank's V packed for one column group of `width` columns,
/// its whole depth `lowK`, as gemm keeps them (after 64 bytes of alignment).
size_t lowRankPanelBytes(int64_t width, int64_t lowK, bool bf16) {
  return lowK > 0 ? 64 + size_t(ceilDiv(width, kPanel) * kPanel * ceilDiv(lowK, perUnit(bf16))) * 4
                  : 0;
}

/// Rows of B (columns of C) the swapped form sums at a time: two
/// micro-kernel calls of kRows rows, whose sums leave for C as one 16 x 16
/// transpose per 16 rows of A.
constexpr int64_t kSwapRows = 2 * kRows;

/// The least depth of a product in the swapped form: each of its sums
/// leaves the registers through a transpose, which a shallow product (a
/// LoRA adapter's rank-r one, a depth of 16) would spend more on than on
/// its dot products, where the panels pack only a B as shallow. (A choice,
/// not a measurement: the qwen3 dX tiles it was measured on are 1536 and
/// 2048 deep.)
constexpr int64_t kSwapDepth = 256;

/// Rows of A (columns of C^T) the swapped form packs at a time: A^T's
/// panels of that many columns over the whole depth stay in L2 while every
/// row of B passes over them.
constexpr int64_t kSwapGroup = kGroup;

/// The row stride, in bf16 values, of the swapped form's decoded rows of B
/// (a depth block's, kSwapBlockUnits units, and 32 more: off a multiple of
/// 4 KiB).
constexpr int64_t kSwapDecodedLd = 2 * kPackedBlockUnits + 32;

/// The row stride, in bf16 values, of the swapped form's copy of op(V)^T's
/// rows for a V stored k x n (not transV): its k values, whole units.
int64_t swappedLowLd(int64_t lowK) { return ceilDiv(lowK, 2) * 2; }

/// Bytes of the swapped form's working memory: A^T's panels for a group of
/// A's rows, then the fp32 sums of kSwapRows rows of C^T, then with a
/// LowRank of depth lowK > 0 U^T's panels for the group, then with a decoder
/// kSwapRows decoded rows of B's depth block.
size_t swappedBytes(int64_t m, int64_t k, int64_t lowK, bool decodedB) {
  return packedBBytes(std::min(m, kSwapGroup), k, true) + size_t(kSwapRows * kSwapGroup) * 4 +
         (lowK > 0 ? packedBBytes(std::min(m, kSwapGroup), lowK, true) +
                         size_t(kSwapRows * swappedLowLd(lowK)) * 2
                   : 0) +
         (decodedB ? size_t(kSwapRows * kSwapDecodedLd) * 2 : 0);
}

/// Whether gemm computes this call in its swapped form: swappedForm's
/// products, with none of the options it does not take (a decoder that
/// writes panels, not rows, among them).
bool swapsCall(int64_t n, int64_t k, bool transA, bool transB, bool bf16, const DecodedB *decodedB,
               bool addScaled, const LowRank *lowRank, bool stream, bool packedB) {
  return swappedForm(n, k, transA, transB, bf16) && !(decodedB && decodedB->panel) && !addScaled &&
         !stream && !packedB;
}

/// packBytes of the product as gemm computes it (not transposed).
size_t directBytes(int64_t m, int64_t n, int64_t k, bool transA, bool bf16, bool cBf16,
                   bool decodedB, bool addScaled, int64_t lowK) {
  if (bf16 && amx())
    return amxPackBytes(m, n, k, decodedB, lowK);
  const int64_t width = std::min(n, kGroup);
  size_t bytes =
      panelBytes(width, decodedB, madeBlockUnits(ceilDiv(k, perUnit(bf16)), narrowC(bf16, n))) +
      packedABytes(m, k, transA, bf16) + partialBytes(m, n, k, bf16, cBf16 || addScaled);
  // The larger of the two forms: packBytes does not know transB.
  if (decodedB)
    bytes += decodedAvx512Bytes();
  bytes += lowRankPanelBytes(width, lowK, bf16);
  // Nor whether the product is the dot form's or the swapped form's.
  // (A call with fewer of the options may take it, with the same memory.)
  if (swappedForm(n, k, transA, true, bf16))
    bytes = std::max(bytes, swappedBytes(m, k, lowK, decodedB));
  return dotForm(transA, true, bf16) ? std::max(bytes, dotBytes(m, k, decodedB, lowK)) : bytes;
}

} // namespace

size_t leadPackBytes(int64_t m, int64_t r, int64_t k, bool bf16, float scale) {
  return packBytes(m, r, k, false, bf16, bf16, false, scale != 1.0f, 0);
}

size_t packBytes(int64_t m, int64_t n, int64_t k, bool transA, bool bf16, bool cBf16, bool decodedB,
                 bool addScaled, int64_t lowRankK) {
  const size_t direct = directBytes(m, n, k, transA, bf16, cBf16, decodedB, addScaled, lowRankK);
  // The larger of the two forms of a product gemm may compute transposed
  // (packBytes does not know transB or packedB).
  if (!narrowTransposed(m, n, transA, decodedB, addScaled))
    return direct;
  return std::max(direct, transposedBytes(m, n, cBf16) +
                              directBytes(n, m, k, true, bf16, cBf16, false, false, 0));
}

#ifdef MOEC_TILE_X86

#define MOEC_TILE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace {

/// The lanes of a 16-lane vector that hold columns [16 * part, cols).
MOEC_TILE_TARGET inline __mmask16 laneMask(int cols, int part) {
  const int left = cols - 16 * part;
  if (left <= 0)
    return 0;
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

/// The units of 16 columns of a bf16 row pair, from the pair's vectors of
/// 32 columns each: columns [16 * HALF, 16 * HALF + 16), each column's value
/// of `r0` in the unit's low half and of `r1` in its high half, by one
/// permutation of the two vectors.
template <int HALF>
MOEC_TILE_TARGET __attribute__((always_inline)) inline __m512i pairUnits(__m512i r0, __m512i r1) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(r0, HALF ? _mm512_add_epi16(lo, _mm512_set1_epi16(16)) : lo, r1);
}

} // namespace

// The panels' packing, shared with the AMX form: TilePack.h says what each
// function makes.
namespace detail {

MOEC_TILE_TARGET void packRows(const void *src, int64_t ld, int64_t p0, int64_t p1,
                               int64_t cols, bool bf16, uint32_t *dst, int64_t dstLd,
                               int64_t panelCols, int64_t panelStride) {
  const int64_t units = ceilDiv(p1 - p0, perUnit(bf16));
  // bf16 rows in pairs, 32 columns at a time: one permutation of the two
  // rows' vectors interleaves 16 columns' pairs (pairUnits; the loop below
  // widens and shifts each half instead).
  // Unit t's columns [c, c + 32) of a bf16 pair of rows (both within p1).
  const auto pairs32 = [&](int64_t t, int64_t c) MOEC_TILE_TARGET {
    const uint16_t *r0 = static_cast<const uint16_t *>(src) + (p0 + 2 * t) * ld;
    const __m512i a = _mm512_loadu_si512(r0 + c), b = _mm512_loadu_si512(r0 + ld + c);
    _mm512_storeu_si512(dst + (c / panelCols) * panelStride + t * dstLd + c % panelCols,
                        pairUnits<0>(a, b));
    const int64_t c2 = c + 16;
    _mm512_storeu_si512(dst + (c2 / panelCols) * panelStride + t * dstLd + c2 % panelCols,
                        pairUnits<1>(a, b));
  };
  // Unit t's columns from c on, 16 at a time.
  const auto rest = [&](int64_t t, int64_t c) MOEC_TILE_TARGET {
    for (; c < cols; c += 16) {
      const __mmask16 mask = laneMask(int(std::min<int64_t>(cols - c, 16)), 0);
      __m512i v;
      if (bf16) {
        const uint16_t *base = static_cast<const uint16_t *>(src) + c;
        const int64_t r0 = p0 + 2 * t, r1 = r0 + 1;
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, base + r0 * ld));
        __m512i hi = _mm512_setzero_si512();
        if (r1 < p1)
          hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, base + r1 * ld));
        v = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      } else {
        const float *base = static_cast<const float *>(src) + c;
        v = _mm512_maskz_loadu_epi32(mask, base + (p0 + t) * ld);
      }
      _mm512_storeu_si512(dst + (c / panelCols) * panelStride + t * dstLd + c % panelCols, v);
    }
  };
  const int64_t whole = cols / 32 * 32;
  int64_t t = 0;
  // bf16 rows four at a time (two units), side by side: four streams from
  // memory at once, which it serves faster than two (the bf16 step with
  // every weight trained, whose forward packs B as stored here, 1.03x).
  if (bf16)
    for (; t + 1 < units && p0 + 2 * t + 3 < p1; t += 2) {
      for (int64_t c = 0; c < whole; c += 32) {
        pairs32(t, c);
        pairs32(t + 1, c);
      }
      rest(t, whole);
      rest(t + 1, whole);
    }
  for (; t < units; ++t) {
    int64_t c = 0;
    if (bf16 && p0 + 2 * t + 1 < p1)
      for (; c < whole; c += 32)
        pairs32(t, c);
    rest(t, c);
  }
}

MOEC_TILE_TARGET void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + x]: column 4L + x of rows 4g..4g+3, in 128-bit lane L.
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int x = 0; x < 4; ++x) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[x], u[4 + x], 0x88);
    const __m512i w0 = _mm512_shuffle_i32x4(u[x], u[4 + x], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + x], u[12 + x], 0xDD);
    r[x] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    r[8 + x] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    r[4 + x] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    r[12 + x] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

/// r[j] = element j of 16 rows of 16 32-bit elements (the first at
/// `first`, rows `stride` bytes apart): transpose16 of the rows as loaded,
/// the same values, built from the rows' 128-bit quarters as they load (row
/// 4g + x's quarter h into lane g of vector 4h + x), then a 4 x 4 transpose
/// within each lane of each four vectors: no permutation across lanes. A
/// transposed B's packing pass (packTransposed) took 1.75-2.8 of a
/// micro-kernel call's time a panel, against 3.3-4.0 with transpose16.
MOEC_TILE_TARGET __attribute__((always_inline)) inline void
transposeRows16(const char *first, int64_t stride, __m512i (&r)[16]) {
  const auto quarter = [&](int row, int h) MOEC_TILE_TARGET {
    return _mm_loadu_si128(reinterpret_cast<const __m128i *>(first + row * stride + 16 * h));
  };
#pragma GCC unroll 4
  for (int h = 0; h < 4; ++h) {
    __m512i l[4];
#pragma GCC unroll 4
    for (int x = 0; x < 4; ++x) {
      __m512i v = _mm512_castsi128_si512(quarter(x, h));
      v = _mm512_inserti32x4(v, quarter(4 + x, h), 1);
      v = _mm512_inserti32x4(v, quarter(8 + x, h), 2);
      l[x] = _mm512_inserti32x4(v, quarter(12 + x, h), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(l[0], l[1]), t1 = _mm512_unpackhi_epi32(l[0], l[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(l[2], l[3]), t3 = _mm512_unpackhi_epi32(l[2], l[3]);
    r[4 * h + 0] = _mm512_unpacklo_epi64(t0, t2);
    r[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
    r[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3);
    r[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
  }
}

/// dst[j, i] = src[i, j] for i < rows, j < cols (strides in elements of 2
/// bytes with `half`, else 4), 16 x 16 blocks at a time.
MOEC_TILE_TARGET void transposeInto(const void *src, int64_t ldSrc, int64_t rows, int64_t cols,
                                    void *dst, int64_t ldDst, bool half) {
  const size_t elt = half ? 2 : 4;
  for (int64_t i0 = 0; i0 < rows; i0 += 16)
    for (int64_t j0 = 0; j0 < cols; j0 += 16) {
      const __mmask16 across = laneMask(int(std::min<int64_t>(16, cols - j0)), 0);
      const __mmask16 down = laneMask(int(std::min<int64_t>(16, rows - i0)), 0);
      __m512i r[16];
      for (int s = 0; s < 16; ++s) {
        const char *row = static_cast<const char *>(src) + size_t((i0 + s) * ldSrc + j0) * elt;
        if (i0 + s >= rows)
          r[s] = _mm512_setzero_si512();
        else if (half)
          r[s] = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(across, row));
        else
          r[s] = _mm512_maskz_loadu_epi32(across, row);
      }
      transpose16(r);
      for (int s = 0; s < 16 && j0 + s < cols; ++s) {
        char *row = static_cast<char *>(dst) + size_t((j0 + s) * ldDst + i0) * elt;
        if (half)
          _mm256_mask_storeu_epi16(row, down, _mm512_cvtepi32_epi16(r[s]));
        else
          _mm512_mask_storeu_epi32(row, down, r[s]);
      }
    }
}

MOEC_TILE_TARGET void packTransposed(const void *b, int64_t ldb, int64_t n, int64_t p0,
                                     int64_t p1, bool bf16, uint32_t *dst, int64_t panelStride) {
  const int64_t per = perUnit(bf16);
  const int64_t units = ceilDiv(p1 - p0, per);
  const int64_t fullUnits = (p1 - p0) / per; // units with no half past p1
  const size_t elt = bf16 ? 2 : 4;
  for (int64_t q = 0; q * kPanel < n; ++q) {
    uint32_t *panel = dst + q * panelStride;
    for (int jj = 0; jj < kPanel; jj += 16) {
      const int64_t j0 = q * kPanel + jj;
      // 16 units of 16 rows at a time, by a transpose; the rows past n and
      // the values past p1 read as zero (masked loads): units past n are
      // zero, and a bf16 pair's high half past p1.
      for (int64_t t = 0; t < units; t += 16) {
        const int64_t left = p1 - (p0 + t * per); // values of a row from here
        const bool whole = j0 + 16 <= n && t + 16 <= fullUnits;
        __m512i r[16];
        if (whole) {
          transposeRows16(static_cast<const char *>(b) + size_t(j0 * ldb + p0 + t * per) * elt,
                          ldb * int64_t(elt), r);
        } else {
          for (int s = 0; s < 16; ++s) {
            const char *row =
                static_cast<const char *>(b) + size_t((j0 + s) * ldb + p0 + t * per) * elt;
            if (j0 + s >= n)
              r[s] = _mm512_setzero_si512();
            else if (bf16)
              r[s] = _mm512_maskz_loadu_epi16(
                  left >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << left) - 1), row);
            else
              r[s] = _mm512_maskz_loadu_epi32(laneMask(int(std::min<int64_t>(left, 16)), 0), row);
          }
          transpose16(r);
        }
        const int64_t count = std::min<int64_t>(16, units - t);
        for (int s = 0; s < count; ++s)
          _mm512_storeu_si512(panel + (t + s) * kPanel + jj, r[s]);
      }
    }
  }
}

MOEC_TILE_TARGET void decodePanel(const DecodedB &d, bool transB, int64_t c0, int64_t cols,
                                  int64_t p0, int64_t p1, uint32_t *to, uint16_t *decoded) {
  if (d.panel) {
    d.panel(d.context, c0 / kPanel, p0 / 2, ceilDiv(p1, 2), to);
    return;
  }
  // (One panel: the packing's panel stride is never used.)
  const int64_t ld = decodedLd(transB), stride = ceilDiv(p1 - p0, 2) * kPanel;
  if (transB) {
    d.read(c0, c0 + cols, p0, p1, decoded, ld);
    packTransposed(decoded, ld, cols, 0, p1 - p0, true, to, stride);
  } else {
    d.read(p0, p1, c0, c0 + cols, decoded, ld);
    packRows(decoded, ld, 0, p1 - p0, cols, true, to, kPanel, kPanel, stride);
  }
}

} // namespace detail

namespace {

/// Cache lines a micro-kernel call prefetches into L2 among its dot
/// products, one every few units: what later calls read (the next depth
/// block's B and A, C's lines). Issued in a burst before the call, they
/// held the fill buffers that the call's own first loads then waited for;
/// spread, the layer's steps with B packed beforehand ran 3-6% faster.
/// Lines past kMax are prefetched at once.
struct Lines {
  static constexpr int kMax = 96;
  const char *line[kMax];
  int count = 0;
};

/// A LowRank's part of one micro-kernel call: U's rows at a + r * aRow
/// (bytes; a unit 4 bytes apart), its `units` units (the last a lone bf16
/// value with `halfLast`), and its V's panel for the call's columns.
struct LowPart {
  const char *a = nullptr;
  int64_t aRow = 0;
  int64_t units = 0;
  bool halfLast = false;
  const uint32_t *panel = nullptr;
};

/// Broadcasts A's unit at `offset` bytes into each of the MR rows: 32 bits,
/// or with HALF a lone bf16 value (the high half zero).
template <int MR, bool HALF>
MOEC_TILE_TARGET __attribute__((always_inline)) inline void
broadcast(__m512i (&av)[MR], const char *const (&rows)[MR], int64_t offset) {
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    uint32_t v = 0;
    std::memcpy(&v, rows[r] + offset, HALF ? 2 : 4);
    av[r] = _mm512_set1_epi32(int(v));
  }
}

/// One unit of the micro-kernel: acc[r][x] += A's unit of row r times the
/// panel's vector x (a bf16 dot product of two pairs, or an FMA), for the
/// panel's first NV vectors.
template <int MR, int NV, bool BF16>
MOEC_TILE_TARGET __attribute__((always_inline)) inline void
step(__m512 (&acc)[MR][NV], const uint32_t *panel, const __m512i (&av)[MR]) {
  __m512i bv[NV];
#pragma GCC unroll 3
  for (int x = 0; x < NV; ++x)
    bv[x] = _mm512_load_si512(panel + 16 * x);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int x = 0; x < NV; ++x) {
      if constexpr (BF16)
        acc[r][x] = _mm512_dpbf16_ps(acc[r][x], (__m512bh)av[r], (__m512bh)bv[x]);
      else
        acc[r][x] =
            _mm512_fmadd_ps(_mm512_castsi512_ps(av[r]), _mm512_castsi512_ps(bv[x]), acc[r][x]);
    }
}

/// out[r, 0:cols) (r < MR) = (in ? in[r, 0:cols) : 0) + the sum over
/// `units` of A's unit times the panel's, A's unit (row r, unit t) at
/// a + r * aRow + t * aUnit (bytes). `out` is fp32, or bf16 bits with
/// `outBf16` (rounded once, here); `in` is fp32 and may be `out`. With
/// `halfLast`, A's last unit is a lone bf16 value (its pair would lie past
/// the depth), read as such. With `scaled` (gemm's AddScaled), the sums are
/// multiplied by its alpha and, where `addend` is not null, added to
/// addend[r, 0:cols) (row stride scaled->ld, out's storage type) before
/// they are stored. With `low`, its units are summed after A's, before
/// any of that.
///
/// With PACK, the panel is not read but made as this call goes, unit by unit
/// as packRows makes it, and written for the calls after this one: a bf16
/// unit t pairs rows 2t and 2t + 1 of `src` (row stride `ldSrc` elements, at
/// the panel's first column; the high half zero past `srcRows` rows), an
/// fp32 one is row t. Its loads then run among the dot products, instead of
/// in a pass of their own that waits on memory with nothing else to do.
///
/// NV is the number of 16-lane vectors of the panel the call computes: 3 (48
/// columns, MR up to kRows), or 1 for a C at most 16 columns wide (a LoRA
/// adapter's rank-r product), where MR goes up to kNarrowRows. AROW, where
/// it is not 0, is aRow as compiled (a narrow call's stage of A), so that
/// the rows are addressed from one register.
template <int MR, bool BF16, bool PACK, int NV = 3, int64_t AROW = 0>
MOEC_TILE_TARGET void micro(int64_t units, const char *a, int64_t aRow, int64_t aUnit,
                            bool halfLast, uint32_t *panel, const float *in, int64_t ldIn,
                            void *out, int64_t ldOut, bool outBf16, int cols, const void *src,
                            int64_t ldSrc, int64_t srcRows, const AddScaled *scaled,
                            const char *addend, const Lines &ahead, const LowPart *low) {
  static_assert(NV == 3 || !PACK, "the panel is packed in the call 48 columns at a time");
  __m512 acc[MR][NV];
  const __mmask16 masks[3] = {laneMask(cols, 0), laneMask(cols, 1), laneMask(cols, 2)};
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int x = 0; x < NV; ++x)
      acc[r][x] =
          in ? _mm512_maskz_loadu_ps(masks[x], in + r * ldIn + 16 * x) : _mm512_setzero_ps();
  const char *rows[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    rows[r] = a + r * (AROW ? AROW : aRow);
  const int64_t whole = halfLast ? units - 1 : units;
  __m512i av[MR];
  // Units [0, whole), panel by panel, in chunks of `every` units, each
  // after one of `ahead`'s lines: the loop over a chunk's units holds no
  // prefetch state. (A check at each unit kept two of the eight rows'
  // pointers on the stack: the tile 1.04-1.09x without it, Zen 4.)
  const int64_t every = ahead.count ? std::max<int64_t>(1, units / ahead.count) : units + 1;
  int issued = 0;
  const auto eachUnit = [&](auto &&body) MOEC_TILE_TARGET {
    int64_t t = 0;
    for (; issued < ahead.count && t < whole; ++issued) {
      _mm_prefetch(ahead.line[issued], _MM_HINT_T1);
      for (const int64_t end = std::min(whole, t + every); t < end; ++t, panel += kPanel)
        body(t);
    }
    for (; t < whole; ++t, panel += kPanel)
      body(t);
  };
  if constexpr (PACK) {
    // Unit t of the panel, from `src` (above).
    const auto pack = [&](int64_t t) MOEC_TILE_TARGET {
      if constexpr (!BF16) {
        // An fp32 unit is row t's 48 columns.
        const float *row = static_cast<const float *>(src) + t * ldSrc;
#pragma GCC unroll 3
        for (int x = 0; x < 3; ++x)
          _mm512_store_si512(panel + 16 * x, _mm512_maskz_loadu_epi32(masks[x], row + 16 * x));
        return;
      }
      const uint16_t *r0 = static_cast<const uint16_t *>(src) + 2 * t * ldSrc, *r1 = r0 + ldSrc;
      const bool pair = 2 * t + 1 < srcRows;
      if (pair && cols == kPanel) {
        // A whole panel's pair: three permutations of four loads (the
        // forward's B-as-stored tiles 2-8% faster, a thread alone and two
        // at once, than widening and shifting each 16 columns' halves).
        const __m512i a = _mm512_loadu_si512(r0), b = _mm512_loadu_si512(r1);
        _mm512_store_si512(panel, pairUnits<0>(a, b));
        _mm512_store_si512(panel + 16, pairUnits<1>(a, b));
        _mm512_store_si512(
            panel + 32,
            pairUnits<0>(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r0 + 32))),
                         _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(r1 + 32)))));
        return;
      }
#pragma GCC unroll 3
      for (int x = 0; x < 3; ++x) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(masks[x], r0 + 16 * x));
        const __m512i hi =
            pair ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(masks[x], r1 + 16 * x))
                 : _mm512_setzero_si512();
        _mm512_store_si512(panel + 16 * x, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    };
    // A's lone last value outside the loop, as below: a loop that chose
    // between the two broadcasts held all eight rows' vectors at once and
    // kept four of the sums on the stack.
    eachUnit([&](int64_t t) MOEC_TILE_TARGET {
      pack(t);
      broadcast<MR, false>(av, rows, t * aUnit);
      step<MR, NV, BF16>(acc, panel, av);
    });
    if (halfLast) {
      pack(whole);
      broadcast<MR, true>(av, rows, whole * aUnit);
      step<MR, NV, BF16>(acc, panel, av);
    }
  } else {
    eachUnit([&](int64_t t) MOEC_TILE_TARGET {
      broadcast<MR, false>(av, rows, t * aUnit);
      step<MR, NV, BF16>(acc, panel, av);
    });
    if (halfLast) {
      broadcast<MR, true>(av, rows, whole * aUnit);
      step<MR, NV, BF16>(acc, panel, av);
    }
  }
  for (; issued < ahead.count; ++issued)
    _mm_prefetch(ahead.line[issued], _MM_HINT_T1);
  if (low) {
    const char *lowRows[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      lowRows[r] = low->a + r * low->aRow;
    const uint32_t *lowPanel = low->panel;
    const int64_t lowWhole = low->halfLast ? low->units - 1 : low->units;
    for (int64_t t = 0; t < lowWhole; ++t, lowPanel += kPanel) {
      broadcast<MR, false>(av, lowRows, t * 4);
      step<MR, NV, BF16>(acc, lowPanel, av);
    }
    if (low->halfLast) {
      broadcast<MR, true>(av, lowRows, lowWhole * 4);
      step<MR, NV, BF16>(acc, lowPanel, av);
    }
  }
  if (scaled) {
    const int64_t elt = outBf16 ? 2 : 4;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
      for (int x = 0; x < NV; ++x)
        acc[r][x] = scaleAdd16(acc[r][x], scaled->alpha,
                               addend ? addend + (r * scaled->ld + 16 * x) * elt : nullptr, outBf16,
                               masks[x]);
  }
  if (outBf16) {
    uint16_t *o = static_cast<uint16_t *>(out);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
      for (int x = 0; x < NV; ++x) {
        // (bf16 operands: a CPU with avx512_bf16's conversion.)
        if constexpr (BF16)
          _mm256_mask_storeu_epi16(o + r * ldOut + 16 * x, masks[x], bf16Packed16(acc[r][x]));
        else
          storeBf16x16(o + r * ldOut + 16 * x, masks[x], acc[r][x]);
      }
    return;
  }
  float *o = static_cast<float *>(out);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int x = 0; x < NV; ++x)
      _mm512_mask_storeu_ps(o + r * ldOut + 16 * x, masks[x], acc[r][x]);
}

/// Walks the cache lines of a set of equally long rows (`rows` rows of
/// `bytes` bytes, `stride` bytes apart) and hands them to the micro-kernel
/// calls to prefetch into L2 (Lines), a few rows a call: the next depth
/// block's operands, fetched while this block computes, so the GEMM does
/// not wait on memory at each block's start.
///
/// Each call takes whole rows, the same number each time, so that the loops'
/// branches repeat from call to call. A walk of a fixed number of lines,
/// wrapping to the next row at a different line each call, cost a tile whose
/// operands were already cached a tenth of its time, as much with its
/// prefetches left out as with them: the walk, not the prefetching (most
/// likely its mispredicted row wraps; this was measured, not counted).
class Prefetch {
public:
  Prefetch() = default;
  /// `rows` rows of `bytes` bytes, `stride` bytes apart; with `pieces`, each
  /// row is taken as that many runs of whole lines, one after the other (a
  /// long row, such as a packed panel's depth block, spread over the calls
  /// like many short ones).
  Prefetch(const char *base, int64_t rows, int64_t bytes, int64_t stride, int64_t pieces = 1)
      : rows(rows * pieces), pieces(pieces), lines(ceilDiv(ceilDiv(bytes, 64), pieces)),
        total(ceilDiv(bytes, 64)), stride(stride), at(base) {}

  /// Spreads the rows over `calls` calls of next().
  void spread(int64_t calls) { perCall = ceilDiv(rows, calls); }

  /// Adds the next rows' lines to `to` (as many as it holds; the rest are
  /// prefetched here). The walk keeps its place in the row (`piece`, `at`)
  /// rather than dividing by `pieces` at each row, and lists a run's lines
  /// without a check at each one. A call takes a hundred lines or more
  /// (a packed B's next depth block over 64 calls: 96), and the division
  /// and the checks were about 5% of the workers' time in the qwen3 steps
  /// (`perf`); the steps 0.94-0.97x the time without them (the log,
  /// 2026-11-28).
  MOEC_TILE_TARGET void next(Lines &to) {
    const int64_t end = std::min(rows, row + perCall);
    for (; row < end; ++row) {
      const char *line = at + piece * lines * 64;
      const int64_t count = std::min(lines, total - piece * lines);
      const int64_t listed = std::min<int64_t>(count, Lines::kMax - to.count);
      // Eight lines' addresses a store (the steps 0.990-0.994x the time of
      // one a store, alternating in one process).
      const char **into = to.line + to.count;
      __m512i eight = _mm512_add_epi64(_mm512_set1_epi64(reinterpret_cast<int64_t>(line)),
                                       _mm512_setr_epi64(0, 64, 128, 192, 256, 320, 384, 448));
      int64_t l = 0;
      for (; l + 8 <= listed; l += 8) {
        _mm512_storeu_si512(into + l, eight);
        eight = _mm512_add_epi64(eight, _mm512_set1_epi64(8 * 64));
      }
      if (l < listed)
        _mm512_mask_storeu_epi64(into + l, __mmask8((1u << (listed - l)) - 1), eight);
      to.count += int(listed);
      for (l = listed; l < count; ++l)
        _mm_prefetch(line + l * 64, _MM_HINT_T1);
      if (++piece == pieces) {
        piece = 0;
        at += stride;
      }
    }
  }

private:
  int64_t rows = 0, pieces = 1, lines = 0, total = 0, stride = 0;
  int64_t perCall = 0, row = 0;
  /// The walk's place: the start of row `row / pieces`, and `row % pieces`.
  const char *at = nullptr;
  int64_t piece = 0;
};

using Micro = void (*)(int64_t, const char *, int64_t, int64_t, bool, uint32_t *, const float *,
                       int64_t, void *, int64_t, bool, int, const void *, int64_t, int64_t,
                       const AddScaled *, const char *, const Lines &, const LowPart *);

/// Rows of C per micro-kernel call for a C at most 16 columns wide (one
/// vector of the panel: kNarrowRows accumulators).
constexpr int kNarrowRows = 16;

/// Bytes between the rows of A a narrow call reads from its stage (a depth
/// block's units and one line more).
constexpr int64_t kNarrowStageRow = (kBlockUnits + 16) * 4;

/// The micro-kernel of a bf16 C at most 16 columns wide, `rows` rows: A's
/// rows `aRow` bytes apart, or with AROW (a narrow call's stage,
/// kNarrowStageRow) that many.
template <int64_t AROW = 0> Micro microNarrowFor(int rows) {
  static constexpr Micro table[kNarrowRows] = {
      micro<1, true, false, 1, AROW>,  micro<2, true, false, 1, AROW>,
      micro<3, true, false, 1, AROW>,  micro<4, true, false, 1, AROW>,
      micro<5, true, false, 1, AROW>,  micro<6, true, false, 1, AROW>,
      micro<7, true, false, 1, AROW>,  micro<8, true, false, 1, AROW>,
      micro<9, true, false, 1, AROW>,  micro<10, true, false, 1, AROW>,
      micro<11, true, false, 1, AROW>, micro<12, true, false, 1, AROW>,
      micro<13, true, false, 1, AROW>, micro<14, true, false, 1, AROW>,
      micro<15, true, false, 1, AROW>, micro<16, true, false, 1, AROW>};
  return table[rows - 1];
}

/// The micro-kernel of `rows` rows (up to kRows) on the panel's first NV
/// vectors.
template <bool BF16, bool PACK = false, int NV = 3> Micro microFor(int rows) {
  static constexpr Micro table[kRows] = {
      micro<1, BF16, PACK, NV>, micro<2, BF16, PACK, NV>, micro<3, BF16, PACK, NV>,
      micro<4, BF16, PACK, NV>, micro<5, BF16, PACK, NV>, micro<6, BF16, PACK, NV>,
      micro<7, BF16, PACK, NV>, micro<8, BF16, PACK, NV>};
  return table[rows - 1];
}

//===----------------------------------------------------------------------===//
// The dot form: a bf16 op(B) stored n x k (transB), A row-major
//===----------------------------------------------------------------------===//

/// Sums each of 16 vectors' lanes: lane 4j + t of the result is the sum of
/// v[j + 4t]'s 16 lanes, by a fixed tree (halves, quarters, pairs).
MOEC_TILE_TARGET __attribute__((always_inline)) inline __m512 laneSums16(const __m512 (&v)[16]) {
  __m512 w[8], z[4], u[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

/// Where the dot form reads one operand's rows: step t of row r at
/// at + t * step + r * row (bf16 values).
struct DotRows {
  const uint16_t *at = nullptr;
  int64_t step = 0, row = 0;
};

/// One block of the dot form: the sums of a 4 x 4 block of C, lane 4r + c
/// for A's row r and B's row c. Steps [0, steps) of A, of which B's are the
/// first bSteps (the last of them masked by `tail`, a mask of bf16 values:
/// lanes past it read as zero from both) and a LowRank's V's the others
/// (`v`, from its step 0). Each lane of accumulator (r, c) adds the dot
/// products of its value pair in depth order; then laneSums16.
MOEC_TILE_TARGET void dotBlock(DotRows a, DotRows b, int64_t bSteps, __mmask32 tail, DotRows v,
                               int64_t steps, __m512 &sums) {
  __m512 acc[kDotRows * kDotCols];
#pragma GCC unroll 16
  for (int i = 0; i < kDotRows * kDotCols; ++i)
    acc[i] = _mm512_setzero_ps();
  const auto step = [&](int64_t t, const uint16_t *bAt, int64_t bRow,
                        __mmask32 mask) MOEC_TILE_TARGET {
    __m512i bv[kDotCols];
#pragma GCC unroll 4
    for (int c = 0; c < kDotCols; ++c)
      bv[c] = _mm512_maskz_loadu_epi16(mask, bAt + c * bRow);
#pragma GCC unroll 4
    for (int r = 0; r < kDotRows; ++r) {
      const __m512i x = _mm512_maskz_loadu_epi16(mask, a.at + t * a.step + r * a.row);
#pragma GCC unroll 4
      for (int c = 0; c < kDotCols; ++c)
        acc[r * kDotCols + c] =
            _mm512_dpbf16_ps(acc[r * kDotCols + c], (__m512bh)x, (__m512bh)bv[c]);
    }
  };
  const __mmask32 all = __mmask32(~0u);
  const int64_t whole = tail == all ? bSteps : bSteps - 1;
  for (int64_t t = 0; t < whole; ++t)
    step(t, b.at + t * b.step, b.row, all);
  if (whole < bSteps)
    step(whole, b.at + whole * b.step, b.row, tail);
  for (int64_t t = bSteps; t < steps; ++t)
    step(t, v.at + (t - bSteps) * v.step, v.row, all);
  // Lane 4c + r to lane 4r + c.
  const __m512i rowMajor = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  sums = _mm512_permutexvar_ps(rowMajor, laneSums16(acc));
}

/// The values of a 4 x 4 block of a matrix of `elt` bytes an element (fp32
/// or bf16), row stride `ld`, its rows [0, rows) and columns [0, cols), as
/// fp32 in lane 4r + c (zero elsewhere).
MOEC_TILE_TARGET __m512 dotLoad(const char *at, int64_t ld, int64_t elt, int rows, int cols) {
  const __mmask16 colMask = __mmask16((1u << cols) - 1);
  __m512 v = _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const char *row = at + r * ld * elt;
    const __m128 x =
        elt == 2 ? _mm_castsi128_ps(_mm_slli_epi32(
                       _mm_cvtepu16_epi32(_mm_maskz_loadu_epi16(__mmask8(colMask), row)), 16))
                 : _mm_maskz_loadu_ps(__mmask8(colMask), row);
    v = _mm512_mask_broadcast_f32x4(v, __mmask16(colMask << (4 * r)), x);
  }
  return v;
}

/// The dot form's C (gemm's comment says when it runs), for each block of
/// up to kDotRowBlock rows of A, each 4 rows of B (columns of C) against
/// every 4 rows of A, the next 4 rows of B prefetched meanwhile. A's rows
/// are read in place where C is narrow (kDotStagedColumns: few columns to
/// spread a copy over), else staged [block of 4][step][row], with U's after
/// them (a LowRank). B's rows are read in place unless decoded, the last
/// ones of an n not a multiple of 4, or a LowRank's that do not end on a
/// whole step: those are staged in B's stage. V's columns (a LowRank) are
/// staged after their rows, from a whole step on.
MOEC_TILE_TARGET void gemmDot(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                              const uint16_t *b, int64_t ldb, char *c, int64_t ldc, bool cBf16,
                              bool load, void *pack, const DecodedB *decodedB,
                              const AddScaled *addScaled, const LowRank *lowRank) {
  // The depth: A's k values, then a LowRank's lowK (U's after A's, V's
  // columns after B's rows): the sums of the product of the concatenations.
  const int64_t lowK = lowRank ? lowRank->k : 0, depth = k + lowK, steps = dotSteps(depth);
  const int64_t rowBlock = std::min(m, kDotRowBlock);
  uint16_t *aStage = static_cast<uint16_t *>(pack);
  uint16_t *bStage = aStage + ceilDiv(rowBlock, kDotRows) * kDotRows * steps * kDotStep;
  const int64_t bStageLd = dotStageLd(steps);
  uint32_t *panelUnits = reinterpret_cast<uint32_t *>(bStage + kDotCols * bStageLd);
  const int64_t cElt = cBf16 ? 2 : 4;
  const bool stageA = lowRank || n >= kDotStagedColumns;
  // B's rows in place for their whole steps (a LowRank's V then from a
  // step of its own), unless decoded or a LowRank's depth starts inside a
  // step.
  const bool bInPlace = !decodedB && (!lowRank || k % kDotStep == 0);
  const int64_t bSteps = bInPlace ? dotSteps(k) : steps;
  // The last step of a depth that ends inside one, where A or B is read in
  // place: both read as zero past it (in a stage they are zero there).
  const __mmask32 tail =
      !lowRank && k % kDotStep ? __mmask32((1u << (k % kDotStep)) - 1) : __mmask32(~0u);
  // Row `row` of B's stage: from value `from` of the depth on, B's row j (a
  // column of op(B)) and V's column j after it, zero past the depth.
  const auto stageColumn = [&](int64_t j, int64_t from, uint16_t *row) MOEC_TILE_TARGET {
    std::memset(row, 0, size_t(steps * kDotStep - from) * 2);
    if (from < k) {
      if (!decodedB) {
        std::memcpy(row, b + j * ldb, size_t(k) * 2);
      } else if (!decodedB->panel) {
        decodedB->read(j, j + 1, 0, k, row, k);
      } else { // a panel's units, a depth block at a time (not the layer's path)
        const int64_t q = j / kPanel, units = ceilDiv(k, 2);
        for (int64_t u0 = 0; u0 < units; u0 += kBlockUnits) {
          const int64_t u1 = std::min(units, u0 + kBlockUnits);
          decodedB->panel(decodedB->context, q, u0, u1, panelUnits);
          for (int64_t u = u0; u < u1; ++u) {
            const uint32_t unit = panelUnits[(u - u0) * kPanel + j % kPanel];
            row[2 * u] = uint16_t(unit);
            if (2 * u + 1 < k)
              row[2 * u + 1] = uint16_t(unit >> 16);
          }
        }
      }
    }
    if (lowRank) {
      const uint16_t *v = static_cast<const uint16_t *>(lowRank->v);
      uint16_t *low = row + k - from;
      if (lowRank->transV)
        std::memcpy(low, v + j * lowRank->ldv, size_t(lowK) * 2);
      else
        for (int64_t p = 0; p < lowK; ++p)
          low[p] = v[p * lowRank->ldv + j];
    }
  };
  for (int64_t i0 = 0; i0 < m; i0 += kDotRowBlock) {
    const int64_t rows = std::min(kDotRowBlock, m - i0), blocks = ceilDiv(rows, kDotRows);
    // A's rows staged (with U's after them), zero past the depth and past
    // m, step by step: each row gathered whole in B's stage (free until B's
    // rows come), then its steps put in place.
    // Read in place, only a last block of fewer than 4 rows is staged
    // (at the stage's start), so that no row past m is read.
    const int64_t first = stageA ? 0 : rows / kDotRows * kDotRows;
    if (first < rows) {
      std::memset(aStage, 0, size_t((blocks - first / kDotRows) * kDotRows * steps * kDotStep) * 2);
      for (int64_t i = first; i < rows; ++i) {
        uint16_t *row = bStage;
        std::memset(row + k, 0, size_t(steps * kDotStep - k) * 2);
        std::memcpy(row, a + (i0 + i) * lda, size_t(k) * 2);
        if (lowRank)
          std::memcpy(row + k, static_cast<const uint16_t *>(lowRank->u) + (i0 + i) * lowRank->ldu,
                      size_t(lowK) * 2);
        uint16_t *at = aStage + ((i - first) / kDotRows) * kDotRows * steps * kDotStep +
                       (i % kDotRows) * kDotStep;
        for (int64_t t = 0; t < steps; ++t)
          std::memcpy(at + t * kDotRows * kDotStep, row + t * kDotStep, size_t(kDotStep) * 2);
      }
    }
    for (int64_t j0 = 0; j0 < n; j0 += kDotCols) {
      const int cols = int(std::min<int64_t>(kDotCols, n - j0));
      // B's rows: in place, or (the last ones of n, or not read in place)
      // from the stage; V's columns staged from step bSteps on.
      const bool whole = bInPlace && cols == kDotCols;
      DotRows bRows{b + j0 * ldb, kDotStep, ldb}, vRows{bStage, kDotStep, bStageLd};
      if (!whole || lowRank) {
        const int64_t from = whole ? bSteps * kDotStep : 0;
        for (int cc = 0; cc < kDotCols; ++cc) {
          if (cc < cols)
            stageColumn(j0 + cc, from, bStage + cc * bStageLd);
          else
            std::memset(bStage + cc * bStageLd, 0, size_t(steps * kDotStep - from) * 2);
        }
        if (!whole)
          bRows = vRows;
      }
      const int64_t rowSteps = whole ? bSteps : steps;
      // The next rows of B, into L1, a few lines a block of A's rows.
      const char *next = !decodedB && j0 + kDotCols < n
                             ? reinterpret_cast<const char *>(b + (j0 + kDotCols) * ldb)
                             : nullptr;
      const int64_t nextRows = std::min<int64_t>(kDotCols, n - j0 - kDotCols);
      const int64_t rowLines = ceilDiv(k * 2, 64), nextLines = nextRows * rowLines;
      const int64_t perBlock = ceilDiv(nextLines, blocks);
      for (int64_t s = 0; s < blocks; ++s) {
        if (next)
          for (int64_t l = s * perBlock, end = std::min(nextLines, l + perBlock); l < end; ++l)
            _mm_prefetch(next + (l / rowLines) * ldb * 2 + (l % rowLines) * 64, _MM_HINT_T0);
        const int64_t i = i0 + s * kDotRows;
        const int rs = int(std::min<int64_t>(kDotRows, m - i));
        // In place, A's rows; the staged block of fewer than 4 (above).
        DotRows aRows{aStage + s * kDotRows * steps * kDotStep, kDotRows * kDotStep, kDotStep};
        if (!stageA)
          aRows = rs == kDotRows ? DotRows{a + i * lda, kDotStep, lda}
                                 : DotRows{aStage, kDotRows * kDotStep, kDotStep};
        __m512 sums;
        dotBlock(aRows, bRows, rowSteps, tail, vRows, steps, sums);
        char *at = c + (i * ldc + j0) * cElt;
        if (load)
          sums = _mm512_add_ps(dotLoad(at, ldc, cElt, rs, cols), sums);
        if (addScaled) {
          const __m512 addend =
              addScaled->addend ? dotLoad(static_cast<const char *>(addScaled->addend) +
                                              (i * addScaled->ld + j0) * cElt,
                                          addScaled->ld, cElt, rs, cols)
                                : __m512();
          sums = scaleAdd(sums, addScaled->alpha, addScaled->addend ? &addend : nullptr);
        }
        alignas(64) char out[kDotRows * kDotCols * 4];
        if (cBf16)
          _mm256_store_si256(reinterpret_cast<__m256i *>(out), bf16Packed16(sums));
        else
          _mm512_store_ps(reinterpret_cast<float *>(out), sums);
        for (int r = 0; r < rs; ++r)
          std::memcpy(at + r * ldc * cElt, out + r * kDotCols * cElt, size_t(cols * cElt));
      }
    }
  }
}

//===----------------------------------------------------------------------===//
// The swapped form: a bf16 op(B) stored n x k (transB), A row-major,
// computed as its transpose C^T = B A^T
//===----------------------------------------------------------------------===//

/// Depth units of one micro-kernel call of the swapped form: the qwen3
/// backward's dX tiles (`gmm_bench --layer 32 3 1`) level or up to 1.07x
/// faster than in blocks of kBlockUnits (64 units: 1.04-1.2x slower), the
/// frozen step's backward 0.93-0.96x the panels' time against 0.99x.
constexpr int64_t kSwapBlockUnits = kPackedBlockUnits;

/// The micro-kernel of `rows` rows on as many of a panel's vectors as its
/// `cols` live columns fill (the swapped form's last panel of A^T).
Micro microSwapFor(int rows, int cols) {
  return cols <= 16   ? microFor<true, false, 1>(rows)
         : cols <= 32 ? microFor<true, false, 2>(rows)
                      : microFor<true>(rows);
}

/// C[j, i] = sums[i, j] for i < rows (at most 16), j < cols: fp32, or bf16
/// rounded as the micro-kernel rounds its bf16 C (bf16Packed16, a value at
/// a time the same whatever its neighbours), 16 x 16 blocks by transposes.
MOEC_TILE_TARGET void storeTransposedSums(const float *sums, int64_t ld, int64_t rows, int64_t cols,
                                          char *c, int64_t ldc, bool cBf16) {
  const __mmask16 down = laneMask(int(rows), 0);
  const int64_t cElt = cBf16 ? 2 : 4;
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    const __mmask16 across = laneMask(int(std::min<int64_t>(16, cols - j0)), 0);
    __m512i r[16];
    for (int s = 0; s < 16; ++s)
      r[s] =
          s < rows ? _mm512_maskz_loadu_epi32(across, sums + s * ld + j0) : _mm512_setzero_si512();
    transpose16(r);
    for (int s = 0; s < 16 && j0 + s < cols; ++s) {
      char *row = c + (j0 + s) * ldc * cElt;
      if (cBf16)
        _mm256_mask_storeu_epi16(row, down, bf16Packed16(_mm512_castsi512_ps(r[s])));
      else
        _mm512_mask_storeu_epi32(row, down, r[s]);
    }
  }
}

/// The swapped form's C (gemm's comment says when it runs): per group of
/// up to kSwapGroup rows of A, A^T packed whole into panels (packB); then
/// per kSwapRows rows of B, read in place as the micro-kernel's rows, their
/// sums over the whole depth in `stage` (from C transposed, with `load`),
/// the next rows of B prefetched meanwhile, and the sums written to C
/// transposed.
MOEC_TILE_TARGET void gemmSwapped(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                                  const uint16_t *b, int64_t ldb, char *c, int64_t ldc, bool cBf16,
                                  bool load, void *pack, const LowRank *lowRank,
                                  const DecodedB *decodedB) {
  const int64_t allUnits = ceilDiv(k, 2), blocks = ceilDiv(allUnits, kSwapBlockUnits);
  const int64_t cElt = cBf16 ? 2 : 4;
  uint32_t *panels = static_cast<uint32_t *>(pack);
  float *stage = reinterpret_cast<float *>(static_cast<char *>(pack) +
                                           packedBBytes(std::min(m, kSwapGroup), k, true));
  const int64_t ldStage = kSwapGroup;
  // With lowRank: C^T += op(V)^T U^T, op(V)^T's rows the micro-kernel's
  // rows after B's: read in place where V is stored n x k (transV), else
  // copied a row block at a time (`lowRows`: kSwapRows rows of its k
  // values, a few hundred bytes); U^T packed into panels for each group of
  // A's rows, after the sums.
  const int64_t lowUnits = lowRank ? ceilDiv(lowRank->k, 2) : 0;
  const int64_t lowLd = lowRank ? swappedLowLd(lowRank->k) : 0;
  uint32_t *lowPanels = reinterpret_cast<uint32_t *>(stage + kSwapRows * ldStage);
  uint16_t *lowRows = reinterpret_cast<uint16_t *>(
      lowPanels + (lowRank ? ceilDiv(std::min(m, kSwapGroup), kPanel) * kPanel * lowUnits : 0));
  // With decodedB: a row block's rows of B over a depth block, decoded from
  // the decoder's rows as the micro-kernel's rows (in L1), not B's.
  uint16_t *decoded = lowRows + (lowRank ? kSwapRows * lowLd : 0);
  const char *bBytes = reinterpret_cast<const char *>(b);
  // The rows of B at i0 (rows of them) over the whole depth, as stored: in
  // B, or the decoder's codes (none: nothing to fetch).
  auto bRows = [&](int64_t i0, int64_t rows) {
    if (!decodedB)
      return Prefetch(bBytes + i0 * ldb * 2, rows, k * 2, ldb * 2, blocks);
    const DecodedB &d = *decodedB;
    if (!d.codes)
      return Prefetch();
    const auto at = [&](int64_t v) { return d.halfBytes ? v / 2 : v; };
    return Prefetch(reinterpret_cast<const char *>(d.codes) + (d.rowOffset + i0) * d.codesLd +
                        at(d.colOffset),
                    rows, at(d.colOffset + k - 1) - at(d.colOffset) + 1, d.codesLd, blocks);
  };
  for (int64_t j0 = 0; j0 < m; j0 += kSwapGroup) {
    const int64_t mb = std::min(kSwapGroup, m - j0), panelCount = ceilDiv(mb, kPanel);
    packB(mb, k, a + j0 * lda, lda, true, true, panels);
    if (lowRank)
      packB(mb, lowRank->k, static_cast<const uint16_t *>(lowRank->u) + j0 * lowRank->ldu,
            lowRank->ldu, true, true, lowPanels);
    for (int64_t i0 = 0; i0 < n; i0 += kSwapRows) {
      const int64_t rows = std::min(kSwapRows, n - i0), halves = ceilDiv(rows, kRows);
      if (load)
        transposeInto(c + (j0 * ldc + i0) * cElt, ldc, mb, rows, stage, ldStage, false);
      // op(V)^T's rows of this row block: V's rows in place, or its
      // columns transposed into lowRows (a lone last value's high half is
      // never read: LowPart::halfLast).
      const char *lowA = nullptr;
      int64_t lowRow = 0;
      if (lowRank && lowRank->transV) {
        lowA = static_cast<const char *>(lowRank->v) + i0 * lowRank->ldv * 2;
        lowRow = lowRank->ldv * 2;
      } else if (lowRank) {
        transposeInto(static_cast<const uint16_t *>(lowRank->v) + i0, lowRank->ldv, lowRank->k,
                      rows, lowRows, lowLd, true);
        lowA = reinterpret_cast<const char *>(lowRows);
        lowRow = lowLd * 2;
      }
      // The next rows of B over the whole depth, a depth block's piece of
      // each at a time, spread over this row block's calls.
      Prefetch next;
      if (i0 + kSwapRows < n)
        next = bRows(i0 + kSwapRows, std::min(kSwapRows, n - i0 - kSwapRows));
      next.spread(blocks * panelCount * halves);
      for (int64_t u0 = 0; u0 < allUnits; u0 += kSwapBlockUnits) {
        const int64_t units = std::min(kSwapBlockUnits, allUnits - u0);
        const bool last = u0 + units == allUnits, halfLast = last && k % 2 == 1;
        // B's rows of this row block and depth block: as stored, or decoded.
        const char *bAt = bBytes + (i0 * ldb + 2 * u0) * 2;
        int64_t bRow = ldb * 2;
        if (decodedB) {
          decodedB->read(i0, i0 + rows, 2 * u0, std::min(k, 2 * (u0 + units)), decoded,
                         kSwapDecodedLd);
          bAt = reinterpret_cast<const char *>(decoded);
          bRow = kSwapDecodedLd * 2;
        }
        for (int64_t q = 0; q < panelCount; ++q) {
          const int cols = int(std::min<int64_t>(kPanel, mb - q * kPanel));
          for (int64_t h = 0; h < halves; ++h) {
            const int r = int(std::min<int64_t>(kRows, rows - h * kRows));
            float *sums = stage + h * kRows * ldStage + q * kPanel;
            Lines ahead;
            next.next(ahead);
            const LowPart low{lowA + h * kRows * lowRow, lowRow, lowUnits,
                              lowRank && lowRank->k % 2 == 1, lowPanels + q * lowUnits * kPanel};
            microSwapFor(r, cols)(units, bAt + h * kRows * bRow, bRow, 4, halfLast,
                                  panels + (q * allUnits + u0) * kPanel,
                                  u0 > 0 || load ? sums : nullptr, ldStage, sums, ldStage, false,
                                  cols, nullptr, 0, 0, nullptr, nullptr, ahead,
                                  last && lowRank ? &low : nullptr);
          }
        }
      }
      storeTransposedSums(stage, ldStage, rows, mb, c + (j0 * ldc + i0) * cElt, ldc, cBf16);
    }
  }
}

} // namespace

bool dotForm(bool transA, bool transB, bool bf16) {
  static const bool chosen = [] {
    const char *value = envValue("MOEC_DOT_FORM");
    if (value && std::strcmp(value, "on") == 0)
      return true;
    if (value && std::strcmp(value, "off") == 0)
      return false;
    if (value && std::strcmp(value, "auto") != 0)
      std::fprintf(stderr, "moec: %s is neither 'auto', 'on' nor 'off'; using 'auto'\n",
                   envShown("MOEC_DOT_FORM", value).c_str());
    // Where it pays (Tile.h): a core that runs a 512-bit operation as two
    // 256-bit halves (AMD family 19h, Zen 4).
    const CpuSignature cpu = cpuSignature();
    return cpu.amd && cpu.family == 0x19;
  }();
  return chosen && bf16 && transB && !transA && available(true) && !amx();
}

bool swappedForm(int64_t n, int64_t k, bool transA, bool transB, bool bf16) {
  static const bool allowed = envAutoOrOff("MOEC_SWAPPED_FORM");
  return allowed && bf16 && transB && !transA && !narrowC(bf16, n) && k >= kSwapDepth &&
         available(true) && !amx() && !dotForm(transA, transB, bf16);
}

bool available(bool bf16) {
  // (DQ too, which every CPU with BW and VL has: the bf16 rounding's
  // check for subnormals uses it.)
  static const bool f32 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  static const bool dot = f32 && __builtin_cpu_supports("avx512bf16");
  return bf16 ? dot : f32;
}

void gemm(int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, bool transA, const void *b,
          int64_t ldb, bool transB, bool bf16, void *c, int64_t ldc, bool cBf16, bool load,
          void *pack, bool stream, const void *packedB, const DecodedB *decodedB,
          const AddScaled *addScaled, const LowRank *lowRank) {
  // A lead product (LowRank::Lead) the AMX tile does not compute from its
  // own tiles of op(A): U by the call that would write it on its own, then
  // the product with U as given.
  if (lowRank && lowRank->lead && !(bf16 && amx() && leadInTile(k, transA))) {
    const LowRank::Lead &lead = *lowRank->lead;
    AddScaled scaled;
    gemm(m, lowRank->k, k, a, lda, false, lead.b, lead.ldb, lead.transB, bf16, lead.u, lowRank->ldu,
         bf16, false, pack, false, lead.packedB, nullptr, lead.scaled(&scaled));
    LowRank rest = *lowRank;
    rest.lead = nullptr;
    gemm(m, n, k, a, lda, transA, b, ldb, transB, bf16, c, ldc, cBf16, load, pack, stream, packedB,
         decodedB, addScaled, &rest);
    return;
  }
  // A narrow C whose A is stored transposed (a LoRA adapter's weight
  // gradient, X^T dU: m the model's width, n the rank) is computed as its
  // transpose, C^T = op(B)^T op(A)^T, into the working memory, then written
  // to C transposed. There B is the narrow operand (packed whole, small)
  // and A is read along its rows as stored, where C's own form would pack
  // A transposed 16 x 16 values at a time. Each element is the same sum of
  // the same products in the same depth order (both the tile dot products
  // and the micro-kernel's multiply the two operands' values pairwise), and
  // C^T starts from C where `load` asks for it, so the bits are C's own
  // form's.
  if (narrowTransposed(m, n, transA, decodedB, addScaled) && !transB && !packedB) {
    const int64_t ldT = transposedLd(m);
    char *cT = static_cast<char *>(pack);
    if (load)
      transposeInto(c, ldc, m, n, cT, ldT, cBf16);
    gemm(n, m, k, b, ldb, true, a, lda, false, bf16, cT, ldT, cBf16, load,
         cT + transposedBytes(m, n, cBf16));
    transposeInto(cT, ldT, n, m, c, ldc, cBf16);
    return;
  }
  if (bf16 && amx())
    return gemmAmx(m, n, k, a, lda, transA, b, ldb, transB, c, ldc, cBf16, load, pack, stream,
                   packedB, decodedB, addScaled, lowRank);
  if (swapsCall(n, k, transA, transB, bf16, decodedB, addScaled, lowRank, stream, packedB))
    return gemmSwapped(m, n, k, static_cast<const uint16_t *>(a), lda,
                       static_cast<const uint16_t *>(b), ldb, static_cast<char *>(c), ldc, cBf16,
                       load, pack, lowRank, decodedB);
  // A transposed op(B) (B stored n x k) in the dot form (the header says
  // why); a B packed beforehand is not read there.
  if (dotForm(transA, transB, bf16))
    return gemmDot(m, n, k, static_cast<const uint16_t *>(a), lda, static_cast<const uint16_t *>(b),
                   ldb, static_cast<char *>(c), ldc, cBf16, load, pack, decodedB, addScaled,
                   lowRank);
  // With packedB: op(B) packed whole (packB), panel Q of the columns at
  // [Q][unit over the whole depth][kPanel]; nothing is packed here.
  const uint32_t *prepacked = static_cast<const uint32_t *>(packedB);
  // A bf16 C at most 16 columns wide (a LoRA adapter's rank-r product) is
  // computed kNarrowRows rows a call on the panel's first vector, not
  // kRows rows on all three, two of them empty.
  const bool narrow = narrowC(bf16, n);
  // Depth blocks of kBlockUnits units, or kPackedBlockUnits where B was
  // packed beforehand: its panels are read where they lie, so a deeper
  // block needs no more memory here, and it passes the partial sums
  // between blocks a quarter as often; likewise where a decoder writes the
  // panels straight (quantized codes packed beforehand). (A narrow call's
  // stage holds one block of A's rows: kBlockUnits.)
  const bool deep = (prepacked || (decodedB && decodedB->panel)) && !narrow;
  // (Or the whole depth in one block where it is a little deeper than
  // kBlockUnits: madeBlockUnits.)
  const int64_t per = perUnit(bf16), allUnits = ceilDiv(k, per);
  const int64_t made = madeBlockUnits(allUnits, narrow);
  const int64_t blockUnits = deep       ? kPackedBlockUnits
                             : decodedB ? kBlockUnits
                                        : made,
                depth = blockUnits * per;
  // The units between two of a block's panels packed here.
  const int64_t panelStride = blockUnits * kPanel;
  const int64_t elt = bf16 ? 2 : 4, cElt = cBf16 ? 2 : 4;
  const int64_t width = std::min(n, kGroup);
  uint32_t *panels = static_cast<uint32_t *>(pack);
  // op(A) stored k x m: packed once for the whole depth, in panels of
  // kAPanel rows, each [t][i] over all units: a row block's units lie one
  // after the other, 64 bytes apart, as the micro-kernel walks them (rows of
  // units m wide would put them a multiple of 4 KiB apart, on one set of
  // the L1 cache).
  const int64_t aPanelUnits = allUnits * kAPanel;
  char *after = static_cast<char *>(pack) + panelBytes(width, decodedB != nullptr, made);
  uint32_t *packedA = reinterpret_cast<uint32_t *>(after);
  if (transA)
    packRows(a, lda, 0, k, m, bf16, packedA, kAPanel, kAPanel, aPanelUnits);
  // Where the sums of the blocks before the last one live: C itself when it
  // is fp32 and they are its values, else fp32 partial sums (m x width).
  const bool apart = cBf16 || addScaled;
  float *partialBase = reinterpret_cast<float *>(after + packedABytes(m, k, transA, bf16));
  // With decodedB: one panel's part of a transposed B per depth block, or a
  // column group's of a B as stored, decoded (after the partial sums, which
  // a bf16 C deeper than one block needs).
  uint16_t *decoded = reinterpret_cast<uint16_t *>(reinterpret_cast<char *>(partialBase) +
                                                   partialBytes(m, n, k, bf16, apart));
  // With lowRank: its V's panels of one column group, its whole depth (after
  // the decoded part of B, on a line of their own), and U's rows in place.
  const int64_t lowUnits = lowRank ? ceilDiv(lowRank->k, per) : 0, lowStride = lowUnits * kPanel;
  uint32_t *lowPanels = nullptr;
  if (lowRank) {
    const uintptr_t end =
        reinterpret_cast<uintptr_t>(decoded) + (decodedB ? decodedAvx512Bytes() : 0);
    lowPanels = reinterpret_cast<uint32_t *>((end + 63) & ~uintptr_t(63));
  }
  const char *aBytes = static_cast<const char *>(a), *bBytes = static_cast<const char *>(b);
  // The rows of B's column group at j0 (nb wide), depth [q0, q1), and of A
  // (read in place) at depth [q0, q1): what a later block will pack or read.
  auto bRegion = [&](int64_t j0, int64_t nb, int64_t q0, int64_t q1) {
    if (decodedB) { // the decoder's codes of those rows and columns
      const DecodedB &d = *decodedB;
      if (!d.codes)
        return Prefetch();
      if (d.panel) // the panels' units, one run a panel
        return Prefetch(reinterpret_cast<const char *>(d.codes) + (j0 / kPanel) * d.codesLd +
                            (q0 / 2) * d.unitBytes,
                        ceilDiv(nb, kPanel), (ceilDiv(q1, 2) - q0 / 2) * d.unitBytes, d.codesLd);
      const auto at = [&](int64_t v) { return d.halfBytes ? v / 2 : v; };
      const int64_t r0 = d.rowOffset + (transB ? j0 : q0), rows = transB ? nb : q1 - q0;
      const int64_t c0 = d.colOffset + (transB ? q0 : j0), cols = transB ? q1 - q0 : nb;
      return Prefetch(reinterpret_cast<const char *>(d.codes) + r0 * d.codesLd + at(c0), rows,
                      at(c0 + cols - 1) - at(c0) + 1, d.codesLd);
    }
    if (prepacked)
      return Prefetch(reinterpret_cast<const char *>(
                          prepacked + ((j0 / kPanel) * allUnits + q0 / per) * kPanel),
                      ceilDiv(nb, kPanel), ceilDiv(q1 - q0, per) * kPanel * 4,
                      allUnits * kPanel * 4, ceilDiv(ceilDiv(q1 - q0, per) * kPanel * 4, 1024));
    return transB ? Prefetch(bBytes + (j0 * ldb + q0) * elt, nb, (q1 - q0) * elt, ldb * elt)
                  : Prefetch(bBytes + (q0 * ldb + j0) * elt, q1 - q0, nb * elt, ldb * elt);
  };
  // The rows of C's column group at j0, nb wide.
  auto cRegion = [&](int64_t j0, int64_t nb) {
    return Prefetch(static_cast<const char *>(c) + j0 * cElt, m, nb * cElt, ldc * cElt);
  };
  auto aRegion = [&](int64_t q0, int64_t q1) {
    return transA ? Prefetch() : Prefetch(aBytes + q0 * elt, m, (q1 - q0) * elt, lda * elt);
  };
  const int64_t rowStep = narrow ? kNarrowRows : kRows;
  // The micro-kernel of a call of `rows` rows (not the first row block's of
  // a B packed in the call).
  auto kernelFor = [&](int rows) {
    if (narrow)
      return transA ? microNarrowFor(rows) : microNarrowFor<kNarrowStageRow>(rows);
    return bf16 ? microFor<true>(rows) : microFor<false>(rows);
  };
  // With `stream`: a row block's sums over a column group, on their way to C.
  alignas(64) float stage[std::max<int64_t>(kRows * kGroup, kNarrowRows * 16)];
  // A narrow call's rows of A (read in place otherwise), copied
  // kNarrowStageRow bytes apart: rows as stored a multiple of 4 KiB apart
  // share one set of the L1 cache, and a stride the micro-kernel knows
  // addresses its sixteen rows from one register, where sixteen pointers
  // spilled (the narrow tile 1.1-1.3x where A is 2048 wide, warm or from
  // memory; level where it is 768).
  alignas(64) char narrowStage[kNarrowRows * kNarrowStageRow];
  // Column groups of kGroup, each over the whole depth: its partial sums and
  // panels stay in L2 while the depth passes.
  for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
    const int64_t nb = std::min(kGroup, n - j0);
    const void *bGroup = decodedB ? nullptr : bBytes + (transB ? j0 * ldb : j0) * elt;
    char *cGroup = static_cast<char *>(c) + j0 * cElt;
    float *partial = apart ? partialBase : reinterpret_cast<float *>(cGroup);
    const int64_t ldPartial = apart ? nb : ldc;
    if (lowRank) {
      const char *v =
          static_cast<const char *>(lowRank->v) + (lowRank->transV ? j0 * lowRank->ldv : j0) * elt;
      if (lowRank->transV)
        packTransposed(v, lowRank->ldv, nb, 0, lowRank->k, bf16, lowPanels, lowStride);
      else
        packRows(v, lowRank->ldv, 0, lowRank->k, nb, bf16, lowPanels, kPanel, kPanel, lowStride);
    }
    for (int64_t p0 = 0; p0 < k; p0 += depth) {
      const int64_t p1 = std::min(k, p0 + depth);
      const int64_t units = ceilDiv(p1 - p0, per);
      // An op(B) stored k x n is packed by the first row block's calls
      // (micro's PACK), where its loads overlap the dot products (fp32 too:
      // on a Zen 4 core, whose 512-bit operations take two cycles, the fp32
      // up_proj and down_proj tiles 1.04-1.13x a pass of its own first); the
      // others here. (A transposed op(B) packed by the calls, 16 units of
      // its 48 rows at a time by transposes, was not faster.)
      const bool packInCall = !transB && !prepacked && !decodedB && !narrow;
      // (A B packed beforehand is read where packB put it.)
      if (decodedB && !transB && decodedB->pairs && !decodedB->panel) {
        // B as stored (k x n) by a decoder that writes the column group's
        // panels' units itself: no bf16 rows in between (the qwen3
        // backward's quantized dA and dX tiles 1.02-1.10x rows of the whole
        // group decoded, then packed; those 1.04-1.10x a panel's at a time;
        // the log, 2026-11-30).
        decodedB->readPairs(p0, p1, j0, j0 + nb, panels, panelStride);
      } else if (decodedB) {
        // Panel by panel.
        for (int64_t q = 0; q * kPanel < nb; ++q)
          decodePanel(*decodedB, transB, j0 + q * kPanel,
                      std::min<int64_t>(kPanel, nb - q * kPanel), p0, p1, panels + q * panelStride,
                      decoded);
      } else if (!prepacked && transB)
        packTransposed(bGroup, ldb, nb, p0, p1, bf16, panels, panelStride);
      else if (!prepacked && !packInCall)
        packRows(bGroup, ldb, p0, p1, nb, bf16, panels, kPanel, kPanel, panelStride);
      // A's unit (row i0 + r, unit t) of this block lies at
      // aRows(i0) + r * aRow + t * aUnit bytes.
      int64_t aRow, aUnit;
      bool halfLast = false;
      if (transA) {
        aRow = 4;
        aUnit = kAPanel * 4;
      } else {
        aRow = lda * elt;
        aUnit = 4;
        halfLast = bf16 && (p1 - p0) % 2 == 1;
      }
      auto aRows = [&](int64_t i0) {
        if (!transA)
          return aBytes + p0 * elt + i0 * aRow;
        return reinterpret_cast<const char *>(packedA + (i0 / kAPanel) * aPanelUnits +
                                              (p0 / per) * kAPanel + i0 % kAPanel);
      };
      // This block adds onto C (load) or onto the blocks before it; the
      // last block writes C.
      const float *in =
          p0 > 0 ? partial : load ? reinterpret_cast<const float *>(cGroup) : nullptr;
      const int64_t ldIn = p0 > 0 ? ldPartial : ldc;
      const bool last = p1 == k;
      char *out = last ? cGroup : reinterpret_cast<char *>(partial);
      const int64_t ldOut = last ? ldc : ldPartial;
      const bool outBf16 = last && cBf16;
      const int64_t outElt = outBf16 ? 2 : 4;
      // What comes next: this group's next block, or the next group's first.
      // When that block reads C or writes it through the caches, C's lines
      // too, so that its stores do not wait for them to come from memory.
      Prefetch nextB, nextA, nextC;
      if (p1 < k) {
        nextB = bRegion(j0, nb, p1, std::min(k, p1 + depth));
        nextA = aRegion(p1, std::min(k, p1 + depth));
        if (p1 + depth >= k && !stream)
          nextC = cRegion(j0, nb);
      } else if (j0 + kGroup < n) {
        nextB = bRegion(j0 + kGroup, std::min(kGroup, n - j0 - kGroup), 0, std::min(k, depth));
        nextA = aRegion(0, std::min(k, depth));
        if ((k <= depth || load) && !stream)
          nextC = cRegion(j0 + kGroup, std::min(kGroup, n - j0 - kGroup));
      }
      const int64_t calls = ceilDiv(nb, kPanel) * ceilDiv(m, rowStep);
      for (Prefetch *next : {&nextB, &nextA, &nextC})
        next->spread(calls);
      auto call = [&](int64_t q, int64_t i0, char *to, int64_t ldTo) {
        const int cols = int(std::min<int64_t>(kPanel, nb - q * kPanel));
        const int rows = int(std::min<int64_t>(rowStep, m - i0));
        const Micro kernel = packInCall && i0 == 0
                                 ? (bf16 ? microFor<true, true>(rows) : microFor<false, true>(rows))
                                 : kernelFor(rows);
        Lines ahead;
        nextB.next(ahead);
        nextA.next(ahead);
        nextC.next(ahead);
        uint32_t *panel = prepacked ? const_cast<uint32_t *>(prepacked) +
                                          ((j0 / kPanel + q) * allUnits + p0 / per) * kPanel
                                    : panels + q * panelStride;
        const AddScaled *scaled = last ? addScaled : nullptr;
        const char *addend = scaled && scaled->addend
                                 ? static_cast<const char *>(scaled->addend) +
                                       (i0 * scaled->ld + j0 + q * kPanel) * cElt
                                 : nullptr;
        const char *aAt = aRows(i0);
        LowPart low;
        if (last && lowRank) {
          low.a = static_cast<const char *>(lowRank->u) + i0 * lowRank->ldu * elt;
          low.aRow = lowRank->ldu * elt;
          low.units = lowUnits;
          low.halfLast = bf16 && lowRank->k % 2 == 1;
          low.panel = lowPanels + q * lowStride;
        }
        if (narrow && !transA) { // (the kernel reads the stage)
          for (int r = 0; r < rows; ++r)
            std::memcpy(narrowStage + r * kNarrowStageRow, aAt + r * aRow, size_t(p1 - p0) * elt);
          aAt = narrowStage;
        }
        kernel(units, aAt, aRow, aUnit, halfLast, panel, in ? in + i0 * ldIn + q * kPanel : nullptr,
               ldIn, to + q * kPanel * outElt, ldTo, outBf16, cols,
               packInCall ? static_cast<const char *>(bGroup) + (p0 * ldb + q * kPanel) * elt
                          : nullptr,
               ldb, p1 - p0, scaled, addend, ahead, last && lowRank ? &low : nullptr);
      };
      if (last && stream) {
        // Row block by row block: the group's columns of kRows rows are
        // summed into `stage`, then written to C whole, around the caches.
        for (int64_t i0 = 0; i0 < m; i0 += rowStep) {
          for (int64_t q = 0; q * kPanel < nb; ++q)
            call(q, i0, reinterpret_cast<char *>(stage), nb);
          for (int64_t r = 0; r < std::min<int64_t>(rowStep, m - i0); ++r)
            streamCopy(out + (i0 + r) * ldOut * outElt,
                       reinterpret_cast<const char *>(stage) + r * nb * outElt,
                       size_t(nb * outElt));
        }
      } else {
        // Panel by panel: the panel stays in L1 while every row block of A
        // passes over it.
        for (int64_t q = 0; q * kPanel < nb; ++q)
          for (int64_t i0 = 0; i0 < m; i0 += rowStep)
            call(q, i0, out + i0 * ldOut * outElt, ldOut);
      }
    }
  }
  // The streamed stores reach memory before anything the caller stores
  // after this (the event that says the tile is done).
  if (stream)
    _mm_sfence();
}

void packB(int64_t n, int64_t k, const void *b, int64_t ldb, bool transB, bool bf16, void *dst) {
  const int64_t per = perUnit(bf16), allUnits = ceilDiv(k, per);
  uint32_t *out = static_cast<uint32_t *>(dst);
  if (!transB) {
    packRows(b, ldb, 0, k, n, bf16, out, kPanel, kPanel, allUnits * kPanel);
    return;
  }
  // The whole depth at once: each of 16 rows of B read from its start to its
  // end (streams the hardware prefetcher follows), not in a depth block's
  // pieces, every row again per block.
  packTransposed(b, ldb, n, 0, k, bf16, out, allUnits * kPanel);
}

#else // !MOEC_TILE_X86

bool available(bool) { return false; }

bool dotForm(bool, bool, bool) { return false; }

bool swappedForm(int64_t, int64_t, bool, bool, bool) { return false; }

namespace {
[[noreturn]] void absent() {
  std::fprintf(stderr, "moec: the AVX-512 tile was called on a CPU without it\n");
  std::abort();
}
} // namespace

void gemm(int64_t, int64_t, int64_t, const void *, int64_t, bool, const void *, int64_t, bool, bool,
          void *, int64_t, bool, bool, void *, bool, const void *, const DecodedB *,
          const AddScaled *, const LowRank *) {
  absent();
}

void packB(int64_t, int64_t, const void *, int64_t, bool, bool, void *) { absent(); }

#endif // MOEC_TILE_X86

} // namespace moec::cpu::tile
