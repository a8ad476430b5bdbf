//===- Text.cpp - the text dump of a task program -------------------------===//

#include "compiler/inspect/Describe.h"
#include "compiler/inspect/Dump.h"
#include "compiler/inspect/Table.h"

#include <fmt/format.h>

#include <algorithm>

namespace moec::inspect {

using namespace moec::format;
using json = nlohmann::ordered_json;

namespace {

/// Indents every line of `text` by `indent` spaces.
std::string indentLines(const std::string &text, size_t indent) {
  std::string out(indent, ' ');
  for (char c : text) {
    out += c;
    if (c == '\n')
      out += std::string(indent, ' ');
  }
  return out;
}


} // namespace


namespace {

/// The most critical-path tasks the text dump lists one by one.
constexpr size_t kMaxPathLines = 32;


std::string headerText(const TaskProgram &p, const FileFacts &facts, const DumpOptions &options,
                       const Analysis &a) {
  std::string out = fmt::format("task binary {}\n", facts.path);
  out += fmt::format("  format version {}; flags {:#x}: {} pass, {} activations{}\n",
                     kFormatVersion, p.flags, p.isBackward() ? "backward" : "forward",
                     (p.flags & kFlagBf16) ? "bf16" : "f32",
                     (p.flags & kFlagNotes) ? ", the compiler's notes" : "");
  out += fmt::format("  file size {} bytes; CRC-32 {:#010x}\n", facts.fileSize, facts.crc32);
  out += fmt::format("  computes: {}\n", computesText(p));
  out +=
      fmt::format("  EP ranks {}{}; local experts {} ({} experts in all); target '{}'\n",
                  p.epRanks,
                  p.tpRanks > 1 ? fmt::format(" x TP ranks {} ({} ranks)", p.tpRanks, p.ranks())
                                : std::string(),
                  p.localExperts, uint64_t(p.epRanks) * p.localExperts, p.name(p.target));
  if (p.layer) {
    const LayerRecord &l = *p.layer;
    out += fmt::format("  layer: hidden {}, intermediate {}, top_k {} of {} experts, seq_size {}, "
                       "{}{}{}\n",
                       l.hidden, l.intermediate, l.topK, l.experts, l.seqSize,
                       configDTypeName(l.dtype),
                       l.dispatchDtype != l.dtype
                           ? fmt::format(" (dispatched as {})", configDTypeName(l.dispatchDtype))
                           : std::string(),
                       l.mainGrad() ? ", main_grad" : "");
    out += fmt::format("  capacity: factor {}: {} rows routed a rank, {} received by its experts"
                       "{}\n",
                       l.capacityFactor, l.rowCapacity, l.receiveCapacity,
                       l.loraRank ? fmt::format("; LoRA rank {}, scaling {}", l.loraRank,
                                                l.loraScaling())
                                  : std::string());
  } else {
    out += "  layer: no layer record (a task program not compiled from a config)\n";
  }
  if (a.timed)
    out += fmt::format("  costs from profile '{}'\n", a.profileName);
  if (p.flags & kFlagNotes) {
    // The compiler's notes, line by line; control characters a damaged or
    // foreign binary may hold are shown as '?'.
    std::string notes(p.name(p.notes));
    for (char &c : notes)
      if ((unsigned char)c < 0x20 && c != '\n')
        c = '?';
    size_t begin = 0;
    while (begin <= notes.size()) {
      size_t end = notes.find('\n', begin);
      if (end == std::string::npos)
        end = notes.size();
      out += fmt::format("  {}\n", notes.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  if (options.rank)
    out += fmt::format("  resolved for rank {}: tile e = global expert, p = peer rank, g = "
                       "peer group; signals name peer ranks\n",
                       *options.rank);
  else
    out += "  rank-relative: tile e = local expert, p = peer offset, g = peer group; signals name "
           "peer offsets (--rank R resolves them)\n";
  return out;
}

std::string slotsText(const TaskProgram &p) {
  Table table({"slot", "param", "name", "dtype", "dims", "kind", "capacity"},
              {true, true, false, false, false, false, true});
  for (size_t i = 0; i < p.slots.size(); ++i) {
    const SlotRecord &slot = p.slots[i];
    std::string kind;
    if (slot.flags & kSlotList)
      kind = "list";
    if (slot.flags & kSlotDynamic)
      kind += kind.empty() ? "dynamic" : ",dynamic";
    table.add({std::to_string(i), std::to_string(slot.param), std::string(p.name(slot.name)),
               dtypeName(slot.dtype), dimsText(slot), kind.empty() ? "-" : kind,
               (slot.flags & kSlotDynamic) ? fmt::format("{} rows", slot.capacityRows) : "-"});
  }
  return fmt::format("tensor slots ({}):\n", p.slots.size()) + table.render(2);
}

std::string opsText(const TaskProgram &p) {
  Table table(
      {"op", "name", "kind", "tasks", "core", "grid e x p x r x c", "rows", "cols", "depth",
       "tile m/n/k", "lda/ldb/ldc", "slots in → out", "flags"},
      {true, false, false, true, false, false, true, true, true, false, false, false, false});
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const OpRecord &op = p.ops[i];
    const TilingRecord &t = p.tilings[op.tiling];
    std::string inputs;
    for (uint32_t slot : tilingInputs(t))
      inputs += (inputs.empty() ? "" : ",") + std::to_string(slot);
    table.add({std::to_string(i), std::string(p.name(op.name)), opKindName(op.kind),
               std::to_string(op.taskCount), opCore(p, uint32_t(i)),
               fmt::format("{} x {} x {} x {}", t.experts, t.peers, t.rowTiles, t.colTiles),
               std::to_string(t.rows), std::to_string(t.cols), std::to_string(t.depth),
               fmt::format("{}/{}/{}", t.tileM, t.tileN, t.tileK),
               fmt::format("{}/{}/{}", t.lda, t.ldb, t.ldc),
               fmt::format("{} → {}", inputs.empty() ? "-" : inputs, t.outputSlot),
               tilingFlagsText(t)});
  }
  return fmt::format("ops ({}, {} tasks):\n", p.ops.size(), p.tasks.size()) + table.render(2);
}

std::string eventsText(const TaskProgram &p, const Analysis &a) {
  Table table({"event", "name", "kind", "op", "threshold", "signallers", "waiters"},
              {true, false, false, false, true, true, true});
  for (size_t i = 0; i < p.events.size(); ++i) {
    const EventRecord &event = p.events[i];
    std::string op = event.op == kNone ? "-" : std::string(p.name(p.ops[event.op].name));
    table.add({std::to_string(i), std::string(p.name(event.name)), eventKindName(event.kind), op,
               std::to_string(event.threshold), std::to_string(a.signallers[i]),
               std::to_string(a.waiters[i])});
  }
  return fmt::format("events ({}):\n", p.events.size()) + table.render(2);
}

std::string queuesText(const TaskProgram &p, const DumpOptions &options, const Analysis &a) {
  std::vector<double> busy = queueBusy(p, a);
  std::vector<uint32_t> shown = shownQueues(p, options);
  std::string out = options.core ? fmt::format("queue of {}:\n",
                                               coreLabel(options.core->kind, options.core->index))
                                 : fmt::format("queues ({}):\n", p.queues.size());
  size_t width = std::to_string(p.tasks.empty() ? 0 : p.tasks.size() - 1).size();
  for (uint32_t q : shown) {
    const QueueRecord &queue = p.queues[q];
    out += fmt::format("  {}: {} task{}", queueLabel(queue), queue.entryCount,
                       queue.entryCount == 1 ? "" : "s");
    if (a.timed) {
      out += fmt::format(", busy {}", formatSeconds(busy[q]));
      if (a.run.ok())
        out += fmt::format(", finishes at {}", formatSeconds(a.run.queues[q].finishSeconds));
    }
    out += "\n";
    size_t limit =
        options.core ? queue.entryCount : std::min<size_t>(queue.entryCount, options.queuePreview);
    for (size_t k = 0; k < limit; ++k) {
      uint32_t task = p.queueEntries[queue.firstEntry + k];
      const TaskRecord &record = p.tasks[task];
      out += fmt::format("    {:>{}} {} {} waits {} signals {}\n", task, width,
                         p.name(p.ops[record.op].name), tileText(p, task, options.rank),
                         waitsText(p, record), signalsText(p, record, options.rank));
    }
    if (limit < queue.entryCount)
      out += fmt::format("    ... {} more (--core {}:{} lists them all)\n",
                         queue.entryCount - limit, coreKindName(queue.coreKind), queue.coreIndex);
  }
  return out;
}

/// The tasks of the critical path, one line each: rank, task, op, tile
/// (resolved for its rank) and when it runs in the simulation; the first
/// and last kMaxPathLines / 2 when the path is longer.
std::string criticalPathTasksText(const TaskProgram &p, const Analysis &a) {
  const std::vector<uint32_t> &path = a.run.criticalPath;
  Table table({"rank", "task", "op", "tile", "start", "cost"},
              {true, true, false, false, true, true});
  size_t half = kMaxPathLines / 2;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path.size() > kMaxPathLines && i == half) {
      table.add({"", "...", fmt::format("({} more)", path.size() - 2 * half), "", "", ""});
      i = path.size() - half;
    }
    uint32_t task = path[i], rank = a.run.criticalPathRanks[i];
    // Every rank runs the same tables, so rank 0's times are every rank's.
    table.add({std::to_string(rank), std::to_string(task), std::string(p.name(p.ops[p.tasks[task].op].name)),
               tileText(p, task, rank), amountText(a, a.run.start[task]),
               amountText(a, a.costs[task])});
  }
  return table.render(4);
}

std::string statisticsText(const TaskProgram &p, const Analysis &a) {
  std::string out = a.timed ? fmt::format("statistics (costs from profile '{}'):\n", a.profileName)
                            : "statistics (in task counts: every task costs one step):\n";
  if (!a.timed && !a.note.empty())
    out += fmt::format("  note: {}\n", a.note);
  for (const std::string &warning : a.warnings)
    out += fmt::format("  warning: {}\n", warning);
  auto [cube, vector] = taskCounts(p);
  size_t cubeQueues = 0, vectorQueues = 0;
  for (const QueueRecord &queue : p.queues)
    (queue.coreKind == CoreKind::Cube ? cubeQueues : vectorQueues) += 1;
  out += fmt::format("  tasks: {} cube on {} queue{}, {} vector on {} queue{}, {} in all\n", cube,
                     cubeQueues, cubeQueues == 1 ? "" : "s", vector, vectorQueues,
                     vectorQueues == 1 ? "" : "s", p.tasks.size());
  if (!a.run.ok()) {
    out += "  schedule: DEADLOCK\n";
    out += indentLines(a.run.status.message(), 4) + "\n";
    return out;
  }
  out += fmt::format("  schedule: deadlock-free (every queue of all {} rank{} drains)\n",
                     p.ranks(), p.ranks() == 1 ? "" : "s");
  out += fmt::format("  critical path{}: {}, {} task{}: {}\n",
                     p.ranks() > 1 ? " (ending on rank 0)" : "",
                     amountText(a, a.run.criticalPathSeconds), a.run.criticalPath.size(),
                     a.run.criticalPath.size() == 1 ? "" : "s",
                     summarizePath(p, a.run.criticalPath, a.run.criticalPathRanks));
  out += criticalPathTasksText(p, a);
  double share = a.run.makespan > 0 ? a.run.criticalPathSeconds / a.run.makespan : 1.0;
  out += fmt::format("  simulated makespan: {} (the critical path is {:.0f}% of it)\n",
                     amountText(a, a.run.makespan), 100 * share);
  std::vector<double> busy = queueBusy(p, a);
  out += a.timed ? "  queue balance (busy time):\n" : "  queue balance (tasks per queue):\n";
  for (CoreKind kind : {CoreKind::Cube, CoreKind::Vector}) {
    std::optional<Balance> b = balanceOf(p, busy, kind);
    if (!b)
      continue;
    std::string kindName = coreKindName(kind);
    if (b->queues == 1)
      out += fmt::format("    {}: one queue, {} ({})\n", kindName,
                         queueLabel(p.queues[b->minQueue]), amountText(a, b->minBusy));
    else if (b->minBusy == b->maxBusy)
      out += fmt::format("    {}: max/mean 1.00 over {} queues, each {}\n", kindName, b->queues,
                         amountText(a, b->maxBusy));
    else
      out += fmt::format("    {}: max/mean {:.2f} over {} queues; least {} ({}), most {} ({})\n",
                         kindName, b->ratio, b->queues, queueLabel(p.queues[b->minQueue]),
                         amountText(a, b->minBusy), queueLabel(p.queues[b->maxQueue]),
                         amountText(a, b->maxBusy));
  }
  return out;
}

} // namespace

std::string dumpText(const TaskProgram &program, const FileFacts &facts, const DumpOptions &options,
                     const Analysis &analysis) {
  std::string out = headerText(program, facts, options, analysis);
  out += "\n" + slotsText(program);
  out += "\n" + opsText(program);
  out += "\n" + eventsText(program, analysis);
  out += "\n" + queuesText(program, options, analysis);
  out += "\n" + statisticsText(program, analysis);
  return out;
}

} // namespace moec::inspect
