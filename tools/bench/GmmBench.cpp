//===- GmmBench.cpp - Single-thread speed of the matmul tile kernel -------===//
//
// Times one M x N x K tile (default 512^3) on the calling thread: the naive
// triple loop (reference::matmul), then gemmTile with fp32 and with bf16
// operands, and prints GFLOP/s (2*M*N*K flops per call, best of `reps`) and
// the largest difference from the naive result. With `experts` > 1 it then
// times the bf16 and fp32 tiles as a layer meets them: one call on each of
// `experts` distinct pairs of A and B in turn (each expert's weight new to
// the caches), and prints the rate over all of them.
//
//   bazel run //tools/bench:gmm_bench -- [M N K [reps [experts]]]
//
// `gmm_bench --layer [experts [reps [threads [tile]]]]` times the six tile shapes
// of the qwen3-30b-a3b layer (H 2048, I 768, 128 rows an expert, the
// strides and transposes its binaries give the tiles), and the five
// products of a rank-16 LoRA adapter on up_proj (16 columns wide or 16 rows
// tall), the same way, in fp32
// and bf16, on `threads` threads at once (each on operands of its own, as
// the layer's workers run); and, for the tiles whose B is a weight, with
// each expert's B packed beforehand (tile::packB: the layer's packed-weight
// store, ContextOptions::packWeights), the plain and packed runs
// alternating: bf16, and fp32 where moec's fp32 tile runs (MOEC_GEMM=moec);
// not where the tile reads B in its dot form (tile::dotForm), which reads
// no packed B (the layer packs none there either). (A bf16 B stored n x k
// as stored runs in the swapped form where the dot form does not,
// tile::swappedForm; packed, through the panels.) The weight gradients
// (dw1, dw2 and the adapters' *_grad) write each expert's C of its own past
// the caches, as the layer does. With `tile`, only the tile of that name.
//
// `gmm_bench --ladder [reps [bf16|f32]]` says where a tile's time goes (bf16
// unless told), one thread, B packed beforehand, rung by rung against the
// probe's peak of that type (Peak.h; f32 needs moec's fp32 tile:
// MOEC_GEMM=moec):
// one depth block whose operands fit in L1; one column group over one depth
// block from L2; one column group over the whole depth; the up_proj tile of the qwen3 layer (128 x
// 1536 x 2048) warm in the caches (one expert's operands again and again); the same on 32 experts'
// operands in turn, each new to the caches as in a layer's pass. The rungs alternate, each keeping
// its best of `reps`.
//
// `gmm_bench --sources [seconds]` times the tile's inner loop with the
// operand it streams read from each level of the memory system (Peak.h's
// measureSourceRates): the fp32 micro-kernel's loop, and AMX tile dot
// products where the CPU has them; GFLOP/s, the share of the probe's peak
// and the streamed operand's GB/s, about `seconds` a level.
//
// `gmm_bench --dequantize [reps]` times the CPU backend's dequantization of
// a quantized weight (runtime/cpu/Quant.h) into bf16 as a forward tile of
// the qwen3 layer asks for it: w1 stored [2I, H] = [1536, 2048], 192 rows
// at a time, each format, one thread; nanoseconds a value, best of `reps`;
// then the decoder's own cost with its codes in L2 (128 rows, a column
// group of 192 columns at a time, 20 times over), as rows and as the
// panels' units the backward's tiles take (tile::DecodedB::pairs).
//
// `gmm_bench --quantized [experts [reps]]` times the qwen3 tiles whose B is
// a quantized weight (the transposed layout: w1 [2I, H], w2 [H, I]; the
// forward reads them transposed, the backward's dX and dA as stored), bf16,
// one thread, 128 rows an expert over `experts` experts in turn, five ways
// alternating: a dense bf16 B (the tile reads it in its form for the
// product), the same B packed beforehand (tile::packB), the codes
// dequantized a tile's 192 columns at a time into a bf16 copy that the tile
// then reads as a dense B, the codes decoded by the tile as it goes
// (tile::DecodedB: into its panels, straight by DecodedB::pairs where B is
// stored k x n, or in the swapped form into the rows it reads), and the codes packed beforehand in
// the panels' order (packCodes), decoded straight into them. GFLOP/s counting the bf16-equivalent
// work.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Quant.h"
#include "runtime/cpu/Peak.h"
#include "runtime/cpu/Tile.h"
#include "base/Memory.h"
#include "runtime/tooling/Reference.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace moec::cpu;
namespace reference = moec::reference;

namespace {

/// Returns the best wall time in seconds of `reps` runs of `body`.
double bestSeconds(int reps, const std::function<void()> &body) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    body();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count());
  }
  return best;
}

float maxDiff(const std::vector<float> &a, const std::vector<float> &b) {
  float d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

/// One tile shape of a layer: C (m x n, ldc) = op(A) op(B), A stored with
/// lda, B with ldb.
struct Shape {
  const char *name;
  int64_t m, n, k, lda, ldb, ldc;
  bool transA, transB;
  /// A LoRA adapter's rank-deep product: C = addend + 2 * the sums (the
  /// layer's scaled product onto the base's output), the addend m x n and
  /// C itself, each expert's own (the layer writes the sums over the base's
  /// output in place).
  bool addScaled = false;
  /// A weight gradient (A the activations, transposed): each expert writes
  /// a C of its own, streamed past the caches, as the layer writes them
  /// (gmmWgradTile); one C for every expert, warm in the caches and written
  /// through them, ran oneDNN's fp32 tiles 1.4-1.6x faster than the layer
  /// does (a Xeon core).
  bool weightGrad() const { return transA; }
};

/// The tiles of qwen3-30b-a3b at 128 rows an expert, as the shipped graphs'
/// automatic splits cut them (moec dump of the binaries at ep 2, S 1024: one
/// tile per expert and op): forward up/down projections, the backward's two
/// activation gradients (transposed weights) and two weight gradients
/// (transposed activations, the depth the expert's rows).
constexpr Shape kLayer[] = {
    {"up_proj", 128, 1536, 2048, 2048, 1536, 1536, false, false},
    {"down_proj", 128, 2048, 768, 768, 2048, 2048, false, false},
    {"act_grad", 128, 768, 2048, 2048, 2048, 768, false, true},
    {"gate_grad", 128, 2048, 1536, 1536, 1536, 2048, false, true},
    {"dw2", 768, 2048, 128, 768, 2048, 2048, true, false},
    {"dw1", 2048, 1536, 128, 2048, 1536, 1536, true, false},
    // A LoRA adapter of rank 16 on up_proj: u = x·A (16 columns), and A's
    // weight gradient x^T·du.
    {"lora_a", 128, 16, 2048, 2048, 16, 16, false, false},
    {"lora_a_grad", 2048, 16, 128, 2048, 16, 16, true, false},
    // The backward's product through B, du = dy·B^T (B stored [16, 2I],
    // the layer's w1_lora_B), and B's weight gradient u^T·dy (16 rows).
    {"lora_v", 128, 16, 1536, 1536, 1536, 16, false, true},
    {"lora_b_grad", 16, 1536, 128, 16, 1536, 1536, true, false},
    // ... and its B product onto up_proj's output in place: y = y_base + 2
    // u·B^T (B stored [2I, 16]), 16 deep.
    {"lora_b", 128, 1536, 16, 16, 16, 1536, false, true, true},
};

/// One thread's operands of a shape, `experts` distinct sets in the
/// operands' storage, and its C (a weight gradient's: one per expert).
struct Operands {
  std::vector<std::vector<char>> a, b;
  std::vector<moec::ZeroedPages> c;      // page-aligned, as the layer's are 64-byte aligned
  std::vector<std::vector<char>> addend; // per expert
  void *cOf(int e) { return c[c.size() == 1 ? 0 : size_t(e)].data(); }
};

Operands makeOperands(const Shape &s, Elt elt, int experts, std::mt19937 &rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const int64_t aSize = (s.transA ? s.k : s.m) * s.lda;
  const int64_t bSize = (s.transB ? s.n : s.k) * s.ldb;
  const size_t bytes = dtypeSize(elt);
  Operands o;
  for (int e = 0; e < experts; ++e) {
    std::vector<float> a(static_cast<size_t>(aSize)), b(static_cast<size_t>(bSize));
    for (float &x : a)
      x = dist(rng);
    for (float &x : b)
      x = dist(rng);
    o.a.emplace_back(size_t(aSize) * bytes);
    o.b.emplace_back(size_t(bSize) * bytes);
    storeFloats(a.data(), o.a.back().data(), elt, a.size());
    storeFloats(b.data(), o.b.back().data(), elt, b.size());
  }
  for (int e = 0; e < (s.weightGrad() ? experts : 1); ++e)
    o.c.emplace_back(size_t(s.m * s.ldc) * bytes);
  if (s.addScaled)
    for (int e = 0; e < experts; ++e) {
      std::vector<float> add(size_t(s.m * s.ldc));
      for (float &x : add)
        x = dist(rng);
      o.addend.emplace_back(add.size() * bytes);
      storeFloats(add.data(), o.addend.back().data(), elt, add.size());
    }
  return o;
}

/// Times every shape of kLayer over `experts` distinct operand sets (C
/// stored in the operands' type, as the layer stores it) on `threads`
/// threads at once, each on operands of its own (as the layer's workers
/// meet different experts' weights), and prints GFLOP/s per thread.
int layerShapes(int experts, int reps, int threads, const std::string &only) {
  std::printf("GEMM: %s\n", gemmConfig());
  std::printf("qwen3-30b-a3b tiles, %d thread%s at once, %d experts' operands each in turn, best "
              "of %d; GFLOP/s per thread\n",
              threads, threads == 1 ? "" : "s", experts, reps);
  std::printf("  %-10s %-22s %10s %10s %10s %10s\n", "tile", "m x n x k", "f32", "f32 packed",
              "bf16", "bf16 packed");
  std::mt19937 rng(1);
  for (const Shape &s : kLayer) {
    if (!only.empty() && only != s.name)
      continue;
    std::printf("  %-10s %5lld x %5lld x %5lld", s.name, (long long)s.m, (long long)s.n,
                (long long)s.k);
    // The weight tiles (B not transposed-A's partner: the weight gradients'
    // B is an activation) also run on B packed beforehand.
    const bool weightB = !s.transA;
    for (const Elt elt : {Elt::F32, Elt::BF16}) {
      std::vector<Operands> mine;
      for (int t = 0; t < threads; ++t)
        mine.push_back(makeOperands(s, elt, experts, rng));
      // (The dot form reads B as stored: a packed B would time the same.)
      const bool packable =
          weightB && packedTile(elt, elt) && !tile::dotForm(s.transA, s.transB, elt == Elt::BF16);
      // [thread][expert]: each expert's op(B) packed whole.
      std::vector<std::vector<moec::ZeroedPages>> packed(static_cast<size_t>(threads));
      if (packable)
        for (int t = 0; t < threads; ++t)
          for (int e = 0; e < experts; ++e) {
            packed[size_t(t)].emplace_back(tile::packedBBytes(s.n, s.k, elt == Elt::BF16));
            tile::packB(s.n, s.k, mine[size_t(t)].b[size_t(e)].data(), s.ldb, s.transB,
                        elt == Elt::BF16, packed[size_t(t)].back().data());
          }
      std::vector<Scratch> scratch(static_cast<size_t>(threads));
      auto run = [&](int t, bool usePacked) {
        Operands &o = mine[size_t(t)];
        for (int e = 0; e < experts; ++e)
          gemmTile(s.m, s.n, s.k, ConstMatrix{o.a[size_t(e)].data(), elt, s.lda}, s.transA,
                   ConstMatrix{o.b[size_t(e)].data(), elt, s.ldb}, s.transB,
                   Matrix{s.addScaled ? o.addend[size_t(e)].data() : o.cOf(e), elt, s.ldc}, false,
                   &scratch[size_t(t)], s.addScaled ? 2.0f : 1.0f, s.weightGrad(),
                   usePacked ? packed[size_t(t)][size_t(e)].data() : nullptr, nullptr,
                   s.addScaled ? ConstMatrix{o.addend[size_t(e)].data(), elt, s.ldc}
                               : ConstMatrix{});
      };
      auto all = [&](bool usePacked) {
        std::vector<std::thread> others;
        for (int i = 1; i < threads; ++i)
          others.emplace_back(run, i, usePacked);
        run(0, usePacked);
        for (std::thread &x : others)
          x.join();
      };
      // Plain and packed alternate, each keeping its best.
      double best[2] = {1e30, 1e30};
      for (int r = 0; r < reps; ++r)
        for (const bool usePacked : {false, true}) {
          if (usePacked && !packable)
            continue;
          best[usePacked] = std::min(best[usePacked], bestSeconds(1, [&] { all(usePacked); }));
        }
      const double flops = 2.0 * double(s.m * s.n * s.k) * experts;
      std::printf("%*s%8.1f", 3, "", flops / best[0] * 1e-9);
      if (packable)
        std::printf("%*s%8.1f", 3, "", flops / best[1] * 1e-9);
      else
        std::printf("%*s%8s", 3, "", "-");
    }
    std::printf("   GFLOP/s\n");
  }
  return 0;
}

/// A weight format the benches quantize into.
struct Format {
  const char *name;
  moec::WeightFormat format;
  int64_t group = 0;
  bool zeroPoints = false;
};

/// A [rows, cols] fp32 weight quantized in a format: the codes, the scales
/// and the matrix that names them.
struct Quantized {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  QuantizedMatrix m;

  Quantized(const Format &f, const std::vector<float> &w, int64_t rows, int64_t cols)
      : codes(size_t(rows * cols)), scales(size_t(rows * cols)) { // more than any format needs
    m.format = f.format;
    m.rows = rows;
    m.cols = cols;
    m.group = f.group;
    m.zeroPoints = f.zeroPoints;
    quantize(m, w.data(), cols, codes.data(), scales.data());
    m.codes = codes.data();
    m.scales = scales.data();
  }
  Quantized(const Quantized &) = delete; // m points into the vectors
};

/// Times dequantize() into bf16 of a [1536, 2048] weight in each format,
/// 192 rows at a time (a tile's chunk), and prints ns a value.
int dequantizeRates(int reps) {
  const int64_t rows = 1536, cols = 2048, chunk = 192;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> w(size_t(rows * cols));
  for (float &x : w)
    x = dist(rng);
  const Format formats[] = {{"fp8_block128", moec::WeightFormat::Fp8Block128, 0, false},
                            {"int8", moec::WeightFormat::Int8Channel, 0, false},
                            {"int4_g128", moec::WeightFormat::Int4Group, 128, false},
                            {"int4_g64_zp", moec::WeightFormat::Int4Group, 64, true},
                            {"int4_g32", moec::WeightFormat::Int4Group, 32, false}};
  std::vector<uint16_t> out(size_t(chunk * cols));
  std::printf("dequantize into bf16, [%lld, %lld] weight, %lld rows at a time, one thread, best "
              "of %d\n",
              (long long)rows, (long long)cols, (long long)chunk, reps);
  for (const Format &f : formats) {
    const Quantized q(f, w, rows, cols);
    const QuantizedMatrix &m = q.m;
    const double t = bestSeconds(reps, [&] {
      for (int64_t r = 0; r < rows; r += chunk)
        dequantize(m, r, r + chunk, 0, cols, out.data(), Elt::BF16, cols);
    });
    std::printf("  %-14s %6.3f ns a value", f.name, t / double(rows * cols) * 1e9);
    // The decoder's own cost, its codes in L2: 128 rows, 192 columns at a
    // time (a column group), 20 times over, as rows and, where the bf16
    // tile runs, as the panels' units (DecodedB::pairs: the backward's).
    constexpr int64_t warmRows = 128, group = 192, passes = 20;
    const double values = double(passes * warmRows * cols);
    const double tr = bestSeconds(reps, [&] {
      for (int pass = 0; pass < passes; ++pass)
        for (int64_t c = 0; c < cols; c += group)
          dequantize(m, 0, warmRows, c, std::min(cols, c + group), out.data(), Elt::BF16, group);
    });
    std::printf("; warm: rows %6.3f", tr / values * 1e9);
    const tile::DecodedB d = decodedB(m);
    if (d.pairs) {
      std::vector<uint32_t> units(size_t(4 * (warmRows / 2) * 48));
      const double tp = bestSeconds(reps, [&] {
        for (int pass = 0; pass < passes; ++pass)
          for (int64_t c = 0; c < cols; c += group)
            d.pairs(d.context, 0, warmRows, c, std::min(cols, c + group), units.data(),
                    (warmRows / 2) * 48);
      });
      std::printf(", pairs %6.3f", tp / values * 1e9);
    }
    std::printf("\n");
  }
  return 0;
}

/// The `--quantized` mode (the header says what it times).
int quantizedTiles(int experts, int reps) {
  if (!tile::available(true)) {
    std::printf("this CPU has no avx512_bf16: moec's bf16 tile does not run\n");
    return 0;
  }
  struct Shape {
    const char *name;
    int64_t n, k;
    bool transB; // B stored n x k (the forward), else k x n
  };
  const Shape shapes[] = {{"up_proj (w1, fwd)", 1536, 2048, true},
                          {"down_proj (w2, fwd)", 2048, 768, true},
                          {"dA = dZ w2", 768, 2048, false},
                          {"dX = dA' w1", 2048, 1536, false}};
  const Format formats[] = {{"int8", moec::WeightFormat::Int8Channel, 0},
                            {"fp8_block128", moec::WeightFormat::Fp8Block128, 0},
                            {"int4_g128", moec::WeightFormat::Int4Group, 128}};
  const int64_t m = 128, chunk = 192;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::printf("quantized B, bf16, one thread, m %lld, %d experts in turn, best of %d, GFLOP/s:\n"
              "%-22s %-13s %9s %12s %14s %10s %13s\n",
              (long long)m, experts, reps, "tile", "format", "dense B", "dense packed",
              "dequantized", "decoded", "codes packed");
  for (const Shape &s : shapes) {
    const int64_t rows = s.transB ? s.n : s.k, cols = s.transB ? s.k : s.n;
    std::vector<float> w(size_t(rows * cols));
    for (float &x : w)
      x = dist(rng);
    std::vector<std::vector<uint16_t>> a(static_cast<size_t>(experts)),
        dense(static_cast<size_t>(experts));
    std::vector<moec::ZeroedPages> densePacked;
    for (int e = 0; e < experts; ++e) {
      a[size_t(e)].resize(size_t(m * s.k));
      for (uint16_t &x : a[size_t(e)])
        x = floatToBf16(dist(rng) * 50);
      dense[size_t(e)].resize(size_t(rows * cols));
      for (size_t i = 0; i < w.size(); ++i)
        dense[size_t(e)][i] = floatToBf16(w[i]);
      densePacked.emplace_back(tile::packedBBytes(s.n, s.k, true));
      tile::packB(s.n, s.k, dense[size_t(e)].data(), cols, s.transB, true,
                  densePacked.back().data());
    }
    std::vector<float> c(size_t(m * s.n));
    Scratch scratch;
    std::vector<uint16_t> copy(size_t(rows * cols));
    const double flops = 2.0 * double(m) * double(s.n) * double(s.k) * experts;
    for (const Format &f : formats) {
      std::vector<std::unique_ptr<Quantized>> quantized(static_cast<size_t>(experts));
      std::vector<moec::ZeroedPages> codesPacked;
      for (auto &q : quantized) {
        q = std::make_unique<Quantized>(f, w, rows, cols);
        codesPacked.emplace_back(packedCodesBytes(q->m, s.transB, s.n));
        packCodes(q->m, s.transB, 0, s.n, codesPacked.back().data());
      }
      const auto run = [&](int way) {
        for (int e = 0; e < experts; ++e) {
          const ConstMatrix am{a[size_t(e)].data(), Elt::BF16, s.k};
          const Matrix cm{c.data(), Elt::F32, s.n};
          const ConstMatrix bm{dense[size_t(e)].data(), Elt::BF16, cols};
          if (way == 0) {
            gemmTile(m, s.n, s.k, am, false, bm, s.transB, cm, false, &scratch);
          } else if (way == 1) {
            gemmTile(m, s.n, s.k, am, false, bm, s.transB, cm, false, &scratch, 1.0f, false,
                     densePacked[size_t(e)].data());
          } else if (way == 2) {
            for (int64_t c0 = 0; c0 < s.n; c0 += chunk) {
              const int64_t nb = std::min(chunk, s.n - c0);
              const int64_t ld = s.transB ? s.k + 32 : nb + (nb % 512 ? 0 : 32);
              if (s.transB)
                dequantize(quantized[size_t(e)]->m, c0, c0 + nb, 0, cols, copy.data(), Elt::BF16,
                           ld);
              else
                dequantize(quantized[size_t(e)]->m, 0, rows, c0, c0 + nb, copy.data(), Elt::BF16,
                           ld);
              gemmTile(m, nb, s.k, am, false, ConstMatrix{copy.data(), Elt::BF16, ld}, s.transB,
                       Matrix{c.data() + c0, Elt::F32, s.n}, false, &scratch);
            }
          } else {
            const tile::DecodedB d = way == 3 ? decodedB(quantized[size_t(e)]->m)
                                              : packedCodesB(codesPacked[size_t(e)].data());
            gemmTile(m, s.n, s.k, am, false, ConstMatrix{quantized[size_t(e)]->codes.data(), Elt::BF16, 0},
                     s.transB, cm, false, &scratch, 1.0f, false, nullptr, &d);
          }
        }
      };
      double best[5] = {1e30, 1e30, 1e30, 1e30, 1e30};
      for (int r = 0; r < reps; ++r)
        for (int way = 0; way < 5; ++way)
          best[way] = std::min(best[way], bestSeconds(1, [&] { run(way); }));
      std::printf("%-22s %-13s %9.1f %12.1f %14.1f %10.1f %13.1f\n", s.name, f.name,
                  flops / best[0] * 1e-9, flops / best[1] * 1e-9, flops / best[2] * 1e-9,
                  flops / best[3] * 1e-9, flops / best[4] * 1e-9);
    }
  }
  return 0;
}

/// One rung of --ladder: a product C (m x n; fp32, or bf16 where cBf16 asks
/// and the operands are bf16) of A (m x k) and B packed beforehand, over `experts` operand sets in
/// turn, each call repeated `calls` times.
struct Rung {
  const char *name;
  int64_t m, n, k;
  bool cBf16;
  int experts, calls;
};

/// gmm_bench --ladder: see the header.
int ladder(int reps, Elt elt) {
  const bool bf16 = elt == Elt::BF16;
  if (!packedTile(elt, elt)) {
    std::fprintf(stderr, bf16 ? "gmm_bench --ladder: this CPU has no avx512_bf16 tile\n"
                              : "gmm_bench --ladder f32: moec's fp32 tile is not chosen (it needs "
                                "AVX-512 and MOEC_GEMM=moec)\n");
    return 1;
  }
  const std::optional<FmaPeak> peak =
      bf16 ? measureBf16DotPeak(0.3) : std::optional<FmaPeak>(measureFmaPeak(0.3));
  if (!peak) {
    std::fprintf(stderr, "gmm_bench --ladder: no bf16 dot-product peak on this CPU\n");
    return 1;
  }
  const Rung rungs[] = {
      {"one depth block in L1 (8 x 48 x 256)", 8, 48, 256, false, 1, 4000},
      {"one column group, one block, L2 (128 x 192 x 256)", 128, 192, 256, false, 1, 200},
      {"one column group, the whole depth (128 x 192 x 2048)", 128, 192, 2048, true, 1, 25},
      {"up_proj warm (128 x 1536 x 2048, one expert)", 128, 1536, 2048, true, 1, 4},
      {"up_proj cold (the same, 32 experts in turn)", 128, 1536, 2048, true, 32, 1},
  };
  struct Set {
    std::vector<std::vector<char>> a;
    std::vector<moec::ZeroedPages> packed;
    std::vector<char> c;
  };
  std::mt19937 rng(7);
  std::vector<Set> sets;
  for (const Rung &r : rungs) {
    const Shape shape{r.name, r.m, r.n, r.k, r.k, r.n, r.n, false, false};
    Operands o = makeOperands(shape, elt, r.experts, rng);
    Set set;
    set.a = std::move(o.a);
    for (const std::vector<char> &b : o.b) {
      set.packed.emplace_back(tile::packedBBytes(r.n, r.k, bf16));
      tile::packB(r.n, r.k, b.data(), r.n, false, bf16, set.packed.back().data());
    }
    set.c.resize(size_t(r.m * r.n) * (r.cBf16 && bf16 ? 2 : 4));
    sets.push_back(std::move(set));
  }
  Scratch scratch;
  std::vector<double> best(std::size(rungs), 1e30);
  for (int rep = 0; rep < reps; ++rep)
    for (size_t i = 0; i < std::size(rungs); ++i) {
      const Rung &r = rungs[i];
      Set &set = sets[i];
      best[i] = std::min(best[i], bestSeconds(1, [&] {
                           for (int e = 0; e < r.experts; ++e)
                             for (int call = 0; call < r.calls; ++call)
                               gemmTile(r.m, r.n, r.k,
                                        ConstMatrix{set.a[size_t(e)].data(), elt, r.k}, false,
                                        ConstMatrix{nullptr, elt, r.n}, false,
                                        Matrix{set.c.data(), r.cBf16 && bf16 ? Elt::BF16 : Elt::F32,
                                               r.n},
                                        false, &scratch, 1.0f, false, set.packed[size_t(e)].data());
                         }));
    }
  std::printf("GEMM: %s\n", gemmConfig());
  std::printf("where a %s tile's time goes: one thread, B packed beforehand, best of %d; "
              "the probe's peak %.1f GFLOP/s (%s)\n",
              bf16 ? "bf16" : "fp32", reps, peak->gflops, peak->isa);
  std::printf("  %-52s %10s %8s\n", "rung", "GFLOP/s", "of peak");
  for (size_t i = 0; i < std::size(rungs); ++i) {
    const Rung &r = rungs[i];
    const double rate = 2.0 * double(r.m * r.n * r.k) * r.experts * r.calls / best[i] * 1e-9;
    std::printf("  %-52s %10.1f %7.1f%%\n", r.name, rate, 100 * rate / peak->gflops);
  }
  return 0;
}

/// gmm_bench --sources: see the header.
int sourceRates(double seconds) {
  bool any = false;
  for (const bool bf16 : {false, true}) {
    const std::vector<SourceRate> rates = measureSourceRates(bf16, seconds);
    if (rates.empty())
      continue;
    const std::optional<FmaPeak> peak =
        bf16 ? measureBf16DotPeak(0.3) : std::optional<FmaPeak>(measureFmaPeak(0.3));
    std::printf("%s, one thread, the streamed operand from each level; the probe's peak %.1f "
                "GFLOP/s (%s)\n",
                bf16 ? "bf16 AMX tile dot products (2 x 2 tiles, 2 KiB of B a step)"
                     : "fp32 micro-kernel loop (8 x 48 FMAs, 192 bytes of B a unit)",
                peak->gflops, peak->isa);
    std::printf("  %-8s %12s %10s %8s %10s\n", "level", "buffer KiB", "GFLOP/s", "of peak", "GB/s");
    for (const SourceRate &r : rates)
      std::printf("  %-8s %12zu %10.1f %7.1f%% %10.1f\n", r.level.c_str(), r.bytes >> 10, r.gflops,
                  100 * r.gflops / peak->gflops, r.gbPerSecond);
    any = true;
  }
  if (!any) {
    std::fprintf(stderr, "gmm_bench --sources: this CPU has neither AVX-512 nor AMX\n");
    return 1;
  }
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf(
        "usage: gmm_bench [M N K [reps [experts]]]      one tile, fp32 and bf16, one thread\n"
        "       gmm_bench --layer [experts [reps [threads [tile]]]]  the qwen3 layer's tile "
        "shapes\n"
        "       gmm_bench --ladder [reps [bf16|f32]]    where a tile's time goes, rung by rung\n"
        "       gmm_bench --quantized [experts [reps]]  tiles whose B is a quantized weight\n"
        "       gmm_bench --dequantize [reps]           the dequantizer's rate, each format\n"
        "       gmm_bench --sources [seconds]           the inner loop's rate by where its operand "
        "lies\n"
        "The head of tools/bench/GmmBench.cpp says what each times. MOEC_GEMM (auto, moec,\n"
        "onednn) and MOEC_AMX (auto, off) choose the kernels (docs/runtime.md).\n");
    return 0;
  }
  if (argc >= 2 && std::string(argv[1]) == "--ladder") {
    const int reps = argc >= 3 ? std::atoi(argv[2]) : 5;
    const std::string type = argc >= 4 ? argv[3] : "bf16";
    if (reps <= 0 || (type != "bf16" && type != "f32")) {
      std::fprintf(stderr, "usage: gmm_bench --ladder [reps [bf16|f32]] (reps positive)\n");
      return 2;
    }
    return ladder(reps, type == "f32" ? Elt::F32 : Elt::BF16);
  }
  if (argc >= 2 && std::string(argv[1]) == "--sources") {
    const double seconds = argc >= 3 ? std::atof(argv[2]) : 0.3;
    if (!(seconds > 0)) {
      std::fprintf(stderr, "usage: gmm_bench --sources [seconds] (positive)\n");
      return 2;
    }
    return sourceRates(seconds);
  }
  if (argc >= 2 && std::string(argv[1]) == "--quantized") {
    const int experts = argc >= 3 ? std::atoi(argv[2]) : 16;
    const int reps = argc >= 4 ? std::atoi(argv[3]) : 5;
    if (experts <= 0 || reps <= 0) {
      std::fprintf(stderr, "usage: gmm_bench --quantized [experts [reps]] (positive)\n");
      return 2;
    }
    return quantizedTiles(experts, reps);
  }
  if (argc >= 2 && std::string(argv[1]) == "--dequantize")
    return dequantizeRates(argc >= 3 ? std::max(1, std::atoi(argv[2])) : 10);
  if (argc >= 2 && std::string(argv[1]) == "--layer") {
    const int experts = argc >= 3 ? std::atoi(argv[2]) : 32;
    const int reps = argc >= 4 ? std::atoi(argv[3]) : 3;
    const int threads = argc >= 5 ? std::atoi(argv[4]) : 1;
    const std::string only = argc >= 6 ? argv[5] : "";
    if (experts <= 0 || reps <= 0 || threads <= 0) {
      std::fprintf(stderr,
                   "usage: gmm_bench --layer [experts [reps [threads [tile]]]] (positive)\n");
      return 2;
    }
    if (!only.empty() && std::none_of(std::begin(kLayer), std::end(kLayer),
                                      [&](const Shape &s) { return only == s.name; })) {
      std::string names;
      for (const Shape &s : kLayer)
        names += std::string(names.empty() ? "" : ", ") + s.name;
      std::fprintf(stderr, "gmm_bench --layer: no tile named '%s' (the tiles: %s)\n", only.c_str(),
                   names.c_str());
      return 2;
    }
    return layerShapes(experts, reps, threads, only);
  }
  int64_t m = 512, n = 512, k = 512;
  int reps = 5;
  if (argc >= 4) {
    m = std::atoll(argv[1]);
    n = std::atoll(argv[2]);
    k = std::atoll(argv[3]);
  }
  int experts = 1;
  if (argc >= 5)
    reps = std::atoi(argv[4]);
  if (argc >= 6)
    experts = std::atoi(argv[5]);
  if (m <= 0 || n <= 0 || k <= 0 || reps <= 0 || experts <= 0) {
    std::fprintf(stderr, "usage: gmm_bench [M N K [reps [experts]]] (all positive)\n");
    return 2;
  }

  const GemmOperands operands = randomGemmOperands(m, n, k);
  const std::vector<float> &a = operands.a, &b = operands.b;
  const std::vector<uint16_t> &a16 = operands.a16, &b16 = operands.b16;
  std::vector<float> naive(size_t(m * n)), fast(size_t(m * n)), fast16(size_t(m * n));
  const double flops = 2.0 * double(m) * double(n) * double(k);

  std::printf("GEMM: %s\n", gemmConfig());
  std::printf("tile %lld x %lld x %lld, one thread, best of %d\n", (long long)m, (long long)n,
              (long long)k, reps);

  const double tNaive = bestSeconds(std::max(1, reps / 2), [&] {
    reference::matmul(m, n, k, a.data(), b.data(), naive.data());
  });
  Scratch scratch;
  const double tFast = bestSeconds(reps, [&] {
    gemmTile(m, n, k, ConstMatrix{a.data(), Elt::F32, k}, false,
             ConstMatrix{b.data(), Elt::F32, n}, false, Matrix{fast.data(), Elt::F32, n}, false,
             &scratch);
  });
  const double tBf16 = bestSeconds(reps, [&] {
    gemmTile(m, n, k, ConstMatrix{a16.data(), Elt::BF16, k}, false,
             ConstMatrix{b16.data(), Elt::BF16, n}, false, Matrix{fast16.data(), Elt::F32, n},
             false, &scratch);
  });

  std::printf("naive loop       %9.3f ms  %8.2f GFLOP/s\n", tNaive * 1e3, flops / tNaive * 1e-9);
  std::printf("gemmTile f32     %9.3f ms  %8.2f GFLOP/s  (max |diff| vs naive %.2e)\n",
              tFast * 1e3, flops / tFast * 1e-9, double(maxDiff(fast, naive)));
  std::printf("gemmTile bf16 in %9.3f ms  %8.2f GFLOP/s  (inputs rounded to bf16: max |diff| "
              "vs naive %.2e)\n",
              tBf16 * 1e3, flops / tBf16 * 1e-9, double(maxDiff(fast16, naive)));
  std::printf("speed-up f32 over naive: %.1fx\n", tNaive / tFast);
  if (experts > 1) {
    // Distinct operands per expert: A m x k and B k x n, in both storages.
    std::vector<GemmOperands> each;
    for (int e = 0; e < experts; ++e)
      each.push_back(randomGemmOperands(m, n, k));
    for (const bool bf16 : {false, true}) {
      const double t = bestSeconds(reps, [&] {
        for (const GemmOperands &x : each)
          gemmTile(m, n, k,
                   bf16 ? ConstMatrix{x.a16.data(), Elt::BF16, k}
                        : ConstMatrix{x.a.data(), Elt::F32, k},
                   false,
                   bf16 ? ConstMatrix{x.b16.data(), Elt::BF16, n}
                        : ConstMatrix{x.b.data(), Elt::F32, n},
                   false, Matrix{fast.data(), Elt::F32, n}, false, &scratch);
      });
      std::printf("%d experts %s  %9.3f ms  %8.2f GFLOP/s\n", experts, bf16 ? "bf16" : "f32 ",
                  t * 1e3, flops * experts / t * 1e-9);
    }
  }
  return 0;
}
