//===- Executor.cpp - Runs a task program on every rank of an EP group ----===//
//
// See Executor.h for the design. Ownership rules that keep it race-free:
//
// - A logical queue's QueueState is written only by the worker that owns
//   the queue. Ownership moves through the ready FIFO (under `mutex`), an
//   event's waiter list (under the event's lock), or a worker's list of
//   queues its signals woke.
// - An event's waiter list and the waitThreshold/nextWaiter fields of the
//   queues on it are touched only under the event's lock.
// - A queue parks by linking itself and publishing the smallest waited-for
//   threshold (`minWaiting`), then re-reading the counter, all seq_cst; a
//   signaller adds to the counter and then reads `minWaiting`, both seq_cst.
//   Whichever runs second sees the other, so a wake-up is never lost.
// - The workers are the helpers of a thread team (ThreadTeam, the process's
//   when the options give one): run() resets all state single-threaded,
//   then launches one worker per helper and joins them at the end.
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/Executor.h"

#include "base/File.h"
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

namespace {

using Clock = std::chrono::steady_clock;

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
std::string formatSeconds(double seconds) { return fmt::format("{:.3g} s", seconds); }

/// Returns the name of the op of task `task`, or "?" for an index out of range.
std::string_view opNameOf(const TaskProgram &program, uint32_t task) {
  if (task >= program.tasks.size() || program.tasks[task].op >= program.ops.size())
    return "?";
  return program.name(program.ops[program.tasks[task].op].name);
}

} // namespace


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
  bool remote = false;     ///< some ranks run in other processes
  std::unique_ptr<comm::Inbox> inbox;   ///< with `remote`: what peers signal
  std::vector<uint32_t> remoteEvents;   ///< events a peer may signal
  std::vector<uint64_t> eventTotal;     ///< what every rank's signals add to each event
  /// A peer offset that signals an event, and what its signals add to it.
  struct Signaller {
    uint32_t offset;
    uint64_t total;
    uint32_t op; ///< an op of the signalling tasks (whose fansOut() they share)
  };
  std::vector<std::vector<Signaller>> signallers; ///< [event]: who signals it
  std::vector<uint64_t> inboxValues;    ///< the local inbox as last read, per local rank
  std::vector<uint64_t> inboxSeen;      ///< what of it was delivered
  uint32_t queueCount = 0; ///< Q, queues per rank
  uint32_t eventCount = 0; ///< E, events per rank
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
  std::condition_variable workCv;  ///< idle workers wait here for ready queues
  std::condition_variable doneCv;  ///< run() waits here for the workers
  std::vector<uint32_t> ring;      ///< the ready FIFO, R x Q slots
  size_t ringHead = 0;
  size_t ringSize = 0;
  std::atomic<size_t> readyCount{0}; ///< ringSize, for spinning workers
  uint32_t inPass = 0;   ///< workers that have not left the pass
  uint32_t busy = 0;     ///< workers that own a logical queue
  uint32_t sleepers = 0; ///< workers waiting on workCv
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

Executor::Impl::Impl(TaskProgram programIn, TaskFunction runTaskIn,
                     const ExecutorOptions &optionsIn)
    : program(std::move(programIn)), runTask(std::move(runTaskIn)), options(optionsIn) {
  rankCount = program.ranks();
  queueCount = uint32_t(program.queues.size());
  eventCount = uint32_t(program.events.size());
  workerCount = options.workers;
  if (workerCount == 0)
    workerCount = std::max(1u, std::thread::hardware_concurrency());
  firstLocal = 0;
  localCount = rankCount;
  if (options.fabric && !options.fabric->allLocal()) {
    remote = true;
    firstLocal = options.fabric->firstLocal();
    localCount = options.fabric->localRanks();
    this->options.detectDeadlock = false;
    std::vector<bool> fromPeer(program.events.size(), false);
    eventTotal.assign(program.events.size(), 0);
    signallers.resize(program.events.size());
    // Every rank runs every task once, so each task's signals reach every
    // rank once in a pass (from the rank peerOffset before it). Tasks may
    // share signal records: count them per task.
    // A task that fans out reaches every rank once from each TP rank of
    // the EP rank peerOffset before it.
    for (const TaskRecord &task : program.tasks) {
      const bool fanOut = program.fansOut(task.op);
      for (uint32_t i = 0; i < task.signalCount; ++i) {
        const SignalRecord &signal = program.signals[task.firstSignal + i];
        eventTotal[signal.event] += uint64_t(signal.increment) * (fanOut ? program.tpRanks : 1);
        if (signal.peerOffset == 0 && !fanOut)
          continue;
        fromPeer[signal.event] = true;
        std::vector<Signaller> &from = signallers[signal.event];
        auto it = std::find_if(from.begin(), from.end(), [&](const Signaller &s) {
          return s.offset == signal.peerOffset && program.fansOut(s.op) == fanOut;
        });
        if (it == from.end())
          from.push_back({signal.peerOffset, signal.increment, task.op});
        else
          it->total += signal.increment;
      }
    }
    for (uint32_t e = 0; e < fromPeer.size(); ++e)
      if (fromPeer[e])
        remoteEvents.push_back(e);
    inboxValues.assign(size_t(localCount) * program.events.size(), 0);
    inboxSeen = inboxValues;
  }
  totalTasks = uint64_t(localCount) * program.tasks.size();

  queueInfo.resize(queueCount);
  for (uint32_t q = 0; q < queueCount; ++q)
    queueInfo[q] = {program.queues[q].firstEntry, program.queues[q].entryCount,
                    program.queues[q].coreKind == CoreKind::Cube};
  for (uint32_t e = 0; e < eventCount; ++e)
    if (program.events[e].kind == EventKind::Terminate)
      terminateEvents.push_back(e);
  for (uint32_t q = 0; q < queueCount; ++q)
    if (queueInfo[q].count > 0)
      for (uint32_t r = firstLocal; r < firstLocal + localCount; ++r)
        startOrder.push_back(r * queueCount + q);

  events.reset(new EventState[size_t(rankCount) * eventCount]);
  queues.reset(new QueueState[size_t(rankCount) * queueCount]);
  ring.assign(size_t(rankCount) * queueCount, kNil);
  workers.reset(new Worker[workerCount]);
  for (uint32_t w = 0; w < workerCount; ++w)
    workers[w].woken.reserve(64);
}

Executor::Impl::~Impl() = default;

//===----------------------------------------------------------------------===//
// Workers
//===----------------------------------------------------------------------===//

void Executor::Impl::workerMain(uint32_t worker) {
  runPass(worker);
  std::lock_guard<std::mutex> lock(mutex);
  if (--inPass == 0)
    doneCv.notify_all();
}

/// Returns a ready logical queue from the FIFO, which the caller then owns,
/// or kNil when the pass is over. `wasBusy`: the caller owned a queue until
/// now. Spins briefly, then sleeps, while the FIFO is empty; declares a
/// deadlock when no worker owns a queue and tasks are left.
uint32_t Executor::Impl::acquire(bool wasBusy) {
  std::unique_lock<std::mutex> lock(mutex);
  if (wasBusy)
    --busy;
  bool spun = false;
  for (;;) {
    if (passOver.load(std::memory_order_relaxed))
      return kNil;
    if (ringSize > 0) {
      // Take the chosen queue out; the ones before it move up one slot.
      size_t at = ringHead + pickReady();
      const uint32_t lq = ring[at % ring.size()];
      for (; at > ringHead; --at)
        ring[at % ring.size()] = ring[(at - 1) % ring.size()];
      ringHead = ringHead + 1 == ring.size() ? 0 : ringHead + 1;
      readyCount.store(--ringSize, std::memory_order_relaxed);
      ++busy;
      return lq;
    }
    if (busy == 0 && options.detectDeadlock && remaining.load() > 0) {
      // Every unfinished queue is parked and nothing runs that could signal.
      stopReason = Stop::Deadlock;
      passOver.store(true);
      workCv.notify_all();
      return kNil;
    }
    if (!spun && options.spinIterations > 0) {
      spun = true;
      lock.unlock();
      for (uint32_t i = 0; i < options.spinIterations; ++i) {
        if (readyCount.load(std::memory_order_relaxed) > 0 ||
            passOver.load(std::memory_order_relaxed))
          break;
        if (i % 32 == 31)
          std::this_thread::yield();
        else
          cpuRelax();
      }
      lock.lock();
      continue;
    }
    ++sleepers;
    workCv.wait(lock);
    --sleepers;
    spun = false;
  }
}

/// Which ready queue a worker takes (its position in the FIFO; the caller
/// holds `mutex` and the FIFO is not empty): the first vector queue (its
/// tasks are short, and feed or drain the cube queues), else the cube queue
/// with the most tasks left, so that the cube queues end together rather
/// than one of them running alone at the end of the pass.
size_t Executor::Impl::pickReady() const {
  size_t best = 0;
  uint32_t bestLeft = 0;
  for (size_t i = 0; i < ringSize; ++i) {
    const uint32_t lq = ring[(ringHead + i) % ring.size()];
    if (!queueInfo[lq % queueCount].cube)
      return i;
    if (tasksLeft(lq) > bestLeft) {
      best = i;
      bestLeft = tasksLeft(lq);
    }
  }
  return best;
}

/// Called by the owner of cube queue `lq`, whose head task is ready: when
/// the FIFO holds a cube queue with kRebalanceMargin or more tasks left
/// than `lq`, puts `lq` in its place and returns it (the caller owns it
/// now); else returns `lq`. Without this a worker keeps its queue while it
/// can, and queues that started late finish late, on one worker, while the
/// others have nothing left.
uint32_t Executor::Impl::rebalance(uint32_t lq) {
  if (readyCount.load(std::memory_order_relaxed) == 0)
    return lq;
  std::lock_guard<std::mutex> lock(mutex);
  const uint32_t mine = tasksLeft(lq);
  for (size_t i = 0; i < ringSize; ++i) {
    uint32_t &slot = ring[(ringHead + i) % ring.size()];
    if (queueInfo[slot % queueCount].cube && tasksLeft(slot) >= mine + kRebalanceMargin) {
      const uint32_t taken = slot;
      slot = lq;
      return taken;
    }
  }
  return lq;
}

/// Appends `lqs` to the ready FIFO and wakes as many sleeping workers.
void Executor::Impl::pushReady(const std::vector<uint32_t> &lqs) {
  size_t wake;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (uint32_t lq : lqs) {
      size_t slot = ringHead + ringSize;
      if (slot >= ring.size())
        slot -= ring.size();
      ring[slot] = lq;
      ++ringSize;
    }
    readyCount.store(ringSize, std::memory_order_relaxed);
    wake = std::min<size_t>(lqs.size(), sleepers);
  }
  for (size_t i = 0; i < wake; ++i)
    workCv.notify_one();
}

/// Checks the waits of the head task of logical queue `lq` (owned by the
/// caller, not drained), in order from the first one not known to be met.
/// Returns true when all are met. Otherwise parks the queue on the event of
/// the first unmet wait and returns false; the caller no longer owns it.
bool Executor::Impl::headReady(uint32_t lq) {
  uint32_t rank = lq / queueCount;
  QueueState &state = queues[lq];
  const QueueInfo &info = queueInfo[lq % queueCount];
  const TaskRecord &task = program.tasks[program.queueEntries[info.first + state.head]];
  while (state.waitCursor < task.waitCount) {
    const WaitRecord &wait = program.waits[task.firstWait + state.waitCursor];
    EventState &event = events[size_t(rank) * eventCount + wait.event];
    if (event.value.load(std::memory_order_acquire) >= wait.threshold) {
      ++state.waitCursor;
      continue;
    }
    event.lock.lock();
    if (options.trace) {
      state.parkEvent = wait.event;
      state.parkNs = (Clock::now() - passStart).count();
    }
    state.waitThreshold = wait.threshold;
    state.nextWaiter = event.waiters;
    event.waiters = lq;
    uint64_t least =
        std::min<uint64_t>(event.minWaiting.load(std::memory_order_relaxed), wait.threshold);
    event.minWaiting.store(least, std::memory_order_seq_cst);
    if (event.value.load(std::memory_order_seq_cst) >= wait.threshold) {
      // A signal came in meanwhile: unlink again (still first on the list).
      event.waiters = state.nextWaiter;
      state.nextWaiter = kNil;
      event.lock.unlock();
      ++state.waitCursor;
      continue;
    }
    event.lock.unlock();
    return false;
  }
  return true;
}

/// Sends `signal` of a task that ran on `rank`; appends the logical queues it
/// wakes (which the caller then owns) to `woken`. A signal for a rank of
/// another process goes through the inbox.
Status Executor::Impl::signal(uint32_t rank, uint32_t op, const SignalRecord &signal,
                              std::vector<uint32_t> &woken, const trace::WaitSpan &by,
                              trace::Trace *waits) {
  const TaskProgram::RankRange to = program.signalRanks(op, rank, signal.peerOffset);
  for (uint32_t target = to.first; target < to.first + to.count; ++target) {
    if (!isLocal(target)) {
      if (Status s = inbox->signal(target, signal.event, signal.increment, by.signalTask); !s)
        return s;
      continue;
    }
    addToEvent(target, signal.event, signal.increment, woken, by, waits);
  }
  return Status::success();
}

/// Adds `increment` to event `eventIndex` of local rank `rank`; appends the
/// logical queues it wakes (which the caller then owns) to `woken`.
void Executor::Impl::addToEvent(uint32_t rank, uint32_t eventIndex, uint64_t increment,
                                std::vector<uint32_t> &woken, const trace::WaitSpan &by,
                                trace::Trace *waits) {
  EventState &event = events[size_t(rank) * eventCount + eventIndex];
  uint64_t value = event.value.fetch_add(increment, std::memory_order_seq_cst) + increment;
  if (value < event.minWaiting.load(std::memory_order_seq_cst))
    return;
  event.lock.lock();
  value = event.value.load(std::memory_order_relaxed);
  uint64_t least = kNoWaiter;
  uint32_t *link = &event.waiters;
  while (*link != kNil) {
    uint32_t lq = *link;
    QueueState &waiter = queues[lq];
    if (waiter.waitThreshold <= value) {
      *link = waiter.nextWaiter;
      waiter.nextWaiter = kNil;
      woken.push_back(lq);
      if (waits) {
        trace::WaitSpan span = by;
        span.rank = lq / queueCount;
        span.queue = lq % queueCount;
        span.task = program.queueEntries[queueInfo[span.queue].first + waiter.head];
        span.event = waiter.parkEvent;
        span.beginNs = waiter.parkNs;
        span.endNs = (Clock::now() - passStart).count();
        waits->waits.push_back(span);
      }
    } else {
      least = std::min(least, waiter.waitThreshold);
      link = &waiter.nextWaiter;
    }
  }
  event.minWaiting.store(least, std::memory_order_seq_cst);
  event.lock.unlock();
}

void Executor::Impl::fail(Status status) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (stopReason == Stop::None) {
      stopReason = Stop::Error;
      error = std::move(status);
    }
    passOver.store(true);
  }
  workCv.notify_all();
}

void Executor::Impl::finishPass() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    passOver.store(true);
  }
  workCv.notify_all();
}

void Executor::Impl::runPass(uint32_t workerIndex) {
  Worker &worker = workers[workerIndex];
  std::vector<uint32_t> &woken = worker.woken;
  const bool tracing = options.trace;
  uint32_t lq = kNil;
  bool wasBusy = false;
  for (;;) {
    if (lq == kNil) {
      lq = acquire(wasBusy);
      if (lq == kNil)
        return;
      wasBusy = true;
    }
    if (passOver.load(std::memory_order_relaxed))
      return;
    if (!headReady(lq)) {
      lq = kNil;
      continue;
    }

    // Run the head task.
    const uint32_t rank = lq / queueCount;
    QueueState &state = queues[lq];
    const QueueInfo &info = queueInfo[lq % queueCount];
    const uint32_t taskIndex = program.queueEntries[info.first + state.head];
    const TaskRecord &task = program.tasks[taskIndex];
    int64_t startNs = (Clock::now() - passStart).count();
    worker.currentSinceNs.store(startNs, std::memory_order_relaxed);
    worker.current.store(uint64_t(lq) << 32 | taskIndex, std::memory_order_relaxed);
    Status status;
    try {
      status = runTask(rank, taskIndex, workerIndex);
    } catch (const std::exception &exception) {
      status = Status::error(std::string("the task threw: ") + exception.what());
    } catch (...) {
      status = Status::error("the task threw an exception");
    }
    worker.current.store(kIdle, std::memory_order_relaxed);
    if (!status.ok()) {
      fail(status.withPrefix(taskName(lq, taskIndex) + ": "));
      return;
    }

    // Signal, advance, and pick what to run next.
    trace::WaitSpan by;
    by.signalRank = rank;
    by.signalTask = taskIndex;
    for (uint32_t s = 0; s < task.signalCount && status.ok(); ++s)
      status = signal(rank, task.op, program.signals[task.firstSignal + s], woken, by,
                      tracing ? &worker.trace : nullptr);
    if (tracing)
      worker.trace.tasks.push_back({rank, lq % queueCount, taskIndex, workerIndex, startNs,
                                    (Clock::now() - passStart).count()});
    if (!status.ok()) {
      woken.clear();
      fail(status.withPrefix(taskName(lq, taskIndex) + ": "));
      return;
    }
    ++state.head;
    state.waitCursor = 0;
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1)
      finishPass();
    if (state.head == info.count || !headReady(lq))
      lq = kNil;
    else if (info.cube)
      lq = rebalance(lq);
    if (!woken.empty()) {
      if (lq == kNil) {
        lq = woken.front();
        woken.erase(woken.begin());
      }
      if (!woken.empty())
        pushReady(woken);
      woken.clear();
    }
  }
}

//===----------------------------------------------------------------------===//
// run() and its reports
//===----------------------------------------------------------------------===//

void Executor::Impl::reset() {
  size_t eventStates = size_t(rankCount) * eventCount;
  for (size_t i = 0; i < eventStates; ++i) {
    events[i].value.store(0, std::memory_order_relaxed);
    events[i].minWaiting.store(kNoWaiter, std::memory_order_relaxed);
    events[i].waiters = kNil;
  }
  size_t queueStates = size_t(rankCount) * queueCount;
  for (size_t i = 0; i < queueStates; ++i)
    queues[i] = QueueState();
  std::copy(startOrder.begin(), startOrder.end(), ring.begin());
  ringHead = 0;
  ringSize = startOrder.size();
  readyCount.store(ringSize);
  busy = 0;
  sleepers = 0;
  stopReason = Stop::None;
  error = Status();
  runningReport.clear();
  remaining.store(totalTasks);
  passOver.store(totalTasks == 0);
  for (uint32_t w = 0; w < workerCount; ++w) {
    workers[w].trace = trace::Trace();
    workers[w].woken.clear();
    workers[w].current.store(kIdle);
  }
  trace = trace::Trace();
  remoteWaits = trace::Trace();
}

/// Stops the pass for the watchdog (the caller holds `mutex`): what runs now
/// goes into the report.
void Executor::Impl::fireWatchdog(Clock::time_point now) {
  stopReason = Stop::Watchdog;
  runningReport = describeRunning(now);
  passOver.store(true);
  workCv.notify_all();
}

/// Waits for the workers to leave the pass, firing the watchdog when no task
/// completes for the timeout.
void Executor::Impl::supervise() {
  using namespace std::chrono;
  const bool watchdog = options.timeout.count() > 0;
  const nanoseconds slice =
      watchdog ? std::clamp<nanoseconds>(options.timeout / 8, milliseconds(1), milliseconds(100))
               : nanoseconds(milliseconds(100));
  uint64_t lastRemaining = remaining.load();
  Clock::time_point lastProgress = Clock::now();
  std::unique_lock<std::mutex> lock(mutex);
  while (!(passOver.load() && inPass == 0)) {
    doneCv.wait_for(lock, slice);
    if (passOver.load())
      continue;
    Clock::time_point now = Clock::now();
    uint64_t left = remaining.load();
    if (left != lastRemaining) {
      lastRemaining = left;
      lastProgress = now;
    } else if (watchdog && now - lastProgress >= options.timeout) {
      fireWatchdog(now);
    }
  }
}

/// Reads the local inbox and adds what peers signalled since the last read
/// to the local events, pushing the queues that wakes. Sets *delivered when
/// something arrived.
Status Executor::Impl::deliver(bool *delivered) {
  *delivered = false;
  std::vector<uint32_t> woken;
  for (uint32_t i = 0; i < localCount; ++i) {
    uint64_t *values = inboxValues.data() + size_t(i) * eventCount;
    uint64_t *seen = inboxSeen.data() + size_t(i) * eventCount;
    if (Status s = inbox->read(firstLocal + i, values); !s)
      return s;
    for (uint32_t e : remoteEvents)
      if (values[e] > seen[e]) {
        trace::WaitSpan by;
        if (options.trace) {
          const uint64_t last = inbox->lastSignaller(firstLocal + i, e);
          if (last != comm::Inbox::kUnknown) {
            by.signalRank = uint32_t(last >> 32);
            by.signalTask = uint32_t(last);
          }
        }
        addToEvent(firstLocal + i, e, values[e] - seen[e], woken, by,
                   options.trace ? &remoteWaits : nullptr);
        seen[e] = values[e];
        *delivered = true;
      }
  }
  if (!woken.empty())
    pushReady(woken);
  return Status::success();
}

/// True when every terminate event of every local rank is complete and every
/// signal peers send in a pass has arrived (so that the inbox can be reset
/// with none in flight, whatever the binary's thresholds).
bool Executor::Impl::terminated() const {
  for (uint32_t rank = firstLocal; rank < firstLocal + localCount; ++rank) {
    for (uint32_t e : terminateEvents)
      if (events[size_t(rank) * eventCount + e].value.load() < program.events[e].threshold)
        return false;
    for (uint32_t e : remoteEvents)
      if (events[size_t(rank) * eventCount + e].value.load() < eventTotal[e])
        return false;
  }
  return true;
}

/// supervise() for a pass whose peers run in other processes: polls the
/// inbox until the local queues have drained and the local terminate events
/// are complete (or an error), firing the watchdog when neither a task
/// completes nor a signal arrives for the timeout.
void Executor::Impl::superviseRemote() {
  using namespace std::chrono;
  const bool watchdog = options.timeout.count() > 0;
  uint64_t lastRemaining = remaining.load();
  Clock::time_point lastProgress = Clock::now();
  uint32_t idle = 0;
  for (;;) {
    bool delivered = false;
    if (Status s = deliver(&delivered); !s) {
      fail(s.withPrefix(fmt::format("rank {}: reading the events peers signal: ", firstLocal)));
      break;
    }
    const uint64_t left = remaining.load();
    if (left == 0 && terminated())
      break;
    // A task failed. (The last task's finishPass() also sets passOver, after
    // remaining reached 0: read remaining again, after passOver, so that a
    // pass whose last task ends between the two reads goes on waiting for
    // its peers' signals instead of ending early.)
    if (passOver.load() && remaining.load() > 0)
      break;
    const Clock::time_point now = Clock::now();
    if (delivered || left != lastRemaining) {
      lastRemaining = left;
      lastProgress = now;
      idle = 0;
    } else if (watchdog && now - lastProgress >= options.timeout) {
      std::lock_guard<std::mutex> lock(mutex);
      fireWatchdog(now);
      break;
    } else if (++idle < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(microseconds(std::min<uint32_t>(idle - 63, 50)));
    }
  }
  std::unique_lock<std::mutex> lock(mutex);
  passOver.store(true);
  workCv.notify_all();
  doneCv.wait(lock, [&] { return inPass == 0; });
}

std::string Executor::Impl::taskName(uint32_t lq, uint32_t task) const {
  return fmt::format("rank {}, {}, task {} (op '{}')", lq / queueCount,
                     trace::coreName(program, lq % queueCount), task, opNameOf(program, task));
}

/// Describes the tasks running at `now` (read from the workers' atomics).
std::string Executor::Impl::describeRunning(Clock::time_point now) const {
  int64_t nowNs = (now - passStart).count();
  std::string out;
  for (uint32_t w = 0; w < workerCount; ++w) {
    uint64_t current = workers[w].current.load(std::memory_order_relaxed);
    if (current == kIdle)
      continue;
    int64_t since = workers[w].currentSinceNs.load(std::memory_order_relaxed);
    out += fmt::format("{}{} has been running for {}", out.empty() ? "" : "; ",
                       taskName(uint32_t(current >> 32), uint32_t(current)),
                       formatSeconds(double(std::max<int64_t>(0, nowNs - since)) * 1e-9));
  }
  return out;
}

/// For an event of local rank `rank` that ranks of other processes signal:
/// "; signalled by ranks P, Q", the ranks whose signals it waits for, each
/// with what its signals added of what they add in a pass where the inbox
/// keeps it ("; signalled by rank P (1 of 2 arrived, 1 missing)").
std::string Executor::Impl::describeSignallers(uint32_t rank, uint32_t event) const {
  if (!remote || signallers[event].empty())
    return "";
  std::vector<std::pair<uint32_t, uint64_t>> peers;
  for (const Signaller &from : signallers[event]) {
    const TaskProgram::RankRange sources = program.signalSources(from.op, rank, from.offset);
    for (uint32_t peer = sources.first; peer < sources.first + sources.count; ++peer)
      if (!isLocal(peer))
        peers.push_back({peer, from.total});
  }
  std::sort(peers.begin(), peers.end());
  if (peers.empty())
    return "";
  std::vector<std::string> parts;
  bool counted = true;
  for (const auto &[peer, total] : peers) {
    const uint64_t got = inbox->signalledBy(rank, peer, event);
    if (got == comm::Inbox::kUnknown) {
      counted = false;
      break;
    }
    parts.push_back(got >= total ? fmt::format("rank {} ({} of {} arrived)", peer, got, total)
                                 : fmt::format("rank {} ({} of {} arrived, {} missing)", peer,
                                               got, total, total - got));
  }
  if (!counted) {
    std::vector<uint32_t> ranks;
    for (const auto &entry : peers)
      ranks.push_back(entry.first);
    return fmt::format("; signalled by rank{} {}", ranks.size() == 1 ? "" : "s",
                       fmt::join(ranks, ", "));
  }
  return fmt::format("; signalled by {}", fmt::join(parts, ", "));
}

/// Describes the queues that did not drain (call once the workers are out of
/// the pass): the first one waiting for an event, then a few more.
std::string Executor::Impl::describeStuck() const {
  const size_t limit = std::max(1u, options.stuckQueuesReported);
  std::vector<std::string> blocked, ready;
  uint64_t left = 0;
  uint32_t undrained = 0, ranksStuck = 0;
  for (uint32_t rank = firstLocal; rank < firstLocal + localCount; ++rank) {
    bool rankStuck = false;
    for (uint32_t q = 0; q < queueCount; ++q) {
      uint32_t lq = rank * queueCount + q;
      const QueueState &state = queues[lq];
      const QueueInfo &info = queueInfo[q];
      if (state.head >= info.count)
        continue;
      left += info.count - state.head;
      ++undrained;
      rankStuck = true;
      if (blocked.size() >= limit && ready.size() >= limit)
        continue;
      uint32_t taskIndex = program.queueEntries[info.first + state.head];
      const TaskRecord &task = program.tasks[taskIndex];
      std::string text = taskName(lq, taskIndex);
      bool isBlocked = false;
      for (uint32_t w = 0; w < task.waitCount && !isBlocked; ++w) {
        const WaitRecord &wait = program.waits[task.firstWait + w];
        uint64_t value =
            events[size_t(rank) * eventCount + wait.event].value.load(std::memory_order_relaxed);
        if (value < wait.threshold) {
          isBlocked = true;
          text += fmt::format(" waits for event {} '{}' (value {}, needs {}{})", wait.event,
                              program.name(program.events[wait.event].name), value, wait.threshold,
                              describeSignallers(rank, wait.event));
        }
      }
      if (isBlocked && blocked.size() < limit)
        blocked.push_back(std::move(text));
      else if (!isBlocked && ready.size() < limit)
        ready.push_back(text + " is ready");
    }
    ranksStuck += rankStuck;
  }
  std::vector<std::string> listed = std::move(blocked);
  listed.insert(listed.end(), ready.begin(), ready.end());
  std::string out =
      undrained == 0
          ? fmt::format("{} of {} task runs completed; every queue of this process drained",
                        totalTasks - left, totalTasks)
          : fmt::format("{} of {} task runs completed; {} queue{} on {} rank{} did not drain ({} "
                        "task runs left)",
                        totalTasks - left, totalTasks, undrained, undrained == 1 ? "" : "s",
                        ranksStuck, ranksStuck == 1 ? "" : "s", left);
  uint32_t shown = uint32_t(std::min(limit, listed.size()));
  for (uint32_t i = 0; i < shown; ++i)
    out += (i == 0 ? ". Stuck: " : "; ") + listed[i];
  if (undrained > shown)
    out += fmt::format("; and {} more", undrained - shown);
  // Signals of other processes that have not all arrived (the pass waits
  // for them even when every local queue drained).
  std::vector<std::string> missing;
  uint32_t missingCount = 0;
  if (remote)
    for (uint32_t rank = firstLocal; rank < firstLocal + localCount; ++rank)
      for (uint32_t e : remoteEvents) {
        const uint64_t value = events[size_t(rank) * eventCount + e].value.load();
        if (value >= eventTotal[e])
          continue;
        if (++missingCount <= limit)
          missing.push_back(fmt::format("rank {} event {} '{}' is at {} of {}{}", rank, e,
                                        program.name(program.events[e].name), value,
                                        eventTotal[e], describeSignallers(rank, e)));
      }
  if (!missing.empty())
    out += fmt::format(". Signals from other processes missing: {}{}", fmt::join(missing, "; "),
                       missingCount > missing.size()
                           ? fmt::format("; and {} more", missingCount - missing.size())
                           : std::string());
  return out;
}

Status Executor::Impl::result() {
  switch (stopReason) {
  case Stop::Error:
    // Under a fabric of several processes, an error may be a peer's (its
    // stop, a lost link): where the local queues stood goes with it.
    if (remote && (remaining.load() > 0 || !terminated()))
      return Status::error(error.message() + "; " + describeStuck(), error.code());
    return error;
  case Stop::Watchdog: {
    std::string text = fmt::format("watchdog: no task completed for {}",
                                   formatSeconds(double(options.timeout.count()) * 1e-9));
    if (!runningReport.empty())
      text += "; running: " + runningReport;
    return Status::error(text + "; " + describeStuck());
  }
  case Stop::Deadlock:
    return Status::error("deadlock: every unfinished queue waits for an event and no task is "
                         "running that could signal it; " +
                         describeStuck());
  case Stop::None:
    break;
  }
  for (uint32_t rank = firstLocal; rank < firstLocal + localCount; ++rank)
    for (uint32_t e : terminateEvents) {
      uint64_t value = events[size_t(rank) * eventCount + e].value.load();
      if (value != program.events[e].threshold)
        return Status::error(fmt::format(
            "rank {}: every queue drained, but terminate event {} '{}' is at {}, not at its "
            "threshold {}",
            rank, e, program.name(program.events[e].name), value, program.events[e].threshold));
    }
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Executor
//===----------------------------------------------------------------------===//

Executor::Executor(std::unique_ptr<Impl> implIn) : impl(std::move(implIn)) {}

Executor::~Executor() = default;

Status Executor::create(TaskProgram program, TaskFunction runTask, const ExecutorOptions &options,
                        std::unique_ptr<Executor> *out) {
  if (!runTask)
    return Status::error("executor: no task function");
  Status status = format::validateTaskProgram(program);
  if (!status.ok())
    return status.withPrefix("executor: invalid program: ");
  if (uint64_t(program.ranks()) * program.queues.size() >= kNil)
    return Status::error(fmt::format("executor: {} ranks x {} queues are too many logical queues",
                                     program.ranks(), program.queues.size()));
  std::unique_ptr<Impl> impl;
  try {
    impl = std::make_unique<Impl>(std::move(program), std::move(runTask), options);
  } catch (const std::bad_alloc &) {
    return Status::error("executor: out of memory for the per-rank state");
  }
  if (impl->remote) {
    status = impl->options.fabric->createInbox(impl->eventCount, &impl->inbox);
    if (!status.ok())
      return status.withPrefix("executor: ");
  }
  // The workers are the team's helpers: the options' team (the process's,
  // shared by the passes of every layer), or one of the executor's own.
  impl->team = options.team ? options.team
                            : std::make_shared<ThreadTeam>(impl->workerCount + 1);
  if (impl->team->size() - 1 < impl->workerCount)
    return Status::error(fmt::format(
        "executor: cannot start worker thread {} of {}: {} (the system starts no more threads: "
        "a memory or process limit; ask for fewer)",
        impl->team->size() - 1, impl->workerCount, impl->team->whyFewer()));
  out->reset(new Executor(std::move(impl)));
  return Status::success();
}

Status Executor::run() {
  Impl &state = *impl;
  if (state.inRun.exchange(true))
    return Status::error("executor: run() is already running");
  state.reset();
  state.passStart = Clock::now();
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.inPass = state.workerCount;
  }
  state.team->launch(state.workerCount,
                     [&state](size_t worker) { state.workerMain(uint32_t(worker)); });
  if (state.remote)
    state.superviseRemote();
  else
    state.supervise();
  state.team->join();
  Clock::time_point end = Clock::now();

  state.stats.tasksRun = state.totalTasks - state.remaining.load();
  state.stats.seconds = std::chrono::duration<double>(end - state.passStart).count();
  if (state.options.trace) {
    for (uint32_t w = 0; w < state.workerCount; ++w)
      state.trace.append(state.workers[w].trace);
    state.trace.append(state.remoteWaits);
    state.trace.sort();
  }
  Status status = state.result();
  if (state.remote && status.ok()) {
    // Every signal of this pass has arrived (the local waits and terminate
    // events count all of them), and peers signal the next pass only after
    // its exchange: the inbox can start again from zero.
    state.inbox->reset();
    std::fill(state.inboxValues.begin(), state.inboxValues.end(), 0);
    std::fill(state.inboxSeen.begin(), state.inboxSeen.end(), 0);
  }
  state.inRun.store(false);
  return status;
}

bool Executor::stopRequested() const {
  return impl->inRun.load(std::memory_order_relaxed) &&
         impl->passOver.load(std::memory_order_relaxed) &&
         impl->remaining.load(std::memory_order_relaxed) > 0;
}

uint64_t Executor::tasksPerPass() const { return impl->totalTasks; }

uint64_t Executor::tasksDone() const {
  return impl->totalTasks - std::min(impl->totalTasks,
                                     impl->remaining.load(std::memory_order_relaxed));
}

const TaskProgram &Executor::program() const { return impl->program; }

uint32_t Executor::ranks() const { return impl->rankCount; }

uint32_t Executor::workers() const { return impl->workerCount; }

const PassStats &Executor::lastPass() const { return impl->stats; }

const trace::Trace &Executor::trace() const { return impl->trace; }

std::chrono::steady_clock::time_point Executor::lastPassStart() const { return impl->passStart; }

Status Executor::writeTrace(const std::string &path) const {
  return trace::writeChromeTrace(impl->program, impl->trace, path);
}

} // namespace moec::exec
