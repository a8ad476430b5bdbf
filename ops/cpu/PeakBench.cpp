//===- PeakBench.cpp - gemmTile as a share of the FMA peak -----------------===//
//
// Measures the fp32 FMA peak of one thread (measureFmaPeak, for `seconds`,
// default 0.5), then times single-thread fp32 gemmTile on a few shapes (best
// of at least 5 calls, or of as many as fit in about 0.3 s) and prints each
// as GFLOP/s and as a percentage of that peak.
//
//   bazel run //ops/cpu:peak_bench -- [seconds]
//
//===----------------------------------------------------------------------===//

#include "ops/cpu/Gmm.h"
#include "ops/cpu/Peak.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

using namespace moec::ops;

namespace {

/// Returns the best GFLOP/s of fp32 C = A B (m x k times k x n) on this
/// thread.
double gemmGflops(int64_t m, int64_t n, int64_t k) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> a(size_t(m * k)), b(size_t(k * n)), c(size_t(m * n));
  for (float &v : a)
    v = dist(rng);
  for (float &v : b)
    v = dist(rng);
  auto call = [&] {
    gemmTile(m, n, k, ConstMatrix{a.data(), Elt::F32, k}, false, ConstMatrix{b.data(), Elt::F32, n},
             false, Matrix{c.data(), Elt::F32, n}, false);
  };
  call(); // warm-up: BLAS set-up, page faults

  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  double best = 1e30;
  for (int rep = 0;; ++rep) {
    const auto start = Clock::now();
    call();
    const auto end = Clock::now();
    best = std::min(best, std::chrono::duration<double>(end - start).count());
    if (rep + 1 >= 5 && std::chrono::duration<double>(end - begin).count() > 0.3)
      break;
  }
  return 2.0 * double(m) * double(n) * double(k) / best * 1e-9;
}

} // namespace

int main(int argc, char **argv) {
  double seconds = 0.5;
  if (argc >= 2)
    seconds = std::atof(argv[1]);
  if (argc > 2 || !(seconds > 0)) {
    std::fprintf(stderr, "usage: peak_bench [seconds] (positive)\n");
    return 2;
  }

  const FmaPeak peak = measureFmaPeak(seconds);
  std::printf("fp32 FMA peak, one thread: %.1f GFLOP/s (%s, %d lanes; measured in %.2f s)\n",
              peak.gflops, peak.isa, peak.lanes, peak.seconds);

  struct Shape {
    int64_t m, n, k;
  };
  for (const Shape &s : {Shape{512, 512, 512}, Shape{1024, 1024, 1024}, Shape{2048, 2048, 512}}) {
    const double gflops = gemmGflops(s.m, s.n, s.k);
    std::printf("gemmTile f32 %5lld x %5lld x %5lld  %8.1f GFLOP/s  %5.1f%% of peak\n",
                (long long)s.m, (long long)s.n, (long long)s.k, gflops,
                100.0 * gflops / peak.gflops);
  }
  return 0;
}
