//===- Peak.cpp - Measured peaks of one thread ----------------------------===//

#include "runtime/cpu/Peak.h"

#include "base/Time.h"
#include "runtime/cpu/Gmm.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOEC_PEAK_X86 1
#endif

namespace moec::cpu {

namespace {

/// Passes of all accumulators per loop iteration, so the loop's own counter
/// and branch are a small share of the instructions.
constexpr int kPasses = 4;

/// The chains run acc = acc * kMul + kAdd, which converges to 1 from any
/// start: values stay normal (no denormal slow path, no overflow).
constexpr float kMul = 0.999999f;
constexpr float kAdd = 1.0e-6f;

/// Receives the folded accumulators, so the chains cannot be optimised away.
volatile float sink;

/// A timed kernel: runs `iters` iterations of `chains` independent FMA
/// chains of `lanes` lanes each (kPasses FMAs per chain per iteration).
struct Kernel {
  const char *isa;
  int lanes;
  int chains;
  void (*run)(int64_t iters);
};

#ifdef MOEC_PEAK_X86

/// Folds the accumulators into `sink`.
template <int N> __attribute__((target("avx512f"))) void sinkAvx512(const __m512 (&acc)[N]) {
  __m512 sum = acc[0];
  for (int j = 1; j < N; ++j)
    sum = _mm512_add_ps(sum, acc[j]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0;
  for (float v : lanes)
    total += v;
  sink = total;
}

template <int N> __attribute__((target("avx512f"))) void runAvx512(int64_t iters) {
  __m512 acc[N];
  for (int j = 0; j < N; ++j)
    acc[j] = _mm512_set1_ps(float(j + 2));
  const __m512 mul = _mm512_set1_ps(kMul);
  const __m512 add = _mm512_set1_ps(kAdd);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 64
    for (int p = 0; p < kPasses * N; ++p)
      acc[p % N] = _mm512_fmadd_ps(acc[p % N], mul, add);
  }
  sinkAvx512(acc);
}

template <int N> __attribute__((target("avx2,fma"))) void runAvx2(int64_t iters) {
  __m256 acc[N];
  for (int j = 0; j < N; ++j)
    acc[j] = _mm256_set1_ps(float(j + 2));
  const __m256 mul = _mm256_set1_ps(kMul);
  const __m256 add = _mm256_set1_ps(kAdd);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 64
    for (int p = 0; p < kPasses * N; ++p)
      acc[p % N] = _mm256_fmadd_ps(acc[p % N], mul, add);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < N; ++j)
    sum = _mm256_add_ps(sum, acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0;
  for (float v : lanes)
    total += v;
  sink = total;
}

/// bf16 dot products (vdpbf16ps): each adds 16 lanes x 2 bf16 products to
/// fp32 accumulators, 64 flops; the Kernel counts it as 32 "lanes" of one
/// FMA. Small products keep the sums normal and far from overflow.
template <int N> __attribute__((target("avx512f,avx512bf16"))) void runAvx512Bf16(int64_t iters) {
  __m512 acc[N];
  for (int j = 0; j < N; ++j)
    acc[j] = _mm512_set1_ps(float(j + 2));
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 64
    for (int p = 0; p < kPasses * N; ++p)
      acc[p % N] = _mm512_dpbf16_ps(acc[p % N], x, x);
  }
  sinkAvx512(acc);
}

#endif // MOEC_PEAK_X86

/// The portable fallback: a multiply and an add per step (2 flops, whether
/// or not the compiler fuses or vectorises them).
template <int N> void runScalar(int64_t iters) {
  float acc[N];
  for (int j = 0; j < N; ++j)
    acc[j] = float(j + 2);
  for (int64_t i = 0; i < iters; ++i) {
    for (int p = 0; p < kPasses; ++p)
      for (int j = 0; j < N; ++j)
        acc[j] = acc[j] * kMul + kAdd;
  }
  float total = 0;
  for (float v : acc)
    total += v;
  sink = total;
}

/// The kernels this CPU can run, widest first.
std::vector<Kernel> supportedKernels() {
  std::vector<Kernel> kernels;
#ifdef MOEC_PEAK_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    kernels.push_back({"avx512f", 16, 8, runAvx512<8>});
    kernels.push_back({"avx512f", 16, 12, runAvx512<12>});
    kernels.push_back({"avx512f", 16, 16, runAvx512<16>});
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    // 16 ymm registers: 14 chains plus the two constants fill them.
    kernels.push_back({"avx2+fma", 8, 8, runAvx2<8>});
    kernels.push_back({"avx2+fma", 8, 12, runAvx2<12>});
    kernels.push_back({"avx2+fma", 8, 14, runAvx2<14>});
  }
#endif
  if (kernels.empty()) {
    kernels.push_back({"scalar", 1, 8, runScalar<8>});
    kernels.push_back({"scalar", 1, 16, runScalar<16>});
  }
  return kernels;
}

/// The bf16 dot-product kernels this CPU can run (none without avx512_bf16).
std::vector<Kernel> bf16Kernels() {
  std::vector<Kernel> kernels;
#ifdef MOEC_PEAK_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")) {
    kernels.push_back({"avx512_bf16", 32, 8, runAvx512Bf16<8>});
    kernels.push_back({"avx512_bf16", 32, 12, runAvx512Bf16<12>});
    kernels.push_back({"avx512_bf16", 32, 16, runAvx512Bf16<16>});
  }
#endif
  return kernels;
}

/// Times one trial of `kernel`; returns seconds.
double timeTrial(const Kernel &kernel, int64_t iters) {
  const auto start = Clock::now();
  kernel.run(iters);
  return secondsSince(start);
}

/// Flops of one trial: 2 per lane per FMA.
double trialFlops(const Kernel &kernel, int64_t iters) {
  return 2.0 * kernel.lanes * kernel.chains * kPasses * double(iters);
}

/// Times `kernels` in rounds for about `seconds`; the best of all trials.
FmaPeak measureKernels(const std::vector<Kernel> &kernels, double seconds) {
  const auto start = Clock::now();
  const double budget = std::max(seconds, 0.0);

  // Some ten rounds in the budget, but no trial so short that the clock's
  // resolution matters or so long that one interruption spoils many.
  const double target = std::clamp(budget / (10.0 * double(kernels.size())), 2e-4, 2e-2);

  std::vector<int64_t> iters(kernels.size());
  std::vector<double> best(kernels.size(), 0.0); // flops per second
  auto record = [&](size_t k, double took) {
    if (took > 0)
      best[k] = std::max(best[k], trialFlops(kernels[k], iters[k]) / took);
  };

  // Calibration (also the warm-up): grow each kernel's trial until it takes
  // at least half the target, then scale it to the target.
  for (size_t k = 0; k < kernels.size(); ++k) {
    iters[k] = 16;
    double took = timeTrial(kernels[k], iters[k]);
    while (took < target / 2 && iters[k] < (int64_t(1) << 40)) {
      iters[k] *= 2;
      took = timeTrial(kernels[k], iters[k]);
    }
    record(k, took);
    if (took > 0)
      iters[k] = std::max<int64_t>(1, int64_t(double(iters[k]) * target / took));
  }

  // Rounds of one trial per kernel until the budget is spent.
  do {
    for (size_t k = 0; k < kernels.size(); ++k)
      record(k, timeTrial(kernels[k], iters[k]));
  } while (secondsSince(start) < budget);

  FmaPeak peak;
  peak.isa = kernels.front().isa;
  peak.lanes = kernels.front().lanes;
  for (size_t k = 0; k < kernels.size(); ++k) {
    if (best[k] * 1e-9 > peak.gflops) {
      peak.isa = kernels[k].isa;
      peak.lanes = kernels[k].lanes;
      peak.gflops = best[k] * 1e-9;
    }
  }
  peak.seconds = secondsSince(start);
  return peak;
}

} // namespace

FmaPeak measureFmaPeak(double seconds) { return measureKernels(supportedKernels(), seconds); }

std::optional<FmaPeak> measureBf16DotPeak(double seconds) {
  const std::vector<Kernel> kernels = bf16Kernels();
  if (kernels.empty())
    return std::nullopt;
  return measureKernels(kernels, seconds);
}

GemmOperands randomGemmOperands(int64_t m, int64_t n, int64_t k) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  GemmOperands o;
  o.a.resize(size_t(m * k));
  o.b.resize(size_t(k * n));
  for (float &v : o.a)
    v = dist(rng);
  for (float &v : o.b)
    v = dist(rng);
  o.a16.resize(o.a.size());
  o.b16.resize(o.b.size());
  floatToBf16(o.a.data(), o.a16.data(), o.a.size());
  floatToBf16(o.b.data(), o.b16.data(), o.b.size());
  return o;
}

double measureGemmGflops(int64_t m, int64_t n, int64_t k, Elt elt, double seconds) {
  const GemmOperands o = randomGemmOperands(m, n, k);
  std::vector<float> c(size_t(m * n));
  const bool bf16 = elt == Elt::BF16;
  const ConstMatrix am{bf16 ? static_cast<const void *>(o.a16.data()) : o.a.data(), elt, k};
  const ConstMatrix bm{bf16 ? static_cast<const void *>(o.b16.data()) : o.b.data(), elt, n};
  Scratch scratch;
  auto call = [&] { gemmTile(m, n, k, am, false, bm, false, Matrix{c.data(), Elt::F32, n}, false, &scratch); };
  call(); // warm-up: GEMM set-up (JIT kernels), page faults, scratch

  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  double best = 1e30;
  for (int rep = 0;; ++rep) {
    const auto start = Clock::now();
    call();
    const auto end = Clock::now();
    best = std::min(best, std::chrono::duration<double>(end - start).count());
    if (rep + 1 >= 5 && std::chrono::duration<double>(end - begin).count() > seconds)
      break;
  }
  return 2.0 * double(m) * double(n) * double(k) / best * 1e-9;
}

} // namespace moec::cpu
