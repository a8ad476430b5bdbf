//===- Executor.h - Runs a task program on every rank of an EP group -*- C++ -*-===//
//
// The executor runs one pass of a loaded task program for all R ranks of an
// EP group inside one process. It does not know what a task computes: the
// caller passes a task function that does a tile's work (kernels, and the
// data copy of a put), and the executor decides when each task may run and
// sends its signals once the function has returned.
//
// Design
//
// - Logical queues. Every rank has a copy of each of the program's in-order
//   queues (one per cube or vector core), so there are R x Q logical queues.
//   They are multiplexed onto N worker threads; a logical queue is owned by at
//   most one worker at a time, which is what keeps it in order.
//
// - Events. Every rank has its own copy of each event: an atomic counter,
//   plus a short list of the logical queues whose head task waits for it.
//   A signal is a fetch_add on the counter of the rank it reaches; when the
//   new value reaches the smallest threshold a parked queue waits for, the
//   signaller takes the event's small lock, unlinks every queue whose
//   threshold is met and makes it ready. A queue parks by linking itself
//   under that lock and then re-reading the counter, so no wake-up is lost.
//   No thread ever blocks on an event: a worker whose queue cannot go on
//   parks the queue, not itself, and picks other work.
//
// - Scheduling. A worker keeps running its queue while the next head is
//   ready, except that a worker on a cube queue hands it over for a ready
//   cube queue with 2 or more tasks left than its own: kept to the end,
//   queues that started late would finish late, one worker running the
//   last of them while the others had nothing left (the backward pass of
//   qwen3-30b-a3b at 2 ranks had one worker idle 8% of the pass so). When
//   the queue parks or drains, it takes a queue its own signals just woke
//   (the data is hot in its cache), else one from the shared set of ready
//   queues: the first vector queue (short tasks that feed or drain the cube
//   queues), else the cube queue with the most tasks left. A worker with nothing to do spins briefly on that FIFO and
//   then sleeps on a condition variable until a queue becomes ready or the
//   pass ends. So a worker never sleeps while a ready queue exists, and the
//   cost of a task is O(its waits + its signals), independent of R and Q,
//   apart from the short scan of an event's parked queues when it wakes some.
//
// - Pass. run() resets every counter and queue, wakes the workers (a pool
//   created once and kept for the executor's life), and returns when every
//   task of every rank has run exactly once (every queue drained, which
//   brings every event, terminate events included, to its threshold), or on
//   the first error. The calling thread supervises: it is the watchdog.
//
// - Watchdog. When no task completes for `timeout`, the pass stops and the
//   error names a stuck queue (rank, core, task, op) and the event it waits
//   for (index, name, value, threshold), and lists a few more. Since all
//   ranks run in this process, a pass in which every queue is parked and no
//   task is running can never go on; with `detectDeadlock` (the default) that
//   is reported at once, with the same description, instead of after the
//   timeout. Tasks still running when the watchdog fires are named too
//   ("has been running for 61 s"); run() returns once they have returned.
//
// - Errors. The first task function to fail (or throw) stops the pass on all
//   ranks: workers finish the tasks they are running and start no more, and
//   run() returns that error prefixed with the task's rank, core, index and
//   op.
//
// - Ranks in other processes. With a fabric whose ranks are not all in this
//   process (ExecutorOptions::fabric), only the local ranks' queues run here;
//   a signal for another rank goes out through the fabric's inbox, and the
//   supervising thread polls the local inbox and adds what arrived to the
//   local events, waking parked queues as a local signal would.
//
// - Trace. Optionally every task's start and end (per worker, no locking),
//   and every time a queue sat parked on an event with the task whose
//   signal woke it, are recorded as a trace::Trace (runtime/trace), which
//   can be written as Chrome/Perfetto trace JSON.
//
// No MLIR or LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_EXEC_EXECUTOR_H
#define MOEC_RUNTIME_EXEC_EXECUTOR_H

#include "base/Status.h"
#include "base/Time.h"
#include "runtime/comm/Fabric.h"
#include "format/TaskBinary.h"
#include "runtime/trace/Trace.h"
#include "runtime/exec/ThreadTeam.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moec::exec {

/// Does the work of task `task` (an index into the program's tasks) on rank
/// `rank`; `worker` (0 .. workers-1) is the worker thread running it, e.g. to
/// index per-thread scratch memory. For a put, it also copies the data to the
/// peer: the executor sends the task's signals only after it returns
/// successfully. It is called from several threads at once (never twice for
/// the same rank and task in one pass), and must return: the executor cannot
/// interrupt it.
using TaskFunction = std::function<Status(uint32_t rank, uint32_t task, uint32_t worker)>;

/// How an executor runs.
struct ExecutorOptions {
  /// Worker threads; 0 means std::thread::hardware_concurrency() (at least 1).
  uint32_t workers = 0;

  /// The threads the workers run on: a team whose helpers (size() - 1, at
  /// least `workers`) each run one worker during run(), held by the
  /// executor from the start of a pass to its end. Null: the executor makes
  /// a team of its own. The CPU backend gives the process's team
  /// (ThreadTeam::shared), so that every layer's passes share one set.
  std::shared_ptr<ThreadTeam> team;

  /// The watchdog fires when no task completes for this long; zero or less
  /// turns it off.
  std::chrono::nanoseconds timeout =
      std::chrono::nanoseconds(int64_t(kDefaultTimeoutSeconds * 1e9));

  /// Report at once a pass in which every unfinished queue is parked on an
  /// event and no task is running (which can never go on, since all ranks
  /// run in this process). When false, only the watchdog stops such a pass.
  bool detectDeadlock = true;

  /// Record every task run and every wait of a parked queue (see
  /// Executor::trace()).
  bool trace = false;

  /// How many times an idle worker checks for ready work before it sleeps.
  uint32_t spinIterations = 256;

  /// How many stuck queues a watchdog or deadlock error lists.
  uint32_t stuckQueuesReported = 4;

  /// The fabric of the EP group; null: every rank runs in this process. With
  /// a fabric that runs only some ranks here (MPI), the executor runs the
  /// queues of its local ranks only, sends the signals of puts to other
  /// ranks through an inbox (comm::Inbox: after the put's rows, as a remote
  /// atomic add), and its supervising thread delivers what peers signal to
  /// its ranks' events. A pass then ends when the local queues have drained
  /// and the local terminate events are complete; deadlock detection is off
  /// (a peer may still signal), so the watchdog bounds every wait.
  std::shared_ptr<comm::Fabric> fabric;
};

/// What the last pass did.
struct PassStats {
  uint64_t tasksRun = 0; ///< task runs that completed, over all ranks
  double seconds = 0;    ///< wall time of the pass
};

/// Runs passes of one task program for all ranks of its EP group. Created
/// with create(); run() may be called any number of times, from one thread at
/// a time (and never from inside a task function).
class Executor {
public:
  /// Validates `program` (validateTaskProgram) and creates an executor for
  /// all of its program.epRanks ranks, with its worker threads, calling
  /// `runTask` for every task. Returns an error, and leaves *out alone, when
  /// the program is invalid or `runTask` is empty.
  static Status create(format::TaskProgram program, TaskFunction runTask,
                       const ExecutorOptions &options, std::unique_ptr<Executor> *out);

  /// Stops and joins the worker threads.
  ~Executor();

  Executor(const Executor &) = delete;
  Executor &operator=(const Executor &) = delete;

  /// Runs one pass: resets every event counter to zero and every queue to its
  /// first task, runs every task of every rank exactly once, each only once
  /// its waits are met on its rank, and returns once all queues have drained
  /// and every rank's terminate events have reached their thresholds. On a
  /// task error, a watchdog timeout or a deadlock, stops all workers and
  /// returns the error; the executor can run again afterwards.
  Status run();

  /// Returns true while the current pass is stopping (after an error, the
  /// watchdog or a deadlock). A long task function may poll it to return
  /// early; its result is then ignored.
  bool stopRequested() const;

  /// Task runs (over the local ranks) a pass makes, and how many of them
  /// the pass in flight has completed: callable from any thread while run()
  /// runs, for a progress display (after a pass, done equals the total).
  uint64_t tasksPerPass() const;
  uint64_t tasksDone() const;

  /// Returns the program the executor runs.
  const format::TaskProgram &program() const;

  /// Returns the number of ranks (program().epRanks).
  uint32_t ranks() const;

  /// Returns the number of worker threads.
  uint32_t workers() const;

  /// Returns what the last pass did (zeros before the first).
  const PassStats &lastPass() const;

  /// Returns the trace of the last pass when tracing is on (else empty):
  /// its tasks, sorted by start time, and the waits of parked queues with
  /// the signaller that ended each (unknown for a signal from another
  /// process). Times are from lastPassStart(); a task ends after its
  /// signals are sent. A pass that failed keeps what completed.
  const trace::Trace &trace() const;

  /// When the last pass started.
  std::chrono::steady_clock::time_point lastPassStart() const;

  /// Writes the last pass's trace to `path` as Chrome/Perfetto trace JSON
  /// (trace::chromeTraceJson). Errors start with the path.
  Status writeTrace(const std::string &path) const;

private:
  struct Impl;
  explicit Executor(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl;
};

} // namespace moec::exec

#endif // MOEC_RUNTIME_EXEC_EXECUTOR_H
