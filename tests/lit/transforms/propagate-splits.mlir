// RUN: moec-opt %graphs/seed/moe_ffn_fwd.mlir --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s --check-prefix=FWD
// RUN: moec-opt %graphs/seed/moe_ffn_bwd.mlir --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s --check-prefix=BWD
// RUN: moec-opt %graphs/seed/moe_ffn_fwd.mlir --moe-graph-pipeline="config=%configs/seed-test.json target=ascend-910b" | FileCheck %s --check-prefix=SEED-FWD
// RUN: moec-opt %graphs/seed/moe_ffn_bwd.mlir --moe-graph-pipeline="config=%configs/seed-test.json target=ascend-910b" | FileCheck %s --check-prefix=SEED-BWD
// RUN: moec-opt %s --split-input-file --verify-diagnostics --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s
// RUN: not moec-opt %graphs/seed/moe_ffn_fwd.mlir --moe-propagate-splits 2>&1 | FileCheck %s --check-prefix=UNRESOLVED

// tiny.json: L = single_rank_expert_num 2, R = ep 2, per_expert_seq 256,
// per_rank_seq 256, per_expert_seq_to_other 128, num_experts 4,
// num_cube_cores 2, hidden_size 64, intermediate_size 32.
//
// grid = [experts, peers, row tiles, column tiles, rows, columns]; tasks are
// numbered expert-major in that order, so expert e owns tasks
// [e * T/L, (e+1) * T/L).

// Forward graph, 4 tasks per op:
// - dispatch: L x R = 4, one row tile each of the 128 rows sent to an expert.
// - up_proj/down_proj: 2 tasks per expert; split value 4096 leaves no row
//   tile room (128 balanced rows / 4096 < 1), so 1 row tile x 2 column tiles.
// - swiglu: 2 row tiles of each expert's 256-row segment.
// - combine: as dispatch.
// Every map follows the expert: up_proj needs the dispatch tiles of its
// expert from both peers; swiglu's row tiles each read whole rows, so both
// column tiles of up_proj for the expert; down_proj's single row tile spans
// both swiglu row tiles; combine puts all of an expert's rows.
// FWD-LABEL: moe.graph "moe_ffn_fwd"
// FWD: moe.dispatch "dispatch"
// FWD-SAME: deps = []
// FWD-SAME: grid = array<i64: 2, 2, 1, 1, 128, 64>
// FWD-SAME: tasks = 4 : i64
// FWD: moe.gmm "up_proj"
// FWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "dispatch", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// FWD-SAME: grid = array<i64: 2, 1, 1, 2, 256, 64>
// FWD-SAME: tasks = 4 : i64
// FWD: moe.swiglu "swiglu"
// FWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "up_proj", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// FWD-SAME: grid = array<i64: 2, 1, 2, 1, 256, 32>
// FWD-SAME: tasks = 4 : i64
// FWD: moe.gmm "down_proj"
// FWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "swiglu", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// FWD-SAME: grid = array<i64: 2, 1, 1, 2, 256, 64>
// FWD-SAME: tasks = 4 : i64
// FWD: moe.combine "combine"
// FWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "down_proj", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// FWD-SAME: grid = array<i64: 2, 2, 1, 1, 128, 64>
// FWD-SAME: tasks = 4 : i64

// Backward graph: the ordering edges that duplicate a data edge add no map;
// gate_grad -> w2_grad carries no tensor, so w2_grad needs every gate_grad
// tile (operand -1). The weight gradients reduce over their expert's rows:
// the whole expert's producer tiles. w1_grad's [32, 64] result per expert in
// 2 tiles: 1 x 2 (32 x 32 tiles) is square; w2_grad's [64, 64] result: 1 x 2
// and 2 x 1 are equally square, the fewer row tiles win.
// BWD-LABEL: moe.graph "moe_ffn_bwd"
// BWD: moe.dispatch "dispatch"
// BWD-SAME: deps = []
// BWD-SAME: grid = array<i64: 2, 2, 1, 1, 128, 64>
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "act_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "dispatch", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// BWD-SAME: grid = array<i64: 2, 1, 1, 2, 256, 32>
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "w1_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "dispatch", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// BWD-SAME: grid = array<i64: 2, 1, 1, 2, 32, 64>
// BWD-SAME: tasks = 4 : i64
// BWD: moe.swiglu_grad "swiglu_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "act_grad", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// BWD-SAME: grid = array<i64: 2, 1, 2, 1, 256, 64>
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "gate_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 0, producer = "swiglu_grad", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// BWD-SAME: grid = array<i64: 2, 1, 1, 2, 256, 64>
// BWD-SAME: tasks = 4 : i64
// BWD: moe.combine "combine"
// BWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "gate_grad", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]
// BWD-SAME: grid = array<i64: 2, 2, 1, 1, 128, 64>
// BWD-SAME: tasks = 4 : i64
// BWD: moe.gmm "w2_grad"
// BWD-SAME: deps = [#moe.tile_map<operand = 1, producer = "swiglu_grad", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>, #moe.tile_map<operand = -1, producer = "gate_grad", first = [0, 0, 0, 0], last = [3, 3, 3, 3]>]
// BWD-SAME: grid = array<i64: 2, 1, 1, 2, 64, 64>
// BWD-SAME: tasks = 4 : i64

// seed-test.json leaves the core counts to the target: ascend-910b gives 24
// cube cores, so the gmm ops have 24 * 8 tasks. L = 8, R = 2,
// per_expert_seq 1024, per_expert_seq_to_other 512, H 5120, I 2048.
// - dispatch/combine: 16 * (512 / 128) = 64 tasks = 8 x 2 x 4 row tiles.
// - up_proj/down_proj/act_grad/gate_grad: 24 per expert, all column tiles.
// - swiglu(_grad): (1024 / 128) * 8 = 64 tasks, 8 row tiles per expert.
// - w1_grad: [2048, 5120] per expert in 24 tiles: 3 x 8 (683 x 640) is the
//   squarest; w2_grad: [5120, 4096] in 24: 6 x 4 (853 x 1024).
// SEED-FWD-LABEL: moe.graph "moe_ffn_fwd"
// SEED-FWD: moe.dispatch "dispatch"
// SEED-FWD-SAME: grid = array<i64: 8, 2, 4, 1, 512, 5120>
// SEED-FWD-SAME: tasks = 64 : i64
// SEED-FWD: moe.gmm "up_proj"
// SEED-FWD-SAME: grid = array<i64: 8, 1, 1, 24, 1024, 4096>
// SEED-FWD-SAME: tasks = 192 : i64
// SEED-FWD: moe.swiglu "swiglu"
// SEED-FWD-SAME: grid = array<i64: 8, 1, 8, 1, 1024, 2048>
// SEED-FWD-SAME: tasks = 64 : i64
// SEED-FWD: moe.gmm "down_proj"
// SEED-FWD-SAME: grid = array<i64: 8, 1, 1, 24, 1024, 5120>
// SEED-FWD-SAME: tasks = 192 : i64
// SEED-FWD: moe.combine "combine"
// SEED-FWD-SAME: grid = array<i64: 8, 2, 4, 1, 512, 5120>
// SEED-FWD-SAME: tasks = 64 : i64

// SEED-BWD-LABEL: moe.graph "moe_ffn_bwd"
// SEED-BWD: moe.gmm "act_grad"
// SEED-BWD-SAME: grid = array<i64: 8, 1, 1, 24, 1024, 2048>
// SEED-BWD: moe.gmm "w1_grad"
// SEED-BWD-SAME: grid = array<i64: 8, 1, 3, 8, 2048, 5120>
// SEED-BWD-SAME: tasks = 192 : i64
// SEED-BWD: moe.swiglu_grad "swiglu_grad"
// SEED-BWD-SAME: grid = array<i64: 8, 1, 8, 1, 1024, 4096>
// SEED-BWD: moe.gmm "gate_grad"
// SEED-BWD-SAME: grid = array<i64: 8, 1, 1, 24, 1024, 5120>
// SEED-BWD: moe.combine "combine"
// SEED-BWD-SAME: grid = array<i64: 8, 2, 4, 1, 512, 5120>
// SEED-BWD: moe.gmm "w2_grad"
// SEED-BWD-SAME: grid = array<i64: 8, 1, 6, 4, 5120, 4096>
// SEED-BWD-SAME: tasks = 192 : i64

// UNRESOLVED: error: graph 'moe_ffn_fwd' has unresolved shapes: run moe-resolve-shapes first

// Row tiles of the same expert segments (256 rows each) map row tile to the
// overlapping row tiles of the same expert.
// CHECK-LABEL: moe.graph "row_tiles"
moe.graph "row_tiles" attributes {edges = [["p4", "by_cols"], ["p4", "c2"]]} {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // A source: 256 / 64 = 4 tasks, 2 row tiles per expert: tasks 0-1 are
  // expert 0's rows [0, 128) and [128, 256), tasks 2-3 expert 1's.
  // CHECK: moe.swiglu "p4"
  // CHECK-SAME: deps = []
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 1, 256, 32>
  // CHECK-SAME: tasks = 4 : i64
  %p4 = moe.swiglu "p4"(%y) -> "p4_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // 2 tasks, one per expert: each needs both row tiles of its expert.
  // The edge p4 -> c2 duplicates the data edge and adds no map.
  // CHECK: moe.swiglu_grad "c2"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "p4", first = [0, 2], last = [1, 3]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 1, 1, 256, 64>
  // CHECK-SAME: tasks = 2 : i64
  %c2 = moe.swiglu_grad "c2"(%p4, %y) -> "c2_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
  // Back to 2 row tiles per expert: both row tiles of expert e share its one
  // c2 tile e.
  // CHECK: moe.swiglu "c4"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "c2", first = [0, 0, 1, 1], last = [0, 0, 1, 1]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 1, 256, 32>
  // CHECK-SAME: tasks = 4 : i64
  %c4 = moe.swiglu "c4"(%c2) -> "c4_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // The split dim only sets the count (64 / 16 = 4): a swiglu's tiles are
  // row tiles of the expert segments whatever dim it names, so the map is
  // c4's. The ordering edge p4 -> by_cols carries no tensor: operand -1,
  // every p4 tile.
  // CHECK: moe.swiglu "by_cols"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "c2", first = [0, 0, 1, 1], last = [0, 0, 1, 1]>, #moe.tile_map<operand = -1, producer = "p4", first = [0, 0, 0, 0], last = [3, 3, 3, 3]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 1, 256, 32>
  // CHECK-SAME: tasks = 4 : i64
  %cols = moe.swiglu "by_cols"(%c2) -> "cols_out" {split = #moe.split<inputs = [0:1], output_dims = [1]>, split_value = 16 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // Both operands are read row-wise, the split one and the other alike.
  // CHECK: moe.swiglu_grad "whole"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "p4", first = [0, 2], last = [1, 3]>, #moe.tile_map<operand = 1, producer = "c2", first = [0, 1], last = [0, 1]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 1, 1, 256, 64>
  // CHECK-SAME: tasks = 2 : i64
  %whole = moe.swiglu_grad "whole"(%p4, %c2) -> "whole_out" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// Row tiles that do not divide the segment evenly: row tile i of T covers
// rows [i*256/T, (i+1)*256/T).
// CHECK-LABEL: moe.graph "uneven"
moe.graph "uneven" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // 3 row tiles per expert: rows [0, 85), [85, 170), [170, 256).
  // CHECK: moe.swiglu "p3"
  // CHECK-SAME: grid = array<i64: 2, 1, 3, 1, 256, 32>
  // CHECK-SAME: tasks = 6 : i64
  %p3 = moe.swiglu "p3"(%y) -> "p3_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "3 * single_rank_expert_num">, split_value = 1 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // 2 row tiles per expert: rows [0, 128) need p3 row tiles 0-1, rows
  // [128, 256) row tiles 1-2; expert 1's p3 tiles are 3-5.
  // CHECK: moe.swiglu_grad "c4"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "p3", first = [0, 1, 3, 4], last = [1, 2, 4, 5]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 1, 256, 64>
  // CHECK-SAME: tasks = 4 : i64
  %c4 = moe.swiglu_grad "c4"(%p3, %y) -> "c4_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// Activation gmm grids: as many row tiles as divide the per-expert count and
// leave split_value rows of a balanced segment (per_rank_seq / L = 128) each,
// the rest column tiles. Maps from and to a gmm cover all of its column tiles
// in the row tiles overlapped.
// CHECK-LABEL: moe.graph "gmm_grids"
moe.graph "gmm_grids" {
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %w = moe.input "w" : !moe.tensor<[2, 64, 64], f32>
  %w2 = moe.input "w2" : !moe.tensor<[2, 32, 64], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  // 4 per expert, split value 64: at most 128 / 64 = 2 row tiles, so 2 x 2.
  // CHECK: moe.gmm "up"
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 2, 256, 64>
  // CHECK-SAME: tasks = 8 : i64
  %up = moe.gmm "up"(%x, %w, %g) -> "up_y" {split = #moe.split<inputs = [], output_dims = [0], task_num = "4 * single_rank_expert_num">, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[2, 64, 64], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32>
  // The same count with split value 4096: one row tile, 4 column tiles.
  // CHECK: moe.gmm "up_cols"
  // CHECK-SAME: grid = array<i64: 2, 1, 1, 4, 256, 64>
  // CHECK-SAME: tasks = 8 : i64
  %upc = moe.gmm "up_cols"(%x, %w, %g) -> "up_cols_y" {split = #moe.split<inputs = [], output_dims = [0], task_num = "4 * single_rank_expert_num">, split_value = 4096 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[2, 64, 64], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32>
  // 3 row tiles per expert over up's 2 x 2 (expert e: tasks 4e..4e+3, row
  // tile r, column tile c at 4e + 2r + c): rows [0, 85) lie in up's row tile
  // 0 (tasks 0-1), [85, 170) straddle both (0-3), [170, 256) lie in row
  // tile 1 (2-3).
  // CHECK: moe.swiglu "s3"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "up", first = [0, 0, 2, 4, 4, 6], last = [1, 3, 3, 5, 7, 7]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 3, 1, 256, 32>
  // CHECK-SAME: tasks = 6 : i64
  %s3 = moe.swiglu "s3"(%up) -> "s3_out" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "3 * single_rank_expert_num">, split_value = 1 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // 4 row tiles of 64 rows over up_cols' single row tile: all 4 column tiles
  // of the expert.
  // CHECK: moe.swiglu "s4"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "up_cols", first = [0, 0, 0, 0, 4, 4, 4, 4], last = [3, 3, 3, 3, 7, 7, 7, 7]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 4, 1, 256, 32>
  // CHECK-SAME: tasks = 8 : i64
  %s4 = moe.swiglu "s4"(%upc) -> "s4_out" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "4 * single_rank_expert_num">, split_value = 1 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // 2 x 2 over s4's 4 row tiles: row tile 0 (rows [0, 128)) needs s4 row
  // tiles 0-1 for both of its column tiles, row tile 1 needs 2-3.
  // CHECK: moe.gmm "down"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "s4", first = [0, 0, 2, 2, 4, 4, 6, 6], last = [1, 1, 3, 3, 5, 5, 7, 7]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 2, 256, 64>
  // CHECK-SAME: tasks = 8 : i64
  %down = moe.gmm "down"(%s4, %w2, %g) -> "down_y" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "4 * single_rank_expert_num">, split_value = 64 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[2, 32, 64], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32>
}

// -----

// Puts and weight gradients: a consumer of rows arriving from every peer, or
// one reducing over an expert's rows, needs all of its expert's producer
// tiles.
// CHECK-LABEL: moe.graph "experts"
moe.graph "experts" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  %w = moe.input "w" : !moe.tensor<[2, 64, 64], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  // 4 * (128 / 64) = 8 tasks: 2 experts x 2 peers x 2 row tiles of the 128
  // rows a rank sends an expert; expert e's tasks are 4e..4e+3.
  // CHECK: moe.dispatch "dispatch"
  // CHECK-SAME: grid = array<i64: 2, 2, 2, 1, 128, 64>
  // CHECK-SAME: tasks = 8 : i64
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 64 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
  // 2 x 2 per expert; each tile needs its expert's 4 dispatch tiles.
  // CHECK: moe.gmm "up"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "dispatch", first = [0, 0, 0, 0, 4, 4, 4, 4], last = [3, 3, 3, 3, 7, 7, 7, 7]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 2, 256, 64>
  // CHECK-SAME: tasks = 8 : i64
  %up = moe.gmm "up"(%t, %w, %g) -> "up_y" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "4 * single_rank_expert_num">, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[2, 64, 64], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32>
  // Row tile r of a swiglu over up's 2 x 2: up's row tile r, both column
  // tiles.
  // CHECK: moe.swiglu "s"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 0, producer = "up", first = [0, 2, 4, 6], last = [1, 3, 5, 7]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 1, 256, 32>
  // CHECK-SAME: tasks = 4 : i64
  %s = moe.swiglu "s"(%up) -> "s_out" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
  // Weight gradient, result [2, 64, 32]: 8 tiles per expert, 4 x 2 gives
  // square 16 x 16 tiles. Although s is row-tiled, every tile sums over all
  // of its expert's rows: both s row tiles of the expert.
  // CHECK: moe.gmm "wgrad"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 1, producer = "s", first = [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2], last = [1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3]>]
  // CHECK-SAME: grid = array<i64: 2, 1, 4, 2, 64, 32>
  // CHECK-SAME: tasks = 16 : i64
  %dw = moe.gmm "wgrad"(%x, %s, %g) -> "dw" {transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0], task_num = "8 * single_rank_expert_num">, split_value = 4096 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[256, 32], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[2, 64, 32], f32>
  // 2 x 2 x 2 row tiles; each puts rows of its expert: all 4 up tiles of it.
  // CHECK: moe.combine "combine"
  // CHECK-SAME: deps = [#moe.tile_map<operand = 1, producer = "up", first = [0, 0, 0, 0, 4, 4, 4, 4], last = [3, 3, 3, 3, 7, 7, 7, 7]>]
  // CHECK-SAME: grid = array<i64: 2, 2, 2, 1, 128, 64>
  // CHECK-SAME: tasks = 8 : i64
  %out = moe.combine "combine"(%off, %up, %soff, %n) -> "out" {split = #moe.split<inputs = [1:0], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 64 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// task_num is evaluated with the config and split_value: 4 * (128 / 64) = 8,
// 4 row tiles per expert.
// CHECK-LABEL: moe.graph "task_num"
// CHECK: moe.swiglu "p"
// CHECK-SAME: grid = array<i64: 2, 1, 4, 1, 256, 32>
// CHECK-SAME: tasks = 8 : i64
moe.graph "task_num" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 64 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// A put's count must be a multiple of L x R = 4. One the split value derives
// (256 / 128 = 2) is rounded up to it.
// CHECK-LABEL: moe.graph "put_rounded_up"
moe.graph "put_rounded_up" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // CHECK: moe.dispatch "dispatch"
  // CHECK-SAME: grid = array<i64: 2, 2, 1, 1, 128, 64>
  // CHECK-SAME: tasks = 4 : i64
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// An explicit task_num is taken as written: 2 is no multiple of L x R = 4.
moe.graph "put_not_multiple" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'dispatch': 2 tasks do not divide evenly over local experts x ranks (4); the task count must be a multiple of it}}
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0], task_num = "2">, split_value = 128 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// A swiglu's count must be a multiple of L = 2.
moe.graph "swiglu_not_multiple" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'p3': 3 tasks do not divide evenly over local experts (2); the task count must be a multiple of it}}
  %p3 = moe.swiglu "p3"(%y) -> "p3_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts - 1">, split_value = 1 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
}

// -----

// So must a gmm's.
moe.graph "gmm_not_multiple" {
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %w = moe.input "w" : !moe.tensor<[2, 64, 64], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'up': 5 tasks do not divide evenly over local experts (2); the task count must be a multiple of it}}
  %up = moe.gmm "up"(%x, %w, %g) -> "up_y" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts + 1">, split_value = 4096 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[2, 64, 64], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32>
}

// -----

// A weight gradient's [2, 2] result per expert has 4 elements: 8 tiles of it
// would leave some empty.
moe.graph "wgrad_empty_tiles" {
  %x = moe.input "x" : !moe.tensor<[256, 2], f32>
  %dy = moe.input "dy" : !moe.tensor<[256, 2], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'wgrad': 8 tasks per expert cannot tile its 2 x 2 result without empty tiles}}
  %dw = moe.gmm "wgrad"(%x, %dy, %g) -> "dw" {transpose_lhs, split = #moe.split<inputs = [], output_dims = [0], task_num = "8 * single_rank_expert_num">, split_value = 4096 : i64} : (!moe.tensor<[256, 2], f32>, !moe.tensor<[256, 2], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[2, 2, 2], f32>
}

// -----

// Split value 4096 allows one row tile, so the 4 tasks per expert must all be
// column tiles of a 2-column result.
moe.graph "gmm_empty_columns" {
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %w = moe.input "w" : !moe.tensor<[2, 64, 2], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'up': 4 tasks per expert cannot tile its 2 result columns without empty tiles}}
  %up = moe.gmm "up"(%x, %w, %g) -> "up_y" {split = #moe.split<inputs = [], output_dims = [0], task_num = "4 * single_rank_expert_num">, split_value = 4096 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[2, 64, 2], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 2], f32>
}

// -----

// 1024 tasks: 512 row tiles per expert over its 256-row segment.
moe.graph "swiglu_empty_rows" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'p': 512 row tiles over 256 rows leave tiles empty; use fewer tasks}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "4 * per_expert_seq">, split_value = 1 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
}

// -----

// A put's row tiles cut the 128 rows a rank sends an expert: 256 / 1 = 256
// tasks are 64 row tiles, fine; 1024 tasks are 256 row tiles, too many.
moe.graph "put_empty_rows" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 1 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'combine': 256 row tiles over 128 rows leave tiles empty; use fewer tasks}}
  %out = moe.combine "combine"(%off, %t, %soff, %n) -> "out" {split = #moe.split<inputs = [1:0], output_dims = [0], task_num = "4 * per_rank_seq">, split_value = 1 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// A split value that does not divide its dim: ceil(256 / 96) = 3 tiles,
// rounded up to 2 per local expert; the tiles of a segment are balanced.
// CHECK-LABEL: moe.graph "not_dividing_source"
moe.graph "not_dividing_source" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // CHECK: moe.swiglu "p"
  // CHECK-SAME: grid = array<i64: 2, 1, 2, 1, 256, 32>
  // CHECK-SAME: tasks = 4 : i64
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 96 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// CHECK-LABEL: moe.graph "not_dividing_input"
moe.graph "not_dividing_input" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  // The split input's dim 1 is intermediate_size = 32: ceil(32 / 5) = 7
  // tasks, rounded up to 4 per local expert.
  // CHECK: moe.swiglu_grad "c"
  // CHECK-SAME: grid = array<i64: 2, 1, 4, 1, 256, 64>
  // CHECK-SAME: tasks = 8 : i64
  %c = moe.swiglu_grad "c"(%p, %y) -> "c_out" {split = #moe.split<inputs = [0:1], output_dims = [0]>, split_value = 5 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "task_num_zero" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'p': task_num 'tp - 1' is 0; it must be positive}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "tp - 1">, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// A division in a task_num counts tiles and rounds up: ceil(256 / 96) = 3 row
// tiles per expert, rows [0, 85), [85, 170), [170, 256).
// CHECK-LABEL: moe.graph "task_num_not_dividing"
moe.graph "task_num_not_dividing" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // CHECK: moe.swiglu "p"
  // CHECK-SAME: grid = array<i64: 2, 1, 3, 1, 256, 32>
  // CHECK-SAME: tasks = 6 : i64
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "(per_expert_seq / split_value) * single_rank_expert_num">, split_value = 96 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "task_num_unknown_symbol" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'p': task_num: unknown symbol 'num_cube_core' (did you mean 'num_cube_cores'?)}}
  %p = moe.swiglu "p"(%y) -> "p_out" {split = #moe.split<inputs = [], output_dims = [0], task_num = "num_cube_core * 2">, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}
