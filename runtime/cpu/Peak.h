//===- Peak.h - Measured peaks of one thread --------------------*- C++ -*-===//
//
// The denominator for "percent of peak" in matmul benchmarks: the fp32
// multiply-add throughput one thread of this machine actually sustains,
// measured rather than computed from a nominal clock and a table of core
// types (turbo, power limits and virtualisation make both unreliable).
//
// measureClockPeak gives a second opinion from other facts: a clock timed on
// dependent adds, times the flops a cycle the vendor documents for the
// core (a table of core families).
//
// The measurement runs independent chains of vector FMAs, acc = acc * m + c,
// entirely in registers: no loads, no stores, nothing that depends on
// memory. Each chain has to wait for its previous FMA (latency about 4
// cycles) while the core can start about two FMAs a cycle, so fewer than ~8
// chains leave the FMA units idle; the kernels run 8, 12 and 16 chains (14
// for AVX2, which has only 16 vector registers) and keep the best.
//
// The ISA is chosen at run time (__builtin_cpu_supports, which also checks
// that the OS saves the wide registers): the AVX-512 and AVX2+FMA kernels are
// compiled with function-level target attributes, so the file needs no
// global -m flags and runs on any x86-64. Both are measured where AVX-512 is
// available, because the wider one is not always faster: AMD Zen 4 executes
// a 512-bit FMA as two 256-bit halves, so both give the same flops per
// cycle, and a core that lowers its clock for AVX-512 can make it slower.
// The higher result wins: an underestimated peak would inflate every
// percentage computed from it. Without FMA (or off x86) a portable scalar
// loop is timed; that figure is only a floor.
//
// Timing: after a calibration that sizes one trial to a few milliseconds,
// the kernels are run in rounds, one trial of each per round (so a noisy
// moment on a shared machine does not favour one of them), until the time
// budget is spent. The best trial of all is reported.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_PEAK_H
#define MOEC_RUNTIME_CPU_PEAK_H

#include "runtime/cpu/Element.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moec::cpu {

/// The fp32 FMA throughput of one thread, as measureFmaPeak found it.
struct FmaPeak {
  /// The instruction set of the fastest kernel: "avx512f", "avx2+fma", or
  /// "scalar" (the portable fallback).
  const char *isa = "scalar";
  /// fp32 lanes per vector of that instruction set: 16, 8, or 1.
  int lanes = 1;
  /// Measured fp32 GFLOP/s of the calling thread; an FMA counts 2 flops per
  /// lane.
  double gflops = 0;
  /// Wall time the measurement took, in seconds.
  double seconds = 0;
};

/// Measures the fp32 FMA throughput of the calling thread: independent
/// chains of register-only vector FMAs (8, 12 and 16 accumulators; 14, not
/// 16, with AVX2) with every instruction set the CPU supports among
/// AVX-512F and AVX2+FMA, run for about `seconds` in repeated short trials
/// (at least one trial of each kernel, however small `seconds` is). Returns
/// the best trial over all kernels and the instruction set that achieved it.
/// Pin the thread and keep the machine otherwise idle for a meaningful
/// figure.
FmaPeak measureFmaPeak(double seconds = 0.2);

/// The same for bf16 dot products (avx512_bf16's vdpbf16ps: 2 products per
/// fp32 lane, 64 flops per instruction; `lanes` is 32 then), and, where the
/// bf16 tile runs on AMX (tile::amx()), AMX tile dot products (tdpbf16ps:
/// 16384 flops per instruction, `isa` "amx_bf16", `lanes` 8192): the peak
/// bf16 GMM tiles run against. Nothing without avx512_bf16.
std::optional<FmaPeak> measureBf16DotPeak(double seconds = 0.2);

/// What `threads` threads sustain together, each measuring as above (the
/// bf16 dot-product peak with `bf16`, else the fp32 FMA peak) at the same
/// time, started together: the sum of their peaks, in GFLOP/s, and the
/// smallest of them. On a machine whose cores share a power or clock
/// budget (a VM's, a socket's) the sum is under `threads` times one thread
/// alone; a share of "the N-core peak" is fairest against this sum. Nothing
/// for bf16 without avx512_bf16, or for no threads.
struct TogetherPeak {
  double gflops = 0; ///< the sum over the threads
  double least = 0;  ///< the smallest thread's
};
std::optional<TogetherPeak> measurePeakTogether(unsigned threads, bool bf16, double seconds = 0.3);

/// What `threads` threads read from memory together, the bound of a pass
/// whose operands stream from memory (a layer's weights, read once a pass):
/// each thread reads its own buffer of `bytes` (0: memoryReadBytes), whose
/// pages it writes first, a pass at a time with one load a 64-byte line
/// (the line is what memory moves), in one stream or in four side by side
/// (passes of each in turn: which moves more differs by core), the threads
/// started together, for about `seconds`. Sums each thread's fastest pass,
/// in GB/s (1e9 bytes); `least` is the slowest thread's. Nothing for no
/// threads, for a buffer under 256 bytes, or where the memory cannot be
/// had.
struct MemoryRead {
  double gbPerSecond = 0; ///< the sum over the threads
  double least = 0;       ///< the slowest thread's
  size_t bytes = 0;       ///< each thread's buffer
};
std::optional<MemoryRead> measureMemoryRead(unsigned threads, double seconds = 0.3,
                                            size_t bytes = 0);

/// measureMemoryRead's buffer a thread: twice the L3 the OS reports, shared
/// out over the threads, so that their buffers together are more than the
/// L3 holds; 64 MiB to 1 GiB, and all of them at most a quarter of the
/// machine's memory.
size_t memoryReadBytes(unsigned threads);

/// A second opinion on the measured peaks, from other facts than theirs:
/// the core's clock, timed on a chain of dependent register adds (one a
/// cycle on every x86-64 core, whatever its vector units), times the flops
/// a cycle the vendor documents for the core's FMA and bf16 dot-product
/// units. A measured peak well under it means the core runs its vector
/// units below the clock of its scalar code (a lower AVX-512 clock, a power
/// limit) or the table's assumption does not hold for this part; one well
/// over it, that the table is wrong. Either way the two disagree, and a
/// percentage of the measured peak says less.
struct ClockPeak {
  /// The measured clock of the calling thread's core; 0 off x86.
  double ghz = 0;
  /// What the table knows the core as and its vector units (null: a core
  /// the table does not know).
  const char *core = nullptr;
  const char *units = nullptr;
  /// Documented flops a cycle of one core: fp32 FMAs (2 per lane) and bf16
  /// dot products (4 per fp32 lane); 0 where unknown or absent.
  int fp32PerCycle = 0;
  int bf16PerCycle = 0;

  double fp32Gflops() const { return ghz * fp32PerCycle; }
  double bf16Gflops() const { return ghz * bf16PerCycle; }
};

/// The x86 vendor, family and model of the CPU (cpuid leaf 1 with its
/// extended fields), all zero/false off x86.
struct CpuSignature {
  bool amd = false, intel = false;
  unsigned family = 0, model = 0;
};
CpuSignature cpuSignature();

/// The table behind ClockPeak: what the vendor documents for a core of
/// this vendor, family and model with these instruction sets (its `ghz` 0).
ClockPeak documentedWidth(bool amd, bool intel, unsigned family, unsigned model, bool avx2Fma,
                          bool avx512f, bool avx512Bf16);

/// Measures the clock of the calling thread's core for about `seconds` (best
/// of short trials) and looks up its core in documentedWidth's table.
ClockPeak measureClockPeak(double seconds = 0.1);

/// What `moec bench` prints of the check: a line "independent check: core
/// clock ... GHz ..." with the clock's figures and the probe's shares of
/// them (`fp32Gflops`, and `bf16Gflops` where there is a bf16 probe), or
/// one that says the core is not in the table; then, when a share is off
/// by more than 10%, a line "warning: ...". Empty without a clock (off x86).
std::string clockCheckText(const ClockPeak &clock, double fp32Gflops,
                           std::optional<double> bf16Gflops);

/// How fast a GEMM's inner loop runs when the operand it streams comes from
/// one level of the memory system: the other operand stays in L1, the
/// streamed one is read once a pass over a buffer sized for the level, with
/// nothing reused from it. fp32: the AVX-512 micro-kernel's loop (8 rows of
/// A broadcast from L1 against 48 columns of B, 24 FMAs for 192 bytes of B
/// a unit); bf16 on AMX: a 2 x 2 block of tile dot products (four 16 x 16 x
/// 32 products for two A tiles in L1 and 2 KiB of B a step). Its L1 row is
/// the loop's own ceiling against the probe's register-only peak; the
/// others say how many bytes a second the products can take from each
/// level, hence how much reuse a tile needs there to run at the peak.
struct SourceRate {
  std::string level;      ///< "L1", "L2", "L3" or "memory"
  size_t bytes = 0;       ///< the streamed buffer
  double gflops = 0;      ///< best of the trials
  double gbPerSecond = 0; ///< the streamed operand's bytes read a second
};

/// The rates above for fp32 (a CPU with AVX-512) or, with `bf16`, AMX tiles
/// (tile::amx()); nothing where the CPU lacks the kernel. Buffers sized
/// from the caches the OS reports (sysconf): L1 a quarter of it (at most 16
/// KiB; A takes 16 KiB more), L2 half of it, L3 a quarter (at most 64 MiB;
/// no row where the L3 is under four L2s), memory four times the L3 (256
/// MiB to 1 GiB); none over `maxBytes`. About `seconds` a level.
std::vector<SourceRate> measureSourceRates(bool bf16, double seconds = 0.2,
                                           size_t maxBytes = size_t(1) << 30);

/// Random operands of an m x k by k x n product, uniform in [-1, 1), as
/// fp32 and rounded to bf16, for the matmul benchmarks.
struct GemmOperands {
  std::vector<float> a, b;
  std::vector<uint16_t> a16, b16;
};
GemmOperands randomGemmOperands(int64_t m, int64_t n, int64_t k);

/// Returns the best GFLOP/s of one gemmTile call, C[m, n] = A[m, k] B[k, n]
/// with A and B stored as `elt` and C as fp32, on the calling thread: best of
/// at least 5 calls, or of as many as fit in about `seconds`, after a
/// warm-up call.
double measureGemmGflops(int64_t m, int64_t n, int64_t k, Elt elt = Elt::F32,
                         double seconds = 0.3);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_PEAK_H
