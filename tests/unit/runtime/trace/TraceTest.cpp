//===- TraceTest.cpp - Tests for traces and their Chrome JSON writer ------===//
//
// runtime/trace on a hand-made two-rank trace: the Chrome/Perfetto JSON
// parsed back (metadata, process and thread names, task, wait and phase
// spans with their timestamps and durations in microseconds, the flow arrow
// from a signalling task to the task that waited), escaping, unknown tasks;
// the spans' shift, append and sort; the packed form sent between processes;
// and the file writer.
//
//===----------------------------------------------------------------------===//

#include "runtime/trace/Trace.h"
#include "format/TaskBinary.h"
#include "tests/unit/support/ProgramBuilder.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

using namespace moec;
using namespace moec::format;
using moec::test::ProgramBuilder;
using moec::test::requireValid;
using moec::trace::PhaseSpan;
using moec::trace::TaskSpan;
using moec::trace::Trace;
using moec::trace::WaitSpan;
using nlohmann::json;

namespace {

/// Two ranks. Op "dispatch": tasks 0 and 1, the puts to peer offsets 0 and
/// 1, on vector core 0 (queue 0); each signals event 0 "rows" on its peer.
/// Op "up": tasks 2 and 3, two column tiles of a GMM, on cube core 0 (queue
/// 1); each waits for "rows" and signals the terminate event "done".
TaskProgram twoRankProgram() {
  ProgramBuilder b(2);
  const uint32_t d = b.op("dispatch", OpKind::Dispatch, CoreKind::Vector, 2, 2);
  const uint32_t g = b.op("up", OpKind::Gmm, CoreKind::Cube, 2);
  const uint32_t rows = b.event("rows", EventKind::CrossRank);
  const uint32_t done = b.event("done", EventKind::Terminate);
  for (uint32_t k = 0; k < 2; ++k) {
    b.signal(d + k, rows, 1, k);
    b.wait(g + k, rows);
    b.signal(g + k, done);
  }
  b.queue(CoreKind::Vector, 0, {d, d + 1});
  b.queue(CoreKind::Cube, 0, {g, g + 1});
  TaskProgram program = b.build();
  requireValid(program);
  return program;
}

/// A trace of a pass of twoRankProgram(): every task on both ranks, rank 0's
/// cube core waiting for "rows" until rank 1's task 1 put its rows there, a
/// wait on rank 1 whose signaller is not known, and rank 0's host phases.
Trace twoRankTrace() {
  Trace t;
  t.source = "simulated";
  t.profile = "cpu";
  // rank, queue, task, worker, start, end (ns)
  t.tasks = {
      {0, 0, 0, 1, 1234, 3000},   {0, 0, 1, 1, 3000, 5500}, {0, 1, 2, 0, 6000, 10000},
      {0, 1, 3, 0, 10000, 10400}, {1, 0, 0, 3, 1500, 2500}, {1, 0, 1, 3, 2500, 5800},
      {1, 1, 2, 2, 4000, 7000},   {1, 1, 3, 2, 7000, 9000},
  };
  WaitSpan known;
  known.rank = 0;
  known.queue = 1;
  known.task = 2;
  known.event = 0;
  known.beginNs = 2000;
  known.endNs = 6000;
  known.signalRank = 1;
  known.signalTask = 1;
  WaitSpan unknown;
  unknown.rank = 1;
  unknown.queue = 1;
  unknown.task = 2;
  unknown.event = 0;
  unknown.beginNs = 3000;
  unknown.endNs = 4000;
  t.waits = {known, unknown};
  t.phases = {{0, "prepare", 0, 1000}, {0, "tasks", 1000, 10400}, {0, "finish", 10400, 10650}};
  return t;
}

/// The events of a parsed trace that match `pred`.
template <typename Pred> std::vector<json> eventsWhere(const json &trace, Pred pred) {
  std::vector<json> out;
  for (const json &e : trace.at("traceEvents"))
    if (pred(e))
      out.push_back(e);
  return out;
}

/// The one complete event of category `cat` at (pid, tid) with args.task ==
/// `task` (or, for phases, named `name`).
json spanAt(const json &trace, const std::string &cat, uint32_t pid, uint32_t tid, int64_t task,
            const std::string &name = "") {
  std::vector<json> found = eventsWhere(trace, [&](const json &e) {
    return e.at("ph") == "X" && e.at("cat") == cat && e.at("pid") == pid && e.at("tid") == tid &&
           (name.empty() || e.at("name") == name) && (task < 0 || e.at("args").at("task") == task);
  });
  INFO(cat << " span at pid " << pid << " tid " << tid << " task " << task << " " << name);
  REQUIRE(found.size() == 1);
  return found[0];
}

std::string tempPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

} // namespace

//===----------------------------------------------------------------------===//
// Chrome trace JSON
//===----------------------------------------------------------------------===//

TEST_CASE("the Chrome trace: metadata and the names of ranks and cores", "[trace]") {
  const TaskProgram program = twoRankProgram();
  const json trace = json::parse(trace::chromeTraceJson(program, twoRankTrace(), "fwd.bin"));

  CHECK(trace.at("displayTimeUnit") == "ns");
  const json &meta = trace.at("metadata");
  CHECK(meta.at("source") == "simulated");
  CHECK(meta.at("profile") == "cpu");
  CHECK(meta.at("pass") == "forward");
  CHECK(meta.at("binary") == "fwd.bin");
  CHECK(meta.at("ep_ranks") == 2);
  CHECK(meta.at("local_experts") == 1);

  std::map<uint32_t, std::string> processes;
  std::map<std::pair<uint32_t, uint32_t>, std::string> threads;
  std::map<std::pair<uint32_t, uint32_t>, int64_t> threadOrder;
  for (const json &e : eventsWhere(trace, [](const json &e) { return e.at("ph") == "M"; })) {
    const uint32_t pid = e.at("pid"), tid = e.at("tid");
    if (e.at("name") == "process_name")
      processes[pid] = e.at("args").at("name");
    else if (e.at("name") == "thread_name")
      threads[{pid, tid}] = e.at("args").at("name");
    else if (e.at("name") == "thread_sort_index")
      threadOrder[{pid, tid}] = e.at("args").at("sort_index");
  }
  CHECK(processes == std::map<uint32_t, std::string>{{0, "rank 0"}, {1, "rank 1"}});
  // tid = queue index; the host's phases on tid = number of queues, only on
  // the rank that has phases.
  CHECK(threads == std::map<std::pair<uint32_t, uint32_t>, std::string>{
                       {{0, 0}, "vector core 0"},
                       {{0, 1}, "cube core 0"},
                       {{0, 2}, "host"},
                       {{1, 0}, "vector core 0"},
                       {{1, 1}, "cube core 0"},
                   });
  CHECK(threadOrder.at({0, 2}) == -1); // the host first
  CHECK(threadOrder.at({0, 1}) == 1);

  CHECK(trace::coreName(program, 0) == "vector core 0");
  CHECK(trace::coreName(program, 1) == "cube core 0");
  CHECK(trace::coreName(program, 7) == "queue 7");

  // A backward program's pass.
  TaskProgram backward = program;
  backward.flags |= kFlagBackward;
  CHECK(json::parse(trace::chromeTraceJson(backward, Trace())).at("metadata").at("pass") ==
        "backward");
}

TEST_CASE("the Chrome trace: task spans in microseconds with their tiles", "[trace]") {
  const TaskProgram program = twoRankProgram();
  const json trace = json::parse(trace::chromeTraceJson(program, twoRankTrace()));

  // One complete event per task span.
  const auto tasks = eventsWhere(trace, [](const json &e) {
    return e.at("ph") == "X" && (e.at("cat") == "dispatch" || e.at("cat") == "gmm");
  });
  CHECK(tasks.size() == 8);

  // Rank 0's first put: 1234 ns to 3000 ns, to itself (peer offset 0).
  json put0 = spanAt(trace, "dispatch", 0, 0, 0);
  CHECK(put0.at("name") == "dispatch");
  CHECK(put0.at("ts").get<double>() == Approx(1.234));
  CHECK(put0.at("dur").get<double>() == Approx(1.766));
  const json &a0 = put0.at("args");
  CHECK(a0.at("op") == 0);
  CHECK(a0.at("rank") == 0);
  CHECK(a0.at("peer") == 0);
  CHECK(a0.at("expert") == 0);
  CHECK(a0.at("worker") == 1);
  CHECK(a0.at("rows") == json::array({0, 64}));
  CHECK(a0.at("cols") == json::array({0, 64}));

  // Rank 1's put at peer offset 1 goes to rank 0, an expert of rank 0's.
  const json a1 = spanAt(trace, "dispatch", 1, 0, 1).at("args");
  CHECK(a1.at("peer") == 0);
  CHECK(a1.at("expert") == 0);
  CHECK(a1.at("worker") == 3);

  // Rank 1's second GMM tile: column tile 1, columns [64, 128) of its own
  // expert 1.
  json gmm = spanAt(trace, "gmm", 1, 1, 3);
  CHECK(gmm.at("name") == "up");
  CHECK(gmm.at("ts").get<double>() == Approx(7.0));
  CHECK(gmm.at("dur").get<double>() == Approx(2.0));
  const json &ga = gmm.at("args");
  CHECK(ga.at("op") == 1);
  CHECK(ga.at("expert") == 1);
  CHECK(ga.at("peer") == 1);
  CHECK(ga.at("row_tile") == 0);
  CHECK(ga.at("col_tile") == 1);
  CHECK(ga.at("cols") == json::array({64, 128}));

  // A simulated span does not know its time off the core: no off_core_us.
  CHECK_FALSE(a0.contains("off_core_us"));
  // A measured one does, in microseconds.
  Trace measured = twoRankTrace();
  measured.source = "measured";
  for (TaskSpan &span : measured.tasks)
    span.offCoreNs = (span.endNs - span.startNs) / 4;
  const json withOff = json::parse(trace::chromeTraceJson(program, measured));
  CHECK(spanAt(withOff, "dispatch", 0, 0, 0).at("args").at("off_core_us").get<double>() ==
        Approx(0.441)); // (3000 - 1234) / 4 ns
  CHECK(spanAt(withOff, "gmm", 1, 1, 3).at("args").at("off_core_us").get<double>() == Approx(0.5));
}

TEST_CASE("the Chrome trace: waits, the signal's flow arrow, and host phases", "[trace]") {
  const TaskProgram program = twoRankProgram();
  const json trace = json::parse(trace::chromeTraceJson(program, twoRankTrace()));

  // Rank 0's cube core waited 2000..6000 ns for "rows", met by rank 1's
  // task 1.
  json wait = spanAt(trace, "wait", 0, 1, 2);
  CHECK(wait.at("name") == "wait rows");
  CHECK(wait.at("ts").get<double>() == Approx(2.0));
  CHECK(wait.at("dur").get<double>() == Approx(4.0));
  CHECK(wait.at("args").at("event") == 0);
  CHECK(wait.at("args").at("event_name") == "rows");
  CHECK(wait.at("args").at("signal_rank") == 1);
  CHECK(wait.at("args").at("signal_task") == 1);

  // A signaller that is not known is -1, and draws no arrow.
  json blind = spanAt(trace, "wait", 1, 1, 2);
  CHECK(blind.at("args").at("signal_rank") == -1);
  CHECK(blind.at("args").at("signal_task") == -1);

  // One arrow: it starts inside the signaller's slice (rank 1, queue 0,
  // 2500..5800 ns: the wait's end, 6000, clamped to 500 ns before the
  // slice's end) and ends 500 ns into the waiter's slice (from 6000 ns).
  const auto starts = eventsWhere(trace, [](const json &e) { return e.at("ph") == "s"; });
  const auto ends = eventsWhere(trace, [](const json &e) { return e.at("ph") == "f"; });
  REQUIRE(starts.size() == 1);
  REQUIRE(ends.size() == 1);
  CHECK(starts[0].at("cat") == "signal");
  CHECK(starts[0].at("id") == ends[0].at("id"));
  CHECK(starts[0].at("pid") == 1);
  CHECK(starts[0].at("tid") == 0);
  CHECK(starts[0].at("ts").get<double>() == Approx(5.3));
  CHECK(ends[0].at("pid") == 0);
  CHECK(ends[0].at("tid") == 1);
  CHECK(ends[0].at("bp") == "e");
  CHECK(ends[0].at("ts").get<double>() == Approx(6.5));

  // Host phases on the host thread (tid 2: after the 2 queues).
  const auto phases =
      eventsWhere(trace, [](const json &e) { return e.value("cat", "") == "phase"; });
  REQUIRE(phases.size() == 3);
  json finish = spanAt(trace, "phase", 0, 2, -1, "finish");
  CHECK(finish.at("ts").get<double>() == Approx(10.4));
  CHECK(finish.at("dur").get<double>() == Approx(0.25));
  json tasks = spanAt(trace, "phase", 0, 2, -1, "tasks");
  CHECK(tasks.at("dur").get<double>() == Approx(9.4));
}

TEST_CASE("trace JSON escapes op names", "[trace]") {
  ProgramBuilder b(1);
  uint32_t a = b.op("we\"ird\\name", OpKind::Gmm, CoreKind::Cube, 1);
  b.queue(CoreKind::Cube, 0, {a});
  TaskProgram program = b.build();
  trace::Trace events;
  events.tasks = {{0, 0, a, 0, 1000, 2500}};
  nlohmann::json trace = nlohmann::json::parse(trace::chromeTraceJson(program, events));
  const nlohmann::json &last = trace["traceEvents"].back();
  CHECK(last["name"] == "we\"ird\\name");
  CHECK(last["ts"].get<double>() == Approx(1.0));
  CHECK(last["dur"].get<double>() == Approx(1.5));
  CHECK(last["cat"] == "gmm");
}

TEST_CASE("trace JSON escapes control characters and marks unknown tasks", "[trace]") {
  ProgramBuilder b(1);
  const uint32_t a = b.op("a", OpKind::Swiglu, CoreKind::Vector, 1);
  b.event("line\nbreak\ttab\x01");
  b.queue(CoreKind::Vector, 0, {a});
  const TaskProgram program = b.build();
  Trace t;
  t.source = "measured \"run\"";
  t.phases = {{0, "pre\npare", 0, 10}};
  t.tasks = {{0, 0, 7, 0, 0, 100}}; // task 7: not in the program
  t.waits = {{0, 0, 0, 0, 0, 5}};
  const json trace = json::parse(trace::chromeTraceJson(program, t));
  CHECK(trace.at("metadata").at("source") == "measured \"run\"");
  CHECK(spanAt(trace, "phase", 0, 1, -1).at("name") == "pre\npare");
  const json wait = spanAt(trace, "wait", 0, 0, 0);
  CHECK(wait.at("name") == "wait line\nbreak\ttab\x01");
  CHECK(wait.at("args").at("event_name") == "line\nbreak\ttab\x01");
  const json unknown = spanAt(trace, "?", 0, 0, 7);
  CHECK(unknown.at("name") == "?");
  CHECK(unknown.at("args").at("op") == kNone);
  CHECK_FALSE(unknown.at("args").contains("expert"));
}

//===----------------------------------------------------------------------===//
// Spans
//===----------------------------------------------------------------------===//

TEST_CASE("spans shift, append and sort by start, then rank and queue", "[trace]") {
  Trace t;
  CHECK(t.empty());
  t.tasks = {{1, 0, 5, 0, 300, 400}, {0, 1, 6, 0, 300, 350}, {0, 0, 7, 0, 100, 200}};
  t.waits = {{1, 0, 5, 0, 250, 300}, {0, 1, 6, 0, 50, 300}};
  CHECK_FALSE(t.empty());

  Trace other;
  other.phases = {{0, "prepare", 0, 50}};
  t.append(other);
  CHECK(t.tasks.size() == 3);
  CHECK(t.phases.size() == 1);

  t.shift(1000);
  CHECK(t.tasks[0].startNs == 1300);
  CHECK(t.tasks[0].endNs == 1400);
  CHECK(t.waits[1].beginNs == 1050);
  CHECK(t.waits[1].endNs == 1300);
  CHECK(t.phases[0].beginNs == 1000);
  CHECK(t.phases[0].endNs == 1050);

  t.sort();
  std::vector<uint32_t> order;
  for (const TaskSpan &s : t.tasks)
    order.push_back(s.task);
  CHECK(order == std::vector<uint32_t>{7, 6, 5}); // 1100; 1300 rank 0; 1300 rank 1
  CHECK(t.waits[0].task == 6);
  CHECK(t.waits[1].task == 5);
}

TEST_CASE("a packed trace unpacks to the same spans, appended", "[trace]") {
  Trace original = twoRankTrace();
  original.tasks[2].offCoreNs = 1500; // (the others unknown)
  const std::vector<char> bytes = trace::packTrace(original);

  Trace out;
  out.tasks = {{1, 1, 1, 1, 1, 2}}; // kept: the spans are appended
  Status status = trace::unpackTrace(bytes.data(), bytes.size(), &out);
  INFO(status.message());
  REQUIRE(status.ok());
  REQUIRE(out.tasks.size() == 1 + original.tasks.size());
  for (size_t i = 0; i < original.tasks.size(); ++i) {
    const TaskSpan &a = original.tasks[i], &b = out.tasks[i + 1];
    CHECK(a.rank == b.rank);
    CHECK(a.queue == b.queue);
    CHECK(a.task == b.task);
    CHECK(a.worker == b.worker);
    CHECK(a.startNs == b.startNs);
    CHECK(a.endNs == b.endNs);
    CHECK(a.offCoreNs == b.offCoreNs);
  }
  CHECK(out.tasks[3].offCoreNs == 1500);
  REQUIRE(out.waits.size() == 2);
  CHECK(out.waits[0].signalRank == 1);
  CHECK(out.waits[0].signalTask == 1);
  CHECK(out.waits[0].endNs == 6000);
  CHECK(out.waits[1].signalRank == trace::kUnknown);
  REQUIRE(out.phases.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CHECK(out.phases[i].name == original.phases[i].name);
    CHECK(out.phases[i].beginNs == original.phases[i].beginNs);
    CHECK(out.phases[i].endNs == original.phases[i].endNs);
  }

  // Every cut is refused.
  for (size_t size = 0; size < bytes.size(); ++size) {
    Trace cut;
    Status s = trace::unpackTrace(bytes.data(), size, &cut);
    INFO("cut at " << size);
    CHECK(s.message() == "a packed trace that is cut short or too long");
  }
  // And so is a count that the bytes cannot hold.
  std::vector<char> huge = bytes;
  const uint64_t tasks = uint64_t(1) << 40;
  std::memcpy(huge.data(), &tasks, sizeof tasks);
  Trace refused;
  CHECK_FALSE(trace::unpackTrace(huge.data(), huge.size(), &refused).ok());
  CHECK(refused.empty());
}

TEST_CASE("writeChromeTrace writes the JSON whole, and an error names the path", "[trace]") {
  const TaskProgram program = twoRankProgram();
  const Trace t = twoRankTrace();
  const std::string path = tempPath("trace-test.json");
  Status status = trace::writeChromeTrace(program, t, path, "b.bin");
  INFO(status.message());
  REQUIRE(status.ok());
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text == trace::chromeTraceJson(program, t, "b.bin"));

  status = trace::writeChromeTrace(program, t, "/nonexistent-dir/trace.json");
  REQUIRE_FALSE(status.ok());
  CHECK(status.message().rfind("/nonexistent-dir/trace.json: ", 0) == 0);
}
