// RUN: moec-opt %s --split-input-file --verify-diagnostics

// Errors of the moe.swiglu and moe.swiglu_grad verifiers.

// swiglu: input[M, 2I] -> result[M, I].
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size", 1], act>
  // expected-error@+1 {{'moe.swiglu' op 's': input 'y' must have rank 2, got rank 3}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size", 1], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu' op 's': result 'r' must have rank 2, got rank 1}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq], act>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], bf16>
  // expected-error@+1 {{'moe.swiglu' op 's': dtype mismatch: input 'y' and result 'r' differ in element type}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], bf16>) -> !moe.tensor<[per_rank_seq, intermediate_size], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[seq_size, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu' op 's': shape mismatch: result 'r' dim 0 is '2 * seq_size' but input 'y' dim 0 is 'seq_size'}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[seq_size, "2 * intermediate_size"], act>) -> !moe.tensor<["2 * seq_size", intermediate_size], act>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': shape mismatch: result 'r' dim 0 is '128' but input 'y' dim 0 is '256'}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[128, 32], f32>
}

// -----

// The input is twice as wide as the result.
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  // expected-error@+1 {{'moe.swiglu' op 's': shape mismatch: input 'y' dim 1 is 'intermediate_size' but twice result 'r' dim 1 is '2 * (intermediate_size)'}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': shape mismatch: input 'y' dim 1 is '64' but twice result 'r' dim 1 is '2 * (64)'}}
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
}

// -----

// Equal expressions in another spelling verify.
// expected-no-diagnostics
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "intermediate_size * 2"], act, list, dynamic>
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "intermediate_size * 2"], act, list, dynamic>) -> !moe.tensor<[per_rank_seq, intermediate_size], act, list, dynamic>
}

// -----

// expected-no-diagnostics
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
}

// -----

// An integer against a symbol is left for after moe-resolve-shapes.
// expected-no-diagnostics
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, 64], act>
  %r = moe.swiglu "s"(%y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 64], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// swiglu_grad: grad[M, I] and input[M, 2I] -> result[M, 2I].
moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size, 1], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': grad 'da' must have rank 2, got rank 3}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size, 1], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': input 'y' must have rank 2, got rank 1}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': result 'r' must have rank 2, got rank 3}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size", 1], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], bf16>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': dtype mismatch: grad 'da' and input 'y' differ in element type}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], bf16>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': dtype mismatch: result 'r' and input 'y' differ in element type}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], f32>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[seq_size, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<["seq_size * top_k", "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: input 'y' dim 0 is 'seq_size * top_k' but grad 'da' dim 0 is 'seq_size'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[seq_size, intermediate_size], act>, !moe.tensor<["seq_size * top_k", "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[128, 32], f32>
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: input 'y' dim 0 is '256' but grad 'da' dim 0 is '128'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[128, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 64], f32>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: input 'y' dim 1 is 'intermediate_size' but twice grad 'da' dim 1 is '2 * (intermediate_size)'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[256, 32], f32>
  %y = moe.input "y" : !moe.tensor<[256, 32], f32>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: input 'y' dim 1 is '32' but twice grad 'da' dim 1 is '2 * (32)'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 32], f32>) -> !moe.tensor<[256, 32], f32>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[seq_size, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[seq_size, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: result 'r' dim 0 is 'seq_size + 1' but input 'y' dim 0 is 'seq_size'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[seq_size, intermediate_size], act>, !moe.tensor<[seq_size, "2 * intermediate_size"], act>) -> !moe.tensor<["seq_size + 1", "2 * intermediate_size"], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: result 'r' dim 1 is 'hidden_size' but input 'y' dim 1 is '2 * intermediate_size'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
}

// -----

moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[256, 32], f32>
  %y = moe.input "y" : !moe.tensor<[256, 64], f32>
  // expected-error@+1 {{'moe.swiglu_grad' op 'sg': shape mismatch: result 'r' dim 1 is '32' but input 'y' dim 1 is '64'}}
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[256, 32], f32>, !moe.tensor<[256, 64], f32>) -> !moe.tensor<[256, 32], f32>
}

// -----

// Integers against symbols are left for after moe-resolve-shapes.
// expected-no-diagnostics
moe.graph "g" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, 64], act>
  %r = moe.swiglu_grad "sg"(%da, %y) -> "r" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, 64], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}
