//===- Analysis.h - what a task program costs, simulated --------*- C++ -*-===//
//
// The statistics of a task program: each task's cost from a target
// profile's cost model (or unit costs without one), the timed simulation of
// every rank (makespan, critical path, the deadlock proof's verdict), and
// who signals and waits on each event. `moec dump`, the JSON dump and
// libmoec's inspection calls read it.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_INSPECT_ANALYSIS_H
#define MOEC_COMPILER_INSPECT_ANALYSIS_H

#include "base/Status.h"
#include "compiler/target/Profile.h"
#include "compiler/target/Simulate.h"
#include "format/TaskBinary.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moec::inspect {

/// What the statistics are computed from: task costs and the timed
/// simulation of the whole program.
struct Analysis {
  /// True when a profile gave the costs (seconds); false when every task
  /// costs 1 and the statistics are in task counts.
  bool timed = false;

  /// The profile's name when timed.
  std::string profileName;

  /// Why there is no profile when not timed ("" when timed).
  std::string note;

  /// Per task: its estimated seconds, or 1 when not timed.
  std::vector<double> costs;

  /// The timed simulation (status: the deadlock proof's verdict).
  target::TimedRun run;

  /// Per event: the signals and the waits naming it (counted per task).
  std::vector<uint32_t> signallers, waiters;

  /// What the reader should know about the estimates, e.g. that the
  /// profile's core counts are not the binary's.
  std::vector<std::string> warnings;
};

/// The profile the statistics of `program` are computed with: `target`
/// (a --target argument) when given, else the one the binary's header
/// names. Fails only for a bad `target`; when the header's target cannot be
/// resolved here, *profile is left empty and *note says why.
Status analysisProfile(const format::TaskProgram &program, const std::optional<std::string> &target,
                       std::optional<target::TargetProfile> *profile, std::string *note);

/// Computes the analysis of `program`: with `profile`'s cost model (its
/// shared cores and link), or, when `profile` is null, with unit costs and
/// `note` saying why. With `recordTrace` and a profile, the simulation
/// records its trace (run.trace).
Analysis analyzeProgram(const format::TaskProgram &program, const target::TargetProfile *profile,
                        const std::string &note = "", bool recordTrace = false);

/// Returns a warning when `profile`'s cube or vector core count differs
/// from the number of cube or vector queues of `program` (re-costing a
/// binary with another profile keeps its queues), else "".
std::string coreCountWarning(const format::TaskProgram &program,
                             const target::TargetProfile &profile);

/// The analysis `moec dump` and libmoec make of `program` (read from the
/// file `source`): with the profile of `target` (a --target argument) or
/// else of the binary's header (analysisProfile), and a warning when a
/// given target's core counts are not the binary's (coreCountWarning).
/// With `recordTrace` the simulation records its trace, which needs a
/// profile: without one it fails, naming `source` and why.
Status analyzeBinary(const format::TaskProgram &program, const std::optional<std::string> &target,
                     bool recordTrace, const std::string &source, Analysis *out);

/// Returns "12.3 us", "4.56 ms", "1.20 s" (three significant digits).
std::string formatSeconds(double seconds);

/// Returns the ops of a task path as runs of one op: "dispatch x32 → up_proj
/// x1 → swiglu x4", at most `maxRuns` runs and then "→ ... (N more)". With
/// `ranks` (one per task, as TimedRun::criticalPathRanks), a run is also of
/// one rank, and runs not on rank 0 say so: "dispatch x1 on rank 3 → ...".
std::string summarizePath(const format::TaskProgram &program, const std::vector<uint32_t> &tasks,
                          const std::vector<uint32_t> &ranks = {}, size_t maxRuns = 12);

} // namespace moec::inspect

#endif // MOEC_COMPILER_INSPECT_ANALYSIS_H
