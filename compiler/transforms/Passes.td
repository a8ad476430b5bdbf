//===- Passes.td - moe graph passes ---------------------------*- tablegen -*-===//

#ifndef MOEC_COMPILER_TRANSFORMS_PASSES_TD
#define MOEC_COMPILER_TRANSFORMS_PASSES_TD

include "mlir/Pass/PassBase.td"

def ResolveShapes : Pass<"moe-resolve-shapes", "::mlir::ModuleOp"> {
  let summary = "Bind symbolic dims and the activation dtype from a model/parallel config";
  let description = [{
    Loads the config named by `config`, derives the seed's TaskSplitValue
    fields from it, and evaluates every tensor dim expression of every
    `moe.graph`, replacing it with its integer value; `act` element types
    become `f32` or `bf16`. The symbols and their values are kept in the
    graph's `bindings` attribute for later passes. `num_cube_cores` and
    `num_vector_cores` come from the config when it sets them, else from
    the `target` profile. Fails, naming the tensor and dim, on an unknown
    symbol, a division that does not divide, or a non-positive dim.
  }];
  let options = [
    Option<"configPath", "config", "std::string", /*default=*/"\"\"",
           "path of the model/parallel config JSON">,
    Option<"target", "target", "std::string", /*default=*/"\"cpu\"",
           "target profile (cpu, ascend-910b, h100 or a profile JSON) that gives "
           "num_cube_cores and num_vector_cores when the config does not">,
  ];
  let statistics = [
    Statistic<"numResolvedTensors", "resolved-tensors", "Number of tensors resolved">,
  ];
}

def QuantizeDispatch : Pass<"moe-quantize-dispatch", "::mlir::ModuleOp"> {
  let summary = "Put the quantizable dispatches' rows on the wire as FP8 (dispatch_dtype fp8_e4m3)";
  let description = [{
    When the config's `dispatch_dtype` is `fp8_e4m3` (the binding
    `fp8_dispatch`), every `moe.dispatch` marked `quantizable` gets a
    `moe.quantize` of its source rows before it and a `moe.dequantize` of
    its result after it: the put moves e4m3 codes with one fp32 scale per
    128 values, and the dispatch's consumers read the dequantized rows,
    which keep the result's name and slot. Other dispatches, and combines,
    are left alone. Runs after `moe-resolve-shapes`.
  }];
}

def VerifyGraph : Pass<"moe-verify-graph", "::mlir::ModuleOp"> {
  let summary = "Check the graph's data flow: cycles, dangling inputs, unsplittable inputs";
  let description = [{
    Fails on a cycle (naming the ops on it) and on a split input that is a
    graph input: such an op has no producer tiles to follow, a case the seed
    silently turned into a task count of 1. With a config whose `tp` is
    above 1, fails on a combine of a layer graph that is not `reduce_tp`, and
    on a graph with no expert weights (only dispatches and combines). Warns
    about graph inputs that no op reads.
  }];
}

def FuseLowRank : Pass<"moe-fuse-low-rank", "::mlir::ModuleOp"> {
  let summary = "Fold each LoRA adapter's second gmm into its base's as a low-rank product";
  let description = [{
    A gmm that adds a product onto its addend (`result = addend + lhs x rhs`,
    no scale: a LoRA adapter's second product, `Y = Y_base + U B` or
    `dX = dX_base + V A^T`) whose addend a base gmm writes and nothing else
    reads becomes that base gmm's low-rank product: one gmm, `result =
    lhs x rhs + U x B` (its `low_lhs`, `low_rhs`), under the base's name and
    split and the adapter's result name and slot; the adapter's gmm is gone,
    and the graph's ordering edges that named it name the base. The tile then
    sums the adapter's rank-r units with the base's before its one store,
    where two gmms read and wrote the base's output twice. Runs after
    `moe-verify-graph`; the compile runs it for targets whose cube cores
    share no cache (`shared_cache` false: the CPU), whose backend runs such
    gmms.
  }];
  let statistics = [
    Statistic<"numFused", "fused", "LoRA products folded into their base's gmm">,
  ];
}

def AssignSlots : Pass<"moe-assign-slots", "::mlir::ModuleOp"> {
  let summary = "Give slots to tensors and tiling slots to ops that have none";
  let description = [{
    Tensors without a parameter slot take the smallest free slots, in block
    order. Ops that need a tiling descriptor (gmm, swiglu, swiglu_grad) and
    have no tiling slot take the smallest free ones; all-to-all ops get -1.
    Slots given in the graph are kept.
  }];
  let statistics = [
    Statistic<"numSlots", "assigned-slots", "Number of parameter slots assigned">,
    Statistic<"numTilingSlots", "assigned-tiling-slots", "Number of tiling slots assigned">,
  ];
}

def PropagateSplits : Pass<"moe-propagate-splits", "::mlir::ModuleOp"> {
  let summary = "Compute task counts, tile grids and the tile-range dependency map of every edge";
  let description = [{
    Visits the compute ops in topological order (the seed's semantics). An
    op's task count is its `task_num` expression when it has one (evaluated
    with the graph's bindings and `split_value`, each division rounding up:
    it counts tiles); otherwise the extent of its first split input's dim
    (or, for a source, of its first output split dim) divided by the split
    value, rounded up, then up to a multiple of what the op's grid needs
    (L, or L x R for a put). A dimension's tiles are balanced, so an extent
    that is no multiple of the split value gets one more, smaller tile.

    The tasks form a grid, `grid = [experts, peers, row tiles, column
    tiles, rows, columns]`, numbered in that order (rows and columns are
    the extents the tiles cut):

    - `moe.dispatch`, `moe.combine`: L x R x T x 1, the rows a rank puts to
      (or returns from) local expert e of the peer at offset p, in T row
      tiles of at most `per_expert_seq_to_other` rows;
    - `moe.swiglu`, `moe.swiglu_grad`: L x 1 x T x 1, row tiles of each
      expert's segment of at most `per_expert_seq` rows;
    - `moe.gmm` (activation form): L x 1 x mt x nt over each expert's
      segment: the most row tiles that divide the count and give each at
      least `split_value` rows of a segment of balanced size
      (`per_rank_seq / L`), the rest over columns;
    - `moe.gmm` (weight-gradient form): L x 1 x mt x nt over each expert's
      result, as square as the count allows.

    The count must be a multiple of the grid's fixed factors, and no tile
    may be empty. For every operand produced by another op it records a
    `#moe.tile_map`: for each consumer tile, the range of producer tiles
    it needs. Two ops that cut the same expert segments into row tiles map
    row tile to overlapping row tiles; a consumer that reduces over an
    expert's rows (a weight gradient, a put) or reads rows that arrive from
    every peer needs the whole of its expert's producer tiles; anything else
    needs every producer tile. An ordering edge of the graph (operand -1)
    needs every producer tile. The maps are stored in the op's `deps`
    attribute, the grid in `grid` and the count in `tasks`. Needs
    `moe-resolve-shapes` first.

    An op with `split_value` "auto" has its grid chosen here instead, from
    the config's shapes and core counts and this pass's options (the
    compiler tries several and keeps the one whose schedule is fastest):
    its row tiles share out the rows there are at run time
    (kTilingShareRows), a power of two of them so that row-wise neighbours
    map tile to tile; a put aims for `put-rows` rows a tile under balanced
    routing; a SwiGLU(-grad) for `vector-tasks-per-core` tiles per vector
    core; a GMM for `cube-tasks-per-core` tiles per cube core, over rows
    first (at least `gmm-rows` rows a tile when balanced), then over
    columns (at least 128 a tile), the counts whose tiles, padded to the
    kernel's blocks (`pad-m` x `pad-n`), take the fewest waves of the cube
    cores; a weight gradient for `weight-grad-tasks-per-core` tiles per cube
    core (0: as many as the activation GMMs), the grid whose padded tiles
    the cube cores would finish soonest. With `peer-groups` G > 1 (at most the EP
    degree), the GMM, SwiGLU(-grad) and dequantize tiles of an expert are
    cut first by the source rank of their rows: group g holds the rows that
    came from the ranks p EP ranks behind, g*R/G <= p < (g+1)*R/G, and needs
    only the dispatch tiles that put them; a combine tile needs only the
    group of the rank it returns rows to. Weight gradients still reduce over
    all of an expert's rows.
  }];
  let options = [
    Option<"cubeTasksPerCore", "cube-tasks-per-core", "int64_t", /*default=*/"2",
           "automatic splits: GMM tiles per cube core">,
    Option<"vectorTasksPerCore", "vector-tasks-per-core", "int64_t", /*default=*/"2",
           "automatic splits: SwiGLU tiles per vector core">,
    Option<"putRows", "put-rows", "int64_t", /*default=*/"256",
           "automatic splits: rows a put tile holds under balanced routing">,
    Option<"gmmRows", "gmm-rows", "int64_t", /*default=*/"128",
           "automatic splits: rows a GMM tile holds at least under balanced routing">,
    Option<"peerGroups", "peer-groups", "int64_t", /*default=*/"1",
           "automatic splits: groups of source ranks each expert's rows are cut into">,
    Option<"weightGradTasksPerCore", "weight-grad-tasks-per-core", "int64_t", /*default=*/"0",
           "automatic splits: weight-gradient GMM tiles per cube core (0: cube-tasks-per-core)">,
    Option<"padM", "pad-m", "int64_t", /*default=*/"1",
           "automatic splits: the rows of the blocks a GMM kernel computes whole "
           "(the target's pad_m)">,
    Option<"padN", "pad-n", "int64_t", /*default=*/"1",
           "automatic splits: the columns of the blocks a GMM kernel computes whole "
           "(the target's pad_n)">,
  ];
  let statistics = [
    Statistic<"numTasks", "tasks", "Number of tile tasks over all ops">,
  ];
}

#endif // MOEC_COMPILER_TRANSFORMS_PASSES_TD
