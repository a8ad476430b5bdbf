//===- Compile.cpp - Graph to task program, the whole compiler ------------===//
//
// See Compile.h.
//
//===----------------------------------------------------------------------===//

#include "compiler/driver/Compile.h"

#include "compiler/import/GraphJson.h"
#include "compiler/ir/MoeDialect.h"
#include "compiler/target/Cost.h"
#include "compiler/target/Simulate.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <optional>

namespace moec::driver {

namespace {

using LowerAndSchedule =
    std::function<Status(format::TaskProgram *, target::ScheduleEstimate *)>;

} // namespace

std::string splitNotes(const CompileResult &result) {
  std::string text = fmt::format(
      "automatic splits: {} candidates tried; of those within 2% of the shortest estimated "
      "makespan, the shortest critical path, then the fewest tasks, was picked; where the target "
      "shares a link or its cores, the pick, the best without peer groups, the two shortest "
      "estimates and those within 20% of the shortest estimate with a critical path over 1% "
      "shorter than the pick's were simulated, and the same rule, within 3%, picked among their runs "
      "(*)\n"
      "  cube tasks/core  gmm rows  wgrad tasks/core  vector tasks/core  put rows  peer groups  "
      " tasks  makespan ms  critical path ms  simulated ms",
      result.candidates.size());
  for (size_t i = 0; i < result.candidates.size(); ++i) {
    const SplitCandidate &c = result.candidates[i];
    text += fmt::format("\n{} {:>15} {:>9} {:>17} {:>18} {:>9} {:>12} {:>7} {:>12.3f} {:>17.3f} "
                        "{:>13}",
                        i == result.chosen ? '*' : ' ', c.cubeTasksPerCore, c.gmmRows,
                        c.weightGradPerCore(),
                        c.vectorTasksPerCore, c.putRows, c.peerGroups, c.tasks,
                        c.makespan * 1e3, c.criticalPath * 1e3,
                        c.simulated > 0 ? fmt::format("{:.3f}", c.simulated * 1e3) : "-");
  }
  return text;
}

namespace {

/// The tile grids of every op of the module's graph, in order: candidates
/// with the same grids lower to the same program.
std::vector<int64_t> gridsOf(mlir::ModuleOp module) {
  std::vector<int64_t> grids;
  for (moe::GraphOp graph : module.getOps<moe::GraphOp>())
    for (moe::TaskOpInterface op : graph.getBlock().getOps<moe::TaskOpInterface>())
      if (mlir::DenseI64ArrayAttr grid = op.getGridAttr())
        grids.insert(grids.end(), grid.asArrayRef().begin(), grid.asArrayRef().end());
  return grids;
}

/// The pass options of a candidate on `profile`.
moe::PropagateSplitsOptions optionsOf(const SplitCandidate &c,
                                      const target::TargetProfile &profile) {
  moe::PropagateSplitsOptions options = moe::splitOptionsFor(profile);
  options.cubeTasksPerCore = c.cubeTasksPerCore;
  options.vectorTasksPerCore = c.vectorTasksPerCore;
  options.putRows = c.putRows;
  options.gmmRows = c.gmmRows;
  options.peerGroups = c.peerGroups;
  options.weightGradTasksPerCore = c.weightGradTasksPerCore;
  return options;
}

/// The automatic splits' options to try: GMM tiles per cube core and rows
/// per GMM tile (at the pass's defaults for the rest), then peer groups
/// (when the caller fixed none), twice the weight-gradient tiles (a graph
/// with weight gradients), SwiGLU tiles per vector core and rows per put
/// tile, each around the best so far. Each candidate reruns split
/// propagation, lowering and scheduling. Of the candidates whose estimated
/// makespan is within 2% of the shortest, the one with the shortest
/// critical path wins (the least exposed to a late tile), then the one with
/// the fewest tasks; where the target shares a link or its cores, the same
/// rule then picks among the timed runs of finalists (below).
Status chooseSplits(mlir::ModuleOp module, const LowerAndSchedule &lowerAndSchedule,
                    int64_t peerGroups, const ModelConfig &config,
                    const target::TargetProfile &profile,
                    CompileResult *result) {
  const moe::PropagateSplitsOptions defaults = moe::splitOptionsFor(profile);
  const TaskSplitValue split = deriveTaskSplitValue(config);
  const int64_t epRanks = config.ep;
  // The rows an expert's segment holds under balanced routing.
  const int64_t segmentRows = split.perRankSeq / std::max<int64_t>(1, split.singleRankExpertNum);
  std::vector<format::TaskProgram> programs;
  std::vector<target::ScheduleEstimate> estimates;
  std::vector<std::vector<int64_t>> grids; // of each candidate
  result->candidates.clear();
  // The index of the candidate with the shortest estimated makespan.
  auto fastest = [&] {
    size_t best = 0;
    for (size_t i = 1; i < result->candidates.size(); ++i)
      if (result->candidates[i].makespan < result->candidates[best].makespan)
        best = i;
    return best;
  };
  auto tryCandidate = [&](SplitCandidate c) -> Status {
    for (const SplitCandidate &d : result->candidates)
      if (d.sameOptions(c))
        return Status::success();
    format::TaskProgram program;
    target::ScheduleEstimate estimate;
    if (result->candidates.empty() && c.peerGroups == defaults.peerGroups) {
      // The graph pipeline ran the pass at its defaults.
      program = std::move(result->program);
      estimate = result->estimate;
      grids.push_back(gridsOf(module));
    } else {
      mlir::PassManager pm(module.getContext());
      pm.addPass(moe::createPropagateSplits(optionsOf(c, profile)));
      if (mlir::failed(pm.run(module)))
        return Status::error("the graph passes failed");
      grids.push_back(gridsOf(module));
      // Options that cut every op as an earlier candidate did give its
      // program again.
      const auto same = std::find(grids.begin(), grids.end() - 1, grids.back());
      if (same != grids.end() - 1) {
        program = programs[size_t(same - grids.begin())];
        estimate = estimates[size_t(same - grids.begin())];
      } else if (Status status = lowerAndSchedule(&program, &estimate); !status) {
        return status;
      }
    }
    c.makespan = estimate.makespan;
    c.criticalPath = estimate.criticalPath;
    c.tasks = program.tasks.size();
    result->candidates.push_back(c);
    programs.push_back(std::move(program));
    estimates.push_back(estimate);
    return Status::success();
  };
  // Peer groups as the pass takes them: at most one a rank.
  SplitCandidate first{defaults.cubeTasksPerCore, defaults.vectorTasksPerCore, defaults.putRows,
                       defaults.gmmRows,
                       peerGroups > 0 ? std::min(peerGroups, epRanks) : defaults.peerGroups};
  if (Status s = tryCandidate(first); !s)
    return s;
  for (int64_t cube : {1, 2, 4})
    for (int64_t rows : {int64_t(128), int64_t(1024)}) {
      SplitCandidate c = first;
      c.cubeTasksPerCore = cube;
      c.gmmRows = rows;
      if (Status s = tryCandidate(c); !s)
        return s;
    }
  if (peerGroups == 0) {
    // At most one group a rank, and at least the candidate's gmm-rows
    // balanced rows a group: a smaller GMM tile packs its weight panel for
    // too few rows (the cost model's tiles are compute-bound there, a CPU's
    // are not). The pass itself takes any count up to one a rank.
    const SplitCandidate best = result->candidates[fastest()];
    for (int64_t groups : {int64_t(4), int64_t(16)})
      if (epRanks > groups / 4) { // 4 from EP 2, 16 from EP 5
        SplitCandidate c = best;
        c.peerGroups = std::max<int64_t>(
            1, std::min({groups, epRanks, segmentRows / std::max<int64_t>(1, c.gmmRows)}));
        if (Status s = tryCandidate(c); !s)
          return s;
      }
  }
  const bool weightGradients = llvm::any_of(
      module.getOps<moe::GraphOp>(), [](moe::GraphOp graph) {
        return llvm::any_of(graph.getBlock().getOps<moe::GmmOp>(),
                            [](moe::GmmOp gmm) { return gmm.isWeightGradient(); });
      });
  if (weightGradients) {
    // A weight gradient reduces over all of its expert's rows, so with few
    // experts a rank its tiles are long and come last: twice the tiles may
    // share the cores better, or read their operands too often.
    SplitCandidate c = result->candidates[fastest()];
    c.weightGradTasksPerCore = 2 * c.cubeTasksPerCore;
    if (Status s = tryCandidate(c); !s)
      return s;
  }
  for (int64_t vector : {1, 4}) {
    SplitCandidate c = result->candidates[fastest()];
    c.vectorTasksPerCore = vector;
    if (Status s = tryCandidate(c); !s)
      return s;
  }
  for (int64_t putRows : {64, 128, 1024}) {
    SplitCandidate c = result->candidates[fastest()];
    c.putRows = putRows;
    if (Status s = tryCandidate(c); !s)
      return s;
  }
  // Of the candidates `eligible` admits, the first within `tolerance` of
  // the shortest makespan (`makespanOf`), in the order tried, then the
  // shortest critical path, then the fewest tasks.
  using Makespan = std::function<double(const SplitCandidate &)>;
  const Makespan estimated = [](const SplitCandidate &c) { return c.makespan; };
  auto pick = [&](const std::function<bool(const SplitCandidate &)> &eligible,
                  const Makespan &makespanOf, double tolerance) {
    std::optional<size_t> best;
    for (size_t i = 0; i < result->candidates.size(); ++i)
      if (eligible(result->candidates[i]) &&
          (!best || makespanOf(result->candidates[i]) < makespanOf(result->candidates[*best])))
        best = i;
    if (!best)
      return best;
    const double bound = makespanOf(result->candidates[*best]) * (1 + tolerance);
    std::optional<size_t> chosen;
    for (size_t i = 0; i < result->candidates.size(); ++i) {
      const SplitCandidate &c = result->candidates[i];
      if (!eligible(c) || makespanOf(c) > bound)
        continue;
      if (!chosen)
        chosen = i;
      const SplitCandidate &b = result->candidates[*chosen];
      if (c.criticalPath < b.criticalPath * 0.99 ||
          (c.criticalPath <= b.criticalPath * 1.01 && c.tasks < b.tasks))
        chosen = i;
    }
    return chosen;
  };
  auto any = [](const SplitCandidate &) { return true; };
  size_t chosen = *pick(any, estimated, 0.02);
  // Where puts share a link or cube and vector tasks share cores, the
  // estimate (a list schedule) can be off by several percent from the timed
  // run of the fixed queues: the finalists are simulated, and the same rule
  // picks among their runs, within 3% of the shortest: a critical path a
  // third shorter is worth that much, as a late tile (a skewed expert, a
  // slow peer) then delays the pass less. The finalists are the pick, the
  // pick without peer groups, the two shortest estimates and those within
  // 20% of the shortest estimate with a critical path over 1% shorter than
  // the pick's.
  if (profile.linkTotalBytes > 0 || profile.sharing == target::CoreSharing::Rank) {
    std::vector<size_t> finalists = {chosen};
    auto add = [&](std::optional<size_t> i) {
      if (i && std::find(finalists.begin(), finalists.end(), *i) == finalists.end())
        finalists.push_back(*i);
    };
    add(pick([](const SplitCandidate &c) { return c.peerGroups == 1; }, estimated, 0.02));
    std::vector<size_t> byEstimate(result->candidates.size());
    for (size_t i = 0; i < byEstimate.size(); ++i)
      byEstimate[i] = i;
    std::stable_sort(byEstimate.begin(), byEstimate.end(), [&](size_t a, size_t b) {
      return result->candidates[a].makespan < result->candidates[b].makespan;
    });
    for (size_t k = 0; k < std::min<size_t>(2, byEstimate.size()); ++k)
      add(byEstimate[k]);
    const double near = result->candidates[byEstimate[0]].makespan * 1.2;
    const double shorter = result->candidates[chosen].criticalPath * 0.99;
    for (size_t i = 0; i < result->candidates.size(); ++i)
      if (result->candidates[i].makespan <= near && result->candidates[i].criticalPath < shorter)
        add(i);
    for (size_t i : finalists) {
      target::TimedRun run =
          target::simulateTimed(programs[i], target::costModel(programs[i], profile));
      result->candidates[i].simulated = run.ok() ? run.makespan : 0;
    }
    if (std::optional<size_t> best =
            pick([](const SplitCandidate &c) { return c.simulated > 0; },
                 [](const SplitCandidate &c) { return c.simulated; }, 0.03))
      chosen = *best;
  }
  result->chosen = chosen;
  result->program = std::move(programs[chosen]);
  result->estimate = estimates[chosen];
  result->program.flags |= format::kFlagNotes;
  result->program.notes = result->program.addString(splitNotes(*result));
  // The module ends with the chosen splits, as the program has them.
  mlir::PassManager pm(module.getContext());
  pm.addPass(moe::createPropagateSplits(optionsOf(result->candidates[chosen], profile)));
  if (mlir::failed(pm.run(module)))
    return Status::error("the graph passes failed");
  return Status::success();
}

} // namespace

Status compileModule(mlir::ModuleOp module, const CompileOptions &options, CompileResult *out) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point mark = Clock::now();
  std::vector<std::pair<const char *, double>> phases;
  auto phase = [&](const char *name) {
    Clock::time_point now = Clock::now();
    phases.push_back({name, std::chrono::duration<double, std::milli>(now - mark).count()});
    mark = now;
  };
  auto starting = [&](const char *name) {
    if (options.onStep)
      options.onStep(name);
  };

  CompileResult result;
  lower::LowerOptions lowerOptions;
  if (Status status = target::loadConfigForTarget(options.configPath, options.target,
                                                  &result.config, &lowerOptions.profile);
      !status)
    return status;
  lowerOptions.granularity = options.granularity;
  lowerOptions.leadProducts = options.leadProducts;
  lowerOptions.layer = layerRecord(result.config);
  result.profile = lowerOptions.profile;

  starting("graph passes");
  mlir::PassManager pm(module.getContext());
  moe::buildGraphPipeline(pm, result.config, options.configPath,
                          moe::splitOptionsFor(lowerOptions.profile),
                          moe::fusesLowRank(lowerOptions.profile));
  if (mlir::failed(pm.run(module)))
    return Status::error("the graph passes failed");
  phase("graph passes");
  auto graphs = module.getOps<moe::GraphOp>();
  if (graphs.empty())
    return Status::error("the module holds no moe.graph");
  moe::GraphOp graph = *graphs.begin();
  result.graphName = graph.getSymName().str();
  // Lowers and schedules the graph as its splits now stand; `timed` marks
  // the phases.
  auto lowerAndSchedule = [&](format::TaskProgram *program, target::ScheduleEstimate *estimate,
                              bool timed) -> Status {
    if (timed)
      starting("lower");
    if (mlir::failed(lower::lowerGraph(graph, lowerOptions, program)))
      return Status::error("lowering failed");
    if (timed) {
      phase("lower");
      starting("schedule");
    }
    if (Status status = target::scheduleQueues(program, lowerOptions.profile,
                                               uint32_t(result.config.numCubeCores),
                                               uint32_t(result.config.numVectorCores), estimate);
        !status)
      return status;
    if (timed)
      phase("schedule");
    return Status::success();
  };
  if (Status status = lowerAndSchedule(&result.program, &result.estimate, true); !status)
    return status;
  if (llvm::any_of(graph.getBlock().getOps<moe::TaskOpInterface>(),
                   [](moe::TaskOpInterface op) { return op.isAutoSplit(); })) {
    starting("choose splits");
    if (Status status = chooseSplits(
            module,
            [&](format::TaskProgram *program, target::ScheduleEstimate *estimate) {
              return lowerAndSchedule(program, estimate, false);
            },
            options.peerGroups, result.config, lowerOptions.profile, &result);
        !status)
      return status;
    phase("choose splits");
  }
  starting("deadlock proof");
  if (Status status = target::proveDeadlockFree(result.program); !status)
    return status;
  phase("deadlock proof");
  if (Status status = format::validateTaskProgram(result.program); !status)
    return Status::error("the compiled program is invalid: " + status.message());
  result.phases = std::move(phases);
  *out = std::move(result);
  return Status::success();
}

Status compileGraphFile(const std::string &graphPath, const CompileOptions &options,
                        CompileResult *out) {
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler(&context, [&](mlir::Diagnostic &diag) {
    if (diag.getSeverity() == mlir::DiagnosticSeverity::Error)
      diagnostics += diag.str() + "\n";
    return mlir::success();
  });
  context.printOpOnDiagnostic(false);
  mlir::OwningOpRef<mlir::ModuleOp> module = loadGraph(graphPath, &context);
  if (!module)
    return Status::error(graphPath + ": " + diagnostics);
  Status status = compileModule(*module, options, out);
  if (!status && !diagnostics.empty())
    return Status::error(status.message() + ": " + diagnostics);
  return status;
}

} // namespace moec::driver
