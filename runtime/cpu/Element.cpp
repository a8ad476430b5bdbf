//===- Element.cpp - Storage types and bf16 conversion --------------------===//
//
// The array conversions run eight elements at a time with AVX2 where the
// CPU has it (chosen at run time), giving the same bits as the scalar
// floatToBf16 / bf16ToFloat they fall back to (and finish the tail with).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Element.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define MOEC_ELEMENT_AVX2 1
#endif

namespace moec::cpu {

namespace {

#ifdef MOEC_ELEMENT_AVX2
__attribute__((target("avx2"))) size_t floatToBf16Avx2(const float *src, uint16_t *dst,
                                                        size_t count) {
  const __m256i absMask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src + i));
    const __m256i high = _mm256_srli_epi32(x, 16);
    // Round to nearest even: add 0x7fff and the lowest kept bit.
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, half), _mm256_and_si256(high, one)), 16);
    const __m256i isNan = _mm256_cmpgt_epi32(_mm256_and_si256(x, absMask), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, quiet), isNan);
    // Every lane is below 2^16: pack the 32-bit lanes to 16 bits in order.
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i), packed);
  }
  return i;
}

__attribute__((target("avx2"))) size_t bf16ToFloatAvx2(const uint16_t *src, float *dst,
                                                        size_t count) {
  size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + i), w);
  }
  return i;
}
#endif

} // namespace

bool cpuHasAvx2() {
#ifdef MOEC_ELEMENT_AVX2
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
#else
  return false;
#endif
}

bool cpuHasAvx512() {
#ifdef MOEC_ELEMENT_AVX2
  static const bool have = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return have;
#else
  return false;
#endif
}

void floatToBf16(const float *src, uint16_t *dst, size_t count) {
  size_t i = 0;
#ifdef MOEC_ELEMENT_AVX2
  if (cpuHasAvx2())
    i = floatToBf16Avx2(src, dst, count);
#endif
  for (; i < count; ++i)
    dst[i] = floatToBf16(src[i]);
}

void bf16ToFloat(const uint16_t *src, float *dst, size_t count) {
  size_t i = 0;
#ifdef MOEC_ELEMENT_AVX2
  if (cpuHasAvx2())
    i = bf16ToFloatAvx2(src, dst, count);
#endif
  for (; i < count; ++i)
    dst[i] = bf16ToFloat(src[i]);
}

void loadFloats(const void *src, Elt elt, float *dst, size_t count) {
  if (elt == Elt::BF16)
    bf16ToFloat(static_cast<const uint16_t *>(src), dst, count);
  else if (count != 0)
    std::memcpy(dst, src, count * sizeof(float));
}

void storeFloats(const float *src, void *dst, Elt elt, size_t count) {
  if (elt == Elt::BF16)
    floatToBf16(src, static_cast<uint16_t *>(dst), count);
  else if (count != 0)
    std::memcpy(dst, src, count * sizeof(float));
}

} // namespace moec::cpu
