// RUN: moec-opt %s --split-input-file --verify-diagnostics --moe-propagate-splits

// A `bindings` attribute alone does not make shapes resolved: every tensor
// must have integer dims and a bound dtype, even when every symbol the pass
// reads is bound.
moe.graph "g" attributes {bindings = {single_rank_expert_num = 2 : i64, ep = 2 : i64, per_expert_seq = 8 : i64, per_expert_seq_to_other = 4 : i64, per_rank_seq = 8 : i64, m = 8 : i64, n = 4 : i64}} {
  // expected-error@+1 {{tensor 'y' has unresolved dims or dtype: run moe-resolve-shapes first}}
  %y = moe.input "y" : !moe.tensor<[m, "2*n"], f32>
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[m, "2*n"], f32>) -> !moe.tensor<[m, n], f32>
}

// -----

// A resolved dim is not enough either: the dtype must be bound.
moe.graph "g" attributes {bindings = {single_rank_expert_num = 2 : i64, ep = 2 : i64, per_expert_seq = 8 : i64, per_expert_seq_to_other = 4 : i64, per_rank_seq = 8 : i64}} {
  // expected-error@+1 {{tensor 'y' has unresolved dims or dtype: run moe-resolve-shapes first}}
  %y = moe.input "y" : !moe.tensor<[8, 8], act>
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[8, 8], act>) -> !moe.tensor<[8, 4], act>
}

// -----

// The tile grids need the expert and sequence symbols moe-resolve-shapes
// binds; a graph whose bindings lack one is not from that pass.
// expected-error@+1 {{graph 'g' has no binding for 'per_expert_seq': run moe-resolve-shapes first}}
moe.graph "g" attributes {bindings = {single_rank_expert_num = 2 : i64, ep = 2 : i64, per_expert_seq_to_other = 4 : i64, per_rank_seq = 8 : i64}} {
  %y = moe.input "y" : !moe.tensor<[8, 8], f32>
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[8, 8], f32>) -> !moe.tensor<[8, 4], f32>
}

// -----

// expected-error@+1 {{graph 'g' has no binding for 'single_rank_expert_num': run moe-resolve-shapes first}}
moe.graph "g" attributes {bindings = {}} {
  %y = moe.input "y" : !moe.tensor<[8, 8], f32>
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[8, 8], f32>) -> !moe.tensor<[8, 4], f32>
}
