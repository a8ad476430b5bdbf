//===- Schedule.h - Per-core in-order queues for a task program -*- C++ -*-===//
//
// Orders a task program's tasks into one in-order queue per logical core by
// list scheduling on the cost model: the task with the longest remaining
// path to the end of the pass (critical path first) goes to the core of its
// kind that frees up first (load balance). It sees what the timed simulation
// (Simulate.h) sees: a rank's puts share its link, and on a profile with
// CoreSharing::Rank a task also takes one of the cores a rank's cube and
// vector queues share. Puts are numbered peer offset by
// peer offset (the tile grid), and equal priorities keep that order, so at
// any step rank r puts to rank r + k: the ranks of the group target
// different peers at once, which is the seed's rank-aware reordering written
// relative to the rank.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_TARGET_SCHEDULE_H
#define MOEC_COMPILER_TARGET_SCHEDULE_H

#include "compiler/target/Profile.h"
#include "format/TaskBinary.h"

namespace moec::target {

/// What the scheduler estimates for the queues it built.
struct ScheduleEstimate {
  double makespan = 0;      ///< seconds until the last task of a rank ends
  double criticalPath = 0;  ///< seconds of the longest dependency chain
  double cubeBusy = 0;      ///< summed task seconds on cube cores
  double vectorBusy = 0;    ///< summed task seconds on vector cores
};

/// Replaces the queues of *program with one queue per core: `cubeCores`
/// cube queues and `vectorCores` vector queues (some may stay empty), using
/// `profile`'s cost model. The program's waits and signals must form an
/// acyclic dependency graph when every rank is taken alike (signals to a peer
/// count as signals to the same event); fails with a message otherwise.
Status scheduleQueues(format::TaskProgram *program, const TargetProfile &profile,
                      uint32_t cubeCores, uint32_t vectorCores,
                      ScheduleEstimate *estimate = nullptr);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_SCHEDULE_H
