//===- Fp8.h - FP8 e4m3 values and rows quantized in blocks -----*- C++ -*-===//
//
// FP8 e4m3 as OCP's "E4M3FN" (and torch.float8_e4m3fn, DeepEP's dispatch):
// sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111
// is NaN; the largest finite value is 448 (0.1111.110); subnormals down to
// 2^-9. fp32 -> e4m3 rounds to nearest, ties to even, and saturates: a
// finite value past 448 and an infinity give +-448 (as PTX's
// cvt.rn.satfinite); a NaN gives NaN with its sign. e4m3 -> fp32 is exact.
//
// A quantized row of H values holds, in this order,
//   H bytes        the e4m3 codes of value / scale
//   B fp32 scales  one per block of 128 values (B = ceil(H / 128), the last
//                  block may be shorter), scale = amax(block) / 448
// so it is fp8RowBytes(H) = H + 4 * B bytes long (base/DType.h) and one put
// moves it whole.
// A block of zeros has scale 1 (and codes 0). A block that holds a NaN or an
// infinity gets a NaN scale: it dequantizes to NaN, never to a finite value.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_FP8_H
#define MOEC_RUNTIME_CPU_FP8_H

#include "base/DType.h"

#include <cstddef>
#include <cstdint>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moec::cpu {

/// The largest finite e4m3 value.
constexpr float kFp8Max = 448.0f;

/// The e4m3 code nearest to `value` (ties to even), saturating at +-448.
uint8_t floatToE4m3(float value);

/// The fp32 value of e4m3 code `code` (exact; NaN for S.1111.111).
float e4m3ToFloat(uint8_t code);

#if defined(__x86_64__)
/// `values` (those of the 16 e4m3 codes `codes`) with each lane whose code
/// is a NaN code (S.1111.111) a quiet NaN of the code's sign: (v & sign) |
/// 0x7FC00000. For kernels built for AVX-512 (F, BW, VL).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 e4m3MendNaN16(__m512 values,
                                                                                 __m128i codes) {
  const __mmask16 nan =
      _mm_cmpeq_epi8_mask(_mm_and_si128(codes, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
  if (nan == 0)
    return values;
  return _mm512_castsi512_ps(_mm512_mask_ternarylogic_epi32(_mm512_castps_si512(values), nan,
                                                            _mm512_set1_epi32(int(0x80000000u)),
                                                            _mm512_set1_epi32(0x7FC00000), 0xEA));
}

/// The fp32 values of 16 e4m3 codes (bytes) times 2^-8, by way of fp16: a
/// code's bits shifted into fp16's place (exponent and mantissa to bits
/// 7-13, the sign to bit 15) are an fp16 whose value is the code's times
/// 2^-8, subnormal codes too, converted to fp32 exactly. NaN codes, rare in
/// weights, are mended (e4m3MendNaN16) unless the caller knows there are
/// none (`mayHoldNaN` false). For a caller that folds the 2^8 into a scale
/// it multiplies by; kernels built for AVX-512 (F, BW, VL).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512
e4m3HalfValues16(__m128i codes, bool mayHoldNaN = true) {
  // Bits 7-14: the code; its sign (bit 14) moved to bit 15 by adding the
  // bit to itself (bit 15 is clear).
  const __m256i x = _mm256_slli_epi16(_mm256_cvtepu8_epi16(codes), 7);
  const __m256i half = _mm256_add_epi16(x, _mm256_and_si256(x, _mm256_set1_epi16(0x4000)));
  const __m512 v = _mm512_cvtph_ps(half);
  return mayHoldNaN ? e4m3MendNaN16(v, codes) : v;
}

/// The fp32 values of 16 e4m3 codes, e4m3ToFloat's: e4m3HalfValues16's
/// scaled by 2^8, exactly (a mended NaN stays the same NaN).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512
e4m3Values16(__m128i codes, bool mayHoldNaN = true) {
  return _mm512_mul_ps(e4m3HalfValues16(codes, mayHoldNaN), _mm512_set1_ps(256.0f));
}

/// The values of 32 e4m3 codes, 16 from `a` into `lo` and 16 from `b` into
/// `hi`, times 2^-8: e4m3Values16's fp16 values before its scaling, made
/// for both halves at once (one widening, shift and sign move over 32
/// lanes), for a caller that folds the 2^8 into a scale it multiplies by.
/// NaN codes mended as e4m3Values16 mends them (`mayHoldNaN`).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void
e4m3HalfValues32(__m128i a, __m128i b, __m512 &lo, __m512 &hi, bool mayHoldNaN) {
  const __m512i x = _mm512_slli_epi16(
      _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1)), 7);
  const __m512i half = _mm512_add_epi16(x, _mm512_and_si512(x, _mm512_set1_epi16(0x4000)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(half));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(half, 1));
  if (mayHoldNaN) {
    lo = e4m3MendNaN16(lo, a);
    hi = e4m3MendNaN16(hi, b);
  }
}

#endif

/// Quantizes rows [rowBegin, rowEnd) of `src` (`cols` values a row of type
/// `elt`, F32 or BF16, rows `srcLd` elements apart) into rows of `dst`,
/// fp8RowBytes(cols) bytes each, `dstLd` bytes apart.
void quantizeRows(const void *src, DType elt, int64_t srcLd, uint8_t *dst, int64_t dstLd,
                  int64_t rowBegin, int64_t rowEnd, int64_t cols);

/// The inverse: rows [rowBegin, rowEnd) of quantized `src` (`srcLd` bytes
/// apart) as values of type `elt` in `dst` (rows `dstLd` elements apart):
/// code value times its block's scale, rounded once to `elt`.
void dequantizeRows(const uint8_t *src, int64_t srcLd, void *dst, DType elt, int64_t dstLd,
                    int64_t rowBegin, int64_t rowEnd, int64_t cols);

/// FP8 weights in 128 x 128 blocks (DeepSeek-V3's `weight` and
/// `weight_scale_inv`): a [rows, cols] matrix is e4m3 codes [rows, cols]
/// and fp32 scales [ceil(rows / 128), ceil(cols / 128)], and value (i, j) is
/// code(i, j) x scale(i / 128, j / 128). A block's scale is amax / 448 as
/// for rows (1 for a block of zeros, NaN for one that holds a NaN or an
/// infinity).
constexpr int64_t kFp8WeightBlock = 128;

/// Quantizes the fp32 matrix `src` [rows, cols] (row stride srcLd) into
/// `codes` [rows, cols] (contiguous) and `scales` [ceil(rows / 128),
/// ceil(cols / 128)] (contiguous).
void quantizeBlocks(const float *src, int64_t srcLd, int64_t rows, int64_t cols, uint8_t *codes,
                    float *scales);

/// Rows [rowBegin, rowEnd) and columns [colBegin, colEnd) of a block-scaled
/// FP8 matrix [rows, cols] (codes contiguous, scales as quantizeBlocks
/// writes them) as values of type `elt` (F32 or BF16; code x scale rounded
/// once) into `dst`, row i, column j at (i - rowBegin) * dstLd + (j -
/// colBegin).
void dequantizeBlocks(const uint8_t *codes, const float *scales, int64_t cols, int64_t rowBegin,
                      int64_t rowEnd, int64_t colBegin, int64_t colEnd, void *dst, DType elt,
                      int64_t dstLd);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_FP8_H
