// RUN: moec-opt %s --split-input-file --moe-assign-slots | FileCheck %s
// RUN: moec-opt %graphs/moe_ffn_bwd.mlir --moe-assign-slots | FileCheck %s --check-prefix=BWD

// Tensors without a slot take the smallest free slots in block order; slots
// given are kept. Ops needing a tiling descriptor (gmm, swiglu, swiglu_grad)
// take the smallest free tiling slots; dispatch and combine get -1.

// CHECK-LABEL: moe.graph "slots"
// CHECK-NEXT: moe.input "off" {slot = 0 : i64}
// CHECK-NEXT: moe.input "x" {slot = 2 : i64}
// CHECK-NEXT: moe.input "soff" {slot = 3 : i64}
// CHECK-NEXT: moe.input "n" {slot = 1 : i64}
// CHECK-NEXT: moe.input "w" {slot = 4 : i64}
// CHECK-NEXT: moe.input "g" {slot = 6 : i64}
// CHECK-NEXT: moe.dispatch "dispatch"
// CHECK-SAME: -> "t" {slot = 5 : i64
// CHECK-SAME: tiling_slot = -1 : i64
// CHECK-NEXT: moe.gmm "up"
// CHECK-SAME: -> "y" {slot = 7 : i64
// CHECK-SAME: tiling_slot = 0 : i64
// CHECK-NEXT: moe.swiglu "act"
// CHECK-SAME: -> "a" {slot = 9 : i64
// CHECK-SAME: tiling_slot = 2 : i64
// CHECK-NEXT: moe.swiglu_grad "act_grad"
// CHECK-SAME: -> "da" {slot = 8 : i64
// CHECK-SAME: tiling_slot = 1 : i64
// CHECK-NEXT: moe.input "wd" {slot = 12 : i64}
// CHECK-NEXT: moe.gmm "down"
// CHECK-SAME: -> "z" {slot = 10 : i64
// CHECK-SAME: tiling_slot = 3 : i64
// CHECK-NEXT: moe.combine "combine"
// CHECK-SAME: -> "out" {slot = 11 : i64
// CHECK-SAME: tiling_slot = -1 : i64
moe.graph "slots" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" {slot = 2 : i64} : !moe.tensor<[per_rank_seq, hidden_size], act>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" {slot = 1 : i64} : !moe.tensor<[num_experts], i32>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %g = moe.input "g" {slot = 6 : i64} : !moe.tensor<[single_rank_expert_num], i64>
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
  %y = moe.gmm "up"(%t, %w, %g) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %a = moe.swiglu "act"(%y) -> "a" {slot = 9 : i64, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64, tiling_slot = 2 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  %da = moe.swiglu_grad "act_grad"(%a, %y) -> "da" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %wd = moe.input "wd" {slot = 12 : i64} : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], act>
  %z = moe.gmm "down"(%da, %wd, %g) -> "z" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
  %out = moe.combine "combine"(%off, %z, %soff, %n) -> "out" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
}

// -----

// Tiling slots given are kept, -1 included (even on a gmm), and skipped when
// handing out new ones; a dispatch given a tiling slot keeps it.
// CHECK-LABEL: moe.graph "tiling"
// CHECK-NEXT: moe.input "y" {slot = 0 : i64}
// CHECK-NEXT: moe.gmm "keep_none"
// CHECK-SAME: -> "a" {slot = 1 : i64
// CHECK-SAME: tiling_slot = -1 : i64
// CHECK-NEXT: moe.swiglu "first"
// CHECK-SAME: -> "b" {slot = 2 : i64
// CHECK-SAME: tiling_slot = 1 : i64
// CHECK-NEXT: moe.swiglu "second"
// CHECK-SAME: -> "c" {slot = 3 : i64
// CHECK-SAME: tiling_slot = 0 : i64
// CHECK-NEXT: moe.swiglu "third"
// CHECK-SAME: -> "d" {slot = 4 : i64
// CHECK-SAME: tiling_slot = 3 : i64
// CHECK-NEXT: moe.input "w" {slot = 5 : i64}
// CHECK-NEXT: moe.input "g" {slot = 6 : i64}
moe.graph "tiling" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.gmm "keep_none"(%y, %w, %g) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
  %b = moe.swiglu "first"(%y) -> "b" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = 1 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %c = moe.swiglu "second"(%y) -> "c" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %d = moe.swiglu "third"(%y) -> "d" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = 3 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 8], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
}

// -----

// CHECK-LABEL: moe.graph "dispatch_kept"
// CHECK-NEXT: moe.input "off" {slot = 0 : i64}
// CHECK-NEXT: moe.input "x" {slot = 1 : i64}
// CHECK-NEXT: moe.input "soff" {slot = 2 : i64}
// CHECK-NEXT: moe.input "n" {slot = 3 : i64}
// CHECK-NEXT: moe.dispatch "dispatch"
// CHECK-SAME: -> "t" {slot = 4 : i64
// CHECK-SAME: tiling_slot = 5 : i64
moe.graph "dispatch_kept" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64, tiling_slot = 5 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
}

// The backward graph has every slot already: nothing changes.
// BWD: moe.input "target_offset" {slot = 1 : i64}
// BWD: moe.input "glist" {slot = 19 : i64}
// BWD: moe.dispatch "dispatch"
// BWD-SAME: slot = 0 : i64
// BWD-SAME: tiling_slot = -1 : i64
// BWD: moe.gmm "act_grad"
// BWD-SAME: slot = 8 : i64
// BWD-SAME: tiling_slot = 20 : i64
// BWD: moe.gmm "w2_grad"
// BWD-SAME: slot = 18 : i64
// BWD-SAME: tiling_slot = 22 : i64
