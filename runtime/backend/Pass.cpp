//===- Pass.cpp - The backend seam ------------------------------------------===//

#include "runtime/backend/Pass.h"

#include <functional>

#include <algorithm>

namespace moec::backend {

uint64_t slotElements(const format::SlotRecord &slot) {
  uint64_t count = 1;
  for (uint32_t i = 0; i < slot.rank; ++i)
    count *= (i == 0 && (slot.flags & format::kSlotDynamic)) ? slot.capacityRows : slot.dims[i];
  return count;
}

uint64_t workspaceBytes(const format::TaskProgram &program, const rt::LayerPlan &plan,
                        uint32_t ranks, size_t (*bytes)(const format::SlotRecord &),
                        const std::vector<uint32_t> *sharing) {
  const std::vector<uint32_t> caller = plan.boundSlots();
  uint64_t needed = 0;
  for (uint32_t slot = 0; slot < program.slots.size(); ++slot)
    if (std::find(caller.begin(), caller.end(), slot) == caller.end() &&
        !(sharing && (*sharing)[slot] != rt::kNoSlot))
      needed += uint64_t(bytes(program.slots[slot])) * slotCopies(program, slot) * ranks;
  return needed;
}

namespace {
/// An activation-form GMM's fourth input where it is B's scales
/// (`scales`) or an addend (not), else rt::kNoSlot.
uint32_t fourthInput(const format::TaskProgram &program, const format::OpRecord &op, bool scales) {
  const format::TilingRecord &t = program.tilings[op.tiling];
  const bool activation = op.kind == format::OpKind::Gmm && t.depth != 0;
  return activation && t.inputCount == 4 && format::hasAddend(t) != scales ? t.inputSlots[3]
                                                                           : rt::kNoSlot;
}
} // namespace

void findBadScaleOnHost(ScaleCheck &c) {
  c.index = -1;
  for (int64_t i = 0; i < c.count; ++i)
    if (!goodScale(c.scales[i], c.pairs && i % 2 == 1)) {
      c.index = i;
      c.value = c.scales[i];
      return;
    }
}

Status Pass::findBadScales(std::vector<ScaleCheck> &checks) const {
  for (ScaleCheck &c : checks)
    findBadScaleOnHost(c);
  return Status::success();
}

uint32_t addendSlot(const format::TaskProgram &program, const format::OpRecord &op) {
  return fourthInput(program, op, false);
}

uint32_t weightScalesSlot(const format::TaskProgram &program, const format::OpRecord &op) {
  return fourthInput(program, op, true);
}

std::vector<uint32_t> sumsOverAddends(const format::TaskProgram &program, const rt::LayerPlan &plan,
                                      size_t (*bytes)(const format::SlotRecord &)) {
  const size_t slots = program.slots.size();
  std::vector<uint32_t> over(slots, rt::kNoSlot);
  // The slots that are not plain workspace: bound, layout, windows.
  std::vector<bool> plain(slots, true);
  for (const std::vector<uint32_t> &list : {plan.boundSlots(), plan.layoutSlots()})
    for (uint32_t slot : list)
      plain[slot] = false;
  std::vector<int> readers(slots, 0);
  for (const format::OpRecord &op : program.ops) {
    const format::TilingRecord &t = program.tilings[op.tiling];
    if (format::isPut(op.kind))
      plain[t.outputSlot] = false;
    for (uint32_t i = 0; i < t.inputCount; ++i)
      ++readers[t.inputSlots[i]];
  }
  // An addend's contents end with the product: not one a backward reads.
  std::vector<bool> dies = plain;
  if (!plan.shape.backward)
    for (uint32_t slot : plan.readByBackward())
      dies[slot] = false;
  for (const format::OpRecord &op : program.ops) {
    const uint32_t addend = addendSlot(program, op);
    if (addend == rt::kNoSlot)
      continue;
    const uint32_t out = program.tilings[op.tiling].outputSlot;
    if (dies[addend] && plain[out] && readers[addend] == 1 &&
        bytes(program.slots[addend]) == bytes(program.slots[out]) &&
        slotCopies(program, addend) == slotCopies(program, out))
      over[out] = addend;
  }
  return over;
}

uint32_t slotCopies(const format::TaskProgram &program, uint32_t slot) {
  for (uint32_t op = 0; op < program.ops.size(); ++op)
    if (program.fansOut(op) && program.tilings[program.ops[op].tiling].outputSlot == slot)
      return program.tpRanks;
  return 1;
}

int64_t slotRows(const format::SlotRecord &slot) {
  return slot.rank == 0 ? 0
                        : int64_t((slot.flags & format::kSlotDynamic) ? slot.capacityRows
                                                                      : slot.dims[0]);
}

void fillLayoutTensors(const format::TaskProgram &program, const rt::LayerPlan &plan,
                       const std::vector<RankRoute> &routes, uint32_t firstRank, uint32_t endRank,
                       const std::function<void *(uint32_t rank, uint32_t slot)> &memory) {
  // Ranks are EP ranks here: the TP ranks of an EP rank route the same
  // tokens (Group::agree checks it) and exchange with their own TP
  // coordinate's ranks, so every TP coordinate has the same layout.
  const uint32_t R = program.epRanks, T = program.tpRanks, L = plan.shape.localExperts, E = R * L;
  const auto ep = [&](uint32_t q) -> const rt::RoutingLayout & {
    return routes[size_t(q) * T].layout;
  };
  // rows[r][e]: rows local expert e of rank r receives; start[r][e]: its
  // segment's first row; before[q][g]: rows ranks < q send expert g.
  std::vector<std::vector<int64_t>> rows(R, std::vector<int64_t>(L)), start = rows;
  std::vector<std::vector<int64_t>> before(R, std::vector<int64_t>(E, 0));
  for (uint32_t g = 0; g < E; ++g)
    for (uint32_t q = 0; q < R; ++q) {
      if (q + 1 < R)
        before[q + 1][g] = before[q][g] + ep(q).counts[g];
      rows[g / L][g % L] += ep(q).counts[g];
    }
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t e = 1; e < L; ++e)
      start[r][e] = start[r][e - 1] + rows[r][e - 1];
  const auto targetOffset = [&](uint32_t q, uint32_t g) {
    return start[g / L][g % L] + before[q][g];
  };
  // A dispatch or combine program alone has only its own half's tensors.
  const auto put = [&](uint32_t r, uint32_t slot, int64_t i, int64_t value) {
    if (slot == rt::kNoSlot)
      return;
    void *data = memory(r, slot);
    if (program.slots[slot].dtype == DType::I32)
      static_cast<int32_t *>(data)[i] = int32_t(value);
    else
      static_cast<int64_t *>(data)[i] = value;
  };
  for (uint32_t r = firstRank; r < endRank; ++r) {
    const uint32_t me = r / T;
    const rt::RoutingLayout &own = routes[r].layout;
    for (uint32_t g = 0; g < E; ++g) {
      put(r, plan.dSize, g, own.counts[g]);
      put(r, plan.dSrcOffset, g, own.offsets[g]);
      put(r, plan.dTargetOffset, g, targetOffset(me, g));
    }
    for (uint32_t q = 0; q < R; ++q)
      for (uint32_t e = 0; e < L; ++e) {
        const uint32_t g = me * L + e, i = q * L + e;
        put(r, plan.cSize, i, ep(q).counts[g]);
        put(r, plan.cSrcOffset, i, targetOffset(q, g));
        put(r, plan.cTargetOffset, i, ep(q).offsets[g]);
      }
    for (uint32_t e = 0; e < L; ++e)
      put(r, plan.glist, e, start[me][e] + rows[me][e]);
  }
}

std::vector<int64_t> segmentSourceStarts(const format::TaskProgram &program,
                                         const rt::LayerPlan &plan,
                                         const std::vector<RankRoute> &routes, uint32_t epRank) {
  const uint32_t R = program.epRanks, T = program.tpRanks, L = plan.shape.localExperts;
  std::vector<int64_t> starts(size_t(L) * (R + 1));
  for (uint32_t e = 0; e < L; ++e) {
    int64_t *expert = &starts[size_t(e) * (R + 1)];
    for (uint32_t q = 0; q < R; ++q)
      expert[q + 1] = expert[q] + routes[size_t(q) * T].layout.counts[size_t(epRank) * L + e];
  }
  return starts;
}

namespace {

/// Calls visit(op, from, to, bytes) for the rows each put op of `program`
/// moves from rank `from` into the windows of rank `to` in one pass.
void forEachPut(const format::TaskProgram &program, const rt::LayerPlan &plan,
                const std::vector<RankRoute> &routes,
                const std::function<void(format::OpKind, uint32_t, uint32_t, uint64_t)> &visit) {
  const uint32_t R = program.epRanks, T = program.tpRanks,
                 L = uint32_t(plan.shape.localExperts);
  for (uint32_t o = 0; o < program.ops.size(); ++o) {
    const format::OpRecord &op = program.ops[o];
    if (!format::isPut(op.kind))
      continue;
    const format::TilingRecord &tiling = program.tilings[op.tiling];
    const uint64_t rowBytes =
        tiling.cols * format::dtypeSize(program.slots[tiling.outputSlot].dtype);
    // Rows EP rank s routes to expert e of EP rank q: the dispatch puts them
    // from (s, t) to (q, t), the combine returns them from (q, t) to (s, t),
    // or to every (s, t') when it fans out (signalRanks: its puts go where
    // its signals do).
    for (uint32_t s = 0; s < R; ++s)
      for (uint32_t q = 0; q < R; ++q)
        for (uint32_t e = 0; e < L; ++e) {
          const int64_t rows = routes[size_t(s) * T].layout.counts[size_t(q) * L + e];
          const uint64_t bytes = uint64_t(std::min<int64_t>(rows, int64_t(tiling.rows))) * rowBytes;
          for (uint32_t t = 0; t < T; ++t) {
            const bool dispatch = op.kind == format::OpKind::Dispatch;
            const uint32_t from = (dispatch ? s : q) * T + t;
            const format::TaskProgram::RankRange to =
                program.signalRanks(o, from, ((dispatch ? q : s) + R - (dispatch ? s : q)) % R);
            for (uint32_t k = 0; k < to.count; ++k)
              visit(op.kind, from, to.first + k, bytes);
          }
        }
  }
}

} // namespace

std::vector<uint64_t> expectedPutBytes(const format::TaskProgram &program,
                                       const rt::LayerPlan &plan,
                                       const std::vector<RankRoute> &routes, uint32_t rank) {
  std::vector<uint64_t> bytes(routes.size(), 0);
  forEachPut(program, plan, routes, [&](format::OpKind, uint32_t from, uint32_t to, uint64_t n) {
    if (to == rank)
      bytes[from] += n;
  });
  return bytes;
}

PutBytes groupPutBytes(const format::TaskProgram &program, const rt::LayerPlan &plan,
                       const std::vector<RankRoute> &routes) {
  PutBytes total;
  forEachPut(program, plan, routes, [&](format::OpKind kind, uint32_t from, uint32_t to, uint64_t n) {
    if (from != to)
      (kind == format::OpKind::Dispatch ? total.dispatch : total.combine) += n;
  });
  return total;
}

} // namespace moec::backend
