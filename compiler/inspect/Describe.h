//===- Describe.h - how every view of a task program names its parts ----*- C++ -*-===//
//
// The labels the text dump, the JSON dump and the dot graphs share: cores,
// queues, slot dims, tiling flags, a task's tile (resolved for a rank),
// its waits and signals, and the statistics of a program's queues.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_INSPECT_DESCRIBE_H
#define MOEC_COMPILER_INSPECT_DESCRIBE_H

#include "compiler/inspect/Analysis.h"
#include "compiler/inspect/Dump.h"
#include "format/TaskBinary.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moec::inspect {

using format::CoreKind;
using format::OpRecord;
using format::QueueRecord;
using format::SlotRecord;
using format::TaskProgram;
using format::TaskRecord;
using format::TileCoord;
using format::TilingRecord;

/// "cube core 3".
std::string coreLabel(CoreKind kind, uint32_t index);

/// "cube core 3" for a queue.
std::string queueLabel(const QueueRecord &queue);

/// The queues in (kind, index) order: cube cores first.
std::vector<uint32_t> queueOrder(const TaskProgram &p);

/// The queues a dump shows: the selected core's, or all in (kind, index)
/// order.
std::vector<uint32_t> shownQueues(const TaskProgram &p, const DumpOptions &options);

/// The core kind of the tasks of op `index`: "cube", "vector", "mixed",
/// "in HOST" for a lead product (format::leadOp: HOST's tasks compute its
/// tiles), or "-" for another op without tasks.
std::string opCore(const TaskProgram &p, uint32_t index);

/// "[256, 128]".
std::string dimsText(const SlotRecord &slot);

/// The names of a tiling's flags: "transpose_a", "transpose_b",
/// "accumulate", "scale=0.5".
std::vector<std::string> tilingFlagNames(const TilingRecord &t);

/// "transpose_a,accumulate" or "-".
std::string tilingFlagsText(const TilingRecord &t);

/// The input slots of a tiling, then its low-rank product's U and V.
std::vector<uint32_t> tilingInputs(const TilingRecord &tiling);

/// A task's tile with rank-relative fields resolved for `rank` (if any).
struct ResolvedTile {
  TileCoord coord;
  uint64_t expert = 0; ///< local, or global with a rank
  uint32_t peer = 0;   ///< peer offset, or peer rank with a rank
};

ResolvedTile resolvedTile(const TaskProgram &p, uint32_t task, std::optional<uint32_t> rank);

/// "tile(e0,p1,r0,c2 rows 0..128 cols 256..384)".
std::string tileText(const TaskProgram &p, uint32_t task, std::optional<uint32_t> rank);

/// "[ev3 dispatch.rows_in >= 4, ev5 ... >= 1]".
std::string waitsText(const TaskProgram &p, const TaskRecord &task);

/// "[ev3 dispatch.rows_in +1 → +1]" (peer offset), or "→ rank 2" with a rank.
std::string signalsText(const TaskProgram &p, const TaskRecord &task,
                        std::optional<uint32_t> rank);

/// A quantity in the analysis' unit: seconds, or tasks (steps) when untimed.
std::string amountText(const Analysis &a, double value);

/// Per queue: the sum of its tasks' costs.
std::vector<double> queueBusy(const TaskProgram &p, const Analysis &a);

/// The balance of the queues of one core kind.
struct Balance {
  size_t queues = 0;
  double mean = 0, ratio = 0;
  uint32_t minQueue = 0, maxQueue = 0;
  double minBusy = 0, maxBusy = 0;
};

/// Returns the balance of the `kind` queues, or nothing when there are none.
std::optional<Balance> balanceOf(const TaskProgram &p, const std::vector<double> &busy,
                                 CoreKind kind);

/// Counts the tasks of each core kind: {cube, vector}.
std::pair<uint64_t, uint64_t> taskCounts(const TaskProgram &p);

/// What a binary computes, from its ops: the layer's forward; its backward
/// with weight gradients written, accumulated into fp32 (main_grad), or
/// none (frozen weights); or the dispatch or combine alone.
std::string computesText(const TaskProgram &p);

} // namespace moec::inspect

#endif // MOEC_COMPILER_INSPECT_DESCRIBE_H
