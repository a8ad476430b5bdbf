//===- Element.h - Storage types, bf16 conversion, matrix views -*- C++ -*-===//
//
// The CPU kernels store tensors as fp32 or bf16 and always compute in fp32.
// This header is the one place that defines bf16: a bf16 value is the upper
// 16 bits of an IEEE-754 binary32, kept as uint16_t bits. fp32 -> bf16 rounds
// to nearest, ties to even; a NaN stays a NaN (quieted, sign kept); overflow
// rounds to infinity; subnormals are kept, not flushed. bf16 -> fp32 is exact.
//
// Matrices are row-major views: element (i, j) of a view is at element offset
// i * ld + j from its data pointer, with `ld` (the leading stride) counted in
// elements of the view's type.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_ELEMENT_H
#define MOEC_RUNTIME_CPU_ELEMENT_H

#include "base/DType.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moec::cpu {

/// The storage type of a tensor (base/DType.h): F32 or BF16 for the
/// kernels. Arithmetic is always fp32.
using Elt = DType;

/// Returns the bf16 bits nearest to `value` (round to nearest, ties to even).
/// A NaN gives a quiet NaN with the same sign; values past the largest finite
/// bf16 round to infinity.
inline uint16_t floatToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bool isNan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even;
  // a carry out of the mantissa correctly bumps the exponent (up to inf).
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  // Truncating a NaN whose payload sits in the low half would give infinity:
  // keep the sign and the high payload bits, and set the quiet bit.
  const uint32_t quietNan = (bits >> 16) | 0x0040u;
  return uint16_t(isNan ? quietNan : rounded);
}

/// Returns the fp32 value of the bf16 bits `bits` (exact).
inline float bf16ToFloat(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

/// Returns `value` rounded to the nearest bf16, as fp32.
inline float roundToBf16(float value) { return bf16ToFloat(floatToBf16(value)); }

#if defined(__x86_64__)
/// floatToBf16's bits of 16 floats (nearest, ties to even; NaNs quiet),
/// each in the low half of its 32-bit lane, the high half zero: the AVX-512
/// form of it, for kernels built for AVX-512 (F, BW, VL).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i bf16Bits16(__m512 value) {
  const __m512i x = _mm512_castps_si512(value);
  const __m512i high = _mm512_srli_epi32(x, 16);
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)),
                       _mm512_and_si512(high, _mm512_set1_epi32(1))),
      16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x0040)));
}

/// vfpclassps's class of a subnormal value: what avx512_bf16's conversions
/// read as zero (bf16Packed16 and bf16PairBits16 look for it).
constexpr int kSubnormalClass = 0x20;

/// bf16Bits16's 16 values as 16 bits each (_mm512_cvtepi32_epi16 of it), on
/// avx512_bf16's conversion (`vcvtneps2bf16`: nearest, ties to even, NaNs
/// quiet) except in a vector that holds a subnormal, which that instruction
/// reads as zero (unless the caller knows none is: `maySubnormal` false).
/// For kernels built for AVX-512 (F, BW, VL, DQ) and avx512_bf16, on a CPU
/// that has them.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) inline __m256i
bf16Packed16(__m512 value, bool maySubnormal = true) {
  if (maySubnormal && _mm512_fpclass_ps_mask(value, kSubnormalClass))
    return _mm512_cvtepi32_epi16(bf16Bits16(value));
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(value));
}

/// bf16Bits16(lo) | bf16Bits16(hi) << 16: two rows of a bf16 pair, as the
/// bf16 tile's panels hold them. On avx512_bf16's conversion
/// (`vcvtne2ps2bf16`: nearest, ties to even, NaNs quiet, as bf16Bits16),
/// except where a lane is subnormal, which that instruction reads as zero:
/// those vectors take bf16Bits16 (unless the caller knows none is:
/// `maySubnormal` false). For kernels built for AVX-512 (F, BW, VL, DQ) and
/// avx512_bf16, on a CPU that has them.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) inline __m512i
bf16PairBits16(__m512 lo, __m512 hi, bool maySubnormal = true) {
  if (maySubnormal &&
      (_mm512_fpclass_ps_mask(lo, kSubnormalClass) | _mm512_fpclass_ps_mask(hi, kSubnormalClass)))
    return _mm512_or_si512(bf16Bits16(lo), _mm512_slli_epi32(bf16Bits16(hi), 16));
  // lo's 16 values then hi's, interleaved into pairs.
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                         8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(pairs, both);
}

/// 16 contiguous values of type `elt` (F32 or BF16) at `p` as fp32 (exact:
/// loadFloats' values). For kernels built for AVX-512 (F).
__attribute__((target("avx512f"))) inline __m512 loadFloats16(const void *p, Elt elt) {
  if (elt == Elt::F32)
    return _mm512_loadu_ps(p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i *>(p))), 16));
}

/// Rounds 16 floats to bf16 bits (bf16Bits16) and stores the lanes of
/// `mask` at `out`.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void
storeBf16x16(uint16_t *out, __mmask16 mask, __m512 value) {
  _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(bf16Bits16(value)));
}

/// Stores 16 floats at `p` as values of type `elt` (F32, or BF16 rounded
/// as storeFloats rounds them): loadFloats16's inverse.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void storeFloats16(void *p, Elt elt,
                                                                               __m512 value) {
  if (elt == Elt::F32)
    _mm512_storeu_ps(p, value);
  else
    storeBf16x16(static_cast<uint16_t *>(p), __mmask16(0xFFFF), value);
}
#endif

/// True when this CPU has AVX2 (checked once): the kernels' eight-lane
/// paths, which give the same bits as their scalar forms, run only then.
bool cpuHasAvx2();

/// True when this CPU has AVX-512 F, BW and VL (checked once): what the
/// kernels' sixteen-lane paths are built for, and run only then.
bool cpuHasAvx512();

/// Converts `count` floats at `src` to bf16 bits at `dst`.
void floatToBf16(const float *src, uint16_t *dst, size_t count);

/// Converts `count` bf16 values at `src` to floats at `dst`.
void bf16ToFloat(const uint16_t *src, float *dst, size_t count);

/// Reads `count` contiguous elements of type `elt` at `src` into floats.
void loadFloats(const void *src, Elt elt, float *dst, size_t count);

/// Writes `count` floats as contiguous elements of type `elt` at `dst`
/// (rounding to bf16 when `elt` is BF16).
void storeFloats(const float *src, void *dst, Elt elt, size_t count);

/// Returns element `index` of the array of type `elt` at `data`, as fp32.
inline float loadFloat(const void *data, Elt elt, int64_t index) {
  if (elt == Elt::BF16)
    return bf16ToFloat(static_cast<const uint16_t *>(data)[index]);
  return static_cast<const float *>(data)[index];
}

/// Stores `value` as element `index` of the array of type `elt` at `data`.
inline void storeFloat(void *data, Elt elt, int64_t index, float value) {
  if (elt == Elt::BF16)
    static_cast<uint16_t *>(data)[index] = floatToBf16(value);
  else
    static_cast<float *>(data)[index] = value;
}

/// A half-open index range [begin, end). An empty or inverted range holds no
/// index.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;

  /// The number of indices, 0 when end <= begin.
  int64_t size() const { return end > begin ? end - begin : 0; }
  /// True when the range holds no index.
  bool empty() const { return end <= begin; }
};

/// Asks for the bytes [p, p + bytes) in L2: a row about to be read at a
/// place no hardware prefetcher can guess (the next routed row, the next row
/// of a tile another core just wrote). The callers pass an address they
/// computed (`m.address(i, j)`): GCC 12 drops the prefetches of this loop
/// when it is a ConstMatrix member that computes the address itself.
inline void prefetchBytes(const void *p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(static_cast<const char *>(p) + b, 0, 2);
}

/// A read-only row-major matrix view: element (i, j) is element i * ld + j of
/// the array of type `elt` at `data`.
struct ConstMatrix {
  const void *data = nullptr;
  Elt elt = Elt::F32;
  int64_t ld = 0; ///< leading stride in elements

  /// Returns the address of element (i, j).
  const void *address(int64_t i, int64_t j) const {
    return static_cast<const char *>(data) + (i * ld + j) * int64_t(dtypeSize(elt));
  }
  /// Returns element (i, j) as fp32.
  float at(int64_t i, int64_t j) const { return loadFloat(data, elt, i * ld + j); }
};

/// A writable row-major matrix view; see ConstMatrix.
struct Matrix {
  void *data = nullptr;
  Elt elt = Elt::F32;
  int64_t ld = 0; ///< leading stride in elements

  /// Returns the address of element (i, j).
  void *address(int64_t i, int64_t j) const {
    return static_cast<char *>(data) + (i * ld + j) * int64_t(dtypeSize(elt));
  }
  /// Returns element (i, j) as fp32.
  float at(int64_t i, int64_t j) const { return loadFloat(data, elt, i * ld + j); }
  /// Stores `value` (rounded to the storage type) as element (i, j).
  void set(int64_t i, int64_t j, float value) const { storeFloat(data, elt, i * ld + j, value); }
  /// The same view, read-only.
  operator ConstMatrix() const { return ConstMatrix{data, elt, ld}; }
};

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_ELEMENT_H
