// RUN: moec-opt %s --split-input-file --verify-diagnostics

// The moe.quantize and moe.dequantize verifiers, and FP8 rows on puts.

// A valid pair: [M, 300] rows quantize to [M, 300 + 4 * 3] f8E4M3FN rows.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 300], bf16>
  %q = moe.quantize "q"(%x) -> "xq" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 300], bf16>) -> !moe.tensor<[per_rank_seq, 312], f8E4M3FN>
  %d = moe.dequantize "d"(%q) -> "x2" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 312], f8E4M3FN>) -> !moe.tensor<[per_rank_seq, 300], bf16>
}

// -----

// Symbolic widths compare as expressions.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %q = moe.quantize "q"(%x) -> "xq" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>) -> !moe.tensor<[per_rank_seq, "(hidden_size) + 4 * (((hidden_size) + 127) / 128)"], f8E4M3FN>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 256], f32>
  // expected-error@+1 {{'moe.quantize' op 'q': shape mismatch: result 'xq' dim 1 is '256' but the width of quantized rows of input 'x' (H + 4 * ceil(H / 128)) is '264'}}
  %q = moe.quantize "q"(%x) -> "xq" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 256], f32>) -> !moe.tensor<[per_rank_seq, 256], f8E4M3FN>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 256], f32>
  // expected-error@+1 {{'moe.quantize' op 'q': result 'xq' must have element type f8E4M3FN, got bf16}}
  %q = moe.quantize "q"(%x) -> "xq" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 256], f32>) -> !moe.tensor<[per_rank_seq, 264], bf16>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 264], f8E4M3FN>
  // expected-error@+1 {{'moe.quantize' op 'q': input 'x' must have element type act, f32 or bf16, got f8E4M3FN}}
  %q = moe.quantize "q"(%x) -> "xq" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 264], f8E4M3FN>) -> !moe.tensor<[per_rank_seq, 264], f8E4M3FN>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[16, 264], f8E4M3FN>
  // expected-error@+1 {{'moe.dequantize' op 'd': shape mismatch: result 'y' dim 0 is '8' but input 'x' dim 0 is '16'}}
  %d = moe.dequantize "d"(%x) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[16, 264], f8E4M3FN>) -> !moe.tensor<[8, 256], f32>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 264, 1], f8E4M3FN>
  // expected-error@+1 {{'moe.dequantize' op 'd': input 'x' must have rank 2, got rank 3}}
  %d = moe.dequantize "d"(%x) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, 264, 1], f8E4M3FN>) -> !moe.tensor<[per_rank_seq, 256], f32>
}

// -----

// A combine returns rows in the compute dtype only.
moe.graph "g" {
  %to = moe.input "to" : !moe.tensor<[4], i64>
  %rows = moe.input "rows" : !moe.tensor<[per_rank_seq, 264], f8E4M3FN>
  %from = moe.input "from" : !moe.tensor<[4], i64>
  %n = moe.input "n" : !moe.tensor<[4], i32>
  // expected-error@+1 {{'moe.combine' op 'c': src 'rows' must have element type act, f32 or bf16, got f8E4M3FN}}
  %c = moe.combine "c"(%to, %rows, %from, %n) -> "out" {split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[4], i64>, !moe.tensor<[per_rank_seq, 264], f8E4M3FN>, !moe.tensor<[4], i64>, !moe.tensor<[4], i32>) -> !moe.tensor<[per_rank_seq, 264], f8E4M3FN>
}
