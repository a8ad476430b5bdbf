//===- CpuKernelsTest.cpp - Tests for the CPU kernels of ops/cpu ----------===//
//
// Each kernel against straightforward loops (in double) on random data:
// several shapes, ragged tile grids, strided views, empty segments, fp32 and
// bf16 storage; plus bf16 rounding, determinism and thread safety.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Rows.h"
#include "runtime/cpu/Swiglu.h"
#include "runtime/cpu/Tile.h"
#include "runtime/layer/Routing.h"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include <thread>
#include <vector>

using namespace moec::cpu;
using moec::rt::buildRoutingLayout;
using moec::rt::RoutingLayout;
using moec::Status;

namespace {

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

uint32_t floatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// A rows x cols matrix (with a leading stride of at least cols) stored as
/// fp32 or bf16. Padding elements hold a sentinel so a kernel that writes
/// past its tile shows up.
struct Buffer {
  Elt elt = Elt::F32;
  int64_t rows = 0, cols = 0, ld = 0;
  std::vector<float> f32;
  std::vector<uint16_t> b16;

  Buffer(Elt elt, int64_t rows, int64_t cols, int64_t pad = 0)
      : elt(elt), rows(rows), cols(cols), ld(cols + pad) {
    const size_t n = size_t(std::max<int64_t>(rows * ld, 1));
    if (elt == Elt::F32)
      f32.assign(n, kSentinel);
    else
      b16.assign(n, floatToBf16(kSentinel));
  }

  static constexpr float kSentinel = -640.0f; // exact in bf16 too

  void *data() { return elt == Elt::F32 ? static_cast<void *>(f32.data()) : b16.data(); }
  const void *data() const {
    return elt == Elt::F32 ? static_cast<const void *>(f32.data()) : b16.data();
  }
  Matrix view() { return Matrix{data(), elt, ld}; }
  ConstMatrix cview() const { return ConstMatrix{data(), elt, ld}; }
  float get(int64_t i, int64_t j) const { return cview().at(i, j); }
  void set(int64_t i, int64_t j, float v) { view().set(i, j, v); }

  /// Fills the matrix (not the padding) with uniform values in [-1, 1).
  void randomize(std::mt19937 &rng, float scale = 1.0f) {
    std::uniform_real_distribution<float> dist(-scale, scale);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        set(i, j, dist(rng));
  }

  /// Raw bytes, for bit-exact comparisons.
  std::vector<uint8_t> bytes() const {
    const size_t n = elt == Elt::F32 ? f32.size() * 4 : b16.size() * 2;
    std::vector<uint8_t> out(n);
    std::memcpy(out.data(), data(), n);
    return out;
  }
};

/// The rows x cols values of `b` (without padding) as doubles, row-major.
std::vector<double> dense(const Buffer &b) {
  std::vector<double> out(size_t(b.rows * b.cols));
  for (int64_t i = 0; i < b.rows; ++i)
    for (int64_t j = 0; j < b.cols; ++j)
      out[size_t(i * b.cols + j)] = b.get(i, j);
  return out;
}

/// Exact (double) C = sum over p of A(i, p) * B(p, j) for a row-major m x k
/// `a` and k x n `b`, and the sums of |A(i, p) * B(p, j)| that bound their
/// rounding errors.
void exactProduct(int64_t m, int64_t n, int64_t k, const std::vector<double> &a,
                  const std::vector<double> &b, std::vector<double> *c,
                  std::vector<double> *scale) {
  c->assign(size_t(m * n), 0.0);
  scale->assign(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p) {
      const double av = a[size_t(i * k + p)];
      double *ci = c->data() + i * n, *si = scale->data() + i * n;
      const double *bp = b.data() + p * n;
      for (int64_t j = 0; j < n; ++j) {
        ci[j] += av * bp[j];
        si[j] += std::fabs(av * bp[j]);
      }
    }
}

/// Returns the transpose of the rows x cols row-major `x`.
std::vector<double> transpose(const std::vector<double> &x, int64_t rows, int64_t cols) {
  std::vector<double> t(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      t[size_t(j * rows + i)] = x[size_t(i * cols + j)];
  return t;
}

/// Row/column ranges of tile i when `extent` is cut into `tiles` tiles, the
/// way a TilingRecord cuts them (ragged when tiles does not divide extent).
Range tileRange(int64_t i, int64_t extent, int64_t tiles) {
  return Range{i * extent / tiles, (i + 1) * extent / tiles};
}

/// Checks a computed value against an exact one: `scale` bounds the sum of
/// |products| behind it, `storedBf16` says the result was rounded to bf16.
bool close(double got, double want, double scale, bool storedBf16) {
  const double tol = 1e-5 * scale + (storedBf16 ? std::ldexp(std::fabs(want), -8) : 0.0) + 1e-30;
  return std::fabs(got - want) <= tol;
}

std::string describe(Elt a, Elt b, Elt c) {
  return std::string("A ") + dtypeName(a) + ", B " + dtypeName(b) + ", C " + dtypeName(c);
}

/// The storage combinations the matmul tests cover.
struct EltCombo {
  Elt a, b, c;
};
const EltCombo kCombos[] = {
    {Elt::F32, Elt::F32, Elt::F32},
    {Elt::BF16, Elt::BF16, Elt::BF16},
    {Elt::BF16, Elt::BF16, Elt::F32},
    {Elt::F32, Elt::BF16, Elt::BF16},
};

//===----------------------------------------------------------------------===//
// Matmul problem runner
//===----------------------------------------------------------------------===//

enum class GmmKind { Forward, Dgrad };

/// Runs gmmForwardTile or gmmDgradTile over every tile of a rowTiles x
/// colTiles grid of a capacity-sized expert (capacity >= segment rows) and
/// checks every element of C: computed inside the segment, untouched
/// elsewhere.
/// With an epilogue: C = D + scale * product, where D is a separate addend
/// buffer (Addend::Separate) or C's own values (Addend::InPlace).
enum class Addend { None, Separate, InPlace };

void checkActivationGmm(GmmKind kind, EltCombo elts, int64_t totalRows, Segment seg,
                        int64_t capacity, int64_t depth, int64_t n, int64_t rowTiles,
                        int64_t colTiles, uint32_t seed, float scale = 1.0f,
                        Addend addend = Addend::None, int64_t bPad = -1, int64_t aPad = 3,
                        int64_t cPad = 2) {
  INFO("scale " << scale << ", addend " << int(addend));
  INFO(std::string(kind == GmmKind::Forward ? "forward" : "dgrad") << ", "
                                                                   << describe(elts.a, elts.b, elts.c));
  INFO("rows " << totalRows << ", segment [" << seg.offset << ", +" << seg.rows << "), capacity "
               << capacity << ", depth " << depth << ", n " << n << ", grid " << rowTiles
               << " x " << colTiles);
  std::mt19937 rng(seed);
  Buffer a(elts.a, totalRows, depth, aPad);
  Buffer b = kind == GmmKind::Forward ? Buffer(elts.b, depth, n, bPad < 0 ? 5 : bPad)
                                      : Buffer(elts.b, n, depth, bPad < 0 ? 1 : bPad);
  Buffer c(elts.c, totalRows, n, cPad);
  a.randomize(rng);
  b.randomize(rng);
  Buffer d(elts.c, totalRows, n, 4);
  d.randomize(rng);
  if (addend == Addend::InPlace)
    c.randomize(rng);
  const Buffer before = c;
  Epilogue epilogue;
  epilogue.scale = scale;
  if (addend == Addend::Separate)
    epilogue.addend = d.cview();
  if (addend == Addend::InPlace)
    epilogue.addend = c.cview();

  Scratch scratch;
  for (int64_t ti = 0; ti < rowTiles; ++ti)
    for (int64_t tj = 0; tj < colTiles; ++tj) {
      const Range rows = tileRange(ti, capacity, rowTiles), cols = tileRange(tj, n, colTiles);
      if (kind == GmmKind::Forward)
        gmmForwardTile(a.cview(), b.cview(), c.view(), depth, seg, rows, cols, &scratch,
                       epilogue);
      else
        gmmDgradTile(a.cview(), b.cview(), c.view(), depth, seg, rows, cols, &scratch,
                     epilogue);
    }

  // The exact product over the whole buffer; only the segment's rows count.
  std::vector<double> want, magnitude;
  const std::vector<double> bKN =
      kind == GmmKind::Forward ? dense(b) : transpose(dense(b), n, depth);
  exactProduct(totalRows, n, depth, dense(a), bKN, &want, &magnitude);
  for (int64_t i = 0; i < totalRows; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const size_t at = size_t(i * n + j);
      const double add = addend == Addend::Separate  ? double(d.get(i, j))
                         : addend == Addend::InPlace ? double(before.get(i, j))
                                                     : 0.0;
      want[at] = add + double(scale) * want[at];
      magnitude[at] = std::fabs(add) + std::fabs(double(scale)) * magnitude[at];
    }
  int64_t bad = 0;
  for (int64_t i = 0; i < totalRows; ++i) {
    const bool inSeg = i >= seg.offset && i < seg.offset + seg.rows;
    for (int64_t j = 0; j < c.ld; ++j) {
      const float got = c.get(i, j);
      if (!inSeg || j >= n) {
        if (got != before.get(i, j) && ++bad <= 5)
          FAIL_CHECK("C[" << i << "][" << j << "] outside the tile was written: " << got);
        continue;
      }
      if (!close(got, want[size_t(i * n + j)], magnitude[size_t(i * n + j)],
                 elts.c == Elt::BF16) &&
          ++bad <= 5)
        FAIL_CHECK("C[" << i << "][" << j << "] = " << got << ", expected "
                        << want[size_t(i * n + j)]);
    }
  }
  CHECK(bad == 0);
}

/// Runs gmmWgradTile over a rowTiles x colTiles grid of the [K, N] gradient
/// of one expert and checks it; with `accumulate`, C starts from random
/// values that the result adds to.
void checkWgrad(EltCombo elts, int64_t totalRows, Segment seg, int64_t kDim, int64_t n,
                int64_t rowTiles, int64_t colTiles, bool accumulate, uint32_t seed) {
  INFO("wgrad, " << describe(elts.a, elts.b, elts.c) << (accumulate ? ", accumulate" : ""));
  INFO("rows " << totalRows << ", segment [" << seg.offset << ", +" << seg.rows << "), K " << kDim
               << ", N " << n << ", grid " << rowTiles << " x " << colTiles);
  std::mt19937 rng(seed);
  Buffer a(elts.a, totalRows, kDim, 2);
  Buffer b(elts.b, totalRows, n, 1);
  Buffer c(elts.c, kDim, n, 3);
  a.randomize(rng);
  b.randomize(rng);
  c.randomize(rng);
  const Buffer before = c;

  Scratch scratch;
  for (int64_t ti = 0; ti < rowTiles; ++ti)
    for (int64_t tj = 0; tj < colTiles; ++tj)
      gmmWgradTile(a.cview(), b.cview(), c.view(), seg, tileRange(ti, kDim, rowTiles),
                   tileRange(tj, n, colTiles), accumulate, &scratch);

  // The exact A^T B over the segment's rows.
  const std::vector<double> aAll = dense(a), bAll = dense(b);
  const std::vector<double> aSeg(aAll.begin() + seg.offset * kDim,
                                 aAll.begin() + (seg.offset + seg.rows) * kDim);
  const std::vector<double> bSeg(bAll.begin() + seg.offset * n,
                                 bAll.begin() + (seg.offset + seg.rows) * n);
  std::vector<double> product, scale;
  exactProduct(kDim, n, seg.rows, transpose(aSeg, seg.rows, kDim), bSeg, &product, &scale);
  int64_t bad = 0;
  for (int64_t p = 0; p < kDim; ++p)
    for (int64_t j = 0; j < c.ld; ++j) {
      const float got = c.get(p, j);
      if (j >= n) {
        if (got != Buffer::kSentinel && ++bad <= 5)
          FAIL_CHECK("C[" << p << "][" << j << "] (padding) was written: " << got);
        continue;
      }
      const double start = accumulate ? double(before.get(p, j)) : 0.0;
      const double want = start + product[size_t(p * n + j)];
      const double bound = std::fabs(start) + scale[size_t(p * n + j)];
      if (!close(got, want, bound, elts.c == Elt::BF16) && ++bad <= 5)
        FAIL_CHECK("C[" << p << "][" << j << "] = " << got << ", expected " << want);
    }
  CHECK(bad == 0);
}

} // namespace

//===----------------------------------------------------------------------===//
// bf16
//===----------------------------------------------------------------------===//

TEST_CASE("bf16 conversion rounds to nearest even", "[cpu][bf16]") {
  CHECK(floatToBf16(1.0f) == 0x3F80);
  CHECK(floatToBf16(-2.0f) == 0xC000);
  CHECK(floatToBf16(0.0f) == 0x0000);
  CHECK(floatToBf16(-0.0f) == 0x8000);
  // Ties go to the even neighbour.
  CHECK(floatToBf16(bitsFloat(0x3F808000u)) == 0x3F80); // 1 + 2^-8: tie, 0x3F80 is even
  CHECK(floatToBf16(bitsFloat(0x3F818000u)) == 0x3F82); // tie, rounds up to even 0x3F82
  CHECK(floatToBf16(bitsFloat(0xBF818000u)) == 0xBF82); // the same, negative
  // Off-tie values go to the nearest.
  CHECK(floatToBf16(bitsFloat(0x3F808001u)) == 0x3F81);
  CHECK(floatToBf16(bitsFloat(0x3F807FFFu)) == 0x3F80);
  CHECK(floatToBf16(bitsFloat(0x3F80FFFFu)) == 0x3F81);
  // A carry into the exponent.
  CHECK(floatToBf16(bitsFloat(0x3FFFFFFFu)) == 0x4000);
  // Overflow to infinity; infinities stay.
  CHECK(floatToBf16(std::numeric_limits<float>::max()) == 0x7F80);
  CHECK(floatToBf16(-std::numeric_limits<float>::max()) == 0xFF80);
  CHECK(floatToBf16(bitsFloat(0x7F7F7FFFu)) == 0x7F7F); // just below the tie: largest finite
  CHECK(floatToBf16(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(floatToBf16(-std::numeric_limits<float>::infinity()) == 0xFF80);
  // Subnormals are rounded, not flushed.
  CHECK(floatToBf16(bitsFloat(0x00010000u)) == 0x0001);
  CHECK(floatToBf16(bitsFloat(0x00008000u)) == 0x0000); // tie to even 0
  CHECK(floatToBf16(bitsFloat(0x00018000u)) == 0x0002); // tie to even 2
  CHECK(floatToBf16(bitsFloat(0x00000001u)) == 0x0000);
  CHECK(bf16ToFloat(0x0001) == bitsFloat(0x00010000u));
}

TEST_CASE("bf16 conversion keeps NaN", "[cpu][bf16]") {
  // A NaN whose payload is only in the low half would truncate to infinity.
  const uint32_t nans[] = {0x7F800001u, 0x7FC00000u, 0xFF800001u, 0x7FFFFFFFu, 0xFFC00001u};
  for (uint32_t n : nans) {
    const uint16_t b = floatToBf16(bitsFloat(n));
    INFO("fp32 bits " << std::hex << n << " -> bf16 bits " << b);
    CHECK(std::isnan(bf16ToFloat(b)));
    CHECK((b & 0x8000) == ((n >> 16) & 0x8000)); // sign kept
  }
  CHECK(floatToBf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FC0);
}

TEST_CASE("the array conversions give the scalar ones' bits", "[cpu][bf16]") {
  // Random bit patterns (every sign, NaNs with payloads in either half,
  // infinities, denormals, halfway cases), an odd count so that the vector
  // loop leaves a tail.
  std::mt19937 rng(17);
  std::vector<float> values(100003);
  for (size_t i = 0; i < values.size(); ++i) {
    uint32_t bits = rng();
    if (i % 7 == 0)
      bits = (bits & 0xffff0000u) | 0x8000u; // exactly halfway
    if (i % 11 == 0)
      bits |= 0x7f800000u; // inf or NaN
    std::memcpy(&values[i], &bits, sizeof bits);
  }
  std::vector<uint16_t> narrow(values.size());
  floatToBf16(values.data(), narrow.data(), values.size());
  std::vector<float> wide(values.size());
  bf16ToFloat(narrow.data(), wide.data(), narrow.size());
  int64_t bad = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    bad += narrow[i] != floatToBf16(values[i]);
    bad += floatBits(wide[i]) != floatBits(bf16ToFloat(narrow[i]));
  }
  CHECK(bad == 0);
}

TEST_CASE("bf16 round trip is exact for every bf16 value", "[cpu][bf16]") {
  std::vector<uint16_t> all(65536), back(65536);
  std::vector<float> wide(65536);
  for (uint32_t i = 0; i < 65536; ++i)
    all[i] = uint16_t(i);
  bf16ToFloat(all.data(), wide.data(), all.size());
  floatToBf16(wide.data(), back.data(), wide.size());
  int64_t bad = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    CHECK(floatBits(wide[i]) == (i << 16)); // widening is exact
    CHECK(back[i] == floatToBf16(wide[i])); // array form matches the scalar one
    const bool isNan = std::isnan(wide[i]);
    if (isNan ? !std::isnan(bf16ToFloat(back[i])) : back[i] != all[i])
      ++bad;
  }
  CHECK(bad == 0);

  // Every fp32 value rounds to one of its two bf16 neighbours, the nearer.
  std::mt19937 rng(3);
  for (int i = 0; i < 100000; ++i) {
    const uint32_t bits = rng() % 0x7F000000u; // finite, positive, far from overflow
    const float v = bitsFloat(bits);
    const float lo = bitsFloat(bits & 0xFFFF0000u), hi = bitsFloat((bits & 0xFFFF0000u) + 0x10000u);
    const float r = roundToBf16(v);
    REQUIRE((r == lo || r == hi));
    const double dLo = double(v) - double(lo), dHi = double(hi) - double(v);
    if (dLo < dHi)
      REQUIRE(r == lo);
    else if (dHi < dLo)
      REQUIRE(r == hi);
  }
}

//===----------------------------------------------------------------------===//
// Grouped matmuls
//===----------------------------------------------------------------------===//

TEST_CASE("gmm forward tiles match the loops", "[cpu][gmm]") {
  uint32_t seed = 10;
  for (const EltCombo &elts : kCombos) {
    // A segment in the middle of the buffer, a capacity grid larger than it,
    // ragged tiles in both directions.
    checkActivationGmm(GmmKind::Forward, elts, 50, Segment{7, 33}, 40, 37, 29, 3, 4, ++seed);
    // Tiles of one row / one column; depth 1.
    checkActivationGmm(GmmKind::Forward, elts, 9, Segment{0, 9}, 9, 1, 5, 9, 5, ++seed);
    // Blocks of the bf16 path (256 x 512 x 512) cut across tiles.
    checkActivationGmm(GmmKind::Forward, elts, 300, Segment{20, 270}, 270, 530, 600, 1, 1, ++seed);
    checkActivationGmm(GmmKind::Forward, elts, 300, Segment{20, 270}, 290, 530, 600, 2, 3, ++seed);
    // An empty segment, and a grid whose tiles all lie past the segment.
    checkActivationGmm(GmmKind::Forward, elts, 10, Segment{4, 0}, 8, 6, 7, 2, 2, ++seed);
    checkActivationGmm(GmmKind::Forward, elts, 10, Segment{10, 0}, 8, 6, 7, 2, 2, ++seed);
    // A weight whose fp32 rows are 1 KiB apart: the tile copies it to a
    // stride that does not alias first (bf16 rows are widened to one).
    checkActivationGmm(GmmKind::Forward, elts, 80, Segment{5, 70}, 70, 48, 200, 1, 2, ++seed,
                       1.0f, Addend::None, 56);
  }
}

TEST_CASE("gmm dgrad tiles match the loops", "[cpu][gmm]") {
  uint32_t seed = 50;
  for (const EltCombo &elts : kCombos) {
    checkActivationGmm(GmmKind::Dgrad, elts, 50, Segment{7, 33}, 40, 37, 29, 3, 4, ++seed);
    checkActivationGmm(GmmKind::Dgrad, elts, 9, Segment{0, 9}, 9, 1, 5, 9, 5, ++seed);
    checkActivationGmm(GmmKind::Dgrad, elts, 300, Segment{20, 270}, 290, 530, 600, 2, 3, ++seed);
    checkActivationGmm(GmmKind::Dgrad, elts, 10, Segment{4, 0}, 8, 6, 7, 2, 2, ++seed);
    // A weight whose fp32 rows are 4 KiB apart: where oneDNN runs AVX-512
    // kernels, the tile is computed as its transpose, 128 rows of A at a
    // time (tiles of 145 rows; 12-13 columns, not whole 8 x 8 blocks);
    // scaled and added in place onto C too.
    checkActivationGmm(GmmKind::Dgrad, elts, 300, Segment{20, 270}, 290, 200, 37, 2, 3, ++seed,
                       1.0f, Addend::None, 824);
    checkActivationGmm(GmmKind::Dgrad, elts, 300, Segment{20, 270}, 290, 200, 37, 2, 3, ++seed,
                       -0.5f, Addend::InPlace, 824);
    // A, B and C stored densely (rows of exactly the depth and of C's
    // width, as the layer's are), tiles of whole rows: fp32 tiles run on
    // oneDNN's matmul primitive where it has brgemm kernels for them; plain,
    // and added onto a separate addend (its sum post-op); row tiles not a
    // multiple of its blocks.
    checkActivationGmm(GmmKind::Dgrad, elts, 300, Segment{20, 270}, 290, 160, 70, 3, 1, ++seed,
                       1.0f, Addend::None, 0, 0, 0);
    checkActivationGmm(GmmKind::Dgrad, elts, 300, Segment{20, 270}, 290, 160, 70, 2, 1, ++seed,
                       1.0f, Addend::Separate, 0, 0, 0);
  }
}

TEST_CASE("fp32 dgrad tiles of more row counts than a thread keeps matmul primitives for",
          "[cpu][gmm]") {
  // Each row count is a shape of its own (a primitive where oneDNN has
  // brgemm kernels for it); past the thread's 512 the kept ones are dropped
  // and made again. Every product stays right, also the first row counts
  // met again after the drop.
  std::mt19937 rng(31);
  const int64_t n = 16, k = 24, most = 530;
  Buffer a(Elt::F32, most, k, 0), b(Elt::F32, n, k, 0);
  a.randomize(rng);
  b.randomize(rng);
  std::vector<int64_t> rowCounts;
  for (int64_t rows = 1; rows <= most; ++rows)
    rowCounts.push_back(rows);
  rowCounts.insert(rowCounts.end(), {1, 2, 3});
  int64_t bad = 0;
  for (int64_t rows : rowCounts) {
    Buffer c(Elt::F32, rows, n, 0);
    gemmTile(rows, n, k, a.cview(), false, b.cview(), true, c.view(), false);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0, scale = 0;
        for (int64_t p = 0; p < k; ++p) {
          want += double(a.get(i, p)) * b.get(j, p);
          scale += std::fabs(double(a.get(i, p)) * b.get(j, p));
        }
        if (!close(c.get(i, j), want, scale, false) && ++bad <= 5)
          FAIL_CHECK(rows << " rows: C[" << i << "][" << j << "] = " << c.get(i, j) << ", expected "
                          << want);
      }
  }
  CHECK(bad == 0);
}

TEST_CASE("gmm tiles scale the product and add an addend (LoRA adapters)", "[cpu][gmm]") {
  uint32_t seed = 70;
  for (const EltCombo &elts : kCombos)
    for (GmmKind kind : {GmmKind::Forward, GmmKind::Dgrad}) {
      // A rank-r product scaled (U = s X A), ragged tiles past the segment.
      checkActivationGmm(kind, elts, 50, Segment{7, 33}, 40, 37, 8, 3, 2, ++seed, 2.0f);
      // An adapter's product added onto a base output, separate and in place
      // (Y = Y_base + U B), depth r = 4; and the bf16 path's blocks.
      checkActivationGmm(kind, elts, 50, Segment{7, 33}, 40, 4, 29, 3, 4, ++seed, 1.0f,
                         Addend::Separate);
      checkActivationGmm(kind, elts, 50, Segment{7, 33}, 40, 4, 29, 3, 4, ++seed, 0.5f,
                         Addend::InPlace);
      checkActivationGmm(kind, elts, 300, Segment{20, 270}, 290, 16, 600, 2, 3, ++seed,
                         -1.5f, Addend::Separate);
      // An empty segment leaves C alone.
      checkActivationGmm(kind, elts, 10, Segment{4, 0}, 8, 6, 7, 2, 2, ++seed, 1.0f,
                         Addend::Separate);
    }
}

TEST_CASE("gmm wgrad tiles match the loops", "[cpu][gmm]") {
  uint32_t seed = 90;
  for (const EltCombo &elts : kCombos)
    for (bool accumulate : {false, true}) {
      checkWgrad(elts, 50, Segment{7, 33}, 37, 29, 3, 4, accumulate, ++seed);
      checkWgrad(elts, 12, Segment{0, 12}, 5, 3, 5, 3, accumulate, ++seed);
      // More rows than one reduction slice of the bf16 path (512), K past a
      // 256-row block, N past a 512-column block.
      checkWgrad(elts, 1200, Segment{100, 1050}, 270, 530, 2, 2, accumulate, ++seed);
      // An empty segment: zeros, or C unchanged when accumulating.
      checkWgrad(elts, 10, Segment{3, 0}, 6, 7, 2, 2, accumulate, ++seed);
    }
}

TEST_CASE("a weight gradient's fp32 product runs on moec's tile where streamedTile says",
          "[cpu][gmm]") {
  // Under MOEC_GEMM=auto an fp32 C that gemmTile streams (a weight
  // gradient, not accumulated) goes to moec's tile on an Intel CPU with
  // AVX-512 when both sides are over 16 (not a rank-r adapter's): the bits
  // of tile::gemm. Everywhere else it runs where an unstreamed C runs.
  static const bool intel = __builtin_cpu_is("intel");
  const bool own = gemmKernel() == GemmKernel::Auto && intel && tile::available(false);
  CHECK(streamedTile(Elt::F32, Elt::F32, 64, 80) == (own || packedTile(Elt::F32, Elt::F32)));
  CHECK(streamedTile(Elt::F32, Elt::F32, 64, 16) == packedTile(Elt::F32, Elt::F32));
  std::mt19937 rng(31);
  for (const int64_t n : {int64_t(80), int64_t(16)}) {
    INFO("n " << n);
    // A stored k x m (the activations, transposed); k deep enough that
    // oneDNN's sgemm cuts the depth otherwise than moec's tile (at 139 the
    // two gave the same bits).
    const int64_t m = 64, k = 1000;
    Buffer a(Elt::F32, k, m), b(Elt::F32, k, n);
    a.randomize(rng);
    b.randomize(rng);
    Buffer streamed(Elt::F32, m, n), cached(Elt::F32, m, n);
    gemmTile(m, n, k, a.cview(), true, b.cview(), false, streamed.view(), false, nullptr, 1.0f,
             true);
    gemmTile(m, n, k, a.cview(), true, b.cview(), false, cached.view(), false);
    if (!streamedTile(Elt::F32, Elt::F32, m, n) || packedTile(Elt::F32, Elt::F32)) {
      CHECK(streamed.bytes() == cached.bytes());
      continue;
    }
    Buffer own(Elt::F32, m, n);
    moec::ZeroedPages pack(tile::packBytes(m, n, k, true, false, false));
    tile::gemm(m, n, k, a.data(), a.ld, true, b.data(), b.ld, false, false, own.data(), own.ld,
               false, false, pack.data());
    CHECK(streamed.bytes() == own.bytes());
    // (The two GEMMs sum in different orders: this product tells them apart.)
    CHECK(cached.bytes() != own.bytes());
  }
}

TEST_CASE("gmm wgrad accumulates into an fp32 main-grad buffer", "[cpu][gmm]") {
  // Two micro-batches of bf16 activations accumulate into one fp32 gradient;
  // the sum equals one call over both batches' rows.
  std::mt19937 rng(5);
  const int64_t m = 40, k = 24, n = 18;
  Buffer a(Elt::BF16, 2 * m, k), b(Elt::BF16, 2 * m, n);
  a.randomize(rng);
  b.randomize(rng);
  Buffer mainGrad(Elt::F32, k, n), once(Elt::F32, k, n);
  std::fill(mainGrad.f32.begin(), mainGrad.f32.end(), 0.0f);
  gmmWgradTile(a.cview(), b.cview(), mainGrad.view(), Segment{0, m}, {0, k}, {0, n}, true);
  gmmWgradTile(a.cview(), b.cview(), mainGrad.view(), Segment{m, m}, {0, k}, {0, n}, true);
  gmmWgradTile(a.cview(), b.cview(), once.view(), Segment{0, 2 * m}, {0, k}, {0, n}, false);
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < n; ++j)
      REQUIRE(mainGrad.get(i, j) == Approx(once.get(i, j)).epsilon(1e-5).margin(1e-5));
}

TEST_CASE("gemmTile edge cases", "[cpu][gmm]") {
  std::mt19937 rng(8);
  Buffer a(Elt::F32, 4, 3), b(Elt::F32, 3, 5);
  a.randomize(rng);
  b.randomize(rng);
  for (Elt cElt : {Elt::F32, Elt::BF16}) {
    Buffer c(cElt, 4, 5);
    c.randomize(rng);
    const Buffer before = c;
    // k = 0: C becomes zero, or stays when accumulating.
    gemmTile(4, 5, 0, a.cview(), false, b.cview(), false, c.view(), true);
    CHECK(c.bytes() == before.bytes());
    gemmTile(4, 5, 0, a.cview(), false, b.cview(), false, c.view(), false);
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 5; ++j)
        CHECK(c.get(i, j) == 0.0f);
    // m = 0 or n = 0: nothing is touched.
    c = before;
    gemmTile(0, 5, 3, a.cview(), false, b.cview(), false, c.view(), false);
    gemmTile(4, 0, 3, a.cview(), false, b.cview(), false, c.view(), false);
    CHECK(c.bytes() == before.bytes());
  }
  // beta = 0 overwrites: NaN garbage in C does not leak into the result.
  Buffer c(Elt::F32, 4, 5);
  std::fill(c.f32.begin(), c.f32.end(), std::numeric_limits<float>::quiet_NaN());
  gemmTile(4, 5, 3, a.cview(), false, b.cview(), false, c.view(), false);
  for (float v : c.f32)
    CHECK(!std::isnan(v));
  // A one-row operand with a leading stride below its width (never used).
  Buffer row(Elt::F32, 1, 3);
  row.randomize(rng);
  Buffer out(Elt::F32, 1, 5);
  gemmTile(1, 5, 3, ConstMatrix{row.f32.data(), Elt::F32, 0}, false, b.cview(), false,
           Matrix{out.f32.data(), Elt::F32, 0}, false);
  for (int64_t j = 0; j < 5; ++j) {
    double want = 0;
    for (int64_t p = 0; p < 3; ++p)
      want += double(row.get(0, p)) * b.get(p, j);
    CHECK(out.get(0, j) == Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("gmm kernels are deterministic, also on worker threads", "[cpu][gmm]") {
  std::mt19937 rng(21);
  for (const EltCombo &elts : kCombos) {
    INFO(describe(elts.a, elts.b, elts.c));
    const int64_t rows = 700, k = 300, n = 260;
    Buffer a(elts.a, rows, k), b(elts.b, rows, n), w(elts.b, k, n);
    a.randomize(rng);
    b.randomize(rng);
    w.randomize(rng);

    // Repeated calls give the same bits.
    Buffer c1(elts.c, k, n), c2(elts.c, k, n);
    gmmWgradTile(a.cview(), b.cview(), c1.view(), Segment{0, rows}, {0, k}, {0, n}, false);
    gmmWgradTile(a.cview(), b.cview(), c2.view(), Segment{0, rows}, {0, k}, {0, n}, false);
    CHECK(c1.bytes() == c2.bytes());

    // Tiles computed on four threads at once equal the same tiles computed
    // one after another.
    const int64_t rowTiles = 4, colTiles = 3;
    Buffer serial(elts.c, rows, n), parallel(elts.c, rows, n);
    Segment seg{0, rows};
    for (int64_t t = 0; t < rowTiles * colTiles; ++t)
      gmmForwardTile(a.cview(), w.cview(), serial.view(), k, seg,
                     tileRange(t / colTiles, rows, rowTiles), tileRange(t % colTiles, n, colTiles));
    std::vector<std::thread> workers;
    for (int worker = 0; worker < 4; ++worker)
      workers.emplace_back([&, worker] {
        for (int64_t t = worker; t < rowTiles * colTiles; t += 4)
          gmmForwardTile(a.cview(), w.cview(), parallel.view(), k, seg,
                         tileRange(t / colTiles, rows, rowTiles),
                         tileRange(t % colTiles, n, colTiles));
      });
    for (std::thread &t : workers)
      t.join();
    CHECK(serial.bytes() == parallel.bytes());
  }
}

TEST_CASE("a GEMM leaves the calling thread's OpenMP thread count as it was", "[cpu][gmm]") {
  // oneDNN threads with OpenMP; the kernels run it on one thread and must
  // not change what a host (PyTorch) set for its own calls.
  const int before = omp_get_max_threads();
  omp_set_num_threads(3);
  std::vector<float> a(64 * 32, 0.5f), b(32 * 48, 0.25f), c(64 * 48);
  gemmTile(64, 48, 32, ConstMatrix{a.data(), Elt::F32, 32}, false,
           ConstMatrix{b.data(), Elt::F32, 48}, false, Matrix{c.data(), Elt::F32, 48}, false);
  CHECK(c[0] == 32 * 0.5f * 0.25f);
  CHECK(omp_get_max_threads() == 3);
  omp_set_num_threads(before);
}

TEST_CASE("the GEMM library reports its configuration", "[cpu][gmm]") {
  const std::string config = gemmConfig();
  CHECK(config.find("oneDNN") != std::string::npos);
  CHECK(config.find(nativeBf16Gemm() ? "bf16 products on bf16 dot-product instructions"
                                     : "bf16 operands widened to fp32") != std::string::npos);
  // The form a bf16 B stored n x k takes on the AVX-512 micro-kernel.
  if (moecTile(true) && !tile::amx())
    CHECK(config.find(tile::dotForm(false, true, true) ? "in the dot form"
                      : tile::swappedForm(17, 2048, false, true, true)
                          ? "as its transpose"
                          : "through panels") != std::string::npos);
  // Under kernels_isa_test, which caps oneDNN's ISA (DNNL_MAX_CPU_ISA) for
  // each one this CPU has, the kernels above ran on that ISA's code.
  if (const char *expected = std::getenv("MOEC_EXPECT_ISA")) {
    INFO("gemmConfig: " << config);
    CHECK(config.find(std::string("CPU ISA ") + expected + ",") != std::string::npos);
    const std::string isa = expected;
    CHECK(nativeBf16Gemm() == (isa == "avx512_core_bf16" || isa == "avx512_core_amx"));
  }
}

//===----------------------------------------------------------------------===//
// SwiGLU
//===----------------------------------------------------------------------===//

TEST_CASE("silu and its derivative", "[cpu][swiglu]") {
  CHECK(silu(0.0f) == 0.0f);
  CHECK(silu(1.0f) == Approx(1.0 / (1.0 + std::exp(-1.0))).epsilon(1e-6));
  CHECK(silu(-100.0f) == Approx(0.0).margin(1e-30));
  CHECK(silu(100.0f) == Approx(100.0));
  CHECK(siluGrad(0.0f) == Approx(0.5));
  CHECK(siluGrad(-100.0f) == Approx(0.0).margin(1e-30));
  for (float x : {-6.0f, -2.5f, -1.0f, -0.3f, 0.2f, 1.0f, 3.0f, 7.0f}) {
    const double h = 1e-3;
    const double fd = (double(silu(float(x + h))) - double(silu(float(x - h)))) / (2 * h);
    CHECK(siluGrad(x) == Approx(fd).epsilon(2e-3).margin(1e-4));
  }
}

TEST_CASE("swiglu gives the same bits whatever the tiling (vector lanes or tails)",
          "[cpu][swiglu]") {
  // 75 columns: one tile runs 4 vectors of 16 lanes (AVX-512), one of 8
  // (AVX2) and a tail of 3 (or, on a CPU without AVX-512, 9 vectors of 8 and
  // the tail); tiles of one column run every element alone. The results
  // must be equal bit for bit, and silu()/siluGrad() (the scalar forms) must
  // agree with them.
  std::mt19937 rng(5);
  const int64_t rows = 9, inter = 75;
  Buffer y(Elt::F32, rows, 2 * inter, 0), da(Elt::F32, rows, inter, 0);
  y.randomize(rng, 12.0f);
  da.randomize(rng);
  y.set(0, 0, -100.0f);
  y.set(0, 1, 100.0f);
  y.set(0, 2, 0.0f);
  Buffer a1(Elt::F32, rows, inter, 0), a2(Elt::F32, rows, inter, 0);
  Buffer d1(Elt::F32, rows, 2 * inter, 0), d2(Elt::F32, rows, 2 * inter, 0);
  swigluForward(y.cview(), a1.view(), inter, Range{0, rows}, Range{0, inter});
  swigluBackward(y.cview(), da.cview(), d1.view(), inter, Range{0, rows}, Range{0, inter});
  for (int64_t c = 0; c < inter; ++c) {
    swigluForward(y.cview(), a2.view(), inter, Range{0, rows}, Range{c, c + 1});
    swigluBackward(y.cview(), da.cview(), d2.view(), inter, Range{0, rows}, Range{c, c + 1});
  }
  int64_t differ = 0;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < inter; ++i) {
      const float g = y.get(m, i), u = y.get(m, inter + i), d = da.get(m, i);
      differ += a1.get(m, i) != a2.get(m, i);
      differ += d1.get(m, i) != d2.get(m, i);
      differ += d1.get(m, inter + i) != d2.get(m, inter + i);
      differ += a1.get(m, i) != silu(g) * u;
      differ += d1.get(m, inter + i) != d * silu(g);
      differ += d1.get(m, i) != d * u * siluGrad(g);
    }
  CHECK(differ == 0);
}

TEST_CASE("swiglu forward and backward tiles match the loops", "[cpu][swiglu]") {
  std::mt19937 rng(31);
  struct Shape {
    int64_t rows, inter, rowTiles, colTiles;
  };
  for (Shape s : {Shape{17, 13, 3, 2}, Shape{5, 300, 2, 1}, Shape{1, 1, 1, 1}, Shape{0, 4, 1, 1}})
    for (Elt elt : {Elt::F32, Elt::BF16}) {
      INFO("rows " << s.rows << ", inter " << s.inter << ", " << dtypeName(elt));
      Buffer y(elt, s.rows, 2 * s.inter, 3), a(elt, s.rows, s.inter, 2);
      Buffer da(elt, s.rows, s.inter, 1), dy(elt, s.rows, 2 * s.inter, 2);
      y.randomize(rng, 4.0f);
      da.randomize(rng);
      for (int64_t ti = 0; ti < s.rowTiles; ++ti)
        for (int64_t tj = 0; tj < s.colTiles; ++tj) {
          const Range rows = tileRange(ti, s.rows, s.rowTiles);
          const Range cols = tileRange(tj, s.inter, s.colTiles);
          swigluForward(y.cview(), a.view(), s.inter, rows, cols);
          swigluBackward(y.cview(), da.cview(), dy.view(), s.inter, rows, cols);
        }
      const double rel = elt == Elt::BF16 ? std::ldexp(1.0, -8) : 1e-6;
      int64_t bad = 0;
      for (int64_t m = 0; m < s.rows; ++m) {
        for (int64_t i = 0; i < s.inter; ++i) {
          const double g = y.get(m, i), u = y.get(m, s.inter + i), d = da.get(m, i);
          const double sig = 1.0 / (1.0 + std::exp(-g));
          const double wantA = g * sig * u;
          const double wantGate = d * u * sig * (1.0 + g * (1.0 - sig));
          const double wantUp = d * g * sig;
          auto ok = [&](double got, double want) {
            return std::fabs(got - want) <= rel * std::fabs(want) + 1e-6;
          };
          if (!ok(a.get(m, i), wantA) && ++bad <= 5)
            FAIL_CHECK("A[" << m << "][" << i << "] = " << a.get(m, i) << ", expected " << wantA);
          if (!ok(dy.get(m, i), wantGate) && ++bad <= 5)
            FAIL_CHECK("dY gate [" << m << "][" << i << "] = " << dy.get(m, i) << ", expected "
                                   << wantGate);
          if (!ok(dy.get(m, s.inter + i), wantUp) && ++bad <= 5)
            FAIL_CHECK("dY up [" << m << "][" << i << "] = " << dy.get(m, s.inter + i)
                                 << ", expected " << wantUp);
        }
        // Padding stays untouched.
        for (int64_t j = s.inter; j < a.ld; ++j)
          if (a.get(m, j) != Buffer::kSentinel && ++bad <= 5)
            FAIL_CHECK("A padding [" << m << "][" << j << "] written");
        for (int64_t j = 2 * s.inter; j < dy.ld; ++j)
          if (dy.get(m, j) != Buffer::kSentinel && ++bad <= 5)
            FAIL_CHECK("dY padding [" << m << "][" << j << "] written");
      }
      CHECK(bad == 0);
    }
}

//===----------------------------------------------------------------------===//
// Puts, dispatch gather, combine
//===----------------------------------------------------------------------===//

TEST_CASE("gatherTokenRows dispatches token rows, optionally weighted", "[cpu][rows]") {
  std::mt19937 rng(52);
  const std::vector<int32_t> ids = {2, 0, 1, 2, 0, 1}; // 3 tokens, top-2, 3 experts
  RoutingLayout layout;
  REQUIRE(buildRoutingLayout(ids.data(), 3, 2, 3, &layout).ok());
  const std::vector<float> weights = {0.5f, 0.25f, 2.0f, -1.0f, 0.75f, 1.5f};
  // Columns past a 256-column chunk, whose second chunk has a whole block of
  // 16 and a rest (the kernels' vector and scalar paths).
  const int64_t cols = 275;
  for (Elt elt : {Elt::F32, Elt::BF16}) {
    Buffer x(elt, 3, cols, 1), plain(elt, 6, cols), scaled(Elt::F32, 6, cols);
    x.randomize(rng);
    gatherTokenRows(x.cview(), layout.order.data(), 2, nullptr, plain.view(), 6, cols);
    gatherTokenRows(x.cview(), layout.order.data(), 2, weights.data(), scaled.view(), 6, cols);
    for (int64_t i = 0; i < 6; ++i) {
      const int64_t id = layout.order[size_t(i)], t = id / 2;
      for (int64_t j = 0; j < cols; ++j) {
        CHECK(plain.get(i, j) == x.get(t, j));
        CHECK(scaled.get(i, j) == weights[size_t(id)] * x.get(t, j));
      }
    }
  }
}

TEST_CASE("gatherTokenRows into line-aligned rows of its own type gives the same values",
          "[cpu][rows]") {
  // Rows a rank sends: line-aligned, whole lines apart, the source's type
  // (the rows the kernel writes past the caches where it can). A last
  // partial line and padding the kernel must not touch.
  std::mt19937 rng(54);
  const std::vector<int32_t> ids = {2, 0, 1, 2, 0, 1};
  RoutingLayout layout;
  REQUIRE(buildRoutingLayout(ids.data(), 3, 2, 3, &layout).ok());
  const std::vector<float> weights = {0.5f, 0.25f, 2.0f, -1.0f, 0.75f, 1.3f};
  const int64_t cols = 275, ld = 320; // 640 or 1280 bytes a row
  for (Elt elt : {Elt::F32, Elt::BF16}) {
    INFO(dtypeName(elt));
    Buffer x(elt, 3, cols, 1);
    x.randomize(rng);
    const size_t elt64 = dtypeSize(elt);
    std::vector<char> memory(size_t(2 * 6 * ld) * elt64 + 64);
    char *aligned = memory.data() + (64 - reinterpret_cast<uintptr_t>(memory.data()) % 64) % 64;
    const Matrix plain{aligned, elt, ld}, scaled{aligned + size_t(6 * ld) * elt64, elt, ld};
    for (int64_t i = 0; i < 12; ++i)
      for (int64_t j = 0; j < ld; ++j)
        Matrix{aligned, elt, ld}.set(i, j, Buffer::kSentinel);
    gatherTokenRows(x.cview(), layout.order.data(), 2, nullptr, plain, 6, cols);
    gatherTokenRows(x.cview(), layout.order.data(), 2, weights.data(), scaled, 6, cols);
    int bad = 0;
    for (int64_t i = 0; i < 6; ++i) {
      const int64_t id = layout.order[size_t(i)], t = id / 2;
      for (int64_t j = 0; j < ld; ++j) {
        const float product = weights[size_t(id)] * x.get(t, j < cols ? j : 0);
        const float wantPlain = j < cols ? x.get(t, j) : Buffer::kSentinel;
        const float wantScaled = j >= cols          ? Buffer::kSentinel
                                 : elt == Elt::BF16 ? roundToBf16(product)
                                                    : product;
        if (ConstMatrix{plain.data, elt, ld}.at(i, j) != wantPlain && ++bad <= 5)
          FAIL_CHECK("plain [" << i << "][" << j << "]");
        if (ConstMatrix{scaled.data, elt, ld}.at(i, j) != wantScaled && ++bad <= 5)
          FAIL_CHECK("weighted [" << i << "][" << j << "]");
      }
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("combineRows and combineWeightGrad match the loops", "[cpu][rows]") {
  std::mt19937 rng(53);
  // hidden: a 256-column chunk, then a block of 16 and a rest of 3.
  const int64_t tokens = 11, topK = 3, experts = 5, hidden = 275;
  std::vector<int64_t> ids(size_t(tokens * topK));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < topK; ++k)
      ids[size_t(t * topK + k)] = (t + 2 * k) % experts;
  RoutingLayout layout;
  REQUIRE(buildRoutingLayout(ids.data(), tokens, topK, experts, &layout).ok());
  std::vector<float> weights(size_t(tokens * topK));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float &w : weights)
    w = dist(rng);

  for (Elt elt : {Elt::F32, Elt::BF16}) {
    INFO(dtypeName(elt));
    Buffer z(elt, tokens * topK, hidden, 2), dy(elt, tokens, hidden, 1);
    z.randomize(rng);
    dy.randomize(rng);
    // The whole output at once, and as a ragged 3 x 2 grid of tiles.
    Buffer whole(elt, tokens, hidden, 3), tiled(elt, tokens, hidden, 3);
    combineRows(z.cview(), layout.position.data(), weights.data(), topK, whole.view(),
                {0, tokens}, {0, hidden});
    for (int64_t ti = 0; ti < 3; ++ti)
      for (int64_t tj = 0; tj < 2; ++tj)
        combineRows(z.cview(), layout.position.data(), weights.data(), topK, tiled.view(),
                    tileRange(ti, tokens, 3), tileRange(tj, hidden, 2));
    CHECK(whole.bytes() == tiled.bytes());
    Buffer unweighted(Elt::F32, tokens, hidden);
    combineRows(z.cview(), layout.position.data(), nullptr, topK, unweighted.view(),
                {0, tokens}, {0, hidden});

    std::vector<float> dw(size_t(tokens * topK), -5.0f);
    combineWeightGrad(dy.cview(), z.cview(), layout.position.data(), topK, {2, tokens}, hidden,
                      dw.data());

    const double rel = elt == Elt::BF16 ? std::ldexp(1.0, -8) : 0.0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < hidden; ++h) {
        double want = 0, sum = 0, scale = 0;
        for (int64_t k = 0; k < topK; ++k) {
          const double zv = z.get(layout.position[size_t(t * topK + k)], h);
          want += weights[size_t(t * topK + k)] * zv;
          sum += zv;
          scale += std::fabs(zv);
        }
        REQUIRE(std::fabs(whole.get(t, h) - want) <= 1e-6 * scale + rel * std::fabs(want));
        if (elt == Elt::F32) { // k ascending, each product rounded first
          float exact = 0;
          for (int64_t k = 0; k < topK; ++k) {
            const float p =
                weights[size_t(t * topK + k)] * z.get(layout.position[size_t(t * topK + k)], h);
            exact += p;
          }
          CHECK(whole.get(t, h) == exact);
        }
        REQUIRE(std::fabs(unweighted.get(t, h) - sum) <= 1e-6 * scale);
      }
      for (int64_t k = 0; k < topK; ++k) {
        const float got = dw[size_t(t * topK + k)];
        if (t < 2) {
          CHECK(got == -5.0f); // outside the token range
          continue;
        }
        double want = 0, scale = 0;
        for (int64_t h = 0; h < hidden; ++h) {
          const double p = double(dy.get(t, h)) * z.get(layout.position[size_t(t * topK + k)], h);
          want += p;
          scale += std::fabs(p);
        }
        REQUIRE(std::fabs(got - want) <= 1e-5 * scale);
        // The order Rows.h gives, in fp32, each product rounded before it
        // is added (no fused multiply-add): the same bits.
        float lanes[16] = {};
        for (int64_t h = 0; h < hidden; ++h) {
          const float p = dy.get(t, h) * z.get(layout.position[size_t(t * topK + k)], h);
          lanes[h % 16] += p;
        }
        for (int width = 8; width > 0; width /= 2)
          for (int l = 0; l < width; ++l)
            lanes[l] += lanes[l + width];
        CHECK(got == lanes[0]);
      }
    }
  }
}
