//===- Dump.cpp - What `moec dump` prints about a task program ------------===//

#include "tools/moec/Dump.h"

#include "compiler/target/Cost.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstring>

namespace moec::dump {

using namespace moec::format;
using json = nlohmann::ordered_json;

namespace {

//===----------------------------------------------------------------------===//
// Small helpers
//===----------------------------------------------------------------------===//

/// A text table: rows of cells, printed with each column as wide as its
/// widest cell, numeric columns right-aligned.
class Table {
public:
  /// `rightAligned[i]` says whether column i is right-aligned.
  Table(std::vector<std::string> header, std::vector<bool> rightAligned)
      : right(std::move(rightAligned)) {
    rows.push_back(std::move(header));
  }

  void add(std::vector<std::string> row) { rows.push_back(std::move(row)); }

  /// Renders the table, each line indented by `indent` spaces.
  std::string render(size_t indent) const {
    std::vector<size_t> width(rows.front().size(), 0);
    for (const auto &row : rows)
      for (size_t i = 0; i < row.size() && i < width.size(); ++i)
        width[i] = std::max(width[i], displayWidth(row[i]));
    std::string out;
    for (const auto &row : rows) {
      std::string line(indent, ' ');
      for (size_t i = 0; i < row.size() && i < width.size(); ++i) {
        size_t pad = width[i] - displayWidth(row[i]);
        bool last = i + 1 == row.size();
        if (i < right.size() && right[i])
          line += std::string(pad, ' ') + row[i];
        else
          line += row[i] + (last ? "" : std::string(pad, ' '));
        if (!last)
          line += "  ";
      }
      while (!line.empty() && line.back() == ' ')
        line.pop_back();
      out += line + "\n";
    }
    return out;
  }

private:
  /// The number of characters of UTF-8 text.
  static size_t displayWidth(const std::string &text) {
    size_t n = 0;
    for (unsigned char c : text)
      n += (c & 0xC0) != 0x80;
    return n;
  }

  std::vector<std::vector<std::string>> rows;
  std::vector<bool> right;
};

/// "cube core 3".
std::string coreLabel(CoreKind kind, uint32_t index) {
  return fmt::format("{} core {}", coreKindName(kind), index);
}

/// "cube core 3" for a queue.
std::string queueLabel(const QueueRecord &queue) {
  return coreLabel(queue.coreKind, queue.coreIndex);
}

/// The queues in (kind, index) order: cube cores first.
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

/// The queues a dump shows: the selected core's, or all in (kind, index)
/// order.
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

/// The core kind of an op's tasks: "cube", "vector", "mixed", or "-" for an
/// op without tasks.
std::string opCore(const TaskProgram &p, const OpRecord &op) {
  if (op.taskCount == 0)
    return "-";
  CoreKind kind = p.tasks[op.firstTask].coreKind;
  for (uint32_t t = op.firstTask; t < op.firstTask + op.taskCount; ++t)
    if (p.tasks[t].coreKind != kind)
      return "mixed";
  return coreKindName(kind);
}

/// "[256, 128]".
std::string dimsText(const SlotRecord &slot) {
  std::string out = "[";
  for (unsigned d = 0; d < slot.rank && d < kMaxTensorRank; ++d)
    out += fmt::format("{}{}", d ? ", " : "", slot.dims[d]);
  return out + "]";
}

/// The names of a tiling's flags: "transpose_a", "transpose_b",
/// "accumulate", "scale=0.5".
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
  return names;
}

/// "transpose_a,accumulate" or "-".
std::string tilingFlagsText(const TilingRecord &t) {
  const std::vector<std::string> names = tilingFlagNames(t);
  return names.empty() ? "-" : fmt::format("{}", fmt::join(names, ","));
}

/// The input slots of a tiling.
std::vector<uint32_t> tilingInputs(const TilingRecord &tiling) {
  std::vector<uint32_t> inputs;
  for (unsigned k = 0; k < tiling.inputCount && k < kMaxTilingInputs; ++k)
    inputs.push_back(tiling.inputSlots[k]);
  return inputs;
}

/// A task's tile with rank-relative fields resolved for `rank` (if any).
struct ResolvedTile {
  TileCoord coord;
  uint64_t expert = 0; ///< local, or global with a rank
  uint32_t peer = 0;   ///< peer offset, or peer rank with a rank
};

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
  tile.peer = p.tilings[p.ops[p.tasks[task].op].tiling].peers > 1 ? resolved.peerRank
                                                                   : resolved.coord.peer;
  return tile;
}

/// "tile(e0,p1,r0,c2 rows 0..128 cols 256..384)".
std::string tileText(const TaskProgram &p, uint32_t task, std::optional<uint32_t> rank) {
  ResolvedTile t = resolvedTile(p, task, rank);
  return fmt::format("tile(e{},p{},r{},c{} rows {}..{} cols {}..{})", t.expert, t.peer,
                     t.coord.rowTile, t.coord.colTile, t.coord.rowBegin, t.coord.rowEnd,
                     t.coord.colBegin, t.coord.colEnd);
}

/// "[ev3 dispatch.rows_in >= 4, ev5 ... >= 1]".
std::string waitsText(const TaskProgram &p, const TaskRecord &task) {
  std::string out = "[";
  for (uint32_t k = 0; k < task.waitCount; ++k) {
    const WaitRecord &wait = p.waits[size_t(task.firstWait) + k];
    out += fmt::format("{}ev{} {} >= {}", k ? ", " : "", wait.event,
                       p.name(p.events[wait.event].name), wait.threshold);
  }
  return out + "]";
}

/// "[ev3 dispatch.rows_in +1 → +1]" (peer offset), or "→ rank 2" with a rank.
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

/// A quantity in the analysis' unit: seconds, or tasks (steps) when untimed.
std::string amountText(const Analysis &a, double value) {
  if (a.timed)
    return formatSeconds(value);
  return fmt::format("{:.0f} {}", value, value == 1 ? "step" : "steps");
}

/// Per queue: the sum of its tasks' costs.
std::vector<double> queueBusy(const TaskProgram &p, const Analysis &a) {
  std::vector<double> busy(p.queues.size(), 0.0);
  for (size_t q = 0; q < p.queues.size(); ++q)
    for (uint32_t k = 0; k < p.queues[q].entryCount; ++k)
      busy[q] += a.costs[p.queueEntries[size_t(p.queues[q].firstEntry) + k]];
  return busy;
}

/// The balance of the queues of one core kind.
struct Balance {
  size_t queues = 0;
  double mean = 0, ratio = 0;
  uint32_t minQueue = 0, maxQueue = 0;
  double minBusy = 0, maxBusy = 0;
};

/// Returns the balance of the `kind` queues, or nothing when there are none.
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

/// Counts the tasks of each core kind: {cube, vector}.
std::pair<uint64_t, uint64_t> taskCounts(const TaskProgram &p) {
  uint64_t cube = 0, vector = 0;
  for (const TaskRecord &task : p.tasks)
    (task.coreKind == CoreKind::Cube ? cube : vector) += 1;
  return {cube, vector};
}

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

/// Quotes `text` for a dot label or id.
std::string dotQuote(const std::string &text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\')
      out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

} // namespace

//===----------------------------------------------------------------------===//
// Options and analysis
//===----------------------------------------------------------------------===//

Status parseCoreSelector(const std::string &text, CoreSelector *out) {
  auto bad = [&] {
    return Status::error(fmt::format(
        "bad core '{}': expected cube:N or vector:N (N a core index, e.g. cube:3)", text));
  };
  size_t colon = text.find(':');
  if (colon == std::string::npos)
    return bad();
  std::string kind = text.substr(0, colon), index = text.substr(colon + 1);
  CoreSelector core;
  if (kind == "cube")
    core.kind = CoreKind::Cube;
  else if (kind == "vector")
    core.kind = CoreKind::Vector;
  else
    return bad();
  if (index.empty() || index.size() > 10 || !std::all_of(index.begin(), index.end(), [](char c) {
        return std::isdigit((unsigned char)c);
      }))
    return bad();
  uint64_t value = std::stoull(index);
  if (value > UINT32_MAX)
    return bad();
  core.index = uint32_t(value);
  *out = core;
  return Status::success();
}

FileFacts factsOf(const TaskProgram &program, const std::string &path) {
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  FileFacts facts;
  facts.path = path;
  facts.fileSize = bytes.size();
  std::memcpy(&facts.crc32, bytes.data() + offsetof(FileHeader, crc32), sizeof(facts.crc32));
  return facts;
}

Status analysisProfile(const TaskProgram &program, const std::optional<std::string> &target,
                       std::optional<target::TargetProfile> *profile, std::string *note) {
  target::TargetProfile resolved;
  profile->reset();
  note->clear();
  if (target) {
    if (Status status = target::resolveProfile(*target, &resolved); !status)
      return status.withPrefix("--target: ");
    *profile = resolved;
    return Status::success();
  }
  std::string name(program.name(program.target));
  if (Status status = target::resolveProfile(name, &resolved); status)
    *profile = resolved;
  else
    *note = fmt::format("the binary's target '{}' cannot be resolved here ({}); give --target "
                        "PROFILE for time estimates",
                        name, status.message());
  return Status::success();
}

Analysis analyzeProgram(const TaskProgram &program, const target::TargetProfile *profile,
                        const std::string &note, bool recordTrace) {
  Analysis a;
  a.timed = profile != nullptr;
  if (profile) {
    a.profileName = profile->name;
    target::CostModel model = target::costModel(program, *profile);
    a.costs = model.costs;
    a.run = target::simulateTimed(program, model, recordTrace);
    if (recordTrace)
      a.run.trace.profile = profile->name;
  } else {
    a.note = note;
    a.costs.assign(program.tasks.size(), 1.0);
    a.run = target::simulateTimed(program, a.costs);
  }
  a.signallers.assign(program.events.size(), 0);
  a.waiters.assign(program.events.size(), 0);
  for (const TaskRecord &task : program.tasks) {
    for (uint32_t k = 0; k < task.waitCount; ++k)
      ++a.waiters[program.waits[size_t(task.firstWait) + k].event];
    for (uint32_t k = 0; k < task.signalCount; ++k)
      ++a.signallers[program.signals[size_t(task.firstSignal) + k].event];
  }
  return a;
}

std::string coreCountWarning(const TaskProgram &program, const target::TargetProfile &profile) {
  uint32_t cubeQueues = 0, vectorQueues = 0;
  for (const QueueRecord &queue : program.queues)
    (queue.coreKind == CoreKind::Cube ? cubeQueues : vectorQueues) += 1;
  if (cubeQueues == profile.cubeCores && vectorQueues == profile.vectorCores)
    return "";
  return fmt::format("profile '{}' has {} cube + {} vector cores per rank, but the binary was "
                     "scheduled for {} cube + {} vector queues; the estimates keep the binary's "
                     "queues (compile with --target {} for that profile's schedule)",
                     profile.name, profile.cubeCores, profile.vectorCores, cubeQueues,
                     vectorQueues, profile.name);
}

Status checkDumpOptions(const TaskProgram &program, const DumpOptions &options) {
  if (options.rank && *options.rank >= program.ranks())
    return Status::error(fmt::format("--rank {}: the binary runs on {} rank{} (0..{})",
                                     *options.rank, program.ranks(),
                                     program.ranks() == 1 ? "" : "s", program.ranks() - 1));
  if (options.core && shownQueues(program, options).empty()) {
    std::vector<uint32_t> indices;
    for (const QueueRecord &queue : program.queues)
      if (queue.coreKind == options.core->kind)
        indices.push_back(queue.coreIndex);
    std::sort(indices.begin(), indices.end());
    const char *kind = coreKindName(options.core->kind);
    std::string have;
    if (indices.empty())
      have = fmt::format("it has no {} cores", kind);
    else if (indices.back() - indices.front() + 1 == indices.size())
      have = fmt::format("its {} cores are {}..{}", kind, indices.front(), indices.back());
    else {
      have = fmt::format("its {} cores are", kind);
      for (size_t i = 0; i < indices.size() && i < 16; ++i)
        have += fmt::format("{} {}", i ? "," : "", indices[i]);
      if (indices.size() > 16)
        have += ", ...";
    }
    return Status::error(fmt::format("the binary has no {} ({})",
                                     coreLabel(options.core->kind, options.core->index), have));
  }
  return Status::success();
}

std::string formatSeconds(double seconds) {
  if (seconds == 0)
    return "0 s";
  static const struct {
    double scale;
    const char *unit;
  } units[] = {{1, "s"}, {1e-3, "ms"}, {1e-6, "us"}, {1e-9, "ns"}};
  for (const auto &u : units)
    if (seconds >= u.scale || u.scale == 1e-9) {
      double v = seconds / u.scale;
      int decimals = v >= 100 ? 0 : v >= 10 ? 1 : 2;
      return fmt::format("{:.{}f} {}", v, decimals, u.unit);
    }
  return fmt::format("{} s", seconds);
}

std::string summarizePath(const TaskProgram &program, const std::vector<uint32_t> &tasks,
                          const std::vector<uint32_t> &ranks, size_t maxRuns) {
  struct Run {
    uint32_t op, rank;
    size_t count;
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < tasks.size(); ++i) {
    uint32_t op = program.tasks[tasks[i]].op;
    uint32_t rank = i < ranks.size() ? ranks[i] : 0;
    if (!runs.empty() && runs.back().op == op && runs.back().rank == rank)
      ++runs.back().count;
    else
      runs.push_back({op, rank, 1});
  }
  std::string out;
  for (size_t i = 0; i < runs.size() && i < maxRuns; ++i) {
    out += fmt::format("{}{} x{}", i ? " → " : "", program.name(program.ops[runs[i].op].name),
                       runs[i].count);
    if (runs[i].rank != 0)
      out += fmt::format(" on rank {}", runs[i].rank);
  }
  if (runs.size() > maxRuns)
    out += fmt::format(" → ... ({} more)", runs.size() - maxRuns);
  return out;
}

//===----------------------------------------------------------------------===//
// Text
//===----------------------------------------------------------------------===//

namespace {

/// The most critical-path tasks the text dump lists one by one.
constexpr size_t kMaxPathLines = 32;

/// What a binary computes, from its ops: the layer's forward; its backward
/// with weight gradients written, accumulated into fp32 (main_grad), or
/// none (frozen weights); or the dispatch or combine alone.
std::string computesText(const TaskProgram &p) {
  if (p.ops.size() == 1 && !p.isBackward() &&
      (p.ops[0].kind == OpKind::Dispatch || p.ops[0].kind == OpKind::Combine))
    return p.ops[0].kind == OpKind::Dispatch ? "the dispatch alone" : "the combine alone";
  // LoRA adapters: a GMM that adds its product to an addend (the base
  // projection's), from rank-r rows.
  std::string lora;
  int adapters = 0;
  for (const format::OpRecord &op : p.ops) {
    const format::TilingRecord &t = p.tilings[op.tiling];
    if (op.kind == OpKind::Gmm && t.depth != 0 && t.inputCount == 4) {
      ++adapters;
      lora = fmt::format(" with LoRA adapters on {} projection{} (rank {})", adapters,
                         adapters == 1 ? "" : "s", t.depth);
    }
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

std::string headerText(const TaskProgram &p, const FileFacts &facts, const DumpOptions &options,
                       const Analysis &a) {
  std::string out = fmt::format("task binary {}\n", facts.path);
  out += fmt::format("  format version {}; flags {:#x}: {} pass, {} activations\n", kFormatVersion,
                     p.flags, p.isBackward() ? "backward" : "forward",
                     (p.flags & kFlagBf16) ? "bf16" : "f32");
  out += fmt::format("  file size {} bytes; CRC-32 {:#010x}\n", facts.fileSize, facts.crc32);
  out += fmt::format("  computes: {}\n", computesText(p));
  out +=
      fmt::format("  EP ranks {}{}; local experts {} ({} experts in all); target '{}'\n",
                  p.epRanks,
                  p.tpRanks > 1 ? fmt::format(" x TP ranks {} ({} ranks)", p.tpRanks, p.ranks())
                                : std::string(),
                  p.localExperts, uint64_t(p.epRanks) * p.localExperts, p.name(p.target));
  if (a.timed)
    out += fmt::format("  costs from profile '{}'\n", a.profileName);
  if (options.rank)
    out += fmt::format("  resolved for rank {}: tile e = global expert, p = peer rank; signals "
                       "name peer ranks\n",
                       *options.rank);
  else
    out += "  rank-relative: tile e = local expert, p = peer offset; signals name peer offsets "
           "(--rank R resolves them)\n";
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
               std::to_string(op.taskCount), opCore(p, op),
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

//===----------------------------------------------------------------------===//
// JSON
//===----------------------------------------------------------------------===//

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
                   {"core", opCore(p, op)},
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

//===----------------------------------------------------------------------===//
// Dot
//===----------------------------------------------------------------------===//

Status dumpDot(const TaskProgram &p, const DumpOptions &options, std::string *out,
               size_t *drawnCount) {
  std::vector<uint32_t> shown = shownQueues(p, options);
  std::vector<uint8_t> opShown(p.ops.size(), options.ops.empty());
  for (const std::string &name : options.ops) {
    bool found = false;
    for (size_t i = 0; i < p.ops.size(); ++i)
      if (p.name(p.ops[i].name) == name)
        opShown[i] = found = true;
    if (!found) {
      std::vector<std::string> names;
      for (const OpRecord &op : p.ops)
        names.push_back(std::string(p.name(op.name)));
      return Status::error(fmt::format("--ops: the binary has no op '{}' (its ops: {})", name,
                                       fmt::join(names, ", ")));
    }
  }
  std::vector<uint8_t> drawn(p.tasks.size(), 0);
  size_t drawnTasks = 0;
  for (uint32_t q : shown)
    for (uint32_t k = 0; k < p.queues[q].entryCount; ++k) {
      uint32_t task = p.queueEntries[size_t(p.queues[q].firstEntry) + k];
      if (opShown[p.tasks[task].op]) {
        drawn[task] = 1;
        ++drawnTasks;
      }
    }
  if (drawnCount)
    *drawnCount = drawnTasks;
  std::vector<uint8_t> touched(p.events.size(), 0);

  std::string text = "digraph moec {\n  rankdir=TB;\n  node [shape=box, fontsize=10];\n";
  for (uint32_t q : shown) {
    const QueueRecord &queue = p.queues[q];
    std::vector<uint32_t> tasks;
    for (uint32_t k = 0; k < queue.entryCount; ++k)
      if (drawn[p.queueEntries[size_t(queue.firstEntry) + k]])
        tasks.push_back(p.queueEntries[size_t(queue.firstEntry) + k]);
    if (tasks.empty())
      continue;
    text +=
        fmt::format("  subgraph cluster_q{} {{\n    label={};\n", q, dotQuote(queueLabel(queue)));
    for (uint32_t task : tasks) {
      ResolvedTile t = resolvedTile(p, task, options.rank);
      std::string label =
          fmt::format("{} {}\ne{} p{} r{} c{}", task, p.name(p.ops[p.tasks[task].op].name),
                      t.expert, t.peer, t.coord.rowTile, t.coord.colTile);
      text += fmt::format("    t{} [label={}];\n", task, dotQuote(label));
    }
    for (size_t k = 1; k < tasks.size(); ++k)
      text += fmt::format("    t{} -> t{} [style=dotted, arrowhead=none];\n", tasks[k - 1],
                          tasks[k]);
    text += "  }\n";
  }

  std::string edges;
  for (uint32_t task = 0; task < p.tasks.size(); ++task) {
    if (!drawn[task])
      continue;
    const TaskRecord &record = p.tasks[task];
    for (uint32_t k = 0; k < record.signalCount; ++k) {
      const SignalRecord &signal = p.signals[size_t(record.firstSignal) + k];
      touched[signal.event] = 1;
      std::string label = fmt::format("+{}", signal.increment);
      if (signal.peerOffset != 0)
        label += options.rank
                     ? fmt::format(" → rank {}", p.peerRank(*options.rank, signal.peerOffset))
                     : fmt::format(" → +{}", signal.peerOffset);
      edges += fmt::format("  t{} -> ev{} [label={}];\n", task, signal.event, dotQuote(label));
    }
    for (uint32_t k = 0; k < record.waitCount; ++k) {
      const WaitRecord &wait = p.waits[size_t(record.firstWait) + k];
      touched[wait.event] = 1;
      if (wait.threshold == p.events[wait.event].threshold)
        edges += fmt::format("  ev{} -> t{};\n", wait.event, task);
      else
        edges += fmt::format("  ev{} -> t{} [label={}];\n", wait.event, task,
                             dotQuote(fmt::format(">= {}", wait.threshold)));
    }
  }
  for (uint32_t e = 0; e < p.events.size(); ++e)
    if (touched[e])
      text += fmt::format(
          "  ev{} [shape=ellipse, label={}];\n", e,
          dotQuote(fmt::format("ev{} {}\n{} = {}", e, p.name(p.events[e].name),
                               eventKindName(p.events[e].kind), p.events[e].threshold)));
  text += edges + "}\n";
  *out = std::move(text);
  return Status::success();
}

std::string dumpOpGraph(const TaskProgram &p) {
  // The op that writes each slot, and the waits each op makes on events of
  // each other op.
  std::vector<uint32_t> producer(p.slots.size(), kNone);
  for (uint32_t i = 0; i < p.ops.size(); ++i)
    producer[p.tilings[p.ops[i].tiling].outputSlot] = i;
  std::vector<std::vector<uint64_t>> waitsOn(p.ops.size(), std::vector<uint64_t>(p.ops.size(), 0));
  for (const TaskRecord &task : p.tasks)
    for (uint32_t k = 0; k < task.waitCount; ++k) {
      uint32_t from = p.events[p.waits[size_t(task.firstWait) + k].event].op;
      if (from != kNone)
        ++waitsOn[task.op][from];
    }

  std::string text = fmt::format(
      "digraph moec_ops {{\n  rankdir=TB;\n  label={};\n  labelloc=t;\n"
      "  node [fontsize=11];\n",
      dotQuote(fmt::format("{} ({}, {} ranks, {} local experts, {} tasks)", computesText(p),
                           (p.flags & kFlagBf16) ? "bf16" : "f32", p.ranks(), p.localExperts,
                           p.tasks.size())));
  std::vector<uint8_t> used(p.slots.size(), 0);
  for (uint32_t i = 0; i < p.ops.size(); ++i) {
    const OpRecord &op = p.ops[i];
    const TilingRecord &t = p.tilings[op.tiling];
    text += fmt::format(
        "  op{} [shape=box, style=\"rounded,filled\", fillcolor={}, label={}];\n", i,
        opCore(p, op) == "cube" ? "\"#cfe2ff\"" : "\"#d1f0d1\"",
        dotQuote(fmt::format("{}\n{} on {} cores\n{} tiles: {} x {} x {} x {}",
                             p.name(op.name), opKindName(op.kind), opCore(p, op), op.taskCount,
                             t.experts, t.peers, t.rowTiles, t.colTiles)));
    for (uint32_t slot : tilingInputs(t))
      used[slot] = 1;
    used[t.outputSlot] = 1;
  }
  for (uint32_t s = 0; s < p.slots.size(); ++s)
    if (used[s])
      text += fmt::format("  s{} [shape=ellipse, label={}];\n", s,
                          dotQuote(fmt::format("{}\n{} {}", p.name(p.slots[s].name),
                                               dtypeName(p.slots[s].dtype),
                                               dimsText(p.slots[s]))));
  for (uint32_t i = 0; i < p.ops.size(); ++i) {
    const OpRecord &op = p.ops[i];
    const TilingRecord &t = p.tilings[op.tiling];
    for (uint32_t slot : tilingInputs(t)) {
      uint32_t from = producer[slot];
      if (from != kNone && waitsOn[i][from] > 0)
        text += fmt::format("  s{} -> op{} [label={}];\n", slot, i,
                            dotQuote(fmt::format("{} waits", waitsOn[i][from])));
      else
        text += fmt::format("  s{} -> op{};\n", slot, i);
    }
    text += fmt::format("  op{} -> s{} [label={}];\n", i, t.outputSlot,
                        dotQuote(fmt::format("{} tiles", op.taskCount)));
  }
  return text + "}\n";
}

} // namespace moec::dump
