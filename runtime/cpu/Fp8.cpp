//===- Fp8.cpp - FP8 e4m3 values and rows quantized in blocks ---------------===//
//
// A block's codes and its decoding run eight values at a time with AVX2
// where the CPU has it (chosen at run time), with the same bits as the
// scalar floatToE4m3 / table decode they fall back to (and finish with).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Fp8.h"

#include "runtime/cpu/Element.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 reports the undefined vectors its own AVX-512 headers start some
// intrinsics from (_mm512_undefined_*) as maybe uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MOEC_FP8_AVX2 1
#endif

namespace moec::cpu {

uint8_t floatToE4m3(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u)
    return sign | 0x7Fu; // NaN
  if (magnitude >= 0x43E00000u)
    return sign | 0x7Eu; // 448 and up, infinity included: saturate
  if (magnitude < 0x3C800000u) {
    // Below 2^-6, the smallest normal: a multiple of 2^-9 (a subnormal code,
    // or 0x08 = 2^-6 when it rounds up). The product is exact; nearbyint
    // rounds ties to even.
    float abs;
    std::memcpy(&abs, &magnitude, sizeof abs);
    return sign | uint8_t(std::nearbyint(abs * 512.0f));
  }
  // A normal: keep 3 of the 23 mantissa bits, rounding to nearest, ties to
  // even; a carry out of the mantissa bumps the exponent. fp32's exponent
  // bias is 127, e4m3's 7.
  const uint32_t rounded = (magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20;
  const uint32_t code = rounded - (120u << 3);
  return sign | uint8_t(std::min<uint32_t>(code, 0x7Eu));
}

namespace {

std::array<float, 256> decodeTable() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xF, mantissa = code & 7;
    float v;
    if (exponent == 0xF && mantissa == 7)
      v = std::numeric_limits<float>::quiet_NaN();
    else if (exponent == 0)
      v = std::ldexp(float(mantissa), -9);
    else
      v = std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
    table[size_t(code)] = code & 0x80 ? -v : v;
  }
  return table;
}

const std::array<float, 256> &decoded() {
  static const std::array<float, 256> table = decodeTable();
  return table;
}

} // namespace

float e4m3ToFloat(uint8_t code) { return decoded()[code]; }

namespace {

#ifdef MOEC_FP8_AVX2
/// floatToE4m3 of eight lanes, as 32-bit lanes.
__attribute__((target("avx2"))) __m256i e4m3Avx2(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  // Normals: keep 3 mantissa bits, ties to even; rebias 127 -> 7.
  const __m256i lowestKept = _mm256_and_si256(_mm256_srli_epi32(magnitude, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(magnitude, _mm256_set1_epi32(0x7FFFF)), lowestKept), 20);
  const __m256i normal =
      _mm256_min_epi32(_mm256_sub_epi32(rounded, _mm256_set1_epi32(120 << 3)), _mm256_set1_epi32(0x7E));
  // Below 2^-6: multiples of 2^-9, rounded to nearest even.
  const __m256i subnormal = _mm256_cvtps_epi32(
      _mm256_round_ps(_mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(512.0f)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  __m256i code = _mm256_blendv_epi8(
      normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), magnitude));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E),
                            _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x43DFFFFF)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F),
                            _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7F800000)));
  return _mm256_or_si256(code, sign);
}

/// Codes of values[0..n) / scale; returns how many it wrote (a multiple of 8).
__attribute__((target("avx2"))) int64_t encodeAvx2(const float *values, int64_t n, float scale,
                                                   uint8_t *codes) {
  const __m256 s = _mm256_set1_ps(scale);
  // The low byte of each 32-bit lane, gathered into each 128-bit half's low 4 bytes.
  const __m256i lowBytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                            -1, -1, -1, -1);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i c = _mm256_shuffle_epi8(e4m3Avx2(_mm256_div_ps(_mm256_loadu_ps(values + j), s)),
                                          lowBytes);
    const uint32_t lo = uint32_t(_mm_cvtsi128_si32(_mm256_castsi256_si128(c)));
    const uint32_t hi = uint32_t(_mm_cvtsi128_si32(_mm256_extracti128_si256(c, 1)));
    std::memcpy(codes + j, &lo, 4);
    std::memcpy(codes + j + 4, &hi, 4);
  }
  return j;
}

/// amax of |values[0..n)| and whether all are finite, 8 lanes at a time;
/// returns how many it read.
__attribute__((target("avx2"))) int64_t amaxAvx2(const float *values, int64_t n, float *amax,
                                                 bool *finite) {
  __m256 m = _mm256_setzero_ps();
  __m256i special = _mm256_setzero_si256();
  const __m256i absMask = _mm256_set1_epi32(0x7FFFFFFF), exponent = _mm256_set1_epi32(0x7F800000);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i bits = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(values + j)), absMask);
    special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent));
    m = _mm256_max_ps(m, _mm256_castsi256_ps(bits));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float v : lanes)
    *amax = std::max(*amax, v);
  *finite = *finite && _mm256_testz_si256(special, special);
  return j;
}

/// values[j] = table[codes[j]] * scale, 8 lanes at a time; returns how many.
__attribute__((target("avx2"))) int64_t decodeAvx2(const uint8_t *codes, int64_t n, float scale,
                                                   const float *table, float *values) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256i index =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(codes + j)));
    _mm256_storeu_ps(values + j, _mm256_mul_ps(_mm256_i32gather_ps(table, index, 4), s));
  }
  return j;
}

/// The codes' values times `scale`, 16 at a time (e4m3Values16: the
/// product with `scale` is the table's, bit for bit). Returns how many it
/// did (a multiple of 16).
template <bool BF16>
__attribute__((target("avx512f,avx512bw,avx512vl"))) int64_t
decodeAvx512(const uint8_t *codes, int64_t n, float scale, void *out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = e4m3Values16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(codes + j)));
    if constexpr (BF16)
      storeBf16x16(static_cast<uint16_t *>(out) + j, 0xFFFF, _mm512_mul_ps(v, s));
    else
      _mm512_storeu_ps(static_cast<float *>(out) + j, _mm512_mul_ps(v, s));
  }
  return j;
}
#endif

} // namespace

namespace {
/// values[j] = the value of codes[j] x scale, for j < n: 16 at a time with
/// AVX-512, 8 with AVX2, the rest by table (the same bits).
void decodeRun(const uint8_t *codes, int64_t n, float scale, float *values) {
  const std::array<float, 256> &table = decoded();
  int64_t j = 0;
#ifdef MOEC_FP8_AVX2
  if (cpuHasAvx512())
    j = decodeAvx512<false>(codes, n, scale, values);
  else if (cpuHasAvx2())
    j = decodeAvx2(codes, n, scale, table.data(), values);
#endif
  for (; j < n; ++j)
    values[j] = table[codes[j]] * scale;
}

/// decodeRun into `dst` of `elt`: a bf16 value rounded once (floatToBf16),
/// in registers with AVX-512 (the same bits).
void decodeRunTo(const uint8_t *codes, int64_t n, float scale, void *dst, DType elt) {
  if (elt != DType::BF16) {
    decodeRun(codes, n, scale, static_cast<float *>(dst));
    return;
  }
  const std::array<float, 256> &table = decoded();
  uint16_t *out = static_cast<uint16_t *>(dst);
  int64_t j = 0;
#ifdef MOEC_FP8_AVX2
  if (cpuHasAvx512())
    j = decodeAvx512<true>(codes, n, scale, out);
#endif
  for (; j < n; ++j)
    out[j] = floatToBf16(table[codes[j]] * scale);
}
} // namespace

void quantizeRows(const void *src, DType elt, int64_t srcLd, uint8_t *dst, int64_t dstLd,
                  int64_t rowBegin, int64_t rowEnd, int64_t cols) {
  const bool avx2 = cpuHasAvx2();
  float values[kFp8Block];
  for (int64_t i = rowBegin; i < rowEnd; ++i) {
    const char *row = static_cast<const char *>(src) + size_t(i * srcLd) * dtypeSize(elt);
    uint8_t *codes = dst + i * dstLd;
    uint8_t *scales = codes + cols;
    for (int64_t b = 0; b * kFp8Block < cols; ++b) {
      const int64_t begin = b * kFp8Block, n = std::min(kFp8Block, cols - begin);
      loadFloats(row + size_t(begin) * dtypeSize(elt), elt, values, size_t(n));
      float amax = 0;
      bool finite = true;
      int64_t j = 0;
#ifdef MOEC_FP8_AVX2
      if (avx2)
        j = amaxAvx2(values, n, &amax, &finite);
#endif
      for (; j < n; ++j) {
        finite = finite && std::isfinite(values[j]);
        amax = std::max(amax, std::fabs(values[j]));
      }
      const float scale = !finite     ? std::numeric_limits<float>::quiet_NaN()
                          : amax > 0 ? amax / kFp8Max
                                     : 1.0f;
      j = 0;
#ifdef MOEC_FP8_AVX2
      if (avx2)
        j = encodeAvx2(values, n, scale, codes + begin);
#endif
      for (; j < n; ++j)
        codes[begin + j] = floatToE4m3(values[j] / scale);
      std::memcpy(scales + 4 * b, &scale, 4);
    }
  }
}

void dequantizeRows(const uint8_t *src, int64_t srcLd, void *dst, DType elt, int64_t dstLd,
                    int64_t rowBegin, int64_t rowEnd, int64_t cols) {
  float values[kFp8Block];
  for (int64_t i = rowBegin; i < rowEnd; ++i) {
    const uint8_t *codes = src + i * srcLd;
    const uint8_t *scales = codes + cols;
    char *row = static_cast<char *>(dst) + size_t(i * dstLd) * dtypeSize(elt);
    for (int64_t b = 0; b * kFp8Block < cols; ++b) {
      const int64_t begin = b * kFp8Block, n = std::min(kFp8Block, cols - begin);
      float scale;
      std::memcpy(&scale, scales + 4 * b, 4);
      decodeRun(codes + begin, n, scale, values);
      storeFloats(values, row + size_t(begin) * dtypeSize(elt), elt, size_t(n));
    }
  }
}

void quantizeBlocks(const float *src, int64_t srcLd, int64_t rows, int64_t cols, uint8_t *codes,
                    float *scales) {
  const int64_t B = kFp8WeightBlock, colBlocks = (cols + B - 1) / B;
  for (int64_t bi = 0; bi * B < rows; ++bi)
    for (int64_t bj = 0; bj < colBlocks; ++bj) {
      const int64_t r0 = bi * B, r1 = std::min(rows, r0 + B);
      const int64_t c0 = bj * B, c1 = std::min(cols, c0 + B);
      float amax = 0;
      bool finite = true;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = c0; j < c1; ++j) {
          const float v = src[i * srcLd + j];
          finite = finite && std::isfinite(v);
          amax = std::max(amax, std::fabs(v));
        }
      const float scale = !finite     ? std::numeric_limits<float>::quiet_NaN()
                          : amax > 0 ? amax / kFp8Max
                                     : 1.0f;
      scales[bi * colBlocks + bj] = scale;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = c0; j < c1; ++j)
          codes[i * cols + j] = floatToE4m3(src[i * srcLd + j] / scale);
    }
}

void dequantizeBlocks(const uint8_t *codes, const float *scales, int64_t cols, int64_t rowBegin,
                      int64_t rowEnd, int64_t colBegin, int64_t colEnd, void *dst, DType elt,
                      int64_t dstLd) {
  const int64_t B = kFp8WeightBlock, colBlocks = (cols + B - 1) / B;
  for (int64_t i = rowBegin; i < rowEnd; ++i) {
    const uint8_t *row = codes + i * cols;
    const float *rowScales = scales + (i / B) * colBlocks;
    char *out = static_cast<char *>(dst) + size_t((i - rowBegin) * dstLd) * dtypeSize(elt);
    // Runs of columns within one block: one scale each.
    for (int64_t j0 = colBegin; j0 < colEnd;) {
      const int64_t j1 = std::min(colEnd, (j0 / B + 1) * B), n = j1 - j0;
      const float scale = rowScales[j0 / B];
      decodeRunTo(row + j0, n, scale, out + size_t(j0 - colBegin) * dtypeSize(elt), elt);
      j0 = j1;
    }
  }
}

} // namespace moec::cpu
