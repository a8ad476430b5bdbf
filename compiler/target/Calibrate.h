//===- Calibrate.h - the cost model's rates, fitted to measured runs -*- C++ -*-===//
//
// `moec bench --calibrate` runs layers on this machine with traces on, then
// fits a target profile to them here: each rate class (cube fp32, cube
// bf16, SwiGLU, a rank's put to itself, a put to a peer) is the work of
// its tasks (from the cost model at unit rates) over the time the traces
// say they took; the per-task overhead is the value, at least the
// executor's own floor, that makes the simulated makespans of the passes
// add up to their measured wall times. No runtime dependency: the caller
// measures, this fits.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_TARGET_CALIBRATE_H
#define MOEC_COMPILER_TARGET_CALIBRATE_H

#include "compiler/target/Profile.h"
#include "format/TaskBinary.h"
#include "runtime/trace/Trace.h"

#include <cstdint>
#include <vector>

namespace moec::target {

/// One measured pass the fit learns from.
struct MeasuredPass {
  const format::TaskProgram *program = nullptr;
  const trace::Trace *trace = nullptr; ///< its task spans (the best run's)
  double seconds = 0;                  ///< the task program's wall time in that run
};

/// The rate classes the fit sets.
enum class RateClass { CubeF32, CubeBf16, VectorMath, Copy, Link };

/// The class of task `task` and its work in that class's unit (flops,
/// element accesses or bytes), from the cost model at unit rates.
std::pair<RateClass, double> taskWork(const format::TaskProgram &program, uint32_t task);

/// `estimate` with its rates fitted to the task spans of `passes` (a class
/// without tasks keeps its estimate), its cores set to `threads`, and its
/// task overhead fitted to the passes' wall times, no lower than
/// `overheadFloor` (seconds: what the executor alone costs per task).
TargetProfile calibrateProfile(const TargetProfile &estimate,
                               const std::vector<MeasuredPass> &passes, uint32_t threads,
                               double overheadFloor);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_CALIBRATE_H
