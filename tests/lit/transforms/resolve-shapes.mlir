// RUN: moec-opt %s --split-input-file --verify-diagnostics --moe-resolve-shapes=config=%configs/tiny.json | FileCheck %s
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes=config=%configs/seed-test.json | FileCheck %s --check-prefix=BF16
// RUN: not moec-opt %s --split-input-file --moe-resolve-shapes=config=%configs/seed-test.json 2>&1 | FileCheck %s --check-prefix=DEFERRED
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes 2>&1 | FileCheck %s --check-prefix=NOCONFIG
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes=config=%S/Inputs/no-such-config.json 2>&1 | FileCheck %s --check-prefix=NOFILE
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes=config=%S/Inputs/misspelled-key.json 2>&1 | FileCheck %s --check-prefix=BADCONFIG

// tiny.json: hidden_size 64, intermediate_size 32, num_experts 4, top_k 2,
// ep 2, tp 1, seq_size 128, fp32, 2 cube cores, 4 vector cores. Derived:
// seq_all 512, per_expert_seq 256, per_rank_seq 256,
// per_expert_seq_to_other 128, single_rank_expert_num 2.

// CHECK-LABEL: moe.graph "resolved"
// CHECK-SAME: bindings = {dtype_size = 4 : i64, ep = 2 : i64, fp8_dispatch = 0 : i64, hidden_size = 64 : i64, intermediate_size = 32 : i64, local_intermediate_size = 32 : i64, num_cube_cores = 2 : i64, num_experts = 4 : i64, num_vector_cores = 4 : i64, per_expert_seq = 256 : i64, per_expert_seq_to_other = 128 : i64, per_rank_seq = 256 : i64, seq_all = 512 : i64, seq_size = 128 : i64, single_rank_expert_num = 2 : i64, top_k = 2 : i64, tp = 1 : i64}
// CHECK-SAME: edges = {{\[\[}}"up", "act"]]
moe.graph "resolved" attributes {edges = [["up", "act"]]} {
  // act becomes f32; flags and slots stay.
  // CHECK: moe.input "x" {slot = 3 : i64} : <[256, 64], f32, list>
  %x = moe.input "x" {slot = 3 : i64} : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  // CHECK: moe.input "w" : <[2, 64, 64], f32, list>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act, list>
  // Concrete element types are kept.
  // CHECK: moe.input "g" : <[2], i64>
  %g = moe.input "g" : !moe.tensor<[single_rank_expert_num], i64>
  // CHECK: moe.input "b" : <[4, 8, 512, 1], bf16>
  %b = moe.input "b" : !moe.tensor<[num_experts, "top_k * (num_experts)", seq_all, "per_expert_seq_to_other / 128"], bf16>
  // CHECK: moe.gmm "up"
  // CHECK-SAME: : (!moe.tensor<[256, 64], f32, list>, !moe.tensor<[2, 64, 64], f32, list>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32, dynamic>
  %y = moe.gmm "up"(%x, %w, %g) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act, list>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "intermediate_size * 2"], act, dynamic>
  // The split spec's task_num stays symbolic: it is evaluated by moe-propagate-splits.
  // CHECK: moe.swiglu "act"
  // CHECK-SAME: split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "per_expert_seq / split_value">
  // CHECK-SAME: : (!moe.tensor<[256, 64], f32, dynamic>) -> !moe.tensor<[256, 32], f32, dynamic>
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "per_expert_seq / split_value">, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "intermediate_size * 2"], act, dynamic>) -> !moe.tensor<[per_rank_seq, intermediate_size], act, dynamic>
}

// -----

// An integer dim against a symbolic one verifies before resolution and is
// checked once the symbol has a value: hidden_size is 64 in tiny.json, but
// 5120 in seed-test.json.
// CHECK-LABEL: moe.graph "deferred"
// CHECK: moe.combine "combine"
// CHECK-SAME: (!moe.tensor<[4], i64>, !moe.tensor<[256, 64], f32, list>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[256, 64], f32>
// DEFERRED: error: 'moe.combine' op 'combine': shape mismatch: result 'r' dim 1 is '64' but src 'x' dim 1 is '5120'
moe.graph "deferred" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, 64], act>
}

// -----

moe.graph "unknown_symbol" {
  // expected-error@+1 {{tensor 'x' dim 1 ('hiden_size'): unknown symbol 'hiden_size' (did you mean 'hidden_size'?)}}
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hiden_size], act>
}

// -----

moe.graph "unknown_symbol_far" {
  // expected-error@+1 {{tensor 'x' dim 0 ('2 * tokens'): unknown symbol 'tokens'}}
  %x = moe.input "x" : !moe.tensor<["2 * tokens"], act>
}

// -----

// split_value is bound only in task_num expressions, not in dims.
moe.graph "split_value_in_dim" {
  // expected-error@+1 {{tensor 'x' dim 0 ('per_rank_seq / split_value'): unknown symbol 'split_value'}}
  %x = moe.input "x" : !moe.tensor<["per_rank_seq / split_value"], act>
}

// -----

moe.graph "not_dividing" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  // expected-error@+1 {{tensor 'y' dim 1 ('hidden_size / 3'): 'hidden_size / 3' does not divide: 64 is not a multiple of 3}}
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "hidden_size / 3"], act>
}

// -----

moe.graph "division_by_zero" {
  // expected-error@+1 {{tensor 'y' dim 0 ('hidden_size / (tp - 1)'): division by zero in 'hidden_size / (tp - 1)': 'tp - 1' is 0}}
  %y = moe.input "y" : !moe.tensor<["hidden_size / (tp - 1)"], act>
}

// -----

moe.graph "non_positive" {
  // expected-error-re@+1 {{tensor 'y' dim 0 ('hidden_size - 2 * intermediate_size') is 0 with config '{{.*}}tiny.json'; dims must be positive}}
  %y = moe.input "y" : !moe.tensor<["hidden_size - 2 * intermediate_size"], act>
}

// -----

// Result tensors of compute ops are resolved too.
moe.graph "op_result" {
  %y = moe.input "y" : !moe.tensor<[256, "2 * intermediate_size"], act>
  // expected-error@+1 {{tensor 'a' dim 0 ('per_rank_sequence'): unknown symbol 'per_rank_sequence'}}
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_sequence, intermediate_size], act>
}

// With bf16 in the config, act becomes bf16.
// BF16-LABEL: moe.graph "moe_ffn_fwd"
// BF16-SAME: hidden_size = 5120 : i64
// BF16-SAME: per_rank_seq = 4096 : i64
// BF16-SAME: single_rank_expert_num = 8 : i64
// BF16: moe.input "src" {slot = 2 : i64} : <[4096, 5120], bf16, list>
// BF16: moe.input "up_proj_weight" {slot = 5 : i64} : <[8, 5120, 4096], bf16, list>
// BF16: moe.input "glist" {slot = 14 : i64} : <[8], i64>
// BF16: moe.swiglu "swiglu"
// BF16-SAME: -> !moe.tensor<[4096, 2048], bf16, list, dynamic>

// NOCONFIG: error: moe-resolve-shapes needs a config: pass config=PATH

// NOFILE: error: {{.*}}Inputs/no-such-config.json: cannot open: No such file or directory

// BADCONFIG: error: {{.*}}Inputs/misspelled-key.json: unknown key 'hidden_sise' (did you mean 'hidden_size'?)
