// RUN: moec-opt %s --split-input-file --verify-diagnostics

// Errors of the moe.gmm verifier, in both forms: the activation form
// (rank-3 rhs, forward and data gradient) and the weight-gradient form
// (rank-2 rhs with transpose_lhs).

// group_list and lhs.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num, 1], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': group_list 'gl' must have rank 1, got rank 2}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num, 1], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], f32>
  // expected-error@+1 {{'moe.gmm' op 'm': group_list 'gl' must have element type i32 or i64, got f32}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], f32>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': lhs 'x' must have rank 2, got rank 1}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

// Element types.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], bf16>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': dtype mismatch: lhs 'x' and rhs 'w' differ in element type}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], bf16>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], bf16>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], bf16>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': dtype mismatch: result 'r' must have the operands' element type (or f32 with accumulate)}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], bf16>, !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], bf16>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, intermediate_size], f32>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], bf16>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], bf16>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': dtype mismatch: result 'r' must have the operands' element type (or f32 with accumulate)}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[per_rank_seq, hidden_size], bf16>, !moe.tensor<[per_rank_seq, intermediate_size], bf16>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], f32>
}

// -----

// An f32 result with accumulate (an fp32 main-grad buffer) verifies.
// expected-no-diagnostics
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], bf16>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], bf16>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs, accumulate} : (!moe.tensor<[per_rank_seq, hidden_size], bf16>, !moe.tensor<[per_rank_seq, intermediate_size], bf16>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], f32>
}

// -----

// Activation form (rank-3 rhs).
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': transpose_lhs needs the weight-gradient form (a rank-2 rhs); rhs 'w' has rank 3}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': accumulate needs the weight-gradient form (a rank-2 rhs)}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, accumulate} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'r' must have rank 2, got rank 3}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, per_rank_seq, "2 * intermediate_size"], act>
}

// -----

// Contraction dim: rhs[G, K, N] against lhs[M, K].
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, intermediate_size, hidden_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs 'w' dim 1 is 'intermediate_size' but lhs 'x' dim 1 is 'hidden_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, intermediate_size, hidden_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %w = moe.input "w" : !moe.tensor<[2, 32, 64], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs 'w' dim 1 is '32' but lhs 'x' dim 1 is '64'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[2, 32, 64], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[256, 64], f32>
}

// -----

// With transpose_rhs the rhs is [G, N, K].
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, intermediate_size, hidden_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs (transposed) 'w' dim 2 is 'hidden_size' but lhs 'x' dim 1 is 'intermediate_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_rhs} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num, intermediate_size, hidden_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
}

// -----

// The backward graph's act_grad: lhs[M, H], rhs[G, I, H] transposed -> [M, I].
// expected-no-diagnostics
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, intermediate_size, hidden_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_rhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, intermediate_size, hidden_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// Group count.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[top_k, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[num_experts], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs 'w' dim 0 is 'top_k' but group_list 'gl' dim 0 is 'num_experts'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[top_k, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[num_experts], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %w = moe.input "w" : !moe.tensor<[4, 64, 32], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i32>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs 'w' dim 0 is '4' but group_list 'gl' dim 0 is '2'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[4, 64, 32], f32>, !moe.tensor<[2], i32>) -> !moe.tensor<[256, 32], f32>
}

// -----

// Result shape [M, N].
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[seq_size, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: result 'r' dim 0 is 'seq_size * top_k' but lhs 'x' dim 0 is 'seq_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[seq_size, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<["seq_size * top_k", "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: result 'r' dim 1 is 'intermediate_size' but rhs 'w' dim 2 is '2 * intermediate_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: result 'r' dim 1 is 'intermediate_size' but rhs (transposed) 'w' dim 1 is 'hidden_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_rhs} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// An integer against a symbol is left for after moe-resolve-shapes.
// expected-no-diagnostics
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, 64], act>
}

// -----

// Derived config symbols compare by their definitions: per_rank_seq is
// seq_all / ep.
// expected-no-diagnostics
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<["seq_all / ep", "2 * intermediate_size"], act>
}

// -----

// Expressions with a division that differ are left for after
// moe-resolve-shapes: per_expert_seq (seq_all / top_k) equals per_rank_seq
// (seq_all / ep) when top_k equals ep.
// expected-no-diagnostics
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_expert_seq, "2 * intermediate_size"], act>
}

// -----

// Weight-gradient form (rank-2 rhs): lhs[M, K]^T x rhs[M, N] -> [G, K, N].
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': the weight-gradient form (a rank-2 rhs) needs transpose_lhs}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': transpose_rhs is not supported in the weight-gradient form}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs, transpose_rhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'r' must have rank 3, got rank 2}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[hidden_size, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[seq_size, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<["seq_size * top_k", intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs 'w' dim 0 is 'seq_size * top_k' but lhs 'x' dim 0 is 'seq_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[seq_size, hidden_size], act>, !moe.tensor<["seq_size * top_k", intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %w = moe.input "w" : !moe.tensor<[128, 32], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: rhs 'w' dim 0 is '128' but lhs 'x' dim 0 is '256'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[256, 64], f32>, !moe.tensor<[128, 32], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[2, 64, 32], f32>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[num_experts], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: result 'r' dim 0 is 'top_k' but group_list 'gl' dim 0 is 'num_experts'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[num_experts], i64>) -> !moe.tensor<[top_k, hidden_size, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: result 'r' dim 1 is 'intermediate_size' but lhs 'x' dim 1 is 'hidden_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, intermediate_size, intermediate_size], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: result 'r' dim 2 is 'hidden_size' but rhs 'w' dim 1 is 'intermediate_size'}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, hidden_size], act>
}

// -----

// expected-no-diagnostics
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64, transpose_lhs, accumulate} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, "intermediate_size"], act>
}

// -----

// rhs of another rank.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, 1, hidden_size, intermediate_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': rhs 'w' must have rank 3 (expert weights) or rank 2 (weight-gradient form), got 4}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, 1, hidden_size, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[hidden_size], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': rhs 'w' must have rank 3 (expert weights) or rank 2 (weight-gradient form), got 1}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[hidden_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

// FP8 e4m3 weights: the fourth operand is their fp32 block scales.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], f8E4M3FN>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': rhs 'w' is 'f8E4M3FN' codes and the gmm has no fourth operand: quantized weights need their fp32 scales, one per 128 x 128 block}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], f8E4M3FN>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], f8E4M3FN>
  %s = moe.input "s" : !moe.tensor<[2, 2, 8], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: scales 's' dim 2 is '8' but the 128-column blocks of rhs is '(512) / 128'}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], f8E4M3FN>, !moe.tensor<[2], i64>, !moe.tensor<[2, 2, 8], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], f8E4M3FN>
  %s = moe.input "s" : !moe.tensor<[single_rank_expert_num, "(2 * intermediate_size) / 128", "hidden_size / 128"], bf16>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' must have element type f32, got bf16}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, "2 * intermediate_size", hidden_size], f8E4M3FN>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, "(2 * intermediate_size) / 128", "hidden_size / 128"], bf16>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

// No gmm writes an FP8 weight (a weight gradient into a quantized weight).
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %dy = moe.input "dy" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'dw' is 'f8E4M3FN': a quantized weight is frozen, no gmm writes one}}
  %dw = moe.gmm "m"(%x, %dy, %gl) -> "dw" {transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], f8E4M3FN>
}

// -----

// int8 codes (a scale per row) and int4 codes (a scale per group of 32, 64
// or 128 along a row, or (scale, zero point) pairs): the fourth operand is
// their fp32 scales, [G, rows], [G, rows, groups] or [G, rows, groups, 2].
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': rhs 'w' is 'i8' codes and the gmm has no fourth operand: quantized weights need their fp32 scales, one per row}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': rhs 'w' is 'i4' codes and the gmm has no fourth operand: quantized weights need their fp32 scales, one per group of 32, 64 or 128 along a row}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[2, 256, 4], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' must have rank 2, got rank 3}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 4], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[2, 512], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: scales 's' dim 1 is '512' but rhs 'w' dim 1 is '256'}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[2, 512], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[4, 256], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: scales 's' dim 0 is '4' but rhs 'w' dim 0 is '2'}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[4, 256], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[2, 256], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' must have element type f32, got bf16}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256], bf16>) -> !moe.tensor<[64, 256], act>
}

// -----

// A quantized weight's product is not scaled (its scales are its own).
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[2, 256], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': a quantized weight's gmm takes no scale attribute}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, scale = 5.000000e-01 : f64, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 4, 2], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': a quantized weight's gmm takes no scale attribute}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, scale = "lora_scaling", split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 4, 2], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

// Groups of 48, 16, and a count that does not divide the row.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 96], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 96], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 2], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' holds 2 groups for rows of 96 values: an int4 weight's groups are 32, 64 or 128 values each}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 96], act>, !moe.tensor<[2, 256, 96], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 2], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 32], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' holds 32 groups for rows of 512 values: an int4 weight's groups are 32, 64 or 128 values each}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 32], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 3], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' holds 3 groups for rows of 512 values: an int4 weight's groups are 32, 64 or 128 values each}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 3], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

// With zero points the groups are checked alike.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 96], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 96], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 2, 2], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' holds 2 groups for rows of 96 values: an int4 weight's groups are 32, 64 or 128 values each}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 96], act>, !moe.tensor<[2, 256, 96], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 2, 2], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 8, 3], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' dim 3 must be 2 (a scale and a zero point per group), got 3}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 8, 3], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 8, 1], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' dim 3 must be 2 (a scale and a zero point per group), got 1}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 8, 1], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' must have rank 3 ([G, rows, groups]) or 4 ([G, rows, groups, 2]: scales and zero points), got rank 2}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 8, 2, 1], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' must have rank 3 ([G, rows, groups]) or 4 ([G, rows, groups, 2]: scales and zero points), got rank 5}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 8, 2, 1], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 512, 8], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: scales 's' dim 1 is '512' but rhs 'w' dim 1 is '256'}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 512, 8], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i4>
  %s = moe.input "s" : !moe.tensor<[2, 256, 8], i64>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': scales 's' must have element type f32, got i64}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i4>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256, 8], i64>) -> !moe.tensor<[64, 256], act>
}

// -----

// Codes are weights only: an lhs of codes is refused.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], i8>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[2, 256], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': lhs 'x' must have element type act, f32 or bf16, got i8}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], i8>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256], f32>) -> !moe.tensor<[64, 256], act>
}

// -----

// No gmm writes an int8 or int4 weight either.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %dy = moe.input "dy" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'dw' is 'i8': a quantized weight is frozen, no gmm writes one}}
  %dw = moe.gmm "m"(%x, %dy, %gl) -> "dw" {transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], i8>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %dy = moe.input "dy" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %gl = moe.input "gl" : !moe.tensor<[single_rank_expert_num], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'dw' is 'i4': a quantized weight is frozen, no gmm writes one}}
  %dw = moe.gmm "m"(%x, %dy, %gl) -> "dw" {transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], i4>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[2, 256, 512], i8>
  %s = moe.input "s" : !moe.tensor<[2, 256], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'r' is 'i8': a quantized weight is frozen, no gmm writes one}}
  %r = moe.gmm "m"(%x, %w, %gl, %s) -> "r" {transpose_rhs, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[2, 256, 512], i8>, !moe.tensor<[2], i64>, !moe.tensor<[2, 256], f32>) -> !moe.tensor<[64, 256], i8>
}

// -----

// Codes are expert weights: a rank-2 rhs of codes (the weight-gradient form) is refused.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 512], act>
  %w = moe.input "w" : !moe.tensor<[64, 256], i4>
  %s = moe.input "s" : !moe.tensor<[64, 8], f32>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': rhs 'w' is 'i4' codes: quantized weights are expert weights (rank 3), read by the activation form}}
  %dw = moe.gmm "m"(%x, %w, %gl, %s) -> "dw" {transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[64, 512], act>, !moe.tensor<[64, 256], i4>, !moe.tensor<[2], i64>, !moe.tensor<[64, 8], f32>) -> !moe.tensor<[2, 512, 256], act>
}

// -----

// A low-rank pair (moe-fuse-low-rank's; low_lhs [M, r], low_rhs [G, r, N]):
// low_rhs's r must be low_lhs's columns.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 8, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: low_rhs 'b' dim 1 is '8' but low_lhs 'u' dim 1 is '4'}}
  %r = moe.gmm "m"(%x, %w, %gl, %u, %b) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 8, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}

// -----

// transpose_low_rhs reads low_rhs as [G, N, r].
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': shape mismatch: low_rhs (transposed) 'b' dim 2 is '48' but low_lhs 'u' dim 1 is '4'}}
  %r = moe.gmm "m"(%x, %w, %gl, %u, %b) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64, transpose_low_rhs} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}

// -----

// An addend and a low-rank pair: the pass never makes one.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %d = moe.input "d" : !moe.tensor<[64, 48], bf16>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': a low-rank product needs a gmm without an addend or a scale}}
  %r = moe.gmm "m"(%x, %w, %gl, %d, %u, %b) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 48], bf16>, !moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}

// -----

// The low-rank pair of lhs's element type.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], f32>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': dtype mismatch: low_lhs 'u' and lhs 'x' differ in element type}}
  %r = moe.gmm "m"(%x, %w, %gl, %u, %b) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 4], f32>, !moe.tensor<[2, 4, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.gmm' op 'm': transpose_low_rhs needs a low-rank product}}
  %r = moe.gmm "m"(%x, %w, %gl) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64, transpose_low_rhs} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 48], bf16>
}

// -----

// At most an addend (or scales) and a low-rank pair.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %d = moe.input "d" : !moe.tensor<[64, 48], bf16>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': a gmm takes at most 6 operands (an addend or scales, then a low-rank pair), got 7}}
  %r = moe.gmm "m"(%x, %w, %gl, %d, %u, %b, %b) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 48], bf16>, !moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>, !moe.tensor<[2, 4, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}

// -----

// Dims compared before the rank checks of their tensors: an addend's or a
// low-rank pair's beside a result of rank 1 (an error, not a read past the
// result's dims).
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %d = moe.input "d" : !moe.tensor<[64, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'r' has rank 1, so no dim 1}}
  %r = moe.gmm "m"(%x, %w, %gl, %d) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 48], bf16>) -> !moe.tensor<[64], bf16>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  // expected-error@+1 {{'moe.gmm' op 'm': result 'r' has rank 1, so no dim 1}}
  %r = moe.gmm "m"(%x, %w, %gl, %u, %b) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>) -> !moe.tensor<[64], bf16>
}
