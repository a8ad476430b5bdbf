//===- Layer.h - What the slots and ops of a layer binary are ---*- C++ -*-===//
//
// A task binary names its tensors by slot and its ops by kind; the runtime
// needs to know which slot is the layer's x, which the expert weights, which
// the routing layout tensors it fills, which tensors backward takes from
// forward. analyzeLayer() finds these roles from the dataflow of the ops (the
// forward and backward graphs of DESIGN §2), checks every shape and tiling
// the kernels will rely on, and returns a LayerPlan. A binary that is not a
// MoE-FFN layer, or whose tilings do not fit its tensors, is refused here,
// once, so the task functions can run without checks.
//
// The layout tensors (filled by the runtime from the routing of all ranks,
// before a pass; all indexed by i = q * L + e for peer rank q and local
// expert e of the expert's rank):
//
//   dispatch, on source rank r, for global expert g = q * L + e:
//     size_d[g]          rows r sends to expert g
//     src_offset[g]      first of them in r's src rows (expert-major order)
//     target_offset[g]   where they land in rank q's expert-major buffer
//   combine, on expert rank r, for rows of local expert e from rank q:
//     size_c[q*L+e]        their count (= rank q's size_d[r*L+e])
//     src_offset_c[q*L+e]  where they are in r's buffer (q's target_offset)
//     target_offset_c[q*L+e] where they go in q's returned rows (q's src_offset)
//   glist[e]             end row of local expert e's segment (cumulative)
//
// An expert's segment holds its rows ordered by source rank, then token,
// then top-k position (the reference's dispatch order).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_LAYER_LAYER_H
#define MOEC_RUNTIME_LAYER_LAYER_H

#include "format/LayerShape.h"
#include "base/Status.h"
#include "format/TaskBinary.h"

#include <array>
#include <vector>

namespace moec::rt {

/// No slot.
inline constexpr uint32_t kNoSlot = format::kNone;

/// What a binary computes: a pass of the whole layer, or the communication
/// half alone (a graph that holds only a dispatch, or only a combine).
enum class PlanKind : uint8_t { Layer, Dispatch, Combine };

/// The slots of a LoRA adapter on one projection (W: w1 [L, H, 2I] or w2
/// [L, I, H], so [L, K, N]): Y = X W + (X A) B with A [L, K, r] and B
/// [L, r, N], the scale applied to the rank-r product U = s X A.
struct LoraSlots {
  uint32_t a = kNoSlot, b = kNoSlot;   ///< A, B (both passes)
  uint32_t u = kNoSlot;                ///< U [T, r]: forward's output, backward's input
  uint32_t da = kNoSlot, db = kNoSlot; ///< backward: the adapter gradients
};

/// The role of every slot and op of a forward or backward layer binary, or
/// of a dispatch or combine binary.
struct LayerPlan {
  LayerShape shape;
  /// The binary's layer record, which the shape was checked against.
  format::LayerRecord record;
  PlanKind kind = PlanKind::Layer;

  uint32_t dispatchOp = 0, combineOp = 0;
  /// FP8 dispatch (shape.fp8Dispatch): the quantize of the rows to send,
  /// and the dequantize of the received rows; else kNoSlot.
  uint32_t quantizeOp = kNoSlot, dequantizeOp = kNoSlot;

  // Slots the runtime fills before the task program runs.
  uint32_t src = kNoSlot; ///< rows to send [S*K, H], gathered from x (or w*dy)
  /// FP8 dispatch: the quantized rows to send [S*K, W] and the quantized
  /// rows received [T, W], W = H + 4 * ceil(H / 128) bytes (runtime/cpu/Fp8.h).
  uint32_t srcFp8 = kNoSlot, receivedFp8 = kNoSlot;
  uint32_t dTargetOffset = kNoSlot, dSrcOffset = kNoSlot, dSize = kNoSlot;
  uint32_t cTargetOffset = kNoSlot, cSrcOffset = kNoSlot, cSize = kNoSlot;
  uint32_t glist = kNoSlot;

  // The returned rows [S*K, H] (the combine's output), which the runtime
  // reduces into y (or dx).
  uint32_t returned = kNoSlot;
  // The rows the combine returns [T, H]: a slot of the workspace in a layer
  // pass; the caller's expert_y in a combine binary.
  uint32_t toReturn = kNoSlot;

  // Slots bound to the caller's tensors.
  uint32_t w1 = kNoSlot, w2 = kNoSlot;   ///< [L, H, 2I], [L, I, H]
  /// The scales of quantized base weights (LayerShape::weightFormat).
  uint32_t w1Scale = kNoSlot, w2Scale = kNoSlot;
  uint32_t dw1 = kNoSlot, dw2 = kNoSlot; ///< backward

  // Forward: the activations backward needs. Backward: the slots that take
  // them (the same tensors).
  uint32_t dispatched = kNoSlot; ///< X [T, H]
  uint32_t upOut = kNoSlot;      ///< Y [T, 2I]
  uint32_t swigluOut = kNoSlot;  ///< A [T, I]

  /// LoRA adapters: [0] on w1, [1] on w2 (shape.loraTargets says which).
  std::array<LoraSlots, 2> lora;

  /// Per op: its input slots, in operand order.
  std::vector<std::array<uint32_t, format::kMaxTilingInputs>> inputs;

  /// The slots that get no workspace of their own: the caller's tensors
  /// (weights, adapters, gradients; a combine binary's expert rows) and, in
  /// backward, the forward pass's saved activations.
  std::vector<uint32_t> boundSlots() const;

  /// The routing layout tensors (those set; the runtime fills them).
  std::vector<uint32_t> layoutSlots() const;

  /// Of a forward plan: the slots whose contents the backward pass reads
  /// after the forward pass is over (X, Y, A, the adapters' U, the returned
  /// rows for dtopk_weights). The pass's other workspace slots are dead
  /// once it ends.
  std::vector<uint32_t> readByBackward() const;
};

/// Finds the roles of `program`'s slots, checks its shapes and tilings, and
/// checks what they say of the layer against the program's layer record
/// (which it must have), taking the capacity factor from it.
/// A program of one dispatch op, or of one combine op, is the communication
/// half of the layer alone (PlanKind::Dispatch, PlanKind::Combine): H, R, L,
/// S and the capacities are set; I is 0.
/// Errors say what does not fit, e.g. "op 'up_proj' (gmm): tiling lda is 32,
/// but its input 'target' has rows of 64".
Status analyzeLayer(const format::TaskProgram &program, LayerPlan *out);

/// Checks what a plan's shape says of the layer against `program`'s layer
/// record (which it must have: "the binary's layer record says hidden size
/// 128, but its ops have 64"), and takes from the record what the ops
/// cannot say (the capacity factor; LayerPlan::record). analyzeLayer ends
/// with it.
Status checkLayerRecord(const format::TaskProgram &program, LayerPlan &plan);

/// Checks that a backward plan can take the tensors a forward plan saves:
/// same ranks, experts, sizes, dtypes and capacities.
Status checkPassesMatch(const LayerPlan &forward, const LayerPlan &backward);

/// Checks that a dispatch plan and a combine plan are the two halves of one
/// exchange: same ranks, experts, hidden size, dtype and capacities.
Status checkExchangeMatch(const LayerPlan &dispatch, const LayerPlan &combine);

} // namespace moec::rt

#endif // MOEC_RUNTIME_LAYER_LAYER_H
