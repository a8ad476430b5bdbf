//===- Compile.h - Graph to task program, the whole compiler ----*- C++ -*-===//
//
// The steps `moec compile` runs, as one call, so the CLI and the tests that
// need fresh binaries (the runtime tests) compile the same way: the graph
// pipeline (resolve shapes, verify, assign slots, propagate splits) for a
// config and target, lowering to a task program, queue scheduling for the
// target's cores, the deadlock proof, and the program's validation.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_DRIVER_COMPILE_H
#define MOEC_COMPILER_DRIVER_COMPILE_H

#include "compiler/config/Config.h"
#include "compiler/lower/Lower.h"
#include "compiler/target/Profile.h"
#include "compiler/target/Schedule.h"
#include "base/Status.h"
#include "format/TaskBinary.h"

#include "mlir/IR/BuiltinOps.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace moec::driver {

/// What to compile for.
struct CompileOptions {
  std::string configPath;  ///< model/parallel config (JSON)
  std::string target = "cpu"; ///< profile name or profile JSON path
  lower::Granularity granularity = lower::Granularity::PerTileRange;
  /// Automatic splits: the peer groups each expert's rows are cut into
  /// (1: none); 0 lets the compiler choose.
  int64_t peerGroups = 0;
  /// Lead products lowered into their hosts' tasks (LowerOptions::
  /// leadProducts); false keeps them GMMs of their own tasks.
  bool leadProducts = true;
  /// Told the name of each step as it starts ("graph passes", "lower",
  /// "schedule", "choose splits" for a graph with automatic splits,
  /// "deadlock proof"): a progress display; may be empty.
  std::function<void(const char *step)> onStep;
};

/// A compiled program and what was learnt on the way.
/// One setting of the automatic splits' options that the compiler tried,
/// and the schedule it gave.
struct SplitCandidate {
  int64_t cubeTasksPerCore = 0, vectorTasksPerCore = 0, putRows = 0, gmmRows = 0;
  int64_t peerGroups = 1;
  int64_t weightGradTasksPerCore = 0; ///< 0: cubeTasksPerCore
  double makespan = 0, criticalPath = 0; ///< seconds, the scheduler's estimate
  double simulated = 0; ///< seconds, the timed simulation's makespan (0: not run)
  uint64_t tasks = 0;

  /// Weight-gradient GMM tiles per cube core (moe-propagate-splits'
  /// weight-grad-tasks-per-core, 0 taking cube-tasks-per-core).
  int64_t weightGradPerCore() const {
    return weightGradTasksPerCore > 0 ? weightGradTasksPerCore : cubeTasksPerCore;
  }

  /// Whether `o` asks moe-propagate-splits for the same splits.
  bool sameOptions(const SplitCandidate &o) const {
    return cubeTasksPerCore == o.cubeTasksPerCore && gmmRows == o.gmmRows &&
           vectorTasksPerCore == o.vectorTasksPerCore && putRows == o.putRows &&
           peerGroups == o.peerGroups && weightGradPerCore() == o.weightGradPerCore();
  }
};

struct CompileResult {
  format::TaskProgram program;
  target::ScheduleEstimate estimate;
  /// With automatic splits: every candidate tried, in order, and the one
  /// taken (its program is `program`). Empty for a graph without them.
  std::vector<SplitCandidate> candidates;
  size_t chosen = 0;
  ModelConfig config;                    ///< with core counts filled in
  target::TargetProfile profile;
  std::string graphName;
  std::vector<std::pair<const char *, double>> phases; ///< milliseconds each
};

/// The table of the automatic splits' candidates that a binary keeps in
/// its notes (TaskProgram::notes) and `moec dump` shows.
std::string splitNotes(const CompileResult &result);

/// Compiles the graph in `module` (which the pipeline rewrites). Returns an
/// error for a bad config, profile, schedule or proof; errors the passes
/// report go to the module's diagnostic handler, and the returned message then
/// says which step failed.
Status compileModule(mlir::ModuleOp module, const CompileOptions &options, CompileResult *out);

/// Loads the graph at `graphPath` (.json or .mlir) and compiles it; the
/// diagnostics of loading and of the passes are part of the returned error.
Status compileGraphFile(const std::string &graphPath, const CompileOptions &options,
                        CompileResult *out);

} // namespace moec::driver

#endif // MOEC_COMPILER_DRIVER_COMPILE_H
