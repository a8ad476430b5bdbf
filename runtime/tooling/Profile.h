//===- Profile.h - Where a pass's time goes, from its trace -----*- C++ -*-===//
//
// The profile of one traced pass (ContextOptions::trace): per op, its busy
// time (the sum of its task runs over every worker), the work it did
// (FLOPs of a GMM, bytes of a put or an element-wise op, counted on the
// rows the routing gave each tile), its rate per core and that rate's share
// of one core's peak; per worker, its busy and idle time in the task
// program and its time off its core during task runs (TaskSpan::offCoreNs:
// the OS ran something else there); the task runs that took far longer than their op's others for
// their work (slowTasks); the waits of parked cores by event, with the ranks
// whose signals ended them; and the pass's host phases (prepare, tasks,
// finish). `moec run --profile` prints it; the torch op returns it
// (Layer.profile()).
//
// No MLIR/LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TOOLING_PROFILE_H
#define MOEC_RUNTIME_TOOLING_PROFILE_H

#include "runtime/api/Runtime.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moec::tooling {

/// One core's peaks, in GFLOP/s, that an op's rate is a share of.
struct Peaks {
  double f32 = 0;  ///< fp32 FMA (cpu::measureFmaPeak)
  double bf16 = 0; ///< bf16 products where the CPU has them, else the fp32 peak
  std::string f32Isa, bf16Isa;
};

/// One task run of a traced pass, as slowTasks judges it.
struct TaskCost {
  uint32_t op = 0; ///< its op (runs are compared within an op)
  int64_t ns = 0;  ///< how long it ran
  double work = 0; ///< its FLOPs or bytes; 0: not judged
};

/// A run slowTasks found: its index in the runs, and the time its op's
/// median time per unit of work gives its work.
struct SlowTask {
  size_t index = 0;
  double expectedNs = 0;
};

/// The runs (the largest excess first) that took at least `ratio` times
/// what their op's median time per unit of work gives their work, and at
/// least `minExcessNs` more. A run far past its op's others is one that
/// stalled: on a shared machine most often the cores taken by something
/// else, which a profile should not be read as the op's own cost.
std::vector<SlowTask> slowTasks(const std::vector<TaskCost> &runs, double ratio,
                                int64_t minExcessNs);

/// Measures this machine's Peaks (about `seconds` per probe).
Peaks measurePeaks(double seconds = 0.3);

/// The profile of the last traced `which` pass of `context` (tracing on; a
/// pass has run), as a table: its header names the pass, its wall time and
/// phases, the workers and the peaks. Errors: tracing off, no such pass.
Status profileText(const rt::Context &context, rt::TracedPass which, const Peaks &peaks,
                   std::string *out);

} // namespace moec::tooling

#endif // MOEC_RUNTIME_TOOLING_PROFILE_H
