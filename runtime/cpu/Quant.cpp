//===- Quant.cpp - Quantized weights: int8 rows, int4 groups --------------===//

#include "runtime/cpu/Quant.h"

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

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

/// Whether no value of format f under `scale` (and int4's `zero`) can be
/// subnormal: its least nonzero magnitude times the scale is at least
/// FLT_MIN (int8: 1; FP8: 2^-9; int4: 1 where the zero point is whole, a
/// zero point the layer takes lying in [0, 15]). avx512_bf16's conversion,
/// which reads subnormal values as zero, then rounds every value of it as
/// floatToBf16 does.
inline bool noSubnormal(WeightFormat f, float scale, float zero) {
  constexpr float least = std::numeric_limits<float>::min();
  switch (f) {
  case WeightFormat::Int4Group:
    return scale >= least && zero >= 0.0f && zero <= 15.0f && zero == float(int(zero));
  case WeightFormat::Fp8Block128:
    return scale >= least * 512.0f;
  default:
    return scale >= least;
  }
}

/// x / m.group for x >= 0, by a shift where the group is a power of two
/// (32, 64 or 128: the decoders ask once a run, and a 64-bit division
/// takes as long as decoding a vector).
inline int64_t perGroup(const QuantizedMatrix &m, int64_t x) {
  return (m.group & (m.group - 1)) == 0 ? x >> __builtin_ctzll(uint64_t(m.group)) : x / m.group;
}

/// The scale and zero point of m's value (r, c) (zero 0 where the format
/// has none: its values are code x scale), m's format F.
template <WeightFormat F>
__attribute__((always_inline)) inline std::pair<float, float> scaleOf(const QuantizedMatrix &m,
                                                                      int64_t r, int64_t c) {
  if constexpr (F == WeightFormat::Fp8Block128) {
    const int64_t colBlocks = (m.cols + kFp8WeightBlock - 1) / kFp8WeightBlock;
    return {m.scales[(r / kFp8WeightBlock) * colBlocks + c / kFp8WeightBlock], 0.0f};
  } else if constexpr (F == WeightFormat::Int8Channel) {
    return {m.scales[r], 0.0f};
  } else if constexpr (F == WeightFormat::Int4Group) {
    const int64_t where = r * perGroup(m, m.cols) + perGroup(m, c);
    return m.zeroPoints ? std::pair{m.scales[2 * where], m.scales[2 * where + 1]}
                        : std::pair{m.scales[where], 8.0f};
  } else {
    return {1.0f, 0.0f};
  }
}

/// scaleOf of m's own format.
inline std::pair<float, float> scaleAt(const QuantizedMatrix &m, int64_t r, int64_t c) {
  switch (m.format) {
  case WeightFormat::Fp8Block128:
    return scaleOf<WeightFormat::Fp8Block128>(m, r, c);
  case WeightFormat::Int8Channel:
    return scaleOf<WeightFormat::Int8Channel>(m, r, c);
  case WeightFormat::Int4Group:
    return scaleOf<WeightFormat::Int4Group>(m, r, c);
  case WeightFormat::Dense:
    break;
  }
  return {1.0f, 0.0f};
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
#endif

/// Values [0, n) of `out` = codes[j] x scale.
void decodeInt8(const int8_t *codes, int64_t n, float scale, const Out &out) {
  for (int64_t j = 0; j < n; ++j)
    out.put(j, float(codes[j]) * scale);
}

/// Values [j0, j0 + n) of a row of 4-bit codes, to out[0, n).
void decodeInt4(const uint8_t *row, int64_t j0, int64_t n, float scale, float zero,
                const Out &out) {
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t byte = row[(j0 + j) / 2];
    const int code = (j0 + j) % 2 ? byte >> 4 : byte & 0xF;
    out.put(j, (float(code) - zero) * scale);
  }
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

namespace {

/// dequantize() a value at a time (FP8 by Fp8.h's dequantizeBlocks).
void dequantizeScalar(const QuantizedMatrix &m, int64_t rowBegin, int64_t rowEnd, int64_t colBegin,
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
      const int64_t j1 = std::min(colEnd, (perGroup(m, j0) + 1) * m.group);
      const auto [scale, zero] = scaleOf<WeightFormat::Int4Group>(m, i, j0);
      decodeInt4(static_cast<const uint8_t *>(m.codes) + i * int4Bytes(m.cols), j0, j1 - j0,
                 scale, zero, at(j0));
      j0 = j1;
    }
  }
}

} // namespace

#ifdef MOEC_QUANT_AVX512
namespace {

/// A run of a row of `m` under one scale, from the column it was asked for
/// to `end`, and what the AVX-512 decoders need of it.
struct Run {
  int64_t end;
  float scale, zero; ///< zero: int4's; scale: FP8's times 2^8 with `folded`
  bool folded;
  /// No value of the run can be subnormal (noSubnormal).
  bool normal;
};

/// The run of row i that holds column c, cut at c1 (m's format F).
template <WeightFormat F>
inline Run runAt(const QuantizedMatrix &m, int64_t i, int64_t c, int64_t c1) {
  const auto [scale, zero] = scaleOf<F>(m, i, c);
  const bool normal = noSubnormal(F, scale, zero);
  switch (F) {
  case WeightFormat::Int8Channel:
    return {c1, scale, zero, false, normal};
  case WeightFormat::Int4Group:
    return {std::min(c1, (perGroup(m, c) + 1) * m.group), scale, zero, false, normal};
  default: { // FP8 blocks: the 2^8 of e4m3HalfValues16 in the scale where it stays finite
    const bool folded = std::isfinite(scale * 256.0f);
    return {std::min(c1, (c / kFp8WeightBlock + 1) * kFp8WeightBlock),
            folded ? scale * 256.0f : scale, zero, folded, normal};
  }
  }
}

/// The codes of m's row i (format F): a byte a value, or int4's two.
template <WeightFormat F>
__attribute__((always_inline)) inline const uint8_t *rowCodes(const QuantizedMatrix &m, int64_t i) {
  return static_cast<const uint8_t *>(m.codes) +
         i * (F == WeightFormat::Int4Group ? int4Bytes(m.cols) : m.cols);
}

/// The values of columns [c, c + 16) of the row whose codes are at `row`
/// (rowCodes), all in run `r`, in fp32 before their rounding: dequantize's,
/// exactly (FP8's one product by the scale times 2^8 is its two). Int4's c
/// is even.
template <WeightFormat F>
MOEC_QUANT_TARGET __attribute__((always_inline)) inline __m512 values16(const uint8_t *row,
                                                                        const Run &r, int64_t c) {
  switch (F) {
  case WeightFormat::Int8Channel: {
    const __m512i codes =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(row + c)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(r.scale));
  }
  case WeightFormat::Int4Group: {
    // Lane 2k takes byte k's low half, lane 2k + 1 its high half.
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(row + c / 2));
    const __m128i nibble = _mm_set1_epi8(0xF);
    const __m512i code = _mm512_cvtepu8_epi32(
        _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble)));
    return _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(r.zero)),
                         _mm512_set1_ps(r.scale));
  }
  default: { // FP8 blocks
    __m512 v = e4m3HalfValues16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(row + c)));
    if (!r.folded)
      v = _mm512_mul_ps(v, _mm512_set1_ps(256.0f));
    return _mm512_mul_ps(v, _mm512_set1_ps(r.scale));
  }
  }
}

/// Whether values16 reads column c on: int4's codes from a byte's start.
template <WeightFormat F> inline bool readable(int64_t c) {
  return F != WeightFormat::Int4Group || c % 2 == 0;
}

/// How rowsOf stores its values: fp32; bf16 rounded once by bf16Bits16's
/// integer operations; or on avx512_bf16's conversion (bf16Packed16, the
/// same bits), where the CPU has it.
enum class Store { F32, Bf16, Bf16Native };

/// dequantize() on AVX-512: 16 values at a time within a run of one scale,
/// a value at a time at a run's end. Built with avx512_bf16 enabled so that
/// one body serves every Store: only Store::Bf16Native's conversion is an
/// avx512_bf16 instruction, and it runs only where the CPU has it.
template <WeightFormat F, Store S>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void
rowsOf(const QuantizedMatrix &m, int64_t r0, int64_t r1, int64_t c0, int64_t c1, void *dst,
       int64_t ld) {
  const DType elt = S == Store::F32 ? DType::F32 : DType::BF16;
  for (int64_t i = r0; i < r1; ++i) {
    char *row = static_cast<char *>(dst) + size_t((i - r0) * ld - c0) * dtypeSize(elt);
    const uint8_t *codes = rowCodes<F>(m, i);
    for (int64_t c = c0; c < c1;) {
      const Run r = runAt<F>(m, i, c, c1);
      if (readable<F>(c))
        for (; c + 16 <= r.end; c += 16) {
          const __m512 v = values16<F>(codes, r, c);
          if constexpr (S == Store::F32)
            _mm512_storeu_ps(reinterpret_cast<float *>(row) + c, v);
          else if constexpr (S == Store::Bf16)
            storeBf16x16(reinterpret_cast<uint16_t *>(row) + c, 0xFFFF, v);
          else
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(reinterpret_cast<uint16_t *>(row) + c),
                                bf16Packed16(v, !r.normal));
        }
      if (c < r.end)
        dequantizeScalar(m, i, i + 1, c, r.end, row + size_t(c) * dtypeSize(elt), elt, ld);
      c = r.end;
    }
  }
}

/// f(std::integral_constant<WeightFormat, F>()) for the quantized format F
/// of `format` (FP8 blocks for any other): a loop made for each format,
/// chosen once a call.
template <typename Fn> decltype(auto) byFormat(WeightFormat format, Fn &&f) {
  switch (format) {
  case WeightFormat::Int8Channel:
    return f(std::integral_constant<WeightFormat, WeightFormat::Int8Channel>());
  case WeightFormat::Int4Group:
    return f(std::integral_constant<WeightFormat, WeightFormat::Int4Group>());
  default:
    return f(std::integral_constant<WeightFormat, WeightFormat::Fp8Block128>());
  }
}

/// rowsOf into `elt`, on avx512_bf16's conversion where the CPU has it.
template <WeightFormat F>
void rowsTo(const QuantizedMatrix &m, int64_t r0, int64_t r1, int64_t c0, int64_t c1, void *dst,
            DType elt, int64_t ld) {
  if (elt != DType::BF16)
    rowsOf<F, Store::F32>(m, r0, r1, c0, c1, dst, ld);
  else if (tile::available(true))
    rowsOf<F, Store::Bf16Native>(m, r0, r1, c0, c1, dst, ld);
  else
    rowsOf<F, Store::Bf16>(m, r0, r1, c0, c1, dst, ld);
}

/// dequantize() on AVX-512 (F, BW, VL), by format.
void dequantizeAvx512(const QuantizedMatrix &m, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                      void *dst, DType elt, int64_t ld) {
  byFormat(m.format, [&](auto f) { rowsTo<decltype(f)::value>(m, r0, r1, c0, c1, dst, elt, ld); });
}

/// DecodedB::pairs of a QuantizedMatrix: dequantize's values, rounded once
/// to bf16 on avx512_bf16's conversion (bf16PairBits16), written as the
/// panels' units, 16 columns at a time from c0, a run of one scale (the
/// two rows' runs end together) at a time (by dequantize where 16 columns
/// are not all in one run).
template <WeightFormat F>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void
pairsOf(const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint32_t *dst,
        int64_t panelStride) {
  const QuantizedMatrix &m = *static_cast<const QuantizedMatrix *>(context);
  constexpr int64_t P = tile::kPanelColumns;
  const int64_t cols = c1 - c0;
  for (int64_t i = r0, t = 0; i < r1; i += 2, ++t) {
    const bool second = i + 1 < r1;
    const uint8_t *lowRow = rowCodes<F>(m, i), *highRow = rowCodes<F>(m, second ? i + 1 : i);
    for (int64_t j = 0; j < cols;) {
      const int64_t c = c0 + j;
      const Run lo = runAt<F>(m, i, c, c1), hi = second ? runAt<F>(m, i + 1, c, c1) : lo;
      // The run's vectors, column c0 + j at `to`: 16 columns on, and at a
      // panel's end on to the next panel.
      const int64_t end = lo.end - c0;
      if (readable<F>(c) && j + 16 <= end) {
        const bool maySubnormal = !(lo.normal && hi.normal);
        uint32_t *to = dst + (j / P) * panelStride + t * P + j % P;
        int64_t x = (j % P) / 16;
        for (; j + 16 <= end; j += 16) {
          const __m512 a = values16<F>(lowRow, lo, c0 + j);
          const __m512 b = second ? values16<F>(highRow, hi, c0 + j) : _mm512_setzero_ps();
          _mm512_storeu_si512(to, bf16PairBits16(a, b, maySubnormal));
          to += 16;
          if (++x == P / 16) {
            x = 0;
            to += panelStride - P;
          }
        }
      }
      if (j < end) { // 16 columns across the run's end (or c1: lanes past it zero, as packRows
                     // leaves them)
        const int64_t w = std::min<int64_t>(16, cols - j);
        alignas(64) float values[2][16] = {};
        dequantize(m, i, i + 1, c0 + j, c0 + j + w, values[0], DType::F32, 16);
        if (second)
          dequantize(m, i + 1, i + 2, c0 + j, c0 + j + w, values[1], DType::F32, 16);
        _mm512_storeu_si512(dst + (j / P) * panelStride + t * P + j % P,
                            bf16PairBits16(_mm512_load_ps(values[0]), _mm512_load_ps(values[1])));
        j += 16;
      }
    }
  }
}

void decodePairs(const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint32_t *dst,
                 int64_t panelStride) {
  byFormat(static_cast<const QuantizedMatrix *>(context)->format,
           [&](auto f) { pairsOf<decltype(f)::value>(context, r0, r1, c0, c1, dst, panelStride); });
}

} // namespace
#endif

void dequantize(const QuantizedMatrix &m, int64_t rowBegin, int64_t rowEnd, int64_t colBegin,
                int64_t colEnd, void *dst, DType elt, int64_t dstLd) {
#ifdef MOEC_QUANT_AVX512
  if (cpuHasAvx512()) {
    dequantizeAvx512(m, rowBegin, rowEnd, colBegin, colEnd, dst, elt, dstLd);
    return;
  }
#endif
  dequantizeScalar(m, rowBegin, rowEnd, colBegin, colEnd, dst, elt, dstLd);
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
#ifdef MOEC_QUANT_AVX512
  if (tile::available(true))
    d.pairs = decodePairs;
#endif
  return d;
}

//===----------------------------------------------------------------------===//
// Codes packed for the tile
//===----------------------------------------------------------------------===//

namespace {

/// The head of packCodes' memory: what the decoder needs to find the rest.
/// Codes: per panel of 48 columns, per unit t (depth values 2t and 2t + 1),
/// 8-bit codes as two rows of 48 bytes (depth 2t, then 2t + 1), 4-bit ones
/// as 48 bytes (depth 2t in the low half). Scales (and zero points): with
/// `depthScales` (op(B)'s scale varies along its depth value by value: int8
/// and int4 read as stored), a row of `scaleLd` per depth value and, per
/// column, the index of its scale in the row; else a row of one scale per
/// column (padded to whole panels) per `group` depth values.
struct PackedCodes {
  WeightFormat format = WeightFormat::Dense;
  bool zeroPoints = false, depthScales = false;
  /// FP8: the scales are stored times 2^8 (where every one stays finite),
  /// so that the decoder multiplies the codes' fp16 values (the values
  /// times 2^-8) by them once: the same products, exactly.
  bool scalesTimes256 = false;
  /// FP8: whether any code is a NaN code (none in a real weight), found
  /// once at packing so that the decoder mends NaN lanes only where some
  /// could be.
  bool nanCodes = false;
  /// Whether no value can be subnormal (noSubnormal under every scale),
  /// found at packing: the decoder's bf16 rounding then skips its check.
  bool normal = false;
  int64_t depth = 0, n = 0, units = 0, panels = 0, group = 0, scaleLd = 0;
  uint64_t codesAt = 0, scalesAt = 0, zerosAt = 0, indexAt = 0;
};

constexpr int64_t kCodePanel = tile::kPanelColumns;

int64_t unitBytesOf(WeightFormat f) { return f == WeightFormat::Int4Group ? 48 : 96; }

size_t lineUp(size_t bytes) { return (bytes + 63) / 64 * 64; }

/// The head of a packing of `m` (its offsets filled in) and its bytes.
PackedCodes packedLayout(const QuantizedMatrix &m, bool transposed, int64_t n, size_t *bytes) {
  PackedCodes h;
  h.format = m.format;
  h.zeroPoints = m.format == WeightFormat::Int4Group && m.zeroPoints;
  h.depth = transposed ? m.cols : m.rows;
  h.n = n;
  h.units = (h.depth + 1) / 2;
  h.panels = (n + kCodePanel - 1) / kCodePanel;
  const int64_t padded = h.panels * kCodePanel;
  // A stored row is an output channel: as stored (not transposed) op(B)'s
  // depth runs along int8's and int4's scales value by value.
  h.depthScales = !transposed && m.format != WeightFormat::Fp8Block128;
  int64_t scaleRows = 0;
  if (h.depthScales) {
    h.scaleLd = m.format == WeightFormat::Int4Group ? m.cols / m.group : 1;
    scaleRows = 2 * h.units;
  } else {
    h.group = m.format == WeightFormat::Fp8Block128 ? kFp8WeightBlock
              : m.format == WeightFormat::Int4Group ? m.group
                                                    : 2 * h.units;
    h.scaleLd = padded;
    scaleRows = (2 * h.units + h.group - 1) / h.group;
  }
  size_t at = lineUp(sizeof(PackedCodes));
  h.codesAt = at;
  at += lineUp(size_t(h.panels * h.units * unitBytesOf(m.format)));
  h.scalesAt = at;
  at += lineUp(size_t(scaleRows * h.scaleLd) * sizeof(float));
  h.zerosAt = at;
  if (h.zeroPoints)
    at += lineUp(size_t(scaleRows * h.scaleLd) * sizeof(float));
  h.indexAt = at;
  if (h.depthScales)
    at += lineUp(size_t(padded) * sizeof(int32_t));
  *bytes = at;
  return h;
}

/// The code of m's value (r, c): a byte, or a 4-bit code.
uint8_t codeAt(const QuantizedMatrix &m, int64_t r, int64_t c) {
  const uint8_t *codes = static_cast<const uint8_t *>(m.codes);
  if (m.format != WeightFormat::Int4Group)
    return codes[r * m.cols + c];
  const uint8_t byte = codes[r * int4Bytes(m.cols) + c / 2];
  return c % 2 ? byte >> 4 : byte & 0xF;
}

#ifdef MOEC_QUANT_AVX512
/// The packed codes of one unit row's 16 columns at `codes` (the panel's
/// unit row, column 16 v on) as fp32 code values: depth 2t in lo, 2t + 1 in
/// hi (an e4m3 code's value, an int8 code, a 4-bit code).
template <WeightFormat F>
MOEC_QUANT_TARGET __attribute__((always_inline)) inline void
codeValues16(const uint8_t *unit, int v, __m512 &lo, __m512 &hi, bool mayHoldNaN,
             bool scalesHold256) {
  if constexpr (F == WeightFormat::Int4Group) {
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(unit + 16 * v)));
    const __m512i low = _mm512_set1_epi32(0xF);
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    return;
  }
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(unit + 16 * v));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(unit + 48 + 16 * v));
  if constexpr (F == WeightFormat::Int8Channel) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    return;
  }
  // FP8: the codes' values times 2^-8, the 2^8 in the scales
  // (PackedCodes::scalesTimes256) or put back here.
  e4m3HalfValues32(a, b, lo, hi, mayHoldNaN);
  if (!scalesHold256) {
    lo = _mm512_mul_ps(lo, _mm512_set1_ps(256.0f));
    hi = _mm512_mul_ps(hi, _mm512_set1_ps(256.0f));
  }
}

/// Units [u0, u1) of panel q of packed codes of format F, their scales
/// along the depth or not (DepthScales), as bf16 pairs, (code - zero) x
/// scale rounded once (dequantize's values), on avx512_bf16's conversion
/// (bf16PairBits16): packed codes are read only where the bf16 tile runs
/// (tile::available(true)).
template <WeightFormat F, bool DepthScales>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"))) void
packedPanelOf(const void *context, int64_t q, int64_t u0, int64_t u1, uint32_t *dst) {
  const PackedCodes &h = *static_cast<const PackedCodes *>(context);
  const char *base = static_cast<const char *>(context);
  const int64_t unitBytes = unitBytesOf(h.format);
  const uint8_t *codes =
      reinterpret_cast<const uint8_t *>(base + h.codesAt) + (q * h.units + u0) * unitBytes;
  const float *scales = reinterpret_cast<const float *>(base + h.scalesAt);
  const float *zeros = reinterpret_cast<const float *>(base + h.zerosAt);
  const int32_t *index = reinterpret_cast<const int32_t *>(base + h.indexAt);
  constexpr bool int4 = F == WeightFormat::Int4Group;
  const __m512 eight = _mm512_set1_ps(8.0f);
  // What each of the panel's three vectors reads of the scales, the same at
  // every unit (found once a call: the panel's stores may alias the index,
  // so the compiler reloads what the loop reads of it): with DepthScales
  // its 16 columns' scale indices, whether they are one, and the first;
  // else the group of the unit's rows, kept as the units pass (a group
  // holds whole units, an even number of depth values).
  __m512i at[3] = {};
  int32_t first[3] = {};
  bool one[3] = {};
  if constexpr (DepthScales)
    for (int v = 0; v < 3; ++v) {
      const int64_t j = q * kCodePanel + 16 * v;
      at[v] = _mm512_loadu_si512(index + j);
      first[v] = index[j];
      one[v] = index[j] == index[j + 15];
    }
  int64_t group = DepthScales ? 0 : 2 * u0 / h.group;
  int64_t groupEnd = DepthScales ? 0 : (group + 1) * h.group;
  for (int64_t t = u0; t < u1; ++t, codes += unitBytes, dst += kCodePanel) {
    // The codes 16 units ahead (a panel's are contiguous), into L1: the
    // decode waits on them otherwise (gmm_bench --quantized: int8 about
    // 1.1x; a prefetch past the block's codes does not fault).
    _mm_prefetch(reinterpret_cast<const char *>(codes) + 16 * unitBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char *>(codes) + 16 * unitBytes + 64, _MM_HINT_T0);
    if (!DepthScales && 2 * t >= groupEnd) {
      ++group;
      groupEnd += h.group;
    }
    for (int v = 0; v < 3; ++v) {
      const int64_t j = q * kCodePanel + 16 * v;
      __m512 lo, hi;
      codeValues16<F>(codes, v, lo, hi, h.nanCodes, h.scalesTimes256);
      __m512 sLo, sHi, zLo = eight, zHi = eight;
      if constexpr (DepthScales) {
        const float *rowLo = scales + 2 * t * h.scaleLd, *rowHi = rowLo + h.scaleLd;
        if (one[v]) {
          sLo = _mm512_set1_ps(rowLo[first[v]]);
          sHi = _mm512_set1_ps(rowHi[first[v]]);
          if (h.zeroPoints) {
            zLo = _mm512_set1_ps(zeros[2 * t * h.scaleLd + first[v]]);
            zHi = _mm512_set1_ps(zeros[(2 * t + 1) * h.scaleLd + first[v]]);
          }
        } else {
          sLo = _mm512_i32gather_ps(at[v], rowLo, 4);
          sHi = _mm512_i32gather_ps(at[v], rowHi, 4);
          if (h.zeroPoints) {
            zLo = _mm512_i32gather_ps(at[v], zeros + 2 * t * h.scaleLd, 4);
            zHi = _mm512_i32gather_ps(at[v], zeros + (2 * t + 1) * h.scaleLd, 4);
          }
        }
      } else {
        const int64_t row = group * h.scaleLd + j;
        sLo = sHi = _mm512_loadu_ps(scales + row);
        if (h.zeroPoints)
          zLo = zHi = _mm512_loadu_ps(zeros + row);
      }
      if constexpr (int4) {
        lo = _mm512_sub_ps(lo, zLo);
        hi = _mm512_sub_ps(hi, zHi);
      }
      lo = _mm512_mul_ps(lo, sLo);
      hi = _mm512_mul_ps(hi, sHi);
      _mm512_storeu_si512(dst + 16 * v, bf16PairBits16(lo, hi, !h.normal));
    }
  }
}

/// DecodedB::panel of packed codes: packedPanelOf of their format and
/// scales' layout (a loop made for each: the format asked for at each unit
/// cost the tiles on codes packed beforehand 2-4%).
void decodePackedPanel(const void *context, int64_t q, int64_t u0, int64_t u1, uint32_t *dst) {
  const PackedCodes &h = *static_cast<const PackedCodes *>(context);
  byFormat(h.format, [&](auto f) {
    constexpr WeightFormat F = decltype(f)::value;
    if (h.depthScales)
      packedPanelOf<F, true>(context, q, u0, u1, dst);
    else
      packedPanelOf<F, false>(context, q, u0, u1, dst);
  });
}
#endif

} // namespace

size_t packedCodesBytes(const QuantizedMatrix &m, bool transposed, int64_t n) {
  size_t bytes = 0;
  packedLayout(m, transposed, n, &bytes);
  return bytes;
}

void packCodes(const QuantizedMatrix &m, bool transposed, int64_t c0, int64_t n, void *dst) {
  size_t bytes = 0;
  PackedCodes h = packedLayout(m, transposed, n, &bytes);
  // The scales (int4's with their zero points): one a block, row or group.
  const int64_t entries = m.format == WeightFormat::Fp8Block128
                              ? ((m.rows + kFp8WeightBlock - 1) / kFp8WeightBlock) *
                                    ((m.cols + kFp8WeightBlock - 1) / kFp8WeightBlock)
                          : m.format == WeightFormat::Int8Channel ? m.rows
                                                                  : m.rows * (m.cols / m.group);
  if (m.format == WeightFormat::Fp8Block128)
    h.scalesTimes256 = std::all_of(m.scales, m.scales + entries,
                                   [](float s) { return std::isfinite(s * 256.0f); });
  h.normal = true;
  for (int64_t e = 0; e < entries && h.normal; ++e)
    h.normal = h.zeroPoints ? noSubnormal(m.format, m.scales[2 * e], m.scales[2 * e + 1])
                            : noSubnormal(m.format, m.scales[e], 8.0f);
  const float scaleFactor = h.scalesTimes256 ? 256.0f : 1.0f;
  char *base = static_cast<char *>(dst);
  std::memset(base, 0, bytes);
  std::memcpy(base, &h, sizeof h);
  // op(B)'s value (p, j) is m's (c0 + j, p) or (p, c0 + j).
  const auto stored = [&](int64_t p, int64_t j) {
    return transposed ? std::pair{c0 + j, p} : std::pair{p, c0 + j};
  };
  const int64_t unitBytes = unitBytesOf(m.format);
  uint8_t *codes = reinterpret_cast<uint8_t *>(base + h.codesAt);
  // Past the columns: code 0, under scale 0 where a scale row is per
  // column (those sums are never stored).
  for (int64_t q = 0; q < h.panels; ++q)
    for (int64_t t = 0; t < h.units; ++t) {
      uint8_t *unit = codes + (q * h.units + t) * unitBytes;
      for (int64_t c = 0; c < kCodePanel; ++c) {
        const int64_t j = q * kCodePanel + c;
        if (j >= n)
          break;
        for (int half = 0; half < 2; ++half) {
          const int64_t p = 2 * t + half;
          // Past the depth, a code whose value is 0: 0, or a 4-bit code at
          // its zero point (where a scale row is shared with the depth
          // before it; a row of its own has scale and zero point 0).
          uint8_t code = 0;
          if (p < h.depth) {
            const auto [r, col] = stored(p, j);
            code = codeAt(m, r, col);
          } else if (m.format == WeightFormat::Int4Group) {
            code =
                !m.zeroPoints ? 8
                : h.depthScales
                    ? 0
                    : uint8_t(scaleAt(m, stored(p - 1, j).first, stored(p - 1, j).second).second);
          }
          if (m.format == WeightFormat::Int4Group)
            unit[c] |= uint8_t(half ? code << 4 : code);
          else
            unit[half * kCodePanel + c] = code;
        }
      }
    }
  if (m.format == WeightFormat::Fp8Block128)
    reinterpret_cast<PackedCodes *>(base)->nanCodes =
        std::any_of(codes, codes + h.panels * h.units * unitBytes,
                    [](uint8_t c) { return (c & 0x7F) == 0x7F; });
  float *scales = reinterpret_cast<float *>(base + h.scalesAt);
  float *zeros = reinterpret_cast<float *>(base + h.zerosAt);
  if (h.depthScales) {
    // Row p: the scales of m's row p; a column's index: its group.
    const int64_t groupCols = m.format == WeightFormat::Int4Group ? m.group : m.cols;
    for (int64_t p = 0; p < h.depth; ++p)
      for (int64_t g = 0; g < h.scaleLd; ++g) {
        const auto [scale, zero] = scaleAt(m, p, g * groupCols);
        scales[p * h.scaleLd + g] = scale;
        if (h.zeroPoints)
          zeros[p * h.scaleLd + g] = zero;
      }
    int32_t *index = reinterpret_cast<int32_t *>(base + h.indexAt);
    for (int64_t j = 0; j < h.panels * kCodePanel; ++j)
      index[j] = int32_t((c0 + std::min(j, n - 1)) / groupCols);
  } else {
    for (int64_t p0 = 0; p0 < h.depth; p0 += h.group)
      for (int64_t j = 0; j < n; ++j) {
        const auto [r, col] = stored(p0, j);
        const auto [scale, zero] = scaleAt(m, r, col);
        scales[(p0 / h.group) * h.scaleLd + j] = scale * scaleFactor;
        if (h.zeroPoints)
          zeros[(p0 / h.group) * h.scaleLd + j] = zero;
      }
  }
}

tile::DecodedB packedCodesB(const void *packed) {
  const PackedCodes &h = *static_cast<const PackedCodes *>(packed);
  tile::DecodedB d;
#ifdef MOEC_QUANT_AVX512
  d.panel = decodePackedPanel;
#endif
  d.context = packed;
  d.codes = static_cast<const uint8_t *>(packed) + h.codesAt;
  d.codesLd = h.units * unitBytesOf(h.format);
  d.unitBytes = unitBytesOf(h.format);
  return d;
}

} // namespace moec::cpu
