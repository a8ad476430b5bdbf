// RUN: moec-opt %s --split-input-file --verify-diagnostics

// Errors of the moe.dispatch and moe.combine verifier: ranks, element
// types, expert-count dims and hidden dims.

// Ranks: offsets and sizes are rank 1, rows rank 2.
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts, 2], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': target_offset 'off' must have rank 1, got rank 2}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts, 2], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq], act>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': src 'x' must have rank 2, got rank 1}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq], act>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts, 1], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': src_offset 'soff' must have rank 1, got rank 2}}
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts, 1], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[4, 4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': sizes 'n' must have rank 1, got rank 2}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[4, 4], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': result 'r' must have rank 2, got rank 3}}
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size, 1], act>
}

// -----

// Element types.
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i32>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': target_offset 'off' must have element type i64, got i32}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i32>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], act>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': src_offset 'soff' must have element type i64, got act}}
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], act>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], f32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': sizes 'n' must have element type i32 or i64, got f32}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], f32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], bf16>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': dtype mismatch: result 'r' and src 'x' differ in element type}}
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], bf16>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], f32>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': dtype mismatch: result 'r' and src 'x' differ in element type}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], bf16>
}

// -----

// Expert-count dims: symbolic and concrete mismatches.
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[top_k], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': shape mismatch: src_offset 'soff' dim 0 is 'top_k' but target_offset 'off' dim 0 is 'num_experts'}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[top_k], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[8], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': shape mismatch: src_offset 'soff' dim 0 is '8' but target_offset 'off' dim 0 is '4'}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[8], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<["2 * num_experts"], i64>
  // expected-error@+1 {{'moe.combine' op 'combine': shape mismatch: sizes 'n' dim 0 is '2 * num_experts' but target_offset 'off' dim 0 is 'num_experts'}}
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<["2 * num_experts"], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[2], i64>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': shape mismatch: sizes 'n' dim 0 is '2' but target_offset 'off' dim 0 is '4'}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[4], i64>, !moe.tensor<[2], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
}

// -----

// Hidden dims: symbolic and concrete mismatches.
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.dispatch' op 'dispatch': shape mismatch: result 'r' dim 1 is 'intermediate_size' but src 'x' dim 1 is 'hidden_size'}}
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, intermediate_size], act, list, dynamic>
}

// -----

moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[256, 64], f32>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  // expected-error@+1 {{'moe.combine' op 'combine': shape mismatch: result 'r' dim 1 is '32' but src 'x' dim 1 is '64'}}
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[256, 64], f32>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[256, 32], f32>
}

// -----

// Equal expressions in another spelling verify.
// expected-no-diagnostics
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, "hidden_size * 2 / 2"], bf16>
  %soff = moe.input "soff" : !moe.tensor<["num_experts + 0"], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i64>
  %r = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, "hidden_size * 2 / 2"], bf16>, !moe.tensor<["num_experts + 0"], i64>, !moe.tensor<[num_experts], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], bf16>
}

// -----

// An integer against a symbol is left for after moe-resolve-shapes.
// expected-no-diagnostics
moe.graph "g" {
  %off = moe.input "off" : !moe.tensor<[4], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act, list>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  %r = moe.combine "combine"(%off, %x, %soff, %n) -> "r" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, 64], act>
}
