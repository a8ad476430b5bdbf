//===- Peak.cpp - Measured peaks of one thread ----------------------------===//

#include "runtime/cpu/Peak.h"

#include "base/Memory.h"
#include "base/Time.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Tile.h"
#include "runtime/cpu/TilePack.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOEC_PEAK_X86 1
#endif
#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
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

/// AMX tile dot products (tdpbf16ps): each adds a 16 x 16 block of fp32
/// sums of 32 bf16 products, 16384 flops; the Kernel counts it as 8192
/// "lanes" of one FMA. N accumulator tiles (at most 6), A and B in the last
/// two registers, small values as above.
template <int N>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void runAmxBf16(int64_t iters) {
  static_assert(N >= 1 && N <= 6, "tiles 6 and 7 hold A and B");
  alignas(64) uint16_t values[16 * 32];
  std::fill(std::begin(values), std::end(values), uint16_t(0x3A83)); // about 1e-3
  alignas(64) float out[16 * 16];
  tile::detail::configureAmxTiles();
  _tile_loadd(6, values, 64);
  _tile_loadd(7, values, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 24
    for (int p = 0; p < kPasses; ++p) {
      _tile_dpbf16ps(0, 6, 7);
      if constexpr (N > 1)
        _tile_dpbf16ps(1, 6, 7);
      if constexpr (N > 2)
        _tile_dpbf16ps(2, 6, 7);
      if constexpr (N > 3)
        _tile_dpbf16ps(3, 6, 7);
      if constexpr (N > 4)
        _tile_dpbf16ps(4, 6, 7);
      if constexpr (N > 5)
        _tile_dpbf16ps(5, 6, 7);
    }
  }
  _tile_stored(0, out, 64);
  _tile_release();
  sink = out[0];
}

/// measureSourceRates' fp32 loop: `units` units of the micro-kernel's loop,
/// A's 8 rows (512 units each, 2 KiB apart) from `a`, B's 192 bytes a unit
/// from `b` on, wrapping at `bytes` (a multiple of 192).
__attribute__((target("avx512f"))) void streamFp32(const float *a, const char *b, size_t bytes,
                                                   int64_t units) {
  __m512 acc[8][3];
  for (auto &row : acc)
    for (__m512 &v : row)
      v = _mm512_setzero_ps();
  size_t at = 0;
  for (int64_t t = 0; t < units; ++t) {
    const float *panel = reinterpret_cast<const float *>(b + at);
    const __m512 b0 = _mm512_load_ps(panel), b1 = _mm512_load_ps(panel + 16),
                 b2 = _mm512_load_ps(panel + 32);
    const int64_t unit = t & 511;
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * 512 + unit]);
      acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
    }
    at += 192;
    if (at == bytes)
      at = 0;
  }
  __m512 sum = _mm512_setzero_ps();
  for (auto &row : acc)
    for (__m512 &v : row)
      sum = _mm512_add_ps(sum, v);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  sink = lanes[0];
}

/// measureSourceRates' AMX loop: `steps` steps of a 2 x 2 block, A's two
/// tiles from `a` (2 KiB), B's two tiles (2 KiB) from `b` on, wrapping at
/// `bytes` (a multiple of 2 KiB).
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void streamAmx(const char *a, const char *b,
                                                                    size_t bytes, int64_t steps) {
  alignas(64) float out[16 * 16];
  tile::detail::configureAmxTiles();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  size_t at = 0;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b + at, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + at + 1024, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 1024, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    at += 2048;
    if (at == bytes)
      at = 0;
  }
  _tile_stored(0, out, 64);
  _tile_release();
  sink = out[0];
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

/// The bf16 dot-product kernels this CPU can run (none without avx512_bf16):
/// vdpbf16ps, and AMX tiles where the bf16 tile runs on them (tile::amx()).
std::vector<Kernel> bf16Kernels() {
  std::vector<Kernel> kernels;
#ifdef MOEC_PEAK_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16")) {
    kernels.push_back({"avx512_bf16", 32, 8, runAvx512Bf16<8>});
    kernels.push_back({"avx512_bf16", 32, 12, runAvx512Bf16<12>});
    kernels.push_back({"avx512_bf16", 32, 16, runAvx512Bf16<16>});
  }
  if (tile::amx()) {
    kernels.push_back({"amx_bf16", 8192, 4, runAmxBf16<4>});
    kernels.push_back({"amx_bf16", 8192, 6, runAmxBf16<6>});
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

namespace {

/// Runs prepare(t), then measure(t) on `threads` threads (the calling one
/// is thread 0), every measure starting once every prepare has ended, so
/// that their trials overlap. False where a thread could not be started
/// (then the started ones still run).
template <typename Prepare, typename Measure>
bool runTogether(unsigned threads, Prepare prepare, Measure measure) {
  std::atomic<unsigned> ready{0};
  const auto run = [&](unsigned t) {
    prepare(t);
    ready.fetch_add(1);
    while (ready.load() < threads)
      std::this_thread::yield();
    measure(t);
  };
  std::vector<std::thread> others;
  for (unsigned t = 1; t < threads; ++t) {
    try {
      others.emplace_back(run, t);
    } catch (const std::system_error &) {
      ready.fetch_add(threads - t); // the missing ones: nobody waits for them
      break;
    }
  }
  run(0);
  for (std::thread &x : others)
    x.join();
  return others.size() + 1 == threads;
}

} // namespace

std::optional<TogetherPeak> measurePeakTogether(unsigned threads, bool bf16, double seconds) {
  const std::vector<Kernel> kernels = bf16 ? bf16Kernels() : supportedKernels();
  if (kernels.empty() || threads == 0)
    return std::nullopt;
  std::vector<double> gflops(threads, 0.0);
  if (!runTogether(threads, [](unsigned) {}, [&](unsigned t) {
        gflops[t] = measureKernels(kernels, seconds).gflops;
      }))
    return std::nullopt;
  TogetherPeak peak;
  peak.least = gflops[0];
  for (double g : gflops) {
    peak.gflops += g;
    peak.least = std::min(peak.least, g);
  }
  return peak;
}

namespace {

/// One pass of measureMemoryRead over `bytes` (whole lines) in `streams`
/// equal parts read side by side, a load a line; the loads' sum, so that
/// they are not left out.
uint64_t readLines(const char *b, size_t bytes, int streams) {
  const size_t lines = bytes / 64 / size_t(streams);
  uint64_t sum[4] = {0, 0, 0, 0};
  for (size_t l = 0; l < lines; ++l)
    for (int s = 0; s < streams; ++s)
      sum[s] += *reinterpret_cast<const volatile uint64_t *>(b + (size_t(s) * lines + l) * 64);
  return sum[0] + sum[1] + sum[2] + sum[3];
}

} // namespace

size_t memoryReadBytes(unsigned threads) {
  threads = std::max(1u, threads);
  long l3 = -1, pages = -1, pageBytes = -1;
#if defined(__unix__)
#if defined(_SC_LEVEL3_CACHE_SIZE)
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  pages = sysconf(_SC_PHYS_PAGES);
  pageBytes = sysconf(_SC_PAGESIZE);
#endif
  const size_t total = 2 * (l3 > 0 ? size_t(l3) : size_t(32) << 20);
  size_t each = std::clamp<size_t>(total / threads, size_t(64) << 20, size_t(1) << 30);
  // All of them at most a quarter of the machine's memory (many threads).
  if (pages > 0 && pageBytes > 0)
    each = std::min(each, size_t(pages) / 4 * size_t(pageBytes) / threads);
  return each / 4096 * 4096;
}

std::optional<MemoryRead> measureMemoryRead(unsigned threads, double seconds, size_t bytes) {
  if (threads == 0)
    return std::nullopt;
  if (bytes == 0)
    bytes = memoryReadBytes(threads);
  if (bytes < 256)
    return std::nullopt;
  bytes = bytes / 256 * 256; // whole lines in four streams
  std::vector<double> best(threads, 0.0);
  std::vector<ZeroedPages> buffers(threads);
  std::atomic<bool> failed{false};
  std::atomic<uint64_t> sink{0};
  const auto prepare = [&](unsigned t) {
    buffers[t] = ZeroedPages(bytes);
    char *b = static_cast<char *>(buffers[t].data());
    if (!b) {
      failed = true;
      return;
    }
#if defined(MADV_HUGEPAGE)
    // Fewer page faults to write it (a hint: refused, the pages stay small).
    ::madvise(b, bytes, MADV_HUGEPAGE);
#endif
    std::memset(b, 1, bytes);
  };
  const auto measure = [&](unsigned t) {
    if (failed)
      return;
    const char *b = static_cast<const char *>(buffers[t].data());
    uint64_t sum = 0;
    const auto begin = Clock::now();
    for (int pass = 0; pass < 4 || secondsSince(begin) < seconds; ++pass) {
      const auto start = Clock::now();
      sum += readLines(b, bytes, pass % 2 ? 4 : 1);
      best[t] = std::max(best[t], double(bytes) / secondsSince(start) * 1e-9);
    }
    sink += sum;
  };
  if (!runTogether(threads, prepare, measure) || failed)
    return std::nullopt;
  MemoryRead read;
  read.bytes = bytes;
  read.least = best[0];
  for (double g : best) {
    read.gbPerSecond += g;
    read.least = std::min(read.least, g);
  }
  return read;
}

ClockPeak documentedWidth(bool amd, bool intel, unsigned family, unsigned model, bool avx2Fma,
                          bool avx512f, bool avx512Bf16) {
  ClockPeak c;
  auto set = [&](const char *core, const char *units, int fp32, int bf16) {
    c.core = core;
    c.units = units;
    c.fp32PerCycle = fp32;
    c.bf16PerCycle = avx512Bf16 ? bf16 : 0;
  };
  // A bf16 dot product is 4 flops per fp32 lane: two products, two sums.
  if (amd && family == 0x1A && avx512f)
    set("AMD family 1Ah (Zen 5)", "two 512-bit FMA pipes", 64, 128);
  else if (amd && family == 0x19 && avx512f)
    set("AMD family 19h (Zen 4)", "two 256-bit FMA pipes, a 512-bit op in two halves", 32, 64);
  else if (amd && family == 0x19 && avx2Fma)
    set("AMD family 19h (Zen 3)", "two 256-bit FMA pipes", 32, 0);
  else if (amd && family == 0x17 && model >= 0x30 && avx2Fma)
    set("AMD family 17h (Zen 2)", "two 256-bit FMA pipes", 32, 0);
  else if (amd && family == 0x17 && avx2Fma)
    set("AMD family 17h (Zen, Zen+)", "two 128-bit FMA pipes", 16, 0);
  else if (intel && family == 6 && avx512f)
    // Its bf16 dot-product rate is not in the table.
    set("Intel family 6 with AVX-512", "two 512-bit FMA units", 64, 0);
  else if (intel && family == 6 && avx2Fma)
    set("Intel family 6 with AVX2", "two 256-bit FMA units", 32, 0);
  return c;
}

#if defined(__x86_64__)
namespace {

/// 16 x `iters` adds of a register to itself, each waiting for the one
/// before: one cycle each, so the loop takes 16 x `iters` cycles.
__attribute__((noinline)) uint64_t addChain(int64_t iters) {
  uint64_t x = 1;
  asm volatile("1:\n\t"
               ".rept 16\n\t"
               "add %0, %0\n\t"
               ".endr\n\t"
               "dec %1\n\t"
               "jnz 1b"
               : "+r"(x), "+r"(iters)
               :
               : "cc");
  return x;
}

} // namespace
#endif

CpuSignature cpuSignature() {
  CpuSignature cpu;
#if defined(__x86_64__)
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
  cpu.family = (eax >> 8) & 0xF;
  cpu.model = (eax >> 4) & 0xF;
  if (cpu.family == 0xF)
    cpu.family += (eax >> 20) & 0xFF;
  if (cpu.family == 0x6 || cpu.family >= 0xF)
    cpu.model |= ((eax >> 16) & 0xF) << 4;
  cpu.amd = __builtin_cpu_is("amd");
  cpu.intel = __builtin_cpu_is("intel");
#endif
  return cpu;
}

ClockPeak measureClockPeak(double seconds) {
  ClockPeak c;
#if defined(__x86_64__)
  const CpuSignature cpu = cpuSignature();
  c = documentedWidth(cpu.amd, cpu.intel, cpu.family, cpu.model,
                      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                      __builtin_cpu_supports("avx512f"),
                      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"));
  // Trials of about a millisecond, the fastest of them: the clock the core
  // reaches, as the FMA probe reports the best of its trials.
  const auto start = Clock::now();
  int64_t iters = 1024;
  while (true) {
    const auto t0 = Clock::now();
    addChain(iters);
    const double took = secondsSince(t0);
    if (took < 5e-4) {
      iters *= 2;
      continue;
    }
    c.ghz = std::max(c.ghz, 16.0 * double(iters) / took * 1e-9);
    if (secondsSince(start) >= seconds)
      break;
  }
#else
  (void)seconds;
#endif
  return c;
}

std::string clockCheckText(const ClockPeak &clock, double fp32Gflops,
                           std::optional<double> bf16Gflops) {
  if (clock.ghz <= 0)
    return "";
  char buffer[512];
  std::string text;
  auto add = [&](const char *format, auto... values) {
    std::snprintf(buffer, sizeof buffer, format, values...);
    text += buffer;
  };
  add("independent check: core clock %.2f GHz (a chain of dependent adds)", clock.ghz);
  if (!clock.core || clock.fp32PerCycle == 0) {
    text += "; no documented flops a cycle for this core, so no check of the peaks\n";
    return text;
  }
  add("; %s, %s: fp32 %d flops a cycle = %.1f GFLOP/s, the probe %.1f%% of it", clock.core,
      clock.units, clock.fp32PerCycle, clock.fp32Gflops(),
      100.0 * fp32Gflops / clock.fp32Gflops());
  double worst = std::abs(fp32Gflops / clock.fp32Gflops() - 1);
  if (bf16Gflops && clock.bf16PerCycle) {
    add("; bf16 %d = %.1f GFLOP/s, the probe %.1f%%", clock.bf16PerCycle, clock.bf16Gflops(),
        100.0 * *bf16Gflops / clock.bf16Gflops());
    worst = std::max(worst, std::abs(*bf16Gflops / clock.bf16Gflops() - 1));
  } else if (bf16Gflops) {
    text += "; no documented bf16 figure for this core";
  }
  text += "\n";
  if (worst > 0.1)
    add("warning: the probe and the clock's figure differ by %.0f%%: the core runs its vector "
        "units at another clock than its scalar code (an AVX-512 clock, a power limit), or this "
        "part's units are not the table's; shares of the peak below are of the probe's "
        "figure\n",
        100.0 * worst);
  return text;
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

std::vector<SourceRate> measureSourceRates(bool bf16, double seconds, size_t maxBytes) {
  std::vector<SourceRate> rates;
#ifdef MOEC_PEAK_X86
  __builtin_cpu_init();
  if (bf16 ? !tile::amx() : !__builtin_cpu_supports("avx512f"))
    return rates;
  // Bytes of the streamed operand a unit (fp32) or step (AMX), and flops.
  const size_t chunk = bf16 ? 2048 : 192;
  const double flops = bf16 ? 4.0 * 16 * 16 * 32 * 2 : 8.0 * 48 * 2;
  const auto cache = [](int name, size_t fallback) {
    const long v = sysconf(name);
    return v > 0 ? size_t(v) : fallback;
  };
  const size_t l1 = cache(_SC_LEVEL1_DCACHE_SIZE, 32 << 10),
               l2 = cache(_SC_LEVEL2_CACHE_SIZE, 1 << 20),
               l3 = cache(_SC_LEVEL3_CACHE_SIZE, 32 << 20);
  std::vector<std::pair<const char *, size_t>> levels = {{"L1", std::min<size_t>(16 << 10, l1 / 4)},
                                                         {"L2", l2 / 2}};
  if (l3 >= 4 * l2)
    levels.push_back({"L3", std::min<size_t>(l3 / 4, 64 << 20)});
  levels.push_back({"memory", std::clamp<size_t>(4 * l3, 256 << 20, size_t(1) << 30)});
  // A: AMX's two tiles, or the fp32 loop's 8 rows of 512 values (16 KiB),
  // on whole lines.
  struct alignas(64) Rows {
    float v[8 * 512];
  };
  const std::unique_ptr<Rows> a(new Rows);
  std::fill(std::begin(a->v), std::end(a->v), 1e-3f);
  for (const auto &[level, want] : levels) {
    const size_t bytes = std::max(chunk, want / chunk * chunk);
    if (bytes > maxBytes)
      continue;
    std::unique_ptr<char, decltype(&std::free)> b(
        static_cast<char *>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)), &std::free);
    if (!b)
      continue;
    // Small values (bf16 1e-3, fp32 1e-3): sums stay normal.
    for (size_t i = 0; i < bytes; i += 2)
      std::memcpy(b.get() + i, "\x83\x3A", 2);
    // A trial: at least one pass over the buffer and some 5 ms.
    const int64_t perPass = int64_t(bytes / chunk);
    auto run = [&](int64_t n) {
      if (bf16)
        streamAmx(reinterpret_cast<const char *>(a->v), b.get(), bytes, n);
      else
        streamFp32(a->v, b.get(), bytes, n);
    };
    run(perPass); // the first touch, and the caches' state for the level
    int64_t n = std::max<int64_t>(perPass, 1024);
    for (;;) {
      const auto start = Clock::now();
      run(n);
      if (secondsSince(start) >= 5e-3 || n >= (int64_t(1) << 40))
        break;
      n *= 2;
    }
    n = (n + perPass - 1) / perPass * perPass;
    double best = 1e30;
    const auto begin = Clock::now();
    do {
      const auto start = Clock::now();
      run(n);
      best = std::min(best, secondsSince(start));
    } while (secondsSince(begin) < seconds);
    SourceRate r;
    r.level = level;
    r.bytes = bytes;
    r.gflops = flops * double(n) / best * 1e-9;
    r.gbPerSecond = double(chunk) * double(n) / best * 1e-9;
    rates.push_back(r);
  }
#else
  (void)bf16;
  (void)seconds;
  (void)maxBytes;
#endif
  return rates;
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
