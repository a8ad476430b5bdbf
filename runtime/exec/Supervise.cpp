//===- Supervise.cpp - A pass reset, watched and reported -----------------===//
//
// See ExecutorImpl.h: the state reset before a pass, the watchdog and the
// supervision of peers' progress during it, and the result (an error names
// the rank, core, task and event) after it.
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/ExecutorImpl.h"

namespace moec::exec {

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
                                 : fmt::format("rank {} ({} of {} arrived, {} missing)", peer, got,
                                               total, total - got));
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
                                        program.name(program.events[e].name), value, eventTotal[e],
                                        describeSignallers(rank, e)));
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

} // namespace moec::exec
