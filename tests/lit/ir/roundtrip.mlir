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

// int8 codes with an fp32 scale per row: scales [G, rows].
// CHECK-LABEL: moe.graph "int8"
moe.graph "int8" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  // CHECK: moe.input "w" : <[single_rank_expert_num, "2 * intermediate_size", hidden_size], i8>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], i8>
  // CHECK: moe.input "s" : <[single_rank_expert_num, "2 * intermediate_size"], f32>
  %s = moe.input "s" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size"], f32>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // CHECK: moe.gmm "m"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) -> "r"
  // CHECK-SAME: transpose_rhs
  // CHECK-SAME: <[single_rank_expert_num, "2 * intermediate_size", hidden_size], i8>
  // CHECK-SAME: <[single_rank_expert_num, "2 * intermediate_size"], f32>
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], i8>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size"], f32>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// int4 codes with an fp32 scale per group along a row: scales [G, rows,
// groups], groups of 64 and 32 where the dims are known, of the config's
// weight_group where they are symbolic.
// CHECK-LABEL: moe.graph "int4"
moe.graph "int4" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  // CHECK: moe.input "w" : <[2, 256, 512], i4>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  // CHECK: moe.input "s64" : <[2, 256, 8], f32>
  %s64 = moe.input "s64" : !moe.tensor<[2, 256, 8], f32>
  // CHECK: moe.input "s32" : <[2, 256, 16], f32>
  %s32 = moe.input "s32" : !moe.tensor<[2, 256, 16], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // CHECK: moe.gmm "g64"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) -> "r64"
  // CHECK-SAME: <[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 8], f32>
  %r64 = moe.gmm "g64"(%x, %w, %gl, %s64) -> "r64" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 8], f32>) -> !moe.tensor<[64, 256], act>
  // CHECK: moe.gmm "g32"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) -> "r32"
  // CHECK-SAME: !moe.tensor<[2, 256, 16], f32>
  %r32 = moe.gmm "g32"(%x, %w, %gl, %s32) -> "r32" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 16], f32>) -> !moe.tensor<[64, 256], act>
  %xs = moe.input "xs" : !moe.tensor<[per_rank_seq, hidden_size], act>
  // CHECK: moe.input "ws" : <[single_rank_expert_num, "2 * intermediate_size", hidden_size], i4>
  %ws = moe.input "ws" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], i4>
  // CHECK: moe.input "ss" : <[single_rank_expert_num, "2 * intermediate_size", "(hidden_size) / weight_group"], f32>
  %ss = moe.input "ss" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", "(hidden_size) / weight_group"], f32>
  %gls = moe.input "gls" : !moe.tensor<[single_rank_expert_num], i64>
  // CHECK: moe.gmm "gs"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) -> "rs"
  %rs = moe.gmm "gs"(%xs, %ws, %gls, %ss) -> "rs" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], i4>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", "(hidden_size) / weight_group"], f32>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// int4 codes with (scale, zero point) pairs per group: scales [G, rows,
// groups, 2], here groups of 128; and symbolic.
// CHECK-LABEL: moe.graph "int4zp"
moe.graph "int4zp" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  // CHECK: moe.input "s" : <[2, 256, 4, 2], f32>
  %s = moe.input "s" : !moe.tensor<[2, 256, 4, 2], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // CHECK: moe.gmm "m"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) -> "r"
  // CHECK-SAME: <[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 4, 2], f32>
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 4, 2], f32>) -> !moe.tensor<[64, 256], act>
  %xs = moe.input "xs" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %ws = moe.input "ws" : !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], i4>
  // CHECK: moe.input "ss" : <[single_rank_expert_num, hidden_size, "(intermediate_size) / weight_group", 2], f32>
  %ss = moe.input "ss" : !moe.tensor<[single_rank_expert_num, hidden_size, "(intermediate_size) / weight_group", 2], f32>
  %gls = moe.input "gls" : !moe.tensor<[single_rank_expert_num], i64>
  // CHECK: moe.gmm "gs"(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}) -> "rs"
  %rs = moe.gmm "gs"(%xs, %ws, %gls, %ss) -> "rs" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], i4>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, hidden_size, "(intermediate_size) / weight_group", 2], f32>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
}
