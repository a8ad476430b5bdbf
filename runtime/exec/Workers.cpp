//===- Workers.cpp - The executor's workers -------------------------------===//
//
// See ExecutorImpl.h: a worker's loop. It takes a ready logical queue,
// runs its head task, signals, and parks the queue on the event its next
// task waits for; the rules of Executor.cpp keep it race-free.
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/ExecutorImpl.h"

namespace moec::exec {

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
    // Traced, the thread's CPU time too, read outside the span (it is a
    // system call): the span's wall time less it is the time off the core.
    const int64_t cpuStartNs = tracing ? threadCpuNs() : 0;
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
    if (tracing) {
      const int64_t endNs = (Clock::now() - passStart).count();
      const int64_t cpuEndNs = threadCpuNs();
      // (Unknown, -1, where the thread's CPU time could not be read.)
      const int64_t offCoreNs =
          cpuStartNs < 0 || cpuEndNs < 0
              ? -1
              : std::max<int64_t>(0, endNs - startNs - (cpuEndNs - cpuStartNs));
      worker.trace.tasks.push_back(
          {rank, lq % queueCount, taskIndex, workerIndex, startNs, endNs, offCoreNs});
    }
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

} // namespace moec::exec
