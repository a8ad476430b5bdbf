//===- Profile.h - Where a pass's time goes, from its trace -----*- C++ -*-===//
//
// The profile of one traced pass (ContextOptions::trace): per op, its busy
// time (the sum of its task runs over every worker), the work it did
// (FLOPs of a GMM, bytes of a put or an element-wise op, counted on the
// rows the routing gave each tile), its rate per core and that rate's share
// of one core's peak; per worker, its busy and idle time in the task
// program; the waits of parked cores by event, with the ranks whose signals
// ended them; and the pass's host phases (prepare, tasks, finish). `moec
// run --profile` prints it; the torch op returns it (Layer.profile()).
//
// No MLIR/LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TOOLING_PROFILE_H
#define MOEC_RUNTIME_TOOLING_PROFILE_H

#include "runtime/api/Runtime.h"

#include <string>

namespace moec::tooling {

/// One core's peaks, in GFLOP/s, that an op's rate is a share of.
struct Peaks {
  double f32 = 0;  ///< fp32 FMA (cpu::measureFmaPeak)
  double bf16 = 0; ///< bf16 products where the CPU has them, else the fp32 peak
  std::string f32Isa, bf16Isa;
};

/// Measures this machine's Peaks (about `seconds` per probe).
Peaks measurePeaks(double seconds = 0.3);

/// The profile of the last traced `which` pass of `context` (tracing on; a
/// pass has run), as a table: its header names the pass, its wall time and
/// phases, the workers and the peaks. Errors: tracing off, no such pass.
Status profileText(const rt::Context &context, rt::TracedPass which, const Peaks &peaks,
                   std::string *out);

} // namespace moec::tooling

#endif // MOEC_RUNTIME_TOOLING_PROFILE_H
