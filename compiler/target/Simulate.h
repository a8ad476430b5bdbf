//===- Simulate.h - Deadlock proof and timed simulation --------*- C++ -*-===//
//
// Runs a task program the way the runtime does, on every rank of its EP
// group at once, without doing the work of any task:
//
// - proveDeadlockFree() runs every queue greedily on monotone event counters
//   and either shows that all queues drain or explains why they cannot: the
//   cycle of queues waiting on each other, or the event that can never reach
//   the threshold a task waits for.
// - simulateTimed() list-schedules the same program with estimated task
//   costs (target::taskCosts) and reports the makespan, each queue's busy and
//   finish time, and the critical path of the task graph.
//
// Why a greedy run is a proof: a queue runs its tasks in order, a task only
// waits for counters to reach thresholds, and counters only grow. Running a
// task never stops another one from running later, so the set of tasks that
// can ever run does not depend on the order in which ready tasks are run. If
// one greedy order drains every queue of every rank, every timing of the real
// devices does too; if it gets stuck, every timing gets stuck at the same
// tasks.
//
// No MLIR or LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_TARGET_SIMULATE_H
#define MOEC_COMPILER_TARGET_SIMULATE_H

#include "base/Status.h"
#include "compiler/target/Cost.h"
#include "format/TaskBinary.h"
#include "runtime/trace/Trace.h"

#include <cstdint>
#include <vector>

namespace moec::target {

/// Proves that every rank of `program`'s EP group runs every task of its
/// queues to completion, whatever the timing.
///
/// A queue's head runs as soon as each of its waits is met on its own rank,
/// and its signals then add their increments on the ranks they reach. Every
/// EP rank runs the same tables and signals name peer offsets, so the proof
/// runs one EP rank (with its TP ranks) for all of them: a signal to the
/// rank `peerOffset` ahead counts on this rank, as the same signal from the
/// rank that far behind would. That run is one in which all EP ranks run
/// the same task at once; it drains exactly when the group's runs do. The
/// run is event driven (a counter's change re-checks only the queue heads
/// waiting on it), so it takes time linear in T x (tasks + waits + signals)
/// for T TP ranks, whatever the EP degree. Only a run that gets stuck is
/// redone on all R ranks, to name the ranks in its explanation.
///
/// After every queue drained, it also checks that every event of every rank
/// ended exactly at its threshold, which for a terminate event means that it
/// fired. (Whether a terminate event may fire while a rank still has queued
/// tasks depends on the timing and is not checked here.)
///
/// When the run gets stuck, the error explains why, in a few lines whatever
/// the program's size: either the cycle of queues that wait on each other
/// ("deadlock: the schedule cannot complete (rank 0: 2 of 8 queues stuck).
/// Cycle: cube core 0 waits at task 12 (op 'down_proj', tile e0 r0 c0) for
/// event 7 'swiglu.e0' (needs 4, has 2); it is signalled by task 30 (op
/// 'swiglu') queued on vector core 1 ... — the cycle closes."), or an event
/// that the tasks left to run cannot bring to the threshold a task waits for.
///
/// The program need not have passed validateTaskProgram's threshold check
/// (this finds threshold bugs too), but its indices must be in range; an
/// error says so when they are not.
Status proveDeadlockFree(const format::TaskProgram &program);

/// The simulated timing of one queue on rank 0.
struct QueueTiming {
  double busySeconds = 0;   ///< the sum of its tasks' costs
  double finishSeconds = 0; ///< when its last task finishes; 0 for an empty queue
};

/// The result of simulateTimed().
struct TimedRun {
  /// An error when the program deadlocks or is malformed (the other fields
  /// are then empty), else a success.
  Status status;

  /// When the last task of any rank finishes, in seconds from the start.
  double makespan = 0;

  /// Per queue, indexed like program.queues: its timing on rank 0.
  std::vector<QueueTiming> queues;

  /// Per task, indexed like program.tasks: when it starts and finishes on
  /// rank 0.
  std::vector<double> start, finish;

  /// The length in seconds of the critical path: the longest chain of
  /// dependent tasks, each costing its estimate, with no queue capacity
  /// limit (a lower bound of the makespan).
  double criticalPathSeconds = 0;

  /// The tasks of the critical path, first to last.
  std::vector<uint32_t> criticalPath;

  /// The rank each task of criticalPath runs on, placing its last task on
  /// rank 0 (every rank has a critical path of the same tasks, rotated).
  std::vector<uint32_t> criticalPathRanks;

  /// With a trace requested: every rank's tasks, the waits of queues
  /// whose head was ready to start (its queue predecessor done) before its
  /// events were, each naming the event and the signal that ended it, in
  /// the format the runtime records (runtime/trace).
  trace::Trace trace;

  /// Returns true when the simulation succeeded.
  bool ok() const { return status.ok(); }
};

/// Simulates `program` on all R ranks with task `t` taking `costs[t]`
/// seconds (costs from taskCosts(); one per task): every queue runs its
/// tasks in order, a task starting when its predecessor in the queue has
/// finished and each of its waits is met, i.e. when the last of the signals
/// its wait threshold needs has arrived; a task's signals arrive when it
/// finishes. The program's tables are the same on every rank and a signal's
/// target is relative to its sender, so every rank's timing is the same;
/// the per-queue and per-task times are rank 0's. As in proveDeadlockFree,
/// one EP rank (with its TP ranks) is run for all of them, with a signal's
/// arrival on the rank `peerOffset` ahead counted on itself, unless a trace
/// is recorded or one pool of cores serves the whole group; then all R
/// ranks are run. (Where several ranks' tasks end at the same instant, the
/// two may order a pool's waiting queues differently.)
///
/// The critical path follows dependencies only, not queue order: task b
/// depends on task a when a carries a signal (on the rank that signal
/// reaches) to an event that b waits for. A wait for an event's final value
/// (the usual case) depends on every signaller of the event; a wait for a
/// partial count depends on the signals that, in the simulated run, brought
/// the counter to that count. The task graph is built with one node per
/// event arrival, so its size stays linear in tasks + waits + signals.
///
/// Returns an error status (the message of proveDeadlockFree) when the
/// program deadlocks or does not end with every event at its threshold, and
/// one when `costs` does not have one entry per task.
TimedRun simulateTimed(const format::TaskProgram &program, const std::vector<double> &costs);

/// The same with the rest of a cost model: with `model.sharing` other than
/// None, a queue's ready head also needs a free core of its pool (a rank's
/// pool, or one pool for the whole group, of model.poolCores cores; a core
/// that finishes a task takes its own queue's next task first if it is
/// ready, else the queue that has waited longest); a put that crosses ranks
/// also queues for its rank's shared link (model.linkTotalBytes), so that
/// its transfer ends no sooner than the transfers before it at the shared
/// rate. The critical path stays the dependency chain of the costs alone.
/// With `recordTrace`, fills TimedRun::trace.
TimedRun simulateTimed(const format::TaskProgram &program, const CostModel &model,
                       bool recordTrace = false);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_SIMULATE_H
