//===- GraphTestSupport.h - Running the graph pipeline in tests -*- C++ -*-===//
//
// What the graph-level tests share: running the graph pipeline on a shipped
// graph and config, and the seed's split values and task_num formulas.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TESTS_UNIT_SUPPORT_GRAPHTESTSUPPORT_H
#define MOEC_TESTS_UNIT_SUPPORT_GRAPHTESTSUPPORT_H

#include "compiler/config/Config.h"
#include "compiler/import/GraphJson.h"
#include "compiler/ir/MoeDialect.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"

#include <catch2/catch.hpp>

#include <sstream>
#include <string>
#include <vector>

namespace moec::test {

using moec::ModelConfig;
using moec::TaskSplitValue;
using moec::moe::GraphOp;
using moec::moe::TaskOpInterface;

/// The layer's graphs in the seed's form: hand-set split values and task_num
/// formulas, which the seed-count tests check against the seed.
inline const char *const kGraphs[] = {"graphs/seed/moe_ffn_fwd.json",
                                      "graphs/seed/moe_ffn_bwd.json"};

/// A context with the graph pipeline's result for one graph and config.
class PipelineRun {
public:
  PipelineRun(const std::string &graphPath, const std::string &configPath,
              const std::string &target = "ascend-910b")
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
    moec::moe::buildGraphPipeline(pm, configPath, target);
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

inline ModelConfig loadExample(const std::string &path) {
  ModelConfig config;
  std::string error;
  bool ok = moec::loadConfig(path, &config, &error);
  INFO("error: " << error);
  REQUIRE(ok);
  return config;
}

/// The seed's split value of an op type (its build_*_graph defaults).
inline int64_t seedSplitValue(const std::string &type) {
  return type == "GMM" ? 4096 : 128;
}

/// The seed's task_num_fn for an op type, with split value `sv`.
inline int64_t seedTaskNum(const std::string &type, int64_t sv, const TaskSplitValue &tsv,
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

} // namespace moec::test

#endif // MOEC_TESTS_UNIT_SUPPORT_GRAPHTESTSUPPORT_H
