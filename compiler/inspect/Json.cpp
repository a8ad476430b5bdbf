//===- Json.cpp - the JSON dump of a task program -------------------------===//

#include "compiler/inspect/Describe.h"
#include "compiler/inspect/Dump.h"

#include <fmt/format.h>

#include <algorithm>

namespace moec::inspect {

using namespace moec::format;
using json = nlohmann::ordered_json;

namespace {

/// A task as one row of the compact table (kCompactEntryColumns); start and
/// finish are null without a simulated run.
json compactTaskJson(const TaskProgram &p, uint32_t task, const DumpOptions &options,
                     const Analysis &a) {
  const TaskRecord &record = p.tasks[task];
  const ResolvedTile t = resolvedTile(p, task, options.rank);
  json waits = json::array();
  for (uint32_t k = 0; k < record.waitCount; ++k) {
    const WaitRecord &wait = p.waits[size_t(record.firstWait) + k];
    waits.push_back({wait.event, wait.threshold});
  }
  json signals = json::array();
  for (uint32_t k = 0; k < record.signalCount; ++k) {
    const SignalRecord &signal = p.signals[size_t(record.firstSignal) + k];
    signals.push_back({signal.event, signal.increment,
                       options.rank ? json(p.peerRank(*options.rank, signal.peerOffset))
                                    : json(signal.peerOffset)});
  }
  return json::array({task, record.op, t.expert, t.peer, t.coord.rowTile, t.coord.colTile,
                      t.coord.rowBegin, t.coord.rowEnd, t.coord.colBegin, t.coord.colEnd,
                      a.costs[task], a.run.ok() ? json(a.run.start[task]) : json(nullptr),
                      a.run.ok() ? json(a.run.finish[task]) : json(nullptr), waits, signals});
}

json taskJson(const TaskProgram &p, uint32_t task, const DumpOptions &options, const Analysis &a) {
  if (options.compact)
    return compactTaskJson(p, task, options, a);
  const TaskRecord &record = p.tasks[task];
  ResolvedTile t = resolvedTile(p, task, options.rank);
  json tile;
  tile["expert"] = t.expert;
  tile["peer"] = t.peer;
  if (options.rank) {
    tile["local_expert"] = t.coord.expert;
    tile["peer_offset"] = t.coord.peer;
  }
  tile["row_tile"] = t.coord.rowTile;
  tile["col_tile"] = t.coord.colTile;
  tile["rows"] = {t.coord.rowBegin, t.coord.rowEnd};
  tile["cols"] = {t.coord.colBegin, t.coord.colEnd};
  json waits = json::array();
  for (uint32_t k = 0; k < record.waitCount; ++k) {
    const WaitRecord &wait = p.waits[size_t(record.firstWait) + k];
    waits.push_back({{"event", wait.event},
                     {"name", std::string(p.name(p.events[wait.event].name))},
                     {"threshold", wait.threshold}});
  }
  json signals = json::array();
  for (uint32_t k = 0; k < record.signalCount; ++k) {
    const SignalRecord &signal = p.signals[size_t(record.firstSignal) + k];
    json s = {{"event", signal.event},
              {"name", std::string(p.name(p.events[signal.event].name))},
              {"increment", signal.increment},
              {"peer_offset", signal.peerOffset}};
    if (options.rank)
      s["peer_rank"] = p.peerRank(*options.rank, signal.peerOffset);
    signals.push_back(s);
  }
  json j;
  j["task"] = task;
  j["op"] = std::string(p.name(p.ops[record.op].name));
  j["op_index"] = record.op;
  j["tile"] = tile;
  j["cost"] = a.costs[task];
  if (a.run.ok()) {
    j["start"] = a.run.start[task];
    j["finish"] = a.run.finish[task];
  }
  j["waits"] = waits;
  j["signals"] = signals;
  return j;
}

} // namespace

json dumpJson(const TaskProgram &p, const FileFacts &facts, const DumpOptions &options,
              const Analysis &a) {
  json out;
  out["file"] = {{"path", facts.path},
                 {"format_version", kFormatVersion},
                 {"flags", p.flags},
                 {"pass", p.isBackward() ? "backward" : "forward"},
                 {"dtype", (p.flags & kFlagBf16) ? "bf16" : "f32"},
                 {"file_size", facts.fileSize},
                 {"crc32", fmt::format("{:#010x}", facts.crc32)},
                 {"computes", computesText(p)},
                 {"ep_ranks", p.epRanks},
                 {"tp_ranks", p.tpRanks},
                 {"local_experts", p.localExperts},
                 {"target", std::string(p.name(p.target))}};
  // The layer record, in the config's keys.
  out["layer"] = p.layer ? json::parse(layerRecordJson(*p.layer)) : json(nullptr);
  out["notes"] = (p.flags & kFlagNotes) ? json(std::string(p.name(p.notes))) : json(nullptr);
  out["rank"] = options.rank ? json(*options.rank) : json(nullptr);
  if (options.compact)
    out["entry_columns"] = kCompactEntryColumns;
  out["profile"] = a.timed ? json(a.profileName) : json(nullptr);
  if (!a.timed && !a.note.empty())
    out["note"] = a.note;
  out["warnings"] = a.warnings;

  json slots = json::array();
  for (size_t i = 0; i < p.slots.size(); ++i) {
    const SlotRecord &slot = p.slots[i];
    json dims = json::array();
    for (unsigned d = 0; d < slot.rank && d < kMaxTensorRank; ++d)
      dims.push_back(slot.dims[d]);
    slots.push_back({{"index", i},
                     {"param", slot.param},
                     {"name", std::string(p.name(slot.name))},
                     {"dtype", dtypeName(slot.dtype)},
                     {"dims", dims},
                     {"list", (slot.flags & kSlotList) != 0},
                     {"dynamic", (slot.flags & kSlotDynamic) != 0},
                     {"capacity_rows", slot.capacityRows}});
  }
  out["slots"] = slots;

  json ops = json::array();
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const OpRecord &op = p.ops[i];
    const TilingRecord &t = p.tilings[op.tiling];
    json flags = tilingFlagNames(t);
    json tiling = {{"index", op.tiling},
                   {"experts", t.experts},
                   {"peers", t.peers},
                   {"row_tiles", t.rowTiles},
                   {"col_tiles", t.colTiles},
                   {"rows", t.rows},
                   {"cols", t.cols},
                   {"depth", t.depth},
                   {"tile_m", t.tileM},
                   {"tile_n", t.tileN},
                   {"tile_k", t.tileK},
                   {"lda", t.lda},
                   {"ldb", t.ldb},
                   {"ldc", t.ldc},
                   {"dtype", dtypeName(t.dtype)},
                   {"inputs", tilingInputs(t)},
                   {"output", t.outputSlot},
                   {"balanced_rows", t.balancedRows},
                   {"flags", flags},
                   {"scale", (t.flags & kTilingScale) ? double(t.scale) : 1.0}};
    ops.push_back({{"index", i},
                   {"name", std::string(p.name(op.name))},
                   {"kind", opKindName(op.kind)},
                   {"first_task", op.firstTask},
                   {"tasks", op.taskCount},
                   {"core", opCore(p, uint32_t(i))},
                   {"tiling", tiling}});
  }
  out["ops"] = ops;

  json events = json::array();
  for (size_t i = 0; i < p.events.size(); ++i) {
    const EventRecord &event = p.events[i];
    events.push_back({{"index", i},
                      {"name", std::string(p.name(event.name))},
                      {"kind", eventKindName(event.kind)},
                      {"op", event.op == kNone ? json(nullptr)
                                               : json(std::string(p.name(p.ops[event.op].name)))},
                      {"threshold", event.threshold},
                      {"signallers", a.signallers[i]},
                      {"waiters", a.waiters[i]}});
  }
  out["events"] = events;

  std::vector<double> busy = queueBusy(p, a);
  json queues = json::array();
  for (uint32_t q : shownQueues(p, options)) {
    const QueueRecord &queue = p.queues[q];
    json entries = json::array();
    for (uint32_t k = 0; k < queue.entryCount; ++k)
      entries.push_back(taskJson(p, p.queueEntries[size_t(queue.firstEntry) + k], options, a));
    json j = {{"queue", q},
              {"core", coreKindName(queue.coreKind)},
              {"core_index", queue.coreIndex},
              {"tasks", queue.entryCount},
              {"busy", busy[q]}};
    if (a.run.ok())
      j["finish"] = a.run.queues[q].finishSeconds;
    j["entries"] = entries;
    queues.push_back(j);
  }
  out["queues"] = queues;

  json stats;
  stats["unit"] = a.timed ? "seconds" : "tasks";
  auto [cube, vector] = taskCounts(p);
  stats["tasks"] = {{"cube", cube}, {"vector", vector}, {"total", p.tasks.size()}};
  stats["deadlock_free"] = a.run.ok();
  if (!a.run.ok()) {
    stats["deadlock"] = a.run.status.message();
  } else {
    stats["critical_path"] = {
        {"length", a.run.criticalPathSeconds},
        {"tasks", a.run.criticalPath},
        {"ranks", a.run.criticalPathRanks},
        {"ops", summarizePath(p, a.run.criticalPath, a.run.criticalPathRanks, SIZE_MAX)}};
    stats["makespan"] = a.run.makespan;
    json balance = json::object();
    for (CoreKind kind : {CoreKind::Cube, CoreKind::Vector}) {
      std::optional<Balance> b = balanceOf(p, busy, kind);
      if (!b)
        continue;
      balance[coreKindName(kind)] = {
          {"queues", b->queues},
          {"mean_busy", b->mean},
          {"max_over_mean", b->ratio},
          {"min", {{"core_index", p.queues[b->minQueue].coreIndex}, {"busy", b->minBusy}}},
          {"max", {{"core_index", p.queues[b->maxQueue].coreIndex}, {"busy", b->maxBusy}}}};
    }
    stats["balance"] = balance;
  }
  out["statistics"] = stats;
  return out;
}

} // namespace moec::inspect
