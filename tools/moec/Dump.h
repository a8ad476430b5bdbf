//===- Dump.h - What `moec dump` prints about a task program ---*- C++ -*-===//
//
// The formatting behind `moec dump`: a task program's header, tensor slots,
// ops and their tile grids, events, per-core queues, and statistics (task
// counts, critical path, simulated makespan, queue balance), as text, as one
// JSON object, or as the task graph in Graphviz dot. The command reads the
// file and parses options; everything it prints is made here, so tests can
// call it on a program built by hand.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TOOLS_MOEC_DUMP_H
#define MOEC_TOOLS_MOEC_DUMP_H

#include "compiler/target/Profile.h"
#include "compiler/target/Simulate.h"
#include "base/Status.h"
#include "runtime/format/TaskBinary.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moec::dump {

/// One core, as `--core` names it: "cube:3", "vector:0".
struct CoreSelector {
  format::CoreKind kind = format::CoreKind::Cube;
  uint32_t index = 0;
};

/// Parses "cube:N" or "vector:N" (N a decimal index) into *out. Fails with a
/// message that quotes `text` and says what is expected.
Status parseCoreSelector(const std::string &text, CoreSelector *out);

/// What the file says about itself beyond the program: its path, size and
/// the CRC-32 of its header.
struct FileFacts {
  std::string path;
  uint64_t fileSize = 0;
  uint32_t crc32 = 0;
};

/// Returns the facts of the file the writer makes from `program` (its size
/// and checksum), named `path`.
FileFacts factsOf(const format::TaskProgram &program, const std::string &path);

/// What to print.
struct DumpOptions {
  /// Print only this core's queue, in full. Without it every queue is
  /// printed, its first `queuePreview` tasks and then "... N more".
  std::optional<CoreSelector> core;

  /// Resolve rank-relative fields for this rank: peer offsets become peer
  /// ranks, local experts global experts (rank * L + e).
  std::optional<uint32_t> rank;

  /// The tasks printed per queue when no core is selected (text only; JSON
  /// always has every task).
  size_t queuePreview = 6;

  /// Draw only the tasks of these ops (dot only); empty: every op.
  std::vector<std::string> ops;

  /// JSON: every queue's tasks as rows of a table (the columns are
  /// kCompactEntryColumns, waits and signals as [event, threshold] and
  /// [event, increment, peer offset]), names only in "ops" and "events".
  bool compact = false;
};

/// The columns of a task row in the compact JSON (DumpOptions::compact).
inline constexpr const char *kCompactEntryColumns[] = {
    "task",     "op_index", "expert",    "peer",      "row_tile", "col_tile",
    "row_begin", "row_end", "col_begin", "col_end",   "cost",     "start",
    "finish",   "waits",    "signals"};

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

/// Checks `options` against `program`: the selected core has a queue (else
/// "the binary has no cube core 9 (its cube cores are 0..7)") and the rank
/// is below the EP group's size.
Status checkDumpOptions(const format::TaskProgram &program, const DumpOptions &options);

/// Returns the text dump: header, slots, ops, events, queues, statistics.
/// `options` must have passed checkDumpOptions.
std::string dumpText(const format::TaskProgram &program, const FileFacts &facts,
                     const DumpOptions &options, const Analysis &analysis);

/// Returns the same as one JSON object, with every queue's tasks:
/// {"file", "rank", "profile", "slots", "ops", "events", "queues",
/// "statistics"}. docs/cli.md lists the keys.
nlohmann::ordered_json dumpJson(const format::TaskProgram &program, const FileFacts &facts,
                                const DumpOptions &options, const Analysis &analysis);

/// Beyond this many tasks, `moec dump --dot` warns that graphviz lays the
/// graph out slowly and suggests the filters.
inline constexpr size_t kLargeDotTasks = 2000;

/// Writes the task graph as Graphviz dot to *out: one box per task (its
/// index, op and tile), clustered by queue with dotted edges in queue
/// order, one ellipse per event, edges from each task to the events it
/// signals and from each event to the tasks that wait for it. The filters
/// of `options` (core, ops) select the tasks drawn, with the events they
/// touch; a rank resolves the labels. Fails when an op filter names no op
/// of the program; *drawn is the number of tasks drawn.
Status dumpDot(const format::TaskProgram &program, const DumpOptions &options, std::string *out,
               size_t *drawn = nullptr);

/// Returns the op graph as Graphviz dot: one box per op (its kind, task
/// count and grid), one ellipse per tensor slot, an edge from each input
/// tensor to its op labelled with the waits the op's tiles make on the
/// events of the tensor's producer, and from each op to its output
/// labelled with its tile count.
std::string dumpOpGraph(const format::TaskProgram &program);

/// Returns "12.3 us", "4.56 ms", "1.20 s" (three significant digits).
std::string formatSeconds(double seconds);

/// Returns the ops of a task path as runs of one op: "dispatch x32 → up_proj
/// x1 → swiglu x4", at most `maxRuns` runs and then "→ ... (N more)". With
/// `ranks` (one per task, as TimedRun::criticalPathRanks), a run is also of
/// one rank, and runs not on rank 0 say so: "dispatch x1 on rank 3 → ...".
std::string summarizePath(const format::TaskProgram &program, const std::vector<uint32_t> &tasks,
                          const std::vector<uint32_t> &ranks = {}, size_t maxRuns = 12);

} // namespace moec::dump

#endif // MOEC_TOOLS_MOEC_DUMP_H
