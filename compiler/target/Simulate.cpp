//===- Simulate.cpp - Deadlock proof and timed simulation -----------------===//

#include "compiler/target/Simulate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <queue>
#include <string>

namespace moec::target {

using namespace moec::format;

namespace {

/// The most cycle steps a deadlock message lists.
constexpr size_t kMaxCycleSteps = 8;

/// No node (of the critical path), no task.
constexpr uint64_t kNoNode = std::numeric_limits<uint64_t>::max();

//===----------------------------------------------------------------------===//
// Index checks
//===----------------------------------------------------------------------===//

/// Checks what the simulations index with: ranges of tasks, waits, signals,
/// queues and queue entries, event indices, peer offsets, and that every
/// task is in exactly one queue. (validateTaskProgram checks all this and
/// more; the simulations also take programs whose thresholds are wrong.)
Status checkIndices(const TaskProgram &p) {
  auto malformed = [](const std::string &what) {
    return Status::error("the program is malformed: " + what);
  };
  if (p.epRanks == 0)
    return malformed("its EP group has 0 ranks");
  for (size_t i = 0; i < p.tasks.size(); ++i) {
    const TaskRecord &task = p.tasks[i];
    if (task.op >= p.ops.size())
      return malformed(
          fmt::format("task {} names op {}, but there are {} ops", i, task.op, p.ops.size()));
    if (uint64_t(task.firstWait) + task.waitCount > p.waits.size())
      return malformed(
          fmt::format("the waits of task {} end past the {} waits", i, p.waits.size()));
    if (uint64_t(task.firstSignal) + task.signalCount > p.signals.size())
      return malformed(
          fmt::format("the signals of task {} end past the {} signals", i, p.signals.size()));
  }
  for (size_t i = 0; i < p.waits.size(); ++i)
    if (p.waits[i].event >= p.events.size())
      return malformed(fmt::format("wait {} names event {}, but there are {} events", i,
                                   p.waits[i].event, p.events.size()));
  for (size_t i = 0; i < p.signals.size(); ++i) {
    if (p.signals[i].event >= p.events.size())
      return malformed(fmt::format("signal {} names event {}, but there are {} events", i,
                                   p.signals[i].event, p.events.size()));
    if (p.signals[i].peerOffset >= p.epRanks)
      return malformed(fmt::format("signal {} has peer offset {}, but there are {} ranks", i,
                                   p.signals[i].peerOffset, p.epRanks));
  }
  std::vector<uint8_t> queued(p.tasks.size(), 0);
  for (size_t q = 0; q < p.queues.size(); ++q) {
    const QueueRecord &queue = p.queues[q];
    if (uint64_t(queue.firstEntry) + queue.entryCount > p.queueEntries.size())
      return malformed(fmt::format("the entries of queue {} end past the {} queue entries", q,
                                   p.queueEntries.size()));
    for (uint32_t k = 0; k < queue.entryCount; ++k) {
      uint32_t task = p.queueEntries[size_t(queue.firstEntry) + k];
      if (task >= p.tasks.size())
        return malformed(fmt::format("queue {} entry {} names task {}, but there are {} tasks", q,
                                     k, task, p.tasks.size()));
      if (queued[task])
        return malformed(fmt::format("task {} is queued twice", task));
      queued[task] = 1;
    }
  }
  for (size_t t = 0; t < p.tasks.size(); ++t)
    if (!queued[t])
      return malformed(fmt::format("task {} is in no queue", t));
  return Status::success();
}

//===----------------------------------------------------------------------===//
// The model: static indexes of a program
//===----------------------------------------------------------------------===//

/// A wait of a task, in an event's list of waiters.
struct Waiter {
  uint32_t threshold;
  uint32_t task;
};

/// A signal of a task, in an event's list of signallers.
struct Signaller {
  uint32_t task;
  uint32_t signal; ///< index into program.signals
};

/// What both simulations look up: where each task is queued, and for each
/// event who waits for it and who signals it. Built once, shared by all
/// ranks (every rank runs the same tables).
///
/// `folded` models one EP rank (its TP ranks) standing for all of them: a
/// signal that would reach the rank `peerOffset` EP ranks further reaches
/// the same rank instead (see proveDeadlockFree).
struct Model {
  explicit Model(const TaskProgram &program, bool folded = false)
      : p(program), folded(folded), R(folded ? program.tpRanks : program.ranks()),
        T(uint32_t(program.tasks.size())),
        Q(uint32_t(program.queues.size())), E(uint32_t(program.events.size())) {
    queueOf.assign(T, 0);
    placeOf.assign(T, 0);
    for (uint32_t q = 0; q < Q; ++q) {
      const QueueRecord &queue = p.queues[q];
      for (uint32_t k = 0; k < queue.entryCount; ++k) {
        uint32_t task = p.queueEntries[size_t(queue.firstEntry) + k];
        queueOf[task] = q;
        placeOf[task] = k;
      }
    }
    // Waiters of each event, by threshold. Waits for 0 are always met and
    // left out. Tasks may share wait ranges, so count through the tasks.
    waiterBegin.assign(size_t(E) + 1, 0);
    signallerBegin.assign(size_t(E) + 1, 0);
    for (const TaskRecord &task : p.tasks) {
      for (uint32_t k = 0; k < task.waitCount; ++k) {
        const WaitRecord &wait = p.waits[size_t(task.firstWait) + k];
        if (wait.threshold > 0)
          ++waiterBegin[wait.event + 1];
      }
      for (uint32_t k = 0; k < task.signalCount; ++k)
        ++signallerBegin[p.signals[size_t(task.firstSignal) + k].event + 1];
    }
    for (uint32_t e = 0; e < E; ++e) {
      waiterBegin[e + 1] += waiterBegin[e];
      signallerBegin[e + 1] += signallerBegin[e];
    }
    waiters.resize(waiterBegin[E]);
    signallers.resize(signallerBegin[E]);
    std::vector<uint32_t> waitFill(waiterBegin.begin(), waiterBegin.end() - 1);
    std::vector<uint32_t> signalFill(signallerBegin.begin(), signallerBegin.end() - 1);
    signalSum.assign(E, 0);
    for (uint32_t t = 0; t < T; ++t) {
      const TaskRecord &task = p.tasks[t];
      for (uint32_t k = 0; k < task.waitCount; ++k) {
        const WaitRecord &wait = p.waits[size_t(task.firstWait) + k];
        if (wait.threshold > 0)
          waiters[waitFill[wait.event]++] = {wait.threshold, t};
      }
      for (uint32_t k = 0; k < task.signalCount; ++k) {
        uint32_t index = task.firstSignal + k;
        const SignalRecord &signal = p.signals[index];
        signallers[signalFill[signal.event]++] = {t, index};
        signalSum[signal.event] += uint64_t(signal.increment) * (p.fansOut(task.op) ? p.tpRanks : 1);
      }
    }
    for (uint32_t e = 0; e < E; ++e)
      std::sort(waiters.begin() + waiterBegin[e], waiters.begin() + waiterBegin[e + 1],
                [](const Waiter &a, const Waiter &b) { return a.threshold < b.threshold; });
  }

  /// The ranks a signal of a task of op `op` run on `rank` reaches.
  TaskProgram::RankRange reached(uint32_t op, uint32_t rank, uint32_t peerOffset) const {
    return p.signalRanks(op, rank, folded ? 0 : peerOffset);
  }

  const TaskProgram &p;
  bool folded;
  uint32_t R, T, Q, E;
  std::vector<uint32_t> queueOf;        ///< per task: its queue
  std::vector<uint32_t> placeOf;        ///< per task: its position in its queue
  std::vector<uint32_t> waiterBegin;    ///< per event, E + 1 offsets into waiters
  std::vector<Waiter> waiters;          ///< grouped by event, by threshold
  std::vector<uint32_t> signallerBegin; ///< per event, E + 1 offsets into signallers
  std::vector<Signaller> signallers;    ///< grouped by event, in task order
  std::vector<uint64_t> signalSum;      ///< per event: the increments of its signals

  //===--- Names for messages ---------------------------------------------===//

  /// The name of the op of `task`.
  std::string opName(uint32_t task) const {
    return std::string(p.name(p.ops[p.tasks[task].op].name));
  }

  /// "e0 r1 c0", with the peer when the grid has more than one.
  std::string tileText(uint32_t task) const {
    const OpRecord &op = p.ops[p.tasks[task].op];
    if (op.tiling >= p.tilings.size() || task < op.firstTask ||
        task - op.firstTask >= p.tilings[op.tiling].tileCount())
      return "?";
    const TilingRecord &tiling = p.tilings[op.tiling];
    TileCoord c = tileCoord(tiling, task - op.firstTask);
    if (tiling.peers > 1)
      return fmt::format("e{} p{} r{} c{}", c.expert, c.peer, c.rowTile, c.colTile);
    return fmt::format("e{} r{} c{}", c.expert, c.rowTile, c.colTile);
  }

  /// "event 7 'swiglu.e0'".
  std::string eventText(uint32_t event) const {
    return fmt::format("event {} '{}'", event, p.name(p.events[event].name));
  }

  /// "cube core 0", or "rank 1 cube core 0" for a group of several ranks.
  std::string coreText(uint32_t rank, uint32_t queue) const {
    const QueueRecord &record = p.queues[queue];
    std::string core = fmt::format("{} core {}", coreKindName(record.coreKind), record.coreIndex);
    return R > 1 ? fmt::format("rank {} {}", rank, core) : core;
  }
};

//===----------------------------------------------------------------------===//
// The state of a run: every rank's counters and queue positions
//===----------------------------------------------------------------------===//

/// Counters and queue positions of all R ranks. A slot is (rank, queue),
/// numbered rank * Q + queue; a counter is (rank, event), rank * E + event.
struct RunState {
  explicit RunState(const Model &model)
      : m(model), counter(size_t(m.R) * m.E, 0), met(size_t(m.R) * m.E, 0),
        pos(size_t(m.R) * m.Q, 0), cursor(size_t(m.R) * m.Q, 0), blocked(size_t(m.R) * m.Q, 0) {}

  size_t slot(uint32_t rank, uint32_t queue) const { return size_t(rank) * m.Q + queue; }
  uint32_t rankOf(size_t slot) const { return uint32_t(slot / m.Q); }
  uint32_t queueOfSlot(size_t slot) const { return uint32_t(slot % m.Q); }

  bool drained(size_t slot) const { return pos[slot] >= m.p.queues[queueOfSlot(slot)].entryCount; }

  /// The task at the head of a slot that is not drained.
  uint32_t head(size_t slot) const {
    return m.p.queueEntries[size_t(m.p.queues[queueOfSlot(slot)].firstEntry) + pos[slot]];
  }

  /// Returns true when task `task` has run on `rank`.
  bool hasRun(uint32_t rank, uint32_t task) const {
    return pos[slot(rank, m.queueOf[task])] > m.placeOf[task];
  }

  /// Returns true when every wait of the slot's head is met, moving the
  /// slot's cursor past the waits that are (they stay met).
  bool headReady(size_t slot) {
    const TaskRecord &task = m.p.tasks[head(slot)];
    const uint64_t *counters = counter.data() + size_t(rankOf(slot)) * m.E;
    for (uint32_t &k = cursor[slot]; k < task.waitCount; ++k) {
      const WaitRecord &wait = m.p.waits[size_t(task.firstWait) + k];
      if (counters[wait.event] < wait.threshold)
        return false;
    }
    return true;
  }

  /// Sends the signals of `task` run on `rank`. For each signal, calls
  /// arrive(target rank, event, peer offset) after adding its increment, and then
  /// meet(target rank, event, waiter) for each wait that the new value meets
  /// for the first time; a blocked slot whose head has such a wait is
  /// unblocked and passed to wake(slot).
  template <typename Arrive, typename Meet, typename Wake>
  void sendSignals(uint32_t rank, uint32_t task, Arrive &&arrive, Meet &&meet, Wake &&wake) {
    const TaskRecord &record = m.p.tasks[task];
    for (uint32_t k = 0; k < record.signalCount; ++k) {
      const SignalRecord &signal = m.p.signals[size_t(record.firstSignal) + k];
      const TaskProgram::RankRange reached = m.reached(record.op, rank, signal.peerOffset);
      for (uint32_t to = reached.first; to < reached.first + reached.count; ++to) {
        size_t c = size_t(to) * m.E + signal.event;
        uint64_t value = counter[c] += signal.increment;
        arrive(to, signal.event, signal.peerOffset);
        uint32_t end = m.waiterBegin[signal.event + 1];
        for (uint32_t &i = met[c]; m.waiterBegin[signal.event] + i < end; ++i) {
          const Waiter &waiter = m.waiters[m.waiterBegin[signal.event] + i];
          if (waiter.threshold > value)
            break;
          meet(to, signal.event, waiter);
          size_t s = slot(to, m.queueOf[waiter.task]);
          if (blocked[s] && head(s) == waiter.task) {
            blocked[s] = 0;
            wake(s);
          }
        }
      }
    }
  }

  /// Marks the slot's head as run.
  void advance(size_t slot) {
    ++pos[slot];
    cursor[slot] = 0;
    ++ran;
  }

  const Model &m;
  std::vector<uint64_t> counter; ///< per (rank, event)
  std::vector<uint32_t> met;     ///< per (rank, event): waiters met so far
  std::vector<uint32_t> pos;     ///< per slot: the position of its head
  std::vector<uint32_t> cursor;  ///< per slot: the head's first wait not known met
  std::vector<uint8_t> blocked;  ///< per slot: its head waits for a counter
  uint64_t ran = 0;              ///< task runs so far, all ranks
};

//===----------------------------------------------------------------------===//
// Explaining a stuck run, checking a finished one
//===----------------------------------------------------------------------===//

/// One step of a wait chain: a stuck slot, the wait its head is blocked on,
/// and a signaller of that event that has not run.
struct ChainStep {
  size_t slot;
  uint32_t task;
  uint32_t event;
  uint32_t needs;
  uint64_t has;
  uint32_t signaller;     ///< a task that has not run and would signal the event
  uint32_t signallerRank; ///< the rank it would run on
};

/// Explains why `run` stopped with queues left: the cycle of queues waiting
/// on each other, or an event that cannot reach the threshold a head waits
/// for.
std::string explainStuck(const Model &m, const RunState &run) {
  const TaskProgram &p = m.p;
  size_t slots = size_t(m.R) * m.Q;
  size_t start = slots;
  for (size_t s = 0; s < slots && start == slots; ++s)
    if (!run.drained(s))
      start = s;
  uint32_t startRank = run.rankOf(start);
  uint32_t stuckHere = 0, stuckRanks = 0;
  for (uint32_t r = 0; r < m.R; ++r) {
    bool any = false;
    for (uint32_t q = 0; q < m.Q; ++q)
      if (!run.drained(run.slot(r, q))) {
        any = true;
        stuckHere += r == startRank;
      }
    stuckRanks += any;
  }
  std::string summary = fmt::format("rank {}: {} of {} queues stuck", startRank, stuckHere, m.Q);
  if (m.R > 1)
    summary += fmt::format("; {} of {} ranks stuck", stuckRanks, m.R);
  std::string out = fmt::format("deadlock: the schedule cannot complete ({})", summary);

  auto headText = [&](uint32_t task) {
    return fmt::format("task {} (op '{}', tile {})", task, m.opName(task), m.tileText(task));
  };

  // Follow head -> unmet wait -> a signaller that has not run -> the head
  // of its queue, until a queue repeats. The stuck state is the same on
  // every rank, rotated (every rank runs the same tables, and the tasks a
  // greedy run gets through do not depend on its order), so a queue reached
  // again on another rank is stuck the same way as where it was first seen:
  // from there the chain repeats around the ranks.
  std::vector<int64_t> seenAt(m.Q, -1);
  std::vector<ChainStep> chain;
  size_t at = start;
  while (seenAt[run.queueOfSlot(at)] < 0) {
    seenAt[run.queueOfSlot(at)] = int64_t(chain.size());
    uint32_t rank = run.rankOf(at);
    uint32_t task = run.head(at);
    const TaskRecord &record = p.tasks[task];
    const WaitRecord *unmet = nullptr;
    for (uint32_t k = run.cursor[at]; k < record.waitCount && !unmet; ++k) {
      const WaitRecord &wait = p.waits[size_t(record.firstWait) + k];
      if (run.counter[size_t(rank) * m.E + wait.event] < wait.threshold)
        unmet = &wait;
    }
    if (!unmet) // cannot happen: a stuck head has an unmet wait
      return out + fmt::format(": {} at the head of {} is stuck with its waits met", headText(task),
                               m.coreText(rank, run.queueOfSlot(at)));
    uint32_t event = unmet->event;
    uint64_t has = run.counter[size_t(rank) * m.E + event];
    // Signals to this rank's copy of the event from tasks that have not run.
    // Follow one whose queue the chain has seen (it closes the cycle), else
    // one on the same rank, else the first.
    uint64_t pending = 0;
    ChainStep step{at, task, event, unmet->threshold, has, 0, 0};
    int best = -1;
    for (uint32_t i = m.signallerBegin[event]; i < m.signallerBegin[event + 1]; ++i) {
      const Signaller &s = m.signallers[i];
      const SignalRecord &signal = p.signals[s.signal];
      const TaskProgram::RankRange sources =
          p.signalSources(p.tasks[s.task].op, rank, signal.peerOffset);
      for (uint32_t from = sources.first; from < sources.first + sources.count; ++from) {
        if (run.hasRun(from, s.task))
          continue;
        pending += signal.increment;
        int score = seenAt[m.queueOf[s.task]] >= 0 ? 2 : from == rank ? 1 : 0;
        if (score > best) {
          best = score;
          step.signaller = s.task;
          step.signallerRank = from;
        }
      }
    }
    if (has + pending < unmet->threshold) {
      const EventRecord &ev = p.events[event];
      std::string why =
          unmet->threshold > ev.threshold
              ? fmt::format("it waits for more than the event's threshold {}", ev.threshold)
              : fmt::format("the event's threshold is {}, but its signals add up to {}",
                            ev.threshold, m.signalSum[event]);
      std::string what = m.eventText(event);
      what[0] = 'E';
      return out +
             fmt::format(". {} can never reach {} on rank {}: {} on {} waits for it, but it has {} "
                         "and the tasks that have not run would add only {} more ({}). This is a "
                         "threshold bug, not a cycle.",
                         what, unmet->threshold, rank, headText(task),
                         m.coreText(rank, run.queueOfSlot(at)), has, pending, why);
    }
    chain.push_back(step);
    at = run.slot(step.signallerRank, m.queueOf[step.signaller]);
  }

  // The cycle is the chain from the first visit of the repeated queue. It
  // is listed from rank 0: the same cycle, rotated, runs through every rank.
  size_t first = size_t(seenAt[run.queueOfSlot(at)]);
  size_t length = chain.size() - first;
  uint32_t shift = run.rankOf(chain[first].slot);
  auto shown = [&](uint32_t rank) { return uint32_t((uint64_t(rank) + m.R - shift) % m.R); };
  out += ". Cycle:";
  for (size_t i = first; i < chain.size() && i < first + kMaxCycleSteps; ++i) {
    const ChainStep &step = chain[i];
    uint32_t rank = run.rankOf(step.slot);
    size_t next = run.slot(step.signallerRank, m.queueOf[step.signaller]);
    uint32_t nextHead = run.head(next);
    std::string where;
    if (nextHead == step.signaller)
      where = fmt::format("at the head of {}",
                          m.coreText(shown(step.signallerRank), m.queueOf[nextHead]));
    else
      where =
          fmt::format("queued on {} at position {}, behind task {} (op '{}') at position {}",
                      m.coreText(shown(step.signallerRank), m.queueOf[step.signaller]),
                      m.placeOf[step.signaller], nextHead, m.opName(nextHead), m.placeOf[nextHead]);
    out += fmt::format("\n  {} waits at {} for {} (needs {}, has {}); it is signalled by task {} "
                       "(op '{}') {}",
                       m.coreText(shown(rank), run.queueOfSlot(step.slot)), headText(step.task),
                       m.eventText(step.event), step.needs, step.has, step.signaller,
                       m.opName(step.signaller), where);
    out += i + 1 < chain.size() ? ";" : "";
  }
  size_t closedAt = chain[first].slot;
  if (length > kMaxCycleSteps)
    out += fmt::format("\n  ... ({} more steps, back to {})", length - kMaxCycleSteps,
                       m.coreText(shown(run.rankOf(closedAt)), run.queueOfSlot(closedAt)));
  if (at == closedAt)
    out += " — the cycle closes.";
  else
    out += fmt::format(" — and {} is stuck as {} is (every rank runs the same tables), so the "
                       "chain repeats around the ranks and the cycle closes.",
                       m.coreText(shown(run.rankOf(at)), run.queueOfSlot(at)),
                       m.coreText(shown(run.rankOf(closedAt)), run.queueOfSlot(closedAt)));
  if (length == 1 && at == closedAt)
    out += " The signaller is queued behind the task that waits for it.";
  return out;
}

/// Checks that every rank's copy of every event ended at its threshold.
Status checkFinalCounters(const Model &m, const RunState &run) {
  const TaskProgram &p = m.p;
  std::string firstProblem;
  uint64_t problems = 0;
  for (uint32_t r = 0; r < m.R; ++r)
    for (uint32_t e = 0; e < m.E; ++e) {
      uint64_t value = run.counter[size_t(r) * m.E + e];
      const EventRecord &event = p.events[e];
      if (value == event.threshold)
        continue;
      if (problems++ > 0)
        continue;
      if (event.kind == EventKind::Terminate && value < event.threshold)
        firstProblem = fmt::format(
            "terminate {} never fires on rank {}: every queue drained with it at {} of its "
            "threshold {} (its signals add up to {})",
            m.eventText(e), r, value, event.threshold, m.signalSum[e]);
      else
        firstProblem = fmt::format(
            "{} ends at {} on rank {} after every queue drained, {} its threshold {} (its "
            "signals add up to {})",
            m.eventText(e), value, r, value < event.threshold ? "below" : "above", event.threshold,
            m.signalSum[e]);
    }
  if (problems == 0)
    return Status::success();
  if (problems > 1)
    firstProblem +=
        fmt::format(" ({} more (rank, event) pairs do not end at their threshold)", problems - 1);
  return Status::error(firstProblem);
}

/// Runs every queue of every rank greedily until none can go on.
void runGreedy(const Model &m, RunState *run) {
  size_t slots = size_t(m.R) * m.Q;
  std::vector<size_t> work;
  work.reserve(slots);
  for (size_t s = slots; s-- > 0;)
    work.push_back(s);
  auto none = [](uint32_t, uint32_t, uint32_t) {};
  auto noMeet = [](uint32_t, uint32_t, const Waiter &) {};
  auto wake = [&](size_t s) { work.push_back(s); };
  while (!work.empty()) {
    size_t s = work.back();
    work.pop_back();
    uint32_t rank = run->rankOf(s);
    while (!run->drained(s)) {
      if (!run->headReady(s)) {
        run->blocked[s] = 1;
        break;
      }
      run->sendSignals(rank, run->head(s), none, noMeet, wake);
      run->advance(s);
    }
  }
}

/// The number of task runs a complete run of all ranks makes.
uint64_t totalRuns(const Model &m) { return uint64_t(m.R) * m.T; }

} // namespace

//===----------------------------------------------------------------------===//
// Entry points
//===----------------------------------------------------------------------===//

Status proveDeadlockFree(const TaskProgram &program) {
  if (Status status = checkIndices(program); !status)
    return status;
  // Every EP rank runs the same tables and a signal names a peer offset, so
  // a run in which every EP rank runs the same task at once is a run of the
  // group, and one EP rank's counters stand for all of theirs: the rank
  // `peerOffset` further gets, from the rank as far behind it, the very
  // signal this rank sends. The folded run drains exactly when the group's
  // does; only to explain a stuck run are all ranks simulated.
  if (program.epRanks > 1) {
    Model folded(program, true);
    RunState run(folded);
    runGreedy(folded, &run);
    if (run.ran == totalRuns(folded) && checkFinalCounters(folded, run).ok())
      return Status::success();
  }
  Model model(program);
  RunState run(model);
  runGreedy(model, &run);
  if (run.ran != totalRuns(model))
    return Status::error(explainStuck(model, run));
  return checkFinalCounters(model, run);
}

TimedRun simulateTimed(const TaskProgram &program, const std::vector<double> &costs) {
  CostModel model;
  model.costs = costs;
  return simulateTimed(program, model, false);
}

TimedRun simulateTimed(const TaskProgram &program, const CostModel &model, bool recordTrace) {
  const std::vector<double> &costs = model.costs;
  TimedRun result;
  if (Status status = checkIndices(program); !status) {
    result.status = status;
    return result;
  }
  if (costs.size() != program.tasks.size() ||
      (!model.linkBytes.empty() && model.linkBytes.size() != program.tasks.size())) {
    result.status = Status::error(
        fmt::format("{} task costs for a program of {} tasks", costs.size(), program.tasks.size()));
    return result;
  }
  // The group's ranks run alike (see proveDeadlockFree) unless one pool of
  // cores serves them all; then, or to trace every rank, all are run.
  const bool fold = program.epRanks > 1 && !recordTrace && model.sharing != CoreSharing::Group;
  Model m(program, fold);
  RunState run(m);
  const size_t T = m.T;

  // Critical path, computed online: a node is a task run on a rank, numbered
  // rank * T + task. Its start bound is the longest chain of dependencies
  // that ends at its start; each (rank, event) keeps the longest chain that
  // ends at an arrival so far and the node it ends with (the event node of
  // the bipartite task graph). A wait is met at an arrival, and takes the
  // event's chain at that moment.
  std::vector<double> pathStart(size_t(m.R) * T, 0.0);
  std::vector<uint64_t> pathPred(size_t(m.R) * T, kNoNode);
  std::vector<double> eventPath(size_t(m.R) * m.E, 0.0);
  std::vector<uint64_t> eventPred(size_t(m.R) * m.E, kNoNode);
  // Folded: how many EP ranks behind its successor a predecessor ran (the
  // peer offset of the signal between them).
  std::vector<uint32_t> pathShift(fold ? size_t(m.R) * T : 0, 0);
  std::vector<uint32_t> eventShift(fold ? size_t(m.R) * m.E : 0, 0);

  result.start.assign(T, 0.0);
  result.finish.assign(T, 0.0);

  struct Finish {
    double time;
    uint64_t seq;
    size_t slot;
    bool operator>(const Finish &o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };
  std::priority_queue<Finish, std::vector<Finish>, std::greater<Finish>> pending;
  uint64_t seq = 0;

  const size_t slots = size_t(m.R) * m.Q;

  // Shared cores: a pool per rank or one for the group, with a FIFO of the
  // slots whose head is ready and waits for a core.
  const bool pooled = model.sharing != CoreSharing::None && model.poolCores > 0;
  auto poolOf = [&](size_t s) -> size_t {
    return model.sharing == CoreSharing::Rank ? run.rankOf(s) : 0;
  };
  size_t pools = !pooled ? 0 : model.sharing == CoreSharing::Rank ? m.R : 1;
  std::vector<uint32_t> freeCores(pools, model.poolCores);
  std::vector<std::deque<size_t>> readyFifo(pools);
  // Shared link: when each rank's link finishes the transfers queued so far.
  const bool linkShared = model.linkTotalBytes > 0 && !model.linkBytes.empty();
  std::vector<double> linkFree(m.R, 0.0);

  // The trace: when each slot's last task finished, and per (rank, task)
  // node the event and signalling node of the wait met last.
  std::vector<double> slotFree(slots, 0.0);
  std::vector<uint32_t> metEvent;
  std::vector<uint64_t> metBy;
  if (recordTrace) {
    metEvent.assign(size_t(m.R) * T, 0);
    metBy.assign(size_t(m.R) * T, kNoNode);
    result.trace.source = "simulated";
  }
  auto nanos = [](double seconds) { return int64_t(std::llround(seconds * 1e9)); };

  auto startHead = [&](size_t s, double now) {
    uint32_t task = run.head(s);
    uint32_t rank = run.rankOf(s);
    double end = now + costs[task];
    if (linkShared && model.linkBytes[task] > 0) {
      double transferEnd = std::max(now, linkFree[rank]) + model.linkBytes[task] / model.linkTotalBytes;
      linkFree[rank] = transferEnd;
      end = std::max(end, transferEnd);
    }
    if (rank == 0) {
      result.start[task] = now;
      result.finish[task] = end;
    }
    if (recordTrace) {
      uint64_t node = uint64_t(rank) * T + task;
      uint32_t queue = run.queueOfSlot(s);
      if (metBy[node] != kNoNode && nanos(now) > nanos(slotFree[s])) {
        trace::WaitSpan wait;
        wait.rank = rank;
        wait.queue = queue;
        wait.task = task;
        wait.event = metEvent[node];
        wait.beginNs = nanos(slotFree[s]);
        wait.endNs = nanos(now);
        wait.signalRank = uint32_t(metBy[node] / T);
        wait.signalTask = uint32_t(metBy[node] % T);
        result.trace.waits.push_back(wait);
      }
      result.trace.tasks.push_back({rank, queue, task, queue, nanos(now), nanos(end)});
    }
    pending.push({end, seq++, s});
  };

  // Starts the slot's head if it is ready and a core is free; a ready head
  // without a core joins its pool's FIFO.
  auto tryStart = [&](size_t s, double now) {
    if (run.drained(s))
      return;
    if (!run.headReady(s)) {
      run.blocked[s] = 1;
      return;
    }
    if (pooled) {
      size_t pool = poolOf(s);
      if (freeCores[pool] == 0) {
        readyFifo[pool].push_back(s);
        return;
      }
      --freeCores[pool];
    }
    startHead(s, now);
  };

  for (size_t s = 0; s < slots; ++s)
    tryStart(s, 0.0);

  std::vector<size_t> woken;
  while (!pending.empty()) {
    Finish done = pending.top();
    pending.pop();
    double now = done.time;
    result.makespan = std::max(result.makespan, now);
    uint32_t rank = run.rankOf(done.slot);
    uint32_t task = run.head(done.slot);
    uint64_t node = uint64_t(rank) * T + task;
    double chain = pathStart[node] + costs[task];
    run.sendSignals(
        rank, task,
        [&](uint32_t to, uint32_t event, uint32_t peerOffset) {
          size_t c = size_t(to) * m.E + event;
          // On a tie, the later arrival: the one that held the waiters up.
          if (eventPred[c] == kNoNode || chain >= eventPath[c]) {
            eventPath[c] = chain;
            eventPred[c] = node;
            if (fold)
              eventShift[c] = peerOffset;
          }
        },
        [&](uint32_t to, uint32_t event, const Waiter &waiter) {
          size_t c = size_t(to) * m.E + event;
          uint64_t waiterNode = uint64_t(to) * T + waiter.task;
          if (recordTrace) {
            metEvent[waiterNode] = event;
            metBy[waiterNode] = node;
          }
          if (pathPred[waiterNode] == kNoNode || eventPath[c] >= pathStart[waiterNode]) {
            pathStart[waiterNode] = eventPath[c];
            pathPred[waiterNode] = eventPred[c];
            if (fold)
              pathShift[waiterNode] = eventShift[c];
          }
        },
        [&](size_t s) { woken.push_back(s); });
    run.advance(done.slot);
    slotFree[done.slot] = now;
    if (pooled)
      ++freeCores[poolOf(done.slot)];
    tryStart(done.slot, now);
    for (size_t s : woken)
      tryStart(s, now);
    woken.clear();
    if (pooled) {
      size_t pool = poolOf(done.slot);
      while (freeCores[pool] > 0 && !readyFifo[pool].empty()) {
        size_t s = readyFifo[pool].front();
        readyFifo[pool].pop_front();
        --freeCores[pool];
        startHead(s, now);
      }
    }
  }

  TimedRun failed;
  if (run.ran != totalRuns(m) || !checkFinalCounters(m, run).ok()) {
    // Which tasks can run does not depend on the order they run in, so the
    // proof gets stuck too; its message names the ranks.
    failed.status = proveDeadlockFree(program);
    if (failed.status.ok())
      failed.status = Status::error("internal error: the timed simulation got stuck where the "
                                    "deadlock proof did not");
    return failed;
  }

  result.queues.resize(m.Q);
  for (uint32_t q = 0; q < m.Q; ++q) {
    const QueueRecord &queue = program.queues[q];
    QueueTiming &timing = result.queues[q];
    for (uint32_t k = 0; k < queue.entryCount; ++k) {
      uint32_t task = program.queueEntries[size_t(queue.firstEntry) + k];
      timing.busySeconds += costs[task];
      timing.finishSeconds = std::max(timing.finishSeconds, result.finish[task]);
    }
  }

  // The critical path ends at the node whose chain is the longest; rank 0's
  // first such node, since every rank has the same chains.
  uint64_t last = kNoNode;
  double longest = -1;
  for (uint64_t node = 0; node < uint64_t(m.R) * T; ++node) {
    double chain = pathStart[node] + costs[node % T];
    if (chain > longest) {
      longest = chain;
      last = node;
    }
  }
  if (last != kNoNode) {
    result.criticalPathSeconds = longest;
    // Folded, a node's rank is its TP coordinate on EP rank `ep`, which
    // steps back by each signal's peer offset along the path.
    const uint32_t groupRanks = program.ranks();
    uint32_t lastRank = uint32_t(last / T), ep = 0;
    for (uint64_t node = last; node != kNoNode; node = pathPred[node]) {
      result.criticalPath.push_back(uint32_t(node % T));
      uint32_t rank = uint32_t(node / T);
      if (fold) {
        rank = ep * program.tpRanks + rank;
        ep = (ep + program.epRanks - pathShift[node]) % program.epRanks;
      }
      result.criticalPathRanks.push_back(
          uint32_t((uint64_t(rank) + groupRanks - lastRank) % groupRanks));
    }
    std::reverse(result.criticalPath.begin(), result.criticalPath.end());
    std::reverse(result.criticalPathRanks.begin(), result.criticalPathRanks.end());
  }
  return result;
}

} // namespace moec::target
