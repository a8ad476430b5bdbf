//===- TaskBinary.cpp - The moec task binary: names, tiles, records -------===//
//
// The names of the enums, the tile a task computes, record equality, the
// program's strings and the layer record's JSON. The records in
// TaskBinary.h are the file's bytes (ReadWrite.cpp copies them as they
// are), which needs a little-endian host, which every supported one is.
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

static_assert(
    std::is_trivially_copyable_v<FileHeader> && std::is_trivially_copyable_v<SectionEntry> &&
        std::is_trivially_copyable_v<SlotRecord> && std::is_trivially_copyable_v<OpRecord> &&
        std::is_trivially_copyable_v<TilingRecord> && std::is_trivially_copyable_v<EventRecord> &&
        std::is_trivially_copyable_v<TaskRecord> && std::is_trivially_copyable_v<WaitRecord> &&
        std::is_trivially_copyable_v<SignalRecord> && std::is_trivially_copyable_v<QueueRecord> &&
        std::is_trivially_copyable_v<LayerRecord>,
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
  return {layer.seqSize, layer.topK, epRanks, localExperts, layer.capacityFactor};
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

} // namespace moec::format
