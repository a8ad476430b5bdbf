//===- Describe.cpp - how every view of a task program names its parts ----===//

#include "compiler/inspect/Describe.h"

#include <fmt/format.h>

#include <algorithm>

namespace moec::inspect {

using namespace moec::format;

std::string coreLabel(CoreKind kind, uint32_t index) {
  return fmt::format("{} core {}", coreKindName(kind), index);
}

std::string queueLabel(const QueueRecord &queue) {
  return coreLabel(queue.coreKind, queue.coreIndex);
}

std::vector<uint32_t> queueOrder(const TaskProgram &p) {
  std::vector<uint32_t> order(p.queues.size());
  for (uint32_t q = 0; q < order.size(); ++q)
    order[q] = q;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const QueueRecord &x = p.queues[a], &y = p.queues[b];
    if (x.coreKind != y.coreKind)
      return uint8_t(x.coreKind) < uint8_t(y.coreKind);
    return x.coreIndex < y.coreIndex;
  });
  return order;
}

std::vector<uint32_t> shownQueues(const TaskProgram &p, const DumpOptions &options) {
  std::vector<uint32_t> order = queueOrder(p);
  if (!options.core)
    return order;
  std::vector<uint32_t> shown;
  for (uint32_t q : order)
    if (p.queues[q].coreKind == options.core->kind && p.queues[q].coreIndex == options.core->index)
      shown.push_back(q);
  return shown;
}

std::string opCore(const TaskProgram &p, uint32_t index) {
  const OpRecord &op = p.ops[index];
  if (op.taskCount == 0) {
    // A lead product: its tiles are its host's (format::leadOp).
    const uint32_t host = leadHost(p, index);
    return host == kNone ? "-" : fmt::format("in {}", p.name(p.ops[host].name));
  }
  CoreKind kind = p.tasks[op.firstTask].coreKind;
  for (uint32_t t = op.firstTask; t < op.firstTask + op.taskCount; ++t)
    if (p.tasks[t].coreKind != kind)
      return "mixed";
  return coreKindName(kind);
}

std::string dimsText(const SlotRecord &slot) {
  std::string out = "[";
  for (unsigned d = 0; d < slot.rank && d < kMaxTensorRank; ++d)
    out += fmt::format("{}{}", d ? ", " : "", slot.dims[d]);
  return out + "]";
}

std::vector<std::string> tilingFlagNames(const TilingRecord &t) {
  std::vector<std::string> names;
  if (t.flags & kTilingTransposeA)
    names.push_back("transpose_a");
  if (t.flags & kTilingTransposeB)
    names.push_back("transpose_b");
  if (t.flags & kTilingAccumulate)
    names.push_back("accumulate");
  if (t.flags & kTilingScale)
    names.push_back(fmt::format("scale={}", t.scale));
  if (t.flags & kTilingShareRows)
    names.push_back("share_rows");
  if (t.flags & kTilingQuantizedB)
    names.push_back("quantized_b");
  if (t.lowRank())
    names.push_back(t.flags & kTilingLowRankTransposeB ? "low_rank,transpose_low_b" : "low_rank");
  return names;
}

std::string tilingFlagsText(const TilingRecord &t) {
  const std::vector<std::string> names = tilingFlagNames(t);
  return names.empty() ? "-" : fmt::format("{}", fmt::join(names, ","));
}

std::vector<uint32_t> tilingInputs(const TilingRecord &tiling) {
  std::vector<uint32_t> inputs;
  for (unsigned k = 0; k < tiling.inputCount && k < kMaxTilingInputs; ++k)
    inputs.push_back(tiling.inputSlots[k]);
  if (tiling.lowRank())
    inputs.insert(inputs.end(), {tiling.lowRankSlots[0], tiling.lowRankSlots[1]});
  return inputs;
}

ResolvedTile resolvedTile(const TaskProgram &p, uint32_t task, std::optional<uint32_t> rank) {
  ResolvedTile tile;
  if (!rank) {
    const OpRecord &op = p.ops[p.tasks[task].op];
    tile.coord = tileCoord(p.tilings[op.tiling], task - op.firstTask);
    tile.expert = tile.coord.expert;
    tile.peer = tile.coord.peer;
    return tile;
  }
  RankTile resolved = rankTile(p, task, *rank);
  tile.coord = resolved.coord;
  tile.expert = resolved.expert;
  tile.peer = isPut(p.ops[p.tasks[task].op].kind) ? resolved.peerRank : resolved.coord.peer;
  return tile;
}

std::string tileText(const TaskProgram &p, uint32_t task, std::optional<uint32_t> rank) {
  ResolvedTile t = resolvedTile(p, task, rank);
  const TilingRecord &tiling = p.tilings[p.ops[p.tasks[task].op].tiling];
  // Shared-out rows depend on the routing: the tile's share, and its rows
  // when routing is balanced.
  if (tiling.flags & kTilingShareRows) {
    TileRows balanced = tileRows(tiling, t.coord, tiling.balancedRows);
    // A peer group's rows are those from the ranks its peer offsets behind.
    const bool group = hasPeerGroups(tiling);
    const std::string present =
        group ? fmt::format("from peer offsets {}..{}", tileBegin(t.coord.peer, p.epRanks, tiling.peers),
                            tileBegin(uint64_t(t.coord.peer) + 1, p.epRanks, tiling.peers) - 1)
              : "present";
    return fmt::format("tile(e{},{}{},r{},c{} rows: share {} of {} of those {}, "
                       "{}..{} when balanced; cols {}..{})",
                       t.expert, group ? "g" : "p", t.peer, t.coord.rowTile, t.coord.colTile,
                       t.coord.rowTile + 1, tiling.rowTiles, present, balanced.begin,
                       balanced.end, t.coord.colBegin, t.coord.colEnd);
  }
  return fmt::format("tile(e{},p{},r{},c{} rows {}..{} cols {}..{})", t.expert, t.peer,
                     t.coord.rowTile, t.coord.colTile, t.coord.rowBegin, t.coord.rowEnd,
                     t.coord.colBegin, t.coord.colEnd);
}

std::string waitsText(const TaskProgram &p, const TaskRecord &task) {
  std::string out = "[";
  for (uint32_t k = 0; k < task.waitCount; ++k) {
    const WaitRecord &wait = p.waits[size_t(task.firstWait) + k];
    out += fmt::format("{}ev{} {} >= {}", k ? ", " : "", wait.event,
                       p.name(p.events[wait.event].name), wait.threshold);
  }
  return out + "]";
}

std::string signalsText(const TaskProgram &p, const TaskRecord &task,
                        std::optional<uint32_t> rank) {
  std::string out = "[";
  for (uint32_t k = 0; k < task.signalCount; ++k) {
    const SignalRecord &signal = p.signals[size_t(task.firstSignal) + k];
    out += fmt::format("{}ev{} {} +{}", k ? ", " : "", signal.event,
                       p.name(p.events[signal.event].name), signal.increment);
    if (signal.peerOffset != 0)
      out += rank ? fmt::format(" → rank {}", p.peerRank(*rank, signal.peerOffset))
                  : fmt::format(" → +{}", signal.peerOffset);
  }
  return out + "]";
}

std::string amountText(const Analysis &a, double value) {
  if (a.timed)
    return formatSeconds(value);
  return fmt::format("{:.0f} {}", value, value == 1 ? "step" : "steps");
}

std::vector<double> queueBusy(const TaskProgram &p, const Analysis &a) {
  std::vector<double> busy(p.queues.size(), 0.0);
  for (size_t q = 0; q < p.queues.size(); ++q)
    for (uint32_t k = 0; k < p.queues[q].entryCount; ++k)
      busy[q] += a.costs[p.queueEntries[size_t(p.queues[q].firstEntry) + k]];
  return busy;
}

std::optional<Balance> balanceOf(const TaskProgram &p, const std::vector<double> &busy,
                                 CoreKind kind) {
  Balance b;
  double sum = 0;
  for (uint32_t q : queueOrder(p)) {
    if (p.queues[q].coreKind != kind)
      continue;
    if (b.queues == 0 || busy[q] < b.minBusy) {
      b.minBusy = busy[q];
      b.minQueue = q;
    }
    if (b.queues == 0 || busy[q] > b.maxBusy) {
      b.maxBusy = busy[q];
      b.maxQueue = q;
    }
    sum += busy[q];
    ++b.queues;
  }
  if (b.queues == 0)
    return std::nullopt;
  b.mean = sum / double(b.queues);
  b.ratio = b.mean > 0 ? b.maxBusy / b.mean : 1.0;
  return b;
}

std::pair<uint64_t, uint64_t> taskCounts(const TaskProgram &p) {
  uint64_t cube = 0, vector = 0;
  for (const TaskRecord &task : p.tasks)
    (task.coreKind == CoreKind::Cube ? cube : vector) += 1;
  return {cube, vector};
}

std::string computesText(const TaskProgram &p) {
  if (p.ops.size() == 1 && !p.isBackward() && isPut(p.ops[0].kind))
    return p.ops[0].kind == OpKind::Dispatch ? "the dispatch alone" : "the combine alone";
  // LoRA adapters: a GMM that adds its product to an addend (the base
  // projection's), from rank-r rows.
  std::string lora;
  int adapters = 0;
  for (const format::OpRecord &op : p.ops) {
    const format::TilingRecord &t = p.tilings[op.tiling];
    // (or, fused into the base's, its low-rank product: U's columns)
    const bool fused = t.lowRank();
    if (op.kind == OpKind::Gmm && t.depth != 0 && (fused || hasAddend(t))) {
      ++adapters;
      lora = fmt::format(" with LoRA adapters on {} projection{} (rank {}{})", adapters,
                         adapters == 1 ? "" : "s", fused ? lowRankDepth(p, t) : t.depth,
                         fused ? ", fused into the base GMMs" : "");
    }
  }
  for (const format::OpRecord &op : p.ops) {
    const TilingRecord &t = p.tilings[op.tiling];
    if (!(t.flags & kTilingQuantizedB))
      continue;
    const format::SlotRecord &w = p.slots[t.inputSlots[1]], &s = p.slots[t.inputSlots[3]];
    if (w.dtype == DType::F8E4M3)
      lora += " (frozen FP8 weights, fp32 scales per 128 x 128 block)";
    else if (w.dtype == DType::I8)
      lora += " (frozen int8 weights, an fp32 scale per row)";
    else
      lora += fmt::format(" (frozen int4 weights, fp32 scales{} per group of {})",
                          s.rank == 4 ? " and zero points" : "",
                          s.rank >= 3 && s.dims[2] ? w.dims[2] / s.dims[2] : 0);
    break;
  }
  if (!p.isBackward())
    return "the layer's forward pass" + lora;
  std::vector<std::string> wgrad;
  bool accumulate = false;
  DType dtype = DType::F32;
  for (const format::OpRecord &op : p.ops) {
    const format::TilingRecord &t = p.tilings[op.tiling];
    if (op.kind != OpKind::Gmm || t.depth != 0)
      continue;
    wgrad.push_back(std::string(p.name(op.name)));
    accumulate = accumulate || (t.flags & format::kTilingAccumulate);
    dtype = p.slots[t.outputSlot].dtype;
  }
  if (wgrad.empty())
    return "the layer's backward pass without weight gradients (frozen weights)" + lora;
  return fmt::format("the layer's backward pass{}; {}gradients ({}) {} {}", lora,
                     lora.empty() ? "weight " : "adapter ", fmt::join(wgrad, ", "),
                     accumulate ? "accumulated into caller buffers of" : "written as",
                     dtypeName(dtype)) +
         (accumulate ? " (main_grad)" : "");
}

} // namespace moec::inspect
