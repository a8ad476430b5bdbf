//===- ExecutorTest.cpp - Tests for the executor core ---------------------===//
//
// Hand-built task programs (chains across cube and vector queues, a diamond,
// puts across ranks, random layered programs with partial waits, deadlocked
// programs) run on 1, 2 and 4 ranks with 1, 2 and 8 workers. A recording
// task function checks, as each task starts, that every event it waits for
// has already received enough increments from tasks that finished (it counts
// them itself), that no two tasks of one logical queue overlap, and at the
// end that every task ran exactly once per rank, in its queue's order.
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/Executor.h"
#include "runtime/exec/ThreadTeam.h"
#include "format/TaskBinary.h"
#include "tests/unit/support/ProgramBuilder.h"

#include <catch2/catch.hpp>
#include <set>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

using namespace moec;
using namespace moec::format;
using moec::exec::Executor;
using moec::exec::ExecutorOptions;
using moec::exec::TaskFunction;
using moec::test::kFinal;
using moec::test::ProgramBuilder;
using moec::test::requireValid;

namespace {

/// A chain A -> B -> C of 4 tiles each, tile by tile: A and C on cube cores
/// 0 and 1 (two tiles each), B on vector cores 0 and 1. C signals the
/// terminate event.
TaskProgram chainProgram(uint32_t ranks) {
  ProgramBuilder b(ranks);
  uint32_t a = b.op("A", OpKind::Gmm, CoreKind::Cube, 4);
  uint32_t bb = b.op("B", OpKind::Swiglu, CoreKind::Vector, 4);
  uint32_t c = b.op("C", OpKind::Gmm, CoreKind::Cube, 4);
  uint32_t done = b.event("C.done", EventKind::Terminate);
  for (uint32_t t = 0; t < 4; ++t) {
    uint32_t ea = b.event(fmt::format("A.t{}", t));
    uint32_t eb = b.event(fmt::format("B.t{}", t));
    b.signal(a + t, ea);
    b.wait(bb + t, ea);
    b.signal(bb + t, eb, 2);
    b.wait(c + t, eb);
    b.signal(c + t, done);
  }
  b.queue(CoreKind::Cube, 0, {a + 0, a + 1, c + 0, c + 1});
  b.queue(CoreKind::Cube, 1, {a + 2, a + 3, c + 2, c + 3});
  b.queue(CoreKind::Vector, 0, {bb + 0, bb + 2});
  b.queue(CoreKind::Vector, 1, {bb + 1, bb + 3});
  return b.build();
}

/// A diamond A -> {B, C} -> D: A and B on cube core 0, C on cube core 1, D
/// on vector core 0; D signals the terminate event.
TaskProgram diamondProgram(uint32_t ranks) {
  ProgramBuilder b(ranks);
  uint32_t a = b.op("A", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t bb = b.op("B", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t c = b.op("C", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t d = b.op("D", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t ea = b.event("a"), eb = b.event("b"), ec = b.event("c");
  uint32_t done = b.event("done", EventKind::Terminate);
  b.signal(a, ea);
  b.wait(bb, ea);
  b.signal(bb, eb);
  b.wait(c, ea);
  b.signal(c, ec);
  b.wait(d, eb);
  b.wait(d, ec);
  b.signal(d, done);
  b.queue(CoreKind::Cube, 0, {a, bb});
  b.queue(CoreKind::Cube, 1, {c});
  b.queue(CoreKind::Vector, 0, {d});
  return b.build();
}

/// Dispatch -> gmm -> combine with puts: dispatch (vector) has 2 tiles per
/// peer, each adding 1 to the cross-rank event 'recv' of the rank it puts
/// to; two gmm tiles (cube) wait for all of 'recv'; combine (vector) has one
/// tile per peer, each waiting for both gmm tiles of its rank and adding 1
/// to the terminate event 'combined' of the rank it puts to.
TaskProgram putProgram(uint32_t ranks) {
  ProgramBuilder b(ranks);
  uint32_t dispatch = b.op("dispatch", OpKind::Dispatch, CoreKind::Vector, 2 * ranks, ranks);
  uint32_t gmm = b.op("up_proj", OpKind::Gmm, CoreKind::Cube, 2);
  uint32_t combine = b.op("combine", OpKind::Combine, CoreKind::Vector, ranks, ranks);
  uint32_t recv = b.event("dispatch.recv", EventKind::CrossRank);
  uint32_t gmmDone = b.event("up_proj.done");
  uint32_t combined = b.event("combine.done", EventKind::Terminate);
  std::vector<uint32_t> vector0, vector1;
  for (uint32_t t = 0; t < 2 * ranks; ++t) {
    b.signal(dispatch + t, recv, 1, t / 2); // tile t goes to peer t / colTiles
    (t % 2 ? vector1 : vector0).push_back(dispatch + t);
  }
  for (uint32_t t = 0; t < 2; ++t) {
    b.wait(gmm + t, recv);
    b.signal(gmm + t, gmmDone);
  }
  for (uint32_t p = 0; p < ranks; ++p) {
    b.wait(combine + p, gmmDone);
    b.signal(combine + p, combined, 1, p);
    (p % 2 ? vector1 : vector0).push_back(combine + p);
  }
  b.queue(CoreKind::Cube, 0, {gmm});
  b.queue(CoreKind::Cube, 1, {gmm + 1});
  b.queue(CoreKind::Vector, 0, vector0);
  b.queue(CoreKind::Vector, 1, vector1);
  return b.build();
}

/// A random layered program: `layers` ops of `width` tasks, each on a random
/// cube or vector core (queues hold tasks in creation order, so it cannot
/// deadlock). Every task adds 1..3 to one of 4 cross-rank events of its op on
/// a random peer, and waits for 0..3 events of earlier ops, for their final
/// value or a random partial count.
TaskProgram randomProgram(uint32_t ranks, uint32_t layers, uint32_t width, uint32_t cores,
                          uint32_t seed) {
  std::mt19937 rng(seed);
  auto pick = [&](uint32_t n) { return uint32_t(rng() % n); };
  ProgramBuilder b(ranks);
  constexpr uint32_t kGroups = 4;
  std::vector<uint32_t> sums;
  std::vector<uint32_t> eventsSoFar;
  std::vector<std::vector<uint32_t>> cube(cores), vector(cores);
  for (uint32_t k = 0; k < layers; ++k) {
    bool isCube = pick(2) == 0;
    uint32_t first = b.op(fmt::format("op{}", k), isCube ? OpKind::Gmm : OpKind::Swiglu,
                          isCube ? CoreKind::Cube : CoreKind::Vector, width);
    std::vector<uint32_t> mine;
    for (uint32_t g = 0; g < kGroups; ++g) {
      mine.push_back(b.event(fmt::format("op{}.g{}", k, g), EventKind::CrossRank));
      sums.push_back(0);
    }
    for (uint32_t j = 0; j < width; ++j) {
      uint32_t task = first + j;
      uint32_t waitCount = eventsSoFar.empty() ? 0 : pick(4);
      for (uint32_t i = 0; i < waitCount; ++i) {
        uint32_t event = eventsSoFar[pick(uint32_t(eventsSoFar.size()))];
        uint32_t threshold = pick(3) == 0 ? 1 + pick(sums[event]) : kFinal;
        b.wait(task, event, threshold);
      }
      uint32_t event = mine[pick(kGroups)];
      uint32_t increment = 1 + pick(3);
      b.signal(task, event, increment, pick(ranks));
      sums[event] += increment;
      (isCube ? cube : vector)[pick(cores)].push_back(task);
    }
    for (uint32_t event : mine)
      if (sums[event] > 0)
        eventsSoFar.push_back(event);
  }
  for (uint32_t c = 0; c < cores; ++c) {
    b.queue(CoreKind::Cube, c, cube[c]);
    b.queue(CoreKind::Vector, c, vector[c]);
  }
  return b.build();
}

/// Two queues of one rank whose heads wait for each other: a (cube core 0)
/// waits for b.done, b (vector core 1) for a.done.
TaskProgram cycleProgram(uint32_t ranks) {
  ProgramBuilder b(ranks);
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

//===----------------------------------------------------------------------===//
// A task function that checks the executor
//===----------------------------------------------------------------------===//

/// Records what the executor runs and checks it as it goes. Thread-safe.
class Recorder {
public:
  explicit Recorder(const TaskProgram &program)
      : program(program), ranks(program.epRanks), taskCount(uint32_t(program.tasks.size())),
        eventCount(uint32_t(program.events.size())),
        observed(new std::atomic<uint64_t>[size_t(ranks) * eventCount]),
        runs(new std::atomic<uint32_t>[size_t(ranks) * taskCount]),
        stamps(new std::atomic<uint64_t>[size_t(ranks) * taskCount]),
        running(new std::atomic<uint32_t>[size_t(ranks) * program.queues.size()]),
        queueOf(program.tasks.size()) {
    for (uint32_t q = 0; q < program.queues.size(); ++q)
      for (uint32_t i = 0; i < program.queues[q].entryCount; ++i)
        queueOf[program.queueEntries[program.queues[q].firstEntry + i]] = q;
    reset();
  }

  /// Forgets the last pass.
  void reset() {
    for (size_t i = 0; i < size_t(ranks) * eventCount; ++i)
      observed[i] = 0;
    for (size_t i = 0; i < size_t(ranks) * taskCount; ++i) {
      runs[i] = 0;
      stamps[i] = 0;
    }
    for (size_t i = 0; i < size_t(ranks) * program.queues.size(); ++i)
      running[i] = 0;
    clock = 0;
    std::lock_guard<std::mutex> lock(mutex);
    problems.clear();
    maxWorker = 0;
  }

  /// The task function: checks the task's waits against the increments of
  /// tasks that finished, marks its queue busy, yields now and then to shake
  /// up the timing, then counts its signals' increments.
  Status operator()(uint32_t rank, uint32_t task, uint32_t worker) {
    const TaskRecord &record = program.tasks[task];
    for (uint32_t w = 0; w < record.waitCount; ++w) {
      const WaitRecord &wait = program.waits[record.firstWait + w];
      uint64_t seen = observed[size_t(rank) * eventCount + wait.event].load();
      if (seen < wait.threshold)
        problem(fmt::format("rank {} task {} started with event {} at {} < {}", rank, task,
                            wait.event, seen, wait.threshold));
    }
    size_t q = size_t(rank) * program.queues.size() + queueOf[task];
    if (running[q].exchange(1) != 0)
      problem(fmt::format("rank {} queue {} runs two tasks at once", rank, queueOf[task]));
    if (runs[size_t(rank) * taskCount + task].fetch_add(1) != 0)
      problem(fmt::format("rank {} task {} ran twice", rank, task));
    stamps[size_t(rank) * taskCount + task] = ++clock;
    if ((rank * 7 + task) % 5 == 0)
      std::this_thread::yield();
    {
      std::lock_guard<std::mutex> lock(mutex);
      maxWorker = std::max(maxWorker, worker);
    }
    running[q].store(0);
    for (uint32_t s = 0; s < record.signalCount; ++s) {
      const SignalRecord &signal = program.signals[record.firstSignal + s];
      uint32_t target = program.peerRank(rank, signal.peerOffset);
      observed[size_t(target) * eventCount + signal.event] += signal.increment;
    }
    return Status::success();
  }

  /// Returns a TaskFunction that calls this recorder.
  TaskFunction function() {
    return [this](uint32_t rank, uint32_t task, uint32_t worker) {
      return (*this)(rank, task, worker);
    };
  }

  /// Checks a completed pass: no problem seen, every task ran once on every
  /// rank, each queue in order, and every event got its threshold.
  void verifyComplete() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (const std::string &text : problems)
        FAIL_CHECK(text);
    }
    for (uint32_t rank = 0; rank < ranks; ++rank) {
      for (uint32_t t = 0; t < taskCount; ++t)
        CHECK(runs[size_t(rank) * taskCount + t].load() == 1);
      for (const QueueRecord &queue : program.queues)
        for (uint32_t i = 1; i < queue.entryCount; ++i) {
          uint32_t before = program.queueEntries[queue.firstEntry + i - 1];
          uint32_t after = program.queueEntries[queue.firstEntry + i];
          CHECK(stamps[size_t(rank) * taskCount + before].load() <
                stamps[size_t(rank) * taskCount + after].load());
        }
      for (uint32_t e = 0; e < eventCount; ++e)
        CHECK(observed[size_t(rank) * eventCount + e].load() == program.events[e].threshold);
    }
  }

  /// Checks that nothing ran early or twice (for a pass that stopped).
  void verifyNoProblem() {
    std::lock_guard<std::mutex> lock(mutex);
    for (const std::string &text : problems)
      FAIL_CHECK(text);
  }

  /// Returns the task runs of the last pass.
  uint64_t totalRuns() const {
    uint64_t total = 0;
    for (size_t i = 0; i < size_t(ranks) * taskCount; ++i)
      total += runs[i].load();
    return total;
  }

  /// Returns the highest worker index seen.
  uint32_t highestWorker() {
    std::lock_guard<std::mutex> lock(mutex);
    return maxWorker;
  }

private:
  void problem(std::string text) {
    std::lock_guard<std::mutex> lock(mutex);
    problems.push_back(std::move(text));
  }

  const TaskProgram &program;
  uint32_t ranks, taskCount, eventCount;
  std::unique_ptr<std::atomic<uint64_t>[]> observed; ///< [rank][event] increments seen
  std::unique_ptr<std::atomic<uint32_t>[]> runs;     ///< [rank][task] times run
  std::unique_ptr<std::atomic<uint64_t>[]> stamps;   ///< [rank][task] start order
  std::unique_ptr<std::atomic<uint32_t>[]> running;  ///< [rank][queue] busy flag
  std::vector<uint32_t> queueOf;
  std::atomic<uint64_t> clock{0};
  std::mutex mutex;
  std::vector<std::string> problems;
  uint32_t maxWorker = 0;
};

/// Creates an executor for `program` or fails the test.
std::unique_ptr<Executor> makeExecutor(const TaskProgram &program, TaskFunction function,
                                       const ExecutorOptions &options) {
  std::unique_ptr<Executor> executor;
  Status status = Executor::create(program, std::move(function), options, &executor);
  INFO(status.message());
  REQUIRE(status.ok());
  REQUIRE(executor);
  return executor;
}

/// Returns the error message of `status`, requiring it to be an error.
std::string errorOf(const Status &status) {
  REQUIRE_FALSE(status.ok());
  return status.message();
}

/// Returns a path for a scratch file.
std::string scratchPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

/// Runs `program` `passes` times with `workers` workers and checks each pass.
void runAndVerify(const TaskProgram &program, uint32_t workers, uint32_t passes) {
  requireValid(program);
  Recorder recorder(program);
  ExecutorOptions options;
  options.workers = workers;
  options.timeout = std::chrono::seconds(30);
  std::unique_ptr<Executor> executor = makeExecutor(program, recorder.function(), options);
  CHECK(executor->workers() == workers);
  CHECK(executor->ranks() == program.epRanks);
  for (uint32_t pass = 0; pass < passes; ++pass) {
    INFO("pass " << pass);
    recorder.reset();
    Status status = executor->run();
    INFO(status.message());
    REQUIRE(status.ok());
    recorder.verifyComplete();
    CHECK(recorder.highestWorker() < workers);
    CHECK(executor->lastPass().tasksRun == uint64_t(program.epRanks) * program.tasks.size());
  }
}

} // namespace

//===----------------------------------------------------------------------===//
// Complete passes
//===----------------------------------------------------------------------===//

TEST_CASE("hand-built programs run every task once, in order, after its waits", "[exec]") {
  for (uint32_t ranks : {1u, 2u, 4u})
    for (uint32_t workers : {1u, 2u, 8u}) {
      INFO(ranks << " ranks, " << workers << " workers");
      SECTION(fmt::format("chain, {} ranks, {} workers", ranks, workers)) {
        runAndVerify(chainProgram(ranks), workers, 3);
      }
      SECTION(fmt::format("diamond, {} ranks, {} workers", ranks, workers)) {
        runAndVerify(diamondProgram(ranks), workers, 3);
      }
      SECTION(fmt::format("puts, {} ranks, {} workers", ranks, workers)) {
        runAndVerify(putProgram(ranks), workers, 3);
      }
      SECTION(fmt::format("random, {} ranks, {} workers", ranks, workers)) {
        runAndVerify(randomProgram(ranks, 12, 24, 3, 17 * ranks + workers), workers, 3);
      }
    }
}

TEST_CASE("a larger random program runs many passes on one executor", "[exec]") {
  // 4 ranks x 32 queues x 1600 tasks, partial waits, cross-rank signals.
  TaskProgram program = randomProgram(4, 40, 40, 16, 7);
  runAndVerify(program, 8, 10);
}

TEST_CASE("an empty queue and more workers than queues are fine", "[exec]") {
  ProgramBuilder b(2);
  uint32_t a = b.op("a", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t done = b.event("done", EventKind::Terminate);
  b.signal(a, done, 1, 1);
  b.queue(CoreKind::Cube, 0, {a});
  b.queue(CoreKind::Vector, 0, {});
  runAndVerify(b.build(), 8, 3);
}

TEST_CASE("cube queues end together: a worker hands its queue over for a longer one",
          "[exec]") {
  // Three cube queues of 12 tasks, no events, two workers. Kept by their
  // first workers until drained, two queues would end before the third
  // started, which would then run alone. Handed over whenever a ready queue
  // has 2 tasks more, every queue starts before any ends.
  ProgramBuilder b(1);
  std::vector<std::vector<uint32_t>> queues(3);
  for (uint32_t q = 0; q < 3; ++q)
    for (int t = 0; t < 12; ++t)
      queues[q].push_back(b.op("gmm" + std::to_string(q), OpKind::Gmm, CoreKind::Cube, 1));
  for (uint32_t q = 0; q < 3; ++q)
    b.queue(CoreKind::Cube, q, queues[q]);
  TaskProgram program = b.build();
  ExecutorOptions options;
  options.workers = 2;
  options.trace = true;
  std::unique_ptr<Executor> executor = makeExecutor(
      program,
      [](uint32_t, uint32_t, uint32_t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return Status::success();
      },
      options);
  REQUIRE(executor->run().ok());
  std::vector<int64_t> firstStart(3, INT64_MAX), lastEnd(3, 0);
  for (const trace::TaskSpan &span : executor->trace().tasks) {
    firstStart[span.queue] = std::min(firstStart[span.queue], span.startNs);
    lastEnd[span.queue] = std::max(lastEnd[span.queue], span.endNs);
  }
  const int64_t latestStart = *std::max_element(firstStart.begin(), firstStart.end());
  const int64_t earliestEnd = *std::min_element(lastEnd.begin(), lastEnd.end());
  CHECK(latestStart < earliestEnd);
}

TEST_CASE("create refuses an invalid program and a missing task function", "[exec]") {
  std::unique_ptr<Executor> executor;
  TaskProgram program = diamondProgram(1);
  program.events[0].threshold = 5;
  std::string message = errorOf(Executor::create(
      program, [](uint32_t, uint32_t, uint32_t) { return Status(); }, ExecutorOptions(),
      &executor));
  CHECK_THAT(message, Catch::StartsWith("executor: invalid program: "));
  CHECK_FALSE(executor);
  message =
      errorOf(Executor::create(diamondProgram(1), TaskFunction(), ExecutorOptions(), &executor));
  CHECK(message == "executor: no task function");
  CHECK_FALSE(executor);
}

TEST_CASE("the default worker count is the hardware's", "[exec]") {
  std::unique_ptr<Executor> executor = makeExecutor(
      diamondProgram(1), [](uint32_t, uint32_t, uint32_t) { return Status(); }, ExecutorOptions());
  CHECK(executor->workers() == std::max(1u, std::thread::hardware_concurrency()));
  Status status = executor->run();
  CHECK(status.ok());
}

TEST_CASE("a program without tasks completes at once", "[exec]") {
  ProgramBuilder b(4);
  b.queue(CoreKind::Cube, 0, {});
  TaskProgram program = b.build();
  requireValid(program);
  std::unique_ptr<Executor> executor = makeExecutor(
      program, [](uint32_t, uint32_t, uint32_t) { return Status::error("no task to run"); },
      ExecutorOptions());
  for (int pass = 0; pass < 2; ++pass) {
    Status status = executor->run();
    INFO(status.message());
    CHECK(status.ok());
    CHECK(executor->lastPass().tasksRun == 0);
  }
}

//===----------------------------------------------------------------------===//
// Errors
//===----------------------------------------------------------------------===//

TEST_CASE("run() refuses to run inside one of its own tasks", "[exec]") {
  Executor *self = nullptr;
  std::string inner;
  auto function = [&](uint32_t rank, uint32_t task, uint32_t) -> Status {
    if (rank == 0 && task == 0)
      inner = self->run().message();
    return Status();
  };
  ExecutorOptions options;
  options.workers = 2;
  std::unique_ptr<Executor> executor = makeExecutor(diamondProgram(2), function, options);
  self = executor.get();
  Status status = executor->run();
  INFO(status.message());
  CHECK(status.ok());
  CHECK(inner == "executor: run() is already running");
}

TEST_CASE("a failing task stops every rank and names its rank, core and task", "[exec]") {
  for (uint32_t workers : {1u, 2u, 8u}) {
    INFO(workers << " workers");
    TaskProgram program = putProgram(2);
    requireValid(program);
    Recorder recorder(program);
    std::atomic<bool> failing{true};
    auto function = [&](uint32_t rank, uint32_t task, uint32_t worker) -> Status {
      Status status = recorder(rank, task, worker);
      if (failing && rank == 1 && task == 3)
        return Status::error("boom");
      return status;
    };
    ExecutorOptions options;
    options.workers = workers;
    std::unique_ptr<Executor> executor = makeExecutor(program, function, options);
    std::string message = errorOf(executor->run());
    // Task 3 is dispatch tile 3 (the second to the peer 1 ahead), on vector
    // core 1.
    CHECK(message == "rank 1, vector core 1, task 3 (op 'dispatch'): boom");
    recorder.verifyNoProblem();
    // The combines wait for all of rank 1's dispatch, so not everything ran.
    CHECK(recorder.totalRuns() < 2 * program.tasks.size());
    CHECK(executor->lastPass().tasksRun < 2 * program.tasks.size());

    // The executor runs again.
    failing = false;
    recorder.reset();
    Status status = executor->run();
    INFO(status.message());
    REQUIRE(status.ok());
    recorder.verifyComplete();
  }
}

TEST_CASE("a failing task stops long queues on other ranks promptly", "[exec]") {
  // 4 ranks, one cube queue of 2000 independent tasks each.
  ProgramBuilder b(4);
  uint32_t first = b.op("work", OpKind::Gmm, CoreKind::Cube, 2000);
  std::vector<uint32_t> tasks;
  for (uint32_t t = 0; t < 2000; ++t)
    tasks.push_back(first + t);
  b.queue(CoreKind::Cube, 0, tasks);
  TaskProgram program = b.build();
  requireValid(program);
  std::atomic<uint64_t> runs{0};
  auto function = [&](uint32_t rank, uint32_t task, uint32_t) -> Status {
    ++runs;
    if (rank == 2 && task == 10)
      return Status::error("bad tile");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    return Status();
  };
  ExecutorOptions options;
  options.workers = 4;
  std::unique_ptr<Executor> executor = makeExecutor(program, function, options);
  std::string message = errorOf(executor->run());
  CHECK(message == "rank 2, cube core 0, task 10 (op 'work'): bad tile");
  CHECK(runs.load() < 4 * 2000 / 2);
}

TEST_CASE("a task that throws is an error too", "[exec]") {
  TaskProgram program = chainProgram(2);
  auto function = [&](uint32_t rank, uint32_t task, uint32_t) -> Status {
    if (rank == 0 && task == 9)
      throw std::runtime_error("out of range");
    return Status();
  };
  ExecutorOptions options;
  options.workers = 2;
  std::unique_ptr<Executor> executor = makeExecutor(program, function, options);
  std::string message = errorOf(executor->run());
  CHECK(message == "rank 0, cube core 0, task 9 (op 'C'): the task threw: out of range");
}

//===----------------------------------------------------------------------===//
// Watchdog and deadlocks
//===----------------------------------------------------------------------===//

TEST_CASE("the watchdog names the stuck core, task and event of a cycle", "[exec]") {
  for (uint32_t ranks : {1u, 2u}) {
    INFO(ranks << " ranks");
    TaskProgram program = cycleProgram(ranks);
    requireValid(program);
    Recorder recorder(program);
    ExecutorOptions options;
    options.workers = 2;
    options.timeout = std::chrono::milliseconds(200);
    options.detectDeadlock = false;
    std::unique_ptr<Executor> executor = makeExecutor(program, recorder.function(), options);
    for (int pass = 0; pass < 2; ++pass) {
      recorder.reset();
      std::string message = errorOf(executor->run());
      INFO(message);
      CHECK_THAT(message, Catch::StartsWith("watchdog: no task completed for 0.2 s; "));
      CHECK_THAT(message,
                 Catch::Contains(fmt::format("0 of {} task runs completed; {} queues on {} rank",
                                             2 * ranks, 2 * ranks, ranks)));
      CHECK_THAT(message, Catch::Contains("Stuck: rank 0, cube core 0, task 0 (op 'a') waits for "
                                          "event 1 'b.done' (value 0, needs 1); rank 0, vector "
                                          "core 1, task 1 (op 'b') waits for event 0 'a.done' "
                                          "(value 0, needs 1)"));
      if (ranks == 2)
        CHECK_THAT(message, Catch::Contains("; rank 1, cube core 0, task 0 (op 'a') waits for "
                                            "event 1 'b.done' (value 0, needs 1)"));
      CHECK(recorder.totalRuns() == 0);
    }
  }
}

TEST_CASE("a deadlock is reported at once when every queue is parked", "[exec]") {
  TaskProgram program = cycleProgram(2);
  ExecutorOptions options;
  options.workers = 3;
  std::unique_ptr<Executor> executor = makeExecutor(
      program, [](uint32_t, uint32_t, uint32_t) { return Status(); }, options);
  auto start = std::chrono::steady_clock::now();
  std::string message = errorOf(executor->run());
  INFO(message);
  CHECK_THAT(message, Catch::StartsWith("deadlock: every unfinished queue waits for an event"));
  CHECK_THAT(message, Catch::Contains("Stuck: rank 0, cube core 0, task 0 (op 'a') waits for "
                                      "event 1 'b.done' (value 0, needs 1)"));
  // Far below the 60 s watchdog.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
}

TEST_CASE("a wait that its own queue must satisfy later gets stuck after progress", "[exec]") {
  // cube core 0 runs x, then y (which waits for z.done), then z (which
  // signals z.done); vector core 0 runs w, which waits for y.done.
  ProgramBuilder b(2);
  uint32_t x = b.op("x", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t y = b.op("y", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t z = b.op("z", OpKind::Gmm, CoreKind::Cube, 1);
  uint32_t w = b.op("w", OpKind::Swiglu, CoreKind::Vector, 1);
  uint32_t zDone = b.event("z.done", EventKind::CrossRank);
  uint32_t yDone = b.event("y.done");
  uint32_t xDone = b.event("x.done");
  b.signal(x, xDone);
  b.wait(y, xDone);
  b.wait(y, zDone);
  b.signal(y, yDone);
  b.signal(z, zDone, 3, 1);
  b.wait(w, yDone);
  b.queue(CoreKind::Cube, 0, {x, y, z});
  b.queue(CoreKind::Vector, 0, {w});
  TaskProgram program = b.build();
  requireValid(program);
  for (bool detect : {false, true}) {
    Recorder recorder(program);
    ExecutorOptions options;
    options.workers = 2;
    options.timeout = std::chrono::milliseconds(200);
    options.detectDeadlock = detect;
    options.stuckQueuesReported = 2;
    std::unique_ptr<Executor> executor = makeExecutor(program, recorder.function(), options);
    std::string message = errorOf(executor->run());
    INFO(message);
    CHECK_THAT(message, Catch::StartsWith(detect ? "deadlock: " : "watchdog: "));
    CHECK_THAT(message, Catch::Contains("2 of 8 task runs completed; 4 queues on 2 ranks did not "
                                        "drain (6 task runs left). Stuck: rank 0, cube core 0, "
                                        "task 1 (op 'y') waits for event 0 'z.done' (value 0, "
                                        "needs 3); rank 0, vector core 0, task 3 (op 'w') waits "
                                        "for event 1 'y.done' (value 0, needs 1); and 2 more"));
    recorder.verifyNoProblem();
    CHECK(recorder.totalRuns() == 2);
    CHECK(executor->lastPass().tasksRun == 2);
  }
}

TEST_CASE("the watchdog names a task that runs too long", "[exec]") {
  TaskProgram program = chainProgram(1);
  std::atomic<bool> slow{true};
  std::atomic<bool> sawStop{false};
  Executor *self = nullptr;
  auto function = [&](uint32_t rank, uint32_t task, uint32_t) -> Status {
    if (slow && task == 4) {
      // Busy until the watchdog stops the pass (or 10 s).
      auto start = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - start < std::chrono::seconds(10)) {
        if (self->stopRequested()) {
          sawStop = true;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    return Status();
  };
  ExecutorOptions options;
  options.workers = 2;
  options.timeout = std::chrono::milliseconds(100);
  std::unique_ptr<Executor> executor = makeExecutor(program, function, options);
  self = executor.get();
  std::string message = errorOf(executor->run());
  INFO(message);
  CHECK_THAT(message, Catch::StartsWith("watchdog: no task completed for 0.1 s; running: rank 0, "
                                        "vector core 0, task 4 (op 'B') has been running for "));
  CHECK(sawStop.load());
  CHECK_FALSE(executor->stopRequested());
  slow = false;
  Status status = executor->run();
  INFO(status.message());
  CHECK(status.ok());
}

//===----------------------------------------------------------------------===//
// Trace
//===----------------------------------------------------------------------===//

TEST_CASE("the trace has one complete event per task per rank", "[exec]") {
  TaskProgram program = putProgram(4);
  Recorder recorder(program);
  ExecutorOptions options;
  options.workers = 4;
  options.trace = true;
  std::unique_ptr<Executor> executor = makeExecutor(program, recorder.function(), options);
  for (int pass = 0; pass < 2; ++pass) {
    recorder.reset();
    Status status = executor->run();
    INFO(status.message());
    REQUIRE(status.ok());
    CHECK(executor->trace().tasks.size() == 4 * program.tasks.size());
  }
  std::string path = scratchPath("executor-trace.json");
  Status status = executor->writeTrace(path);
  INFO(status.message());
  REQUIRE(status.ok());

  std::ifstream file(path);
  nlohmann::json trace = nlohmann::json::parse(file);
  REQUIRE(trace.contains("traceEvents"));
  std::map<std::pair<uint32_t, uint32_t>, int> seen; // (rank, task) -> count
  std::map<std::pair<uint32_t, uint32_t>, std::vector<std::pair<double, double>>> spans;
  std::map<uint32_t, std::string> rankNames;
  for (const nlohmann::json &event : trace["traceEvents"]) {
    if (event["ph"] == "M") {
      if (event["name"] == "process_name")
        rankNames[event["pid"].get<uint32_t>()] = event["args"]["name"].get<std::string>();
      continue;
    }
    if (event["cat"] == "wait" || event["ph"] != "X")
      continue;
    uint32_t rank = event["pid"].get<uint32_t>();
    uint32_t queue = event["tid"].get<uint32_t>();
    uint32_t task = event["args"]["task"].get<uint32_t>();
    REQUIRE(rank < 4);
    REQUIRE(task < program.tasks.size());
    CHECK(event["name"].get<std::string>() ==
          program.name(program.ops[program.tasks[task].op].name));
    CHECK(event["args"]["worker"].get<uint32_t>() < 4);
    double ts = event["ts"].get<double>(), dur = event["dur"].get<double>();
    CHECK(ts >= 0);
    CHECK(dur >= 0);
    ++seen[{rank, task}];
    spans[{rank, queue}].push_back({ts, ts + dur});
  }
  CHECK(seen.size() == 4 * program.tasks.size());
  for (const auto &entry : seen)
    CHECK(entry.second == 1);
  CHECK(rankNames.size() == 4);
  CHECK(rankNames[3] == "rank 3");
  // A core runs one task at a time.
  for (auto &entry : spans) {
    std::sort(entry.second.begin(), entry.second.end());
    for (size_t i = 1; i < entry.second.size(); ++i)
      CHECK(entry.second[i - 1].second <= entry.second[i].first + 1e-3);
  }
  CHECK(trace::coreName(program, 2) == "vector core 0");
}

namespace {

/// A traced executor of `program` (a diamondProgram) on `workers` workers
/// whose task A sleeps 20 ms and the others return at once.
std::unique_ptr<Executor> tracedSleepingA(const TaskProgram &program, uint32_t workers) {
  ExecutorOptions options;
  options.workers = workers;
  options.trace = true;
  return makeExecutor(
      program,
      [&program](uint32_t, uint32_t task, uint32_t) {
        if (program.name(program.ops[program.tasks[task].op].name) == "A")
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        return Status();
      },
      options);
}

} // namespace

TEST_CASE("the trace records waits with the task whose signal ended them", "[exec]") {
  // Task A sleeps, so C (alone on cube core 1) parks on event 'a' and is
  // woken by A's signal; D parks on 'b' or 'c'.
  TaskProgram program = diamondProgram(2);
  std::unique_ptr<Executor> executor = tracedSleepingA(program, 3);
  REQUIRE(executor->run().ok());
  const trace::Trace &trace = executor->trace();
  REQUIRE(trace.tasks.size() == 2 * program.tasks.size());
  std::map<std::pair<uint32_t, uint32_t>, trace::TaskSpan> spans;
  for (const trace::TaskSpan &span : trace.tasks)
    spans[{span.rank, span.task}] = span;
  size_t waitsOnA = 0;
  for (const trace::WaitSpan &wait : trace.waits) {
    INFO("wait of task " << wait.task << " on rank " << wait.rank);
    REQUIRE(wait.signalRank < 2);
    REQUIRE(wait.signalTask < program.tasks.size());
    // The signaller signals the event waited for, on the waiter's rank.
    const TaskRecord &signaller = program.tasks[wait.signalTask];
    bool signals = false;
    for (uint32_t k = 0; k < signaller.signalCount; ++k) {
      const SignalRecord &signal = program.signals[signaller.firstSignal + k];
      signals = signals || (signal.event == wait.event &&
                            program.peerRank(wait.signalRank, signal.peerOffset) == wait.rank);
    }
    CHECK(signals);
    // The wait ends while its signaller runs, and before the waiter starts.
    const trace::TaskSpan &from = spans.at({wait.signalRank, wait.signalTask});
    const trace::TaskSpan &to = spans.at({wait.rank, wait.task});
    CHECK(wait.beginNs <= wait.endNs);
    CHECK(from.startNs <= wait.endNs);
    CHECK(wait.endNs <= from.endNs);
    CHECK(wait.endNs <= to.startNs);
    CHECK(to.queue == wait.queue);
    waitsOnA += program.name(program.events[wait.event].name) == "a";
  }
  // C waits for A on both ranks (A sleeps 20 ms; C has nothing before it).
  CHECK(waitsOnA >= 2);
}

TEST_CASE("a traced run says how long its worker was off its core", "[exec]") {
  // A sleeps 20 ms: its worker's thread is off its core nearly all of it.
  // The others compute: whatever the OS took of their time, the off-core
  // time lies within the run.
  TaskProgram program = diamondProgram(2);
  std::unique_ptr<Executor> executor = tracedSleepingA(program, 2);
  REQUIRE(executor->run().ok());
  const trace::Trace &trace = executor->trace();
  REQUIRE(trace.tasks.size() == 2 * program.tasks.size());
  size_t sleepers = 0;
  for (const trace::TaskSpan &span : trace.tasks) {
    INFO("task " << span.task << " on rank " << span.rank);
    CHECK(span.offCoreNs >= 0);
    CHECK(span.offCoreNs <= span.endNs - span.startNs);
    if (program.name(program.ops[program.tasks[span.task].op].name) == "A") {
      CHECK(span.offCoreNs >= 15000000);
      ++sleepers;
    }
  }
  CHECK(sleepers == 2);
  // The Chrome trace carries it; the packed spans sent between processes too.
  nlohmann::json json = nlohmann::json::parse(trace::chromeTraceJson(program, trace));
  size_t slices = 0;
  for (const nlohmann::json &event : json["traceEvents"])
    if (event["ph"] == "X" && event["cat"] != "wait" && event["cat"] != "phase") {
      CHECK(event["args"]["off_core_us"].get<double>() >= 0);
      CHECK(event["args"]["off_core_us"].get<double>() <= event["dur"].get<double>() + 1e-3);
      ++slices;
    }
  CHECK(slices == trace.tasks.size());
  const std::vector<char> bytes = trace::packTrace(trace);
  trace::Trace back;
  REQUIRE(trace::unpackTrace(bytes.data(), bytes.size(), &back).ok());
  REQUIRE(back.tasks.size() == trace.tasks.size());
  for (size_t i = 0; i < back.tasks.size(); ++i)
    CHECK(back.tasks[i].offCoreNs == trace.tasks[i].offCoreNs);
}

TEST_CASE("no trace is kept when tracing is off, and a bad path is an error", "[exec]") {
  TaskProgram program = diamondProgram(2);
  ExecutorOptions options;
  options.workers = 2;
  std::unique_ptr<Executor> executor = makeExecutor(
      program, [](uint32_t, uint32_t, uint32_t) { return Status(); }, options);
  Status status = executor->run();
  REQUIRE(status.ok());
  CHECK(executor->trace().empty());
  CHECK(executor->trace().waits.empty());
  std::string message = errorOf(executor->writeTrace("/nonexistent-dir/trace.json"));
  CHECK(message == "/nonexistent-dir/trace.json: cannot open for writing: No such file or directory");
}

TEST_CASE("a thread team runs every item once, loop after loop", "[exec][team]") {
  for (uint32_t threads : {1u, 2u, 3u, 8u}) {
    moec::exec::ThreadTeam team(threads);
    CHECK(team.size() == threads);
    for (size_t count : {size_t(0), size_t(1), size_t(2), size_t(7), size_t(1000)}) {
      std::vector<std::atomic<int>> seen(count);
      std::mutex idsMutex;
      std::set<std::thread::id> ids;
      team.run(count, [&](size_t i) {
        seen[i].fetch_add(1);
        std::lock_guard<std::mutex> lock(idsMutex);
        ids.insert(std::this_thread::get_id());
      });
      for (size_t i = 0; i < count; ++i)
        CHECK(seen[i].load() == 1);
      CHECK(ids.size() <= std::min<size_t>(threads, std::max<size_t>(count, 1)));
    }
  }
}

TEST_CASE("a thread team the system starts fewer threads for runs every item all the same",
          "[exec][team]") {
  // A starter that gives `startable` threads, then fails as a system out of
  // threads does (std::thread throws std::system_error): the team is
  // smaller, says why, and its loops still run every item once.
  for (uint32_t startable : {0u, 1u, 2u}) {
    INFO("threads the system starts: " << startable);
    uint32_t started = 0;
    const moec::exec::ThreadTeam::Starter start = [&](std::function<void()> body) {
      if (started == startable)
        throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                                "no thread to be had");
      ++started;
      return std::thread(std::move(body));
    };
    moec::exec::ThreadTeam team(4, start);
    CHECK(team.size() == startable + 1);
    CHECK_THAT(team.whyFewer(), Catch::Contains("no thread to be had"));
    for (size_t count : {size_t(1), size_t(5), size_t(100)}) {
      std::vector<std::atomic<int>> seen(count);
      team.run(count, [&](size_t i) { seen[i].fetch_add(1); });
      for (size_t i = 0; i < count; ++i)
        CHECK(seen[i].load() == 1);
    }
  }
  moec::exec::ThreadTeam all(
      3, [](std::function<void()> body) { return std::thread(std::move(body)); });
  CHECK(all.size() == 3);
  CHECK(all.whyFewer().empty());
}
