//===- Fp8.cpp - FP8 e4m3 values and rows quantized in blocks ---------------===//

#include "runtime/cpu/Fp8.h"

#include "runtime/cpu/Element.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

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

void quantizeRows(const void *src, DType elt, int64_t srcLd, uint8_t *dst, int64_t dstLd,
                  int64_t rowBegin, int64_t rowEnd, int64_t cols) {
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
      for (int64_t j = 0; j < n; ++j) {
        finite = finite && std::isfinite(values[j]);
        amax = std::max(amax, std::fabs(values[j]));
      }
      const float scale = !finite     ? std::numeric_limits<float>::quiet_NaN()
                          : amax > 0 ? amax / kFp8Max
                                     : 1.0f;
      for (int64_t j = 0; j < n; ++j)
        codes[begin + j] = floatToE4m3(values[j] / scale);
      std::memcpy(scales + 4 * b, &scale, 4);
    }
  }
}

void dequantizeRows(const uint8_t *src, int64_t srcLd, void *dst, DType elt, int64_t dstLd,
                    int64_t rowBegin, int64_t rowEnd, int64_t cols) {
  const std::array<float, 256> &table = decoded();
  float values[kFp8Block];
  for (int64_t i = rowBegin; i < rowEnd; ++i) {
    const uint8_t *codes = src + i * srcLd;
    const uint8_t *scales = codes + cols;
    char *row = static_cast<char *>(dst) + size_t(i * dstLd) * dtypeSize(elt);
    for (int64_t b = 0; b * kFp8Block < cols; ++b) {
      const int64_t begin = b * kFp8Block, n = std::min(kFp8Block, cols - begin);
      float scale;
      std::memcpy(&scale, scales + 4 * b, 4);
      for (int64_t j = 0; j < n; ++j)
        values[j] = table[codes[begin + j]] * scale;
      storeFloats(values, row + size_t(begin) * dtypeSize(elt), elt, size_t(n));
    }
  }
}

} // namespace moec::cpu
