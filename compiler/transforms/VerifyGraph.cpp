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
  void runOnOperation() override {
    bool failedAny = false;
    for (GraphOp graph : getOperation().getOps<GraphOp>()) {
      SmallVector<TaskOpInterface> order;
      if (failed(topologicalOrder(graph, order))) {
        failedAny = true;
        continue;
      }
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
