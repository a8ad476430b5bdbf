//===- Quant.cpp - Quantized weights: int8 rows, int4 groups --------------===//

#include "runtime/cpu/Quant.h"

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 reports the undefined vectors its own AVX-512 headers start some
// intrinsics from (_mm512_undefined_*) as maybe uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MOEC_QUANT_AVX512 1
#endif

namespace moec::cpu {

namespace {

/// The scale of a run whose largest magnitude is `amax`, for codes up to
/// `top`: 1 for zeros, NaN when the run holds a NaN or an infinity, and at
/// least the smallest positive float (amax / top of a run of tiny values
/// would round to 0, which no scale may be).
float symmetricScale(float amax, bool finite, float top) {
  if (!finite)
    return std::nanf("");
  return amax > 0 ? std::max(amax / top, std::numeric_limits<float>::denorm_min()) : 1.0f;
}

/// The code of a value whose quotient by its scale is `q`: the nearest
/// integer (ties to even) plus `zero`, clamped to [lo, hi]; 0 for a NaN
/// quotient (a NaN scale, or 0 / 0 under a scale that underflowed to 0),
/// which has no integer (converting NaN to one is undefined).
int toCode(float q, float zero, float lo, float hi) {
  const float code = std::nearbyint(q) + zero;
  return std::isnan(code) ? 0 : int(std::clamp(code, lo, hi));
}

/// Where decoded values go: fp32, or bf16 rounded once (floatToBf16).
struct Out {
  void *base;
  Elt elt;
  void put(int64_t j, float value) const {
    if (elt == Elt::BF16)
      static_cast<uint16_t *>(base)[j] = floatToBf16(value);
    else
      static_cast<float *>(base)[j] = value;
  }
};

#ifdef MOEC_QUANT_AVX512
#define MOEC_QUANT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

bool avx512() {
  static const bool have = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl");
  return have;
}

/// Stores 16 values at element j of `out`: fp32, or rounded to bf16 in
/// registers (the bits of Out::put).
MOEC_QUANT_TARGET inline void store16(const Out &out, int64_t j, __m512 v) {
  if (out.elt == Elt::BF16)
    storeBf16x16(static_cast<uint16_t *>(out.base) + j, 0xFFFF, v);
  else
    _mm512_storeu_ps(static_cast<float *>(out.base) + j, v);
}

/// Value j = codes[j] x scale, 16 at a time. Returns how many it did.
MOEC_QUANT_TARGET int64_t decodeInt8Avx512(const int8_t *codes, int64_t n, float scale,
                                           const Out &out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i c =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(codes + j)));
    store16(out, j, _mm512_mul_ps(_mm512_cvtepi32_ps(c), s));
  }
  return j;
}

/// Value j = (code j - zero) x scale for the codes of bytes[0 .. n / 2),
/// 16 values (8 bytes) at a time. Returns how many values it did.
MOEC_QUANT_TARGET int64_t decodeInt4Avx512(const uint8_t *bytes, int64_t n, float scale,
                                           float zero, const Out &out) {
  const __m512 s = _mm512_set1_ps(scale), z = _mm512_set1_ps(zero);
  const __m512i low = _mm512_set1_epi32(0xF);
  // Lane 2k takes byte k's low half, lane 2k + 1 its high half (GPTQ's
  // order: value j in byte j / 2, low half first).
  const __m512i shifts = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i pick = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i *>(bytes + j / 2)));
    const __m512i c =
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(pick, b), shifts), low);
    store16(out, j, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c), z), s));
  }
  return j;
}
#endif

/// Values [0, n) of `out` = codes[j] x scale.
void decodeInt8(const int8_t *codes, int64_t n, float scale, const Out &out) {
  int64_t j = 0;
#ifdef MOEC_QUANT_AVX512
  if (avx512())
    j = decodeInt8Avx512(codes, n, scale, out);
#endif
  for (; j < n; ++j)
    out.put(j, float(codes[j]) * scale);
}

/// Values [j0, j0 + n) of a row of 4-bit codes, to out[0, n).
void decodeInt4(const uint8_t *row, int64_t j0, int64_t n, float scale, float zero,
                const Out &out) {
  const auto one = [&](int64_t j) {
    const uint8_t byte = row[(j0 + j) / 2];
    const int code = (j0 + j) % 2 ? byte >> 4 : byte & 0xF;
    out.put(j, (float(code) - zero) * scale);
  };
  int64_t j = 0;
  if (j0 % 2 == 1 && n > 0) // from an even value on, bytes hold whole pairs
    one(j++);
#ifdef MOEC_QUANT_AVX512
  if (avx512()) {
    const size_t elt = dtypeSize(out.elt);
    j += decodeInt4Avx512(row + (j0 + j) / 2, n - j, scale, zero,
                          Out{static_cast<char *>(out.base) + size_t(j) * elt, out.elt});
  }
#endif
  for (; j < n; ++j)
    one(j);
}

} // namespace

void quantizeInt8Rows(const float *src, int64_t srcLd, int64_t rows, int64_t cols, int8_t *codes,
                      float *scales) {
  for (int64_t i = 0; i < rows; ++i) {
    const float *row = src + i * srcLd;
    float amax = 0;
    bool finite = true;
    for (int64_t j = 0; j < cols; ++j) {
      finite = finite && std::isfinite(row[j]);
      amax = std::max(amax, std::fabs(row[j]));
    }
    const float scale = symmetricScale(amax, finite, 127.0f);
    scales[i] = scale;
    for (int64_t j = 0; j < cols; ++j)
      codes[i * cols + j] = int8_t(toCode(row[j] / scale, 0.0f, -127.0f, 127.0f));
  }
}

void quantizeInt4Groups(const float *src, int64_t srcLd, int64_t rows, int64_t cols,
                        int64_t group, bool zeroPoints, uint8_t *codes, float *scales) {
  const int64_t groups = cols / group, rowBytes = int4Bytes(cols);
  for (int64_t i = 0; i < rows; ++i) {
    const float *row = src + i * srcLd;
    uint8_t *out = codes + i * rowBytes;
    std::fill(out, out + rowBytes, uint8_t(0));
    for (int64_t g = 0; g < groups; ++g) {
      const float *v = row + g * group;
      float lo = 0, hi = 0;
      bool finite = true;
      for (int64_t j = 0; j < group; ++j) {
        finite = finite && std::isfinite(v[j]);
        lo = std::min(lo, v[j]);
        hi = std::max(hi, v[j]);
      }
      float scale, zero;
      if (zeroPoints) {
        scale = !finite  ? std::nanf("")
                : hi > lo ? std::max((hi - lo) / 15.0f, std::numeric_limits<float>::denorm_min())
                          : 1.0f;
        zero = finite ? std::clamp(std::nearbyint(-lo / scale), 0.0f, 15.0f) : 0.0f;
        scales[2 * (i * groups + g)] = scale;
        scales[2 * (i * groups + g) + 1] = zero;
      } else {
        scale = symmetricScale(std::max(-lo, hi), finite, 7.0f);
        zero = 8;
        scales[i * groups + g] = scale;
      }
      for (int64_t j = 0; j < group; ++j) {
        const int code = toCode(v[j] / scale, zero, 0.0f, 15.0f);
        const int64_t at = g * group + j;
        out[at / 2] |= uint8_t(at % 2 ? code << 4 : code);
      }
    }
  }
}

void quantize(const QuantizedMatrix &m, const float *src, int64_t srcLd, void *codes,
              float *scales) {
  switch (m.format) {
  case WeightFormat::Dense:
    break;
  case WeightFormat::Fp8Block128:
    quantizeBlocks(src, srcLd, m.rows, m.cols, static_cast<uint8_t *>(codes), scales);
    break;
  case WeightFormat::Int8Channel:
    quantizeInt8Rows(src, srcLd, m.rows, m.cols, static_cast<int8_t *>(codes), scales);
    break;
  case WeightFormat::Int4Group:
    quantizeInt4Groups(src, srcLd, m.rows, m.cols, m.group, m.zeroPoints,
                       static_cast<uint8_t *>(codes), scales);
    break;
  }
}

void dequantize(const QuantizedMatrix &m, int64_t rowBegin, int64_t rowEnd, int64_t colBegin,
                int64_t colEnd, void *dst, DType elt, int64_t dstLd) {
  if (m.format == WeightFormat::Fp8Block128) {
    dequantizeBlocks(static_cast<const uint8_t *>(m.codes), m.scales, m.cols, rowBegin, rowEnd,
                     colBegin, colEnd, dst, elt, dstLd);
    return;
  }
  for (int64_t i = rowBegin; i < rowEnd; ++i) {
    char *row = static_cast<char *>(dst) + size_t((i - rowBegin) * dstLd) * dtypeSize(elt);
    const auto at = [&](int64_t j) {
      return Out{row + size_t(j - colBegin) * dtypeSize(elt), elt};
    };
    if (m.format == WeightFormat::Int8Channel) {
      decodeInt8(static_cast<const int8_t *>(m.codes) + i * m.cols + colBegin, colEnd - colBegin,
                 m.scales[i], at(colBegin));
      continue;
    }
    // Int4: runs of columns under one scale (a group).
    for (int64_t j0 = colBegin; j0 < colEnd;) {
      const int64_t g = j0 / m.group, where = i * (m.cols / m.group) + g;
      const int64_t j1 = std::min(colEnd, (g + 1) * m.group);
      const float scale = m.zeroPoints ? m.scales[2 * where] : m.scales[where];
      const float zero = m.zeroPoints ? m.scales[2 * where + 1] : 8.0f;
      decodeInt4(static_cast<const uint8_t *>(m.codes) + i * int4Bytes(m.cols), j0, j1 - j0,
                 scale, zero, at(j0));
      j0 = j1;
    }
  }
}

tile::DecodedB decodedB(const QuantizedMatrix &m) {
  tile::DecodedB d;
  d.decode = [](const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                uint16_t *dst, int64_t ld) {
    dequantize(*static_cast<const QuantizedMatrix *>(context), r0, r1, c0, c1, dst, DType::BF16,
               ld);
  };
  d.context = &m;
  d.codes = static_cast<const uint8_t *>(m.codes);
  d.halfBytes = m.format == WeightFormat::Int4Group;
  d.codesLd = d.halfBytes ? int4Bytes(m.cols) : m.cols;
  return d;
}

} // namespace moec::cpu
