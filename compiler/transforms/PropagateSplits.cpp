//===- PropagateSplits.cpp - task counts and tile-range dependency maps ----===//

#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"

#include "llvm/ADT/DenseMap.h"

namespace moec::moe {
#define GEN_PASS_DEF_PROPAGATESPLITS
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec;
using namespace moec::moe;

namespace {

/// How an op's tiles cut one dim of one tensor: tile j covers rows
/// [j*extent/tiles, (j+1)*extent/tiles).
struct Tiling {
  int64_t tiles = 1;
  int64_t extent = 1;
  int64_t begin(int64_t j) const { return j * extent / tiles; }
  /// The tile holding row r.
  int64_t tileOf(int64_t r) const { return ((r + 1) * tiles - 1) / extent; }
};

int64_t extentOf(Value v, int64_t dim) {
  return *v.getType().cast<MoeTensorType>().getDimValue(dim);
}

struct PropagateSplitsPass : moec::moe::impl::PropagateSplitsBase<PropagateSplitsPass> {
  void runOnOperation() override {
    for (GraphOp graph : getOperation().getOps<GraphOp>())
      if (failed(propagate(graph)))
        return signalPassFailure();
  }

  LogicalResult propagate(GraphOp graph) {
    DictionaryAttr bound = graph.getBindingsAttr();
    if (!bound)
      return graph.emitError() << "graph '" << graph.getSymName()
                               << "' has unresolved shapes: run moe-resolve-shapes first";
    Bindings bindings;
    for (NamedAttribute a : bound)
      bindings[a.getName().str()] = a.getValue().cast<IntegerAttr>().getInt();

    for (Operation &op : graph.getBlock()) {
      auto def = cast<TensorDefOpInterface>(&op);
      if (!def.getTensor().getType().isResolved())
        return op.emitError() << "tensor '" << def.getResultName()
                              << "' has unresolved dims or dtype: run moe-resolve-shapes first";
    }
    SmallVector<TaskOpInterface> order;
    if (failed(topologicalOrder(graph, order)))
      return failure();

    // The tiling of each op's result along its first output split dim.
    llvm::DenseMap<Operation *, Tiling> resultTiling;
    Builder b(graph.getContext());
    for (TaskOpInterface op : order) {
      std::optional<int64_t> tasks = taskCount(op, bindings);
      if (!tasks)
        return failure();
      op.setTasksValue(*tasks);
      numTasks += *tasks;
      SplitAttr split = op.getSplit();
      int64_t outDim = split.getOutputDims().front();
      resultTiling[op] = Tiling{*tasks, extentOf(op->getResult(0), outDim)};

      SmallVector<Attribute> maps;
      for (OpOperand &use : op->getOpOperands()) {
        TaskOpInterface producer = producerOf(use.get());
        if (!producer)
          continue;
        const Tiling &prod = resultTiling[producer];
        int64_t prodDim = producer.getSplit().getOutputDims().front();
        std::optional<int64_t> consumerDim;
        for (unsigned i = 0; i < split.getNumSplitInputs(); ++i)
          if (split.getSplitOperand(i) == use.getOperandNumber())
            consumerDim = split.getSplitDim(i);
        SmallVector<int64_t> first, last;
        if (consumerDim && *consumerDim == prodDim) {
          // Same rows cut two ways: consumer tile j needs the overlapping producer tiles.
          Tiling cons{*tasks, extentOf(use.get(), *consumerDim)};
          for (int64_t j = 0; j < *tasks; ++j) {
            int64_t lo = cons.begin(j), hi = cons.begin(j + 1);
            if (hi == lo) { // an empty tile needs nothing
              first.push_back(0);
              last.push_back(-1);
              continue;
            }
            first.push_back(prod.tileOf(lo));
            last.push_back(prod.tileOf(hi - 1));
          }
        } else {
          // Read whole, or along another dim: every producer tile.
          first.assign(*tasks, 0);
          last.assign(*tasks, prod.tiles - 1);
        }
        maps.push_back(TileMapAttr::get(graph.getContext(), use.getOperandNumber(),
                                        b.getStringAttr(producer.getOpName()), first, last));
      }
      for (TaskOpInterface producer : orderingPredecessors(op)) {
        if (llvm::any_of(op->getOperands(), [&](Value v) { return producerOf(v) == producer; }))
          continue; // the data edge's map already orders them
        SmallVector<int64_t> first(*tasks, 0), last(*tasks, resultTiling[producer].tiles - 1);
        maps.push_back(TileMapAttr::get(graph.getContext(), /*operand=*/-1,
                                        b.getStringAttr(producer.getOpName()), first, last));
      }
      op.setDepsValue(b.getArrayAttr(maps));
    }
    return success();
  }

  /// The seed's rule: a task_num expression if given, else extent / split value.
  std::optional<int64_t> taskCount(TaskOpInterface op, const Bindings &graphBindings) {
    int64_t splitValue = op.getSplitValue();
    SplitAttr split = op.getSplit();
    std::string error;
    Value cut;
    int64_t dim;
    if (split.isSource()) {
      cut = op->getResult(0);
      dim = split.getOutputDims().front();
    } else {
      cut = op->getOperand(split.getSplitOperand(0));
      dim = split.getSplitDim(0);
    }
    int64_t extent = extentOf(cut, dim);
    if (StringAttr expr = split.getTaskNum()) {
      Bindings bindings = graphBindings;
      bindings["split_value"] = splitValue;
      std::optional<int64_t> n = Expr::parse(expr.getValue().str(), &error)->evaluate(bindings, &error);
      if (!n) {
        op->emitError() << "'" << op.getOpName() << "': task_num: " << error;
        return std::nullopt;
      }
      if (*n <= 0) {
        op->emitError() << "'" << op.getOpName() << "': task_num '" << expr.getValue()
                        << "' is " << *n << "; it must be positive";
        return std::nullopt;
      }
      if (*n > extent) {
        op->emitError() << "'" << op.getOpName() << "': task_num '" << expr.getValue()
                        << "' gives " << *n << " tasks for the " << extent << " rows of dim "
                        << dim << " of '" << tensorName(cut) << "'; a task needs at least one row";
        return std::nullopt;
      }
      return n;
    }
    if (extent % splitValue != 0) {
      op->emitError() << "'" << op.getOpName() << "': split value " << splitValue
                      << " does not divide dim " << dim << " of '" << tensorName(cut)
                      << "' (" << extent << ")";
      return std::nullopt;
    }
    return extent / splitValue;
  }
};

} // namespace
