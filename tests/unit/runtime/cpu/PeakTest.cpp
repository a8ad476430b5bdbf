//===- PeakTest.cpp - Tests for the FMA peak measurement ------------------===//
//
// The reported instruction set agrees with its lane count and with what the
// CPU supports, the figure is a positive finite number, and sgemm on the
// same thread does not beat it by more than timing noise (a peak below what
// a real kernel reaches would be an underestimate).
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Peak.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Tile.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

using namespace moec::cpu;

TEST_CASE("FMA peak: consistent ISA, finite positive, not below sgemm", "[peak]") {
  const FmaPeak peak = measureFmaPeak(0.2);
  INFO("isa " << peak.isa << ", " << peak.lanes << " lanes, " << peak.gflops << " GFLOP/s in "
              << peak.seconds << " s");

  const std::string isa = peak.isa;
  if (isa == "avx512f")
    CHECK(peak.lanes == 16);
  else if (isa == "avx2+fma")
    CHECK(peak.lanes == 8);
  else
    CHECK((isa == "scalar" && peak.lanes == 1));

#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == "avx512f")
    CHECK(avx512);
  if (isa == "avx2+fma")
    CHECK(avx2);
  if (avx512 || avx2)
    CHECK(isa != "scalar");
#endif

  CHECK(std::isfinite(peak.gflops));
  CHECK(peak.gflops > 0);
  CHECK(peak.seconds >= 0.2);
  CHECK(peak.seconds < 2.0); // about 0.2 s; generous for a loaded machine

  // sgemm right after, best of a few calls: must stay under the peak, with
  // room for timing noise.
  const int64_t n = 512;
  std::vector<float> a(size_t(n * n), 0.5f), b(size_t(n * n), 0.25f), c(size_t(n * n));
  double best = 1e30;
  for (int rep = 0; rep < 8; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    gemmTile(n, n, n, ConstMatrix{a.data(), Elt::F32, n}, false, ConstMatrix{b.data(), Elt::F32, n},
             false, Matrix{c.data(), Elt::F32, n}, false);
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    best = std::min(best, took.count());
  }
  CHECK(c[0] == Approx(0.5 * 0.25 * n));
  const double gemm = 2.0 * double(n) * n * n / best * 1e-9;
  INFO("gemmTile 512^3: " << gemm << " GFLOP/s");
  CHECK(gemm <= 1.3 * peak.gflops);
}

TEST_CASE("bf16 dot-product peak: present exactly with avx512_bf16, not below bf16 GEMM",
          "[peak]") {
  const std::optional<FmaPeak> peak = measureBf16DotPeak(0.2);
  __builtin_cpu_init();
  const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  REQUIRE(peak.has_value() == has);
  if (!has)
    return;
  // The instructions the bf16 tile runs on: AMX tiles (16384 flops each, 8192
  // "lanes" of an FMA) where it uses them, else vdpbf16ps (32).
  if (tile::amx()) {
    CHECK(std::string(peak->isa) == "amx_bf16");
    CHECK(peak->lanes == 8192);
  } else {
    CHECK(std::string(peak->isa) == "avx512_bf16");
    CHECK(peak->lanes == 32);
  }
  CHECK(std::isfinite(peak->gflops));
  CHECK(peak->gflops > 0);
  // A bf16 tile on those instructions stays under their peak (with room for
  // noise), and the dot products beat plain fp32 FMAs.
  if (nativeBf16Gemm()) {
    const double gemm = measureGemmGflops(512, 512, 512, Elt::BF16, 0.2);
    INFO("bf16 gemmTile 512^3: " << gemm << " GFLOP/s, peak " << peak->gflops);
    CHECK(gemm <= 1.3 * peak->gflops);
  }
  CHECK(peak->gflops > measureFmaPeak(0.2).gflops);
}

TEST_CASE("clock check: the table's widths by core", "[peak]") {
  // AMD: Zen 5 (two 512-bit pipes), Zen 4 (a 512-bit op in two 256-bit
  // halves), Zen 3, Zen 2, Zen; a bf16 figure only with avx512_bf16.
  const ClockPeak zen5 = documentedWidth(true, false, 0x1A, 0x02, true, true, true);
  CHECK(zen5.fp32PerCycle == 64);
  CHECK(zen5.bf16PerCycle == 128);
  const ClockPeak zen4 = documentedWidth(true, false, 0x19, 0x11, true, true, true);
  CHECK(zen4.fp32PerCycle == 32);
  CHECK(zen4.bf16PerCycle == 64);
  CHECK(documentedWidth(true, false, 0x19, 0x11, true, true, false).bf16PerCycle == 0);
  const ClockPeak zen3 = documentedWidth(true, false, 0x19, 0x01, true, false, false);
  CHECK(zen3.fp32PerCycle == 32);
  CHECK(std::string(zen3.core).find("Zen 3") != std::string::npos);
  CHECK(documentedWidth(true, false, 0x17, 0x31, true, false, false).fp32PerCycle == 32);
  CHECK(documentedWidth(true, false, 0x17, 0x01, true, false, false).fp32PerCycle == 16);
  // Intel: the FMA units by instruction set; no bf16 figure.
  const ClockPeak intel = documentedWidth(false, true, 6, 0x8F, true, true, true);
  CHECK(intel.fp32PerCycle == 64);
  CHECK(intel.bf16PerCycle == 0);
  CHECK(documentedWidth(false, true, 6, 0x3C, true, false, false).fp32PerCycle == 32);
  // A core the table does not know: no figure, no name.
  const ClockPeak unknown = documentedWidth(true, false, 0x15, 0x02, true, false, false);
  CHECK(unknown.core == nullptr);
  CHECK(unknown.fp32PerCycle == 0);
  CHECK(documentedWidth(false, false, 6, 0x8F, true, true, true).core == nullptr);
}

TEST_CASE("clock check: a clock a core can have", "[peak]") {
  const ClockPeak c = measureClockPeak(0.05);
#if defined(__x86_64__)
  INFO("core clock " << c.ghz << " GHz, " << (c.core ? c.core : "unknown core"));
  // Dependent adds at one a cycle: a clock between 0.3 and 8 GHz (a broken
  // loop, one the compiler shortened, or a unit error lands outside).
  CHECK(c.ghz > 0.3);
  CHECK(c.ghz < 8.0);
  if (c.fp32PerCycle) {
    // The probe against clock x width, loosely: a part whose units are half
    // the table's (a 256-bit Zen 5) or a lower AVX-512 clock stays inside;
    // a clock off by a factor, or a table wrong by one, does not.
    const FmaPeak fp32 = measureFmaPeak(0.05);
    INFO("probe " << fp32.gflops << " GFLOP/s, clock x width " << c.fp32Gflops());
    CHECK(fp32.gflops > 0.3 * c.fp32Gflops());
    CHECK(fp32.gflops < 1.6 * c.fp32Gflops());
  }
#else
  CHECK(c.ghz == 0);
#endif
}

TEST_CASE("clock check: the text moec bench prints", "[peak]") {
  ClockPeak zen5 = documentedWidth(true, false, 0x1A, 0x02, true, true, true);
  zen5.ghz = 4.0; // 256 fp32 and 512 bf16 GFLOP/s
  const std::string agree = clockCheckText(zen5, 250.0, 510.0);
  INFO(agree);
  CHECK(agree.rfind("independent check: core clock 4.00 GHz", 0) == 0);
  CHECK(agree.find("AMD family 1Ah (Zen 5)") != std::string::npos);
  CHECK(agree.find("fp32 64 flops a cycle = 256.0 GFLOP/s, the probe 97.7% of it") !=
        std::string::npos);
  CHECK(agree.find("bf16 128 = 512.0 GFLOP/s, the probe 99.6%") != std::string::npos);
  CHECK(agree.find("warning") == std::string::npos);
  // A probe at half the figure (a part with 256-bit units): the warning.
  const std::string half = clockCheckText(zen5, 128.0, 256.0);
  CHECK(half.find("warning: the probe and the clock's figure differ by 50%") !=
        std::string::npos);
  // No bf16 probe: no bf16 figure. A core without a bf16 figure says so.
  CHECK(clockCheckText(zen5, 250.0, std::nullopt).find("bf16") == std::string::npos);
  ClockPeak intel = documentedWidth(false, true, 6, 0x8F, true, true, true);
  intel.ghz = 3.0;
  CHECK(clockCheckText(intel, 190.0, 380.0).find("no documented bf16 figure") !=
        std::string::npos);
  // A core the table does not know: the clock alone.
  ClockPeak unknown = documentedWidth(true, false, 0x15, 0x02, true, false, false);
  unknown.ghz = 3.5;
  const std::string none = clockCheckText(unknown, 100.0, std::nullopt);
  CHECK(none.find("3.50 GHz") != std::string::npos);
  CHECK(none.find("no documented flops a cycle for this core") != std::string::npos);
  // No clock (off x86): nothing.
  CHECK(clockCheckText(ClockPeak{}, 100.0, std::nullopt).empty());
}

TEST_CASE("the peak of several threads at once: their sum, each near one alone", "[peak]") {
  CHECK_FALSE(measurePeakTogether(0, false).has_value());
  const FmaPeak alone = measureFmaPeak(0.1);
  const std::optional<TogetherPeak> one = measurePeakTogether(1, false, 0.1);
  REQUIRE(one.has_value());
  CHECK(one->gflops == one->least);
  CHECK(one->gflops > 0.5 * alone.gflops);
  CHECK(one->gflops < 1.5 * alone.gflops);
  // Two threads sum two peaks, whatever the cores: on one core (or two
  // sharing a clock budget) each gets less than alone, never more than
  // alone with room for noise.
  const std::optional<TogetherPeak> two = measurePeakTogether(2, false, 0.1);
  REQUIRE(two.has_value());
  CHECK(two->least > 0);
  CHECK(two->gflops > 0.5 * alone.gflops);
  CHECK(two->gflops < 2 * 1.5 * alone.gflops);
  __builtin_cpu_init();
  const bool bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  CHECK(measurePeakTogether(2, true, 0.05).has_value() == bf16);
}

TEST_CASE("what threads read from memory at once: the sum of each one's, a buffer past the "
          "caches slower than one inside them",
          "[peak]") {
  CHECK_FALSE(measureMemoryRead(0).has_value());
  // Each thread's buffer: more than the L3 holds, shared out over the
  // threads, within bounds; many threads' buffers within a quarter of the
  // machine's memory.
  CHECK(memoryReadBytes(1) >= (size_t(64) << 20));
  CHECK(memoryReadBytes(1) <= (size_t(1) << 30));
  CHECK(memoryReadBytes(64) <= memoryReadBytes(1));
  const size_t machine = size_t(sysconf(_SC_PHYS_PAGES)) * size_t(sysconf(_SC_PAGESIZE));
  CHECK(size_t(4096) * memoryReadBytes(4096) <= machine / 4);
  CHECK(memoryReadBytes(4096) % 4096 == 0);
  CHECK_FALSE(measureMemoryRead(1, 0.01, 255).has_value());
  const std::optional<MemoryRead> memory = measureMemoryRead(1, 0.05, size_t(256) << 20);
  REQUIRE(memory.has_value());
  CHECK(memory->bytes == (size_t(256) << 20));
  CHECK(memory->gbPerSecond == memory->least);
  // Whole lines in four streams: the size rounded down to 256 bytes.
  const std::optional<MemoryRead> cached = measureMemoryRead(1, 0.05, (size_t(32) << 10) + 100);
  REQUIRE(cached.has_value());
  CHECK(cached->bytes == (size_t(32) << 10));
  INFO("memory " << memory->gbPerSecond << " GB/s, 32 KiB " << cached->gbPerSecond << " GB/s");
  CHECK(memory->gbPerSecond > 0.1);
  CHECK(cached->gbPerSecond > 1.5 * memory->gbPerSecond);
  const std::optional<MemoryRead> two = measureMemoryRead(2, 0.05, size_t(64) << 20);
  REQUIRE(two.has_value());
  CHECK(two->least > 0);
  CHECK(two->least <= two->gbPerSecond / 2);
}

TEST_CASE("the inner loop's rate by where its operand lies: where the kernel runs, levels in "
          "order, L1 near the peak",
          "[peak]") {
  for (const bool bf16 : {false, true}) {
    // Only the buffers up to 8 MiB (L1, L2), for a short test.
    const std::vector<SourceRate> rates = measureSourceRates(bf16, 0.05, size_t(8) << 20);
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const bool runs = bf16 ? tile::amx() : __builtin_cpu_supports("avx512f") != 0;
#else
    const bool runs = false;
#endif
    INFO((bf16 ? "AMX" : "fp32") << ", " << rates.size() << " levels");
    if (!runs) {
      CHECK(rates.empty());
      continue;
    }
    REQUIRE(!rates.empty());
    CHECK(rates[0].level == "L1");
    const std::optional<FmaPeak> peak =
        bf16 ? measureBf16DotPeak(0.1) : std::optional<FmaPeak>(measureFmaPeak(0.1));
    REQUIRE(peak);
    for (size_t i = 0; i < rates.size(); ++i) {
      INFO(rates[i].level << ": " << rates[i].bytes << " bytes, " << rates[i].gflops << " GFLOP/s, "
                          << rates[i].gbPerSecond << " GB/s; peak " << peak->gflops);
      CHECK(rates[i].bytes <= (size_t(8) << 20));
      if (i > 0)
        CHECK(rates[i].bytes > rates[i - 1].bytes);
      CHECK(rates[i].gflops > 0);
      // Not above the register-only peak (but for noise between the two
      // measurements); the flops a byte are the loop's own.
      CHECK(rates[i].gflops < 1.3 * peak->gflops);
      CHECK(rates[i].gflops / rates[i].gbPerSecond ==
            Approx(bf16 ? 4.0 * 16 * 16 * 32 * 2 / 2048 : 8.0 * 48 * 2 / 192));
    }
    // In L1 the loop runs near the peak (it measures 80-90% of it).
    CHECK(rates[0].gflops > 0.25 * peak->gflops);
  }
}
