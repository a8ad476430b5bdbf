//===- Dot.cpp - a task program as Graphviz dot ---------------------------===//

#include "compiler/inspect/Describe.h"
#include "compiler/inspect/Dump.h"

#include <fmt/format.h>

#include <algorithm>

namespace moec::inspect {

using namespace moec::format;
using json = nlohmann::ordered_json;

namespace {

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
  // Each op's cores: "in HOST" for a lead product, drawn inside HOST's tiles.
  std::vector<std::string> cores(p.ops.size());
  for (uint32_t i = 0; i < p.ops.size(); ++i)
    cores[i] = opCore(p, i);
  const auto isLead = [&](uint32_t i) { return cores[i].rfind("in ", 0) == 0; };
  std::vector<uint8_t> used(p.slots.size(), 0);
  for (uint32_t i = 0; i < p.ops.size(); ++i) {
    const OpRecord &op = p.ops[i];
    const TilingRecord &t = p.tilings[op.tiling];
    const std::string &core = cores[i];
    const bool lead = isLead(i);
    text += fmt::format(
        "  op{} [shape=box, style=\"rounded,filled\", fillcolor={}, label={}];\n", i,
        core == "cube" || lead ? "\"#cfe2ff\"" : "\"#d1f0d1\"",
        dotQuote(fmt::format(
            "{}\n{} {}\n{}: {} x {} x {} x {}", p.name(op.name), opKindName(op.kind),
            lead ? core + "'s tiles" : fmt::format("on {} cores", core),
            lead ? std::string("no tiles of its own, grid") : fmt::format("{} tiles", op.taskCount),
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
    text += fmt::format(
        "  op{} -> s{} [label={}];\n", i, t.outputSlot,
        dotQuote(isLead(i) ? cores[i] + "'s tiles" : fmt::format("{} tiles", op.taskCount)));
  }
  return text + "}\n";
}

} // namespace moec::inspect
