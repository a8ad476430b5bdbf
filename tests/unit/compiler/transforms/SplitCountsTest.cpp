//===- SplitCountsTest.cpp - Task counts and slots against the seed -------===//
//
// Runs the graph pipeline on the shipped forward and backward graphs and
// checks the task counts against the seed's task_num formulas, and the
// backward graph's slots and edges against the seed's backward graph.
//
//===----------------------------------------------------------------------===//

#include "tests/unit/support/GraphTestSupport.h"

#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using moec::ModelConfig;
using moec::TaskSplitValue;
using moec::moe::GraphOp;
using moec::moe::TaskOpInterface;
using moec::test::kGraphs;
using moec::test::loadExample;
using moec::test::PipelineRun;
using moec::test::seedSplitValue;
using moec::test::seedTaskNum;
using moec::moe::TensorDefOpInterface;
using moec::moe::TileMapAttr;

namespace {

/// An op's parameter slots as the seed lists them: inputs, then the output.
std::vector<int64_t> paramPositions(TaskOpInterface op) {
  std::vector<int64_t> slots;
  for (mlir::Value v : op->getOperands()) {
    auto def = v.getDefiningOp<TensorDefOpInterface>();
    REQUIRE(def);
    REQUIRE(def.getSlot());
    slots.push_back(static_cast<int64_t>(*def.getSlot()));
  }
  auto self = mlir::cast<TensorDefOpInterface>(op.getOperation());
  REQUIRE(self.getSlot());
  slots.push_back(static_cast<int64_t>(*self.getSlot()));
  return slots;
}

/// An op's propagated task count.
int64_t tasksOf(TaskOpInterface op) {
  REQUIRE(op.getTasks());
  return static_cast<int64_t>(*op.getTasks());
}

} // namespace

TEST_CASE("task counts follow the seed's task_num formulas", "[split-counts]") {
  for (const char *configPath :
       {"examples/configs/seed-test.json", "examples/configs/seed-defaults.json"}) {
    ModelConfig config = loadExample(configPath);
    moec::setDefaultCoreCounts(&config, 24, 48); // the ascend-910b profile's
    TaskSplitValue tsv = moec::deriveTaskSplitValue(config);
    for (const char *graphPath : kGraphs) {
      INFO("graph " << graphPath << " with " << configPath);
      PipelineRun run(graphPath, configPath);
      std::set<std::string> types;
      for (TaskOpInterface op : run.ops()) {
        std::string type = op.getSeedOpType().str();
        INFO("op " << op.getOpName().str() << " (" << type << ")");
        types.insert(type);
        int64_t sv = static_cast<int64_t>(op.getSplitValue());
        CHECK(sv == seedSplitValue(type));
        REQUIRE(op.getTasks());
        CHECK(static_cast<int64_t>(*op.getTasks()) ==
              seedTaskNum(type, sv, tsv, config.numCubeCores));
      }
      CHECK(types.count("ALLTOALL"));
      CHECK(types.count("GMM"));
      CHECK(types.size() == 3);
    }
  }
}

TEST_CASE("task counts of the seed configs, literally", "[split-counts]") {
  struct Expected {
    const char *config;
    int64_t allToAll, gmm, swiglu;
  };
  for (Expected e : {Expected{"examples/configs/seed-test.json", 64, 192, 64},
                     Expected{"examples/configs/seed-defaults.json", 512, 192, 512}}) {
    INFO("config " << e.config);
    PipelineRun bwd("graphs/seed/moe_ffn_bwd.json", e.config);
    CHECK(tasksOf(bwd.op("dispatch")) == e.allToAll);
    CHECK(tasksOf(bwd.op("combine")) == e.allToAll);
    for (const char *gmm : {"act_grad", "w1_grad", "gate_grad", "w2_grad"})
      CHECK(tasksOf(bwd.op(gmm)) == e.gmm);
    CHECK(tasksOf(bwd.op("swiglu_grad")) == e.swiglu);

    PipelineRun fwd("graphs/seed/moe_ffn_fwd.json", e.config);
    CHECK(tasksOf(fwd.op("dispatch")) == e.allToAll);
    CHECK(tasksOf(fwd.op("combine")) == e.allToAll);
    CHECK(tasksOf(fwd.op("up_proj")) == e.gmm);
    CHECK(tasksOf(fwd.op("down_proj")) == e.gmm);
    CHECK(tasksOf(fwd.op("swiglu")) == e.swiglu);
  }
}

TEST_CASE("backward graph slots and edges match the seed", "[split-counts]") {
  for (const char *configPath :
       {"examples/configs/seed-test.json", "examples/configs/seed-defaults.json"}) {
    INFO("config " << configPath);
    PipelineRun run("graphs/seed/moe_ffn_bwd.json", configPath);
    // Seed: OperatorNode param_positions (inputs | output) and tiling_position.
    const std::map<std::string, std::pair<std::vector<int64_t>, int64_t>> seed = {
        {"dispatch", {{1, 2, 3, 4, 0}, -1}},   {"act_grad", {{0, 7, 19, 8}, 20}},
        {"w1_grad", {{5, 0, 19, 6}, 23}},      {"swiglu_grad", {{8, 9, 10}, 24}},
        {"gate_grad", {{10, 11, 19, 12}, 21}}, {"combine", {{14, 12, 15, 16, 13}, -1}},
        {"w2_grad", {{17, 10, 19, 18}, 22}},
    };
    std::vector<std::string> names;
    for (TaskOpInterface op : run.ops()) {
      std::string name = op.getOpName().str();
      INFO("op " << name);
      names.push_back(name);
      auto it = seed.find(name);
      REQUIRE(it != seed.end());
      CHECK(paramPositions(op) == it->second.first);
      REQUIRE(op.getTilingSlotValue());
      CHECK(*op.getTilingSlotValue() == it->second.second);
    }
    // Seed: the add_op order.
    CHECK(names == std::vector<std::string>{"dispatch", "act_grad", "w1_grad", "swiglu_grad",
                                            "gate_grad", "combine", "w2_grad"});

    // Seed: the add_edge list, in order.
    const std::vector<std::pair<std::string, std::string>> seedEdges = {
        {"dispatch", "act_grad"},   {"dispatch", "w1_grad"}, {"act_grad", "swiglu_grad"},
        {"swiglu_grad", "gate_grad"}, {"gate_grad", "combine"}, {"gate_grad", "w2_grad"},
    };
    mlir::ArrayAttr edges = run.graph.getEdgesAttr();
    REQUIRE(edges);
    std::vector<std::pair<std::string, std::string>> got;
    for (mlir::Attribute e : edges) {
      auto pair = e.cast<mlir::ArrayAttr>();
      REQUIRE(pair.size() == 2);
      got.emplace_back(pair[0].cast<mlir::StringAttr>().str(),
                       pair[1].cast<mlir::StringAttr>().str());
    }
    CHECK(got == seedEdges);
  }
}

TEST_CASE("an ordering edge without data waits for every producer tile", "[split-counts]") {
  // Seed: add_edge(gate_grad, w2_grad); w2_grad reads swiglu_out, not gate_grad's output.
  PipelineRun run("graphs/seed/moe_ffn_bwd.json", "examples/configs/seed-test.json");
  TaskOpInterface w2 = run.op("w2_grad");
  int64_t gateTiles = tasksOf(run.op("gate_grad"));
  int64_t tiles = tasksOf(w2);
  bool found = false;
  for (mlir::Attribute a : w2.getDepsAttr()) {
    auto map = a.cast<TileMapAttr>();
    if (map.getProducer().getValue() != "gate_grad")
      continue;
    found = true;
    CHECK(map.getOperand() == -1);
    REQUIRE(static_cast<int64_t>(map.getFirst().size()) == tiles);
    REQUIRE(static_cast<int64_t>(map.getLast().size()) == tiles);
    for (int64_t j = 0; j < tiles; ++j) {
      CHECK(map.getFirst()[j] == 0);
      CHECK(map.getLast()[j] == gateTiles - 1);
    }
  }
  CHECK(found);
}

/// The tile map of `op` on the edge from `producer`.
TileMapAttr mapFrom(TaskOpInterface op, const std::string &producer) {
  for (mlir::Attribute a : op.getDepsAttr()) {
    auto map = a.cast<TileMapAttr>();
    if (map.getProducer().getValue() == producer)
      return map;
  }
  FAIL("no map from " << producer);
  return {};
}

TEST_CASE("tiny forward graph: tiles follow expert segments", "[split-counts]") {
  // tiny: L = 2 local experts, R = 2 ranks, per_expert_seq 256, 2 cube cores.
  PipelineRun run("graphs/seed/moe_ffn_fwd.json", "examples/configs/tiny.json", "cpu");
  TaskOpInterface dispatch = run.op("dispatch"), upProj = run.op("up_proj"),
                  swiglu = run.op("swiglu"), downProj = run.op("down_proj"),
                  combine = run.op("combine");
  auto grid = [](TaskOpInterface op) { return op.getGridAttr().asArrayRef().vec(); };
  // [experts, peers, row tiles, column tiles, rows, columns]
  CHECK(grid(dispatch) == std::vector<int64_t>{2, 2, 1, 1, 128, 64});
  CHECK(grid(upProj) == std::vector<int64_t>{2, 1, 1, 2, 256, 64});
  CHECK(grid(swiglu) == std::vector<int64_t>{2, 1, 2, 1, 256, 32});
  CHECK(grid(downProj) == std::vector<int64_t>{2, 1, 1, 2, 256, 64});
  CHECK(grid(combine) == std::vector<int64_t>{2, 2, 1, 1, 128, 64});

  // up_proj tiles of expert e need the dispatch tiles of expert e, from every
  // peer: tiles [2e, 2e+1] (grid order: expert, then peer).
  TileMapAttr map = mapFrom(upProj, "dispatch");
  CHECK(map.getOperand() == 0);
  CHECK(map.getFirst().vec() == std::vector<int64_t>{0, 0, 2, 2});
  CHECK(map.getLast().vec() == std::vector<int64_t>{1, 1, 3, 3});
  // A swiglu row tile reads whole rows: both column tiles of its expert's
  // one up_proj row tile.
  map = mapFrom(swiglu, "up_proj");
  CHECK(map.getFirst().vec() == std::vector<int64_t>{0, 0, 2, 2});
  CHECK(map.getLast().vec() == std::vector<int64_t>{1, 1, 3, 3});
  // down_proj's one row tile per expert covers both swiglu row tiles.
  map = mapFrom(downProj, "swiglu");
  CHECK(map.getFirst().vec() == std::vector<int64_t>{0, 0, 2, 2});
  CHECK(map.getLast().vec() == std::vector<int64_t>{1, 1, 3, 3});
  // A combine put reads rows of its expert that routing scatters: all of
  // the expert's down_proj tiles.
  map = mapFrom(combine, "down_proj");
  CHECK(map.getFirst().vec() == std::vector<int64_t>{0, 0, 2, 2});
  CHECK(map.getLast().vec() == std::vector<int64_t>{1, 1, 3, 3});
}
