//===- FuseLowRank.cpp - a LoRA adapter's second gmm inside its base's ----===//
//
// A LoRA adapter adds its rank-r product onto its base projection's output:
//
//   y_base = gmm(x, w)        y = gmm(u, b, addend = y_base)
//
// (forward; the backward's dX = dX_base + V A^T alike). Where the base's
// output has no other reader, the two become one gmm with a low-rank
// product, y = gmm(x, w; low_lhs = u, low_rhs = b): the tile sums the
// adapter's r units after the base's and stores its output once, instead of
// a second gmm reading and writing the whole output again. The fused gmm
// keeps the base's name, split and tiling slot, and takes the adapter gmm's
// result name and slot, so the tensors its readers see keep their names.
//
//===----------------------------------------------------------------------===//

#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"

namespace moec::moe {
#define GEN_PASS_DEF_FUSELOWRANK
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec::moe;

namespace {

bool quantizedRhs(GmmOp gmm) {
  return isQuantizedWeightType(gmm.getRhs().getType().cast<MoeTensorType>().getElementType());
}

/// The base gmm whose output `add` adds its product onto, when the two can
/// be one gmm; else null.
GmmOp fusableBase(GmmOp add) {
  if (add.isWeightGradient() || add.hasLowRank() || quantizedRhs(add) || !add.getAddend() ||
      add.getScaleAttr() || add.getTransposeLhs())
    return GmmOp();
  Value addend = add.getAddend();
  auto base = addend.getDefiningOp<GmmOp>();
  if (!base || base.isWeightGradient() || base.hasLowRank() || base.getScaleAttr() ||
      (base.getAddend() && !quantizedRhs(base)) || !addend.hasOneUse() ||
      base.getGroupList() != add.getGroupList() || base.getType() != add.getType() ||
      base.getLhs().getType().cast<MoeTensorType>().getElementType() !=
          add.getLhs().getType().cast<MoeTensorType>().getElementType())
    return GmmOp();
  return base;
}

struct FuseLowRankPass : moec::moe::impl::FuseLowRankBase<FuseLowRankPass> {
  void runOnOperation() override {
    for (GraphOp graph : getOperation().getOps<GraphOp>()) {
      SmallVector<GmmOp> adds;
      for (GmmOp gmm : graph.getBlock().getOps<GmmOp>())
        if (fusableBase(gmm))
          adds.push_back(gmm);
      for (GmmOp add : adds)
        fuse(graph, add, fusableBase(add));
    }
  }

  void fuse(GraphOp graph, GmmOp add, GmmOp base) {
    Builder b(add.getContext());
    // After the adapter's gmm: U is written after the base gmm.
    OpBuilder ob(add);
    SmallVector<Value> operands = {base.getLhs(), base.getRhs(), base.getGroupList()};
    if (Value scales = base.getAddend())
      operands.push_back(scales);
    operands.append({add.getLhs(), add.getRhs()});
    OperationState state(base.getLoc(), base->getName());
    state.addOperands(operands);
    state.addTypes(add.getType());
    state.addAttributes(base->getAttrs());
    Operation *fused = ob.create(state);
    fused->setAttr("result_name", add.getResultNameAttr());
    if (IntegerAttr slot = add.getSlotAttr())
      fused->setAttr("slot", slot);
    else
      fused->removeAttr("slot");
    if (add.getTransposeRhs())
      fused->setAttr("transpose_low_rhs", b.getUnitAttr());
    const std::string baseName = base.getOpName().str(), addName = add.getOpName().str();
    add.getResult().replaceAllUsesWith(fused->getResult(0));
    add.erase();
    base.erase();
    renameInEdges(graph, addName, baseName, EdgeEnds::Both);
    ++numFused;
  }
};

} // namespace
