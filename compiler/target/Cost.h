//===- Cost.h - Estimated run time of a task -------------------*- C++ -*-===//
//
// The cost model the scheduler orders and balances queues with, and that
// `moec dump` reports critical paths, queue loads and simulated makespans
// in. A task's cost is its profile's per-task overhead plus its tile's work,
// taking each segment at its balanced-routing size
// (TilingRecord::balancedRows):
//
// - a GMM tile is a roofline: the larger of its flops at the cube rate of
//   its dtype, with M, N and K rounded up to the profile's pad sizes (the
//   granularity the cube computes in), and its operand bytes (A, B, C and
//   an addend, each once) at the memory rate;
// - a SwiGLU(-grad) tile is a roofline too: its element reads and writes
//   at the vector core's math rate, or their bytes at its streaming rate,
//   whichever takes longer;
// - a put's bytes at the link rate of one put, or at the vector core's
//   streaming rate for the rank's own rows; all puts of a rank to others
//   also share the profile's total link bandwidth, which the simulation
//   models (CostModel).
//
// The simulation (Simulate.h) adds what one task's cost cannot say: which
// queues share the hardware that runs them (TargetProfile::sharing) and the
// shared link.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_TARGET_COST_H
#define MOEC_COMPILER_TARGET_COST_H

#include "compiler/target/Profile.h"
#include "format/TaskBinary.h"

#include <vector>

namespace moec::target {

/// Returns the estimated seconds task `task` of `program` takes on one core
/// of `profile`, alone.
double taskSeconds(const format::TaskProgram &program, uint32_t task,
                   const TargetProfile &profile);

/// Returns taskSeconds() of every task, indexed by task.
std::vector<double> taskCosts(const format::TaskProgram &program, const TargetProfile &profile);

/// What the timed simulation needs of a profile for one program.
struct CostModel {
  /// Per task: its seconds alone on a core (taskCosts()).
  std::vector<double> costs;
  /// Per task: the bytes it sends over the rank's shared link (a put to
  /// another rank), else 0.
  std::vector<double> linkBytes;
  /// The bytes/s all puts of a rank share; 0: no limit.
  double linkTotalBytes = 0;
  /// Which queues share cores, and how many cores a shared pool has.
  CoreSharing sharing = CoreSharing::None;
  uint32_t poolCores = 0;
};

/// Returns the cost model of `program` on `profile`.
CostModel costModel(const format::TaskProgram &program, const TargetProfile &profile);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_COST_H
