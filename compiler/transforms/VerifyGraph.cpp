//===- VerifyGraph.cpp - data-flow checks of a moe.graph -------------------===//

#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"

namespace moec::moe {
#define GEN_PASS_DEF_VERIFYGRAPH
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec::moe;

namespace {

struct VerifyGraphPass : moec::moe::impl::VerifyGraphBase<VerifyGraphPass> {
  /// With the config's tp > 1 (a graph whose shapes are resolved), every
  /// combine of a layer returns partial sums over the TP ranks and must say
  /// so; a graph of dispatches and combines alone has no expert weights for
  /// tp to split.
  static LogicalResult checkTensorParallel(GraphOp graph) {
    DictionaryAttr bound = graph.getBindingsAttr();
    auto tp = bound ? bound.getAs<IntegerAttr>("tp") : IntegerAttr();
    if (!tp || tp.getInt() <= 1)
      return success();
    const bool layer = !graph.getBlock().getOps<GmmOp>().empty();
    for (CombineOp op : graph.getBlock().getOps<CombineOp>()) {
      if (!layer)
        return op.emitError() << "graph '" << graph.getSymName() << "': the config's tp is "
                              << tp.getInt()
                              << ", but the graph has no expert weights for tp to split (only "
                                 "dispatches and combines); use a config with tp 1";
      if (!op.getReduceTp())
        return op.emitError()
               << "'" << op.getOpName() << "': the config's tp is " << tp.getInt()
               << ", so the rows it returns are partial sums over " << tp.getInt()
               << " tensor-parallel ranks, but it is not marked reduce_tp (mark it, and give "
                  "the expert weights intermediate_size / tp columns)";
    }
    if (!layer)
      for (DispatchOp op : graph.getBlock().getOps<DispatchOp>())
        return op.emitError() << "graph '" << graph.getSymName() << "': the config's tp is "
                              << tp.getInt()
                              << ", but the graph has no expert weights for tp to split (only "
                                 "dispatches and combines); use a config with tp 1";
    return success();
  }

  void runOnOperation() override {
    bool failedAny = false;
    for (GraphOp graph : getOperation().getOps<GraphOp>()) {
      SmallVector<TaskOpInterface> order;
      if (failed(topologicalOrder(graph, order))) {
        failedAny = true;
        continue;
      }
      if (failed(checkTensorParallel(graph)))
        failedAny = true;
      for (InputOp input : graph.getBlock().getOps<InputOp>())
        if (input.getResult().use_empty())
          input.emitWarning() << "graph input '" << input.getResultName()
                              << "' is never read";
      for (TaskOpInterface op : order) {
        SplitAttr split = op.getSplit();
        for (unsigned i = 0; i < split.getNumSplitInputs(); ++i) {
          Value operand = op->getOperand(split.getSplitOperand(i));
          if (producerOf(operand))
            continue;
          op->emitError() << "'" << op.getOpName() << "' splits operand "
                          << split.getSplitOperand(i) << " ('" << tensorName(operand)
                          << "'), which is a graph input: there are no producer tiles to "
                             "follow (the seed silently used a task count of 1 here); "
                             "split a tensor an op produces, or make the op a source "
                             "(no split inputs)";
          failedAny = true;
        }
      }
    }
    if (failedAny)
      signalPassFailure();
  }
};

} // namespace
