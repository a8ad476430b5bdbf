//===- QuantizeDispatch.cpp - FP8 rows on the wire of a dispatch -----------===//
//
// With the config's "dispatch_dtype": "fp8_e4m3" (the graph's binding
// fp8_dispatch = 1), every dispatch marked `quantizable` becomes
//
//   src --quantize--> src_fp8 --dispatch--> target_fp8 --dequantize--> target
//
// so that a rank puts e4m3 codes and their fp32 block scales (about half the
// bytes of bf16 rows) and the experts read the dequantized rows in the
// compute dtype, under the dispatch result's old name and slot. Quantize
// tiles are row tiles of the rows to send (the dispatch's split value each);
// dequantize tiles are row tiles of each local expert's segment, as the
// dispatch's consumers read them. Combines, and dispatches not marked (the
// backward's dispatch of dy), keep the compute dtype.
//
//===----------------------------------------------------------------------===//

#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"

#include "base/DType.h"

namespace moec::moe {
#define GEN_PASS_DEF_QUANTIZEDISPATCH
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec::moe;

namespace {

struct QuantizeDispatchPass : moec::moe::impl::QuantizeDispatchBase<QuantizeDispatchPass> {
  void runOnOperation() override {
    for (GraphOp graph : getOperation().getOps<GraphOp>()) {
      DictionaryAttr bound = graph.getBindingsAttr();
      if (!bound) {
        graph.emitError() << "graph '" << graph.getSymName()
                          << "' has unresolved shapes: run moe-resolve-shapes first";
        return signalPassFailure();
      }
      auto fp8 = bound.getAs<IntegerAttr>("fp8_dispatch");
      if (!fp8 || fp8.getInt() == 0)
        continue;
      SmallVector<DispatchOp> dispatches;
      for (DispatchOp op : graph.getBlock().getOps<DispatchOp>())
        if (op.getQuantizable())
          dispatches.push_back(op);
      for (DispatchOp op : dispatches)
        if (failed(rewrite(graph, op)))
          return signalPassFailure();
    }
  }

  /// The type of quantized rows of `rows` [M, H]: [M, H + 4 * ceil(H / 128)]
  /// of f8E4M3FN (runtime/cpu/Fp8.h).
  static FailureOr<MoeTensorType> quantizedType(Operation *at, Value rows) {
    auto type = rows.getType().cast<MoeTensorType>();
    std::optional<int64_t> h = type.getRank() == 2 ? type.getDimValue(1) : std::nullopt;
    if (!type.isResolved() || !h)
      return at->emitError() << "tensor '" << tensorName(rows)
                             << "' has unresolved dims: run moe-resolve-shapes first";
    Builder b(at->getContext());
    return type.withDims(b.getArrayAttr({type.getDims()[0], b.getI64IntegerAttr(moec::fp8RowBytes(*h))}),
                         b.getFloat8E4M3FNType());
  }

  LogicalResult rewrite(GraphOp graph, DispatchOp op) {
    MLIRContext *ctx = op.getContext();
    Builder b(ctx);
    Value src = op.getSrc(), target = op.getResult();
    FailureOr<MoeTensorType> srcType = quantizedType(op, src);
    FailureOr<MoeTensorType> targetType = quantizedType(op, target);
    if (failed(srcType) || failed(targetType))
      return failure();
    const std::string name = op.getOpName().str();
    const std::string targetName = op.getResultName().str();
    auto rowTiles = [&](StringRef taskNum) {
      SmallVector<int64_t> pairs;
      if (!taskNum.empty())
        pairs = {0, 0};
      return SplitAttr::get(ctx, pairs, {0}, taskNum.empty() ? StringAttr() : b.getStringAttr(taskNum));
    };
    OpBuilder ob(op);
    // The rows to send are a graph input: the quantize is a source op whose
    // tiles cut its own rows.
    // With an automatic split, the quantize cuts its rows in tiles of 128
    // and the dequantize's split is automatic too.
    const bool automatic = op.getAutoSplit();
    IntegerAttr split = automatic ? b.getI64IntegerAttr(128) : op.getSplitValueAttr();
    UnitAttr autoSplit = automatic ? b.getUnitAttr() : UnitAttr();
    auto quantize = ob.create<QuantizeOp>(
        op.getLoc(), *srcType, src, b.getStringAttr(name + "_quantize"),
        b.getStringAttr(tensorName(src) + "_fp8"), IntegerAttr(), split, UnitAttr(),
        rowTiles(""), IntegerAttr(), DictionaryAttr(), IntegerAttr(), DenseI64ArrayAttr(),
        ArrayAttr());
    op.getSrcMutable().assign(quantize.getResult());
    ob.setInsertionPointAfter(op);
    // The dequantized rows take the dispatch result's name and slot: what
    // read them, and the runtime's roles, stay as they were.
    auto dequantize = ob.create<DequantizeOp>(
        op.getLoc(), target.getType(), target, b.getStringAttr(name + "_dequantize"),
        b.getStringAttr(targetName), op.getSlotAttr(), op.getSplitValueAttr(), autoSplit,
        rowTiles(automatic ? "" : "(per_expert_seq / split_value) * single_rank_expert_num"),
        IntegerAttr(),
        DictionaryAttr(), IntegerAttr(), DenseI64ArrayAttr(), ArrayAttr());
    target.replaceAllUsesExcept(dequantize.getResult(), dequantize);
    target.setType(*targetType);
    op.setResultNameAttr(b.getStringAttr(targetName + "_fp8"));
    op.removeSlotAttr();
    // Ordering edges out of the dispatch now start at its dequantize: what
    // ran after the dispatch runs after the rows it reads are dequantized
    // (and, as before, only on its own experts' rows where a data edge says
    // so).
    renameInEdges(graph, name, name + "_dequantize", EdgeEnds::Sources);
    return success();
  }
};

} // namespace
