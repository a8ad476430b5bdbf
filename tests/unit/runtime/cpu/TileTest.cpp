//===- TileTest.cpp - moec's own AVX-512 GEMM tile ------------------------===//
//
// The tile (runtime/cpu/Tile.h) against a loop in double precision, on
// shapes that cut its panels, depth blocks, column groups and bf16 pairs
// unevenly; the bits of a tile against those of the same matmul cut into
// other tiles; and a bf16 C against floatToBf16 of the fp32 one. On a CPU
// without AVX-512 (or, for bf16, without avx512_bf16) the tile is not there
// and the cases say so. bf16 runs on AMX tiles where the CPU has them;
// tile_avx512_test runs the same cases with MOEC_AMX=off (the AVX-512
// micro-kernel), tile_dot_test, tile_swapped_test and tile_panels_test there
// with each form of a bf16 B stored n x k (MOEC_DOT_FORM on; off, which
// leaves the swapped form; off with MOEC_SWAPPED_FORM=off: the panels).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Tile.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace moec::cpu;

namespace {

/// A stored matrix of `rows` x `cols` values (row stride `ld`), fp32 or
/// bf16; `value` holds what each element is exactly, as a float.
struct Stored {
  bool bf16 = false;
  int64_t rows = 0, cols = 0, ld = 0;
  std::vector<float> f32;
  std::vector<uint16_t> b16;

  Stored(bool bf16, int64_t rows, int64_t cols, int64_t pad)
      : bf16(bf16), rows(rows), cols(cols), ld(cols + pad) {
    f32.assign(size_t(rows * ld), 0.0f);
    b16.assign(size_t(rows * ld), 0);
  }
  void set(int64_t i, int64_t j, float v) {
    b16[size_t(i * ld + j)] = floatToBf16(v);
    f32[size_t(i * ld + j)] = bf16 ? bf16ToFloat(b16[size_t(i * ld + j)]) : v;
  }
  float value(int64_t i, int64_t j) const { return f32[size_t(i * ld + j)]; }
  const void *data() const {
    return bf16 ? static_cast<const void *>(b16.data()) : f32.data();
  }
  void randomize(std::mt19937 &rng) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        set(i, j, dist(rng));
  }
};

/// `size` bytes of `fill`, starting on a 64-byte line (the tile's working
/// memory, or a C placed on or off a line).
struct Aligned {
  std::vector<uint8_t> bytes;
  explicit Aligned(size_t size, uint8_t fill = 0) : bytes(size + 64, fill) {}
  uint8_t *data() {
    return bytes.data() + (64 - reinterpret_cast<uintptr_t>(bytes.data()) % 64) % 64;
  }
};

/// Element `index` of a C stored as fp32, or as bf16 bits with `bf16`.
float valueAt(const uint8_t *c, int64_t index, bool bf16) {
  if (bf16) {
    uint16_t v;
    std::memcpy(&v, c + size_t(index) * 2, 2);
    return bf16ToFloat(v);
  }
  float v;
  std::memcpy(&v, c + size_t(index) * 4, 4);
  return v;
}

/// The operands of C (m x n) = op(A) op(B) over depth k.
struct Product {
  int64_t m, n, k;
  bool transA, transB;
  Stored a, b;

  Product(int64_t m, int64_t n, int64_t k, bool transA, bool transB, bool bf16, uint32_t seed)
      : m(m), n(n), k(k), transA(transA), transB(transB),
        a(bf16, transA ? k : m, transA ? m : k, 3), b(bf16, transB ? n : k, transB ? k : n, 5) {
    std::mt19937 rng(seed);
    a.randomize(rng);
    b.randomize(rng);
  }
  float opA(int64_t i, int64_t p) const { return transA ? a.value(p, i) : a.value(i, p); }
  float opB(int64_t p, int64_t j) const { return transB ? b.value(j, p) : b.value(p, j); }

  /// The largest difference between C's rows [i0, i0 + rows), all n
  /// columns, at `c` (fp32, row stride ldc, C's row i0 first) and the
  /// product in double precision.
  double worstError(const float *c, int64_t ldc, int64_t i0, int64_t rows) const {
    double worst = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double want = 0;
        for (int64_t p = 0; p < k; ++p)
          want += double(opA(i0 + i, p)) * opB(p, j);
        worst = std::max(worst, std::abs(want - c[i * ldc + j]));
      }
    return worst;
  }
  /// Runs the tile on rows [i0, i0 + rows) and columns [j0, j0 + cols) of C
  /// (fp32, row stride ldc, already holding what `load` adds onto).
  void run(float *c, int64_t ldc, bool load, int64_t i0, int64_t rows, int64_t j0,
           int64_t cols) const {
    const size_t elt = a.bf16 ? 2 : 4;
    const char *aAt = static_cast<const char *>(a.data()) + (transA ? i0 : i0 * a.ld) * elt;
    const char *bAt = static_cast<const char *>(b.data()) + (transB ? j0 * b.ld : j0) * elt;
    Aligned pack(tile::packBytes(rows, cols, k, transA, a.bf16, false));
    tile::gemm(rows, cols, k, aAt, a.ld, transA, bAt, b.ld, transB, a.bf16, c + i0 * ldc + j0,
               ldc, false, load, pack.data());
  }
};

/// The value of /proc/cpuinfo's first line named `name` (what the kernel
/// says of the CPU, not the code's own CPUID reading), without its newline;
/// empty where there is none.
std::string cpuinfoField(const char *name) {
  std::string value;
  if (std::FILE *f = std::fopen("/proc/cpuinfo", "r")) {
    char line[8192];
    const size_t length = std::strlen(name);
    while (std::fgets(line, sizeof line, f)) {
      const char *colon = std::strchr(line, ':');
      if (colon && std::strncmp(line, name, length) == 0 &&
          (line[length] == ' ' || line[length] == '\t' || line[length] == ':')) {
        const char *start = colon + 1 + (colon[1] == ' ');
        value.assign(start, std::strcspn(start, "\n"));
        break;
      }
    }
    std::fclose(f);
  }
  return value;
}

/// Whether this CPU runs the tile on `bf16` operands; a warning when not.
bool tileRuns(bool bf16) {
  if (tile::available(bf16))
    return true;
  WARN("this CPU lacks " << (bf16 ? "avx512_bf16" : "AVX-512") << ": the tile is not run");
  return false;
}

} // namespace

TEST_CASE("the bf16 tile runs on AMX exactly where the CPU has it and MOEC_AMX allows",
          "[cpu][tile]") {
  // /proc/cpuinfo's flags (what the kernel says the CPU has and it supports).
  const std::string flags = " " + cpuinfoField("flags") + " ";
  const auto has = [&](const char *flag) {
    return flags.find(std::string(" ") + flag + " ") != std::string::npos;
  };
  if (flags == "  ") {
    WARN("no /proc/cpuinfo flags: nothing to compare");
    return;
  }
  const char *setting = std::getenv("MOEC_AMX");
  const bool off = setting && std::strcmp(setting, "off") == 0;
  INFO("MOEC_AMX=" << (setting ? setting : "(unset)"));
  CHECK(tile::amx() == (has("amx_bf16") && has("amx_tile") && has("avx512_bf16") && !off));
}

TEST_CASE("the dot form runs where MOEC_DOT_FORM says, and by the CPU when unset", "[cpu][tile]") {
  const std::string vendor = cpuinfoField("vendor_id");
  const std::string familyField = cpuinfoField("cpu family");
  const int family = familyField.empty() ? -1 : std::atoi(familyField.c_str());
  if (vendor.empty() || family < 0) {
    WARN("no vendor or family in /proc/cpuinfo: nothing to compare");
    return;
  }
  const char *setting = std::getenv("MOEC_DOT_FORM");
  INFO("MOEC_DOT_FORM=" << (setting ? setting : "(unset)") << ", " << vendor << " family "
                        << family);
  const bool chosen = setting && std::strcmp(setting, "on") == 0 ? true
                      : setting && std::strcmp(setting, "off") == 0
                          ? false
                          : vendor == "AuthenticAMD" && family == 0x19;
  const bool runs = tile::available(true) && !tile::amx();
  CHECK(tile::dotForm(false, true, true) == (chosen && runs));
  // Only a bf16 product of a row-major A and a B stored n x k.
  CHECK_FALSE(tile::dotForm(false, false, true));
  CHECK_FALSE(tile::dotForm(true, true, true));
  CHECK_FALSE(tile::dotForm(false, true, false));
}

TEST_CASE("the swapped form runs where MOEC_SWAPPED_FORM allows and the dot form does not",
          "[cpu][tile]") {
  const char *setting = std::getenv("MOEC_SWAPPED_FORM");
  INFO("MOEC_SWAPPED_FORM=" << (setting ? setting : "(unset)"));
  const bool allowed = !(setting && std::strcmp(setting, "off") == 0);
  const bool runs = tile::available(true) && !tile::amx() && !tile::dotForm(false, true, true);
  CHECK(tile::swappedForm(17, 2048, false, true, true) == (allowed && runs));
  // Only a bf16 product of a row-major A and a B stored n x k, C over 16
  // columns wide.
  CHECK_FALSE(tile::swappedForm(16, 2048, false, true, true));
  CHECK_FALSE(tile::swappedForm(100, 255, false, true, true));
  CHECK(tile::swappedForm(100, 256, false, true, true) ==
        tile::swappedForm(17, 2048, false, true, true));
  CHECK_FALSE(tile::swappedForm(100, 2048, false, false, true));
  CHECK_FALSE(tile::swappedForm(100, 2048, true, true, true));
  CHECK_FALSE(tile::swappedForm(100, 2048, false, true, false));
}

TEST_CASE("moec's tile gives the swapped form the bits of the panels", "[cpu][tile]") {
  // tile::swappedForm: C^T = B A^T, B's rows read in place 16 at a time and
  // A^T packed in groups of 192 rows, against the panels of B packed
  // beforehand (which it does not take): the same bits, and nothing written
  // past C's columns. Shapes that end A's last panel on one, two and three
  // vectors, A's groups (200, 390 rows), B's 16-row blocks (17, 50, 777
  // rows), the 512-unit depth blocks (1025, 2100) and odd depths; C fp32,
  // loaded or not, and bf16; and with a LowRank, its V stored n x r
  // (transV: a LoRA adapter's dX product, U A^T; its rows read in place
  // after B's) or r x n (the forward's on a weight stored [out, in]), of
  // rank 16 and 5 (a lone last bf16 value).
  if (!tileRuns(true))
    return;
  if (!tile::swappedForm(17, 2048, false, true, true))
    WARN("the swapped form does not run here (AMX, the dot form or MOEC_SWAPPED_FORM=off): "
         "the panels against themselves");
  struct Shape {
    int64_t m, n, k;
  };
  const Shape shapes[] = {{1, 17, 257},    {16, 50, 1025},  {40, 777, 300}, {128, 50, 2100},
                          {139, 33, 1025}, {200, 17, 1100}, {390, 40, 513}};
  for (const Shape &s : shapes)
    for (const bool cBf16 : {false, true})
      for (const bool load : {false, true})
        for (const int64_t r : {int64_t(0), int64_t(16), int64_t(5)}) {
          if ((cBf16 && load) || (load && r > 0))
            continue;
          INFO(s.m << " x " << s.n << " x " << s.k << ", C " << (cBf16 ? "bf16" : "fp32")
                   << (load ? ", loaded" : "") << ", low rank " << r);
          const Product x(s.m, s.n, s.k, false, true, true, uint32_t(s.m + s.n + s.k));
          // U (m x r) as low's A, V as its B: n x r (transV) where C's
          // columns are odd, else r x n (copied a row block at a time).
          const bool transV = s.n % 2 == 1;
          const Product low(s.m, s.n, std::max<int64_t>(r, 1), false, transV, true,
                            uint32_t(s.m + 7 * r));
          const tile::LowRank lowRank{low.a.data(), low.a.ld, low.b.data(), low.b.ld, transV, r};
          const tile::LowRank *lr = r > 0 ? &lowRank : nullptr;
          Aligned packedB(tile::packedBBytes(s.n, s.k, true));
          tile::packB(s.n, s.k, x.b.data(), x.b.ld, true, true, packedB.data());
          const int64_t ldc = s.n + 3;
          const size_t elt = cBf16 ? 2 : 4, bytes = size_t(s.m * ldc) * elt;
          Aligned swapped(bytes), panels(bytes);
          // C's values (fp32 ones where loaded), 0x5A bytes past its columns.
          std::memset(swapped.data(), 0x5A, bytes);
          std::mt19937 rng(3);
          std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
          for (int64_t i = 0; i < s.m; ++i)
            for (int64_t j = 0; j < s.n; ++j) {
              const float v = load ? dist(rng) : 0.0f;
              std::memcpy(swapped.data() + size_t(i * ldc + j) * elt, &v, elt);
            }
          std::memcpy(panels.data(), swapped.data(), bytes);
          // The working memory packBytes gives, then 64 guard bytes.
          const size_t own = tile::packBytes(s.m, s.n, s.k, false, true, cBf16, false, false, r);
          Aligned pack(own + 64, 0xA5);
          tile::gemm(s.m, s.n, s.k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, true, true,
                     swapped.data(), ldc, cBf16, load, pack.data(), false, nullptr, nullptr,
                     nullptr, lr);
          CHECK(std::count(pack.data() + own, pack.data() + own + 64, 0xA5) == 64);
          tile::gemm(s.m, s.n, s.k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, true, true,
                     panels.data(), ldc, cBf16, load, pack.data(), false, packedB.data(), nullptr,
                     nullptr, lr);
          CHECK(std::memcmp(swapped.data(), panels.data(), bytes) == 0);
          int64_t touched = 0;
          for (int64_t i = 0; i < s.m; ++i)
            for (size_t b = size_t(s.n) * elt; b < size_t(ldc) * elt; ++b)
              touched += swapped.data()[size_t(i * ldc) * elt + b] != 0x5A;
          CHECK(touched == 0);
          // And the product's values (sums of bf16 products in fp32).
          if (!cBf16 && !load && r == 0)
            CHECK(x.worstError(reinterpret_cast<const float *>(swapped.data()), ldc, 0, s.m) <
                  1e-5 * double(s.k));
        }
}

TEST_CASE("moec's tile matches a loop in double precision", "[cpu][tile]") {
  struct Shape {
    int64_t m, n, k;
  };
  // Tails of the 8-row blocks and 48-column panels, the 192-column groups,
  // depth blocks (128 fp32 values, 256 bf16 ones) and odd bf16 depths; a
  // bf16 C at most 16 columns wide, in blocks of 16 rows and their tails;
  // the dot form's (bf16, transB) 4 x 4 blocks, 32-value steps and 128-row
  // stages of A, staged (n >= 64) or read in place.
  const Shape shapes[] = {{1, 1, 1},      {7, 5, 3},     {9, 50, 257},  {17, 97, 513},
                          {33, 200, 300}, {8, 193, 129}, {40, 16, 300}, {19, 13, 257},
                          {150, 70, 45},  {131, 10, 64}};
  uint32_t seed = 1;
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const Shape &s : shapes)
      for (const bool transA : {false, true})
        for (const bool transB : {false, true})
          for (const bool load : {false, true}) {
            INFO((bf16 ? "bf16 " : "fp32 ") << s.m << " x " << s.n << " x " << s.k
                                            << (transA ? " transA" : "")
                                            << (transB ? " transB" : "") << (load ? " load" : ""));
            const Product x(s.m, s.n, s.k, transA, transB, bf16, ++seed);
            const int64_t ldc = s.n + 2;
            std::vector<float> c(size_t(s.m * ldc), 0.25f);
            x.run(c.data(), ldc, load, 0, s.m, 0, s.n);
            int64_t bad = 0;
            for (int64_t i = 0; i < s.m; ++i) {
              for (int64_t j = 0; j < s.n; ++j) {
                double want = load ? 0.25 : 0.0, scale = load ? 0.25 : 0.0;
                for (int64_t p = 0; p < s.k; ++p) {
                  const double term = double(x.opA(i, p)) * double(x.opB(p, j));
                  want += term;
                  scale += std::fabs(term);
                }
                // fp32 sums of k terms: a few units of 2^-24 per term.
                if (std::fabs(double(c[size_t(i * ldc + j)]) - want) >
                    1e-6 * scale * std::sqrt(double(s.k)) + 1e-30)
                  ++bad;
              }
              // The columns past n are left alone.
              CHECK(c[size_t(i * ldc + s.n)] == 0.25f);
            }
            CHECK(bad == 0);
          }
  }
}

TEST_CASE("moec's tile gives the same bits however the matmul is cut", "[cpu][tile]") {
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const bool transA : {false, true})
      for (const bool transB : {false, true}) {
        INFO((bf16 ? "bf16" : "fp32") << (transA ? " transA" : "") << (transB ? " transB" : ""));
        const int64_t m = 140, n = 250, k = 600;
        const Product x(m, n, k, transA, transB, bf16, 77);
        std::vector<float> whole(size_t(m * n)), cut(size_t(m * n));
        x.run(whole.data(), n, false, 0, m, 0, n);
        // Six tiles, cut off the 8-row blocks, the panels and the groups,
        // and 16 columns (a bf16 C that narrow runs on the narrow kernel;
        // the dot form reads A in place there), the whole C's 128-row
        // stages of A (the dot form's) not theirs.
        for (const auto &[i0, rows] : {std::pair<int64_t, int64_t>{0, 13}, {13, m - 13}})
          for (const auto &[j0, cols] :
               {std::pair<int64_t, int64_t>{0, 61}, {61, 16}, {77, n - 77}})
            x.run(cut.data(), n, false, i0, rows, j0, cols);
        CHECK(std::memcmp(whole.data(), cut.data(), whole.size() * sizeof(float)) == 0);
      }
  }
}

TEST_CASE("moec's tile gives a narrow C with A stored transposed the bits of 16-row tiles",
          "[cpu][tile]") {
  // C = A^T B with C at most 16 columns wide and A stored transposed (a LoRA
  // adapter's weight gradient, X^T dU) is computed as its transpose when C
  // has more than 16 rows; a tile of at most 16 rows is computed as it is.
  // Both give the same bits: fp32 and bf16 operands and C, adding onto C
  // (load), streamed, a C off a line, odd shapes and depths.
  struct Shape {
    int64_t m, n, k;
  };
  const Shape shapes[] = {{200, 16, 300}, {37, 5, 129}, {64, 16, 1}, {1000, 13, 777}};
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const Shape &s : shapes)
      for (const bool cBf16 : {false, true})
        for (const bool load : {false, true})
          for (const bool stream : {false, true}) {
            if (cBf16 && load)
              continue; // (gemm adds onto an fp32 C only)
            INFO((bf16 ? "bf16" : "fp32")
                 << " operands, " << (cBf16 ? "bf16" : "fp32") << " C, " << s.m << " x " << s.n
                 << " x " << s.k << (load ? " load" : "") << (stream ? " stream" : ""));
            const Product x(s.m, s.n, s.k, true, false, bf16, uint32_t(s.m + s.k));
            const int64_t ldc = s.n + 3;
            const size_t elt = cBf16 ? 2 : 4, bytes = size_t(s.m * ldc) * elt;
            // The same start in both: what load adds onto, and the bytes
            // past n that must stay.
            Aligned whole(bytes + elt), cut(bytes + elt);
            std::mt19937 rng(5);
            std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
            for (int64_t i = 0; i < s.m * ldc; ++i) {
              const float v = dist(rng);
              if (cBf16)
                reinterpret_cast<uint16_t *>(whole.data() + elt)[i] = floatToBf16(v);
              else
                reinterpret_cast<float *>(whole.data() + elt)[i] = v;
            }
            std::memcpy(cut.data() + elt, whole.data() + elt, bytes);
            const size_t aElt = bf16 ? 2 : 4;
            Aligned pack(tile::packBytes(s.m, s.n, s.k, true, bf16, cBf16));
            tile::gemm(s.m, s.n, s.k, x.a.data(), x.a.ld, true, x.b.data(), x.b.ld, false, bf16,
                       whole.data() + elt, ldc, cBf16, load, pack.data(), stream);
            for (int64_t i0 = 0; i0 < s.m; i0 += 16) {
              const int64_t rows = std::min<int64_t>(16, s.m - i0);
              Aligned small(tile::packBytes(rows, s.n, s.k, true, bf16, cBf16));
              tile::gemm(rows, s.n, s.k, static_cast<const char *>(x.a.data()) + i0 * aElt, x.a.ld,
                         true, x.b.data(), x.b.ld, false, bf16,
                         cut.data() + elt + size_t(i0 * ldc) * elt, ldc, cBf16, load, small.data(),
                         stream);
            }
            CHECK(std::memcmp(whole.data() + elt, cut.data() + elt, bytes) == 0);
          }
  }
}

TEST_CASE("moec's tile rounds a bf16 C as floatToBf16 does", "[cpu][tile]") {
  if (!tileRuns(true))
    return;
  for (const int64_t k : {100, 700}) { // one depth block, and several
    INFO("k " << k);
    const int64_t m = 19, n = 70;
    Product x(m, n, k, false, false, true, 5);
    // Rows that make infinities and NaNs: inf times a non-zero, inf - inf.
    x.a.set(2, 0, std::numeric_limits<float>::infinity());
    x.a.set(3, 0, std::numeric_limits<float>::infinity());
    x.a.set(3, 1, -std::numeric_limits<float>::infinity());
    x.b.set(1, 5, 0.0f);
    std::vector<float> wide(size_t(m * n));
    x.run(wide.data(), n, false, 0, m, 0, n);
    std::vector<uint16_t> narrow(size_t(m * n));
    Aligned pack(tile::packBytes(m, n, k, false, true, true));
    tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, false, true,
               narrow.data(), n, true, false, pack.data());
    int64_t bad = 0, nans = 0;
    for (size_t i = 0; i < wide.size(); ++i) {
      bad += narrow[i] != floatToBf16(wide[i]);
      nans += std::isnan(wide[i]);
    }
    CHECK(bad == 0);
    CHECK(nans > 0);
  }
}

TEST_CASE("moec's tile writes the same bits to a streamed C", "[cpu][tile]") {
  // A C that nobody reads soon (a weight gradient) is written past the caches,
  // whole rows of a column group at a time: the same values, in every case
  // the cached stores meet: fp32 and bf16 C, one depth block and several, a
  // line-aligned C and one that is not (its rows then go by plain stores),
  // columns that end mid-line, and nothing written past the tile's columns.
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const bool cBf16 : {false, true})
      for (const int64_t k : {int64_t(60), int64_t(700)})
        for (const int64_t offset : {int64_t(0), int64_t(1)}) { // elements off a line
          INFO((bf16 ? "bf16" : "fp32") << " operands, " << (cBf16 ? "bf16" : "fp32")
                                        << " C, k " << k << ", C " << offset
                                        << " elements off a line");
          const int64_t m = 21, n = 410, ldc = 448; // n: two groups and a part
          const Product x(m, n, k, true, false, bf16, 11);
          const size_t elt = cBf16 ? 2 : 4;
          Aligned cached(size_t(m * ldc + offset) * elt, 0x5A),
              streamed(cached.bytes.size() - 64, 0x5A);
          auto at = [&](Aligned &v) { return v.data() + offset * elt; };
          Aligned pack(tile::packBytes(m, n, k, true, bf16, cBf16));
          for (const bool stream : {false, true})
            tile::gemm(m, n, k, x.a.data(), x.a.ld, true, x.b.data(), x.b.ld, false, bf16,
                       at(stream ? streamed : cached), ldc, cBf16, false, pack.data(), stream);
          CHECK(std::memcmp(at(cached), at(streamed), size_t(m * ldc) * elt) == 0);
          // The cached C is right (the case above checks its values), and the
          // columns past n kept their bytes.
          int64_t touched = 0;
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = n; j < ldc; ++j)
              for (size_t b = 0; b < elt; ++b)
                touched += at(streamed)[size_t(i * ldc + j) * elt + b] != 0x5A;
          CHECK(touched == 0);
        }
  }
}

TEST_CASE("moec's AMX tile gives a B stored n x k the bits of the same B stored k x n",
          "[cpu][tile]") {
  // On AMX tiles a weight read transposed (B stored n x k, A of few rows) is
  // computed as C^T = B A^T, B's rows read where they lie: the same sums in
  // the same order, so the bits of C's own form on B transposed into a
  // k x n copy. Row blocks of B that end a tile and a block unevenly (n),
  // depths of whole steps, of a partial one and of several chunks (k), A's
  // rows over one column group and several (m), fp32 C loaded or not, and a
  // bf16 C written plainly or streamed.
  if (!tileRuns(true) || !tile::amx()) {
    WARN("no AMX tiles here: the AMX tile's swapped form is not run");
    return;
  }
  for (const int64_t m : {int64_t(19), int64_t(140), int64_t(300)})
    for (const int64_t n : {int64_t(40), int64_t(250)})
      for (const int64_t k : {int64_t(64), int64_t(600), int64_t(1100)})
        for (const int form : {0, 1, 2}) { // fp32 C; fp32 C loaded; bf16 C streamed
          INFO("m " << m << ", n " << n << ", k " << k << ", form " << form);
          const bool cBf16 = form == 2, load = form == 1, stream = form == 2;
          const Product x(m, n, k, false, true, true, uint32_t(m + n + k));
          Stored bt(true, k, n, 7);
          for (int64_t p = 0; p < k; ++p)
            for (int64_t j = 0; j < n; ++j)
              bt.set(p, j, x.b.value(j, p));
          const size_t elt = cBf16 ? 2 : 4;
          const int64_t ldc = n + 32;
          Aligned swapped(size_t(m * ldc) * elt, 0x3C), own(size_t(m * ldc) * elt, 0x3C);
          Aligned pack(tile::packBytes(m, n, k, false, true, cBf16));
          tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, true, true,
                     swapped.data(), ldc, cBf16, load, pack.data(), stream);
          tile::gemm(m, n, k, x.a.data(), x.a.ld, false, bt.data(), bt.ld, false, true, own.data(),
                     ldc, cBf16, load, pack.data(), stream);
          CHECK(std::memcmp(swapped.data(), own.data(), swapped.bytes.size() - 64) == 0);
          if (form == 0) // and the values are the product's
            CHECK(x.worstError(reinterpret_cast<const float *>(swapped.data()), ldc, 0, m) <
                  1e-3 * double(k));
        }
}

TEST_CASE("moec's tile writes no more working memory than packBytes gives it", "[cpu][tile]") {
  // Depths about one block of panels (128 units) and the deepest taken as
  // one block (256): a weight gradient's depth is an expert's rows, which
  // lands there. The bytes after packBytes keep their fill, and C is right.
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    const int64_t per = bf16 ? 2 : 1;
    for (const int64_t units :
         {int64_t(128), int64_t(129), int64_t(139), int64_t(256), int64_t(257)})
      for (const bool transA : {false, true})
        for (const bool transB : {false, true})
          for (const bool cBf16 : {false, true}) {
            const int64_t m = 37, n = 250, k = units * per;
            INFO((bf16 ? "bf16" : "fp32")
                 << " k " << k << (transA ? " transA" : "") << (transB ? " transB" : "")
                 << (cBf16 ? ", bf16 C" : ", fp32 C"));
            const Product x(m, n, k, transA, transB, bf16, uint32_t(units));
            const size_t bytes = tile::packBytes(m, n, k, transA, bf16, cBf16);
            Aligned pack(bytes + 4096, 0xA5);
            const size_t elt = cBf16 ? 2 : 4;
            Aligned c(size_t(m * n) * elt);
            tile::gemm(m, n, k, x.a.data(), x.a.ld, transA, x.b.data(), x.b.ld, transB, bf16,
                       c.data(), n, cBf16, false, pack.data(), transA);
            int64_t past = 0;
            for (size_t i = bytes; i < bytes + 4096; ++i)
              past += pack.data()[i] != 0xA5;
            CHECK(past == 0);
            int64_t bad = 0;
            for (int64_t i = 0; i < m; ++i)
              for (int64_t j = 0; j < n; ++j) {
                double want = 0.0, scale = 0.0;
                for (int64_t p = 0; p < k; ++p) {
                  const double term = double(x.opA(i, p)) * double(x.opB(p, j));
                  want += term;
                  scale += std::fabs(term);
                }
                const float got = valueAt(c.data(), i * n + j, cBf16);
                // fp32 sums, then (a bf16 C) one rounding: 2^-8 of the value.
                const double tolerance = 1e-6 * scale * std::sqrt(double(k)) +
                                         (cBf16 ? std::fabs(want) / 256 : 0.0) + 1e-30;
                bad += std::fabs(double(got) - want) > tolerance;
              }
            CHECK(bad == 0);
          }
  }
}

TEST_CASE("moec's tile gives the same bits on a B packed whole beforehand", "[cpu][tile]") {
  // packB packs op(B) once, the panels gemm would make block by block: the
  // same bits for every form of B and A, depths that end a block or a bf16
  // pair unevenly, columns that end a panel and a group unevenly, any rows of
  // A (the rows of other tiles read the same packed B), loading C or not,
  // and a bf16 C.
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const bool transB : {false, true})
      for (const bool transA : {false, true})
        // (1100: a bf16 B packed beforehand over more than one of its
        // deeper blocks, 512 units.)
        for (const int64_t k : {int64_t(7), int64_t(257), int64_t(600), int64_t(1100)})
          for (const int64_t n : {int64_t(13), int64_t(200), int64_t(410)})
            for (const bool cBf16 : {false, true}) {
              INFO((bf16 ? "bf16" : "fp32") << ", transA " << transA << ", transB " << transB
                                            << ", k " << k << ", n " << n << ", C "
                                            << (cBf16 ? "bf16" : "fp32"));
              const int64_t m = 19;
              const Product x(m, n, k, transA, transB, bf16, uint32_t(k + n));
              Aligned packedB(tile::packedBBytes(n, k, bf16));
              tile::packB(n, k, x.b.data(), x.b.ld, transB, bf16, packedB.data());
              const size_t elt = cBf16 ? 2 : 4, aElt = bf16 ? 2 : 4;
              for (const int64_t i0 : {int64_t(0), int64_t(5)}) {
                const int64_t rows = m - i0;
                const char *aAt =
                    static_cast<const char *>(x.a.data()) + (transA ? i0 : i0 * x.a.ld) * aElt;
                const bool load = !cBf16 && i0 == 5;
                Aligned plain(size_t(rows * n) * elt, 0x11), packed(size_t(rows * n) * elt, 0x11);
                Aligned pack(tile::packBytes(rows, n, k, transA, bf16, cBf16));
                tile::gemm(rows, n, k, aAt, x.a.ld, transA, x.b.data(), x.b.ld, transB, bf16,
                           plain.data(), n, cBf16, load, pack.data());
                tile::gemm(rows, n, k, aAt, x.a.ld, transA, x.b.data(), x.b.ld, transB, bf16,
                           packed.data(), n, cBf16, load, pack.data(), false, packedB.data());
                CHECK(std::memcmp(plain.data(), packed.data(), size_t(rows * n) * elt) == 0);
                // And the values are the product's (a packed B that were all
                // zero, or misplaced, would give bits both calls could not share).
                if (!cBf16 && !load)
                  CHECK(x.worstError(reinterpret_cast<const float *>(packed.data()), n, i0, rows) <
                        1e-3 * double(k));
              }
            }
  }
}

TEST_CASE("moec's tile gives the same bits on a B read through a decoder", "[cpu][tile]") {
  // A decoded B (a quantized weight's codes) is decoded a panel (16 rows in
  // the swapped form) and a depth block at a time and packed from there: the
  // bits of gemm on the decoded B itself, for both forms of B, depths and columns that end a block,
  // a bf16 pair, a panel and a group unevenly, and B's columns from an offset (a tile's columns of
  // the weight). A B stored k x n whose decoder also writes the panels' units (DecodedB::pairs) is
  // read through that.
  if (!tileRuns(true))
    return;
  struct Source {
    const Stored *b;
    int64_t calls = 0, pairCalls = 0;
  };
  const auto pairs = [](const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                        uint32_t *dst, int64_t panelStride) {
    auto &s = *static_cast<Source *>(const_cast<void *>(context));
    ++s.pairCalls;
    REQUIRE((r0 >= 0 && r0 < r1 && r1 <= s.b->rows && c0 >= 0 && c0 < c1 && c1 <= s.b->cols));
    const int64_t padded = (c1 - c0 + 15) / 16 * 16;
    for (int64_t t = 0; r0 + 2 * t < r1; ++t)
      for (int64_t j = 0; j < padded; ++j) {
        const int64_t i = r0 + 2 * t;
        uint32_t pair = 0;
        if (c0 + j < c1) {
          pair = s.b->b16[size_t(i * s.b->ld + c0 + j)];
          if (i + 1 < r1)
            pair |= uint32_t(s.b->b16[size_t((i + 1) * s.b->ld + c0 + j)]) << 16;
        }
        dst[(j / 48) * panelStride + t * 48 + j % 48] = pair;
      }
  };
  const auto decode = [](const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                         uint16_t *dst, int64_t ld) {
    auto &s = *static_cast<Source *>(const_cast<void *>(context));
    ++s.calls;
    REQUIRE((r0 >= 0 && r1 <= s.b->rows && c0 >= 0 && c1 <= s.b->cols));
    for (int64_t i = r0; i < r1; ++i)
      std::memcpy(dst + (i - r0) * ld, s.b->b16.data() + i * s.b->ld + c0,
                  size_t(c1 - c0) * 2);
  };
  for (const bool transB : {false, true})
    for (const bool withPairs : {false, true})
      for (const int64_t k : {int64_t(7), int64_t(257), int64_t(600)})
        for (const int64_t n : {int64_t(13), int64_t(200), int64_t(410)})
          for (const bool cBf16 : {false, true}) {
            if (transB && withPairs)
              continue;
            INFO("transB " << transB << ", k " << k << ", n " << n << ", C "
                           << (cBf16 ? "bf16" : "fp32") << (withPairs ? ", pairs" : ""));
            const int64_t m = 19, j0 = std::min<int64_t>(21, n / 3); // columns [j0, n)
            const Product x(m, n, k, false, transB, true, uint32_t(3 * k + n));
            const int64_t cols = n - j0;
            const uint16_t *bAt = x.b.b16.data() + (transB ? j0 * x.b.ld : j0);
            const size_t elt = cBf16 ? 2 : 4;
            Aligned plain(size_t(m * cols) * elt, 0x11), decoded(size_t(m * cols) * elt, 0x22);
            // (One buffer for both calls: the larger of their two needs.)
            Aligned pack(std::max(tile::packBytes(m, cols, k, false, true, cBf16, false),
                                  tile::packBytes(m, cols, k, false, true, cBf16, true)));
            tile::gemm(m, cols, k, x.a.data(), x.a.ld, false, bAt, x.b.ld, transB, true,
                       plain.data(), cols, cBf16, false, pack.data());
            Source source{&x.b};
            tile::DecodedB d;
            d.decode = decode;
            if (withPairs)
              d.pairs = pairs;
            d.context = &source;
            (transB ? d.rowOffset : d.colOffset) = j0;
            tile::gemm(m, cols, k, x.a.data(), x.a.ld, false, nullptr, 0, transB, true,
                       decoded.data(), cols, cBf16, false, pack.data(), false, nullptr, &d);
            // (AMX tiles decode B's rows and take no pairs.)
            CHECK(source.calls + source.pairCalls > 0);
            if (withPairs && !tile::amx())
              CHECK(source.pairCalls > 0);
            CHECK(std::memcmp(plain.data(), decoded.data(), size_t(m * cols) * elt) == 0);
          }
}

TEST_CASE("moec's tile gives the same bits on a B whose decoder writes the panels", "[cpu][tile]") {
  // DecodedB::panel (a quantized weight's codes packed beforehand) writes a
  // panel's units straight; the tile then takes depth blocks of
  // kPackedBlockUnits units (a depth of 1100 is two of them, the second
  // short), 128 for a narrow C: the bits of gemm on B itself, for both
  // forms of B and columns that end a panel and a group unevenly. Here the
  // decoder copies the panels of B packed beforehand (tile::packB).
  if (!tileRuns(true))
    return;
  struct Panels {
    const uint32_t *packed;
    int64_t units;
    int64_t calls = 0, deepest = 0;
  };
  const auto panel = [](const void *context, int64_t q, int64_t u0, int64_t u1, uint32_t *dst) {
    auto &s = *static_cast<Panels *>(const_cast<void *>(context));
    ++s.calls;
    s.deepest = std::max(s.deepest, u1 - u0);
    REQUIRE((u0 >= 0 && u1 <= s.units && u0 < u1));
    std::memcpy(dst, s.packed + (q * s.units + u0) * 48, size_t(u1 - u0) * 48 * 4);
  };
  for (const bool transB : {false, true})
    for (const int64_t k : {int64_t(7), int64_t(600), int64_t(1100)})
      for (const int64_t n : {int64_t(13), int64_t(410)})
        for (const bool cBf16 : {false, true}) {
          INFO("transB " << transB << ", k " << k << ", n " << n << ", C "
                         << (cBf16 ? "bf16" : "fp32"));
          const int64_t m = 19;
          const Product x(m, n, k, false, transB, true, uint32_t(5 * k + n));
          const size_t elt = cBf16 ? 2 : 4;
          Aligned plain(size_t(m * n) * elt, 0x11), decoded(size_t(m * n) * elt, 0x22);
          Aligned pack(std::max(tile::packBytes(m, n, k, false, true, cBf16, false),
                                tile::packBytes(m, n, k, false, true, cBf16, true)));
          tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, transB, true,
                     plain.data(), n, cBf16, false, pack.data());
          Aligned packedB(tile::packedBBytes(n, k, true));
          tile::packB(n, k, x.b.data(), x.b.ld, transB, true, packedB.data());
          Panels source{reinterpret_cast<const uint32_t *>(packedB.data()), (k + 1) / 2};
          tile::DecodedB d;
          d.panel = panel;
          d.context = &source;
          tile::gemm(m, n, k, x.a.data(), x.a.ld, false, nullptr, 0, transB, true, decoded.data(),
                     n, cBf16, false, pack.data(), false, nullptr, &d);
          CHECK(source.calls > 0);
          // (A C at most 16 columns wide keeps blocks of kBlockUnits, and
          // so do the dot form, which takes a panel's units to its rows, and
          // AMX tiles, which decode a panel 2 * kBlockUnits values at a time.)
          const bool shallow = n <= 16 || tile::dotForm(false, transB, true) || tile::amx();
          CHECK(source.deepest == std::min<int64_t>((k + 1) / 2, shallow ? 128 : 512));
          CHECK(std::memcmp(plain.data(), decoded.data(), size_t(m * n) * elt) == 0);
        }
}

TEST_CASE("moec's tile scales and adds onto its sums as they leave the registers", "[cpu][tile]") {
  // tile::AddScaled: C = addend + alpha * S in fp32, a multiply and then an
  // add, rounded once into C: the bits of the fp32 sums S (the plain tile)
  // finished by that formula, for fp32 and bf16 C, one depth block and
  // several, alpha 1 and not, no addend, a separate one, and C itself as the
  // addend. Row 3's sums are zero and its addend subnormal: C's values there
  // are subnormal, rounded to bf16 as floatToBf16 rounds them (not as zero).
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const bool cBf16 : {false, true})
      for (const int64_t k : {int64_t(16), int64_t(700)})
        for (const float alpha : {1.0f, 2.5f})
          for (const int addendKind : {0, 1, 2})                  // none, separate, C itself
            for (const int64_t n : {int64_t(250), int64_t(16)})   // 16: the narrow kernel
              for (const bool transB : {false, true}) {           // bf16 transB: the dot form
                INFO((bf16 ? "bf16" : "fp32")
                     << " operands, " << (cBf16 ? "bf16" : "fp32") << " C, k " << k << ", alpha "
                     << alpha << ", addend " << addendKind << ", n " << n << ", transB " << transB);
                const int64_t m = 21, ldc = 256, lda = 260;
                Product x(m, n, k, false, transB, bf16, 13);
                for (int64_t p = 0; p < k; ++p)
                  x.a.set(3, p, 0.0f);
                std::vector<float> sums(size_t(m * n));
                x.run(sums.data(), n, false, 0, m, 0, n);
                std::mt19937 rng(17);
                std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
                // The addend as stored (C's type) and as the floats it holds.
                std::vector<float> add32(size_t(m * lda), 0.0f);
                std::vector<uint16_t> add16(size_t(m * lda), 0);
                for (size_t i = 0; i < add32.size(); ++i) {
                  add16[i] = floatToBf16(dist(rng));
                  add32[i] = cBf16 ? bf16ToFloat(add16[i]) : dist(rng);
                }
                for (int64_t j = 0; j < lda; ++j) { // (j % 100 + 1) x 2^-133, signs alternating
                  const float tiny = std::ldexp(float(j % 100 + 1), -133) * (j % 2 ? -1.0f : 1.0f);
                  add16[size_t(3 * lda + j)] = floatToBf16(tiny);
                  add32[size_t(3 * lda + j)] =
                      cBf16 ? bf16ToFloat(add16[size_t(3 * lda + j)]) : tiny;
                }
                const size_t elt = cBf16 ? 2 : 4;
                std::vector<uint8_t> c(size_t(m * ldc) * elt, 0x5A);
                const void *addendData = nullptr;
                int64_t addendLd = 0;
                if (addendKind == 1) {
                  addendData = cBf16 ? static_cast<const void *>(add16.data()) : add32.data();
                  addendLd = lda;
                } else if (addendKind == 2) {
                  for (int64_t i = 0; i < m; ++i)
                    std::memcpy(c.data() + size_t(i * ldc) * elt,
                                cBf16 ? static_cast<const void *>(&add16[size_t(i * lda)])
                                      : &add32[size_t(i * lda)],
                                size_t(n) * elt);
                  addendData = c.data();
                  addendLd = ldc;
                }
                const tile::AddScaled epilogue{alpha, addendData, addendLd};
                Aligned pack(tile::packBytes(m, n, k, false, bf16, cBf16, false, true));
                tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, transB, bf16,
                           c.data(), ldc, cBf16, false, pack.data(), false, nullptr, nullptr,
                           &epilogue);
                int64_t bad = 0;
                for (int64_t i = 0; i < m; ++i)
                  for (int64_t j = 0; j < n; ++j) {
                    const volatile float scaled = alpha * sums[size_t(i * n + j)];
                    const float want =
                        addendKind == 0 ? scaled : add32[size_t(i * lda + j)] + scaled;
                    const uint8_t *got = c.data() + size_t(i * ldc + j) * elt;
                    if (cBf16) {
                      uint16_t v;
                      std::memcpy(&v, got, 2);
                      bad += v != floatToBf16(want);
                    } else {
                      float v;
                      std::memcpy(&v, got, 4);
                      uint32_t vb, wb;
                      std::memcpy(&vb, &v, 4);
                      std::memcpy(&wb, &want, 4);
                      bad += vb != wb;
                    }
                  }
                CHECK(bad == 0);
                // Nothing past the tile's columns.
                int64_t touched = 0;
                for (int64_t i = 0; i < m; ++i)
                  for (int64_t j = n; j < ldc; ++j)
                    for (size_t b = 0; b < elt; ++b)
                      touched += c[size_t(i * ldc + j) * elt + b] != 0x5A;
                CHECK(touched == 0);
              }
  }
}

TEST_CASE("moec's tile adds a low-rank product to its sums in one call", "[cpu][tile]") {
  // tile::LowRank: C = A op(B) + U op(V). On the AVX-512 micro-kernel, U's
  // units follow A's in the same sums, so where A's depth ends on a whole
  // unit (fp32, or an even bf16 depth) C has the bits of the plain tile on
  // the concatenation [A | U] [op(B) ; op(V)]; on AMX tiles too where A's
  // depth ends on a whole tile step (32 values), else those of the plain
  // tile followed by a second call adding U op(V) onto C. Every form: one
  // depth block and several, B packed beforehand, decoded (a quantized
  // base's; here a decoder that copies B) or as stored, k x n or n x k (on
  // AMX, C as its transpose: the swapped form), V as stored or transposed,
  // an odd rank (a lone bf16 value last), a narrow C, bf16 and fp32 C; and
  // against a loop in double precision.
  const auto decode = [](const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                         uint16_t *dst, int64_t ld) {
    const Stored &b = *static_cast<const Stored *>(context);
    for (int64_t i = r0; i < r1; ++i)
      std::memcpy(dst + (i - r0) * ld, b.b16.data() + i * b.ld + c0, size_t(c1 - c0) * 2);
  };
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    const bool onAmx = bf16 && tile::amx();
    for (const int64_t k : {int64_t(16), int64_t(700), int64_t(64), int64_t(544)})
      for (const int64_t r : {int64_t(16), int64_t(5), int64_t(40)})
        for (const int64_t n : {int64_t(250), int64_t(16)})
          for (const bool transV : {false, true})
            for (const int form : {0, 1, 2}) // B as stored, packed, decoded
              for (const bool cBf16 : {false, true})
                for (const bool transB : {false, true}) { // bf16 transB: the dot form
                  if (form == 2 && !bf16)
                    continue;
                  const bool packed = form == 1, decoded = form == 2;
                  // C streamed past the caches (the same bits) every other case.
                  const bool stream = (k + r + n + transV + form + cBf16 + transB) % 2 == 1;
                  INFO((bf16 ? "bf16" : "fp32") << ", k " << k << ", r " << r << ", n " << n
                                                << ", transV " << transV << ", B "
                                                << (packed    ? "packed"
                                                    : decoded ? "decoded"
                                                              : "as stored")
                                                << ", C " << (cBf16 ? "bf16" : "fp32")
                                                << ", transB " << transB << ", stream " << stream);
                  const int64_t m = k == 544 ? 70 : 21; // 70: three row blocks
                  const Product x(m, n, k, false, transB, bf16, uint32_t(k + r + n));
                  const Product low(m, n, r, false, transV, bf16, uint32_t(7 * k + r));
                  // The concatenation, stored as the plain tile reads it (B's
                  // form as x's).
                  Stored acat(bf16, m, k + r, 3),
                      bcat(bf16, transB ? n : k + r, transB ? k + r : n, 5);
                  for (int64_t i = 0; i < m; ++i)
                    for (int64_t p = 0; p < k + r; ++p)
                      acat.set(i, p, p < k ? x.opA(i, p) : low.opA(i, p - k));
                  for (int64_t p = 0; p < k + r; ++p)
                    for (int64_t j = 0; j < n; ++j) {
                      const float v = p < k ? x.opB(p, j) : low.opB(p - k, j);
                      transB ? bcat.set(j, p, v) : bcat.set(p, j, v);
                    }
                  const size_t elt = cBf16 ? 2 : 4, bytes = size_t(m * n) * elt;
                  Aligned fused(bytes, 0x5A), want(bytes, 0x5A);
                  Aligned packedB(tile::packedBBytes(n, k, bf16));
                  tile::packB(n, k, x.b.data(), x.b.ld, transB, bf16, packedB.data());
                  const tile::LowRank lr{low.a.data(), low.a.ld, low.b.data(), low.b.ld, transV, r};
                  Aligned pack(tile::packBytes(m, n, k + r, false, bf16, cBf16, false, true, r));
                  // The fused call's working memory as packBytes gives it,
                  // with 64 guard bytes after it that it must not touch.
                  const size_t own =
                      tile::packBytes(m, n, k, false, bf16, cBf16, decoded, false, r);
                  Aligned fusedPack(own + 64, 0xA5);
                  tile::DecodedB d;
                  d.decode = decode;
                  d.context = &x.b;
                  tile::gemm(m, n, k, x.a.data(), x.a.ld, false, decoded ? nullptr : x.b.data(),
                             decoded ? 0 : x.b.ld, transB, bf16, fused.data(), n, cBf16, false,
                             fusedPack.data(), stream, packed ? packedB.data() : nullptr,
                             decoded ? &d : nullptr, nullptr, &lr);
                  CHECK(std::count(fusedPack.data() + own, fusedPack.data() + own + 64, 0xA5) ==
                        64);
                  if (onAmx && k % 32 != 0) {
                    tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, transB, bf16,
                               want.data(), n, cBf16, false, pack.data());
                    const tile::AddScaled onto{1.0f, want.data(), n};
                    tile::gemm(m, n, r, low.a.data(), low.a.ld, false, low.b.data(), low.b.ld,
                               transV, bf16, want.data(), n, cBf16, false, pack.data(), false,
                               nullptr, nullptr, &onto);
                  } else {
                    tile::gemm(m, n, k + r, acat.data(), acat.ld, false, bcat.data(), bcat.ld,
                               transB, bf16, want.data(), n, cBf16, false, pack.data());
                  }
                  CHECK(std::memcmp(fused.data(), want.data(), bytes) == 0);
                  double worst = 0, scale = 0;
                  for (int64_t i = 0; i < m; ++i)
                    for (int64_t j = 0; j < n; ++j) {
                      double sum = 0;
                      for (int64_t p = 0; p < k + r; ++p)
                        sum += double(acat.value(i, p)) *
                               (transB ? bcat.value(j, p) : bcat.value(p, j));
                      const float got = valueAt(fused.data(), i * n + j, cBf16);
                      worst = std::max(worst, std::abs(sum - got));
                      scale = std::max(scale, std::abs(sum));
                    }
                  CHECK(worst <= (cBf16 ? 1e-2 : 1e-5) * std::max(1.0, scale));
                }
  }
}

TEST_CASE("moec's tile writes a LowRank's lead product, then adds U's product", "[cpu][tile]") {
  // tile::LowRank::Lead: U = s op(A) op(L) written first (a LoRA adapter's
  // first product inside its base's tile), then C = op(A) op(B) + U op(V).
  // U has the bits of the call that computes it alone (AddScaled{s}, none
  // where s is 1) and C those of the low-rank call on that U: on AMX from
  // the tiles of A the product makes (leadInTile: a depth of whole tile
  // steps, B not read as its transpose in place), else by that call first.
  // Every form: depths of whole steps and not, L stored k x r, r x k or
  // packed, B as stored or packed, k x n or n x k, a narrow C (A read in
  // place), s 1 and not, an odd rank; and the working memory no more than
  // packBytes and leadPackBytes give.
  for (const bool bf16 : {false, true}) {
    if (!tileRuns(bf16))
      continue;
    for (const int64_t k : {int64_t(64), int64_t(700), int64_t(544)})
      for (const int64_t r : {int64_t(16), int64_t(5)})
        for (const int64_t n : {int64_t(250), int64_t(16)})
          for (const int leadForm : {0, 1, 2}) // L k x r, r x k, packed
            for (const bool packedB : {false, true})
              for (const bool transB : {false, true})
                for (const float s : {1.0f, 0.375f}) {
                  INFO((bf16 ? "bf16" : "fp32")
                       << ", k " << k << ", r " << r << ", n " << n << ", L form " << leadForm
                       << ", B packed " << packedB << ", transB " << transB << ", s " << s);
                  const int64_t m = k == 544 ? 70 : 21;
                  const bool leadTransB = leadForm == 1;
                  const Product x(m, n, k, false, transB, bf16, uint32_t(k + r + n));
                  const Product low(m, n, r, false, false, bf16, uint32_t(3 * k + r));
                  const Product lead(m, r, k, false, leadTransB, bf16, uint32_t(5 * k + n));
                  Aligned packedX(tile::packedBBytes(n, k, bf16));
                  tile::packB(n, k, x.b.data(), x.b.ld, transB, bf16, packedX.data());
                  Aligned packedL(tile::packedBBytes(r, k, bf16));
                  tile::packB(r, k, lead.b.data(), lead.b.ld, leadTransB, bf16, packedL.data());
                  const int64_t ldu = r + 3;
                  const size_t elt = bf16 ? 2 : 4, uBytes = size_t(m * ldu) * elt,
                               cBytes = size_t(m * n) * elt;
                  // Alone: U by its own call, then the product on it.
                  Aligned uWant(uBytes, 0x5A), cWant(cBytes, 0x5A);
                  const tile::AddScaled scaled{s, nullptr, 0};
                  Aligned pack(
                      std::max(tile::packBytes(m, n, k, false, bf16, bf16, false, false, r),
                               tile::leadPackBytes(m, r, k, bf16, s)));
                  tile::gemm(m, r, k, x.a.data(), x.a.ld, false, lead.b.data(), lead.b.ld,
                             leadTransB, bf16, uWant.data(), ldu, bf16, false, pack.data(), false,
                             leadForm == 2 ? packedL.data() : nullptr, nullptr,
                             s != 1.0f ? &scaled : nullptr);
                  const tile::LowRank alone{uWant.data(), ldu, low.b.data(), low.b.ld, false, r};
                  tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, transB, bf16,
                             cWant.data(), n, bf16, false, pack.data(), false,
                             packedB ? packedX.data() : nullptr, nullptr, nullptr, &alone);
                  // With the lead: one call, its working memory followed by
                  // 64 guard bytes it must not touch.
                  Aligned u(uBytes, 0x5A), c(cBytes, 0x5A);
                  const tile::LowRank::Lead leadArgs{
                      u.data(),  lead.b.data(),
                      lead.b.ld, leadTransB,
                      s,         leadForm == 2 ? packedL.data() : nullptr};
                  const tile::LowRank withLead{u.data(), ldu, low.b.data(), low.b.ld,
                                               false,    r,   &leadArgs};
                  const size_t own =
                      std::max(tile::packBytes(m, n, k, false, bf16, bf16, false, false, r),
                               tile::leadPackBytes(m, r, k, bf16, s));
                  Aligned leadPack(own + 64, 0xA5);
                  tile::gemm(m, n, k, x.a.data(), x.a.ld, false, x.b.data(), x.b.ld, transB, bf16,
                             c.data(), n, bf16, false, leadPack.data(), false,
                             packedB ? packedX.data() : nullptr, nullptr, nullptr, &withLead);
                  CHECK(std::count(leadPack.data() + own, leadPack.data() + own + 64, 0xA5) == 64);
                  CHECK(std::memcmp(u.data(), uWant.data(), uBytes) == 0);
                  CHECK(std::memcmp(c.data(), cWant.data(), cBytes) == 0);
                  // U against a loop in double precision (its rows' values).
                  double worst = 0;
                  for (int64_t i = 0; i < m; ++i)
                    for (int64_t j = 0; j < r; ++j) {
                      double sum = 0;
                      for (int64_t p = 0; p < k; ++p)
                        sum += double(x.opA(i, p)) * lead.opB(p, j);
                      worst = std::max(
                          worst, std::abs(double(s) * sum - valueAt(u.data(), i * ldu + j, bf16)));
                    }
                  CHECK(worst <= (bf16 ? 0.25 : 1e-3));
                }
  }
}
