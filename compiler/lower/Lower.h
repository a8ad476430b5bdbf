//===- Lower.h - A split-propagated graph to a task program -----*- C++ -*-===//
//
// The step from the graph level (the moe dialect, after moe-propagate-splits)
// to the tile level (a plain C++ task program, format): every op's
// tile grid becomes tasks on its core kind with a tiling descriptor, every
// tile map becomes events that producer tiles signal and consumer tiles wait
// on, and a terminate event collects the graph's sink tiles and the returning
// puts. Queues are left empty for the scheduler (compiler/target).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_LOWER_LOWER_H
#define MOEC_COMPILER_LOWER_LOWER_H

#include "compiler/ir/MoeDialect.h"
#include "compiler/target/Profile.h"
#include "format/TaskBinary.h"

#include "mlir/Support/LogicalResult.h"

#include <optional>
#include <string_view>

namespace moec::lower {

/// How finely events follow the tile maps.
enum class Granularity {
  /// One event per (producer op, local expert), as the seed: a consumer tile
  /// waits for every producer tile of each expert it touches.
  PerExpert,
  /// One event per distinct producer tile range a consumer tile needs: a
  /// consumer tile waits only for the producer tiles its rows come from.
  PerTileRange,
};

/// Returns the granularity spelled "per-expert" or "per-tile-range".
std::optional<Granularity> parseGranularity(std::string_view text);

/// Returns "per-expert" or "per-tile-range".
const char *granularityName(Granularity granularity);

/// Options of lowerGraph.
struct LowerOptions {
  Granularity granularity = Granularity::PerTileRange;
  target::TargetProfile profile; ///< kernel block sizes; its name goes in the header
  /// The layer the graph computes, as its config asked for it: the
  /// program's layer record. Its receive capacity is the rows of the
  /// dynamic tensors (dispatched activations of a rank): their capacity
  /// and dim 0 in the binary. None keeps the graph's dim 0 and writes no
  /// record.
  std::optional<format::LayerRecord> layer;
  /// Lead products (format::leadOp): a GMM that writes the low-rank rows U
  /// of a GMM with a low-rank product from that GMM's own A, over the same
  /// row tiles (a LoRA adapter's first product, U = s X A, beside its
  /// base's), is lowered with no tasks of its own: the base's tiles compute
  /// their rows of U first, and the events U's other readers wait on are
  /// the base's tiles'. The same bits; false keeps every GMM's tasks its
  /// own (a comparison).
  bool leadProducts = true;
};

/// Lowers `graph`, which must have been through the graph pipeline (shapes
/// resolved, slots assigned, splits propagated), into *out: header values,
/// slots, ops with their tilings, tasks, waits, signals and events. Tasks are
/// in op order (topological), each op's in grid order; queues are empty.
/// Emits an error on the graph and fails on what the binary cannot hold (a
/// tensor of rank above 4, a count above 2^32-1).
mlir::LogicalResult lowerGraph(moe::GraphOp graph, const LowerOptions &options,
                               format::TaskProgram *out);

} // namespace moec::lower

#endif // MOEC_COMPILER_LOWER_LOWER_H
