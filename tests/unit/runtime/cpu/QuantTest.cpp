//===- QuantTest.cpp - int8 rows and int4 groups of frozen weights --------===//
//
// runtime/cpu/Quant against a decoder and a quantizer written here from the
// format's definition (Quant.h): int8 codes with a scale per row (amax /
// 127, ties to even), int4 codes two a byte (value j in the low half of byte
// j / 2 when j is even) with a scale per group of 32, 64 or 128 and
// optionally a zero point per group; dequantizing any block of rows and
// columns (odd column starts, group edges, runs long enough for the AVX-512
// decoder and the short tails it leaves) into fp32 and into bf16 (round to
// nearest even of the fp32 value); round trips within half a scale; NaN and
// infinity giving a NaN scale; and LayerShape's names and dims of the
// formats.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Quant.h"
#include "format/LayerShape.h"
#include "runtime/cpu/Fp8.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

using namespace moec;
using namespace moec::cpu;

namespace {

/// x rounded to the nearest integer, ties to the even one, by hand.
double roundHalfEven(double x) {
  const double down = std::floor(x), frac = x - down;
  if (frac > 0.5)
    return down + 1;
  if (frac < 0.5)
    return down;
  return std::fmod(down, 2.0) == 0 ? down : down + 1;
}

uint32_t bitsOf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

/// The bf16 nearest to finite `f` (ties to the even bf16), by its bits.
uint16_t bf16Nearest(float f) {
  const uint32_t bits = bitsOf(f);
  const uint32_t lower = bits & 0xFFFF, upper = bits >> 16;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1)))
    return uint16_t(upper + 1);
  return uint16_t(upper);
}

/// A quantized matrix as the test holds it: the codes' bytes and the scales.
struct Held {
  WeightFormat format;
  int64_t rows, cols, group = 0;
  bool zeroPoints = false;
  std::vector<uint8_t> codes;
  std::vector<float> scales;

  int64_t rowBytes() const { return format == WeightFormat::Int4Group ? (cols + 1) / 2 : cols; }
  int64_t groups() const { return format == WeightFormat::Int4Group ? cols / group : 1; }
  /// FP8: scales [ceil(rows / 128), ceil(cols / 128)].
  int64_t colBlocks() const { return (cols + 127) / 128; }
  int64_t scaleCount() const {
    if (format == WeightFormat::Fp8Block128)
      return (rows + 127) / 128 * colBlocks();
    return format == WeightFormat::Int8Channel ? rows : rows * groups() * (zeroPoints ? 2 : 1);
  }
  QuantizedMatrix view() const {
    QuantizedMatrix m;
    m.format = format;
    m.codes = codes.data();
    m.scales = scales.data();
    m.rows = rows;
    m.cols = cols;
    m.group = group;
    m.zeroPoints = zeroPoints;
    return m;
  }
  /// Code (i, j): the int8 byte, the e4m3 byte, or the low half of byte
  /// j / 2 for even j and the high half for odd j.
  int code(int64_t i, int64_t j) const {
    const uint8_t byte =
        codes[size_t(i * rowBytes() + (format == WeightFormat::Int4Group ? j / 2 : j))];
    if (format == WeightFormat::Int8Channel)
      return int(int8_t(byte));
    if (format == WeightFormat::Fp8Block128)
      return byte;
    return j % 2 == 0 ? byte & 0xF : byte >> 4;
  }
  float scale(int64_t i, int64_t j) const {
    if (format == WeightFormat::Int8Channel)
      return scales[size_t(i)];
    if (format == WeightFormat::Fp8Block128)
      return scales[size_t((i / 128) * colBlocks() + j / 128)];
    const int64_t at = i * groups() + j / group;
    return zeroPoints ? scales[size_t(2 * at)] : scales[size_t(at)];
  }
  float zero(int64_t i, int64_t j) const {
    if (format != WeightFormat::Int4Group)
      return 0;
    return zeroPoints ? scales[size_t(2 * (i * groups() + j / group) + 1)] : 8.0f;
  }
  /// Value (i, j) from the definition, in fp32.
  float value(int64_t i, int64_t j) const {
    if (format == WeightFormat::Int8Channel)
      return float(code(i, j)) * scale(i, j);
    if (format == WeightFormat::Fp8Block128)
      return e4m3ToFloat(uint8_t(code(i, j))) * scale(i, j);
    return (float(code(i, j)) - zero(i, j)) * scale(i, j);
  }
};

Held randomHeld(WeightFormat format, int64_t rows, int64_t cols, int64_t group, bool zeroPoints,
                uint32_t seed) {
  Held h{format, rows, cols, group, zeroPoints, {}, {}};
  std::mt19937 rng(seed);
  h.codes.resize(size_t(rows * h.rowBytes()));
  for (uint8_t &c : h.codes)
    c = uint8_t(rng() & 0xFF); // every int8 code, -128 too; every pair of nibbles
  h.scales.resize(size_t(h.scaleCount()));
  std::uniform_real_distribution<float> scale(0.01f, 3.0f);
  for (size_t s = 0; s < h.scales.size(); ++s)
    h.scales[s] = zeroPoints && s % 2 == 1 ? float(rng() % 16) : scale(rng);
  return h;
}

/// Random int8 codes and int4 codes in groups of 32, 64 and 128, with and
/// without zero points: [7, 384] each.
std::vector<Held> intFormats(uint32_t seed) {
  std::vector<Held> mats = {randomHeld(WeightFormat::Int8Channel, 7, 384, 0, false, seed)};
  for (const int64_t group : {int64_t(32), int64_t(64), int64_t(128)})
    for (const bool zp : {false, true})
      mats.push_back(randomHeld(WeightFormat::Int4Group, 7, 384, group, zp,
                                seed * 1000 + uint32_t(group * 2 + zp)));
  return mats;
}

const char *formatName(const Held &h) {
  if (h.format == WeightFormat::Int8Channel)
    return "int8";
  if (h.format == WeightFormat::Fp8Block128)
    return "fp8";
  return h.zeroPoints ? "int4 with zero points" : "int4";
}

/// Dequantizes rows [r0, r1) and columns [c0, c1) of `h` into fp32 and into
/// bf16, rows ld apart, and checks every value against the definition and
/// that nothing around the block is written.
void checkBlock(const Held &h, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  INFO(formatName(h) << " group " << h.group << ": rows [" << r0 << ", " << r1 << "), cols [" << c0
                     << ", " << c1 << ")");
  const int64_t width = c1 - c0, ld = width + 5, n = r1 - r0;
  const float sentinel = -12345.0f;
  std::vector<float> f32(size_t(n * ld + 7), sentinel);
  std::vector<uint16_t> bf16(f32.size(), 0xDEAD);
  dequantize(h.view(), r0, r1, c0, c1, f32.data(), DType::F32, ld);
  dequantize(h.view(), r0, r1, c0, c1, bf16.data(), DType::BF16, ld);
  for (size_t at = 0; at < f32.size(); ++at) {
    const int64_t i = int64_t(at) / ld, j = int64_t(at) % ld;
    if (i >= n || j >= width) { // outside the block: untouched
      INFO("element " << at << " outside the block");
      REQUIRE(f32[at] == sentinel);
      REQUIRE(bf16[at] == 0xDEAD);
      continue;
    }
    const float want = h.value(r0 + i, c0 + j);
    if (std::isnan(want)) { // a NaN code: NaN in both
      INFO("value (" << r0 + i << ", " << c0 + j << ") is NaN");
      REQUIRE(std::isnan(f32[at]));
      REQUIRE((bf16[at] & 0x7FFF) > 0x7F80);
      continue;
    }
    if (f32[at] != want || bf16[at] != bf16Nearest(want)) {
      INFO("value (" << r0 + i << ", " << c0 + j << "): code " << h.code(r0 + i, c0 + j)
                     << " scale " << h.scale(r0 + i, c0 + j) << " zero " << h.zero(r0 + i, c0 + j));
      REQUIRE(f32[at] == want);
      REQUIRE(bf16[at] == bf16Nearest(want));
    }
  }
}

/// What the quantizers must give, computed here from Quant.h's rules.
struct Expected {
  std::vector<int> codes; // [rows, cols], one per value
  std::vector<float> scales;
};

Expected expectInt8(const std::vector<float> &src, int64_t ld, int64_t rows, int64_t cols) {
  Expected e;
  for (int64_t i = 0; i < rows; ++i) {
    double amax = 0;
    for (int64_t j = 0; j < cols; ++j)
      amax = std::max(amax, std::fabs(double(src[size_t(i * ld + j)])));
    const float scale = amax > 0 ? float(amax / 127.0) : 1.0f;
    e.scales.push_back(scale);
    for (int64_t j = 0; j < cols; ++j) {
      const float q = src[size_t(i * ld + j)] / scale;
      e.codes.push_back(int(std::min(127.0, std::max(-127.0, roundHalfEven(q)))));
    }
  }
  return e;
}

Expected expectInt4(const std::vector<float> &src, int64_t ld, int64_t rows, int64_t cols,
                    int64_t group, bool zeroPoints) {
  Expected e;
  e.codes.resize(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t g = 0; g < cols / group; ++g) {
      const float *v = src.data() + i * ld + g * group;
      float lo = 0, hi = 0;
      for (int64_t j = 0; j < group; ++j) {
        lo = std::min(lo, v[j]);
        hi = std::max(hi, v[j]);
      }
      float scale, zero;
      if (zeroPoints) {
        scale = hi > lo ? (hi - lo) / 15.0f : 1.0f; // in fp32, as Quant.h says
        zero = float(std::min(15.0, std::max(0.0, roundHalfEven(-lo / scale))));
        e.scales.push_back(scale);
        e.scales.push_back(zero);
      } else {
        const double amax = std::max(-double(lo), double(hi));
        scale = amax > 0 ? float(amax / 7.0) : 1.0f;
        zero = 8;
        e.scales.push_back(scale);
      }
      for (int64_t j = 0; j < group; ++j)
        e.codes[size_t(i * cols + g * group + j)] =
            int(std::min(15.0, std::max(0.0, roundHalfEven(v[j] / scale) + zero)));
    }
  return e;
}

/// Quantizes `src` into `h` (its format and sizes set) through both entry
/// points, which must agree, and checks codes and scales against `want`;
/// also that each row of codes is rowBytes() long and nothing past the
/// last is written.
void quantizeAndCheck(Held &h, const std::vector<float> &src, int64_t ld, const Expected &want) {
  INFO(formatName(h) << " group " << h.group << ", " << h.rows << " x " << h.cols);
  const size_t bytes = size_t(h.rows * h.rowBytes());
  std::vector<uint8_t> direct(bytes + 16, 0xAB);
  std::vector<float> directScales(size_t(h.scaleCount()) + 4, -1.0f);
  if (h.format == WeightFormat::Int8Channel)
    quantizeInt8Rows(src.data(), ld, h.rows, h.cols, reinterpret_cast<int8_t *>(direct.data()),
                     directScales.data());
  else
    quantizeInt4Groups(src.data(), ld, h.rows, h.cols, h.group, h.zeroPoints, direct.data(),
                       directScales.data());
  for (size_t b = bytes; b < direct.size(); ++b)
    REQUIRE(direct[b] == 0xAB);
  for (size_t s = size_t(h.scaleCount()); s < directScales.size(); ++s)
    REQUIRE(directScales[s] == -1.0f);
  h.codes.assign(bytes, 0x5C);
  h.scales.assign(size_t(h.scaleCount()), -1.0f);
  quantize(h.view(), src.data(), ld, h.codes.data(), h.scales.data());
  REQUIRE(std::equal(h.codes.begin(), h.codes.end(), direct.begin()));
  REQUIRE(std::memcmp(h.scales.data(), directScales.data(), h.scales.size() * 4) == 0);
  REQUIRE(want.scales.size() == h.scales.size());
  for (size_t s = 0; s < h.scales.size(); ++s) {
    INFO("scale " << s);
    REQUIRE(h.scales[s] == want.scales[s]);
  }
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) {
      INFO("value (" << i << ", " << j << ") = " << src[size_t(i * ld + j)]);
      REQUIRE(h.code(i, j) == want.codes[size_t(i * h.cols + j)]);
    }
}

/// Every value of `h` within half its scale of `src` (plus fp32's rounding
/// of the product).
void checkRoundTrip(const Held &h, const std::vector<float> &src, int64_t ld) {
  std::vector<float> back(size_t(h.rows * h.cols));
  dequantize(h.view(), 0, h.rows, 0, h.cols, back.data(), DType::F32, h.cols);
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) {
      const float v = src[size_t(i * ld + j)], got = back[size_t(i * h.cols + j)];
      const float s = h.scale(i, j);
      INFO(formatName(h) << " group " << h.group << " value (" << i << ", " << j << ") " << v
                         << " -> " << got << ", scale " << s);
      REQUIRE(std::fabs(double(got) - double(v)) <= 0.5 * double(s) * (1 + 1e-6) + 1e-30);
    }
}

std::vector<float> normalMatrix(int64_t rows, int64_t ld, uint32_t seed, float sigma) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<float> x(size_t(rows * ld));
  for (float &v : x)
    v = normal(rng);
  return x;
}

} // namespace

TEST_CASE("int8 rows: scale amax / 127, codes the nearest integer (ties to even), zero rows "
          "scale 1") {
  // Three rows of 12 values, 16 apart; the 4 values between rows are huge
  // and must not count.
  const int64_t rows = 4, cols = 12, ld = 16;
  std::vector<float> x(size_t(rows * ld), 1e9f);
  // amax 127: scale 1, so each code is the value rounded, ties to even.
  const float row0[cols] = {0.5f,    1.5f,   2.5f,  -2.5f, -3.5f, 126.5f,
                            -127.0f, 127.0f, 0.49f, 3.2f,  -0.5f, 4.5f};
  const int codes0[cols] = {0, 2, 2, -2, -4, 126, -127, 127, 0, 3, 0, 4};
  // amax 254: scale 2; 5 / 2 = 2.5 -> 2, 7 / 2 = 3.5 -> 4, 9 / 2 = 4.5 -> 4.
  const float row1[cols] = {5.0f,  7.0f, 9.0f,   -254.0f, 1.0f,   3.0f,
                            -5.0f, 0.0f, 100.0f, -100.0f, 253.0f, 11.0f};
  const int codes1[cols] = {2, 4, 4, -127, 0, 2, -2, 0, 50, -50, 126, 6};
  // A row of zeros: scale 1, codes 0; a tiny row: scale 3e-30 / 127.
  for (int64_t j = 0; j < cols; ++j) {
    x[size_t(j)] = row0[j];
    x[size_t(ld + j)] = row1[j];
    x[size_t(2 * ld + j)] = j % 2 ? 0.0f : -0.0f;
    x[size_t(3 * ld + j)] = j == 4 ? -3e-30f : 1e-30f;
  }
  Held h{WeightFormat::Int8Channel, rows, cols, 0, false, {}, {}};
  quantizeAndCheck(h, x, ld, expectInt8(x, ld, rows, cols));
  CHECK(h.scales[0] == 1.0f);
  CHECK(h.scales[1] == 2.0f);
  CHECK(h.scales[2] == 1.0f);
  CHECK(h.scales[3] == 3e-30f / 127.0f);
  for (int64_t j = 0; j < cols; ++j) {
    INFO("column " << j);
    CHECK(h.code(0, j) == codes0[j]);
    CHECK(h.code(1, j) == codes1[j]);
    CHECK(h.code(2, j) == 0);
  }
  CHECK(h.code(3, 4) == -127);
  CHECK(h.code(3, 0) == 42); // 1e-30 / (3e-30 / 127) = 42.33
  // Codes are stored row after row, cols bytes each (not ld).
  CHECK(int8_t(h.codes[size_t(cols)]) == codes1[0]);
  checkRoundTrip(h, x, ld);

  // Random rows, one with an outlier, through both entry points.
  const int64_t R = 9, C = 300, LD = 311;
  std::vector<float> w = normalMatrix(R, LD, 5, 0.7f);
  w[size_t(4 * LD + 77)] = -55.0f;
  Held r{WeightFormat::Int8Channel, R, C, 0, false, {}, {}};
  quantizeAndCheck(r, w, LD, expectInt8(w, LD, R, C));
  CHECK(r.scales[4] == 55.0f / 127.0f);
  CHECK(r.code(4, 77) == -127);
  checkRoundTrip(r, w, LD);
}

TEST_CASE("int4 codes: value 0 in the low half of byte 0, value 1 in the high half") {
  // One row of 64 values in two groups of 32; bytes built by hand.
  Held h{WeightFormat::Int4Group, 1, 64, 32, false, std::vector<uint8_t>(32, 0x88), {}};
  h.codes[0] = 0x21;  // values 0, 1: codes 1, 2
  h.codes[1] = 0x43;  // values 2, 3: codes 3, 4
  h.codes[2] = 0xF0;  // values 4, 5: codes 0, 15
  h.codes[16] = 0x0F; // values 32, 33: codes 15, 0
  h.codes[31] = 0x7E; // values 62, 63: codes 14, 7
  const float wantSym[] = {-7, -6, -5, -4, -8, 7};
  SECTION("zero point 8") {
    h.scales = {1.0f, 0.5f};
    std::vector<float> out(64, -1.0f);
    dequantize(h.view(), 0, 1, 0, 64, out.data(), DType::F32, 64);
    for (int j = 0; j < 6; ++j)
      CHECK(out[size_t(j)] == wantSym[j]);
    for (int j = 6; j < 32; ++j)
      CHECK(out[size_t(j)] == 0.0f); // code 8
    CHECK(out[32] == 3.5f);          // (15 - 8) x 0.5
    CHECK(out[33] == -4.0f);         // (0 - 8) x 0.5
    CHECK(out[62] == 3.0f);          // (14 - 8) x 0.5
    CHECK(out[63] == -0.5f);         // (7 - 8) x 0.5
    // From value 1 (an odd start): the high half of byte 0 first.
    std::vector<float> odd(5, -1.0f);
    dequantize(h.view(), 0, 1, 1, 6, odd.data(), DType::F32, 5);
    CHECK(odd == std::vector<float>{-6, -5, -4, -8, 7});
    std::vector<float> tail(3, -1.0f);
    dequantize(h.view(), 0, 1, 31, 34, tail.data(), DType::F32, 3);
    CHECK(tail == std::vector<float>{0.0f, 3.5f, -4.0f});
  }
  SECTION("zero points of their own") {
    h.zeroPoints = true;
    h.scales = {0.25f, 3.0f, 2.0f, 15.0f}; // (scale, zero) per group
    std::vector<float> out(64, -1.0f);
    dequantize(h.view(), 0, 1, 0, 64, out.data(), DType::F32, 64);
    const float want[] = {-0.5f, -0.25f, 0.0f, 0.25f, -0.75f, 3.0f};
    for (int j = 0; j < 6; ++j)
      CHECK(out[size_t(j)] == want[j]);
    CHECK(out[6] == 1.25f);   // (8 - 3) x 0.25
    CHECK(out[32] == 0.0f);   // (15 - 15) x 2
    CHECK(out[33] == -30.0f); // (0 - 15) x 2
    CHECK(out[63] == -16.0f); // (7 - 15) x 2
  }
}

TEST_CASE("int4 groups of 32, 64 and 128, with and without zero points, quantize by the rule") {
  const int64_t rows = 6, cols = 384, ld = 400;
  for (const int64_t group : {int64_t(32), int64_t(64), int64_t(128)})
    for (const bool zeroPoints : {false, true}) {
      std::vector<float> x = normalMatrix(rows, ld, uint32_t(group + zeroPoints), 1.3f);
      for (int64_t j = 0; j < group; ++j) {
        x[size_t(1 * ld + j)] = 0.0f;                                     // a group of zeros
        x[size_t(2 * ld + j)] = std::fabs(x[size_t(2 * ld + j)]) + 0.25f; // all positive
        x[size_t(3 * ld + group + j)] = -std::fabs(x[size_t(3 * ld + group + j)]) - 0.1f;
      }
      x[size_t(4 * ld + 5)] = 40.0f; // an outlier: its group's scale
      // Exact ties: in a group with amax 7 (scale 1) without zero points.
      for (int64_t j = 0; j < group; ++j)
        x[size_t(5 * ld + j)] = float(j % 15) - 7.0f + (j % 3 == 0 ? 0.5f : 0.0f);
      x[size_t(5 * ld)] = -7.0f;
      Held h{WeightFormat::Int4Group, rows, cols, group, zeroPoints, {}, {}};
      const Expected want = expectInt4(x, ld, rows, cols, group, zeroPoints);
      quantizeAndCheck(h, x, ld, want);
      const int64_t groups = cols / group, pair = zeroPoints ? 2 : 1;
      CHECK(int64_t(h.scales.size()) == rows * groups * pair);
      CHECK(h.scales[size_t(1 * groups * pair)] == 1.0f); // the group of zeros
      if (zeroPoints) {
        CHECK(h.scales[size_t(1 * groups * pair + 1)] == 0.0f);        // zeros: zero point 0
        CHECK(h.scales[size_t(2 * groups * pair + 1)] == 0.0f);        // lo = 0
        CHECK(h.scales[size_t((3 * groups + 1) * pair + 1)] == 15.0f); // hi = 0
      } else {
        CHECK(h.scales[size_t(4 * groups)] == 40.0f / 7.0f);
        CHECK(h.code(4, 5) == 15);
        CHECK(h.code(1, 0) == 8);
        // Scale 1 and ties to even: -7 -> 1, -3.5 -> 4, -0.5 -> 8, 2.5 ->
        // 10, 5.5 -> 14, -6.5 -> 2; 7 -> 15.
        CHECK(h.scales[size_t(5 * groups)] == 1.0f);
        const std::pair<int64_t, int> ties[] = {{0, 1},   {3, 4},  {6, 8},   {9, 10},
                                                {12, 14}, {15, 2}, {14, 15}, {1, 2}};
        for (const auto &[j, code] : ties) {
          INFO("column " << j << " value " << x[size_t(5 * ld + j)]);
          CHECK(h.code(5, j) == code);
        }
      }
      checkRoundTrip(h, x, ld);
    }
}

TEST_CASE("dequantizing any block of rows and columns gives the definition's values, in fp32 "
          "and bf16") {
  std::vector<Held> mats = intFormats(1);
  const int64_t blocks[][4] = {
      {0, 7, 0, 384},   // the whole matrix
      {2, 5, 1, 383},   // odd start, odd end
      {3, 4, 33, 97},   // across group edges from an odd column
      {1, 6, 127, 129}, // two values on either side of 128
      {0, 7, 5, 6},     // one value, odd
      {6, 7, 64, 65},   // one value, even
      {4, 7, 255, 384}, // odd start to the end
      {0, 1, 0, 0},     // nothing
      {5, 5, 0, 384},   // no rows
  };
  for (const Held &h : mats) {
    for (const auto &b : blocks)
      checkBlock(h, b[0], b[1], b[2], b[3]);
    std::mt19937 rng(uint32_t(h.group + h.zeroPoints));
    for (int k = 0; k < 40; ++k) {
      const int64_t c0 = int64_t(rng() % 384), c1 = c0 + int64_t(rng() % (385 - c0));
      const int64_t r0 = int64_t(rng() % 7), r1 = r0 + int64_t(rng() % (8 - r0));
      checkBlock(h, r0, r1, c0, c1);
    }
  }
}

TEST_CASE("the vector decode (runs of 16 and more) agrees with the scalar definition at every "
          "start and length") {
#if defined(__x86_64__)
  INFO("AVX-512 on this CPU: "
       << (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? "yes" : "no"));
#endif
  // Codes at their extremes as well as random ones, scales that do not
  // round trivially, and bf16 ties made likely by a scale of 1 + 2^-8.
  Held i8 = randomHeld(WeightFormat::Int8Channel, 3, 200, 0, false, 21);
  i8.codes[5] = 0x80; // -128
  i8.codes[6] = 0x7F; // 127
  i8.scales[1] = 1.0f + 1.0f / 256;
  Held i4 = randomHeld(WeightFormat::Int4Group, 3, 256, 128, false, 22);
  Held zp = randomHeld(WeightFormat::Int4Group, 3, 256, 64, true, 23);
  i4.scales[2] = 1.0f + 1.0f / 256;
  // Scales that make subnormal values (rounded to bf16 as floatToBf16 does,
  // not read as zero by avx512_bf16's conversion): a row of int8, a group
  // of int4, and a group whose zero point is not whole, so that (code -
  // zero) x scale is subnormal although the scale is not.
  i8.scales[2] = 1e-39f;
  i4.scales[3] = 3e-40f;
  zp.scales[2] = 2e-38f;
  zp.scales[3] = 7.5f;
  for (const Held *h : {&i8, &i4, &zp})
    for (int64_t c0 = 0; c0 < 40; ++c0)
      for (const int64_t n : {int64_t(1), int64_t(15), int64_t(16), int64_t(17), int64_t(31),
                              int64_t(32), int64_t(33), int64_t(47), int64_t(64), int64_t(129)})
        checkBlock(*h, 0, 3, c0, std::min(h->cols, c0 + n));
}

/// FP8 blocks of random codes (NaN codes replaced) and the scales given.
Held randomFp8(int64_t rows, int64_t cols, std::vector<float> scales, uint32_t seed) {
  Held h{WeightFormat::Fp8Block128, rows, cols, 0, false, {}, std::move(scales)};
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < rows * cols; ++i) {
    const uint8_t c = uint8_t(rng() & 0xFF);
    h.codes.push_back((c & 0x7F) == 0x7F ? 0 : c);
  }
  REQUIRE(int64_t(h.scales.size()) == h.scaleCount());
  return h;
}

TEST_CASE("FP8 blocks dequantize to the definition's values at every start and length, with "
          "NaN codes, subnormal values and scales whose 2^8 multiple overflows") {
  // Scales per 128 x 128 block of [131, 300]: one subnormal (most of its
  // values subnormal: rounded to bf16, not read as zero), one whose 2^8
  // multiple is not finite (its largest codes' values overflow to infinity).
  Held h = randomFp8(131, 300, {0.5f, 2.0f, 3e-39f, 2e36f, 0.01f, 1.0f + 1.0f / 256}, 51);
  h.codes[size_t(3 * 300 + 17)] = 0x7F; // NaN codes of either sign
  h.codes[size_t(130 * 300 + 299)] = 0xFF;
  for (int64_t c0 = 0; c0 < 40; ++c0)
    for (const int64_t n : {int64_t(1), int64_t(15), int64_t(16), int64_t(17), int64_t(33),
                            int64_t(129), int64_t(300)})
      checkBlock(h, 0, 5, c0, std::min(h.cols, c0 + n));
  checkBlock(h, 0, h.rows, 0, h.cols);
  checkBlock(h, 120, 131, 101, 300);
}

TEST_CASE("FP8 blocks dequantize to the definition's values where the CPU reads subnormal "
          "inputs as zero") {
  // A process may set MXCSR.DAZ (PyTorch's torch.set_flush_denormal(True)):
  // the decoders must not pass a subnormal code's value through an
  // instruction that reads it as zero. The scales are normal, so the
  // definition's products do not change under DAZ; 1000 and 300 are
  // scales whose 2^8 multiple stays finite.
  // The tile's decoders (the panels' units of B as stored, DecodedB::pairs;
  // codes packed beforehand, either form of op(B)) must give under DAZ what
  // they give without it (their own cases compare that with dequantize).
  const Held h = randomFp8(131, 300, {0.5f, 1000.0f, 0.01f, 2.0f, 300.0f, 1.0f + 1.0f / 256}, 71);
  const QuantizedMatrix m = h.view();
  const auto tileDecodes = [&] {
    std::vector<uint32_t> out;
    const tile::DecodedB d = decodedB(m);
    if (d.pairs) {
      const int64_t units = (m.rows + 1) / 2, stride = units * 48, panels = (m.cols + 47) / 48;
      std::vector<uint32_t> pairs(size_t(panels * stride));
      d.pairs(d.context, 0, m.rows, 0, m.cols, pairs.data(), stride);
      out.insert(out.end(), pairs.begin(), pairs.end());
    }
    for (const bool transposed : {false, true}) {
      const int64_t depth = transposed ? m.cols : m.rows, n = transposed ? m.rows : m.cols;
      std::vector<uint64_t> packed((packedCodesBytes(m, transposed, n) + 7) / 8);
      packCodes(m, transposed, 0, n, packed.data());
      const tile::DecodedB p = packedCodesB(packed.data());
      if (!p.panel)
        continue;
      const int64_t units = (depth + 1) / 2;
      std::vector<uint32_t> panel(size_t(units * 48));
      for (int64_t q = 0; q * 48 < n; ++q) {
        p.panel(p.context, q, 0, units, panel.data());
        out.insert(out.end(), panel.begin(), panel.end());
      }
    }
    return out;
  };
  checkBlock(h, 0, h.rows, 0, h.cols);
  const std::vector<uint32_t> plain = tileDecodes();
#if defined(__x86_64__)
  struct Csr {
    const unsigned saved = _mm_getcsr();
    Csr() { _mm_setcsr(saved | _MM_DENORMALS_ZERO_ON); }
    ~Csr() { _mm_setcsr(saved); }
  } daz;
  checkBlock(h, 0, h.rows, 0, h.cols);
  checkBlock(h, 3, 9, 17, 290);
  const std::vector<uint32_t> underDaz = tileDecodes();
  REQUIRE(underDaz.size() == plain.size());
  CHECK(std::memcmp(underDaz.data(), plain.data(), plain.size() * 4) == 0);
#endif
}

TEST_CASE("a quantized B as stored gives the tile's panels as dequantize's bf16 values "
          "(DecodedB::pairs)") {
  // Every format; column ranges from unaligned starts (16-column vectors
  // across int4 groups and FP8 blocks, an odd int4 start) and of widths not
  // a multiple of 16 (lanes past the last column zero); depth ranges of odd
  // length (a last unit's high half zero) and from an odd row.
  std::vector<Held> mats = intFormats(61);
  Held fp8 = randomFp8(131, 300, {0.5f, 2.0f, 3e-39f, 2e36f, 0.01f, 7.0f}, 63);
  fp8.codes[size_t(129 * 300 + 140)] = 0xFF;
  mats.push_back(fp8);
  for (const Held &h : mats) {
    const QuantizedMatrix m = h.view();
    const tile::DecodedB d = decodedB(m);
    if (!d.pairs) {
      WARN("no avx512_bf16 here: the decoder writes no panels of a B as stored");
      return;
    }
    std::vector<uint16_t> want(size_t(m.rows * m.cols));
    dequantize(m, 0, m.rows, 0, m.cols, want.data(), DType::BF16, m.cols);
    const int64_t rowRanges[][2] = {{0, m.rows}, {1, m.rows}, {2, 5}};
    for (const auto &rows : rowRanges)
      for (const auto &[c0, n] : {std::pair<int64_t, int64_t>{0, m.cols},
                                  {7, 50},
                                  {33, 97},
                                  {16, 192},
                                  {m.cols - 17, 17},
                                  {5, 1}}) {
        const int64_t r0 = rows[0], r1 = rows[1], units = (r1 - r0 + 1) / 2;
        INFO(formatName(h) << " group " << h.group << ": rows [" << r0 << ", " << r1
                           << "), columns [" << c0 << ", " << c0 + n << ")");
        const int64_t stride = units * 48 + 16, panels = (n + 47) / 48;
        std::vector<uint32_t> got(size_t(panels * stride), 0xDEADBEEF);
        d.pairs(d.context, r0, r1, c0, c0 + n, got.data(), stride);
        for (int64_t q = 0; q < panels; ++q)
          for (int64_t t = 0; t < units; ++t)
            for (int64_t c = 0; c < 48; ++c) {
              const int64_t j = q * 48 + c;
              const uint32_t pair = got[size_t(q * stride + t * 48 + c)];
              if (j >= (n + 15) / 16 * 16) { // past the last vector: untouched
                REQUIRE(pair == 0xDEADBEEF);
                continue;
              }
              const int64_t i = r0 + 2 * t;
              const uint16_t lo = j < n ? want[size_t(i * m.cols + c0 + j)] : 0;
              const uint16_t hi = j < n && i + 1 < r1 ? want[size_t((i + 1) * m.cols + c0 + j)] : 0;
              INFO("unit " << t << ", column " << j);
              REQUIRE((pair & 0xFFFF) == lo);
              REQUIRE((pair >> 16) == hi);
            }
      }
  }
}

TEST_CASE("NaN or infinity in a row or group gives it a NaN scale; its neighbours are untouched") {
  const float nan = std::numeric_limits<float>::quiet_NaN(),
              inf = std::numeric_limits<float>::infinity();
  const int64_t cols = 128, ld = cols;
  for (const float bad : {nan, inf, -inf}) {
    INFO("bad value " << bad);
    // int8: row 1 holds it; rows 0 and 2 do not.
    std::vector<float> x(size_t(3 * ld), 0.75f);
    x[size_t(ld + 9)] = bad;
    x[size_t(2 * ld + 3)] = -1.5f;
    std::vector<int8_t> codes(size_t(3 * cols));
    std::vector<float> scales(3);
    quantizeInt8Rows(x.data(), ld, 3, cols, codes.data(), scales.data());
    CHECK(scales[0] == 0.75f / 127.0f);
    CHECK(std::isnan(scales[1]));
    CHECK(scales[2] == 1.5f / 127.0f);
    Held h8{WeightFormat::Int8Channel,
            3,
            cols,
            0,
            false,
            std::vector<uint8_t>(codes.begin(), codes.end()),
            scales};
    std::vector<float> out(size_t(3 * cols));
    dequantize(h8.view(), 0, 3, 0, cols, out.data(), DType::F32, cols);
    for (int64_t j = 0; j < cols; ++j) {
      REQUIRE(codes[size_t(cols + j)] == 0); // value / NaN has no code: 0
      REQUIRE(std::isnan(out[size_t(cols + j)]));
      REQUIRE(out[size_t(j)] == 127.0f * scales[0]);
      REQUIRE(std::isfinite(out[size_t(2 * cols + j)]));
    }
    // int4, groups of 32: group 2 of the row holds it.
    for (const bool zeroPoints : {false, true}) {
      INFO("zero points " << zeroPoints);
      std::vector<float> y(size_t(cols), 0.5f);
      y[70] = bad;
      Held h4{WeightFormat::Int4Group,
              1,
              cols,
              32,
              zeroPoints,
              std::vector<uint8_t>(size_t(cols / 2)),
              std::vector<float>(zeroPoints ? 8 : 4)};
      quantizeInt4Groups(y.data(), cols, 1, cols, 32, zeroPoints, h4.codes.data(),
                         h4.scales.data());
      for (int64_t g = 0; g < 4; ++g) {
        const float s = h4.scales[size_t(zeroPoints ? 2 * g : g)];
        INFO("group " << g);
        if (g == 2)
          CHECK(std::isnan(s));
        else
          CHECK(s == (zeroPoints ? 0.5f / 15.0f : 0.5f / 7.0f));
      }
      std::vector<float> back(static_cast<size_t>(cols));
      dequantize(h4.view(), 0, 1, 0, cols, back.data(), DType::F32, cols);
      for (int64_t j = 0; j < cols; ++j) {
        INFO("column " << j << ": " << back[size_t(j)]);
        if (j / 32 == 2) {
          REQUIRE(h4.code(0, j) == 0);
          REQUIRE(std::isnan(back[size_t(j)]));
        } else
          REQUIRE(std::fabs(back[size_t(j)] - 0.5f) <= 0.5f * h4.scale(0, j) * (1 + 1e-6f));
      }
    }
  }
}

TEST_CASE("dequantize reads FP8 blocks as dequantizeBlocks defines them") {
  // Codes [200, 300] and scales per 128 x 128 block: the e4m3 value times
  // its block's scale, from any block of rows and columns.
  const int64_t rows = 200, cols = 300;
  std::mt19937 rng(31);
  std::vector<uint8_t> codes(size_t(rows * cols));
  for (uint8_t &c : codes) {
    c = uint8_t(rng() & 0xFF);
    if ((c & 0x7F) == 0x7F)
      c = 0x00; // no NaN codes
  }
  const std::vector<float> scales = {0.5f, 2.0f, 0.125f, 3.0f, 0.01f, 7.0f};
  QuantizedMatrix m;
  m.format = WeightFormat::Fp8Block128;
  m.codes = codes.data();
  m.scales = scales.data();
  m.rows = rows;
  m.cols = cols;
  const int64_t r0 = 100, r1 = 150, c0 = 101, c1 = 290, ld = 200;
  std::vector<float> out(size_t((r1 - r0) * ld), -1.0f);
  dequantize(m, r0, r1, c0, c1, out.data(), DType::F32, ld);
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = c0; j < c1; ++j) {
      const float want =
          e4m3ToFloat(codes[size_t(i * cols + j)]) * scales[size_t((i / 128) * 3 + j / 128)];
      REQUIRE(out[size_t((i - r0) * ld + (j - c0))] == want);
    }
  CHECK(out[size_t(c1 - c0)] == -1.0f);
}

TEST_CASE("codes packed for the tile decode into its panels as dequantize's bf16 values") {
  // Every format, op(B) read transposed (the forward's) and as stored (the
  // backward's dX), column ranges from unaligned starts (16-column vectors
  // across int4 groups), odd depths (a last unit's high half past it: 0).
  std::vector<Held> mats = intFormats(41);
  Held fp8{WeightFormat::Fp8Block128, 131, 300, 0, false, {}, {}};
  std::mt19937 rng(43);
  for (int64_t i = 0; i < fp8.rows * fp8.cols; ++i) {
    const uint8_t c = uint8_t(rng() & 0xFF);
    fp8.codes.push_back((c & 0x7F) == 0x7F ? 0 : c);
  }
  // One block's scale subnormal: most of its values too (rounded to bf16 as
  // dequantize does, not read as zero).
  fp8.scales = {0.5f, 2.0f, 0.125f, 3e-39f, 0.01f, 7.0f};
  mats.push_back(fp8);
  // A scale whose 2^8 multiple is not finite: the packing keeps the scales
  // as they are and the decoder scales the codes' fp16 values itself (the
  // largest codes' values overflow to infinity, as dequantize's do).
  fp8.scales[4] = 2e36f;
  mats.push_back(fp8);
  for (const Held &h : mats)
    for (const bool transposed : {false, true}) {
      const QuantizedMatrix m = h.view();
      const int64_t depth = transposed ? m.cols : m.rows, width = transposed ? m.rows : m.cols;
      // op(B) in bf16 by dequantize: [depth, width].
      std::vector<uint16_t> want(size_t(m.rows * m.cols));
      dequantize(m, 0, m.rows, 0, m.cols, want.data(), DType::BF16, m.cols);
      const auto value = [&](int64_t p, int64_t j) {
        return transposed ? want[size_t(j * m.cols + p)] : want[size_t(p * m.cols + j)];
      };
      for (const auto &[c0, n] :
           {std::pair<int64_t, int64_t>{0, width}, {7, 50}, {33, 97}, {width - 17, 17}, {5, 1}}) {
        if (c0 < 0 || c0 + n > width)
          continue;
        INFO(formatName(h) << (h.format == WeightFormat::Fp8Block128 ? " (fp8)" : "") << " group "
                           << h.group << (transposed ? ", transposed" : ", as stored")
                           << ": columns [" << c0 << ", " << c0 + n << ")");
        std::vector<uint64_t> packed((packedCodesBytes(m, transposed, n) + 7) / 8);
        packCodes(m, transposed, c0, n, packed.data());
        const tile::DecodedB d = packedCodesB(packed.data());
        if (!d.panel) {
          WARN("no AVX-512 here: the packed codes' decoder is absent");
          return;
        }
        const int64_t units = (depth + 1) / 2;
        std::vector<uint32_t> panel(size_t(units * 48));
        for (int64_t q = 0; q * 48 < n; ++q) {
          // In two calls, as the tile asks for a depth block at a time.
          d.panel(d.context, q, 0, units / 2, panel.data());
          d.panel(d.context, q, units / 2, units, panel.data() + (units / 2) * 48);
          for (int64_t t = 0; t < units; ++t)
            for (int64_t c = 0; c < 48 && q * 48 + c < n; ++c) {
              const int64_t j = c0 + q * 48 + c;
              const uint32_t got = panel[size_t(t * 48 + c)];
              REQUIRE((got & 0xFFFF) == value(2 * t, j));
              REQUIRE((got >> 16) == (2 * t + 1 < depth ? value(2 * t + 1, j) : 0u));
            }
        }
      }
    }
}

TEST_CASE("packed FP8 codes that are NaN decode to NaN, their neighbours as dequantize") {
  // The packing looks for NaN codes once, over the whole cell: a NaN code
  // anywhere in it (here one in the last unit only, and one of either sign)
  // must still come out NaN, from either half of a depth range.
  Held fp8{WeightFormat::Fp8Block128, 64, 96, 0, false, {}, {}};
  std::mt19937 rng(47);
  for (int64_t i = 0; i < fp8.rows * fp8.cols; ++i) {
    const uint8_t c = uint8_t(rng() & 0xFF);
    fp8.codes.push_back((c & 0x7F) == 0x7F ? 0 : c);
  }
  const std::pair<int64_t, int64_t> nans[] = {{63, 5}, {62, 40}};
  fp8.codes[size_t(63 * 96 + 5)] = 0x7F;
  fp8.codes[size_t(62 * 96 + 40)] = 0xFF;
  fp8.scales = {0.5f};
  const QuantizedMatrix m = fp8.view();
  std::vector<uint16_t> want(size_t(m.rows * m.cols));
  dequantize(m, 0, m.rows, 0, m.cols, want.data(), DType::BF16, m.cols);
  std::vector<uint64_t> packed((packedCodesBytes(m, false, 48) + 7) / 8);
  packCodes(m, false, 0, 48, packed.data());
  const tile::DecodedB d = packedCodesB(packed.data());
  if (!d.panel) {
    WARN("no AVX-512 here: the packed codes' decoder is absent");
    return;
  }
  std::vector<uint32_t> panel(size_t(32 * 48));
  d.panel(d.context, 0, 0, 16, panel.data());
  d.panel(d.context, 0, 16, 32, panel.data() + 16 * 48);
  const auto isNaN = [](uint16_t b) { return (b & 0x7FFF) > 0x7F80; };
  for (int64_t p = 0; p < 64; ++p)
    for (int64_t j = 0; j < 48; ++j) {
      const uint32_t pair = panel[size_t((p / 2) * 48 + j)];
      const uint16_t got = uint16_t(p % 2 ? pair >> 16 : pair & 0xFFFF);
      const bool nan = (p == nans[0].first && j == nans[0].second) ||
                       (p == nans[1].first && j == nans[1].second);
      INFO("depth " << p << ", column " << j);
      if (nan)
        REQUIRE(isNaN(got));
      else
        REQUIRE(got == want[size_t(p * 96 + j)]);
    }
}

TEST_CASE("LayerShape names each format and gives its stored and scale dims") {
  LayerShape s;
  s.activations = DType::BF16;
  const std::array<int64_t, 3> w{4, 256, 384};
  CHECK(s.weightFormatName() == "dense");
  CHECK(s.weightDType() == DType::BF16);
  CHECK(s.storedDims(w) == std::vector<int64_t>{4, 256, 384});
  CHECK(s.scaleDims(w).empty());
  s.weightFormat = WeightFormat::Fp8Block128;
  CHECK(s.weightFormatName() == "fp8_block128");
  CHECK(s.weightDType() == DType::F8E4M3);
  CHECK(s.scaleDims({4, 200, 300}) == std::vector<int64_t>{4, 2, 3});
  s.weightFormat = WeightFormat::Int8Channel;
  CHECK(s.weightFormatName() == "int8");
  CHECK(s.weightDType() == DType::I8);
  CHECK(s.storedDims(w) == std::vector<int64_t>{4, 256, 384});
  CHECK(s.scaleDims(w) == std::vector<int64_t>{4, 256});
  s.weightFormat = WeightFormat::Int4Group;
  s.weightGroup = 64;
  CHECK(s.weightFormatName() == "int4_g64");
  CHECK(s.weightDType() == DType::I4);
  CHECK(s.storedDims(w) == std::vector<int64_t>{4, 256, 192});
  CHECK(s.storedDims({1, 2, 33}) == std::vector<int64_t>{1, 2, 17});
  CHECK(s.scaleDims(w) == std::vector<int64_t>{4, 256, 6});
  s.weightZeroPoints = true;
  s.weightGroup = 128;
  CHECK(s.weightFormatName() == "int4_g128_zp");
  CHECK(s.scaleDims(w) == std::vector<int64_t>{4, 256, 3, 2});
  CHECK(dtypeName(DType::I8) == std::string("i8"));
  CHECK(dtypeName(DType::I4) == std::string("i4"));
  CHECK(int4Bytes(7) == 4);
  CHECK(int4Bytes(8) == 4);
}
