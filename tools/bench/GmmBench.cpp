//===- GmmBench.cpp - Single-thread speed of the matmul tile kernel -------===//
//
// Times one M x N x K tile (default 512^3) on the calling thread: the naive
// triple loop (reference::matmul), then gemmTile with fp32 and with bf16
// operands, and prints GFLOP/s (2*M*N*K flops per call, best of `reps`) and
// the largest difference from the naive result.
//
//   bazel run //tools/bench:gmm_bench -- [M N K [reps]]
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Peak.h"
#include "runtime/tooling/Reference.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
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

} // namespace

int main(int argc, char **argv) {
  int64_t m = 512, n = 512, k = 512;
  int reps = 5;
  if (argc >= 4) {
    m = std::atoll(argv[1]);
    n = std::atoll(argv[2]);
    k = std::atoll(argv[3]);
  }
  if (argc >= 5)
    reps = std::atoi(argv[4]);
  if (m <= 0 || n <= 0 || k <= 0 || reps <= 0) {
    std::fprintf(stderr, "usage: gmm_bench [M N K [reps]] (all positive)\n");
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
  return 0;
}
