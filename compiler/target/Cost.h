//===- Cost.h - Estimated run time of a task -------------------*- C++ -*-===//
//
// The cost model the scheduler orders and balances queues with, and that
// `moec dump` reports critical paths and queue loads in. A task's cost is
// its profile's per-task overhead plus its tile's work at the profile's
// rates, taking each segment at its balanced-routing size
// (TilingRecord::balancedRows): a GMM tile's flops at the cube rate, a
// SwiGLU tile's bytes at the vector rate, a put's bytes at the link rate (or
// the vector rate for the loading rank's own rows).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_TARGET_COST_H
#define MOEC_COMPILER_TARGET_COST_H

#include "compiler/target/Profile.h"
#include "runtime/format/TaskBinary.h"

#include <vector>

namespace moec::target {

/// Returns the estimated seconds task `task` of `program` takes on one core
/// of `profile`.
double taskSeconds(const format::TaskProgram &program, uint32_t task,
                   const TargetProfile &profile);

/// Returns taskSeconds() of every task, indexed by task.
std::vector<double> taskCosts(const format::TaskProgram &program, const TargetProfile &profile);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_COST_H
