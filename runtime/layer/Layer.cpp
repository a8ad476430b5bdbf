//===- Layer.cpp - What the slots and ops of a layer binary are -----------===//
//
// See Layer.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/layer/Layer.h"

#include <fmt/format.h>

#include <algorithm>

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
    shape.ranks = program.epRanks;
    shape.localExperts = program.localExperts;
    if (shape.localExperts == 0)
      return Status::error("the binary has 0 local experts");
    plan.inputs.resize(program.ops.size());
    for (size_t i = 0; i < program.ops.size(); ++i)
      for (uint32_t k = 0; k < format::kMaxTilingInputs; ++k)
        plan.inputs[i][k] = tiling(uint32_t(i)).inputSlots[k];

    if (program.ops.size() == 1 && !program.isBackward() &&
        (program.ops[0].kind == OpKind::Dispatch || program.ops[0].kind == OpKind::Combine))
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

  // Ops by role.
  uint32_t up = kNoSlot, swiglu = kNoSlot, down = kNoSlot;       // forward
  uint32_t actGrad = kNoSlot, swigluGrad = kNoSlot, gateGrad = kNoSlot; // backward
  uint32_t dw2Op = kNoSlot, dw1Op = kNoSlot;                      // backward

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

  Status findOps() {
    size_t counts[6] = {};
    for (const OpRecord &op : program.ops)
      ++counts[size_t(op.kind)];
    const bool bwd = program.isBackward();
    // A backward pass without the weight-gradient GMMs is a frozen layer's.
    size_t wgrads = 0;
    for (uint32_t i = 0; i < program.ops.size(); ++i)
      wgrads += isWgrad(i);
    plan.shape.frozen = bwd && wgrads == 0;
    const size_t gmms = bwd ? (plan.shape.frozen ? 2 : 4) : 2;
    if (counts[size_t(OpKind::Dispatch)] != 1 || counts[size_t(OpKind::Combine)] != 1 ||
        counts[size_t(OpKind::Gmm)] != gmms ||
        counts[size_t(OpKind::Swiglu)] != (bwd ? 0u : 1u) ||
        counts[size_t(OpKind::SwigluGrad)] != (bwd ? 1u : 0u))
      return notLayer(fmt::format(
          "expected 1 dispatch, {} gmm, 1 {} and 1 combine op; the binary has {} dispatch, "
          "{} gmm, {} swiglu, {} swiglu_grad and {} combine",
          bwd ? "4 (2 with frozen weights)" : "2", bwd ? "swiglu_grad" : "swiglu", counts[1], counts[3], counts[4], counts[5],
          counts[2]));
    for (uint32_t i = 0; i < program.ops.size(); ++i) {
      const OpKind kind = program.ops[i].kind;
      const uint32_t needed = kind == OpKind::Dispatch || kind == OpKind::Combine ? 4
                              : kind == OpKind::Gmm                               ? 3
                              : kind == OpKind::SwigluGrad                        ? 2
                                                                                  : 1;
      if (tiling(i).inputCount != needed)
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
    plan.dSrcOffset = in(d, 2);
    plan.dSize = in(d, 3);
    plan.cTargetOffset = in(c, 0);
    plan.cSrcOffset = in(c, 2);
    plan.cSize = in(c, 3);
    plan.returned = out(c);
    plan.toReturn = in(c, 1);

    if (!bwd) {
      if (Status s = findOne(OpKind::Gmm, 0, out(d), "up projection", &up); !s)
        return s;
      if (Status s = findOne(OpKind::Swiglu, 0, out(up), "SwiGLU", &swiglu); !s)
        return s;
      if (Status s = findOne(OpKind::Gmm, 0, out(swiglu), "down projection", &down); !s)
        return s;
      if (in(c, 1) != out(down))
        return notLayer(fmt::format("the combine sends '{}', not the down projection's '{}'",
                                    slotName(in(c, 1)), slotName(out(down))));
      plan.w1 = in(up, 1);
      plan.w2 = in(down, 1);
      plan.dispatched = out(d);
      plan.upOut = out(up);
      plan.swigluOut = out(swiglu);
      plan.glist = in(up, 2);
      return sameGlist({up, down});
    }
    if (Status s = findOne(OpKind::Gmm, 0, out(d), "activation gradient", &actGrad); !s)
      return s;
    if (Status s = findOne(OpKind::SwigluGrad, 0, out(actGrad), "SwiGLU gradient", &swigluGrad);
        !s)
      return s;
    if (Status s = findOne(OpKind::Gmm, 0, out(swigluGrad), "input gradient", &gateGrad); !s)
      return s;
    if (in(c, 1) != out(gateGrad))
      return notLayer(fmt::format("the combine sends '{}', not the input gradient's '{}'",
                                  slotName(in(c, 1)), slotName(out(gateGrad))));
    plan.w2 = in(actGrad, 1);
    plan.w1 = in(gateGrad, 1);
    plan.upOut = in(swigluGrad, 1);
    plan.glist = in(actGrad, 2);
    if (plan.shape.frozen)
      return sameGlist({actGrad, gateGrad});
    if (Status s = findOne(OpKind::Gmm, 1, out(d), "w2 gradient", &dw2Op, true); !s)
      return s;
    if (Status s = findOne(OpKind::Gmm, 1, out(swigluGrad), "w1 gradient", &dw1Op, true); !s)
      return s;
    plan.swigluOut = in(dw2Op, 0);
    plan.dispatched = in(dw1Op, 0);
    plan.dw2 = out(dw2Op);
    plan.dw1 = out(dw1Op);
    return sameGlist({actGrad, gateGrad, dw2Op, dw1Op});
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
    const int64_t E = int64_t(shape.ranks) * shape.localExperts;
    for (uint32_t k : {0u, 2u, 3u})
      if (Status s = expectIndex(in(0, k), k == 3 ? "sizes" : "offsets", E); !s)
        return s;
    return checkTilings();
  }

  Status sameGlist(std::initializer_list<uint32_t> gmms) const {
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
    if (w1.rank != 3 || w1.dims[2] % 2 != 0)
      return Status::error(fmt::format("slot '{}' (w1) must be [L, H, 2I]", slotName(plan.w1)));
    shape.inter = int64_t(w1.dims[2] / 2);
    const DType act = shape.activations;
    const int64_t L = shape.localExperts, H = shape.hidden, I = shape.inter;
    const int64_t E = int64_t(shape.ranks) * L;
    const uint32_t dispatchOut = out(plan.dispatchOp);
    shape.receiveCapacity = rows(dispatchOut);
    const int64_t T = shape.receiveCapacity, N = shape.rowCapacity;

    struct Expect {
      uint32_t slot;
      const char *role;
      std::vector<int64_t> dims;
    };
    std::vector<Expect> expects = {
        {plan.src, "rows to send", {N, H}},       {dispatchOut, "dispatched rows", {T, H}},
        {plan.w1, "w1", {L, H, 2 * I}},           {plan.w2, "w2", {L, I, H}},
        {plan.upOut, "Y", {T, 2 * I}},            {in(plan.combineOp, 1), "rows to return", {T, H}},
        {plan.returned, "returned rows", {N, H}},
    };
    if (!shape.frozen) {
      expects.push_back({plan.dispatched, "X", {T, H}});
      expects.push_back({plan.swigluOut, "A", {T, I}});
    }
    if (shape.backward) {
      expects.push_back({out(actGrad), "dA", {T, I}});
      expects.push_back({out(swigluGrad), "dY", {T, 2 * I}});
    }
    for (const Expect &e : expects)
      if (Status s = expectShape(e.slot, e.role, e.dims, act); !s)
        return s;
    if (shape.backward && !shape.frozen) {
      shape.weightGrads = program.slots[plan.dw1].dtype;
      if (shape.weightGrads != DType::F32 && shape.weightGrads != DType::BF16)
        return Status::error(fmt::format("slot '{}' (dw1) is {}; expected f32 or bf16",
                                         slotName(plan.dw1),
                                         format::dtypeName(shape.weightGrads)));
      if (Status s = expectShape(plan.dw1, "dw1", {L, H, 2 * I}, shape.weightGrads); !s)
        return s;
      if (Status s = expectShape(plan.dw2, "dw2", {L, I, H}, shape.weightGrads); !s)
        return s;
      const bool acc1 = tiling(dw1Op).flags & format::kTilingAccumulate;
      const bool acc2 = tiling(dw2Op).flags & format::kTilingAccumulate;
      if (acc1 != acc2)
        return Status::error("the two weight-gradient ops disagree on accumulating");
      shape.accumulateWeightGrads = acc1;
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
      if (t.experts != shape.localExperts)
        return tilingError(op, fmt::format("a grid over {} experts; the binary has {} local "
                                           "experts",
                                           t.experts, shape.localExperts));
      const bool put = kind == OpKind::Dispatch || kind == OpKind::Combine;
      if (Status s = expectField(op, "peers", t.peers, put ? shape.ranks : 1); !s)
        return s;
      if (t.dtype != shape.activations && !(kind == OpKind::Gmm && isWgrad(op)))
        return tilingError(op, fmt::format("tiling dtype {}; the activations are {}",
                                           format::dtypeName(t.dtype),
                                           format::dtypeName(shape.activations)));
      const uint8_t allowedFlags =
          kind == OpKind::Gmm ? (isWgrad(op) ? format::kTilingTransposeA | format::kTilingAccumulate
                                             : format::kTilingTransposeB)
                              : 0;
      if (t.flags & ~allowedFlags)
        return tilingError(op, fmt::format("tiling flags {:#x} are not supported here", t.flags));
      const auto width = [&](uint32_t slot) { return int64_t(program.slots[slot].dims[1]); };
      if (put) {
        if (Status s = expectField(op, "cols", t.cols, uint64_t(shape.hidden)); !s)
          return s;
        if (Status s = expectField(op, "lda", t.lda, uint64_t(shape.hidden)); !s)
          return s;
        if (Status s = expectField(op, "ldc", t.ldc, uint64_t(shape.hidden)); !s)
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
      // Per-expert row-tiled ops: GMM (activation form), SwiGLU, SwiGLU-grad.
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
  *out = std::move(plan);
  return Status::success();
}

Status checkExchangeMatch(const LayerPlan &dispatch, const LayerPlan &combine) {
  if (dispatch.kind != PlanKind::Dispatch)
    return Status::error("the dispatch program is not a dispatch alone (a graph of one "
                         "dispatch op)");
  if (combine.kind != PlanKind::Combine)
    return Status::error("the combine program is not a combine alone (a graph of one "
                         "combine op)");
  const LayerShape &d = dispatch.shape, &c = combine.shape;
  const std::pair<const char *, std::pair<int64_t, int64_t>> fields[] = {
      {"ranks", {d.ranks, c.ranks}},
      {"local experts", {d.localExperts, c.localExperts}},
      {"hidden size", {d.hidden, c.hidden}},
      {"tokens", {d.tokens, c.tokens}},
      {"row capacity", {d.rowCapacity, c.rowCapacity}},
      {"receive capacity", {d.receiveCapacity, c.receiveCapacity}},
      {"put capacity", {d.putCapacity, c.putCapacity}},
      {"activations", {int64_t(d.activations), int64_t(c.activations)}},
  };
  for (const auto &[what, values] : fields)
    if (values.first != values.second)
      return Status::error(fmt::format("the dispatch and combine programs are for different "
                                       "layers: {} {} and {}",
                                       what, values.first, values.second));
  return Status::success();
}

Status checkPassesMatch(const LayerPlan &forward, const LayerPlan &backward) {
  const LayerShape &f = forward.shape, &b = backward.shape;
  if (f.backward)
    return Status::error("the forward program is a backward pass");
  if (!b.backward)
    return Status::error("the backward program is a forward pass");
  const auto mismatch = [](const char *what, int64_t fv, int64_t bv) {
    return Status::error(fmt::format(
        "the forward and backward programs are for different layers: {} {} and {}", what, fv, bv));
  };
  const std::pair<const char *, std::pair<int64_t, int64_t>> fields[] = {
      {"ranks", {f.ranks, b.ranks}},
      {"local experts", {f.localExperts, b.localExperts}},
      {"hidden size", {f.hidden, b.hidden}},
      {"intermediate size", {f.inter, b.inter}},
      {"row capacity", {f.rowCapacity, b.rowCapacity}},
      {"receive capacity", {f.receiveCapacity, b.receiveCapacity}},
      {"expert capacity", {f.expertCapacity, b.expertCapacity}},
      {"put capacity", {f.putCapacity, b.putCapacity}},
  };
  for (const auto &[what, values] : fields)
    if (values.first != values.second)
      return mismatch(what, values.first, values.second);
  if (f.activations != b.activations)
    return Status::error(fmt::format("the forward and backward programs are for different layers: "
                                     "activations {} and {}",
                                     format::dtypeName(f.activations),
                                     format::dtypeName(b.activations)));
  return Status::success();
}

} // namespace moec::rt
