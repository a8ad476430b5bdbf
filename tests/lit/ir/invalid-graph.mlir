// RUN: moec-opt %s --split-input-file --verify-diagnostics

// Errors of the moe.graph verifier (ops, tensor names, slots, op names,
// tiling slots, ordering edges) and of the moe.input verifier.

moe.graph "g" {
  %a = moe.input "a" : !moe.tensor<[4], f32>
  // expected-error@+1 {{'builtin.module' op is not allowed in a moe.graph (only moe ops are)}}
  builtin.module {}
}

// -----

moe.graph "g" {
  %a = moe.input "a" : !moe.tensor<[4], f32>
  // expected-error@+1 {{'moe.input' op defines tensor 'a' a second time (first defined at}}
  %b = moe.input "a" : !moe.tensor<[4], f32>
}

// -----

// A compute op's result clashing with a graph input.
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op defines tensor 'y' a second time (first defined at}}
  %a = moe.swiglu "s"(%y) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %a = moe.input "a" {slot = 3 : i64} : !moe.tensor<[4], f32>
  // expected-error@+1 {{'moe.input' op tensor 'b' takes slot 3, already taken by tensor 'a'}}
  %b = moe.input "b" {slot = 3 : i64} : !moe.tensor<[4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" {slot = 0 : i64} : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op tensor 'a' takes slot 0, already taken by tensor 'y'}}
  %a = moe.swiglu "s"(%y) -> "a" {slot = 0 : i64, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  // expected-error@+1 {{'moe.swiglu' op op name 's' is used twice}}
  %b = moe.swiglu "s"(%y) -> "b" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = 0 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  // expected-error@+1 {{'moe.swiglu' op 's2' takes tiling slot 0, already taken by 's1'}}
  %b = moe.swiglu "s2"(%y) -> "b" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = 0 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// Tiling slot -1 (none) may repeat.
// expected-no-diagnostics
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %b = moe.swiglu "s2"(%y) -> "b" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// expected-error@+1 {{'moe.graph' op edge 0 names op 's3', which is not in the graph}}
moe.graph "g" attributes {edges = [["s1", "s3"]]} {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// Edges join compute ops; a graph input is not one.
// expected-error@+1 {{'moe.graph' op edge 0 names op 'y', which is not in the graph}}
moe.graph "g" attributes {edges = [["y", "s1"]]} {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// expected-error@+1 {{'moe.graph' op edge 0 goes from 's1' to itself}}
moe.graph "g" attributes {edges = [["s1", "s1"]]} {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// expected-error@+1 {{'moe.graph' op edge 2 ('s1' -> 's2') is listed twice}}
moe.graph "g" attributes {edges = [["s1", "s2"], ["s2", "s1"], ["s1", "s2"]]} {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %b = moe.swiglu "s2"(%y) -> "b" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// expected-error@+1 {{'moe.graph' op edge 0 must be a pair of op names}}
moe.graph "g" attributes {edges = [["s1", "s2", "s3"]]} {
}

// -----

// expected-error@+1 {{'moe.graph' op edge 1 must be a pair of op names}}
moe.graph "g" attributes {edges = [["s1", "s2"], ["s1", 2]]} {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %a = moe.swiglu "s1"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %b = moe.swiglu "s2"(%y) -> "b" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// expected-error@+1 {{'moe.graph' op edge 0 must be a pair of op names}}
moe.graph "g" attributes {edges = ["s1"]} {
}

// -----

// expected-error@+1 {{'moe.graph' op attribute 'edges' failed to satisfy constraint: array attribute}}
moe.graph "g" attributes {edges = 3} {
}

// -----

moe.graph "g" {
  // expected-error@+1 {{'moe.input' op tensor 'a' has slot -1: a slot is 0 to 65535}}
  %a = moe.input "a" {slot = -1 : i64} : !moe.tensor<[4], f32>
}

// -----

// Slots past the largest index (INT64_MAX is a hash map's reserved key; 2^32
// and more used to be truncated) are the op's own error.
moe.graph "g" {
  // expected-error@+1 {{'moe.input' op tensor 'a' has slot 9223372036854775807: a slot is 0 to 65535}}
  %a = moe.input "a" {slot = 9223372036854775807 : i64} : !moe.tensor<[4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op 's': tiling slot must be -1 (none) or a slot index 0 to 65535, got 4294967311}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64, tiling_slot = 4294967311 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

// An op missing a required attribute is reported by its own verifier before
// the graph's checks read the attribute.
moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{'moe.swiglu' op requires attribute 'split'}}
  %a = moe.swiglu "s"(%y) -> "a" {split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

