//===- Fp8Test.cpp - FP8 e4m3 conversion and block quantization -----------===//
//
// The conversion against a reference written from the format's definition
// (every finite code's value, nearest with ties to even, saturation at 448):
// all 256 codes, NaN and infinity, every bf16 bit pattern and random fp32
// values; block quantization round trips within e4m3's resolution.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Fp8.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace moec;
using namespace moec::cpu;

namespace {

/// The value of code `c` from the definition: sign, exponent bits e (bias
/// 7), mantissa bits m; e == 0 is subnormal (m * 2^-9); 0x7F/0xFF are NaN.
double definition(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7)
    return std::nan("");
  const double v = e == 0 ? m * std::pow(2.0, -9) : (1 + m / 8.0) * std::pow(2.0, e - 7);
  return c & 0x80 ? -v : v;
}

/// The code nearest to `x` by search: ties to the even code, |x| >= 448
/// (infinity too) to +-448, NaN to NaN with x's sign.
uint8_t nearest(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x))
    return sign | 0x7F;
  const double a = std::fabs(double(x));
  if (a >= 448)
    return sign | 0x7E;
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(definition(c) - a), bd = std::fabs(definition(best) - a);
    if (d < bd || (d == bd && (c & 1) == 0 && (best & 1) == 1))
      best = c;
  }
  return sign | uint8_t(best);
}

float fromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

} // namespace

TEST_CASE("every e4m3 code decodes to its defined value and encodes back") {
  for (int c = 0; c < 256; ++c) {
    const double want = definition(c);
    const float got = e4m3ToFloat(uint8_t(c));
    INFO("code 0x" << std::hex << c);
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
      CHECK(floatToE4m3(got) == ((c & 0x80) | 0x7F));
      continue;
    }
    CHECK(double(got) == want);
    CHECK(floatToE4m3(got) == uint8_t(c));
  }
  CHECK(e4m3ToFloat(0x7E) == 448.0f);
  CHECK(e4m3ToFloat(0x01) == std::ldexp(1.0f, -9));
}

TEST_CASE("NaN, infinity and overflow: NaN stays NaN, the rest saturates at 448") {
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(floatToE4m3(std::numeric_limits<float>::quiet_NaN()) == 0x7F);
  CHECK(floatToE4m3(-std::numeric_limits<float>::quiet_NaN()) == 0xFF);
  CHECK(floatToE4m3(fromBits(0x7F800001u)) == 0x7F); // a signalling NaN
  CHECK(floatToE4m3(inf) == 0x7E);
  CHECK(floatToE4m3(-inf) == 0xFE);
  for (float big : {448.0f, 449.0f, 464.0f, 479.9f, 480.0f, 1e6f, 3e38f}) {
    CHECK(floatToE4m3(big) == 0x7E);
    CHECK(floatToE4m3(-big) == 0xFE);
  }
  CHECK(floatToE4m3(-0.0f) == 0x80);
}

TEST_CASE("ties go to the even code, everything else to the nearest") {
  // Midpoints between neighbouring finite codes, and just off them.
  for (int c = 0; c < 0x7E; ++c) {
    const double mid = (definition(c) + definition(c + 1)) / 2;
    const uint8_t even = (c & 1) ? uint8_t(c + 1) : uint8_t(c);
    INFO("between 0x" << std::hex << c << " and 0x" << c + 1);
    CHECK(floatToE4m3(float(mid)) == even);
    CHECK(floatToE4m3(std::nextafter(float(mid), 0.0f)) == uint8_t(c));
    CHECK(floatToE4m3(std::nextafter(float(mid), 1000.0f)) == uint8_t(c + 1));
  }
  // Every bf16 bit pattern, and random fp32 values over the whole range.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float x = fromBits(b << 16);
    REQUIRE(floatToE4m3(x) == nearest(x));
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> pick(0x30000000u, 0x44000000u); // 2^-31 .. 512
  for (int i = 0; i < 20000; ++i) {
    const float x = fromBits(pick(rng) | (i & 1 ? 0x80000000u : 0));
    REQUIRE(floatToE4m3(x) == nearest(x));
  }
}

TEST_CASE("rows quantized in blocks of 128 come back within e4m3's resolution") {
  for (const int64_t cols : {int64_t(64), int64_t(128), int64_t(300), int64_t(1000)}) {
    for (DType elt : {DType::F32, DType::BF16}) {
      const int64_t rows = 5, ld = cols + 3, width = fp8RowBytes(cols);
      std::mt19937 rng{uint32_t(cols)};
      std::normal_distribution<float> value(0.0f, 2.0f);
      std::vector<float> x(size_t(rows * ld));
      for (float &v : x)
        v = value(rng);
      for (int64_t j = 0; j < cols; ++j)
        x[size_t(2 * ld + j)] = 0; // a row of zeros
      x[size_t(3 * ld + 7)] = 1000; // an outlier: its block's scale
      std::vector<char> stored(size_t(rows * ld) * dtypeSize(elt));
      storeFloats(x.data(), stored.data(), elt, x.size());
      std::vector<float> in(x.size());
      loadFloats(stored.data(), elt, in.data(), in.size());
      std::vector<uint8_t> q(size_t(rows * width), 0xAA);
      quantizeRows(stored.data(), elt, ld, q.data(), width, 0, rows, cols);
      std::vector<char> back(stored.size());
      dequantizeRows(q.data(), width, back.data(), elt, ld, 0, rows, cols);
      std::vector<float> out(x.size());
      loadFloats(back.data(), elt, out.data(), out.size());
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t b = 0; b * 128 < cols; ++b) {
          float amax = 0;
          for (int64_t j = b * 128; j < std::min(cols, b * 128 + 128); ++j)
            amax = std::max(amax, std::fabs(in[size_t(i * ld + j)]));
          float scale;
          std::memcpy(&scale, &q[size_t(i * width + cols + 4 * b)], 4);
          CHECK(scale == (amax > 0 ? amax / 448.0f : 1.0f));
          for (int64_t j = b * 128; j < std::min(cols, b * 128 + 128); ++j) {
            const float v = in[size_t(i * ld + j)], got = out[size_t(i * ld + j)];
            // Half a step of e4m3 (3 mantissa bits: 2^-4 relative) or of its
            // subnormals (2^-10 of the scale), plus bf16's rounding.
            const float bound = std::max(std::fabs(v) / 16, scale / 1024) +
                                (elt == DType::BF16 ? std::fabs(v) / 128 : 0);
            INFO("cols " << cols << " row " << i << " col " << j << ": " << v << " -> " << got);
            REQUIRE(std::fabs(got - v) <= bound);
            // The same as decoding the code by hand.
            const float decoded = e4m3ToFloat(q[size_t(i * width + j)]) * scale;
            REQUIRE(got == (elt == DType::BF16 ? roundToBf16(decoded) : decoded));
          }
        }
    }
  }
}

TEST_CASE("a block holding NaN or infinity dequantizes to NaN, its neighbours do not") {
  const int64_t cols = 256, width = fp8RowBytes(cols);
  std::vector<uint8_t> q(static_cast<size_t>(width), 0);
  std::vector<float> y(cols);
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x(cols, 1.5f);
    x[3] = bad; // in the first block only
    quantizeRows(x.data(), DType::F32, cols, q.data(), width, 0, 1, cols);
    dequantizeRows(q.data(), width, y.data(), DType::F32, cols, 0, 1, cols);
    for (int64_t j = 0; j < 128; ++j)
      REQUIRE(std::isnan(y[size_t(j)]));
    for (int64_t j = 128; j < cols; ++j)
      REQUIRE(y[size_t(j)] == 1.5f);
  }
}

TEST_CASE("quantizeRows gives floatToE4m3's codes lane for lane (its vector path too)") {
  // Every finite bf16 value up to 448, in blocks whose first value is 448:
  // the scale is 1, so each code is floatToE4m3 of the value itself.
  std::vector<float> values;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float v = fromBits(b << 16);
    if (!std::isfinite(v) || std::fabs(v) > 448.0f)
      continue;
    if (values.size() % 128 == 0)
      values.push_back(448.0f);
    values.push_back(v);
  }
  // Random values with random scales, a short last block per row.
  std::mt19937 rng{11};
  std::uniform_int_distribution<uint32_t> pick(0x20000000u, 0x48000000u);
  const int64_t cols = 300, rows = 40;
  std::vector<float> randomRows(size_t(cols * rows));
  for (size_t i = 0; i < randomRows.size(); ++i)
    randomRows[i] = fromBits(pick(rng) | (i & 1 ? 0x80000000u : 0));
  for (const auto &[data, width] : {std::pair{&values, int64_t(128)}, std::pair{&randomRows, cols}}) {
    const int64_t n = int64_t(data->size()) / width, stride = fp8RowBytes(width);
    std::vector<uint8_t> q(static_cast<size_t>(n * stride), 0);
    quantizeRows(data->data(), DType::F32, width, q.data(), stride, 0, n, width);
    std::vector<float> back(data->size());
    dequantizeRows(q.data(), stride, back.data(), DType::F32, width, 0, n, width);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < width; ++j) {
        float scale;
        std::memcpy(&scale, &q[size_t(i * stride + width + 4 * (j / 128))], 4);
        const float v = (*data)[size_t(i * width + j)];
        const uint8_t code = q[size_t(i * stride + j)];
        INFO("row " << i << " col " << j << " value " << v << " scale " << scale);
        REQUIRE(code == floatToE4m3(v / scale));
        REQUIRE(back[size_t(i * width + j)] == e4m3ToFloat(code) * scale);
      }
  }
}

TEST_CASE("weights in 128 x 128 blocks: one scale per block, any sub-block dequantized alike") {
  // A 200 x 300 matrix: partial blocks on both edges, a zero block, and
  // blocks of very different magnitudes.
  const int64_t rows = 200, cols = 300, rb = 2, cb = 3;
  std::vector<float> w(size_t(rows * cols));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      w[size_t(i * cols + j)] =
          (i < 128 && j >= 256) ? 0.0f : normal(rng) * (i >= 128 ? 1e-3f : 10.0f);
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales(size_t(rb * cb));
  moec::cpu::quantizeBlocks(w.data(), cols, rows, cols, codes.data(), scales.data());
  // Each scale is its block's amax / 448 (1 for the zero block).
  for (int64_t bi = 0; bi < rb; ++bi)
    for (int64_t bj = 0; bj < cb; ++bj) {
      float amax = 0;
      for (int64_t i = bi * 128; i < std::min(rows, bi * 128 + 128); ++i)
        for (int64_t j = bj * 128; j < std::min(cols, bj * 128 + 128); ++j)
          amax = std::max(amax, std::fabs(w[size_t(i * cols + j)]));
      CHECK(scales[size_t(bi * cb + bj)] == (amax > 0 ? amax / 448.0f : 1.0f));
    }
  // The whole matrix back: within e4m3's resolution of each block.
  std::vector<float> back(w.size());
  moec::cpu::dequantizeBlocks(codes.data(), scales.data(), cols, 0, rows, 0, cols, back.data(),
                              moec::DType::F32, cols);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const float scale = scales[size_t((i / 128) * cb + j / 128)];
      const float v = w[size_t(i * cols + j)], got = back[size_t(i * cols + j)];
      CHECK(got == moec::cpu::e4m3ToFloat(codes[size_t(i * cols + j)]) * scale);
      CHECK(std::fabs(got - v) <= std::max(std::fabs(v) / 16.0f, scale / 512.0f));
    }
  // A sub-block that crosses block edges, into a strided buffer, in bf16:
  // the same values as the whole, rounded once.
  const int64_t r0 = 100, r1 = 170, c0 = 120, c1 = 290, ld = 200;
  std::vector<uint16_t> part(size_t((r1 - r0) * ld), 0xFFFF);
  moec::cpu::dequantizeBlocks(codes.data(), scales.data(), cols, r0, r1, c0, c1, part.data(),
                              moec::DType::BF16, ld);
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = c0; j < c1; ++j)
      CHECK(part[size_t((i - r0) * ld + (j - c0))] ==
            moec::cpu::floatToBf16(back[size_t(i * cols + j)]));
  CHECK(part[size_t(ld - 1)] == 0xFFFF); // nothing past the columns asked for
}

TEST_CASE("dequantizing gives every code's table value times its scale, NaN for NaN codes") {
  // All 256 codes in a row, twice (a vector path takes 16 at a time), in a
  // block with an awkward scale.
  const int64_t cols = 512;
  std::vector<uint8_t> codes(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j)
    codes[size_t(j)] = uint8_t(j % 256);
  const float scales[4] = {0.3f, 1e-20f, 7.0f, 2.5e-3f};
  std::vector<float> out(static_cast<size_t>(cols));
  moec::cpu::dequantizeBlocks(codes.data(), scales, cols, 0, 1, 0, cols, out.data(),
                              moec::DType::F32, cols);
  for (int64_t j = 0; j < cols; ++j) {
    const float want = moec::cpu::e4m3ToFloat(codes[size_t(j)]) * scales[j / 128];
    INFO("code " << j % 256 << " scale " << scales[j / 128]);
    CHECK(std::isnan(out[size_t(j)]) == std::isnan(want));
    // The same bits: -0.0 stays -0.0, and code 0xFF's NaN keeps its sign.
    CHECK(std::memcmp(&out[size_t(j)], &want, 4) == 0);
  }
  // Into bf16 (rounded in registers by the vector path): each value's fp32
  // bits rounded once, NaNs and signed zeros included.
  std::vector<uint16_t> out16(static_cast<size_t>(cols));
  moec::cpu::dequantizeBlocks(codes.data(), scales, cols, 0, 1, 0, cols, out16.data(),
                              moec::DType::BF16, cols);
  for (int64_t j = 0; j < cols; ++j) {
    INFO("code " << j % 256 << " scale " << scales[j / 128]);
    CHECK(out16[size_t(j)] == moec::cpu::floatToBf16(out[size_t(j)]));
  }
}
