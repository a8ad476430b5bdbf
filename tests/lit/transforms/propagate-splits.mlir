// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s --check-prefix=FWD
// RUN: moec-opt %graphs/moe_ffn_bwd.mlir --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s --check-prefix=BWD
// RUN: moec-opt %s --split-input-file --verify-diagnostics --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-propagate-splits 2>&1 | FileCheck %s --check-prefix=UNRESOLVED

// tiny.json: per_rank_seq 256, per_expert_seq 256, per_expert_seq_to_other
// 128, num_experts 4, single_rank_expert_num 2, num_cube_cores 2, tp 1.

// Forward graph: every op has 4 tasks over the 256 rows of dim 0, so each
// consumer tile needs the producer tile of the same index.
// FWD-LABEL: moe.graph "moe_ffn_fwd"
// FWD: moe.dispatch "dispatch"
// FWD-SAME: deps = []
// FWD-SAME: tasks = 4 : i64
// FWD: moe.gmm "up_proj"
// FWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "dispatch", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// FWD-SAME: tasks = 4 : i64
// FWD: moe.swiglu "swiglu"
// FWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "up_proj", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// FWD-SAME: tasks = 4 : i64
// FWD: moe.gmm "down_proj"
// FWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "swiglu", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// FWD-SAME: tasks = 4 : i64
// FWD: moe.combine "combine"
// FWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "down_proj", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// FWD-SAME: tasks = 4 : i64

// Backward graph: the ordering edges that duplicate a data edge add no map;
// gate_grad -> w2_grad carries no tensor, so w2_grad needs every gate_grad
// tile (operand -1).
// BWD-LABEL: moe.graph "moe_ffn_bwd"
// BWD: moe.dispatch "dispatch"
// BWD-SAME: deps = []
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "act_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "dispatch", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "w1_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "dispatch", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// BWD-SAME: tasks = 4 : i64
// BWD: moe.swiglu_grad "swiglu_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "act_grad", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "gate_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "swiglu_grad", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// BWD-SAME: tasks = 4 : i64
// BWD: moe.combine "combine"
// BWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "gate_grad", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>]
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "w2_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "swiglu_grad", first = [0, 1, 2, 3], last = [0, 1, 2, 3]>, #moe.tile_map<operand = -1, producer = "gate_grad", first = [0, 0, 0, 0], last = [3, 3, 3, 3]>]
// BWD-SAME: tasks = 4 : i64

// UNRESOLVED: error: graph 'moe_ffn_fwd' has unresolved shapes: run moe-resolve-shapes first

// Tile counts that differ along the same dim.
// CHECK-LABEL: moe.graph "tile_counts"
moe.graph "tile_counts" attributes {edges = [["p4", "by_cols"], ["p4", "c2"]]} {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // A source: 256 rows / 64 = 4 tiles.
  // CHECK: moe.swiglu "p4"
  // CHECK-SAME: deps = []
  // CHECK-SAME: tasks = 4 : i64
  %p4 = moe.swiglu "p4"(%y) -> "p4_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // Producer 4 tiles, consumer 2: each consumer tile needs two producer tiles.
  // The edge p4 -> c2 duplicates the data edge and adds no map.
  // CHECK: moe.swiglu_grad "c2"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "p4", first = [0, 2], last = [1, 3]>]
  // CHECK-SAME: tasks = 2 : i64
  %c2 = moe.swiglu_grad "c2"(%p4, %y) -> "c2_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
  // Producer 2 tiles, consumer 4: two consumer tiles share each producer tile.
  // CHECK: moe.swiglu "c4"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "c2", first = [0, 0, 1, 1], last = [0, 0, 1, 1]>]
  // CHECK-SAME: tasks = 4 : i64
  %c4 = moe.swiglu "c4"(%c2) -> "c4_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // Split along another dim than the producer's tiles: every producer tile.
  // The ordering edge p4 -> by_cols carries no tensor: operand -1, all tiles.
  // CHECK: moe.swiglu "by_cols"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "c2", first = [0, 0, 0, 0], last = [1, 1, 1, 1]>, #moe.tile_map<operand = -1, producer = "p4", first = [0, 0, 0, 0], last = [3, 3, 3, 3]>]
  // CHECK-SAME: tasks = 4 : i64
  %cols = moe.swiglu "by_cols"(%c2) -> "cols_out" {split = #moe.split<inputs = [0:1], output_dims = [1]>, split_value = 16 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // An operand read whole (not a split input): every producer tile; the
  // split operand maps tile to tile.
  // CHECK: moe.swiglu_grad "whole"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "p4", first = [0, 0], last = [3, 3]>, #moe.tile_map<operand = 1, producer = "c2", first = [0, 1], last = [0, 1]>]
  // CHECK-SAME: tasks = 2 : i64
  %whole = moe.swiglu_grad "whole"(%p4, %c2) -> "whole_out" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// Tile counts from task_num that do not divide the rows evenly: tile j covers
// rows [j*D/T, (j+1)*D/T).
// CHECK-LABEL: moe.graph "uneven"
moe.graph "uneven" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // 3 tiles: rows [0, 85), [85, 170), [170, 256).
  // CHECK: moe.swiglu "p3"
  // CHECK-SAME: tasks = 3 : i64
  %p3 = moe.swiglu "p3"(%y) -> "p3_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts - 1">, split_value = 1 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // Rows [0, 128) need tiles 0-1, rows [128, 256) tiles 1-2.
  // CHECK: moe.swiglu_grad "c2"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "p3", first = [0, 1], last = [1, 2]>]
  // CHECK-SAME: tasks = 2 : i64
  %c2 = moe.swiglu_grad "c2"(%p3, %y) -> "c2_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// More tiles than rows: every task needs at least one row.
moe.graph "too_many_tiles" {
  %y = moe.input "y" : !moe.tensor<[2, 64], f32>
  %p2 = moe.swiglu "p2"(%y) -> "p2_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 1 : i64} : (!moe.tensor<[2, 64], f32>) -> !moe.tensor<[2, 32], f32>
  // expected-error@+1 {{'c4': task_num 'num_experts' gives 4 tasks for the 2 rows of dim 0 of 'p2_out'; a task needs at least one row}}
  %c4 = moe.swiglu_grad "c4"(%p2, %y) -> "c4_out" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "num_experts">, split_value = 1 : i64} : (!moe.tensor<[2, 32], f32>, !moe.tensor<[2, 64], f32>) -> !moe.tensor<[2, 64], f32>
}

// -----

// task_num is evaluated with the config and split_value: 4 * (128 / 64) = 8.
// CHECK-LABEL: moe.graph "task_num"
// CHECK: moe.swiglu "p"
// CHECK-SAME: tasks = 8 : i64
moe.graph "task_num" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 64 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "not_dividing_source" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'p': split value 96 does not divide dim 0 of 'p_out' (256)}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 96 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "not_dividing_input" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  // The split input's dim 1 is intermediate_size = 32.
  // expected-error@+1 {{'c': split value 5 does not divide dim 1 of 'p_out' (32)}}
  %c = moe.swiglu_grad "c"(%p, %y) -> "c_out" {split = #moe.split<inputs = [0:1], output_dims = [0]>, split_value = 5 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "task_num_zero" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'p': task_num 'tp - 1' is 0; it must be positive}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "tp - 1">, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "task_num_not_dividing" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'p': task_num: 'per_expert_seq / split_value' does not divide: 256 is not a multiple of 96}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "(per_expert_seq / split_value) * single_rank_expert_num">, split_value = 96 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "task_num_unknown_symbol" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'p': task_num: unknown symbol 'num_cube_core' (did you mean 'num_cube_cores'?)}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_cube_core * 2">, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}
