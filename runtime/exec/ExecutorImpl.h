//===- ExecutorImpl.h - The executor's state, inside runtime/exec -*- C++ -*-===//
//
// Internal to the executor's files (see Executor.h for the design and
// Executor.cpp for the rules that keep it race-free): Executor::Impl, the
// state of logical queues, events and workers. Executor.cpp makes and runs
// it; Workers.cpp is the workers' loop (acquire, run, signal, park);
// Supervise.cpp resets a pass, watches it (the watchdog, peers' progress)
// and reports how it ended.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_EXEC_EXECUTORIMPL_H
#define MOEC_RUNTIME_EXEC_EXECUTORIMPL_H

#include "runtime/exec/Executor.h"

#include "base/File.h"
#include "base/Time.h"
#include "runtime/exec/ThreadTeam.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <fstream>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <utility>

namespace moec::exec {

using format::CoreKind;
using format::EventKind;
using format::QueueRecord;
using format::SignalRecord;
using format::TaskProgram;
using format::TaskRecord;
using format::WaitRecord;

namespace detail {

/// An index that names no logical queue.
constexpr uint32_t kNil = UINT32_MAX;

/// The `minWaiting` of an event no queue is parked on.
constexpr uint64_t kNoWaiter = UINT64_MAX;

/// The `current` of a worker that runs no task.
constexpr uint64_t kIdle = UINT64_MAX;

/// Tells the processor that this thread is spinning.
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// A one-byte lock for the short critical sections of an event's waiter list.
class SpinLock {
public:
  void lock() {
    for (uint32_t spins = 0;; ++spins) {
      if (!locked.exchange(true, std::memory_order_acquire))
        return;
      while (locked.load(std::memory_order_relaxed)) {
        if (++spins < 64)
          cpuRelax();
        else
          std::this_thread::yield();
      }
    }
  }
  void unlock() { locked.store(false, std::memory_order_release); }

private:
  std::atomic<bool> locked{false};
};

/// One rank's copy of one event.
struct EventState {
  std::atomic<uint64_t> value{0};              ///< the counter
  std::atomic<uint64_t> minWaiting{kNoWaiter}; ///< least threshold a parked queue needs
  SpinLock lock;                               ///< guards `waiters` and its queues' links
  uint32_t waiters = kNil;                     ///< first parked logical queue
};

/// One logical queue (a rank's copy of a program queue).
struct alignas(64) QueueState {
  uint32_t head = 0;          ///< entries of the queue that have run
  uint32_t waitCursor = 0;    ///< waits of the head task known to be met
  uint32_t nextWaiter = kNil; ///< next queue parked on the same event
  uint64_t waitThreshold = 0; ///< the threshold it is parked for
  uint32_t parkEvent = 0;     ///< with tracing: the event it is parked on
  int64_t parkNs = 0;         ///< with tracing: when it parked, from the pass start
};

/// A worker thread and what it keeps between tasks.
struct alignas(64) Worker {
  std::vector<uint32_t> woken;            ///< queues its last task's signals woke
  trace::Trace trace;                     ///< tasks it ran, waits it ended (with tracing)
  std::atomic<uint64_t> current{kIdle};   ///< (logical queue << 32 | task) running
  std::atomic<int64_t> currentSinceNs{0}; ///< when that task started
};

/// Where a program queue's entries are.
struct QueueInfo {
  uint32_t first = 0;
  uint32_t count = 0;
  bool cube = false; ///< a cube core's queue (matrix tiles)
};

/// A worker running a cube queue hands it over for a ready cube queue with
/// at least this many more tasks left (see Impl::rebalance).
constexpr uint32_t kRebalanceMargin = 2;

/// Why a pass stopped before every task ran.
enum class Stop { None, Error, Watchdog, Deadlock };

/// Returns `seconds` for a message: "0.2 s", "60 s", "1.5e-05 s".
inline std::string formatSeconds(double seconds) { return fmt::format("{:.3g} s", seconds); }

/// Returns the name of the op of task `task`, or "?" for an index out of range.
inline std::string_view opNameOf(const TaskProgram &program, uint32_t task) {
  if (task >= program.tasks.size() || program.tasks[task].op >= program.ops.size())
    return "?";
  return program.name(program.ops[program.tasks[task].op].name);
}

} // namespace detail

using namespace detail; // the executor's files only: this header is internal

//===----------------------------------------------------------------------===//
// The executor's state
//===----------------------------------------------------------------------===//

struct Executor::Impl {
  Impl(TaskProgram programIn, TaskFunction runTaskIn, const ExecutorOptions &optionsIn);
  ~Impl();

  /// The threads the workers run on: the options' team, or one of its own.
  std::shared_ptr<ThreadTeam> team;

  // The program and its derived tables (read-only once created).
  TaskProgram program;
  TaskFunction runTask;
  ExecutorOptions options;
  uint32_t rankCount = 0;  ///< R
  uint32_t firstLocal = 0; ///< the ranks run here: firstLocal .. firstLocal + localCount - 1
  uint32_t localCount = 0;
  bool remote = false;                ///< some ranks run in other processes
  std::unique_ptr<comm::Inbox> inbox; ///< with `remote`: what peers signal
  std::vector<uint32_t> remoteEvents; ///< events a peer may signal
  std::vector<uint64_t> eventTotal;   ///< what every rank's signals add to each event
  /// A peer offset that signals an event, and what its signals add to it.
  struct Signaller {
    uint32_t offset;
    uint64_t total;
    uint32_t op; ///< an op of the signalling tasks (whose fansOut() they share)
  };
  std::vector<std::vector<Signaller>> signallers; ///< [event]: who signals it
  std::vector<uint64_t> inboxValues;              ///< the local inbox as last read, per local rank
  std::vector<uint64_t> inboxSeen;                ///< what of it was delivered
  uint32_t queueCount = 0;                        ///< Q, queues per rank
  uint32_t eventCount = 0;                        ///< E, events per rank
  uint32_t workerCount = 0;
  uint64_t totalTasks = 0; ///< R x tasks
  std::vector<QueueInfo> queueInfo;
  std::vector<uint32_t> terminateEvents;
  std::vector<uint32_t> startOrder; ///< non-empty logical queues, ranks interleaved

  // Per-rank state, allocated once.
  std::unique_ptr<EventState[]> events; ///< [rank * E + event]
  std::unique_ptr<QueueState[]> queues; ///< [rank * Q + queue]
  std::unique_ptr<Worker[]> workers;

  // The ready FIFO and the pass's bookkeeping, guarded by `mutex` (the
  // atomics are also read without it).
  std::mutex mutex;
  std::condition_variable workCv; ///< idle workers wait here for ready queues
  std::condition_variable doneCv; ///< run() waits here for the workers
  std::vector<uint32_t> ring;     ///< the ready FIFO, R x Q slots
  size_t ringHead = 0;
  size_t ringSize = 0;
  std::atomic<size_t> readyCount{0}; ///< ringSize, for spinning workers
  uint32_t inPass = 0;               ///< workers that have not left the pass
  uint32_t busy = 0;                 ///< workers that own a logical queue
  uint32_t sleepers = 0;             ///< workers waiting on workCv
  Stop stopReason = Stop::None;
  Status error;              ///< with Stop::Error
  std::string runningReport; ///< with Stop::Watchdog: the tasks running then

  std::atomic<bool> passOver{false};  ///< set when the pass ends, for any reason
  std::atomic<uint64_t> remaining{0}; ///< task runs left in the pass
  std::atomic<bool> inRun{false};
  Clock::time_point passStart;

  PassStats stats;
  trace::Trace trace;
  trace::Trace remoteWaits; ///< waits signals from peers ended (with tracing)

  // Workers.
  void workerMain(uint32_t worker); ///< one pass of one worker
  void runPass(uint32_t worker);
  uint32_t acquire(bool wasBusy);
  void pushReady(const std::vector<uint32_t> &lqs);
  uint32_t tasksLeft(uint32_t lq) const {
    return queueInfo[lq % queueCount].count - queues[lq].head;
  }
  size_t pickReady() const;
  uint32_t rebalance(uint32_t lq);
  bool headReady(uint32_t lq);
  Status signal(uint32_t rank, uint32_t op, const SignalRecord &signal,
                std::vector<uint32_t> &woken, const trace::WaitSpan &by, trace::Trace *waits);
  void addToEvent(uint32_t rank, uint32_t event, uint64_t increment, std::vector<uint32_t> &woken,
                  const trace::WaitSpan &by, trace::Trace *waits);
  bool isLocal(uint32_t rank) const { return rank - firstLocal < localCount; }
  Status deliver(bool *delivered);
  bool terminated() const;
  void superviseRemote();
  void fireWatchdog(Clock::time_point now);
  void fail(Status status);
  void finishPass();

  // run() and its reports.
  void reset();
  void supervise();
  Status result();
  std::string taskName(uint32_t lq, uint32_t task) const;
  std::string describeRunning(Clock::time_point now) const;
  std::string describeStuck() const;
  std::string describeSignallers(uint32_t rank, uint32_t event) const;
};

} // namespace moec::exec

#endif // MOEC_RUNTIME_EXEC_EXECUTORIMPL_H
