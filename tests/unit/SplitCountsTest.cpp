//===- SplitCountsTest.cpp - Task counts and slots against the seed -------===//
//
// Runs the graph pipeline on the shipped forward and backward graphs and
// checks the task counts against the seed's task_num formulas, and the
// backward graph's slots and edges against the seed's backward graph.
//
//===----------------------------------------------------------------------===//

#include "compiler/config/Config.h"
#include "compiler/import/GraphJson.h"
#include "compiler/ir/MoeDialect.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"

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
using moec::moe::TensorDefOpInterface;
using moec::moe::TileMapAttr;

namespace {

/// A context with the graph pipeline's result for one graph and config.
class PipelineRun {
public:
  PipelineRun(const std::string &graphPath, const std::string &configPath)
      : ctx(mlir::MLIRContext::Threading::DISABLED),
        handler(&ctx, [this](mlir::Diagnostic &diag) {
          if (diag.getSeverity() == mlir::DiagnosticSeverity::Error)
            errors << diag.str() << '\n';
          return mlir::success();
        }) {
    ctx.printOpOnDiagnostic(false);
    module = moec::loadGraph(graphPath, &ctx);
    INFO("graph " << graphPath << ": " << errors.str());
    REQUIRE(module);
    mlir::PassManager pm(&ctx);
    moec::moe::buildGraphPipeline(pm, configPath);
    bool ok = mlir::succeeded(pm.run(*module));
    INFO("pipeline with " << configPath << ": " << errors.str());
    REQUIRE(ok);
    auto graphs = module->getOps<GraphOp>();
    REQUIRE(std::distance(graphs.begin(), graphs.end()) == 1);
    graph = *graphs.begin();
  }

  std::vector<TaskOpInterface> ops() {
    std::vector<TaskOpInterface> out;
    for (auto op : graph.getBlock().getOps<TaskOpInterface>())
      out.push_back(op);
    return out;
  }

  TaskOpInterface op(const std::string &name) {
    for (auto op : graph.getBlock().getOps<TaskOpInterface>())
      if (op.getOpName() == name)
        return op;
    FAIL("no op " << name);
    return {};
  }

  mlir::MLIRContext ctx;
  std::ostringstream errors;
  mlir::OwningOpRef<mlir::ModuleOp> module;
  GraphOp graph;

private:
  mlir::ScopedDiagnosticHandler handler;
};

ModelConfig loadExample(const std::string &path) {
  ModelConfig config;
  std::string error;
  bool ok = moec::loadConfig(path, &config, &error);
  INFO("error: " << error);
  REQUIRE(ok);
  return config;
}

/// The seed's split value of an op type (its build_*_graph defaults).
int64_t seedSplitValue(const std::string &type) {
  return type == "GMM" ? 4096 : 128;
}

/// The seed's task_num_fn for an op type, with split value `sv`.
int64_t seedTaskNum(const std::string &type, int64_t sv, const TaskSplitValue &tsv,
                    int64_t numCubeCores) {
  if (type == "ALLTOALL")
    return tsv.allExpertNum * (tsv.perExpertSeqToOther / sv);
  if (type == "GMM")
    return numCubeCores * tsv.singleRankExpertNum;
  if (type == "SWIGLU" || type == "SWIGLU_GRAD")
    return (tsv.perExpertSeq / sv) * tsv.singleRankExpertNum;
  FAIL("unexpected op type " << type);
  return -1;
}

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

const char *const kGraphs[] = {"graphs/moe_ffn_fwd.json", "graphs/moe_ffn_bwd.json"};

} // namespace

TEST_CASE("task counts follow the seed's task_num formulas", "[split-counts]") {
  for (const char *configPath :
       {"examples/configs/seed-test.json", "examples/configs/seed-defaults.json"}) {
    ModelConfig config = loadExample(configPath);
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
    PipelineRun bwd("graphs/moe_ffn_bwd.json", e.config);
    CHECK(tasksOf(bwd.op("dispatch")) == e.allToAll);
    CHECK(tasksOf(bwd.op("combine")) == e.allToAll);
    for (const char *gmm : {"act_grad", "w1_grad", "gate_grad", "w2_grad"})
      CHECK(tasksOf(bwd.op(gmm)) == e.gmm);
    CHECK(tasksOf(bwd.op("swiglu_grad")) == e.swiglu);

    PipelineRun fwd("graphs/moe_ffn_fwd.json", e.config);
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
    PipelineRun run("graphs/moe_ffn_bwd.json", configPath);
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
  PipelineRun run("graphs/moe_ffn_bwd.json", "examples/configs/seed-test.json");
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

TEST_CASE("tiny forward graph: up_proj tile j needs dispatch tile j", "[split-counts]") {
  PipelineRun run("graphs/moe_ffn_fwd.json", "examples/configs/tiny.json");
  TaskOpInterface upProj = run.op("up_proj");
  TaskOpInterface dispatch = run.op("dispatch");
  int64_t tiles = tasksOf(upProj);
  REQUIRE(tiles > 1);
  CHECK(tasksOf(dispatch) == tiles);
  mlir::ArrayAttr deps = upProj.getDepsAttr();
  REQUIRE(deps);
  // The data edge on operand 0 carries the order; the graph's ordering edge
  // dispatch -> up_proj adds no second map.
  REQUIRE(deps.size() == 1);
  auto map = deps[0].cast<TileMapAttr>();
  CHECK(map.getProducer().getValue() == "dispatch");
  CHECK(map.getOperand() == 0);
  REQUIRE(static_cast<int64_t>(map.getFirst().size()) == tiles);
  REQUIRE(static_cast<int64_t>(map.getLast().size()) == tiles);
  for (int64_t j = 0; j < tiles; ++j) {
    INFO("tile " << j);
    CHECK(map.getFirst()[j] == j);
    CHECK(map.getLast()[j] == j);
  }
}
