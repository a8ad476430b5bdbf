//===- SimulateTest.cpp - Tests for the deadlock proof, the timed simulation
//                        and `moec dump`'s formatting ----------------------===//

#include "compiler/target/Schedule.h"
#include "compiler/target/Simulate.h"
#include "format/TaskBinary.h"
#include "tests/unit/support/ProgramBuilder.h"
#include "compiler/inspect/Dump.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <cstdint>
#include <regex>
#include <string>
#include <vector>

using namespace moec;
using namespace moec::format;
using moec::target::proveDeadlockFree;
using moec::target::simulateTimed;
using moec::target::TimedRun;
using moec::test::kFinal;
using moec::test::ProgramBuilder;
using moec::test::requireValid;

namespace {

/// Returns the error message of `status`, requiring it to be an error.
std::string errorOf(const Status &status) {
  REQUIRE_FALSE(status.ok());
  return status.message();
}

/// A forward program for 2 ranks: a dispatch op of 2 vector tasks (tile
/// peer 0 puts to its own rank, tile peer 1 to the other rank), each adding
/// 1 to the cross-rank event 'recv' of the rank it puts to, and an up_proj
/// op of 1 cube task that waits for both puts and fires 'done'.
TaskProgram twoRankProgram() {
  ProgramBuilder b(2, 1);
  uint32_t dispatch = b.op("dispatch", OpKind::Dispatch, CoreKind::Vector, 2, 2);
  uint32_t gmm = b.op("up_proj", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t recv = b.event("recv", EventKind::CrossRank);
  uint32_t done = b.event("done", EventKind::Terminate);
  b.signal(dispatch + 0, recv, 1, 0);
  b.signal(dispatch + 1, recv, 1, 1);
  b.wait(gmm, recv);
  b.signal(gmm, done);
  b.queue(CoreKind::Vector, 0, {dispatch, dispatch + 1});
  b.queue(CoreKind::Cube, 0, {gmm});
  return b.build();
}

/// Two queues of one rank whose heads wait for each other: a (cube core 0)
/// waits for b.done, b (vector core 1) for a.done.
TaskProgram twoQueueCycle() {
  ProgramBuilder b;
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t c = b.op("b", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t aDone = b.event("a.done");
  uint32_t bDone = b.event("b.done");
  b.wait(a, bDone);
  b.signal(a, aDone);
  b.wait(c, aDone);
  b.signal(c, bDone);
  b.queue(CoreKind::Cube, 0, {a});
  b.queue(CoreKind::Vector, 1, {c});
  return b.build();
}

/// A diamond A -> {B, C} -> D with A, B, C on cube cores and D on vector
/// core 0. With `shareCore`, A, B and C share cube core 0; else C runs on
/// cube core 1.
TaskProgram diamond(bool shareCore) {
  ProgramBuilder b;
  uint32_t a = b.op("A", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t bb = b.op("B", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t c = b.op("C", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t d = b.op("D", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t ea = b.event("a"), eb = b.event("b"), ec = b.event("c");
  b.signal(a, ea);
  b.wait(bb, ea);
  b.signal(bb, eb);
  b.wait(c, ea);
  b.signal(c, ec);
  b.wait(d, eb);
  b.wait(d, ec);
  if (shareCore) {
    b.queue(CoreKind::Cube, 0, {a, bb, c});
  } else {
    b.queue(CoreKind::Cube, 0, {a, bb});
    b.queue(CoreKind::Cube, 1, {c});
  }
  b.queue(CoreKind::Vector, 0, {d});
  return b.build();
}

/// A layered program of R ranks: `ops` ops of `width` tasks, alternating
/// cube and vector, on 16 cores of each kind. Task j of op k waits for 4 of
/// the 8 events of op k - 1 and signals event j % 8 of op k on the rank
/// j % R ahead.
TaskProgram layeredProgram(uint32_t ranks, uint32_t ops, uint32_t width) {
  ProgramBuilder b(ranks, 1);
  constexpr uint32_t kGroups = 8, kCores = 16;
  std::vector<uint32_t> first(ops);
  std::vector<std::vector<uint32_t>> events(ops);
  for (uint32_t k = 0; k < ops; ++k) {
    bool cube = k % 2 == 0;
    first[k] = b.op(fmt::format("op{}", k), cube ? OpKind::Gmm : OpKind::Swiglu,
                    cube ? CoreKind::Cube : CoreKind::Vector, width);
    for (uint32_t g = 0; g < kGroups; ++g)
      events[k].push_back(b.event(fmt::format("op{}.g{}", k, g), EventKind::CrossRank));
  }
  for (uint32_t k = 0; k < ops; ++k)
    for (uint32_t j = 0; j < width; ++j) {
      uint32_t task = first[k] + j;
      if (k > 0)
        for (uint32_t i = 0; i < 4; ++i)
          b.wait(task, events[k - 1][(j + i) % kGroups]);
      b.signal(task, events[k][j % kGroups], 1, j % ranks);
    }
  for (uint32_t kind = 0; kind < 2; ++kind)
    for (uint32_t core = 0; core < kCores; ++core) {
      std::vector<uint32_t> tasks;
      for (uint32_t k = kind; k < ops; k += 2)
        for (uint32_t j = core; j < width; j += kCores)
          tasks.push_back(first[k] + j);
      b.queue(kind == 0 ? CoreKind::Cube : CoreKind::Vector, core, tasks);
    }
  return b.build();
}

} // namespace

//===----------------------------------------------------------------------===//
// Deadlock proof
//===----------------------------------------------------------------------===//

TEST_CASE("a two-rank program with puts completes", "[simulate]") {
  TaskProgram program = twoRankProgram();
  requireValid(program);
  Status status = proveDeadlockFree(program);
  INFO(status.message());
  CHECK(status.ok());
}

TEST_CASE("two queues waiting on each other are a cycle", "[simulate]") {
  TaskProgram program = twoQueueCycle();
  requireValid(program);
  std::string message = errorOf(proveDeadlockFree(program));
  INFO(message);
  CHECK_THAT(message, Catch::StartsWith("deadlock: the schedule cannot complete (rank 0: 2 of 2 "
                                        "queues stuck). Cycle:"));
  CHECK_THAT(message, Catch::Contains("cube core 0 waits at task 0 (op 'a', tile e0 r0 c0) for "
                                      "event 1 'b.done' (needs 1, has 0); it is signalled by "
                                      "task 1 (op 'b') at the head of vector core 1"));
  CHECK_THAT(message, Catch::Contains("vector core 1 waits at task 1 (op 'b', tile e0 r0 c0) for "
                                      "event 0 'a.done' (needs 1, has 0); it is signalled by "
                                      "task 0 (op 'a') at the head of cube core 0"));
  CHECK_THAT(message, Catch::EndsWith("— the cycle closes."));
  // A few lines, whatever the program.
  CHECK(std::count(message.begin(), message.end(), '\n') == 2);

  TimedRun run = simulateTimed(program, {1.0, 1.0});
  CHECK_FALSE(run.ok());
  CHECK(run.status.message() == message);
}

TEST_CASE("a cycle across ranks names the ranks", "[simulate]") {
  // Task 0 (cube) waits for x, which task 1 (vector) of the rank behind
  // signals; task 1 waits for y, which task 0 of the rank behind signals.
  ProgramBuilder b(2, 1);
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t c = b.op("b", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t x = b.event("x", EventKind::CrossRank);
  uint32_t y = b.event("y", EventKind::CrossRank);
  b.wait(a, x);
  b.signal(a, y, 1, 1);
  b.wait(c, y);
  b.signal(c, x, 1, 1);
  b.queue(CoreKind::Cube, 0, {a});
  b.queue(CoreKind::Vector, 0, {c});
  TaskProgram program = b.build();
  requireValid(program);
  std::string message = errorOf(proveDeadlockFree(program));
  INFO(message);
  CHECK_THAT(message, Catch::Contains("(rank 0: 2 of 2 queues stuck; 2 of 2 ranks stuck)"));
  CHECK_THAT(message, Catch::Contains("rank 0 cube core 0 waits at task 0 (op 'a', tile e0 r0 "
                                      "c0) for event 0 'x' (needs 1, has 0); it is signalled by "
                                      "task 1 (op 'b') at the head of rank 1 vector core 0"));
  CHECK_THAT(message, Catch::Contains("rank 1 vector core 0 waits at task 1 (op 'b', tile e0 r0 "
                                      "c0) for event 1 'y' (needs 1, has 0); it is signalled by "
                                      "task 0 (op 'a') at the head of rank 0 cube core 0"));
  CHECK_THAT(message, Catch::EndsWith("the cycle closes."));
}

TEST_CASE("an event that cannot reach a wait's threshold is a threshold bug", "[simulate]") {
  ProgramBuilder b;
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t c = b.op("b", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t e = b.event("e");
  b.signal(a, e);
  b.wait(c, e, 2);
  b.queue(CoreKind::Cube, 0, {a});
  b.queue(CoreKind::Vector, 0, {c});
  TaskProgram program = b.build();
  program.events[e].threshold = 2; // the signals add up to 1
  CHECK_THAT(errorOf(validateTaskProgram(program)),
             Catch::Contains("its signals add up to 1, but its threshold is 2"));
  std::string message = errorOf(proveDeadlockFree(program));
  INFO(message);
  CHECK_THAT(message, Catch::StartsWith("deadlock: the schedule cannot complete (rank 0: 1 of 2 "
                                        "queues stuck)."));
  CHECK_THAT(message, Catch::Contains("Event 0 'e' can never reach 2 on rank 0: task 1 (op 'b', "
                                      "tile e0 r0 c0) on vector core 0 waits for it, but it has 1 "
                                      "and the tasks that have not run would add only 0 more"));
  CHECK_THAT(message, Catch::Contains("the event's threshold is 2, but its signals add up to 1"));
  CHECK_THAT(message, Catch::Contains("threshold bug, not a cycle"));
}

TEST_CASE("events must end at their thresholds", "[simulate]") {
  ProgramBuilder b;
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t e = b.event("e");
  uint32_t done = b.event("done", EventKind::Terminate);
  b.signal(a, e);
  b.signal(a, done);
  b.queue(CoreKind::Cube, 0, {a});
  TaskProgram good = b.build();
  requireValid(good);
  CHECK(proveDeadlockFree(good).ok());

  SECTION("below") {
    TaskProgram program = good;
    program.events[e].threshold = 3;
    CHECK(errorOf(proveDeadlockFree(program)) ==
          "event 0 'e' ends at 1 on rank 0 after every queue drained, below its threshold 3 (its "
          "signals add up to 1)");
  }
  SECTION("above") {
    TaskProgram program = good;
    program.events[e].threshold = 0;
    CHECK_THAT(errorOf(proveDeadlockFree(program)),
               Catch::StartsWith("event 0 'e' ends at 1 on rank 0 after every queue drained, "
                                 "above its threshold 0"));
  }
  SECTION("a terminate event that never fires") {
    TaskProgram program = good;
    program.events[done].threshold = 2;
    program.events[e].threshold = 5;
    CHECK(errorOf(proveDeadlockFree(program)) ==
          "event 0 'e' ends at 1 on rank 0 after every queue drained, below its threshold 5 (its "
          "signals add up to 1) (1 more (rank, event) pairs do not end at their threshold)");
    program.events[e].threshold = 1;
    CHECK(errorOf(proveDeadlockFree(program)) ==
          "terminate event 1 'done' never fires on rank 0: every queue drained with it at 1 of "
          "its threshold 2 (its signals add up to 1)");
  }
}

TEST_CASE("a queue whose first task waits for its second deadlocks", "[simulate]") {
  ProgramBuilder b;
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 2);
  uint32_t e = b.event("e");
  b.wait(a, e);
  b.signal(a + 1, e);
  b.queue(CoreKind::Cube, 0, {a, a + 1});
  TaskProgram program = b.build();
  requireValid(program);
  std::string message = errorOf(proveDeadlockFree(program));
  INFO(message);
  CHECK_THAT(message, Catch::Contains("(rank 0: 1 of 1 queues stuck)"));
  CHECK_THAT(message, Catch::Contains("cube core 0 waits at task 0 (op 'a', tile e0 r0 c0) for "
                                      "event 0 'e' (needs 1, has 0); it is signalled by task 1 "
                                      "(op 'a') queued on cube core 0 at position 1, behind task "
                                      "0 (op 'a') at position 0 — the cycle closes."));
  CHECK_THAT(message, Catch::Contains("queued behind the task that waits for it"));
}

TEST_CASE("a long cycle is listed in a few lines", "[simulate]") {
  // 20 queues in a ring: the head of queue i waits for the task of queue
  // i + 1.
  constexpr uint32_t n = 20;
  ProgramBuilder b;
  uint32_t first = b.op("ring", OpKind::Swiglu, CoreKind::Vector, n);
  std::vector<uint32_t> events;
  for (uint32_t i = 0; i < n; ++i)
    events.push_back(b.event(fmt::format("ring{}", i)));
  for (uint32_t i = 0; i < n; ++i) {
    b.wait(first + i, events[(i + 1) % n]);
    b.signal(first + i, events[i]);
    b.queue(CoreKind::Vector, i, {first + i});
  }
  TaskProgram program = b.build();
  requireValid(program);
  std::string message = errorOf(proveDeadlockFree(program));
  INFO(message);
  CHECK(std::count(message.begin(), message.end(), '\n') == 9);
  CHECK_THAT(message, Catch::Contains("... (12 more steps, back to vector core 0) — the cycle "
                                      "closes."));
}

TEST_CASE("malformed programs are refused, not simulated", "[simulate]") {
  TaskProgram program = twoQueueCycle();
  program.signals[0].event = 9;
  CHECK(errorOf(proveDeadlockFree(program)) ==
        "the program is malformed: signal 0 names event 9, but there are 2 events");
  program = twoQueueCycle();
  program.queueEntries[1] = 0;
  CHECK_THAT(errorOf(proveDeadlockFree(program)), Catch::Contains("task 0 is queued twice"));
  CHECK_FALSE(simulateTimed(twoQueueCycle(), {1.0}).ok());
}

//===----------------------------------------------------------------------===//
// Timed simulation
//===----------------------------------------------------------------------===//

TEST_CASE("the timed simulation of a diamond", "[simulate]") {
  // Costs: A 1, B 2, C 3, D 1.
  std::vector<double> costs = {1, 2, 3, 1};
  SECTION("B and C on one core") {
    TaskProgram program = diamond(true);
    requireValid(program);
    TimedRun run = simulateTimed(program, costs);
    INFO(run.status.message());
    REQUIRE(run.ok());
    // Cube core 0: A 0..1, B 1..3, C 3..6; vector core 0: D 6..7.
    CHECK(run.start == std::vector<double>{0, 1, 3, 6});
    CHECK(run.finish == std::vector<double>{1, 3, 6, 7});
    CHECK(run.makespan == 7);
    REQUIRE(run.queues.size() == 2);
    CHECK(run.queues[0].busySeconds == 6);
    CHECK(run.queues[0].finishSeconds == 6);
    CHECK(run.queues[1].busySeconds == 1);
    CHECK(run.queues[1].finishSeconds == 7);
    // The longest chain ignores the shared core: A, C, D = 1 + 3 + 1.
    CHECK(run.criticalPathSeconds == 5);
    CHECK(run.criticalPath == std::vector<uint32_t>{0, 2, 3});
    CHECK(run.criticalPathRanks == std::vector<uint32_t>{0, 0, 0});
  }
  SECTION("C on its own core") {
    TaskProgram program = diamond(false);
    requireValid(program);
    TimedRun run = simulateTimed(program, costs);
    REQUIRE(run.ok());
    // A 0..1; B 1..3 and C 1..4 in parallel; D 4..5.
    CHECK(run.finish == std::vector<double>{1, 3, 4, 5});
    CHECK(run.makespan == 5);
    CHECK(run.criticalPathSeconds == 5);
    CHECK(run.criticalPath == std::vector<uint32_t>{0, 2, 3});
  }
}

TEST_CASE("the timed simulation of two ranks with puts", "[simulate]") {
  // Each rank: vector core 0 runs dispatch tile p0 (cost 1, to itself) then
  // tile p1 (cost 2, to the other rank); up_proj (cost 3) waits for both
  // puts: its own at 1, the other rank's at 3.
  TimedRun run = simulateTimed(twoRankProgram(), {1, 2, 3});
  INFO(run.status.message());
  REQUIRE(run.ok());
  CHECK(run.start == std::vector<double>{0, 1, 3});
  CHECK(run.makespan == 6);
  CHECK(run.queues[0].finishSeconds == 3);
  CHECK(run.queues[1].busySeconds == 3);
  CHECK(run.queues[1].finishSeconds == 6);
  // The put p1 of the other rank, then up_proj: 2 + 3.
  CHECK(run.criticalPathSeconds == 5);
  CHECK(run.criticalPath == std::vector<uint32_t>{1, 2});
  CHECK(run.criticalPathRanks == std::vector<uint32_t>{1, 0});
}

TEST_CASE("a wait for a partial count depends on the signals that met it", "[simulate]") {
  // Tasks 0 (cost 1) and 1 (cost 5) each add 1 to e on their own cores;
  // task 2 waits for e >= 1, so it starts when task 0 is done.
  ProgramBuilder b;
  uint32_t p = b.op("p", OpKind::Gmm, CoreKind::Cube, 2);
  uint32_t w = b.op("w", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t e = b.event("e");
  b.signal(p, e);
  b.signal(p + 1, e);
  b.wait(w, e, 1);
  b.queue(CoreKind::Cube, 0, {p});
  b.queue(CoreKind::Cube, 1, {p + 1});
  b.queue(CoreKind::Vector, 0, {w});
  TaskProgram program = b.build();
  requireValid(program);
  TimedRun run = simulateTimed(program, {1, 5, 1});
  REQUIRE(run.ok());
  CHECK(run.start[w] == 1);
  CHECK(run.makespan == 5);
  CHECK(run.criticalPathSeconds == 5);
  CHECK(run.criticalPath == std::vector<uint32_t>{1});
}

namespace {

/// Whether every queue of every rank of `p` drains, run the plain way: each
/// rank with its own counters, a signal reaching peerRank(), until no head
/// can run. The judge of the proof, which runs one EP rank for all.
bool drainsOnEveryRank(const TaskProgram &p) {
  const uint32_t R = p.ranks(), E = uint32_t(p.events.size()), Q = uint32_t(p.queues.size());
  std::vector<uint64_t> counter(size_t(R) * E, 0);
  std::vector<uint32_t> pos(size_t(R) * Q, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (uint32_t r = 0; r < R; ++r)
      for (uint32_t q = 0; q < Q; ++q)
        for (uint32_t &at = pos[size_t(r) * Q + q]; at < p.queues[q].entryCount; ++at) {
          const TaskRecord &task = p.tasks[p.queueEntries[p.queues[q].firstEntry + at]];
          bool ready = true;
          for (uint32_t k = 0; k < task.waitCount; ++k) {
            const WaitRecord &w = p.waits[task.firstWait + k];
            ready = ready && counter[size_t(r) * E + w.event] >= w.threshold;
          }
          if (!ready)
            break;
          for (uint32_t k = 0; k < task.signalCount; ++k) {
            const SignalRecord &s = p.signals[task.firstSignal + k];
            counter[size_t(p.peerRank(r, s.peerOffset)) * E + s.event] += s.increment;
          }
          progress = true;
        }
  }
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t q = 0; q < Q; ++q)
      if (pos[size_t(r) * Q + q] < p.queues[q].entryCount)
        return false;
  return true;
}

} // namespace

TEST_CASE("the proof and the timed simulation run one rank for all, and agree with running every "
          "rank",
          "[simulate]") {
  // Random programs of 2 to 5 ranks: tasks that signal random events on
  // random peers and wait for random counts of random events, in random
  // queues. Many deadlock (across ranks or within one), many complete.
  std::mt19937 rng(7);
  auto pick = [&](uint32_t n) { return uint32_t(rng() % n); };
  int completes = 0, deadlocks = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const uint32_t ranks = 2 + pick(4), tasks = 2 + pick(7), eventCount = 1 + pick(4);
    ProgramBuilder b(ranks, 1);
    uint32_t first = b.op("a", OpKind::Gmm, CoreKind::Cube, tasks);
    std::vector<uint32_t> events, sums(eventCount, 0);
    for (uint32_t e = 0; e < eventCount; ++e)
      events.push_back(b.event(fmt::format("e{}", e), EventKind::CrossRank));
    for (uint32_t t = 0; t < tasks; ++t)
      for (uint32_t k = pick(3); k-- > 0;) {
        uint32_t e = pick(eventCount), increment = 1 + pick(2);
        b.signal(first + t, events[e], increment, pick(ranks));
        sums[e] += increment;
      }
    for (uint32_t t = 0; t < tasks; ++t)
      for (uint32_t k = pick(3); k-- > 0;) {
        uint32_t e = pick(eventCount);
        if (sums[e] > 0)
          b.wait(first + t, events[e], 1 + pick(sums[e]));
      }
    std::vector<uint32_t> order(tasks);
    for (uint32_t t = 0; t < tasks; ++t)
      order[t] = first + t;
    std::shuffle(order.begin(), order.end(), rng);
    const uint32_t queues = 1 + pick(3);
    for (uint32_t q = 0; q < queues; ++q) {
      std::vector<uint32_t> mine;
      for (uint32_t i = q; i < tasks; i += queues)
        mine.push_back(order[i]);
      b.queue(CoreKind::Cube, q, mine);
    }
    TaskProgram program = b.build();
    const bool drains = drainsOnEveryRank(program);
    Status status = proveDeadlockFree(program);
    INFO("trial " << trial << ": " << status.message());
    REQUIRE(status.ok() == drains);
    (drains ? completes : deadlocks) += 1;
    // The timed simulation folds the ranks the same way unless it records
    // a trace; with no shared cores or link the two runs must agree.
    target::CostModel model;
    for (size_t t = 0; t < program.tasks.size(); ++t)
      model.costs.push_back(0.5 + double(pick(1000)) / 1000);
    TimedRun folded = simulateTimed(program, model, false);
    TimedRun all = simulateTimed(program, model, true);
    REQUIRE(folded.ok() == drains);
    REQUIRE(all.ok() == drains);
    if (!drains) {
      CHECK(folded.status.message() == all.status.message());
      continue;
    }
    CHECK(folded.makespan == Approx(all.makespan).epsilon(1e-12));
    CHECK(folded.criticalPathSeconds == Approx(all.criticalPathSeconds).epsilon(1e-12));
    CHECK(folded.start == all.start);
    CHECK(folded.criticalPath.size() == all.criticalPath.size());
  }
  CHECK(completes > 300);
  CHECK(deadlocks > 300);
}

TEST_CASE("32 ranks of a 25,000-task program", "[simulate]") {
  // A smoke check of the size the proof is built for; no timing asserted.
  TaskProgram program = layeredProgram(32, 25, 1000);
  requireValid(program);
  CHECK(program.tasks.size() == 25000);
  CHECK(program.waits.size() == 96000);
  Status status = proveDeadlockFree(program);
  INFO(status.message());
  CHECK(status.ok());
  TimedRun run = simulateTimed(program, std::vector<double>(program.tasks.size(), 1.0));
  REQUIRE(run.ok());
  // One task per op on the critical path.
  CHECK(run.criticalPathSeconds == 25);
  CHECK(run.criticalPath.size() == 25);
  CHECK(run.makespan >= run.criticalPathSeconds);
}

//===----------------------------------------------------------------------===//
// moec dump
//===----------------------------------------------------------------------===//

namespace {

/// The cpu profile with round numbers.
target::TargetProfile testProfile() {
  target::TargetProfile profile;
  profile.name = "test";
  profile.taskOverhead = 1e-6;
  return profile;
}

/// Counts the matches of `pattern` in `text`.
size_t countMatches(const std::string &text, const std::string &pattern) {
  std::regex re(pattern);
  return size_t(
      std::distance(std::sregex_iterator(text.begin(), text.end(), re), std::sregex_iterator()));
}

} // namespace

TEST_CASE("dump: core selectors and times", "[dump]") {
  inspect::CoreSelector core;
  REQUIRE(inspect::parseCoreSelector("cube:3", &core).ok());
  CHECK(core.kind == CoreKind::Cube);
  CHECK(core.index == 3);
  REQUIRE(inspect::parseCoreSelector("vector:0", &core).ok());
  CHECK(core.kind == CoreKind::Vector);
  for (const char *bad :
       {"cube", "cube:", "gpu:1", "cube:x", "cube:-1", "cube:1:2", ":3", "cube:99999999999"})
    CHECK_THAT(errorOf(inspect::parseCoreSelector(bad, &core)),
               Catch::Contains("expected cube:N or vector:N"));

  CHECK(inspect::formatSeconds(0) == "0 s");
  CHECK(inspect::formatSeconds(1.5e-3) == "1.50 ms");
  CHECK(inspect::formatSeconds(12.34e-6) == "12.3 us");
  CHECK(inspect::formatSeconds(250) == "250 s");
  CHECK(inspect::formatSeconds(5e-9) == "5.00 ns");
}

TEST_CASE("dump: text", "[dump]") {
  TaskProgram program = twoRankProgram();
  target::TargetProfile profile = testProfile();
  inspect::Analysis analysis = inspect::analyzeProgram(program, &profile);
  REQUIRE(analysis.run.ok());
  inspect::FileFacts facts = inspect::factsOf(program, "two.moebin");
  inspect::DumpOptions options;
  std::string text = inspect::dumpText(program, facts, options, analysis);
  INFO(text);
  CHECK_THAT(text, Catch::StartsWith("task binary two.moebin\n"));
  CHECK_THAT(text, Catch::Contains("format version 4; flags 0x0: forward pass, f32 activations"));
  CHECK_THAT(text, Catch::Contains("layer: no layer record (a task program not compiled from a config)"));
  CHECK_THAT(text, Catch::Contains(fmt::format("file size {} bytes; CRC-32 {:#010x}",
                                               facts.fileSize, facts.crc32)));
  CHECK_THAT(text, Catch::Contains("EP ranks 2; local experts 1 (2 experts in all); target 'cpu'"));
  CHECK_THAT(text, Catch::Contains("tensor slots (1):"));
  CHECK_THAT(text, Catch::Contains("ops (2, 3 tasks):"));
  CHECK(countMatches(text, "\n +0 +dispatch +dispatch +2 +vector +1 x 2 x 1 x 1 ") == 1);
  CHECK(countMatches(text, "\n +1 +up_proj +gmm +1 +cube +1 x 1 x 1 x 1 ") == 1);
  CHECK_THAT(text, Catch::Contains("events (2):"));
  CHECK(countMatches(text, "\n +0 +recv +cross-rank +- +2 +2 +1\n") == 1);
  CHECK(countMatches(text, "\n +1 +done +terminate +- +1 +1 +0\n") == 1);
  CHECK_THAT(text, Catch::Contains("vector core 0: 2 tasks, busy "));
  CHECK_THAT(text, Catch::Contains("cube core 0: 1 task, busy "));
  CHECK_THAT(text,
             Catch::Contains("    1 dispatch tile(e0,p1,r0,c0 rows 0..64 cols 0..64) waits [] "
                             "signals [ev0 recv +1 → +1]\n"));
  CHECK_THAT(text, Catch::Contains("    2 up_proj tile(e0,p0,r0,c0 rows 0..64 cols 0..64) waits "
                                   "[ev0 recv >= 2] signals [ev1 done +1]\n"));
  CHECK_THAT(text, Catch::Contains("tasks: 1 cube on 1 queue, 2 vector on 1 queue, 3 in all"));
  CHECK_THAT(text, Catch::Contains("schedule: deadlock-free (every queue of all 2 ranks drains)"));
  CHECK_THAT(text, Catch::Contains("critical path (ending on rank 0): "));
  // The put from the other rank, then up_proj.
  CHECK_THAT(text, Catch::Contains(", 2 tasks: dispatch x1 on rank 1 → up_proj x1\n"));
  CHECK_THAT(text, Catch::Contains("simulated makespan: "));
  CHECK_THAT(text, Catch::Contains("    cube: one queue, cube core 0 ("));

  SECTION("long queues are cut without --core") {
    options.queuePreview = 1;
    std::string cut = inspect::dumpText(program, facts, options, analysis);
    CHECK_THAT(cut, Catch::Contains("    ... 1 more (--core vector:0 lists them all)\n"));
    CHECK_FALSE(cut.find("    1 dispatch") != std::string::npos);
  }
  SECTION("--core shows one queue in full") {
    options.queuePreview = 1;
    options.core = inspect::CoreSelector{CoreKind::Vector, 0};
    REQUIRE(inspect::checkDumpOptions(program, options).ok());
    std::string one = inspect::dumpText(program, facts, options, analysis);
    CHECK_THAT(one, Catch::Contains("queue of vector core 0:\n  vector core 0: 2 tasks"));
    CHECK_THAT(one, Catch::Contains("    0 dispatch"));
    CHECK_THAT(one, Catch::Contains("    1 dispatch"));
    CHECK_FALSE(one.find("cube core 0: 1 task") != std::string::npos);
    CHECK_FALSE(one.find("more (--core") != std::string::npos);
  }
  SECTION("--rank resolves peers and experts") {
    options.rank = 1;
    std::string resolved = inspect::dumpText(program, facts, options, analysis);
    CHECK_THAT(resolved, Catch::Contains("resolved for rank 1"));
    // Tile p1 of rank 1 puts to rank 0: its rows go to rank 0's expert 0,
    // which is expert 0; its own tile p0 stays with expert 1, and rank 1's
    // up_proj computes expert 1.
    CHECK_THAT(resolved, Catch::Contains("    1 dispatch tile(e0,p0,r0,c0 rows 0..64 cols 0..64) "
                                         "waits [] signals [ev0 recv +1 → rank 0]"));
    CHECK_THAT(resolved, Catch::Contains("    0 dispatch tile(e1,p1,r0,c0 rows 0..64 cols 0..64) "
                                         "waits [] signals [ev0 recv +1]"));
    CHECK_THAT(resolved, Catch::Contains("    2 up_proj tile(e1,p0,"));
  }
  SECTION("options that name nothing") {
    options.core = inspect::CoreSelector{CoreKind::Cube, 5};
    CHECK(errorOf(inspect::checkDumpOptions(program, options)) ==
          "the binary has no cube core 5 (its cube cores are 0..0)");
    options.core.reset();
    options.rank = 2;
    CHECK(errorOf(inspect::checkDumpOptions(program, options)) ==
          "--rank 2: the binary runs on 2 ranks (0..1)");
  }
}

TEST_CASE("dump: without a profile, in task counts", "[dump]") {
  TaskProgram program = diamond(true);
  inspect::Analysis analysis =
      inspect::analyzeProgram(program, nullptr, "no profile 'x.json' here");
  std::string text = inspect::dumpText(program, inspect::factsOf(program, "d.moebin"),
                                       inspect::DumpOptions(), analysis);
  INFO(text);
  CHECK_THAT(text, Catch::Contains("statistics (in task counts: every task costs one step):\n"
                                   "  note: no profile 'x.json' here\n"));
  CHECK_THAT(text, Catch::Contains("critical path: 3 steps, 3 tasks: A x1 → C x1 → D x1\n"));
  CHECK_THAT(text, Catch::Contains("simulated makespan: 4 steps"));
  CHECK_THAT(text, Catch::Contains("    cube: one queue, cube core 0 (3 steps)\n"));
  CHECK_THAT(text, Catch::Contains("cube core 0: 3 tasks\n"));

  // Queue balance: uneven and even.
  program = diamond(false);
  text = inspect::dumpText(program, inspect::factsOf(program, "d.moebin"), inspect::DumpOptions(),
                           inspect::analyzeProgram(program, nullptr));
  CHECK_THAT(text, Catch::Contains("    cube: max/mean 1.33 over 2 queues; least cube core 1 (1 "
                                   "step), most cube core 0 (2 steps)\n"));
  program = layeredProgram(2, 3, 32);
  text = inspect::dumpText(program, inspect::factsOf(program, "l.moebin"), inspect::DumpOptions(),
                           inspect::analyzeProgram(program, nullptr));
  CHECK_THAT(text, Catch::Contains("    cube: max/mean 1.00 over 16 queues, each 4 steps\n"));
}

TEST_CASE("dump: a deadlocked program", "[dump]") {
  TaskProgram program = twoQueueCycle();
  target::TargetProfile profile = testProfile();
  inspect::Analysis analysis = inspect::analyzeProgram(program, &profile);
  CHECK_FALSE(analysis.run.ok());
  std::string text = inspect::dumpText(program, inspect::factsOf(program, "c.moebin"),
                                       inspect::DumpOptions(), analysis);
  CHECK_THAT(text, Catch::Contains("  schedule: DEADLOCK\n    deadlock: "));
  nlohmann::json j =
      nlohmann::json::parse(inspect::dumpJson(program, inspect::factsOf(program, "c.moebin"),
                                              inspect::DumpOptions(), analysis)
                                .dump());
  CHECK(j["statistics"]["deadlock_free"] == false);
  CHECK_THAT(j["statistics"]["deadlock"].get<std::string>(), Catch::Contains("the cycle closes"));
}

TEST_CASE("dump: json", "[dump]") {
  TaskProgram program = twoRankProgram();
  target::TargetProfile profile = testProfile();
  inspect::Analysis analysis = inspect::analyzeProgram(program, &profile);
  inspect::DumpOptions options;
  options.queuePreview = 1; // JSON has every task anyway
  nlohmann::json j = nlohmann::json::parse(
      inspect::dumpJson(program, inspect::factsOf(program, "two.moebin"), options, analysis)
          .dump(2));
  CHECK(j["file"]["ep_ranks"] == 2);
  CHECK(j["file"]["target"] == "cpu");
  CHECK(j["file"]["pass"] == "forward");
  CHECK(j["profile"] == "test");
  REQUIRE(j["ops"].size() == 2);
  CHECK(j["ops"][0]["name"] == "dispatch");
  CHECK(j["ops"][0]["tasks"] == 2);
  CHECK(j["ops"][0]["core"] == "vector");
  CHECK(j["ops"][0]["tiling"]["peers"] == 2);
  CHECK(j["ops"][1]["tasks"] == 1);
  CHECK(j["events"][0]["signallers"] == 2);
  CHECK(j["events"][0]["waiters"] == 1);
  REQUIRE(j["queues"].size() == 2);
  CHECK(j["queues"][0]["core"] == "cube");
  CHECK(j["queues"][1]["core"] == "vector");
  CHECK(j["queues"][1]["entries"].size() == 2);
  CHECK(j["queues"][1]["entries"][1]["signals"][0]["peer_offset"] == 1);
  CHECK(j["statistics"]["unit"] == "seconds");
  CHECK(j["statistics"]["tasks"]["total"] == 3);
  CHECK(j["statistics"]["deadlock_free"] == true);
  CHECK(j["statistics"]["critical_path"]["tasks"] == nlohmann::json::array({1, 2}));
  CHECK(j["statistics"]["critical_path"]["ranks"] == nlohmann::json::array({1, 0}));
  CHECK(j["statistics"]["makespan"].get<double>() > 0);
  CHECK(j["statistics"]["balance"]["vector"]["queues"] == 1);

  options.core = inspect::CoreSelector{CoreKind::Cube, 0};
  options.rank = 1;
  j = nlohmann::json::parse(
      inspect::dumpJson(program, inspect::factsOf(program, "two.moebin"), options, analysis)
          .dump());
  REQUIRE(j["queues"].size() == 1);
  CHECK(j["rank"] == 1);
  CHECK(j["queues"][0]["entries"][0]["tile"]["expert"] == 1);
  CHECK(j["queues"][0]["entries"][0]["tile"]["local_expert"] == 0);
}

TEST_CASE("dump: dot", "[dump]") {
  TaskProgram program = twoRankProgram();
  std::string dot;
  REQUIRE(inspect::dumpDot(program, inspect::DumpOptions(), &dot).ok());
  INFO(dot);
  CHECK_THAT(dot, Catch::StartsWith("digraph moec {"));
  CHECK(countMatches(dot, "\n +t[0-9]+ \\[label=") == 3);
  CHECK(countMatches(dot, "\n +ev[0-9]+ \\[shape=ellipse") == 2);
  CHECK(countMatches(dot, "subgraph cluster_q") == 2);
  // Signals: 3 task -> event edges; waits: 1 event -> task edge.
  CHECK(countMatches(dot, "\n +t[0-9]+ -> ev[0-9]+ ") == 3);
  CHECK(countMatches(dot, "\n +ev[0-9]+ -> t[0-9]+;") == 1);
  CHECK_THAT(dot, Catch::Contains("t1 -> ev0 [label=\"+1 → +1\"];"));

  inspect::DumpOptions options;
  options.core = inspect::CoreSelector{CoreKind::Cube, 0};
  REQUIRE(inspect::dumpDot(program, options, &dot).ok());
  CHECK(countMatches(dot, "\n +t[0-9]+ \\[label=") == 1);

  // A large program is drawn whole; the filters select.
  TaskProgram big = layeredProgram(2, 3, 1000);
  size_t drawn = 0;
  REQUIRE(inspect::dumpDot(big, inspect::DumpOptions(), &dot, &drawn).ok());
  CHECK(drawn == 3000);
  CHECK(countMatches(dot, "\n +t[0-9]+ \\[label=") == 3000);
  options.core = inspect::CoreSelector{CoreKind::Vector, 3};
  REQUIRE(inspect::dumpDot(big, options, &dot, &drawn).ok());
  CHECK(countMatches(dot, "\n +t[0-9]+ \\[label=") == 63);
  CHECK(drawn == 63);
  options.core.reset();
  options.ops = {std::string(big.name(big.ops[1].name))};
  REQUIRE(inspect::dumpDot(big, options, &dot, &drawn).ok());
  CHECK(drawn == big.ops[1].taskCount);
  CHECK(countMatches(dot, "\n +t[0-9]+ \\[label=") == size_t(big.ops[1].taskCount));
  options.ops = {"no_such_op"};
  CHECK_THAT(errorOf(inspect::dumpDot(big, options, &dot)),
             Catch::StartsWith("--ops: the binary has no op 'no_such_op' (its ops: "));
}

TEST_CASE("the scheduler refuses cyclic events and zero cores", "[schedule]") {
  ProgramBuilder b;
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t c = b.op("c", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t aDone = b.event("a.done"), cDone = b.event("c.done");
  b.wait(a, cDone);
  b.signal(a, aDone);
  b.wait(c, aDone);
  b.signal(c, cDone);
  b.queue(CoreKind::Cube, 0, {a});
  b.queue(CoreKind::Vector, 0, {c});
  TaskProgram program = b.build();
  requireValid(program);
  moec::target::TargetProfile profile;
  REQUIRE(moec::target::builtinProfile("cpu", &profile).ok());
  std::string message = errorOf(moec::target::scheduleQueues(&program, profile, 1, 1));
  CHECK(message == "the tasks' events form a cycle: 2 of 2 tasks can never start (task 0 of op "
                   "'a' is one)");
  CHECK(errorOf(moec::target::scheduleQueues(&program, profile, 0, 1)) ==
        "a schedule needs at least one cube and one vector core");
}

TEST_CASE("the scheduler gives every core a queue and every task a place", "[schedule]") {
  // Two independent chains cube -> vector; 2 cube and 3 vector cores.
  ProgramBuilder b;
  uint32_t g = b.op("g", OpKind::Gmm, CoreKind::Cube, 4);
  uint32_t s = b.op("s", OpKind::Swiglu, CoreKind::Vector, 4);
  for (uint32_t i = 0; i < 4; ++i) {
    uint32_t e = b.event("g" + std::to_string(i));
    b.signal(g + i, e);
    b.wait(s + i, e);
  }
  uint32_t done = b.event("done", EventKind::Terminate);
  for (uint32_t i = 0; i < 4; ++i)
    b.signal(s + i, done);
  TaskProgram program = b.build(); // no queues yet
  moec::target::TargetProfile profile;
  REQUIRE(moec::target::builtinProfile("cpu", &profile).ok());
  moec::target::ScheduleEstimate estimate;
  REQUIRE(moec::target::scheduleQueues(&program, profile, 2, 3, &estimate).ok());
  requireValid(program); // every task in exactly one queue of its kind
  REQUIRE(program.queues.size() == 5);
  // Equal cube tasks split evenly over the two cube cores.
  CHECK(program.queues[0].entryCount == 2);
  CHECK(program.queues[1].entryCount == 2);
  CHECK(proveDeadlockFree(program).ok());
  CHECK(estimate.makespan >= estimate.criticalPath);
  CHECK(estimate.criticalPath > 0);
}

//===----------------------------------------------------------------------===//
// Shared cores, the shared link, the simulated trace
//===----------------------------------------------------------------------===//

TEST_CASE("shared cores serialize the queues that share them", "[simulate][cost]") {
  // Two ranks, each a dispatch (2 tiles on vector core 0) and a gmm (cube
  // core 0); every task costs 1 s.
  TaskProgram program = twoRankProgram();
  target::CostModel model;
  model.costs.assign(program.tasks.size(), 1.0);
  // Own cores: dispatch 0, 1 on the vector core, then the gmm: 3 s.
  TimedRun own = simulateTimed(program, model);
  REQUIRE(own.ok());
  CHECK(own.makespan == Approx(3.0));
  // One core for the whole group runs all 6 task runs one after another.
  model.sharing = target::CoreSharing::Group;
  model.poolCores = 1;
  TimedRun group = simulateTimed(program, model);
  REQUIRE(group.ok());
  CHECK(group.makespan == Approx(6.0));
  // One core per rank: each rank's 3 tasks in a row (the puts of both ranks
  // overlap).
  model.sharing = target::CoreSharing::Rank;
  TimedRun rank = simulateTimed(program, model);
  REQUIRE(rank.ok());
  CHECK(rank.makespan == Approx(3.0));
  // The critical path stays the dependency chain: put, then gmm.
  CHECK(group.criticalPathSeconds == Approx(2.0));
}

TEST_CASE("puts to peers share the rank's link", "[simulate][cost]") {
  TaskProgram program = twoRankProgram();
  target::CostModel model;
  model.costs.assign(program.tasks.size(), 1.0);
  // Task 1 puts 4 bytes to the peer; the link moves 1 byte/s: the put ends
  // at 4 s, whatever its own cost says.
  model.linkBytes.assign(program.tasks.size(), 0.0);
  model.linkBytes[1] = 4;
  model.linkTotalBytes = 1;
  TimedRun run = simulateTimed(program, model);
  REQUIRE(run.ok());
  CHECK(run.finish[1] == Approx(5.0)); // starts after task 0 at 1 s
  CHECK(run.makespan == Approx(6.0));
}

TEST_CASE("a simulated trace: every task of every rank, waits named by their signaller",
          "[simulate][trace]") {
  TaskProgram program = twoRankProgram();
  target::CostModel model;
  model.costs = {1.0, 2.0, 1.0};
  TimedRun run = simulateTimed(program, model, true);
  REQUIRE(run.ok());
  CHECK(run.trace.source == "simulated");
  REQUIRE(run.trace.tasks.size() == 2 * program.tasks.size());
  // The gmm of each rank waits from 0 s until the last put to it lands:
  // the peer's task 1 (put to the peer) ends at 3 s.
  size_t gmmWaits = 0;
  for (const trace::WaitSpan &wait : run.trace.waits) {
    if (wait.task != 2)
      continue;
    ++gmmWaits;
    CHECK(wait.beginNs == 0);
    CHECK(wait.endNs == 3000000000);
    CHECK(wait.signalTask == 1);
    CHECK(wait.signalRank == 1 - wait.rank);
  }
  CHECK(gmmWaits == 2);
  // The Chrome JSON: one arrow per wait, each end inside an existing slice.
  nlohmann::json json = nlohmann::json::parse(trace::chromeTraceJson(program, run.trace));
  CHECK(json["metadata"]["source"] == "simulated");
  std::map<std::pair<int, int>, std::vector<std::pair<double, double>>> slices;
  std::map<int, int> flowEnds;
  for (const auto &event : json["traceEvents"])
    if (event["ph"] == "X" && event["cat"] != "wait")
      slices[{event["pid"].get<int>(), event["tid"].get<int>()}].push_back(
          {event["ts"].get<double>(), event["ts"].get<double>() + event["dur"].get<double>()});
  for (const auto &event : json["traceEvents"]) {
    if (event["ph"] != "s" && event["ph"] != "f")
      continue;
    ++flowEnds[event["id"].get<int>()];
    bool inside = false;
    for (auto [begin, end] : slices[{event["pid"].get<int>(), event["tid"].get<int>()}])
      inside = inside || (begin < event["ts"].get<double>() && event["ts"].get<double>() < end);
    CHECK(inside);
  }
  CHECK(flowEnds.size() == run.trace.waits.size());
  for (auto [id, ends] : flowEnds)
    CHECK(ends == 2);
}

TEST_CASE("dump: the critical path names its tasks; another profile's core counts warn",
          "[dump]") {
  TaskProgram program = twoRankProgram();
  target::TargetProfile profile;
  profile.name = "test";
  profile.cubeCores = 1;
  profile.vectorCores = 1;
  inspect::Analysis analysis = inspect::analyzeProgram(program, &profile);
  REQUIRE(analysis.run.ok());
  std::string text = inspect::dumpText(program, inspect::factsOf(program, "two.moebin"),
                                       inspect::DumpOptions(), analysis);
  // The path: rank 1's put to rank 0 (task 1), then rank 0's gmm (task 2).
  CHECK(std::regex_search(text, std::regex("\n +1 +1 +dispatch +tile\\(e0,p0,")));
  CHECK(std::regex_search(text, std::regex("\n +0 +2 +up_proj +tile\\(e0,p0,")));
  CHECK(inspect::coreCountWarning(program, profile).empty());
  profile.cubeCores = 132;
  CHECK_THAT(inspect::coreCountWarning(program, profile),
             Catch::StartsWith("profile 'test' has 132 cube + 1 vector cores per rank, but the "
                               "binary was scheduled for 1 cube + 1 vector queues"));
}

TEST_CASE("dump: the op graph", "[dump]") {
  TaskProgram program = twoRankProgram();
  std::string dot = inspect::dumpOpGraph(program);
  INFO(dot);
  CHECK_THAT(dot, Catch::StartsWith("digraph moec_ops {"));
  CHECK(countMatches(dot, "\n +op[0-9]+ \\[shape=box") == 2);
  // Each op writes its output tensor, with its tile count.
  CHECK_THAT(dot, Catch::Contains("op0 -> s0 [label=\"2 tiles\"];"));
  CHECK_THAT(dot, Catch::Contains("op1 -> s0 [label=\"1 tiles\"];"));
}

TEST_CASE("a profile round-trips through its JSON", "[profile]") {
  for (const std::string &name : target::builtinProfileNames()) {
    target::TargetProfile builtin, parsed;
    REQUIRE(target::builtinProfile(name, &builtin).ok());
    // A file under a built-in profile's name is refused: binaries record the
    // name, and it would stand for the built-in one.
    Status status = target::parseProfile(target::profileJson(builtin), "p.json", &parsed);
    CHECK(status.message() ==
          "p.json: 'name' is '" + name +
              "', the name of a built-in profile: binaries compiled with this file would be "
              "taken for that profile's; give it a name of its own (say '" + name +
              "-calibrated')");
    builtin.name += "-copy";
    status = target::parseProfile(target::profileJson(builtin), "p.json", &parsed);
    INFO(status.message());
    REQUIRE(status.ok());
    CHECK(target::profileJson(parsed) == target::profileJson(builtin));
    CHECK(parsed.sharing == builtin.sharing);
    CHECK(parsed.sharedCache == builtin.sharedCache);
  }
  target::TargetProfile p;
  CHECK_THAT(target::parseProfile(R"({"name": "x", "cube_cores": 1, "vector_cores": 1,
                                      "core_sharing": "sometimes"})",
                                  "p.json", &p)
                 .message(),
             Catch::Contains("'core_sharing' must be \"none\", \"rank\" or \"group\""));
  CHECK_THAT(target::parseProfile(R"({"name": "x", "cube_cores": 1, "vector_cores": 1,
                                      "shared_cache": 1})",
                                  "p.json", &p)
                 .message(),
             Catch::Contains("'shared_cache' must be true or false, got 1"));
}

/// A program of one GMM task, `name`, of one tile.
static TaskProgram oneGmmTask(const char *name) {
  ProgramBuilder b(1, 1);
  uint32_t g = b.op(name, OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t done = b.event("done", EventKind::Terminate);
  b.signal(g, done);
  b.queue(CoreKind::Cube, 0, {g});
  return b.build();
}

TEST_CASE("the cost model: with a shared cache, tiles that run at once share a panel",
          "[cost]") {
  // A weight-gradient tile of a 12 x 11 grid on 132 cores, reduced over
  // 32768 rows: memory-bound when each tile loads both of its panels.
  TaskProgram program = oneGmmTask("w2_grad");
  TilingRecord &t = program.tilings[program.ops[0].tiling];
  t.dtype = DType::BF16;
  t.rows = 12 * 128;
  t.cols = 11 * 128;
  t.rowTiles = 12;
  t.colTiles = 11;
  t.depth = 0;
  t.balancedRows = 32768;
  target::TargetProfile profile;
  REQUIRE(target::builtinProfile("h100", &profile).ok());
  profile.taskOverhead = 0;
  profile.cubeFlopsBf16 = 1e18; // memory-bound: bytes alone
  const double m = 128, n = 128, k = 32768;
  const double out = double(dtypeSize(program.slots[t.outputSlot].dtype)) * m * n;
  profile.sharedCache = false;
  CHECK(target::taskSeconds(program, 0, profile) ==
        Approx((2.0 * (m * k + k * n) + out) / profile.memoryBytes));
  // The A panel is shared by the 11 column tiles, the B panel by the 12 row
  // tiles (132 cores / 11 = 12 of them run at once).
  profile.sharedCache = true;
  CHECK(target::taskSeconds(program, 0, profile) ==
        Approx((2.0 * (m * k / 11 + k * n / 12) + out) / profile.memoryBytes));
  // On 22 cores, only 2 row tiles run beside each column's 11.
  profile.cubeCores = 22;
  CHECK(target::taskSeconds(program, 0, profile) ==
        Approx((2.0 * (m * k / 11 + k * n / 2) + out) / profile.memoryBytes));
}

TEST_CASE("the cost model: a narrow GMM tile pays for the padded columns", "[cost]") {
  TaskProgram program = oneGmmTask("up_proj");
  TilingRecord &t = program.tilings[program.ops[0].tiling];
  t.rows = 8192;
  t.cols = 31;
  t.depth = 1024;
  t.balancedRows = 8192;
  target::TargetProfile profile;
  REQUIRE(target::builtinProfile("h100", &profile).ok());
  profile.taskOverhead = 0;
  profile.memoryBytes = 1e18; // compute-bound: flops alone
  double narrow = target::taskSeconds(program, 0, profile);
  t.cols = 128;
  double full = target::taskSeconds(program, 0, profile);
  // 31 columns of a 128-wide MMA cost as much as 128.
  CHECK(narrow == Approx(full));
  profile.padN = 1;
  t.cols = 31;
  CHECK(target::taskSeconds(program, 0, profile) == Approx(full * 31 / 128));
}
