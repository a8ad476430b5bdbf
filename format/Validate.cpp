//===- Validate.cpp - What a task program's content must hold -------------===//
//
// validateTaskProgram: every index in range, every enum and flag known,
// reserved bytes zero, the layer record consistent, grids that fit their
// ops, queues that hold every task once, thresholds that match their
// signals. The reader runs it on every file; the compiler before writing.
//
//===----------------------------------------------------------------------===//

#include "format/TaskBinary.h"

#include "base/Text.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace moec::format {

//===----------------------------------------------------------------------===//
// Validation of the content
//===----------------------------------------------------------------------===//

namespace {

constexpr float kZeroFloat = 0.0f;

/// Computes the number of tiles of the grid of `tiling` into *tiles; returns
/// false when it does not fit in 64 bits (where tileCount() wraps).
bool gridTiles(const TilingRecord &tiling, uint64_t *tiles) {
  uint64_t n = tiling.experts;
  if (__builtin_mul_overflow(n, uint64_t(tiling.peers), &n) ||
      __builtin_mul_overflow(n, uint64_t(tiling.rowTiles), &n) ||
      __builtin_mul_overflow(n, uint64_t(tiling.colTiles), &n))
    return false;
  *tiles = n;
  return true;
}

/// Returns true when all `size` bytes at `bytes` are zero.
bool allZero(const void *bytes, size_t size) {
  const uint8_t *p = static_cast<const uint8_t *>(bytes);
  return std::all_of(p, p + size, [](uint8_t byte) { return byte == 0; });
}

bool validDType(DType dtype) { return uint8_t(dtype) >= 1 && uint8_t(dtype) <= 7; }
bool validOpKind(OpKind kind) { return uint8_t(kind) >= 1 && uint8_t(kind) <= 7; }
bool validCoreKind(CoreKind kind) { return uint8_t(kind) >= 1 && uint8_t(kind) <= 2; }
bool validEventKind(EventKind kind) { return uint8_t(kind) >= 1 && uint8_t(kind) <= 3; }

/// Checks the content of a program; one instance per validation.
class Validator {
public:
  explicit Validator(const TaskProgram &program) : p(program) {
    size_t nul = p.strings.rfind('\0');
    lastNul = nul == std::string::npos ? -1 : int64_t(nul);
  }

  Status run() {
    Status status;
    // Tilings before ops: an op's checks read its tiling's kind and grid.
    if (!(status = checkCounts()) || !(status = checkHeader()) || !(status = checkLayer()) ||
        !(status = checkSlots()) ||
        !(status = checkTilings()) || !(status = checkOps()) || !(status = checkEvents()) ||
        !(status = checkTasks()) || !(status = checkWaitsAndSignals()) ||
        !(status = checkQueues()) || !(status = checkThresholds()))
      return status;
    return Status::success();
  }

private:
  /// Checks a name offset and its name: UTF-8 text, and no control
  /// characters but in `text` (the notes, which run over lines). `what`
  /// names the record ("slot 3").
  Status checkName(const std::string &what, uint32_t offset, bool text = false) const {
    if (offset >= p.strings.size())
      return Status::error(
          fmt::format("{}: name offset {} is past the end of the {}-byte string table", what,
                      offset, p.strings.size()));
    if (int64_t(offset) > lastNul)
      return Status::error(
          fmt::format("{}: the name at offset {} is not NUL-terminated", what, offset));
    // Dumps print names, and their JSON holds UTF-8 text only.
    const std::string_view name = p.name(offset);
    if (size_t bad = firstNonUtf8(name); bad != std::string_view::npos)
      return Status::error(
          fmt::format("{}: the name at offset {} is not UTF-8 text (byte {:#04x} at its offset {})",
                      what, offset, static_cast<unsigned char>(name[bad]), bad));
    if (size_t bad = firstControlCharacter(name); !text && bad != std::string_view::npos)
      return Status::error(
          fmt::format("{}: the name at offset {} holds control character U+{:04X} at its offset {}",
                      what, offset, unsigned(static_cast<unsigned char>(name[bad])), bad));
    return Status::success();
  }

  /// Returns "kind index 'name'", or "kind index" for an empty name.
  std::string label(const char *kind, size_t index, uint32_t nameOffset) const {
    std::string_view name = p.name(nameOffset);
    if (name.empty())
      return fmt::format("{} {}", kind, index);
    return fmt::format("{} {} '{}'", kind, index, name);
  }

  std::string opLabel(uint32_t op) const { return label("op", op, p.ops[op].name); }
  std::string eventLabel(uint32_t event) const {
    return label("event", event, p.events[event].name);
  }
  std::string queueLabel(size_t index) const {
    const QueueRecord &queue = p.queues[index];
    return fmt::format("queue {} ({} core {})", index, coreKindName(queue.coreKind),
                       queue.coreIndex);
  }

  /// Checks that range [first, first + count) lies within `total` records of
  /// `section`.
  static Status checkRange(const std::string &what, const char *rangeName, uint32_t first,
                           uint32_t count, size_t total, const char *section) {
    if (uint64_t(first) + count > total)
      return Status::error(fmt::format("{}: {} [{}, {}) run past the {} {} of the binary", what,
                                       rangeName, first, uint64_t(first) + count, total, section));
    return Status::success();
  }

  Status checkCounts() const {
    struct Count {
      const char *section;
      size_t count;
    } counts[] = {{"strings", p.strings.size()}, {"slots", p.slots.size()},
                  {"ops", p.ops.size()},         {"tilings", p.tilings.size()},
                  {"events", p.events.size()},   {"tasks", p.tasks.size()},
                  {"waits", p.waits.size()},     {"signals", p.signals.size()},
                  {"queues", p.queues.size()},   {"queue entries", p.queueEntries.size()}};
    for (const Count &count : counts)
      if (count.count > kMaxRecords)
        return Status::error(fmt::format(
            "section '{}' has {} records; indices are 32-bit, so a section holds at most {}",
            count.section, count.count, kMaxRecords));
    return Status::success();
  }

  Status checkHeader() const {
    if (p.flags & ~uint32_t(kKnownFileFlags))
      return Status::error(
          fmt::format("header: unknown flag bits {:#x}", p.flags & ~uint32_t(kKnownFileFlags)));
    if (p.epRanks == 0)
      return Status::error("header: the EP group has 0 ranks");
    if (p.tpRanks == 0)
      return Status::error("header: each EP rank has 0 TP ranks");
    if (uint64_t(p.epRanks) * p.tpRanks > std::numeric_limits<uint32_t>::max())
      return Status::error(fmt::format("header: {} EP x {} TP ranks; at most {} ranks in all",
                                       p.epRanks, p.tpRanks,
                                       std::numeric_limits<uint32_t>::max()));
    if (Status status = checkName("header: target", p.target); !status)
      return status;
    if (p.flags & kFlagNotes) {
      if (Status status = checkName("header: notes", p.notes, true); !status)
        return status;
    } else if (p.notes != 0) {
      return Status::error("header: notes are named without the notes flag");
    }
    return Status::success();
  }

  /// The layer record agrees with itself and the header: sizes positive, E
  /// = P * L, I a multiple of T, the capacities those of format/Capacity.h.
  Status checkLayer() const {
    if (!p.layer)
      return Status::success();
    const LayerRecord &l = *p.layer;
    auto bad = [](std::string what) { return Status::error("the layer record: " + what); };
    if (l.flags & ~uint32_t(kKnownLayerFlags))
      return bad(fmt::format("unknown flag bits {:#x}", l.flags & ~uint32_t(kKnownLayerFlags)));
    for (uint8_t byte : l.reserved)
      if (byte != 0)
        return bad("reserved bytes are not zero");
    const std::pair<const char *, int64_t> sizes[] = {{"hidden", l.hidden},
                                                      {"intermediate", l.intermediate},
                                                      {"seq_size", l.seqSize},
                                                      {"top_k", l.topK},
                                                      {"experts", l.experts}};
    for (const auto &[name, value] : sizes)
      if (value <= 0)
        return bad(fmt::format("{} is {}; it must be positive", name, value));
    // The config's limits (format/Capacity.h), which keep the runtime's
    // products of sizes inside 64 bits.
    const std::tuple<const char *, int64_t, int64_t> limits[] = {
        {"hidden", l.hidden, kMaxModelWidth},      {"intermediate", l.intermediate, kMaxModelWidth},
        {"seq_size", l.seqSize, kMaxSeqSize},      {"top_k", l.topK, kMaxCount},
        {"experts", l.experts, kMaxCount},         {"lora rank", l.loraRank, kMaxCount},
        {"weight group", l.weightGroup, kMaxCount}};
    for (const auto &[name, value, most] : limits)
      if (value > most)
        return bad(fmt::format("{} is {}; at most {} is supported", name, value, most));
    if (uint64_t(l.experts) != uint64_t(p.epRanks) * p.localExperts)
      return bad(fmt::format("{} experts, but the header has {} EP ranks of {} experts",
                             l.experts, p.epRanks, p.localExperts));
    if (l.topK > l.experts)
      return bad(fmt::format("top_k {} is more than the {} experts", l.topK, l.experts));
    if (l.intermediate % p.tpRanks != 0)
      return bad(fmt::format("intermediate size {} is not a multiple of the {} TP ranks",
                             l.intermediate, p.tpRanks));
    if (!(l.capacityFactor >= kMinCapacityFactor && l.capacityFactor <= kMaxCapacityFactor))
      return bad(fmt::format("capacity factor {} is not between {} and {}", l.capacityFactor,
                             kMinCapacityFactor, kMaxCapacityFactor));
    if (!(l.loraAlpha >= 0 && std::isfinite(l.loraAlpha)) || (l.loraAlpha > 0 && l.loraRank == 0))
      return bad(fmt::format("LoRA alpha {} with rank {}", l.loraAlpha, l.loraRank));
    if (l.dtype != DType::F32 && l.dtype != DType::BF16)
      return bad(fmt::format("activations of dtype {}; f32 or bf16", unsigned(l.dtype)));
    if (l.dispatchDtype != l.dtype && l.dispatchDtype != DType::F8E4M3)
      return bad(fmt::format("dispatched rows of dtype {}; the activations' ({}) or f8e4m3",
                             unsigned(l.dispatchDtype), dtypeName(l.dtype)));
    const CapacityInputs c = capacityInputs(l, p.epRanks, p.localExperts);
    if (l.rowCapacity != rowCapacityRows(c))
      return bad(fmt::format("row capacity {}, but seq_size x top_k is {}", l.rowCapacity,
                             rowCapacityRows(c)));
    if (l.receiveCapacity != receiveCapacityRows(c))
      return bad(fmt::format("receive capacity {}, but capacity factor {} gives {}",
                             l.receiveCapacity, l.capacityFactor, receiveCapacityRows(c)));
    return Status::success();
  }

  Status checkSlots() const {
    std::vector<std::pair<uint32_t, uint32_t>> params; // (param, slot)
    params.reserve(p.slots.size());
    for (size_t i = 0; i < p.slots.size(); ++i) {
      const SlotRecord &slot = p.slots[i];
      if (Status status = checkName(fmt::format("slot {}", i), slot.name); !status)
        return status;
      std::string what = label("slot", i, slot.name);
      if (!validDType(slot.dtype))
        return Status::error(
            fmt::format("{}: dtype {} is not one of f32 (1), bf16 (2), i32 (3), i64 (4), f8e4m3 (5), i8 (6), i4 (7)", what,
                        unsigned(slot.dtype)));
      if (slot.flags & ~unsigned(kKnownSlotFlags))
        return Status::error(fmt::format("{}: unknown flag bits {:#x}", what,
                                         slot.flags & ~unsigned(kKnownSlotFlags)));
      if (slot.rank > kMaxTensorRank)
        return Status::error(
            fmt::format("{}: rank {} is above {}", what, unsigned(slot.rank), kMaxTensorRank));
      for (unsigned d = slot.rank; d < kMaxTensorRank; ++d)
        if (slot.dims[d] != 0)
          return Status::error(
              fmt::format("{}: dim {} is {}, but the rank is {} (dims past the rank must be 0)",
                          what, d, slot.dims[d], unsigned(slot.rank)));
      bool dynamic = slot.flags & kSlotDynamic;
      if (dynamic && slot.rank == 0)
        return Status::error(fmt::format("{}: a dynamic tensor needs a rank of at least 1", what));
      if (!dynamic && slot.capacityRows != 0)
        return Status::error(fmt::format("{}: capacity rows {} on a tensor that is not dynamic",
                                         what, slot.capacityRows));
      if (slot.reserved0 != 0 || slot.reserved1 != 0)
        return Status::error(fmt::format("{}: reserved bytes are not zero", what));
      params.emplace_back(slot.param, uint32_t(i));
    }
    std::sort(params.begin(), params.end());
    for (size_t i = 1; i < params.size(); ++i)
      if (params[i].first == params[i - 1].first)
        return Status::error(fmt::format(
            "{}: parameter position {} is also that of {}",
            label("slot", params[i].second, p.slots[params[i].second].name), params[i].first,
            label("slot", params[i - 1].second, p.slots[params[i - 1].second].name)));
    return Status::success();
  }

  Status checkOps() const {
    for (size_t i = 0; i < p.ops.size(); ++i) {
      const OpRecord &op = p.ops[i];
      if (Status status = checkName(fmt::format("op {}", i), op.name); !status)
        return status;
      std::string what = label("op", i, op.name);
      if (!validOpKind(op.kind))
        return Status::error(
            fmt::format("{}: kind {} is not an op kind (1..7)", what, unsigned(op.kind)));
      if (!allZero(op.reserved, sizeof(op.reserved)) || op.reserved2 != 0)
        return Status::error(fmt::format("{}: reserved bytes are not zero", what));
      if (Status status =
              checkRange(what, "tasks", op.firstTask, op.taskCount, p.tasks.size(), "tasks");
          !status)
        return status;
      if (op.tiling >= p.tilings.size())
        return Status::error(fmt::format("{}: names tiling {}, but the binary has {} tilings",
                                         what, op.tiling, p.tilings.size()));
      const TilingRecord &tiling = p.tilings[op.tiling];
      if (tiling.opKind != op.kind)
        return Status::error(fmt::format("{}: tiling {} is for a {} op, but the op is a {} op",
                                         what, op.tiling, opKindName(tiling.opKind),
                                         opKindName(op.kind)));
      if (op.taskCount == 0 && tiling.tileCount() > 0) {
        if (Status status = checkLead(i, what); !status)
          return status;
        continue;
      }
      if (tiling.tileCount() != op.taskCount)
        return Status::error(fmt::format(
            "{}: has {} tasks, but its tiling {} is a grid of {} tiles ({} x {} x {} x {})", what,
            op.taskCount, op.tiling, tiling.tileCount(), tiling.experts, tiling.peers,
            tiling.rowTiles, tiling.colTiles));
      for (uint64_t t = op.firstTask; t < uint64_t(op.firstTask) + op.taskCount; ++t)
        if (p.tasks[t].op != i)
          return Status::error(
              fmt::format("{}: its task range [{}, {}) holds task {}, which names op {}", what,
                          op.firstTask, uint64_t(op.firstTask) + op.taskCount, t, p.tasks[t].op));
    }
    return Status::success();
  }

  /// An op with no tasks: a lead product (leadOp), computed by the tasks
  /// of the one GMM whose low-rank U it writes: an activation GMM of that
  /// GMM's A, group list, dtype, depth and row grid (rows shared out
  /// alike; one column tile), with no addend, quantized B or low-rank
  /// product of its own, as wide as U.
  Status checkLead(uint32_t i, const std::string &what) const {
    const TilingRecord &lead = p.tilings[p.ops[i].tiling];
    uint32_t host = kNone;
    for (uint32_t h = 0; h < p.ops.size(); ++h) {
      if (h == i || p.ops[h].tiling >= p.tilings.size())
        continue;
      const TilingRecord &t = p.tilings[p.ops[h].tiling];
      if (t.lowRank() && t.lowRankSlots[0] == lead.outputSlot && p.ops[h].taskCount > 0) {
        if (host != kNone)
          return Status::error(fmt::format(
              "{}: has no tasks, and two ops ({} and {}) read its output as their low-rank U; "
              "a lead product has one host",
              what, label("op", host, p.ops[host].name), label("op", h, p.ops[h].name)));
        host = h;
      }
    }
    if (host == kNone)
      return Status::error(fmt::format(
          "{}: has 0 tasks, but its tiling {} is a grid of {} tiles ({} x {} x {} x {}); only a "
          "lead product, computed in the tiles of a GMM that reads its output as its low-rank "
          "U, has none, and no GMM with tasks reads this op's so",
          what, p.ops[i].tiling, lead.tileCount(), lead.experts, lead.peers, lead.rowTiles,
          lead.colTiles));
    const TilingRecord &t = p.tilings[p.ops[host].tiling];
    const uint32_t shareRows = kTilingShareRows;
    const bool paired =
        lead.opKind == OpKind::Gmm && lead.depth > 0 && lead.depth == t.depth &&
        lead.dtype == t.dtype && lead.inputCount == 3 && !lead.lowRank() &&
        !(lead.flags & (kTilingQuantizedB | kTilingTransposeA | kTilingAccumulate)) &&
        lead.inputSlots[0] == t.inputSlots[0] && lead.inputSlots[2] == t.inputSlots[2] &&
        lead.experts == t.experts && lead.peers == t.peers && lead.rowTiles == t.rowTiles &&
        lead.rows == t.rows && lead.colTiles == 1 &&
        (lead.flags & shareRows) == (t.flags & shareRows) && lead.outputSlot < p.slots.size() &&
        lead.cols == p.slots[lead.outputSlot].dims[1];
    if (!paired)
      return Status::error(fmt::format(
          "{}: has no tasks, so it is the lead product of {}, whose tiles compute it; it must be "
          "an activation GMM of that op's A, group list, dtype, depth and row tiles, of one "
          "column tile, with no addend, quantized weight or low-rank product, as wide as the U it "
          "writes",
          what, label("op", host, p.ops[host].name)));
    return Status::success();
  }

  Status checkSlotIndex(const std::string &what, const std::string &role, uint32_t slot) const {
    if (slot >= p.slots.size())
      return Status::error(fmt::format("{}: {} names slot {}, but the binary has {} slots", what,
                                       role, slot, p.slots.size()));
    return Status::success();
  }

  Status checkTilings() const {
    for (size_t i = 0; i < p.tilings.size(); ++i) {
      const TilingRecord &tiling = p.tilings[i];
      std::string what = fmt::format("tiling {}", i);
      if (!validOpKind(tiling.opKind))
        return Status::error(
            fmt::format("{}: op kind {} is not an op kind (1..7)", what, unsigned(tiling.opKind)));
      if (!validDType(tiling.dtype))
        return Status::error(
            fmt::format("{}: dtype {} is not one of f32 (1), bf16 (2), i32 (3), i64 (4), f8e4m3 (5), i8 (6), i4 (7)", what,
                        unsigned(tiling.dtype)));
      if (tiling.flags & ~unsigned(kKnownTilingFlags))
        return Status::error(fmt::format("{}: unknown flag bits {:#x}", what,
                                         tiling.flags & ~unsigned(kKnownTilingFlags)));
      if (tiling.inputCount > kMaxTilingInputs)
        return Status::error(fmt::format("{}: input count {} is above {}", what,
                                         unsigned(tiling.inputCount), kMaxTilingInputs));
      for (unsigned k = 0; k < kMaxTilingInputs; ++k) {
        if (k < tiling.inputCount) {
          if (Status status =
                  checkSlotIndex(what, fmt::format("input {}", k), tiling.inputSlots[k]);
              !status)
            return status;
        } else if (tiling.inputSlots[k] != kNone) {
          return Status::error(fmt::format(
              "{}: input {} is past the input count {} but names slot {} (unused inputs are {:#x})",
              what, k, unsigned(tiling.inputCount), tiling.inputSlots[k], kNone));
        }
      }
      if (Status status = checkSlotIndex(what, "output", tiling.outputSlot); !status)
        return status;
      if (tiling.experts != 1 && tiling.experts != p.localExperts)
        return Status::error(
            fmt::format("{}: a grid of {} experts; it must be 1 or the {} local experts", what,
                        tiling.experts, p.localExperts));
      if (isPut(tiling.opKind) ? tiling.peers != 1 && tiling.peers != p.epRanks
                               : tiling.peers == 0 || tiling.peers > p.epRanks)
        return Status::error(fmt::format(
            "{}: a grid of {} peers; it must be 1 or the {} EP ranks{}", what, tiling.peers,
            p.epRanks, isPut(tiling.opKind) ? "" : " (or peer groups, at most as many)"));
      if ((tiling.flags & kTilingReduceTp) && tiling.opKind != OpKind::Combine)
        return Status::error(fmt::format("{}: a {} reduces over TP; only a combine can", what,
                                         opKindName(tiling.opKind)));
      if ((tiling.flags & kTilingQuantizedB) &&
          (tiling.opKind != OpKind::Gmm || tiling.depth == 0 || tiling.inputCount != 4))
        return Status::error(fmt::format(
            "{}: quantized weights need an activation GMM with their scales as input 3", what));
      if ((tiling.flags & kTilingShareRows) && tiling.opKind == OpKind::Gmm && tiling.depth == 0)
        return Status::error(
            fmt::format("{}: a weight-gradient GMM tiles its result; it shares out no rows", what));
      if (tiling.rowTiles == 0 || tiling.colTiles == 0)
        return Status::error(fmt::format("{}: a grid of {} x {} tiles is empty", what,
                                         tiling.rowTiles, tiling.colTiles));
      if (tiling.rows < tiling.rowTiles || tiling.cols < tiling.colTiles)
        return Status::error(fmt::format(
            "{}: {} row tiles of {} rows and {} column tiles of {} columns leave a tile empty",
            what, tiling.rowTiles, tiling.rows, tiling.colTiles, tiling.cols));
      // tileBegin() computes i * rows / rowTiles for i <= rowTiles.
      uint64_t bound = 0;
      if (__builtin_mul_overflow(tiling.rows, uint64_t(tiling.rowTiles), &bound) ||
          __builtin_mul_overflow(tiling.cols, uint64_t(tiling.colTiles), &bound))
        return Status::error(fmt::format(
            "{}: {} row tiles of {} rows and {} column tiles of {} columns overflow the 64-bit "
            "tile bounds",
            what, tiling.rowTiles, tiling.rows, tiling.colTiles, tiling.cols));
      uint64_t tiles = 0;
      if (!gridTiles(tiling, &tiles))
        return Status::error(fmt::format(
            "{}: a grid of {} x {} x {} x {} tiles is above the {} a binary holds", what,
            tiling.experts, tiling.peers, tiling.rowTiles, tiling.colTiles, kMaxRecords));
      if (tiles > kMaxRecords)
        return Status::error(fmt::format("{}: a grid of {} tiles is above the {} a binary holds",
                                         what, tiles, kMaxRecords));
      if (hasPeerGroups(tiling) &&
          (!(tiling.flags & kTilingShareRows) || tiling.experts != p.localExperts))
        return Status::error(fmt::format(
            "{}: {} peer groups of a {} need per-expert tiles that share out their rows", what,
            tiling.peers, opKindName(tiling.opKind)));
      if (tiling.flags & kTilingScale) {
        if (!std::isfinite(tiling.scale) || tiling.scale == 0)
          return Status::error(
              fmt::format("{}: scale {} is not a finite nonzero number", what, tiling.scale));
      } else if (std::memcmp(&tiling.scale, &kZeroFloat, sizeof(float)) != 0) {
        return Status::error(fmt::format("{}: scale is set without the scale flag", what));
      }
      if (Status status = checkLowRank(tiling, what); !status)
        return status;
    }
    return Status::success();
  }

  /// A GMM's second, low-rank product (TilingRecord::lowRankSlots): both
  /// slots or neither; an activation GMM with no addend, scale or
  /// accumulation; U [M, r] and V [G, r, N] (or [G, N, r]) of A's dtype.
  Status checkLowRank(const TilingRecord &tiling, const std::string &what) const {
    const uint32_t u = tiling.lowRankSlots[0], v = tiling.lowRankSlots[1];
    if (u == kNone && v == kNone) {
      if (tiling.flags & kTilingLowRankTransposeB)
        return Status::error(fmt::format(
            "{}: flag bit 7 (low-rank V transposed) is set without a low-rank product", what));
      return Status::success();
    }
    if (u == kNone || v == kNone)
      return Status::error(
          fmt::format("{}: a low-rank product names {} but not {} (both slots, or kNone for both)",
                      what, u == kNone ? "V" : "U", u == kNone ? "U" : "V"));
    if (Status status = checkSlotIndex(what, "low-rank U", u); !status)
      return status;
    if (Status status = checkSlotIndex(what, "low-rank V", v); !status)
      return status;
    const bool quantized = tiling.flags & kTilingQuantizedB;
    if (tiling.opKind != OpKind::Gmm || tiling.depth == 0 ||
        (tiling.flags & (kTilingScale | kTilingAccumulate | kTilingTransposeA)) ||
        tiling.inputCount < 2 || (quantized ? tiling.inputCount != 4 : tiling.inputCount > 3))
      return Status::error(fmt::format(
          "{}: a low-rank product needs an activation GMM without an addend, a scale or "
          "accumulation",
          what));
    const SlotRecord &us = p.slots[u], &vs = p.slots[v], &as = p.slots[tiling.inputSlots[0]];
    if (us.dtype != as.dtype || vs.dtype != as.dtype)
      return Status::error(fmt::format("{}: the low-rank U ({}) and V ({}) must have A's dtype {}",
                                       what, dtypeName(us.dtype), dtypeName(vs.dtype),
                                       dtypeName(as.dtype)));
    const bool transposed = tiling.flags & kTilingLowRankTransposeB;
    const uint64_t r = us.rank == 2 ? us.dims[1] : 0;
    const uint64_t vr = transposed ? vs.dims[2] : vs.dims[1],
                   vn = transposed ? vs.dims[1] : vs.dims[2];
    if (us.rank != 2 || r == 0 || us.dims[0] != as.dims[0] || vs.rank != 3 ||
        vs.dims[0] != tiling.experts || vr != r || vn != tiling.cols)
      return Status::error(fmt::format(
          "{}: the low-rank U must be [{}, r] (A's rows) and V [{}, {}] (r = U's columns, N = {}, "
          "the GMM's columns): U is [{}], V [{}]",
          what, as.dims[0], tiling.experts, transposed ? "N, r" : "r, N", tiling.cols,
          fmt::join(us.dims, us.dims + std::min<uint32_t>(us.rank, kMaxTensorRank), ", "),
          fmt::join(vs.dims, vs.dims + std::min<uint32_t>(vs.rank, kMaxTensorRank), ", ")));
    return Status::success();
  }

  Status checkEvents() const {
    for (size_t i = 0; i < p.events.size(); ++i) {
      const EventRecord &event = p.events[i];
      if (Status status = checkName(fmt::format("event {}", i), event.name); !status)
        return status;
      std::string what = label("event", i, event.name);
      if (!validEventKind(event.kind))
        return Status::error(
            fmt::format("{}: kind {} is not local (1), cross-rank (2) or terminate (3)", what,
                        unsigned(event.kind)));
      if (!allZero(event.reserved, sizeof(event.reserved)))
        return Status::error(fmt::format("{}: reserved bytes are not zero", what));
      if (event.op != kNone && event.op >= p.ops.size())
        return Status::error(fmt::format("{}: names op {}, but the binary has {} ops", what,
                                         event.op, p.ops.size()));
    }
    return Status::success();
  }

  /// Checks one wait; `what` says where it is ("task 17: wait 2").
  Status checkWait(const std::string &what, const WaitRecord &wait) const {
    if (wait.event >= p.events.size())
      return Status::error(fmt::format("{} names event {}, but the binary has {} events", what,
                                       wait.event, p.events.size()));
    const EventRecord &event = p.events[wait.event];
    if (wait.threshold > event.threshold)
      return Status::error(fmt::format("{} waits for {} to reach {}, but its final value is {}",
                                       what, eventLabel(wait.event), wait.threshold,
                                       event.threshold));
    return Status::success();
  }

  /// Checks one signal; `what` says where it is ("task 17: signal 0").
  Status checkSignal(const std::string &what, const SignalRecord &signal) const {
    if (signal.event >= p.events.size())
      return Status::error(fmt::format("{} names event {}, but the binary has {} events", what,
                                       signal.event, p.events.size()));
    if (signal.peerOffset >= p.epRanks)
      return Status::error(fmt::format("{} goes to peer offset {}, but the EP group has {} ranks",
                                       what, signal.peerOffset, p.epRanks));
    if (signal.peerOffset != 0 && p.events[signal.event].kind == EventKind::Local)
      return Status::error(fmt::format(
          "{} goes to peer offset {}, but {} is a {} event, not cross-rank or terminate", what,
          signal.peerOffset, eventLabel(signal.event), eventKindName(p.events[signal.event].kind)));
    if (signal.reserved != 0)
      return Status::error(fmt::format("{}: reserved bytes are not zero", what));
    return Status::success();
  }

  Status checkTasks() const {
    for (size_t i = 0; i < p.tasks.size(); ++i) {
      const TaskRecord &task = p.tasks[i];
      std::string what = fmt::format("task {}", i);
      if (task.op >= p.ops.size())
        return Status::error(
            fmt::format("{}: names op {}, but the binary has {} ops", what, task.op, p.ops.size()));
      if (!validCoreKind(task.coreKind))
        return Status::error(fmt::format("{}: core kind {} is not cube (1) or vector (2)", what,
                                         unsigned(task.coreKind)));
      if (!allZero(task.reserved, sizeof(task.reserved)))
        return Status::error(fmt::format("{}: reserved bytes are not zero", what));
      if (Status status =
              checkRange(what, "waits", task.firstWait, task.waitCount, p.waits.size(), "waits");
          !status)
        return status;
      if (Status status = checkRange(what, "signals", task.firstSignal, task.signalCount,
                                     p.signals.size(), "signals");
          !status)
        return status;
      for (uint32_t k = 0; k < task.waitCount; ++k)
        if (Status status =
                checkWait(fmt::format("{}: wait {}", what, k), p.waits[size_t(task.firstWait) + k]);
            !status)
          return status;
      for (uint32_t k = 0; k < task.signalCount; ++k)
        if (Status status = checkSignal(fmt::format("{}: signal {}", what, k),
                                        p.signals[size_t(task.firstSignal) + k]);
            !status)
          return status;
    }
    return Status::success();
  }

  /// Checks the waits and signals no task refers to as well.
  Status checkWaitsAndSignals() const {
    for (size_t i = 0; i < p.waits.size(); ++i)
      if (Status status = checkWait(fmt::format("wait {}", i), p.waits[i]); !status)
        return status;
    for (size_t i = 0; i < p.signals.size(); ++i)
      if (Status status = checkSignal(fmt::format("signal {}", i), p.signals[i]); !status)
        return status;
    return Status::success();
  }

  Status checkQueues() const {
    std::vector<std::pair<uint64_t, uint32_t>> cores; // (kind << 32 | index, queue)
    cores.reserve(p.queues.size());
    for (size_t i = 0; i < p.queues.size(); ++i) {
      const QueueRecord &queue = p.queues[i];
      if (!validCoreKind(queue.coreKind))
        return Status::error(fmt::format("queue {}: core kind {} is not cube (1) or vector (2)", i,
                                         unsigned(queue.coreKind)));
      std::string what = queueLabel(i);
      if (!allZero(queue.reserved, sizeof(queue.reserved)))
        return Status::error(fmt::format("{}: reserved bytes are not zero", what));
      if (Status status = checkRange(what, "entries", queue.firstEntry, queue.entryCount,
                                     p.queueEntries.size(), "queue entries");
          !status)
        return status;
      cores.emplace_back(uint64_t(uint8_t(queue.coreKind)) << 32 | queue.coreIndex, uint32_t(i));
    }
    std::sort(cores.begin(), cores.end());
    for (size_t i = 1; i < cores.size(); ++i)
      if (cores[i].first == cores[i - 1].first)
        return Status::error(fmt::format("{}: the same core as queue {}",
                                         queueLabel(cores[i].second), cores[i - 1].second));

    constexpr uint32_t kNoQueue = kNone;
    std::vector<uint32_t> queueOfTask(p.tasks.size(), kNoQueue);
    for (size_t i = 0; i < p.queues.size(); ++i) {
      const QueueRecord &queue = p.queues[i];
      for (uint32_t k = 0; k < queue.entryCount; ++k) {
        uint32_t task = p.queueEntries[size_t(queue.firstEntry) + k];
        if (task >= p.tasks.size())
          return Status::error(
              fmt::format("{}: entry {} names task {}, but the binary has {} tasks", queueLabel(i),
                          k, task, p.tasks.size()));
        if (p.tasks[task].coreKind != queue.coreKind)
          return Status::error(fmt::format("{}: entry {} is task {}, a {} task", queueLabel(i), k,
                                           task, coreKindName(p.tasks[task].coreKind)));
        if (queueOfTask[task] != kNoQueue)
          return Status::error(fmt::format("task {} is in {} and again in {}", task,
                                           queueLabel(queueOfTask[task]), queueLabel(i)));
        queueOfTask[task] = uint32_t(i);
      }
    }
    for (size_t t = 0; t < p.tasks.size(); ++t)
      if (queueOfTask[t] == kNoQueue)
        return Status::error(fmt::format("task {} is in no queue", t));
    for (size_t i = 0; i < p.queueEntries.size(); ++i)
      if (p.queueEntries[i] >= p.tasks.size())
        return Status::error(
            fmt::format("queue entry {} names task {}, but the binary has {} tasks", i,
                        p.queueEntries[i], p.tasks.size()));
    return Status::success();
  }

  /// A rank's event gets each signal of every task once per rank it
  /// reaches from the EP rank it comes from: once, or T times for a combine
  /// that reduces over TP (whose signals must then name cross-rank or
  /// terminate events, as its TP peers are other ranks).
  Status checkThresholds() const {
    std::vector<uint64_t> sums(p.events.size(), 0);
    for (size_t t = 0; t < p.tasks.size(); ++t) {
      const TaskRecord &task = p.tasks[t];
      const bool fanOut = p.fansOut(task.op);
      for (uint32_t k = 0; k < task.signalCount; ++k) {
        const SignalRecord &signal = p.signals[size_t(task.firstSignal) + k];
        if (fanOut && p.events[signal.event].kind == EventKind::Local)
          return Status::error(fmt::format(
              "task {}: signal {} reaches the {} TP ranks of its peer, but {} is a local event", t,
              k, p.tpRanks, eventLabel(signal.event)));
        // Each step adds below 2^48 to a sum at most 2^32 - 1: no wrap.
        sums[signal.event] += uint64_t(signal.increment) * (fanOut ? p.tpRanks : 1);
        if (sums[signal.event] > std::numeric_limits<uint32_t>::max())
          return Status::error(fmt::format(
              "{}: its signals add up to more than {}, above any threshold",
              eventLabel(signal.event), std::numeric_limits<uint32_t>::max()));
      }
    }
    for (size_t e = 0; e < p.events.size(); ++e)
      if (sums[e] != p.events[e].threshold)
        return Status::error(fmt::format("{}: its signals add up to {}, but its threshold is {}",
                                         eventLabel(uint32_t(e)), sums[e], p.events[e].threshold));
    return Status::success();
  }

  const TaskProgram &p;
  int64_t lastNul = -1;
};

} // namespace

Status validateTaskProgram(const TaskProgram &program) { return Validator(program).run(); }

} // namespace moec::format
