// RUN: moec-opt %s | FileCheck %s
// RUN: moec-opt %s | moec-opt | FileCheck %s

// The printed form parses back to itself: symbolic and concrete dims, the
// act element type, tensor flags, split specs, fill configs, gmm flags.

// CHECK-LABEL: moe.graph "roundtrip"
// CHECK-SAME: edges = {{\[\[}}"dispatch", "up"]]
moe.graph "roundtrip" attributes {edges = [["dispatch", "up"]]} {
  // CHECK: moe.input "x" {slot = 2 : i64} : <[per_rank_seq, hidden_size], act, list>
  %x = moe.input "x" {slot = 2 : i64} : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  // CHECK: moe.input "off" : <[4], i64>
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %sizes = moe.input "sizes" : !moe.tensor<[4], i32>
  // CHECK: moe.input "w" : <[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %g = moe.input "g" : !moe.tensor<[single_rank_expert_num], i64>
  // CHECK: moe.dispatch "dispatch"(%{{.*}}) -> "t"
  // CHECK-SAME: split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %sizes) -> "t" {fill = {advance = "vector", event_group = "num_experts"}, split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 128 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
  // CHECK: moe.gmm "up"
  // CHECK-SAME: split = #moe.split<inputs = [0:0], output_dims = [0]>
  %y = moe.gmm "up"(%t, %w, %g) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "intermediate_size * 2"], act>
  // CHECK: moe.swiglu "act"
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "intermediate_size * 2"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  // CHECK: moe.gmm "wgrad"
  // CHECK-SAME: accumulate
  // CHECK-SAME: transpose_lhs
  %dw = moe.gmm "wgrad"(%x, %y, %g) -> "dw" {accumulate, transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[per_rank_seq, "intermediate_size * 2"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, "2*intermediate_size"], act>
}

// FP8 e4m3 weights with their fp32 block scales as the fourth operand.
// CHECK-LABEL: moe.graph "fp8"
moe.graph "fp8" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], f8E4M3FN>
  %s = moe.input "s" : !moe.tensor<[single_rank_expert_num, "(2 * intermediate_size) / 128", "(hidden_size) / 128"], f32>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // CHECK: moe.gmm "m"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}})
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], f8E4M3FN>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, "(2 * intermediate_size) / 128", "(hidden_size) / 128"], f32>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}
