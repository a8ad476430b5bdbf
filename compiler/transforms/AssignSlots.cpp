//===- AssignSlots.cpp - fill in missing parameter and tiling slots --------===//

#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"

#include "llvm/ADT/DenseSet.h"

namespace moec::moe {
#define GEN_PASS_DEF_ASSIGNSLOTS
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec::moe;

namespace {

/// Hands out the smallest indices not already taken.
class SlotAllocator {
public:
  void take(int64_t slot) { taken.insert(slot); }
  int64_t next() {
    while (taken.contains(cursor))
      ++cursor;
    taken.insert(cursor);
    return cursor;
  }

private:
  llvm::DenseSet<int64_t> taken;
  int64_t cursor = 0;
};

struct AssignSlotsPass : moec::moe::impl::AssignSlotsBase<AssignSlotsPass> {
  void runOnOperation() override {
    for (GraphOp graph : getOperation().getOps<GraphOp>()) {
      SlotAllocator slots, tilings;
      for (Operation &op : graph.getBlock()) {
        if (auto def = dyn_cast<TensorDefOpInterface>(&op); def && def.getSlot())
          slots.take(*def.getSlot());
        if (auto task = dyn_cast<TaskOpInterface>(&op))
          if (auto t = task.getTilingSlotValue(); t && *t >= 0)
            tilings.take(*t);
      }
      for (Operation &op : graph.getBlock()) {
        if (auto def = dyn_cast<TensorDefOpInterface>(&op); def && !def.getSlot()) {
          def.setSlotValue(slots.next());
          ++numSlots;
        }
        auto task = dyn_cast<TaskOpInterface>(&op);
        if (!task || task.getTilingSlotValue())
          continue;
        if (task.needsTiling()) {
          task.setTilingSlotValue(tilings.next());
          ++numTilingSlots;
        } else {
          task.setTilingSlotValue(-1);
        }
      }
    }
  }
};

} // namespace
