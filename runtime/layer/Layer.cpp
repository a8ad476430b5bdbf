//===- Layer.cpp - What the slots and ops of a layer binary are -----------===//
//
// See Layer.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/layer/Layer.h"

#include "format/Capacity.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>

namespace moec::rt {

using format::DType;
using format::OpKind;
using format::OpRecord;
using format::SlotRecord;
using format::TaskProgram;
using format::TilingRecord;

namespace {

/// Finds roles and checks shapes for one program; every check names what it
/// looked at.
class Analyzer {
public:
  Analyzer(const TaskProgram &program, LayerPlan &plan) : program(program), plan(plan) {}

  Status run() {
    LayerShape &shape = plan.shape;
    shape.backward = program.isBackward();
    shape.ranks = program.ranks();
    shape.tp = program.tpRanks;
    shape.localExperts = program.localExperts;
    if (shape.localExperts == 0)
      return Status::error("the binary has 0 local experts");
    if (shape.tp > 1 && program.ops.size() == 1)
      return Status::error(fmt::format(
          "a dispatch or combine alone has no expert weights to split over {} TP ranks; its "
          "binary must have 1 TP rank",
          shape.tp));
    // Under TP every combine returns partial sums, and only then may it
    // reduce over TP.
    for (uint32_t op = 0; op < program.ops.size(); ++op) {
      const bool reduces = tiling(op).flags & format::kTilingReduceTp;
      if (program.ops[op].kind != OpKind::Combine || reduces == (shape.tp > 1))
        continue;
      return Status::error(
          reduces ? fmt::format("op '{}' (combine) reduces over TP, but the binary has 1 TP "
                                "rank",
                                opName(op))
                  : fmt::format("op '{}' (combine): the binary runs on {} TP ranks, whose rows "
                                "it returns are partial sums, but it does not reduce over them",
                                opName(op), shape.tp));
    }
    plan.inputs.resize(program.ops.size());
    for (size_t i = 0; i < program.ops.size(); ++i)
      for (uint32_t k = 0; k < format::kMaxTilingInputs; ++k)
        plan.inputs[i][k] = tiling(uint32_t(i)).inputSlots[k];

    if (program.ops.size() == 1 && !program.isBackward() && format::isPut(program.ops[0].kind))
      return exchange();
    if (Status s = findOps(); !s)
      return s;
    if (Status s = checkShapes(); !s)
      return s;
    return checkTilings();
  }

private:
  const TaskProgram &program;
  LayerPlan &plan;

  // The SwiGLU (forward) or SwiGLU-gradient (backward) op; the
  // weight-gradient ops of a backward pass (dw1 and dw2, or the adapters'
  // gradients).
  uint32_t actOp = kNoSlot;
  std::vector<std::array<std::string, 5>> loraRoles; // names for messages
  uint32_t dw2Op = kNoSlot, dw1Op = kNoSlot;
  std::vector<uint32_t> weightGradOps;

  const TilingRecord &tiling(uint32_t op) const { return program.tilings[program.ops[op].tiling]; }
  uint32_t in(uint32_t op, uint32_t k) const { return tiling(op).inputSlots[k]; }
  uint32_t out(uint32_t op) const { return tiling(op).outputSlot; }
  std::string_view opName(uint32_t op) const { return program.name(program.ops[op].name); }
  std::string_view slotName(uint32_t slot) const { return program.name(program.slots[slot].name); }
  bool isWgrad(uint32_t op) const {
    return program.ops[op].kind == OpKind::Gmm && tiling(op).depth == 0;
  }

  std::string describe(uint32_t op) const {
    return fmt::format("op '{}' ({})", opName(op), format::opKindName(program.ops[op].kind));
  }

  /// The ops of `kind` whose input `k` is `slot` (any slot when kNoSlot).
  std::vector<uint32_t> opsReading(OpKind kind, uint32_t k, uint32_t slot) const {
    std::vector<uint32_t> found;
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      if (program.ops[i].kind == kind && tiling(i).inputCount > k &&
          (slot == kNoSlot || in(i, k) == slot))
        found.push_back(i);
    return found;
  }

  Status notLayer(const std::string &why) const {
    return Status::error(fmt::format("not a MoE-FFN {} layer the runtime can run: {}",
                                     program.isBackward() ? "backward" : "forward", why));
  }

  /// Finds the one op of `kind` whose input `k` is `slot`.
  Status findOne(OpKind kind, uint32_t k, uint32_t slot, const char *role, uint32_t *op,
                 bool wgrad = false) {
    std::vector<uint32_t> found;
    for (uint32_t i : opsReading(kind, k, slot))
      if (kind != OpKind::Gmm || isWgrad(i) == wgrad)
        found.push_back(i);
    if (found.size() != 1)
      return notLayer(fmt::format("expected one {} op for the {} reading slot '{}', found {}",
                                  format::opKindName(kind), role, slotName(slot), found.size()));
    *op = found[0];
    return Status::success();
  }

  /// The op that writes `slot`, or kNoSlot for a graph input.
  uint32_t producer(uint32_t slot) const {
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      if (out(i) == slot)
        return i;
    return kNoSlot;
  }

  bool isActivationGmm(uint32_t op) const {
    return op != kNoSlot && program.ops[op].kind == OpKind::Gmm && !isWgrad(op);
  }

  /// A GMM whose weight is stored quantized, its scales input 3.
  bool quantized(uint32_t op) const {
    return tiling(op).flags & format::kTilingQuantizedB;
  }

  /// The format of the quantized weight `op` reads (kTilingQuantizedB),
  /// from the weight's dtype and its scales' dims, into shape.
  Status readWeightFormat(uint32_t op) {
    LayerShape &shape = plan.shape;
    const SlotRecord &w = program.slots[in(op, 1)], &scales = program.slots[in(op, 3)];
    switch (w.dtype) {
    case DType::F8E4M3:
      shape.weightFormat = WeightFormat::Fp8Block128;
      return Status::success();
    case DType::I8:
      shape.weightFormat = WeightFormat::Int8Channel;
      return Status::success();
    case DType::I4: {
      shape.weightFormat = WeightFormat::Int4Group;
      shape.weightZeroPoints = scales.rank == 4;
      const uint64_t groups = scales.rank >= 3 ? scales.dims[2] : 0;
      const uint64_t group = groups ? w.dims[2] / groups : 0;
      if (w.rank != 3 || !(group == 32 || group == 64 || group == 128) ||
          group * groups != w.dims[2])
        return Status::error(fmt::format(
            "{}: slot '{}' holds 4-bit codes of rows of {} values and slot '{}' their scales, "
            "[{}]: the scales must be [L, rows, cols / g] (or [L, rows, cols / g, 2] with "
            "zero points) for groups of g = 32, 64 or 128",
            describe(op), slotName(in(op, 1)), w.dims[2], slotName(in(op, 3)),
            fmt::join(scales.dims, scales.dims + scales.rank, ", ")));
      shape.weightGroup = int64_t(group);
      return Status::success();
    }
    default:
      return Status::error(fmt::format("{}: slot '{}' is {}; a quantized weight is f8e4m3, i8 "
                                       "or i4 codes",
                                       describe(op), slotName(in(op, 1)),
                                       format::dtypeName(w.dtype)));
    }
  }

  /// One projection of the layer (Y = X W, or dX = dY W^T): its base GMM
  /// and, with a LoRA adapter, the GMM of the rank-r product (U = s X A, or
  /// V = s dY B^T) and the GMM that adds the adapter's second product to the
  /// base output (Y = Y_base + U B, or dX = dX_base + V A^T).
  ///
  /// A base GMM with a low-rank product (TilingRecord::lowRankSlots) is the
  /// adapter's second GMM fused into its base: `add` is then `base`.
  struct Projection {
    uint32_t base = kNoSlot, rankIn = kNoSlot, add = kNoSlot;
    bool lora() const { return add != kNoSlot; }
    bool fused() const { return lora() && add == base; }
    uint32_t last() const { return lora() ? add : base; }
  };

  /// The adapter's weight that the projection's second product reads (B
  /// forward, A^T backward).
  uint32_t addWeight(const Projection &p) const {
    return p.fused() ? tiling(p.add).lowRankSlots[1] : in(p.add, 1);
  }

  /// Finds the projection whose last GMM writes `result` and whose input
  /// rows are `lhs`.
  Status projection(uint32_t result, uint32_t lhs, const char *role, Projection *p) const {
    const uint32_t last = producer(result);
    if (!isActivationGmm(last))
      return notLayer(fmt::format("slot '{}' is not written by a gmm (the {})", slotName(result),
                                  role));
    if (tiling(last).lowRank()) { // an adapter fused into its base: Y = X W + U B
      p->base = p->add = last;
      p->rankIn = producer(tiling(last).lowRankSlots[0]);
      if (in(last, 0) != lhs)
        return notLayer(fmt::format("the {} {} reads '{}'; expected '{}'", role, describe(last),
                                    slotName(in(last, 0)), slotName(lhs)));
      if (p->rankIn == kNoSlot || !isActivationGmm(p->rankIn) || in(p->rankIn, 0) != lhs ||
          tiling(p->rankIn).inputCount != 3 || tiling(p->rankIn).lowRank())
        return notLayer(fmt::format("{} adds a low-rank product of '{}', which is not written by "
                                    "the rank-r gmm of the {} reading '{}'",
                                    describe(last), slotName(tiling(last).lowRankSlots[0]), role,
                                    slotName(lhs)));
      return Status::success();
    }
    if (format::hasAddend(tiling(last))) { // an adapter: Y = Y_base + U B
      p->add = last;
      p->base = producer(in(last, 3));
      p->rankIn = producer(in(last, 0));
      // The addend (input 3) comes from the base gmm, the rank-r rows
      // (input 0) from the gmm to rank r; both read the projection's input.
      for (const auto &[op, input, what] : {std::tuple<uint32_t, uint32_t, const char *>{
                                                p->base, 3, "base"},
                                            {p->rankIn, 0, "rank-r"}})
        if (!isActivationGmm(op) || in(op, 0) != lhs ||
            tiling(op).inputCount != (quantized(op) && op == p->base ? 4 : 3))
          return notLayer(fmt::format("{} reads '{}' (input {}), which is not written by the "
                                      "{} gmm of the {} reading '{}'",
                                      describe(last), slotName(in(last, input)), input, what,
                                      role, slotName(lhs)));
      return Status::success();
    }
    p->base = last;
    if (in(last, 0) != lhs)
      return notLayer(fmt::format("the {} {} reads '{}'; expected '{}'", role, describe(last),
                                  slotName(in(last, 0)), slotName(lhs)));
    return Status::success();
  }

  Status findOps() {
    size_t counts[8] = {};
    for (const OpRecord &op : program.ops)
      ++counts[size_t(op.kind)];
    const size_t quantizes = counts[size_t(OpKind::Quantize)],
                 dequantizes = counts[size_t(OpKind::Dequantize)];
    if (quantizes > 1 || quantizes != dequantizes || (quantizes && program.isBackward()))
      return notLayer(fmt::format("expected a quantize and a dequantize around the forward's "
                                  "dispatch, or neither; the {} binary has {} quantize and {} "
                                  "dequantize",
                                  program.isBackward() ? "backward" : "forward", quantizes,
                                  dequantizes));
    const bool bwd = program.isBackward();
    if (counts[size_t(OpKind::Dispatch)] != 1 || counts[size_t(OpKind::Combine)] != 1 ||
        counts[size_t(OpKind::Swiglu)] != (bwd ? 0u : 1u) ||
        counts[size_t(OpKind::SwigluGrad)] != (bwd ? 1u : 0u))
      return notLayer(fmt::format(
          "expected 1 dispatch, 1 {} and 1 combine op with the gmm ops; the binary has {} "
          "dispatch, {} swiglu, {} swiglu_grad and {} combine",
          bwd ? "swiglu_grad" : "swiglu", counts[1], counts[4], counts[5], counts[2]));
    for (uint32_t i = 0; i < program.ops.size(); ++i) {
      const OpKind kind = program.ops[i].kind;
      const uint32_t needed = format::isPut(kind)          ? 4
                              : kind == OpKind::Gmm        ? 3
                              : kind == OpKind::SwigluGrad ? 2
                                                           : 1;
      if (kind == OpKind::Quantize)
        plan.quantizeOp = i;
      if (kind == OpKind::Dequantize)
        plan.dequantizeOp = i;
      const bool addend = kind == OpKind::Gmm && !isWgrad(i) && tiling(i).inputCount == 4;
      if (tiling(i).inputCount != needed && !addend)
        return notLayer(fmt::format("{} has {} inputs; expected {}", describe(i),
                                    tiling(i).inputCount, needed));
      if (kind == OpKind::Dispatch)
        plan.dispatchOp = i;
      if (kind == OpKind::Combine)
        plan.combineOp = i;
    }
    const uint32_t d = plan.dispatchOp, c = plan.combineOp;
    plan.dTargetOffset = in(d, 0);
    plan.src = in(d, 1);
    // The rows the experts read: the dispatch's, or their dequantized form.
    uint32_t received = out(d);
    if (plan.quantizeOp != kNoSlot) {
      const uint32_t q = plan.quantizeOp, dq = plan.dequantizeOp;
      if (out(q) != in(d, 1) || in(dq, 0) != out(d))
        return notLayer(fmt::format("the quantize must make the dispatch's rows ({} writes '{}', "
                                    "the dispatch reads '{}') and the dequantize read what it "
                                    "receives ({} reads '{}', the dispatch writes '{}')",
                                    describe(q), slotName(out(q)), slotName(in(d, 1)),
                                    describe(dq), slotName(in(dq, 0)), slotName(out(d))));
      plan.shape.fp8Dispatch = true;
      plan.srcFp8 = in(d, 1);
      plan.receivedFp8 = out(d);
      plan.src = in(q, 0);
      received = out(dq);
    }
    plan.dSrcOffset = in(d, 2);
    plan.dSize = in(d, 3);
    plan.cTargetOffset = in(c, 0);
    plan.cSrcOffset = in(c, 2);
    plan.cSize = in(c, 3);
    plan.returned = out(c);
    plan.toReturn = in(c, 1);

    // The element-wise op between the two projections.
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      if (program.ops[i].kind == (bwd ? OpKind::SwigluGrad : OpKind::Swiglu))
        actOp = i;
    const uint32_t act = actOp;
    Projection first, second; // w1 then w2 (forward); w2 then w1 (backward)
    if (Status s = projection(in(act, 0), received, bwd ? "activation gradient" : "up projection",
                              &first);
        !s)
      return s;
    if (Status s = projection(in(c, 1), out(act), bwd ? "input gradient" : "down projection",
                              &second);
        !s)
      return s;
    Projection &p1 = bwd ? second : first, &p2 = bwd ? first : second; // on w1, on w2
    plan.w1 = in(p1.base, 1);
    plan.w2 = in(p2.base, 1);
    plan.upOut = bwd ? in(act, 1) : in(act, 0);
    plan.glist = in(p1.base, 2);
    std::vector<uint32_t> gmms = {p1.base, p2.base};
    LayerShape &shape = plan.shape;
    // The base weights' layout: each expert's matrix stored transposed
    // (w1 [L, 2I, H], w2 [L, H, I]) is read transposed by the forward and as
    // it is by the backward, the other way round from [L, H, 2I], [L, I, H].
    const bool readsW1T = tiling(p1.base).flags & format::kTilingTransposeB,
               readsW2T = tiling(p2.base).flags & format::kTilingTransposeB;
    if (readsW1T != readsW2T)
      return notLayer(fmt::format("{} reads w1 {}transposed and {} reads w2 {}transposed; both "
                                  "base weights must have one layout",
                                  describe(p1.base), readsW1T ? "" : "un", describe(p2.base),
                                  readsW2T ? "" : "un"));
    shape.weightsTransposed = bwd ? !readsW1T : readsW1T;
    // Quantized base weights: both or neither, in one format, and only the
    // base GMMs.
    const auto storage = [&](uint32_t op) {
      return quantized(op) ? fmt::format("as {} codes", format::dtypeName(
                                                            program.slots[in(op, 1)].dtype))
                           : std::string("dense");
    };
    if (storage(p1.base) != storage(p2.base))
      return notLayer(fmt::format("{} reads w1 {} and {} reads w2 {}; both base weights must "
                                  "have one format",
                                  describe(p1.base), storage(p1.base), describe(p2.base),
                                  storage(p2.base)));
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      if (program.ops[i].kind == OpKind::Gmm && quantized(i) && i != p1.base && i != p2.base)
        return notLayer(fmt::format("{} reads a quantized weight; only the base projections' "
                                    "GMMs may",
                                    describe(i)));
    if (quantized(p1.base)) {
      plan.w1Scale = in(p1.base, 3);
      plan.w2Scale = in(p2.base, 3);
      if (Status s = readWeightFormat(p1.base); !s)
        return s;
    }
    for (int t = 0; t < 2; ++t) {
      const Projection &p = t == 0 ? p1 : p2;
      if (!p.lora())
        continue;
      shape.loraTargets |= uint8_t(1u << t);
      gmms.push_back(p.rankIn);
      if (!p.fused())
        gmms.push_back(p.add);
      LoraSlots &lora = plan.lora[t];
      // Forward: U = s X A, Y = Y_base + U B. Backward: V = s dY B^T,
      // dX = dX_base + V A^T.
      lora.a = bwd ? addWeight(p) : in(p.rankIn, 1);
      lora.b = bwd ? in(p.rankIn, 1) : addWeight(p);
      if (!bwd)
        lora.u = out(p.rankIn);
      const TilingRecord &rt = tiling(p.rankIn);
      const float scale = (rt.flags & format::kTilingScale) ? rt.scale : 1.0f;
      if (shape.loraScaling != 0 && shape.loraScaling != scale)
        return notLayer(fmt::format("the adapters' scales differ: {} and {}", shape.loraScaling,
                                    scale));
      shape.loraScaling = scale;
    }
    if (!bwd) {
      plan.dispatched = received;
      plan.swigluOut = out(act);
      return allRoles(gmms);
    }

    // Backward: the weight-gradient GMMs. Without adapters, dw2 = A^T dZ and
    // dw1 = X^T dY, or none (frozen base weights). With adapters the base
    // weights are frozen, and each adapter has dB = U^T dY and dA = X^T V
    // (X: the projection's input rows in forward).
    std::vector<uint32_t> wgrads;
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      if (isWgrad(i))
        wgrads.push_back(i);
    gmms.insert(gmms.end(), wgrads.begin(), wgrads.end());
    const uint32_t dY2 = out(d), dY1 = out(act); // the two projections' dY rows
    if (shape.loraTargets == 0) {
      shape.frozen = wgrads.empty();
      if (!shape.frozen) {
        if (Status s = findOne(OpKind::Gmm, 1, dY2, "w2 gradient", &dw2Op, true); !s)
          return s;
        if (Status s = findOne(OpKind::Gmm, 1, dY1, "w1 gradient", &dw1Op, true); !s)
          return s;
        plan.swigluOut = in(dw2Op, 0);
        plan.dispatched = in(dw1Op, 0);
        plan.dw2 = out(dw2Op);
        plan.dw1 = out(dw1Op);
        weightGradOps = {dw1Op, dw2Op};
      }
      return allRoles(gmms);
    }
    shape.frozen = true;
    for (uint32_t op : wgrads) {
      bool found = false;
      for (int t = 0; t < 2 && !found; ++t) {
        const Projection &p = t == 0 ? p1 : p2;
        if (!p.lora())
          continue;
        LoraSlots &lora = plan.lora[t];
        const uint32_t dY = t == 0 ? dY1 : dY2;
        uint32_t *saved = t == 0 ? &plan.dispatched : &plan.swigluOut;
        if (in(op, 1) == dY && lora.db == kNoSlot) {
          lora.u = in(op, 0);
          lora.db = out(op);
          found = true;
        } else if (in(op, 1) == out(p.rankIn) && lora.da == kNoSlot) {
          *saved = in(op, 0);
          lora.da = out(op);
          found = true;
        }
      }
      if (!found)
        return notLayer(fmt::format("{} is not the gradient of a LoRA adapter; a layer with "
                                    "adapters keeps its base weights frozen",
                                    describe(op)));
      weightGradOps.push_back(op);
    }
    for (int t = 0; t < 2; ++t)
      if ((shape.loraTargets >> t & 1) && (plan.lora[t].da == kNoSlot || plan.lora[t].db == kNoSlot))
        return notLayer(fmt::format("the adapter on w{} has no {} gradient", t + 1,
                                    plan.lora[t].da == kNoSlot ? "A" : "B"));
    return allRoles(gmms);
  }

  /// Every gmm op has a role in the layer, and all read one group list.
  Status allRoles(const std::vector<uint32_t> &gmms) const {
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      if (program.ops[i].kind == OpKind::Gmm &&
          std::find(gmms.begin(), gmms.end(), i) == gmms.end())
        return notLayer(fmt::format("{} is not part of the layer's dataflow", describe(i)));
    return sameGlist(gmms);
  }

  /// A program of one put: the dispatch or the combine alone.
  Status exchange() {
    LayerShape &shape = plan.shape;
    const bool dispatch = program.ops[0].kind == OpKind::Dispatch;
    plan.kind = dispatch ? PlanKind::Dispatch : PlanKind::Combine;
    const TilingRecord &t = tiling(0);
    if (t.inputCount != 4)
      return notLayer(fmt::format("{} has {} inputs; expected 4", describe(0), t.inputCount));
    uint32_t rows = 0, received = 0; // the [N, H] and [T, H] row slots
    if (dispatch) {
      plan.dTargetOffset = in(0, 0);
      plan.src = rows = in(0, 1);
      plan.dSrcOffset = in(0, 2);
      plan.dSize = in(0, 3);
      plan.dispatched = received = out(0);
    } else {
      plan.cTargetOffset = in(0, 0);
      plan.toReturn = received = in(0, 1);
      plan.cSrcOffset = in(0, 2);
      plan.cSize = in(0, 3);
      plan.returned = rows = out(0);
    }
    const SlotRecord &r = program.slots[rows];
    if (r.rank != 2)
      return Status::error(fmt::format("slot '{}' has rank {}; expected [rows, H]",
                                       slotName(rows), r.rank));
    shape.rowCapacity = this->rows(rows);
    shape.hidden = int64_t(r.dims[1]);
    shape.activations = r.dtype;
    if (shape.activations != DType::F32 && shape.activations != DType::BF16)
      return Status::error(fmt::format("slot '{}' is {}; activations must be f32 or bf16",
                                       slotName(rows), format::dtypeName(r.dtype)));
    shape.receiveCapacity = this->rows(received);
    if (Status s = expectShape(received, "expert rows", {shape.receiveCapacity, shape.hidden},
                               shape.activations);
        !s)
      return s;
    const int64_t E = shape.experts();
    for (uint32_t k : {0u, 2u, 3u})
      if (Status s = expectIndex(in(0, k), k == 3 ? "sizes" : "offsets", E); !s)
        return s;
    return checkTilings();
  }

  Status sameGlist(const std::vector<uint32_t> &gmms) const {
    for (uint32_t op : gmms)
      if (in(op, 2) != plan.glist)
        return notLayer(fmt::format("{} reads group list '{}', the others '{}'", describe(op),
                                    slotName(in(op, 2)), slotName(plan.glist)));
    return Status::success();
  }

  /// Rows of a slot: its capacity for a dynamic one, else dim 0.
  int64_t rows(uint32_t slot) const {
    const SlotRecord &s = program.slots[slot];
    return (s.flags & format::kSlotDynamic) ? int64_t(s.capacityRows) : int64_t(s.dims[0]);
  }

  Status expectShape(uint32_t slot, const char *role, std::vector<int64_t> dims,
                     DType dtype) const {
    const SlotRecord &s = program.slots[slot];
    std::vector<int64_t> have;
    for (uint32_t i = 0; i < s.rank; ++i)
      have.push_back(i == 0 ? rows(slot) : int64_t(s.dims[i]));
    if (have != dims)
      return Status::error(fmt::format("slot '{}' ({}) has shape [{}]; expected [{}]",
                                       slotName(slot), role, fmt::join(have, ", "),
                                       fmt::join(dims, ", ")));
    if (s.dtype != dtype)
      return Status::error(fmt::format("slot '{}' ({}) is {}; expected {}", slotName(slot), role,
                                       format::dtypeName(s.dtype), format::dtypeName(dtype)));
    return Status::success();
  }

  Status expectIndex(uint32_t slot, const char *role, int64_t length) const {
    const SlotRecord &s = program.slots[slot];
    if (s.rank != 1 || int64_t(s.dims[0]) != length ||
        (s.dtype != DType::I32 && s.dtype != DType::I64))
      return Status::error(fmt::format("slot '{}' ({}) is {} [{}]; expected i32 or i64 [{}]",
                                       slotName(slot), role, format::dtypeName(s.dtype),
                                       s.rank ? s.dims[0] : 0, length));
    return Status::success();
  }

  Status checkShapes() {
    LayerShape &shape = plan.shape;
    const SlotRecord &src = program.slots[plan.src];
    if (src.rank != 2)
      return Status::error(fmt::format("slot '{}' (rows to send) has rank {}; expected 2",
                                       slotName(plan.src), src.rank));
    shape.rowCapacity = rows(plan.src);
    shape.hidden = int64_t(src.dims[1]);
    shape.activations = src.dtype;
    if (shape.activations != DType::F32 && shape.activations != DType::BF16)
      return Status::error(fmt::format("slot '{}' is {}; activations must be f32 or bf16",
                                       slotName(plan.src), format::dtypeName(src.dtype)));
    const SlotRecord &w1 = program.slots[plan.w1];
    const int twoI = shape.weightsTransposed ? 1 : 2; // the dim of w1 that is 2I
    if (w1.rank != 3 || w1.dims[twoI] % 2 != 0)
      return Status::error(fmt::format("slot '{}' (w1) must be {}", slotName(plan.w1),
                                       shape.weightsTransposed ? "[L, 2I, H] (stored transposed)"
                                                               : "[L, H, 2I]"));
    if (shape.weightFormat != WeightFormat::Dense && shape.backward && !shape.frozen)
      return Status::error(fmt::format(
          "slot '{}' (w1) is stored as {}, and this backward computes the base weights' "
          "gradients: a layer with quantized weights must be frozen or LoRA (no dw1, dw2)",
          slotName(plan.w1), shape.weightFormatName()));
    if (shape.weightsTransposed && shape.backward && !shape.frozen)
      return Status::error(fmt::format(
          "slot '{}' (w1) is stored transposed, and this backward computes the base weights' "
          "gradients: a layer with transposed weights must be frozen or LoRA (no dw1, dw2)",
          slotName(plan.w1)));
    shape.inter = int64_t(w1.dims[twoI] / 2);
    const DType act = shape.activations;
    const int64_t L = shape.localExperts, H = shape.hidden, I = shape.inter;
    const uint32_t dispatchOut =
        shape.fp8Dispatch ? out(plan.dequantizeOp) : out(plan.dispatchOp);
    shape.receiveCapacity = rows(dispatchOut);
    const int64_t T = shape.receiveCapacity, N = shape.rowCapacity;
    // Within what a config may ask for (format/Capacity.h) before any
    // product of them (the layer record, checked last, says the same).
    constexpr int64_t kMaxRows = format::kMaxSeqSize * format::kMaxCount;
    const auto within = [](int64_t v, int64_t least, int64_t most) {
      return v >= least && v <= most; // (a u64 dim past 2^63 reads as negative)
    };
    if (!within(H, 1, format::kMaxModelWidth) || !within(I, 1, format::kMaxModelWidth) ||
        !within(L, 1, format::kMaxCount) || !within(N, 0, kMaxRows) || !within(T, 0, kMaxRows))
      return Status::error(fmt::format(
          "the layer's sizes (hidden {}, intermediate {}, {} local experts, {} rows to send, {} "
          "dispatched rows) are not what a config may ask for (at most {}, {}, {}, {}, {})",
          H, I, L, N, T, format::kMaxModelWidth, format::kMaxModelWidth, format::kMaxCount,
          kMaxRows, kMaxRows));
    const int64_t E = shape.experts();
    const std::array<int64_t, 3> w1Dims = shape.w1Dims(), w2Dims = shape.w2Dims();

    struct Expect {
      uint32_t slot;
      const char *role;
      std::vector<int64_t> dims;
    };
    std::vector<Expect> expects = {
        {plan.src, "rows to send", {N, H}},       {dispatchOut, "dispatched rows", {T, H}},
        {plan.upOut, "Y", {T, 2 * I}},            {in(plan.combineOp, 1), "rows to return", {T, H}},
        {plan.returned, "returned rows", {N, H}},
    };
    if (!shape.frozen) {
      expects.push_back({plan.dispatched, "X", {T, H}});
      expects.push_back({plan.swigluOut, "A", {T, I}});
    }
    if (shape.backward) {
      expects.push_back({in(actOp, 0), "dA", {T, I}});
      expects.push_back({out(actOp), "dY", {T, 2 * I}});
    }
    // Adapters on w1 [L, H, 2I] and w2 [L, I, H]: A [L, K, r], B [L, r, N].
    std::vector<Expect> grads;
    if (shape.loraTargets) {
      const uint32_t firstA = plan.lora[(shape.loraTargets & 1) ? 0 : 1].a;
      shape.loraRank = program.slots[firstA].rank == 3 ? int64_t(program.slots[firstA].dims[2]) : 0;
      const int64_t r = shape.loraRank;
      loraRoles.reserve(2); // the roles' c_str() must stay put
      for (int t = 0; t < 2; ++t) {
        if (!(shape.loraTargets >> t & 1))
          continue;
        const LoraSlots &lora = plan.lora[t];
        const int64_t kDim = t == 0 ? H : I, nDim = t == 0 ? 2 * I : H;
        const std::string w = fmt::format("w{}", t + 1);
        loraRoles.push_back({"adapter A on " + w, "adapter B on " + w, "U of " + w,
                             "A gradient of " + w, "B gradient of " + w});
        const auto &names = loraRoles.back();
        expects.push_back({lora.a, names[0].c_str(), {L, kDim, r}});
        expects.push_back({lora.b, names[1].c_str(), {L, r, nDim}});
        expects.push_back({lora.u, names[2].c_str(), {T, r}});
        if (shape.backward) {
          grads.push_back({lora.da, names[3].c_str(), {L, kDim, r}});
          grads.push_back({lora.db, names[4].c_str(), {L, r, nDim}});
        }
      }
      if (shape.frozen && shape.backward && plan.lora[0].a != kNoSlot)
        expects.push_back({plan.dispatched, "X", {T, H}});
      if (shape.frozen && shape.backward && plan.lora[1].a != kNoSlot)
        expects.push_back({plan.swigluOut, "A", {T, I}});
    }
    for (const Expect &e : expects)
      if (Status s = expectShape(e.slot, e.role, e.dims, act); !s)
        return s;
    // The base weights: the activations' dtype, or codes and their fp32
    // scales.
    const DType weights = shape.weightDType();
    if (Status s = expectShape(plan.w1, "w1", {w1Dims.begin(), w1Dims.end()}, weights); !s)
      return s;
    if (Status s = expectShape(plan.w2, "w2", {w2Dims.begin(), w2Dims.end()}, weights); !s)
      return s;
    if (shape.weightFormat != WeightFormat::Dense) {
      if (Status s = expectShape(plan.w1Scale, "w1's scales", shape.scaleDims(w1Dims), DType::F32);
          !s)
        return s;
      if (Status s = expectShape(plan.w2Scale, "w2's scales", shape.scaleDims(w2Dims), DType::F32);
          !s)
        return s;
    }
    if (shape.fp8Dispatch) {
      const int64_t W = fp8RowBytes(H);
      if (Status s = expectShape(plan.srcFp8, "quantized rows to send", {N, W}, DType::F8E4M3); !s)
        return s;
      if (Status s = expectShape(plan.receivedFp8, "quantized dispatched rows", {T, W},
                                 DType::F8E4M3);
          !s)
        return s;
    }
    if (shape.backward && !shape.frozen) {
      grads.push_back({plan.dw1, "dw1", {L, H, 2 * I}});
      grads.push_back({plan.dw2, "dw2", {L, I, H}});
    }
    if (!grads.empty()) {
      shape.weightGrads = program.slots[grads[0].slot].dtype;
      if (shape.weightGrads != DType::F32 && shape.weightGrads != DType::BF16)
        return Status::error(fmt::format("slot '{}' ({}) is {}; expected f32 or bf16",
                                         slotName(grads[0].slot), grads[0].role,
                                         format::dtypeName(shape.weightGrads)));
      for (const Expect &e : grads)
        if (Status s = expectShape(e.slot, e.role, e.dims, shape.weightGrads); !s)
          return s;
      shape.accumulateWeightGrads = tiling(weightGradOps[0]).flags & format::kTilingAccumulate;
      for (uint32_t op : weightGradOps)
        if (bool(tiling(op).flags & format::kTilingAccumulate) != shape.accumulateWeightGrads)
          return Status::error("the weight-gradient ops disagree on accumulating");
    }
    const std::pair<uint32_t, const char *> indices[] = {
        {plan.dTargetOffset, "dispatch target offsets"}, {plan.dSrcOffset, "dispatch src offsets"},
        {plan.dSize, "dispatch sizes"},                  {plan.cTargetOffset, "combine target offsets"},
        {plan.cSrcOffset, "combine src offsets"},        {plan.cSize, "combine sizes"}};
    for (const auto &[slot, role] : indices)
      if (Status s = expectIndex(slot, role, E); !s)
        return s;
    return expectIndex(plan.glist, "group list", L);
  }

  Status tilingError(uint32_t op, const std::string &what) const {
    return Status::error(fmt::format("{}: {}", describe(op), what));
  }

  Status expectField(uint32_t op, const char *field, uint64_t have, uint64_t want) const {
    if (have != want)
      return tilingError(op, fmt::format("tiling {} is {}; expected {}", field, have, want));
    return Status::success();
  }

  Status checkTilings() {
    LayerShape &shape = plan.shape;
    const int64_t T = shape.receiveCapacity;
    shape.expertCapacity = T;
    shape.putCapacity = T;
    for (uint32_t op = 0; op < program.ops.size(); ++op) {
      const TilingRecord &t = tiling(op);
      const OpKind kind = program.ops[op].kind;
      if (kind == OpKind::Quantize) {
        // Row tiles of the rows to send, not of expert segments.
        const int64_t H = shape.hidden;
        if (Status s = expectField(op, "experts", t.experts, 1); !s)
          return s;
        if (Status s = expectField(op, "peers", t.peers, 1); !s)
          return s;
        if (Status s = expectField(op, "rows", t.rows, uint64_t(shape.rowCapacity)); !s)
          return s;
        for (auto [field, have, want] :
             {std::tuple{"cols", t.cols, H}, {"lda", uint64_t(t.lda), H},
              {"ldc", uint64_t(t.ldc), fp8RowBytes(H)}})
          if (Status s = expectField(op, field, have, uint64_t(want)); !s)
            return s;
        if (t.dtype != DType::F8E4M3 || t.flags)
          return tilingError(op, "a quantize tiling must be f8e4m3 without flags");
        continue;
      }
      if (t.experts != shape.localExperts)
        return tilingError(op, fmt::format("a grid over {} experts; the binary has {} local "
                                           "experts",
                                           t.experts, shape.localExperts));
      const bool put = format::isPut(kind);
      if (put)
        if (Status s = expectField(op, "peers", t.peers, shape.epRanks()); !s)
          return s;
      const bool fp8Put = kind == OpKind::Dispatch && shape.fp8Dispatch;
      if (t.dtype != (fp8Put ? DType::F8E4M3 : shape.activations) &&
          !(kind == OpKind::Gmm && isWgrad(op)))
        return tilingError(op, fmt::format("tiling dtype {}; the activations are {}",
                                           format::dtypeName(t.dtype),
                                           format::dtypeName(shape.activations)));
      // Every row-tiled op may share out the rows present.
      const uint8_t allowedFlags =
          kind == OpKind::Gmm
              ? (isWgrad(op)
                     ? format::kTilingTransposeA | format::kTilingAccumulate
                     : format::kTilingTransposeB | format::kTilingScale | format::kTilingShareRows |
                           format::kTilingQuantizedB | format::kTilingLowRankTransposeB)
          : kind == OpKind::Combine ? format::kTilingReduceTp | format::kTilingShareRows
                                    : format::kTilingShareRows;
      if (t.flags & ~allowedFlags)
        return tilingError(op, fmt::format("tiling flags {:#x} are not supported here", t.flags));
      if (format::hasPeerGroups(t) &&
          (t.peers > uint64_t(shape.epRanks()) || !(t.flags & format::kTilingShareRows) ||
           (kind == OpKind::Gmm && isWgrad(op))))
        // Peer groups: row tiles of the rows from a range of source ranks.
        return tilingError(op, fmt::format("{} peer groups need shared-out rows of an "
                                           "activation op and at most the {} EP ranks",
                                           t.peers, shape.epRanks()));
      const auto width = [&](uint32_t slot) { return int64_t(program.slots[slot].dims[1]); };
      if (put) {
        const uint64_t rowWidth = uint64_t(fp8Put ? fp8RowBytes(shape.hidden) : shape.hidden);
        if (Status s = expectField(op, "cols", t.cols, rowWidth); !s)
          return s;
        if (Status s = expectField(op, "lda", t.lda, rowWidth); !s)
          return s;
        if (Status s = expectField(op, "ldc", t.ldc, rowWidth); !s)
          return s;
        shape.putCapacity = std::min(shape.putCapacity, int64_t(t.rows));
        continue;
      }
      if (kind == OpKind::Gmm && isWgrad(op)) {
        const uint32_t a = in(op, 0), b = in(op, 1), c = out(op);
        if (!(t.flags & format::kTilingTransposeA))
          return tilingError(op, "a weight-gradient GMM must read its A transposed");
        const SlotRecord &cs = program.slots[c];
        if (Status s = expectField(op, "rows", t.rows, uint64_t(width(a))); !s)
          return s;
        if (Status s = expectField(op, "cols", t.cols, uint64_t(width(b))); !s)
          return s;
        if (Status s = expectField(op, "lda", t.lda, uint64_t(width(a))); !s)
          return s;
        if (Status s = expectField(op, "ldb", t.ldb, uint64_t(width(b))); !s)
          return s;
        if (Status s = expectField(op, "ldc", t.ldc, cs.dims[2]); !s)
          return s;
        if (cs.dims[1] != t.rows || cs.dims[2] != t.cols)
          return tilingError(op, fmt::format("output '{}' is not [L, {}, {}]", slotName(c),
                                             t.rows, t.cols));
        continue;
      }
      // Per-expert row-tiled ops: GMM (activation form), SwiGLU, SwiGLU-grad,
      // dequantize.
      // Their grids may cover more rows than the rank's buffer holds (an
      // expert may get every row); the receive capacity bounds them too.
      shape.expertCapacity = std::min(shape.expertCapacity, int64_t(t.rows));
      const uint32_t a = in(op, 0), c = out(op);
      if (Status s = expectField(op, "lda", t.lda, uint64_t(width(a))); !s)
        return s;
      if (Status s = expectField(op, "ldc", t.ldc, uint64_t(width(c))); !s)
        return s;
      if (Status s = expectField(op, "cols", t.cols, uint64_t(width(c))); !s)
        return s;
      if (kind == OpKind::Gmm) {
        if (format::hasAddend(t)) {
          const SlotRecord &cs = program.slots[c];
          if (Status s = expectShape(in(op, 3), "addend", {rows(c), int64_t(cs.dims[1])},
                                     cs.dtype);
              !s)
            return tilingError(op, s.message());
        }
        const SlotRecord &w = program.slots[in(op, 1)];
        const bool transB = t.flags & format::kTilingTransposeB;
        if (Status s = expectField(op, "depth", t.depth, uint64_t(width(a))); !s)
          return s;
        if (Status s = expectField(op, "ldb", t.ldb, w.dims[2]); !s)
          return s;
        const uint64_t wantK = transB ? w.dims[2] : w.dims[1];
        const uint64_t wantN = transB ? w.dims[1] : w.dims[2];
        if (wantK != t.depth || wantN != t.cols)
          return tilingError(op, fmt::format("weight '{}' [{}, {}, {}] does not give a {} x {} "
                                             "product{}",
                                             slotName(in(op, 1)), w.dims[0], w.dims[1], w.dims[2],
                                             t.depth, t.cols, transB ? " (transposed)" : ""));
      } else if (kind == OpKind::SwigluGrad) {
        if (Status s = expectField(op, "ldb", t.ldb, uint64_t(width(in(op, 1)))); !s)
          return s;
      }
    }
    if (shape.putCapacity > shape.expertCapacity)
      shape.putCapacity = shape.expertCapacity;
    // A put carries at most one row per token (experts are distinct in a
    // token's top-k), so the dispatch grid's rows are the compiled S.
    shape.tokens = int64_t(tiling(plan.kind == PlanKind::Layer ? plan.dispatchOp : 0).rows);
    shape.topK = shape.tokens > 0 && shape.rowCapacity % shape.tokens == 0
                     ? shape.rowCapacity / shape.tokens
                     : 0;
    return Status::success();
  }
};

} // namespace


Status analyzeLayer(const TaskProgram &program, LayerPlan *out) {
  LayerPlan plan;
  if (Status s = Analyzer(program, plan).run(); !s)
    return s;
  if (Status s = checkLayerRecord(program, plan); !s)
    return s;
  *out = std::move(plan);
  return Status::success();
}

std::vector<uint32_t> LayerPlan::boundSlots() const {
  std::vector<uint32_t> slots;
  if (kind == PlanKind::Combine)
    slots = {toReturn};
  if (kind != PlanKind::Layer)
    return slots;
  slots = {w1, w2, w1Scale, w2Scale};
  for (const LoraSlots &l : lora)
    slots.insert(slots.end(), {l.a, l.b});
  if (shape.backward) {
    slots.insert(slots.end(), {dw1, dw2, dispatched, upOut, swigluOut});
    for (const LoraSlots &l : lora)
      slots.insert(slots.end(), {l.u, l.da, l.db});
  }
  slots.erase(std::remove(slots.begin(), slots.end(), kNoSlot), slots.end());
  return slots;
}

std::vector<uint32_t> LayerPlan::layoutSlots() const {
  std::vector<uint32_t> slots = {dSize,   dSrcOffset,     dTargetOffset, cSize,
                                 cSrcOffset, cTargetOffset, glist};
  slots.erase(std::remove(slots.begin(), slots.end(), kNoSlot), slots.end());
  return slots;
}

std::vector<uint32_t> LayerPlan::readByBackward() const {
  std::vector<uint32_t> slots = {dispatched, upOut, swigluOut, returned, lora[0].u, lora[1].u};
  slots.erase(std::remove(slots.begin(), slots.end(), kNoSlot), slots.end());
  return slots;
}

} // namespace moec::rt
