//===- Schedule.cpp - Per-core in-order queues for a task program ---------===//

#include "compiler/target/Schedule.h"

#include "compiler/target/Cost.h"

#include <fmt/format.h>

#include <cmath>
#include <algorithm>
#include <functional>
#include <queue>
#include <utility>
#include <vector>

namespace moec::target {

using namespace moec::format;

namespace {

/// A cube task that costs less than this share of the path after it takes
/// that path's priority (scheduleQueues).
constexpr double kSmallShare = 0.05;

/// The dependency graph of one rank, every rank taken alike: a task waits on
/// events, an event is complete once all its signals arrived.
struct DependencyGraph {
  std::vector<uint32_t> waiterBegin;    ///< event -> offset into waiters (E + 1)
  std::vector<uint32_t> waiters;        ///< the tasks waiting on each event, by event
  std::vector<uint32_t> pendingSignals; ///< event -> signals before complete

  /// The tasks that wait on `event`, as a range.
  struct Range {
    const uint32_t *first, *last;
    const uint32_t *begin() const { return first; }
    const uint32_t *end() const { return last; }
  };
  Range waitersOf(uint32_t event) const {
    return {waiters.data() + waiterBegin[event], waiters.data() + waiterBegin[event + 1]};
  }
};

DependencyGraph buildGraph(const TaskProgram &p) {
  DependencyGraph g;
  const size_t E = p.events.size();
  g.waiterBegin.assign(E + 1, 0);
  g.pendingSignals.assign(E, 0);
  for (const TaskRecord &task : p.tasks) {
    for (uint32_t i = 0; i < task.signalCount; ++i)
      ++g.pendingSignals[p.signals[task.firstSignal + i].event];
    for (uint32_t i = 0; i < task.waitCount; ++i)
      ++g.waiterBegin[p.waits[task.firstWait + i].event + 1];
  }
  for (size_t e = 0; e < E; ++e)
    g.waiterBegin[e + 1] += g.waiterBegin[e];
  g.waiters.resize(g.waiterBegin[E]);
  std::vector<uint32_t> fill(g.waiterBegin.begin(), g.waiterBegin.end() - 1);
  for (uint32_t t = 0; t < p.tasks.size(); ++t) {
    const TaskRecord &task = p.tasks[t];
    for (uint32_t i = 0; i < task.waitCount; ++i)
      g.waiters[fill[p.waits[task.firstWait + i].event]++] = t;
  }
  return g;
}

} // namespace

Status scheduleQueues(TaskProgram *program, const TargetProfile &profile, uint32_t cubeCores,
                      uint32_t vectorCores, ScheduleEstimate *estimate) {
  TaskProgram &p = *program;
  if (cubeCores == 0 || vectorCores == 0)
    return Status::error("a schedule needs at least one cube and one vector core");
  const size_t n = p.tasks.size();
  const CostModel model = costModel(p, profile);
  const std::vector<double> &cost = model.costs;
  DependencyGraph g = buildGraph(p);
  // A rank's puts to its peers share its link: an op's puts take at least
  // their bytes over the link's rate, after the first of them starts.
  const bool linkShared = model.linkTotalBytes > 0;
  std::vector<double> opLinkSeconds(p.ops.size(), 0.0);
  if (linkShared)
    for (uint32_t t = 0; t < n; ++t)
      opLinkSeconds[p.tasks[t].op] += model.linkBytes[t] / model.linkTotalBytes;

  // Topological order of the tasks (Kahn), counting unfinished waits.
  std::vector<uint32_t> waitsLeft(n, 0);
  for (uint32_t t = 0; t < n; ++t)
    waitsLeft[t] = p.tasks[t].waitCount;
  std::vector<uint32_t> signalsLeft = g.pendingSignals;
  std::vector<uint32_t> order;
  order.reserve(n);
  for (uint32_t t = 0; t < n; ++t)
    if (waitsLeft[t] == 0)
      order.push_back(t);
  for (size_t i = 0; i < order.size(); ++i) {
    const TaskRecord &task = p.tasks[order[i]];
    for (uint32_t s = 0; s < task.signalCount; ++s) {
      uint32_t event = p.signals[task.firstSignal + s].event;
      if (--signalsLeft[event] == 0)
        for (uint32_t w : g.waitersOf(event))
          if (--waitsLeft[w] == 0)
            order.push_back(w);
    }
  }
  if (order.size() != n) {
    uint32_t stuck = 0;
    while (waitsLeft[stuck] == 0)
      ++stuck;
    return Status::error(fmt::format(
        "the tasks' events form a cycle: {} of {} tasks can never start (task {} of op '{}' is "
        "one)",
        n - order.size(), n, stuck, p.name(p.ops[p.tasks[stuck].op].name)));
  }

  // Bottom levels: a task's cost plus the longest path after it, the
  // priority; for a put, the link time of its op's puts if longer. The
  // critical path is the longest chain of costs alone. A cube task that
  // costs a small share of the path after it (a LoRA adapter's rank-r
  // product ahead of the base GMM that reads it) takes the priority of what
  // follows it, so that it runs just before its successor rather than with
  // all of its op's tiles far ahead of theirs: in-order queues would else
  // hold every successor behind the last expert's small task, whose rows
  // come last. (Measured on the CPU; a target with a shared cache, whose
  // LoRA GMMs stay apart, keeps the plain bottom-level order.)
  std::vector<double> eventLevel(p.events.size(), 0), level(n, 0), priority(n, 0);
  std::vector<double> eventChain(p.events.size(), 0);
  double criticalPath = 0;
  for (size_t i = n; i-- > 0;) {
    uint32_t t = order[i];
    const TaskRecord &task = p.tasks[t];
    double after = 0, chainAfter = 0;
    for (uint32_t s = 0; s < task.signalCount; ++s) {
      const uint32_t event = p.signals[task.firstSignal + s].event;
      after = std::max(after, eventLevel[event]);
      chainAfter = std::max(chainAfter, eventChain[event]);
    }
    level[t] = std::max(cost[t], isPut(p.ops[task.op].kind) ? opLinkSeconds[task.op] : 0.0) + after;
    priority[t] =
        !profile.sharedCache && task.coreKind == CoreKind::Cube && cost[t] < kSmallShare * after
            ? after
            : level[t];
    const double chain = cost[t] + chainAfter;
    criticalPath = std::max(criticalPath, chain);
    for (uint32_t w = 0; w < task.waitCount; ++w) {
      uint32_t event = p.waits[task.firstWait + w].event;
      eventLevel[event] = std::max(eventLevel[event], level[t]);
      eventChain[event] = std::max(eventChain[event], chain);
    }
  }

  // List scheduling, one kind of core at a time interleaved by time.
  struct Kind {
    CoreKind kind;
    uint32_t cores;
    // (free time, core) of every core, earliest first.
    std::priority_queue<std::pair<double, uint32_t>, std::vector<std::pair<double, uint32_t>>,
                        std::greater<>>
        free;
    // Tasks whose events are complete: (ready time, task), earliest first.
    std::priority_queue<std::pair<double, uint32_t>, std::vector<std::pair<double, uint32_t>>,
                        std::greater<>>
        pending;
    std::vector<std::vector<uint32_t>> queues;
    double busy = 0;
  };
  // Among equal priorities, the tiles of the lower expert first, then the
  // lower task (a small task before the successor whose priority it took).
  std::vector<uint32_t> expertOf(n, 0);
  for (uint32_t t = 0; t < n; ++t) {
    const OpRecord &op = p.ops[p.tasks[t].op];
    expertOf[t] = tileCoord(p.tilings[op.tiling], t - op.firstTask).expert;
  }
  auto higher = [&](uint32_t a, uint32_t b) { // b before a?
    if (priority[a] != priority[b])
      return priority[a] < priority[b];
    if (expertOf[a] != expertOf[b])
      return expertOf[a] > expertOf[b];
    return a > b;
  };
  // Where a rank's puts share a link, they take only as many vector queues
  // as it takes to fill it (the first ones), and the other vector work the
  // rest: more puts at once would only wait for the link, holding cores.
  uint32_t putQueues = 0;
  if (linkShared && profile.linkBytes > 0) {
    const double fill = 2 * std::ceil(model.linkTotalBytes / profile.linkBytes);
    if (fill < vectorCores)
      putQueues = uint32_t(std::max(1.0, fill));
  }
  Kind kinds[3] = {{CoreKind::Cube, cubeCores, {}, {}, {}, 0},
                   {CoreKind::Vector, vectorCores - putQueues, {}, {}, {}, 0},
                   {CoreKind::Vector, putQueues, {}, {}, {}, 0}};
  std::vector<std::priority_queue<uint32_t, std::vector<uint32_t>, decltype(higher)>> ready(
      3, std::priority_queue<uint32_t, std::vector<uint32_t>, decltype(higher)>(higher));
  for (Kind &k : kinds) {
    k.queues.resize(k.cores);
    for (uint32_t c = 0; c < k.cores; ++c)
      k.free.push({0.0, c});
  }
  // Where a rank's cube and vector queues share its cores (an H100 SM runs
  // either kind of task), a task also takes one of the pool's cores: when
  // each frees up, earliest first.
  const bool pooled = profile.sharing == CoreSharing::Rank;
  std::priority_queue<double, std::vector<double>, std::greater<>> pool;
  if (pooled)
    for (uint32_t c = 0; c < std::max(cubeCores, vectorCores); ++c)
      pool.push(0.0);
  auto kindOf = [&](uint32_t t) {
    return p.tasks[t].coreKind == CoreKind::Cube       ? 0
           : putQueues > 0 && isPut(p.ops[p.tasks[t].op].kind) ? 2
                                                               : 1;
  };

  std::vector<double> readyAt(n, 0), finish(n, 0), eventDone(p.events.size(), 0);
  double linkFree = 0; // when the rank's link has sent the puts placed so far
  signalsLeft = g.pendingSignals;
  for (uint32_t t = 0; t < n; ++t)
    waitsLeft[t] = p.tasks[t].waitCount;
  for (uint32_t t = 0; t < n; ++t)
    if (waitsLeft[t] == 0)
      kinds[kindOf(t)].pending.push({0.0, t});

  size_t placed = 0;
  double makespan = 0;
  while (placed < n) {
    // The kind whose next decision comes first: its earliest free core, or
    // the earliest ready task if that is later.
    int pick = -1;
    double pickTime = 0;
    for (int k = 0; k < 3; ++k) {
      if (kinds[k].pending.empty() && ready[k].empty())
        continue;
      double t = kinds[k].free.top().first;
      if (pooled)
        t = std::max(t, pool.top());
      if (ready[k].empty())
        t = std::max(t, kinds[k].pending.top().first);
      if (pick < 0 || t < pickTime) {
        pick = k;
        pickTime = t;
      }
    }
    if (pick < 0)
      return Status::error("internal error: the scheduler ran out of ready tasks");
    Kind &k = kinds[pick];
    while (!k.pending.empty() && k.pending.top().first <= pickTime) {
      ready[pick].push(k.pending.top().second);
      k.pending.pop();
    }
    uint32_t t = ready[pick].top();
    ready[pick].pop();
    auto [coreFree, core] = k.free.top();
    k.free.pop();
    double start = std::max(coreFree, readyAt[t]);
    if (pooled) {
      start = std::max(start, pool.top());
      pool.pop();
    }
    finish[t] = start + cost[t];
    if (linkShared && model.linkBytes[t] > 0) {
      linkFree = std::max(linkFree, start) + model.linkBytes[t] / model.linkTotalBytes;
      finish[t] = std::max(finish[t], linkFree);
    }
    makespan = std::max(makespan, finish[t]);
    k.busy += cost[t];
    k.free.push({finish[t], core});
    if (pooled)
      pool.push(finish[t]);
    k.queues[core].push_back(t);
    ++placed;
    const TaskRecord &task = p.tasks[t];
    for (uint32_t s = 0; s < task.signalCount; ++s) {
      uint32_t event = p.signals[task.firstSignal + s].event;
      eventDone[event] = std::max(eventDone[event], finish[t]);
      if (--signalsLeft[event] > 0)
        continue;
      for (uint32_t w : g.waitersOf(event)) {
        readyAt[w] = std::max(readyAt[w], eventDone[event]);
        if (--waitsLeft[w] == 0)
          kinds[kindOf(w)].pending.push({readyAt[w], w});
      }
    }
  }

  p.queues.clear();
  p.queueEntries.clear();
  // Vector queues 0 .. putQueues - 1 are the puts'.
  for (Kind *k : {&kinds[0], &kinds[2], &kinds[1]})
    for (uint32_t c = 0; c < k->cores; ++c) {
      QueueRecord queue;
      queue.coreKind = k->kind;
      queue.coreIndex = k == &kinds[1] ? putQueues + c : c;
      queue.firstEntry = uint32_t(p.queueEntries.size());
      queue.entryCount = uint32_t(k->queues[c].size());
      p.queueEntries.insert(p.queueEntries.end(), k->queues[c].begin(), k->queues[c].end());
      p.queues.push_back(queue);
    }
  if (estimate) {
    estimate->makespan = makespan;
    estimate->criticalPath = criticalPath;
    estimate->cubeBusy = kinds[0].busy;
    estimate->vectorBusy = kinds[1].busy + kinds[2].busy;
  }
  return Status::success();
}

} // namespace moec::target
