//===- Dump.h - what `moec dump` prints about a task program ---*- C++ -*-===//
//
// The formatting behind `moec dump`: a task program's header, tensor slots,
// ops and their tile grids, events, per-core queues, and statistics (task
// counts, critical path, simulated makespan, queue balance), as text, as one
// JSON object, or as the task graph in Graphviz dot (Text.cpp, Json.cpp,
// Dot.cpp). The command reads the file and parses options; everything it
// prints is made here, so tests can call it on a program built by hand.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_INSPECT_DUMP_H
#define MOEC_COMPILER_INSPECT_DUMP_H

#include "base/Status.h"
#include "compiler/inspect/Analysis.h"
#include "format/TaskBinary.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moec::inspect {

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

} // namespace moec::inspect

#endif // MOEC_COMPILER_INSPECT_DUMP_H
