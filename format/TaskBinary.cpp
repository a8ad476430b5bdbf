//===- TaskBinary.cpp - The moec task binary: writer, reader, validation --===//
//
// The records in TaskBinary.h are the file's bytes, so reading a section is
// one bounds-checked memcpy into a vector, and writing one is the reverse.
// That needs a little-endian host, which every supported one is.
//
//===----------------------------------------------------------------------===//

#include "format/TaskBinary.h"

#include "base/File.h"
#include "base/Names.h"

#include "format/Crc32.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "records are copied as they are in memory: a little-endian host is needed"
#endif

namespace moec::format {

namespace {
constexpr float kZeroFloat = 0.0f;
} // namespace

static_assert(
    std::is_trivially_copyable_v<FileHeader> && std::is_trivially_copyable_v<SectionEntry> &&
        std::is_trivially_copyable_v<SlotRecord> && std::is_trivially_copyable_v<OpRecord> &&
        std::is_trivially_copyable_v<TilingRecord> && std::is_trivially_copyable_v<EventRecord> &&
        std::is_trivially_copyable_v<TaskRecord> && std::is_trivially_copyable_v<WaitRecord> &&
        std::is_trivially_copyable_v<SignalRecord> && std::is_trivially_copyable_v<QueueRecord>,
    "records are copied as bytes");

//===----------------------------------------------------------------------===//
// Names
//===----------------------------------------------------------------------===//

namespace {
constexpr Named<SectionKind> kSectionKindNames[] = {
    {SectionKind::Strings, "strings"},
    {SectionKind::Slots, "slots"},
    {SectionKind::Ops, "ops"},
    {SectionKind::Tilings, "tilings"},
    {SectionKind::Events, "events"},
    {SectionKind::Tasks, "tasks"},
    {SectionKind::Waits, "waits"},
    {SectionKind::Signals, "signals"},
    {SectionKind::Queues, "queues"},
    {SectionKind::QueueEntries, "queue entries"},
    {SectionKind::Layer, "layer"},
};
} // namespace

const char *sectionKindName(SectionKind kind) {
  return nameIn(kSectionKindNames, kind);
}

namespace {
constexpr Named<OpKind> kOpKindNames[] = {
    {OpKind::Dispatch, "dispatch"},
    {OpKind::Combine, "combine"},
    {OpKind::Gmm, "gmm"},
    {OpKind::Swiglu, "swiglu"},
    {OpKind::SwigluGrad, "swiglu_grad"},
    {OpKind::Quantize, "quantize"},
    {OpKind::Dequantize, "dequantize"},
};
} // namespace

const char *opKindName(OpKind kind) {
  return nameIn(kOpKindNames, kind);
}

namespace {
constexpr Named<CoreKind> kCoreKindNames[] = {
    {CoreKind::Cube, "cube"},
    {CoreKind::Vector, "vector"},
};
} // namespace

const char *coreKindName(CoreKind kind) {
  return nameIn(kCoreKindNames, kind);
}

namespace {
constexpr Named<EventKind> kEventKindNames[] = {
    {EventKind::Local, "local"},
    {EventKind::CrossRank, "cross-rank"},
    {EventKind::Terminate, "terminate"},
};
} // namespace

const char *eventKindName(EventKind kind) {
  return nameIn(kEventKindNames, kind);
}

TileCoord tileCoord(const TilingRecord &tiling, uint64_t index) {
  TileCoord c;
  c.colTile = uint32_t(index % tiling.colTiles);
  index /= tiling.colTiles;
  c.rowTile = uint32_t(index % tiling.rowTiles);
  index /= tiling.rowTiles;
  c.peer = uint32_t(index % tiling.peers);
  c.expert = uint32_t(index / tiling.peers);
  c.rowBegin = tileBegin(c.rowTile, tiling.rows, tiling.rowTiles);
  c.rowEnd = tileBegin(c.rowTile + 1ull, tiling.rows, tiling.rowTiles);
  c.colBegin = tileBegin(c.colTile, tiling.cols, tiling.colTiles);
  c.colEnd = tileBegin(c.colTile + 1ull, tiling.cols, tiling.colTiles);
  return c;
}

TileRowRuns peerGroupRows(const TilingRecord &tiling, const TileCoord &tile, uint32_t epRank,
                          uint32_t epRanks, const int64_t *sourceStart) {
  const auto rows = [](int64_t n) { return uint64_t(n > 0 ? n : 0); };
  TileRowRuns out;
  if (!hasPeerGroups(tiling)) {
    out.runs[0] = tileRows(tiling, tile, rows(sourceStart[epRanks]));
    out.count = out.runs[0].size() > 0 ? 1 : 0;
    return out;
  }
  const uint64_t R = epRanks;
  const uint64_t p0 = tileBegin(tile.peer, R, tiling.peers);
  const uint64_t p1 = tileBegin(uint64_t(tile.peer) + 1, R, tiling.peers);
  // Sources (rank - p) mod R for p in [p0, p1): the cyclic range from
  // `low` up to `high`.
  const uint64_t low = (epRank + R - (p1 - 1)) % R, high = (epRank + R - p0) % R;
  TileRows whole[2];
  uint32_t parts = 0;
  if (low <= high) {
    whole[parts++] = {rows(sourceStart[low]), rows(sourceStart[high + 1])};
  } else { // wraps past rank R - 1: the high ranks' rows, then the low ones'
    whole[parts++] = {rows(sourceStart[low]), rows(sourceStart[R])};
    whole[parts++] = {rows(sourceStart[0]), rows(sourceStart[high + 1])};
  }
  const uint64_t present = whole[0].size() + (parts > 1 ? whole[1].size() : 0);
  const TileRows share = tileRows(tiling, tile, present);
  // The share [begin, end) of the group's rows, laid over its runs.
  uint64_t skipped = 0;
  for (uint32_t k = 0; k < parts; ++k) {
    const uint64_t n = whole[k].size();
    const uint64_t begin = std::max(share.begin, skipped), end = std::min(share.end, skipped + n);
    if (begin < end)
      out.runs[out.count++] = {whole[k].begin + begin - skipped, whole[k].begin + end - skipped};
    skipped += n;
  }
  return out;
}

bool TaskProgram::fansOut(uint32_t op) const {
  return tpRanks > 1 && (tilings[ops[op].tiling].flags & kTilingReduceTp) != 0;
}

TaskProgram::RankRange TaskProgram::signalRanks(uint32_t op, uint32_t rank,
                                                uint32_t peerOffset) const {
  const uint32_t peer = peerRank(rank, peerOffset);
  return fansOut(op) ? RankRange{epOf(peer) * tpRanks, tpRanks} : RankRange{peer, 1};
}

TaskProgram::RankRange TaskProgram::signalSources(uint32_t op, uint32_t rank,
                                                  uint32_t peerOffset) const {
  const uint32_t fromEp = uint32_t((uint64_t(epOf(rank)) + epRanks - peerOffset) % epRanks);
  return fansOut(op) ? RankRange{fromEp * tpRanks, tpRanks}
                     : RankRange{fromEp * tpRanks + tpOf(rank), 1};
}

RankTile rankTile(const TaskProgram &program, uint32_t task, uint32_t rank) {
  const OpRecord &op = program.ops[program.tasks[task].op];
  const TilingRecord &tiling = program.tilings[op.tiling];
  RankTile tile;
  tile.coord = tileCoord(tiling, task - op.firstTask);
  tile.peerRank = isPut(op.kind) ? program.peerRank(rank, tile.coord.peer) : rank;
  // A dispatch tile's rows go to an expert of the peer; every other
  // per-expert tile holds rows of this rank's experts.
  uint32_t owner = op.kind == OpKind::Dispatch ? tile.peerRank : rank;
  tile.expert = tiling.experts > 1 || program.localExperts == 1
                    ? program.globalExpert(owner, tile.coord.expert)
                    : tile.coord.expert;
  return tile;
}

//===----------------------------------------------------------------------===//
// Record equality
//===----------------------------------------------------------------------===//

namespace {

/// Compares two records byte for byte; they have no padding.
template <typename T> bool sameBytes(const T &a, const T &b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

} // namespace

bool operator==(const SlotRecord &a, const SlotRecord &b) { return sameBytes(a, b); }
bool operator==(const OpRecord &a, const OpRecord &b) { return sameBytes(a, b); }
bool operator==(const TilingRecord &a, const TilingRecord &b) { return sameBytes(a, b); }
bool operator==(const EventRecord &a, const EventRecord &b) { return sameBytes(a, b); }
bool operator==(const TaskRecord &a, const TaskRecord &b) { return sameBytes(a, b); }
bool operator==(const WaitRecord &a, const WaitRecord &b) { return sameBytes(a, b); }
bool operator==(const SignalRecord &a, const SignalRecord &b) { return sameBytes(a, b); }
bool operator==(const QueueRecord &a, const QueueRecord &b) { return sameBytes(a, b); }
bool operator==(const LayerRecord &a, const LayerRecord &b) { return sameBytes(a, b); }

bool operator==(const TaskProgram &a, const TaskProgram &b) {
  return a.flags == b.flags && a.epRanks == b.epRanks && a.tpRanks == b.tpRanks &&
         a.localExperts == b.localExperts &&
         a.target == b.target && a.notes == b.notes &&
         a.strings == b.strings && a.slots == b.slots && a.ops == b.ops && a.tilings == b.tilings &&
         a.events == b.events && a.tasks == b.tasks && a.waits == b.waits &&
         a.signals == b.signals && a.queues == b.queues && a.queueEntries == b.queueEntries &&
         a.layer == b.layer;
}

//===----------------------------------------------------------------------===//
// TaskProgram
//===----------------------------------------------------------------------===//

std::string layerRecordJson(const LayerRecord &l) {
  // A double as the shortest text that reads back the same, with a point.
  auto real = [](double value) {
    std::string text = fmt::format("{}", value);
    return text.find_first_of(".e") == std::string::npos ? text + ".0" : text;
  };
  return fmt::format(
      "{{\"hidden_size\": {}, \"intermediate_size\": {}, \"num_experts\": {}, "
      "\"top_k\": {}, \"seq_size\": {}, \"capacity_factor\": {}, \"row_capacity\": {}, "
      "\"receive_capacity\": {}, \"dtype\": \"{}\", \"dispatch_dtype\": \"{}\", "
      "\"main_grad\": {}, \"lora_rank\": {}, \"lora_alpha\": {}, \"weight_group\": {}}}",
      l.hidden, l.intermediate, l.experts, l.topK, l.seqSize, real(l.capacityFactor),
      l.rowCapacity, l.receiveCapacity, configDTypeName(l.dtype), configDTypeName(l.dispatchDtype),
      l.mainGrad() ? "true" : "false", l.loraRank, real(l.loraAlpha), l.weightGroup);
}

CapacityInputs capacityInputs(const LayerRecord &layer, uint32_t epRanks,
                              uint32_t localExperts) {
  CapacityInputs c;
  c.seqSize = layer.seqSize;
  c.topK = layer.topK;
  c.epRanks = epRanks;
  c.localExperts = localExperts;
  c.capacityFactor = layer.capacityFactor;
  return c;
}

uint32_t TaskProgram::addString(std::string_view text) {
  uint32_t offset = uint32_t(strings.size());
  strings.append(text.data(), text.size());
  strings.push_back('\0');
  return offset;
}

std::string_view TaskProgram::name(uint32_t offset) const {
  if (offset >= strings.size())
    return {};
  const char *begin = strings.data() + offset;
  const void *nul = std::memchr(begin, '\0', strings.size() - offset);
  if (!nul)
    return {};
  return std::string_view(begin, size_t(static_cast<const char *>(nul) - begin));
}

//===----------------------------------------------------------------------===//
// Validation of the content
//===----------------------------------------------------------------------===//

namespace {

constexpr uint64_t kMaxRecords = std::numeric_limits<uint32_t>::max();

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
  /// Checks a name offset; `what` names the record ("slot 3").
  Status checkName(const std::string &what, uint32_t offset) const {
    if (offset >= p.strings.size())
      return Status::error(
          fmt::format("{}: name offset {} is past the end of the {}-byte string table", what,
                      offset, p.strings.size()));
    if (int64_t(offset) > lastNul)
      return Status::error(
          fmt::format("{}: the name at offset {} is not NUL-terminated", what, offset));
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
      if (Status status = checkName("header: notes", p.notes); !status)
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
    if (uint64_t(l.experts) != uint64_t(p.epRanks) * p.localExperts)
      return bad(fmt::format("{} experts, but the header has {} EP ranks of {} experts",
                             l.experts, p.epRanks, p.localExperts));
    if (l.topK > l.experts)
      return bad(fmt::format("top_k {} is more than the {} experts", l.topK, l.experts));
    if (l.intermediate % p.tpRanks != 0)
      return bad(fmt::format("intermediate size {} is not a multiple of the {} TP ranks",
                             l.intermediate, p.tpRanks));
    if (l.seqSize > kMaxSeqSize)
      return bad(fmt::format("seq_size {} is past {}", l.seqSize, kMaxSeqSize));
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
    }
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

//===----------------------------------------------------------------------===//
// Section layout shared by the writer and the reader
//===----------------------------------------------------------------------===//

namespace {

/// Returns the record size of a section kind, or 0 for an unknown kind.
uint32_t recordSizeOf(SectionKind kind) {
  switch (kind) {
  case SectionKind::Strings:
    return 1;
  case SectionKind::Slots:
    return sizeof(SlotRecord);
  case SectionKind::Ops:
    return sizeof(OpRecord);
  case SectionKind::Tilings:
    return sizeof(TilingRecord);
  case SectionKind::Events:
    return sizeof(EventRecord);
  case SectionKind::Tasks:
    return sizeof(TaskRecord);
  case SectionKind::Waits:
    return sizeof(WaitRecord);
  case SectionKind::Signals:
    return sizeof(SignalRecord);
  case SectionKind::Queues:
    return sizeof(QueueRecord);
  case SectionKind::QueueEntries:
    return sizeof(uint32_t);
  case SectionKind::Layer:
    return sizeof(LayerRecord);
  }
  return 0;
}

/// A section's bytes in memory, for the writer.
struct SectionData {
  SectionKind kind;
  const void *data;
  uint64_t count;
};

/// Returns the sections of `program` in SectionKind order.
std::vector<SectionData> sectionsOf(const TaskProgram &program) {
  return {{SectionKind::Strings, program.strings.data(), program.strings.size()},
          {SectionKind::Slots, program.slots.data(), program.slots.size()},
          {SectionKind::Ops, program.ops.data(), program.ops.size()},
          {SectionKind::Tilings, program.tilings.data(), program.tilings.size()},
          {SectionKind::Events, program.events.data(), program.events.size()},
          {SectionKind::Tasks, program.tasks.data(), program.tasks.size()},
          {SectionKind::Waits, program.waits.data(), program.waits.size()},
          {SectionKind::Signals, program.signals.data(), program.signals.size()},
          {SectionKind::Queues, program.queues.data(), program.queues.size()},
          {SectionKind::QueueEntries, program.queueEntries.data(), program.queueEntries.size()},
          {SectionKind::Layer, program.layer ? &*program.layer : nullptr,
           program.layer ? 1u : 0u}};
}

/// Rounds `value` up to a multiple of kSectionAlignment.
uint64_t alignUp(uint64_t value) {
  return (value + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment;
}

constexpr size_t kCrcOffset = offsetof(FileHeader, crc32);

} // namespace

uint32_t taskBinaryChecksum(const uint8_t *data, size_t size) {
  if (size < sizeof(FileHeader))
    return crc32(data, size);
  uint32_t crc = crc32(data, kCrcOffset);
  crc = crc32Zeros(sizeof(uint32_t), crc);
  size_t rest = kCrcOffset + sizeof(uint32_t);
  return crc32(data + rest, size - rest, crc);
}

//===----------------------------------------------------------------------===//
// Writer
//===----------------------------------------------------------------------===//

std::vector<uint8_t> writeTaskBinary(const TaskProgram &program) {
  std::vector<SectionData> sections = sectionsOf(program);
  std::vector<SectionEntry> table(sections.size());

  uint64_t tableOffset = alignUp(sizeof(FileHeader));
  uint64_t offset = alignUp(tableOffset + table.size() * sizeof(SectionEntry));
  for (size_t i = 0; i < sections.size(); ++i) {
    SectionEntry &entry = table[i];
    entry.kind = uint32_t(sections[i].kind);
    entry.recordSize = recordSizeOf(sections[i].kind);
    entry.offset = offset;
    entry.count = sections[i].count;
    offset = alignUp(offset + entry.count * entry.recordSize);
  }

  std::vector<uint8_t> file(offset, 0);
  FileHeader header;
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.version = kFormatVersion;
  header.flags = program.flags;
  header.fileSize = file.size();
  header.epRanks = program.epRanks;
  header.tpRanks = program.tpRanks;
  header.localExperts = program.localExperts;
  header.target = program.target;
  header.notes = program.notes;
  header.sectionCount = uint32_t(table.size());
  header.sectionTableOffset = tableOffset;
  std::memcpy(file.data(), &header, sizeof(header));
  std::memcpy(file.data() + tableOffset, table.data(), table.size() * sizeof(SectionEntry));
  for (size_t i = 0; i < sections.size(); ++i)
    if (table[i].count != 0)
      std::memcpy(file.data() + table[i].offset, sections[i].data,
                  table[i].count * table[i].recordSize);

  uint32_t crc = taskBinaryChecksum(file.data(), file.size());
  std::memcpy(file.data() + kCrcOffset, &crc, sizeof(crc));
  return file;
}

Status writeTaskBinaryFile(const TaskProgram &program, const std::string &path) {
  if (Status status = validateTaskProgram(program); !status)
    return status.withPrefix(path + ": ");
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  return writeFileAtomically(path, {{bytes.data(), bytes.size()}});
}

//===----------------------------------------------------------------------===//
// Reader
//===----------------------------------------------------------------------===//

namespace {

/// Returns "section 'tasks' (offset 4096, 24000 bytes)".
std::string describeSection(SectionKind kind, uint64_t offset, uint64_t bytes) {
  return fmt::format("section '{}' (offset {}, {} bytes)", sectionKindName(kind), offset, bytes);
}

/// Returns "the section table (offset 64, 240 bytes)".
std::string describeTable(uint64_t offset, uint64_t bytes) {
  return fmt::format("the section table (offset {}, {} bytes)", offset, bytes);
}

/// Computes count * recordSize into *bytes; returns false on overflow.
bool sectionBytes(const SectionEntry &entry, uint64_t *bytes) {
  return !__builtin_mul_overflow(entry.count, uint64_t(entry.recordSize), bytes);
}

/// Returns true when [offset, offset + bytes) ends past `size`.
bool endsPast(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset > size || bytes > size - offset;
}

/// The message for a file shorter than its header says. Names the first
/// section (by offset) that the cut leaves incomplete when the section
/// table is there to say so.
std::string truncationMessage(const uint8_t *data, size_t size, const FileHeader &header) {
  std::string said = fmt::format("(the header says the file has {} bytes)", header.fileSize);
  uint64_t tableBytes = uint64_t(header.sectionCount) * sizeof(SectionEntry);
  uint64_t tableOffset = header.sectionTableOffset;
  if (tableOffset >= sizeof(FileHeader) && tableOffset % kSectionAlignment == 0 &&
      !endsPast(tableOffset, tableBytes, header.fileSize)) {
    if (endsPast(tableOffset, tableBytes, size))
      return fmt::format("truncated: {} ends past the end of the {}-byte file {}",
                         describeTable(tableOffset, tableBytes), size, said);
    bool found = false;
    SectionEntry cut;
    uint64_t cutBytes = 0;
    for (uint32_t i = 0; i < header.sectionCount; ++i) {
      SectionEntry entry;
      std::memcpy(&entry, data + tableOffset + i * sizeof(SectionEntry), sizeof(entry));
      uint64_t bytes;
      if (recordSizeOf(SectionKind(entry.kind)) == 0 || !sectionBytes(entry, &bytes) ||
          bytes == 0 || !endsPast(entry.offset, bytes, size))
        continue;
      if (!found || entry.offset < cut.offset) {
        found = true;
        cut = entry;
        cutBytes = bytes;
      }
    }
    if (found)
      return fmt::format("truncated: {} ends past the end of the {}-byte file {}",
                         describeSection(SectionKind(cut.kind), cut.offset, cutBytes), size, said);
  }
  return fmt::format("truncated: the file has {} bytes, but the header says it has {}", size,
                     header.fileSize);
}

/// A section found in the table, for the overlap check.
struct Extent {
  uint64_t offset;
  uint64_t bytes;
  std::string what;
};

/// Checks the section table of a file whose header passed its checks, and
/// fills entries[kind - 1] with each section's entry.
Status checkSectionTable(const uint8_t *data, size_t size, const FileHeader &header,
                         SectionEntry entries[kSectionKindCount]) {
  uint64_t tableOffset = header.sectionTableOffset;
  uint64_t tableBytes = uint64_t(header.sectionCount) * sizeof(SectionEntry);
  if (tableOffset % kSectionAlignment != 0)
    return Status::error(fmt::format("the section table: offset {} is not {}-byte aligned",
                                     tableOffset, kSectionAlignment));
  if (tableOffset < sizeof(FileHeader))
    return Status::error(fmt::format("{} starts inside the {}-byte header",
                                     describeTable(tableOffset, tableBytes), sizeof(FileHeader)));
  if (endsPast(tableOffset, tableBytes, size))
    return Status::error(fmt::format("truncated: {} ends past the end of the {}-byte file",
                                     describeTable(tableOffset, tableBytes), size));

  std::vector<Extent> extents;
  extents.push_back({tableOffset, tableBytes, describeTable(tableOffset, tableBytes)});
  int firstEntryOf[kSectionKindCount];
  std::fill(firstEntryOf, firstEntryOf + kSectionKindCount, -1);
  for (uint32_t i = 0; i < header.sectionCount; ++i) {
    SectionEntry entry;
    std::memcpy(&entry, data + tableOffset + i * sizeof(SectionEntry), sizeof(entry));
    SectionKind kind = SectionKind(entry.kind);
    uint32_t expectedSize = recordSizeOf(kind);
    if (expectedSize == 0)
      return Status::error(
          fmt::format("section table entry {}: kind {} is not a section kind of version {}", i,
                      entry.kind, kFormatVersion));
    const char *name = sectionKindName(kind);
    if (firstEntryOf[entry.kind - 1] >= 0)
      return Status::error(
          fmt::format("section table entry {}: a second '{}' section (the first is entry {})", i,
                      name, firstEntryOf[entry.kind - 1]));
    firstEntryOf[entry.kind - 1] = int(i);
    if (entry.recordSize != expectedSize)
      return Status::error(
          fmt::format("section '{}': record size {}, but version {} {} records are {} bytes", name,
                      entry.recordSize, kFormatVersion, name, expectedSize));
    uint64_t bytes;
    if (!sectionBytes(entry, &bytes))
      return Status::error(
          fmt::format("section '{}': {} records of {} bytes overflow a 64-bit size", name,
                      entry.count, entry.recordSize));
    if (entry.count > kMaxRecords)
      return Status::error(fmt::format(
          "section '{}' has {} records; indices are 32-bit, so a section holds at most {}", name,
          entry.count, kMaxRecords));
    if (entry.offset % kSectionAlignment != 0)
      return Status::error(fmt::format("section '{}': offset {} is not {}-byte aligned", name,
                                       entry.offset, kSectionAlignment));
    if (entry.offset < sizeof(FileHeader))
      return Status::error(fmt::format("{} starts inside the {}-byte header",
                                       describeSection(kind, entry.offset, bytes),
                                       sizeof(FileHeader)));
    if (endsPast(entry.offset, bytes, size))
      return Status::error(fmt::format("truncated: {} ends past the end of the {}-byte file",
                                       describeSection(kind, entry.offset, bytes), size));
    if (bytes != 0)
      extents.push_back({entry.offset, bytes, describeSection(kind, entry.offset, bytes)});
    entries[entry.kind - 1] = entry;
  }
  for (uint32_t k = 0; k < kSectionKindCount; ++k)
    if (firstEntryOf[k] < 0)
      return Status::error(fmt::format("the section table has no '{}' section",
                                       sectionKindName(SectionKind(k + 1))));

  std::sort(extents.begin(), extents.end(),
            [](const Extent &a, const Extent &b) { return a.offset < b.offset; });
  for (size_t i = 1; i < extents.size(); ++i)
    if (extents[i].offset < extents[i - 1].offset + extents[i - 1].bytes)
      return Status::error(fmt::format("{} overlaps {}", extents[i - 1].what, extents[i].what));
  return Status::success();
}

/// Copies the records of one section into `records`.
template <typename T>
void copySection(const uint8_t *data, const SectionEntry &entry, std::vector<T> *records) {
  records->resize(size_t(entry.count));
  if (entry.count != 0)
    std::memcpy(records->data(), data + entry.offset, size_t(entry.count) * sizeof(T));
}

} // namespace

Status readTaskBinary(const uint8_t *data, size_t size, TaskProgram *out) {
  return readTaskBinary(data, size, out, ReadOptions());
}

Status readTaskBinary(const uint8_t *data, size_t size, TaskProgram *out,
                      const ReadOptions &options) {
  if (size != 0 && !data)
    return Status::error("no data (a null pointer)");
  if (std::memcmp(data ? data : reinterpret_cast<const uint8_t *>(""), kMagic,
                  std::min(size, sizeof(kMagic))) != 0)
    return Status::error("not a moec task binary (bad magic)");
  if (size < sizeof(FileHeader))
    return Status::error(
        fmt::format("truncated: the file has {} bytes, less than the {}-byte header", size,
                    sizeof(FileHeader)));
  FileHeader header;
  std::memcpy(&header, data, sizeof(header));
  if (header.version != kFormatVersion)
    return Status::error(fmt::format(
        "format version {} is not supported (this reader reads version {}){}", header.version,
        kFormatVersion,
        header.version >= 1 && header.version < kFormatVersion
            ? "; compile the graph again with this moec (version 2 added the layer record)"
            : ""));
  if (header.fileSize > size)
    return Status::error(truncationMessage(data, size, header));
  if (header.fileSize < size)
    return Status::error(
        fmt::format("file size mismatch: the header says {} bytes, but the file has {}",
                    header.fileSize, size));
  if (options.verifyChecksum) {
    uint32_t crc = taskBinaryChecksum(data, size);
    if (crc != header.crc32)
      return Status::error(fmt::format("bad checksum: header says {:#010x}, content gives {:#010x}",
                                       header.crc32, crc));
  }
  if (header.reserved != 0)
    return Status::error("header: reserved bytes are not zero");
  if (header.sectionCount != kSectionKindCount)
    return Status::error(fmt::format("header: the section table has {} entries; version {} has {}",
                                     header.sectionCount, kFormatVersion, kSectionKindCount));

  SectionEntry entries[kSectionKindCount];
  if (Status status = checkSectionTable(data, size, header, entries); !status)
    return status;

  auto entryOf = [&](SectionKind kind) -> const SectionEntry & {
    return entries[uint32_t(kind) - 1];
  };
  TaskProgram program;
  program.flags = header.flags;
  program.epRanks = header.epRanks;
  program.tpRanks = header.tpRanks == 0 ? 1 : header.tpRanks;
  program.localExperts = header.localExperts;
  program.target = header.target;
  program.notes = header.notes;
  const SectionEntry &strings = entryOf(SectionKind::Strings);
  program.strings.assign(reinterpret_cast<const char *>(data + strings.offset),
                         size_t(strings.count));
  copySection(data, entryOf(SectionKind::Slots), &program.slots);
  copySection(data, entryOf(SectionKind::Ops), &program.ops);
  copySection(data, entryOf(SectionKind::Tilings), &program.tilings);
  copySection(data, entryOf(SectionKind::Events), &program.events);
  copySection(data, entryOf(SectionKind::Tasks), &program.tasks);
  copySection(data, entryOf(SectionKind::Waits), &program.waits);
  copySection(data, entryOf(SectionKind::Signals), &program.signals);
  copySection(data, entryOf(SectionKind::Queues), &program.queues);
  copySection(data, entryOf(SectionKind::QueueEntries), &program.queueEntries);
  const SectionEntry &layer = entryOf(SectionKind::Layer);
  if (layer.count > 1)
    return Status::error(fmt::format("section 'layer' has {} records; a program has at most one",
                                     layer.count));
  if (layer.count == 1) {
    program.layer.emplace();
    std::memcpy(&*program.layer, data + layer.offset, sizeof(LayerRecord));
  }

  if (Status status = validateTaskProgram(program); !status)
    return status;
  *out = std::move(program);
  return Status::success();
}

Status loadTaskBinaryFile(const std::string &path, TaskProgram *out) {
  if (path == "-")
    return Status::error("-: a task binary is read from a file, not from standard input");
  // The header first: a file longer than it says (bytes appended, a sparse
  // tail of gigabytes) is refused before the rest is read.
  std::vector<uint8_t> bytes;
  uint64_t fileSize = 0;
  if (Status s = readFileHead(path, sizeof(FileHeader), &bytes, &fileSize); !s)
    return s;
  if (bytes.size() == sizeof(FileHeader) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0) {
    FileHeader header;
    std::memcpy(&header, bytes.data(), sizeof(header));
    if (header.version == kFormatVersion && header.fileSize < fileSize)
      return Status::error(
          fmt::format("{}: file size mismatch: the header says {} bytes, but the file has {}",
                      path, header.fileSize, fileSize));
  }
  if (Status s = readWholeFile(path, &bytes, std::max<uint64_t>(fileSize, sizeof(FileHeader))); !s)
    return s;
  return readTaskBinary(bytes.data(), bytes.size(), out).withPrefix(path + ": ");
}

} // namespace moec::format
