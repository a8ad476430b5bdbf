//===- LowerTest.cpp - Graph to task program: tasks, tilings, events, queues ===//
//
// Lowers the shipped graphs after the graph pipeline, schedules them and
// checks what a device would run: task counts per op against the seed's
// formulas (through a written and re-read binary), tiling descriptors,
// events at both granularities, the terminate event, and the queues.
//
//===----------------------------------------------------------------------===//

#include "compiler/driver/Compile.h"
#include "compiler/lower/Lower.h"
#include "compiler/target/Schedule.h"
#include "compiler/target/Simulate.h"
#include "format/TaskBinary.h"
#include "tests/unit/support/GraphTestSupport.h"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <string>

using namespace moec;
using namespace moec::format;

namespace {

/// A lowered, scheduled, proven program of one graph and config, compiled
/// the way `moec compile` does.
using Compiled = driver::CompileResult;

Compiled compile(const std::string &graph, const std::string &config,
                 const std::string &targetName, lower::Granularity granularity) {
  INFO(graph << " with " << config << " on " << targetName);
  driver::CompileOptions options;
  options.configPath = config;
  options.target = targetName;
  options.granularity = granularity;
  Compiled c;
  Status compiled = driver::compileGraphFile(graph, options, &c);
  INFO(compiled.message());
  REQUIRE(compiled.ok());
  return c;
}

const OpRecord &opNamed(const TaskProgram &p, const std::string &name) {
  for (const OpRecord &op : p.ops)
    if (p.name(op.name) == name)
      return op;
  FAIL("no op " << name);
  return p.ops.front();
}

const TilingRecord &tilingOf(const TaskProgram &p, const std::string &op) {
  return p.tilings[opNamed(p, op).tiling];
}

/// The events task `t` waits on, by name.
std::set<std::string> waitNames(const TaskProgram &p, uint32_t t) {
  std::set<std::string> names;
  const TaskRecord &task = p.tasks[t];
  for (uint32_t i = 0; i < task.waitCount; ++i)
    names.insert(std::string(p.name(p.events[p.waits[task.firstWait + i].event].name)));
  return names;
}

const EventRecord &eventNamed(const TaskProgram &p, const std::string &name) {
  for (const EventRecord &e : p.events)
    if (p.name(e.name) == name)
      return e;
  FAIL("no event " << name);
  return p.events.front();
}

} // namespace

TEST_CASE("per-expert binaries hold the seed's task counts", "[lower]") {
  for (const char *config :
       {"examples/configs/seed-test.json", "examples/configs/seed-defaults.json"}) {
    for (const char *graph : test::kGraphs) {
      INFO(graph << " with " << config);
      Compiled c = compile(graph, config, "ascend-910b", lower::Granularity::PerExpert);
      // Through the file format, as `moec dump` sees it.
      std::vector<uint8_t> bytes = writeTaskBinary(c.program);
      TaskProgram read;
      REQUIRE(readTaskBinary(bytes.data(), bytes.size(), &read).ok());
      TaskSplitValue tsv = deriveTaskSplitValue(c.config);
      const std::map<OpKind, std::string> seedType = {
          {OpKind::Dispatch, "ALLTOALL"}, {OpKind::Combine, "ALLTOALL"}, {OpKind::Gmm, "GMM"},
          {OpKind::Swiglu, "SWIGLU"},     {OpKind::SwigluGrad, "SWIGLU_GRAD"}};
      for (const OpRecord &op : read.ops) {
        std::string type = seedType.at(op.kind);
        INFO("op " << read.name(op.name));
        CHECK(int64_t(op.taskCount) ==
              test::seedTaskNum(type, test::seedSplitValue(type), tsv, 24));
      }
      CHECK(read.epRanks == uint32_t(c.config.ep));
      CHECK(read.localExperts == uint32_t(tsv.singleRankExpertNum));
      CHECK(read.name(read.target) == "ascend-910b");
      CHECK(read.queues.size() == 24 + 48);
    }
  }
}

TEST_CASE("tiling descriptors follow the graph's shapes", "[lower]") {
  Compiled fwd = compile("graphs/seed/moe_ffn_fwd.json", "examples/configs/tiny.json", "cpu",
                         lower::Granularity::PerTileRange);
  const TaskProgram &p = fwd.program;
  CHECK_FALSE(p.isBackward());
  CHECK(p.epRanks == 2);
  CHECK(p.localExperts == 2);
  // tiny: H 64, I 32, per_expert_seq 256, per_expert_seq_to_other 128.
  const TilingRecord &up = tilingOf(p, "up_proj");
  CHECK(up.opKind == OpKind::Gmm);
  CHECK(up.dtype == format::DType::F32);
  CHECK(up.experts == 2);
  CHECK(up.peers == 1);
  CHECK(up.rowTiles == 1);
  CHECK(up.colTiles == 2);
  CHECK(up.rows == 256);
  CHECK(up.cols == 64); // 2I
  CHECK(up.depth == 64); // K = H
  CHECK(up.lda == 64);
  CHECK(up.ldb == 64);
  CHECK(up.ldc == 64);
  CHECK(up.flags == 0);
  CHECK(up.inputCount == 3);
  CHECK(p.name(p.slots[up.inputSlots[0]].name) == "target");
  CHECK(p.name(p.slots[up.inputSlots[1]].name) == "up_proj_weight");
  CHECK(p.name(p.slots[up.outputSlot].name) == "up_proj_y");
  CHECK(up.balancedRows == 128); // per_rank_seq 256 over 2 experts
  CHECK(up.tileM == 64);

  const TilingRecord &dispatch = tilingOf(p, "dispatch");
  CHECK(dispatch.experts == 2);
  CHECK(dispatch.peers == 2);
  CHECK(dispatch.rows == 128);
  CHECK(dispatch.inputCount == 4);
  CHECK(dispatch.balancedRows == 64); // 256 rows over 2 experts x 2 peers

  const TilingRecord &swiglu = tilingOf(p, "swiglu");
  CHECK(swiglu.rowTiles == 2);
  CHECK(swiglu.cols == 32);
  CHECK(swiglu.lda == 64);
  CHECK(swiglu.ldc == 32);
  // Task t of an op is tile t of its grid.
  const OpRecord &swigluOp = opNamed(p, "swiglu");
  TileCoord last = tileCoord(swiglu, swigluOp.taskCount - 1);
  CHECK(last.expert == 1);
  CHECK(last.rowTile == 1);
  CHECK(last.rowBegin == 128);
  CHECK(last.rowEnd == 256);

  Compiled bwd = compile("graphs/seed/moe_ffn_bwd.json", "examples/configs/tiny.json", "cpu",
                         lower::Granularity::PerTileRange);
  const TaskProgram &b = bwd.program;
  CHECK(b.isBackward());
  const TilingRecord &actGrad = tilingOf(b, "act_grad");
  CHECK(actGrad.flags == kTilingTransposeB);
  CHECK(actGrad.depth == 64); // dA = dZ · w2ᵀ reduces over H
  CHECK(actGrad.cols == 32);
  const TilingRecord &w1Grad = tilingOf(b, "w1_grad");
  CHECK(w1Grad.flags == kTilingTransposeA);
  CHECK(w1Grad.depth == 0); // reduces over the expert's rows
  CHECK(w1Grad.rows * w1Grad.cols == 32 * 64);
  CHECK(w1Grad.rowTiles * w1Grad.colTiles == 2);
}

TEST_CASE("per-expert events: one per producer and expert", "[lower]") {
  Compiled c = compile("graphs/seed/moe_ffn_fwd.json", "examples/configs/tiny.json", "cpu",
                       lower::Granularity::PerExpert);
  const TaskProgram &p = c.program;
  // dispatch.e<l> on the receiving rank counts the tiles of expert l from
  // both ranks: 2 peers x 1 row tile.
  for (const char *name : {"dispatch.e0", "dispatch.e1"}) {
    const EventRecord &e = eventNamed(p, name);
    CHECK(e.kind == EventKind::CrossRank);
    CHECK(e.threshold == 2);
  }
  const OpRecord &up = opNamed(p, "up_proj");
  for (uint32_t t = 0; t < up.taskCount; ++t) {
    uint32_t expert = tileCoord(p.tilings[up.tiling], t).expert;
    CHECK(waitNames(p, up.firstTask + t) ==
          std::set<std::string>{"dispatch.e" + std::to_string(expert)});
  }
  // A dispatch tile signals its expert's event on the peer it puts to.
  const OpRecord &dispatch = opNamed(p, "dispatch");
  for (uint32_t t = 0; t < dispatch.taskCount; ++t) {
    const TaskRecord &task = p.tasks[dispatch.firstTask + t];
    TileCoord tile = tileCoord(p.tilings[dispatch.tiling], t);
    REQUIRE(task.signalCount == 1);
    const SignalRecord &s = p.signals[task.firstSignal];
    CHECK(p.name(p.events[s.event].name) == "dispatch.e" + std::to_string(tile.expert));
    CHECK(s.peerOffset == tile.peer);
    CHECK(task.waitCount == 0);
  }
  // The terminate event: every combine put, on the rank it returns rows to.
  const EventRecord &terminate = eventNamed(p, "terminate");
  CHECK(terminate.kind == EventKind::Terminate);
  const OpRecord &combine = opNamed(p, "combine");
  CHECK(terminate.threshold == combine.taskCount);
  for (uint32_t t = 0; t < combine.taskCount; ++t) {
    const TaskRecord &task = p.tasks[combine.firstTask + t];
    REQUIRE(task.signalCount == 1);
    CHECK(p.signals[task.firstSignal].peerOffset ==
          tileCoord(p.tilings[combine.tiling], t).peer);
  }
}

TEST_CASE("backward sinks and the ordering edge", "[lower]") {
  Compiled c = compile("graphs/seed/moe_ffn_bwd.json", "examples/configs/tiny.json", "cpu",
                       lower::Granularity::PerExpert);
  const TaskProgram &p = c.program;
  // Sinks: combine, w1_grad and w2_grad (their results leave the graph).
  uint32_t sinks = opNamed(p, "combine").taskCount + opNamed(p, "w1_grad").taskCount +
                   opNamed(p, "w2_grad").taskCount;
  CHECK(eventNamed(p, "terminate").threshold == sinks);
  // w2_grad (expert 0) waits for gate_grad's tiles of every expert (the
  // seed's ordering-only edge) and for swiglu_grad's tiles of its expert.
  const OpRecord &w2 = opNamed(p, "w2_grad");
  CHECK(waitNames(p, w2.firstTask) ==
        std::set<std::string>{"gate_grad.e0", "gate_grad.e1", "swiglu_grad.e0"});
}

TEST_CASE("per-tile-range events let a consumer start on its rows", "[lower]") {
  // With GMM split values of 64 rows, tiny's GMMs get two row tiles per
  // expert (128 balanced rows each), like swiglu.
  nlohmann::json graph;
  {
    std::ifstream in("graphs/seed/moe_ffn_fwd.json");
    in >> graph;
  }
  for (auto &op : graph["ops"])
    if (op["op"] == "gmm")
      op["split_value"] = 64;
  std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/fwd-split64.json";
  std::ofstream(path) << graph.dump();

  Compiled range =
      compile(path, "examples/configs/tiny.json", "cpu", lower::Granularity::PerTileRange);
  Compiled expert =
      compile(path, "examples/configs/tiny.json", "cpu", lower::Granularity::PerExpert);
  REQUIRE(range.program.tasks.size() == expert.program.tasks.size());
  const TilingRecord &down = tilingOf(range.program, "down_proj");
  CHECK(down.rowTiles == 2);
  CHECK(down.colTiles == 1);

  // down_proj tile (e0, row tile 0) reads rows [0, 128) of expert 0: per tile
  // range it waits for swiglu tile 0 alone, per expert for all of expert 0's.
  uint32_t first = opNamed(range.program, "down_proj").firstTask;
  CHECK(waitNames(range.program, first) == std::set<std::string>{"swiglu[0]"});
  CHECK(waitNames(expert.program, first) == std::set<std::string>{"swiglu.e0"});
  CHECK(eventNamed(range.program, "swiglu[0]").threshold == 1);
  CHECK(eventNamed(expert.program, "swiglu.e0").threshold == 2);
  // And swiglu row tile 1 of expert 1 waits for up_proj's row tile 1 of
  // expert 1 only (tile 3).
  const OpRecord &swiglu = opNamed(range.program, "swiglu");
  CHECK(waitNames(range.program, swiglu.firstTask + 3) == std::set<std::string>{"up_proj[3]"});

  for (const Compiled *c : {&range, &expert}) {
    const TaskProgram &p = c->program;
    uint64_t total = 0, signals = 0;
    for (const EventRecord &e : p.events)
      total += e.threshold;
    for (const TaskRecord &t : p.tasks)
      signals += t.signalCount;
    CHECK(total == signals); // every signal counts once, on its rank
  }
}

TEST_CASE("queues: every task once, balanced, puts rotated by peer", "[lower]") {
  Compiled c = compile("graphs/seed/moe_ffn_fwd.json", "examples/configs/seed-test.json",
                       "ascend-910b", lower::Granularity::PerExpert);
  const TaskProgram &p = c.program;
  CHECK(p.queues.size() == 72);
  // Every cube core gets GMM work: 24 tasks per expert spread over 24 cores.
  for (const QueueRecord &q : p.queues)
    if (q.coreKind == CoreKind::Cube)
      CHECK(q.entryCount > 0);
  // Within a queue, a dispatch task of an expert never precedes one of the
  // same expert with a smaller peer offset.
  const OpRecord &dispatch = opNamed(p, "dispatch");
  const TilingRecord &tiling = p.tilings[dispatch.tiling];
  for (const QueueRecord &q : p.queues) {
    std::map<uint32_t, uint32_t> lastPeer;
    for (uint32_t i = 0; i < q.entryCount; ++i) {
      uint32_t t = p.queueEntries[q.firstEntry + i];
      if (p.tasks[t].op != uint32_t(&dispatch - p.ops.data()))
        continue;
      TileCoord tile = tileCoord(tiling, t - dispatch.firstTask);
      auto it = lastPeer.find(tile.expert);
      if (it != lastPeer.end())
        CHECK(tile.peer >= it->second);
      lastPeer[tile.expert] = tile.peer;
    }
  }
  CHECK(c.estimate.makespan >= c.estimate.criticalPath);
  CHECK(c.estimate.criticalPath > 0);
}

TEST_CASE("deepseek-v3 on ascend-910b fits in a tenth of the seed's 15 MB", "[lower]") {
  for (const char *graph : test::kGraphs) {
    INFO(graph);
    Compiled c = compile(graph, "examples/configs/deepseek-v3.json", "ascend-910b",
                         lower::Granularity::PerTileRange);
    CHECK(writeTaskBinary(c.program).size() <= 15u * 1024 * 1024 / 10);
  }
}
