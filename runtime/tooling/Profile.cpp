//===- Profile.cpp - Where a pass's time goes, from its trace -----------------===//

#include "runtime/tooling/Profile.h"

#include "format/TaskBinary.h"
#include "runtime/cpu/Peak.h"
#include "runtime/trace/Trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace moec::tooling {

using format::OpKind;

Peaks measurePeaks(double seconds) {
  Peaks peaks;
  const cpu::FmaPeak f32 = cpu::measureFmaPeak(seconds);
  peaks.f32 = f32.gflops;
  peaks.f32Isa = fmt::format("fp32 FMA, {}", f32.isa);
  if (const std::optional<cpu::FmaPeak> bf16 = cpu::measureBf16DotPeak(seconds)) {
    peaks.bf16 = bf16->gflops;
    peaks.bf16Isa = fmt::format("bf16 dot products, {}", bf16->isa);
  } else {
    peaks.bf16 = peaks.f32;
    peaks.bf16Isa = "no bf16 products: bf16 widens to fp32";
  }
  return peaks;
}

std::vector<SlowTask> slowTasks(const std::vector<TaskCost> &runs, double ratio,
                                int64_t minExcessNs) {
  // Each op's median time per unit of work, over its runs with work.
  std::map<uint32_t, std::vector<double>> perWork;
  for (const TaskCost &run : runs)
    if (run.work > 0)
      perWork[run.op].push_back(double(run.ns) / run.work);
  std::map<uint32_t, double> median;
  for (auto &[op, values] : perWork) {
    const auto half = values.begin() + ptrdiff_t(values.size() / 2);
    std::nth_element(values.begin(), half, values.end());
    median[op] = *half;
  }
  std::vector<SlowTask> slow;
  for (size_t i = 0; i < runs.size(); ++i) {
    const TaskCost &run = runs[i];
    if (run.work <= 0)
      continue;
    const double expected = median[run.op] * run.work;
    if (expected > 0 && double(run.ns) >= ratio * expected &&
        double(run.ns) - expected >= double(minExcessNs))
      slow.push_back({i, expected});
  }
  const auto excess = [&](const SlowTask &t) { return double(runs[t.index].ns) - t.expectedNs; };
  std::stable_sort(slow.begin(), slow.end(),
                   [&](const SlowTask &a, const SlowTask &b) { return excess(a) > excess(b); });
  return slow;
}

namespace {

/// What one op did in the pass.
struct OpLine {
  uint64_t runs = 0;
  int64_t busyNs = 0;
  double flops = 0, bytes = 0;
};

std::string quantity(double value, const char *unit) {
  if (value >= 1e9)
    return fmt::format("{:.2f} G{}", value * 1e-9, unit);
  if (value >= 1e6)
    return fmt::format("{:.2f} M{}", value * 1e-6, unit);
  if (value >= 1e3)
    return fmt::format("{:.2f} k{}", value * 1e-3, unit);
  return fmt::format("{:.0f} {}", value, unit);
}

} // namespace

Status profileText(const rt::Context &context, rt::TracedPass which, const Peaks &peaks,
                   std::string *out) {
  if (which == rt::TracedPass::Last)
    return Status::error("profile: name the pass (forward or backward)");
  const bool backward = which == rt::TracedPass::Backward;
  const trace::Trace &trace = context.trace(which);
  const std::shared_ptr<const rt::Program> program = context.program(which);
  if (!program || trace.tasks.empty())
    return Status::error(fmt::format("profile: no traced {} pass (trace it: ContextOptions::"
                                     "trace, moec run --profile)",
                                     backward ? "backward" : "forward"));
  const format::TaskProgram &tasks = program->tasks();
  const LayerShape &shape = context.shape();
  const uint32_t R = context.ranks(), L = uint32_t(shape.localExperts);
  // Rows each rank sends each expert; rows each local expert receives.
  std::vector<const std::vector<int64_t> *> routed(R);
  for (uint32_t r = 0; r < R; ++r) {
    routed[r] = &context.routedRows(r);
    if (routed[r]->size() != size_t(R) * L)
      return Status::error("profile: the routing of the last forward pass is not known");
  }
  const auto received = [&](uint32_t rank, uint32_t expert) {
    int64_t rows = 0;
    for (uint32_t q = 0; q < R; ++q)
      rows += (*routed[q])[size_t(rank) * L + expert];
    return rows;
  };
  // The rows of a tile of `rank`: of the `rows` it cuts, or with peer groups
  // of its group's (format::peerGroupRows, from the rows each EP rank sent).
  const uint32_t epRanks = tasks.epRanks, tp = tasks.tpRanks;
  std::vector<int64_t> starts(epRanks + 1);
  const auto clip = [&](const format::TilingRecord &tiling, const format::TileCoord &tile,
                        int64_t rows, uint32_t rank) {
    if (!format::hasPeerGroups(tiling))
      return double(format::tileRows(tiling, tile, uint64_t(std::max<int64_t>(rows, 0))).size());
    const size_t expert = size_t(tasks.epOf(rank)) * L + tile.expert;
    for (uint32_t q = 0; q < epRanks; ++q)
      starts[q + 1] = starts[q] + (*routed[size_t(q) * tp])[expert];
    return double(
        format::peerGroupRows(tiling, tile, tasks.epOf(rank), epRanks, starts.data()).size());
  };

  std::vector<OpLine> ops(tasks.ops.size());
  std::vector<TaskCost> costs; // per span, for slowTasks
  costs.reserve(trace.tasks.size());
  const uint32_t workers = context.workers();
  std::vector<int64_t> workerBusy(workers, 0), workerOff(workers, 0);
  // Whether the trace says how long each run's worker was off its core (a
  // measured trace does).
  bool offKnown = !trace.tasks.empty();
  int64_t offAll = 0;
  for (const trace::TaskSpan &span : trace.tasks) {
    const uint32_t opIndex = tasks.tasks[span.task].op;
    const format::OpRecord &op = tasks.ops[opIndex];
    const format::TilingRecord &tiling = tasks.tilings[op.tiling];
    const format::TileCoord tile = format::tileCoord(tiling, span.task - op.firstTask);
    const double cols = double(tile.colEnd - tile.colBegin);
    const int64_t ns = span.endNs - span.startNs;
    OpLine &line = ops[opIndex];
    ++line.runs;
    line.busyNs += ns;
    if (span.worker < workers)
      workerBusy[span.worker] += ns;
    if (span.offCoreNs < 0)
      offKnown = false;
    else {
      offAll += span.offCoreNs;
      if (span.worker < workers)
        workerOff[span.worker] += span.offCoreNs;
    }
    const double segment = tiling.experts > 1 || L == 1 ? double(received(span.rank, tile.expert))
                                                        : double(tiling.rows);
    double work = 0; // this run's FLOPs (a GMM) or bytes
    switch (op.kind) {
    case OpKind::Gmm:
      if (tiling.depth > 0) { // (and a low-rank product's depth, U's columns)
        const double rows = clip(tiling, tile, int64_t(segment), span.rank);
        const double r = double(format::lowRankDepth(tasks, tiling));
        work = 2 * rows * cols * (double(tiling.depth) + r);
        // A lead product's U (format::leadOp), by every column tile.
        if (r > 0 && format::leadOp(tasks, opIndex) != format::kNone)
          work += 2 * rows * r * double(tiling.depth);
      } else // a weight gradient: reduces over the expert's rows
        work = 2 * double(tile.rowEnd - tile.rowBegin) * cols * segment;
      break;
    case OpKind::Swiglu:
    case OpKind::SwigluGrad:
      work = clip(tiling, tile, int64_t(segment), span.rank) * cols *
             double(format::dtypeSize(tasks.slots[tiling.outputSlot].dtype)) *
             double(tiling.inputCount + 1);
      break;
    case OpKind::Quantize:
    case OpKind::Dequantize: // read one type, write the other
      work = clip(tiling, tile, int64_t(segment), span.rank) * cols *
             double(format::dtypeSize(tasks.slots[tiling.inputSlots[0]].dtype) +
                    format::dtypeSize(tasks.slots[tiling.outputSlot].dtype));
      break;
    case OpKind::Dispatch:
    case OpKind::Combine: {
      const uint32_t peer = tasks.peerRank(span.rank, tile.peer);
      const int64_t rows = op.kind == OpKind::Dispatch
                               ? (*routed[span.rank])[size_t(peer) * L + tile.expert]
                               : (*routed[peer])[size_t(span.rank) * L + tile.expert];
      work = clip(tiling, tile, rows, span.rank) * cols *
             double(format::dtypeSize(tasks.slots[tiling.outputSlot].dtype));
      break;
    }
    }
    (op.kind == OpKind::Gmm ? line.flops : line.bytes) += work;
    costs.push_back({opIndex, ns, work});
  }

  const rt::PassTimes &times = backward ? context.backwardTimes() : context.forwardTimes();
  const int64_t tasksNs = int64_t(times.tasks * 1e9);
  int64_t busyAll = 0;
  for (const OpLine &line : ops)
    busyAll += line.busyNs;
  std::string text = fmt::format(
      "{} pass: {:.3f} ms (prepare {:.3f}, tasks {:.3f}, finish {:.3f}); {} worker thread{}, "
      "{} local rank{}\n"
      "peaks of one core: {:.1f} GFLOP/s ({}), bf16 {:.1f} GFLOP/s ({})\n",
      backward ? "backward" : "forward", times.total() * 1e3, times.prepare * 1e3,
      times.tasks * 1e3, times.finish * 1e3, workers, workers == 1 ? "" : "s",
      context.localRanks(), context.localRanks() == 1 ? "" : "s", peaks.f32, peaks.f32Isa,
      peaks.bf16, peaks.bf16Isa);
  text += fmt::format("  {:<16} {:<12} {:>6} {:>10} {:>7} {:>14} {:>16} {:>8}\n", "op", "kind",
                      "tasks", "busy ms", "share", "work", "rate per core", "of peak");
  for (size_t i = 0; i < ops.size(); ++i) {
    const OpLine &line = ops[i];
    const format::OpRecord &op = tasks.ops[i];
    const double seconds = double(line.busyNs) * 1e-9;
    std::string work, rate, share;
    if (const uint32_t host = format::leadHost(tasks, uint32_t(i)); host != format::kNone) {
      // A lead product: its work and time are its host's.
      text += fmt::format("  {:<16} {:<12} {:>6} {:>10} {:>7} {:>14} {:>16} {:>8}\n",
                          std::string(tasks.name(op.name)), format::opKindName(op.kind), 0, "-",
                          "-", "-", fmt::format("in {}", tasks.name(tasks.ops[host].name)), "-");
      continue;
    }
    if (op.kind == OpKind::Gmm) {
      const bool bf16 = tasks.tilings[op.tiling].dtype == format::DType::BF16;
      const double gflops = seconds > 0 ? line.flops / seconds * 1e-9 : 0;
      work = quantity(line.flops, "FLOP");
      rate = fmt::format("{:.1f} GFLOP/s", gflops);
      const double peak = bf16 ? peaks.bf16 : peaks.f32;
      share = peak > 0 ? fmt::format("{:.0f}%", 100 * gflops / peak) : "-";
    } else {
      work = quantity(line.bytes, "B");
      rate = fmt::format("{:.2f} GB/s", seconds > 0 ? line.bytes / seconds * 1e-9 : 0);
      share = "-";
    }
    text += fmt::format("  {:<16} {:<12} {:>6} {:>10.3f} {:>6.1f}% {:>14} {:>16} {:>8}\n",
                        std::string(tasks.name(op.name)), format::opKindName(op.kind),
                        line.runs, seconds * 1e3,
                        busyAll > 0 ? 100.0 * double(line.busyNs) / double(busyAll) : 0.0, work,
                        rate, share);
  }
  text += fmt::format("  busy {:.3f} ms of {} x {:.3f} ms in the task program ({:.0f}%)\n",
                      double(busyAll) * 1e-6, workers, double(tasksNs) * 1e-6,
                      tasksNs > 0 ? 100.0 * double(busyAll) / (double(tasksNs) * workers) : 0.0);
  // A run's time off its core (its worker's thread descheduled while it
  // ran) is in its op's busy time and rate: the machine's, not the op's.
  if (offKnown)
    text += fmt::format("  of that busy time {:.3f} ms ({:.1f}%) off the cores: the OS ran other "
                        "threads on them while the runs were under way\n",
                        double(offAll) * 1e-6,
                        busyAll > 0 ? 100.0 * double(offAll) / double(busyAll) : 0.0);
  text += "workers (in the task program):\n";
  for (uint32_t w = 0; w < workers; ++w) {
    text += fmt::format("  worker {:<3} busy {:>9.3f} ms, idle {:>9.3f} ms", w,
                        double(workerBusy[w]) * 1e-6,
                        double(std::max<int64_t>(0, tasksNs - workerBusy[w])) * 1e-6);
    if (offKnown)
      text += fmt::format(", off its core in runs {:>8.3f} ms", double(workerOff[w]) * 1e-6);
    text += "\n";
  }
  // Runs far past their op's others (slowTasks), with where and when they
  // ran: several at once on every worker point at the machine, not the tasks.
  constexpr double kSlowRatio = 3;
  constexpr int64_t kSlowExcessNs = 500000;
  constexpr size_t kSlowShown = 6;
  const std::vector<SlowTask> slow = slowTasks(costs, kSlowRatio, kSlowExcessNs);
  double pastNs = 0, slowOffNs = 0;
  for (const SlowTask &t : slow) {
    pastNs += double(costs[t.index].ns) - t.expectedNs;
    slowOffNs += double(std::max<int64_t>(0, trace.tasks[t.index].offCoreNs));
  }
  text +=
      fmt::format("task runs that took {:.0f}x or more their op's median time for their work "
                  "({} in all, {:.3f} ms past that median{}):\n",
                  kSlowRatio, slow.size(), pastNs * 1e-6,
                  offKnown && !slow.empty()
                      ? fmt::format("; off their cores {:.3f} ms of their time", slowOffNs * 1e-6)
                      : std::string());
  if (slow.empty())
    text += "  none\n";
  for (size_t n = 0; n < slow.size() && n < kSlowShown; ++n) {
    const trace::TaskSpan &span = trace.tasks[slow[n].index];
    const TaskCost &cost = costs[slow[n].index];
    const format::OpRecord &op = tasks.ops[cost.op];
    const format::TileCoord tile =
        format::tileCoord(tasks.tilings[op.tiling], span.task - op.firstTask);
    text += fmt::format(
        "  {:<16} rank {} expert {:<4} worker {:<3} {:>9.3f} ms into the pass: {:.3f} ms, "
        "{:.1f}x{}\n",
        std::string(tasks.name(op.name)), span.rank, tile.expert, span.worker,
        double(span.startNs) * 1e-6, double(cost.ns) * 1e-6, double(cost.ns) / slow[n].expectedNs,
        span.offCoreNs >= 0
            ? fmt::format(", {:.3f} ms of it off its core", double(span.offCoreNs) * 1e-6)
            : std::string());
  }
  if (slow.size() > kSlowShown)
    text += fmt::format("  and {} more\n", slow.size() - kSlowShown);
  // Parked cores by event, with who signalled them.
  struct WaitLine {
    int64_t ns = 0;
    uint64_t count = 0;
    std::set<uint32_t> signallers;
    bool unknown = false;
  };
  std::map<uint32_t, WaitLine> waits;
  for (const trace::WaitSpan &span : trace.waits) {
    WaitLine &line = waits[span.event];
    line.ns += span.endNs - span.beginNs;
    ++line.count;
    if (span.signalRank == trace::kUnknown)
      line.unknown = true;
    else
      line.signallers.insert(span.signalRank);
  }
  std::vector<std::pair<uint32_t, WaitLine>> sorted(waits.begin(), waits.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto &a, const auto &b) { return a.second.ns > b.second.ns; });
  // A parked core is a queue of the task program, not a worker: the workers
  // run other cores' tasks meanwhile, and an event's waits, summed over the
  // cores that waited on it, can add up to more than the pass.
  text += fmt::format("waits of parked cores, by event ({} in all; the workers run other cores' "
                      "tasks meanwhile: their idle time above is what waiting cost):\n",
                      trace.waits.size());
  if (sorted.empty())
    text += "  none\n";
  for (size_t i = 0; i < sorted.size() && i < 8; ++i) {
    const auto &[event, line] = sorted[i];
    std::vector<uint32_t> from(line.signallers.begin(), line.signallers.end());
    text += fmt::format("  {:<24} {:>9.3f} ms over {:>4} waits, ended by rank{} {}{}\n",
                        std::string(tasks.name(tasks.events[event].name)),
                        double(line.ns) * 1e-6, line.count, from.size() == 1 ? "" : "s",
                        from.empty() ? std::string("-") : fmt::format("{}", fmt::join(from, ", ")),
                        line.unknown ? " (and signals of unknown origin)" : "");
  }
  if (sorted.size() > 8)
    text += fmt::format("  and {} more events\n", sorted.size() - 8);
  *out = std::move(text);
  return Status::success();
}

} // namespace moec::tooling
