// RUN: moec-opt %s --split-input-file --verify-diagnostics

// Errors of the !moe.tensor type (parser and verifier) and of the
// #moe.split and #moe.tile_map attribute parsers.

moe.graph "g" {
  // expected-error@+1 {{tensor element type must be act, f32, bf16, f8E4M3FN, i8, i4, i32 or i64, got 'f16'}}
  %a = moe.input "a" : !moe.tensor<[4], f16>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{tensor element type must be act, f32, bf16, f8E4M3FN, i8, i4, i32 or i64, got 'index'}}
  %a = moe.input "a" : !moe.tensor<[4], index>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{dim 0 must be positive, got 0}}
  %a = moe.input "a" : !moe.tensor<[0, 4], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{dim 1 must be positive, got -2}}
  %a = moe.input "a" : !moe.tensor<[4, -2], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{dim 1 '2 *': column 4: expected an operand after '*'}}
  %a = moe.input "a" : !moe.tensor<[4, "2 *"], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{dim 1 '(a + b': column 7: expected ')' to close '(' at column 1}}
  %a = moe.input "a" : !moe.tensor<[4, "(a + b"], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{dim 0 '': column 1: expected an operand}}
  %a = moe.input "a" : !moe.tensor<[""], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{dim 1 '99999999999999999999': column 1: integer literal '99999999999999999999' does not fit in int64}}
  %a = moe.input "a" : !moe.tensor<[4, "99999999999999999999"], f32>
}

// -----

// A bare keyword dim is parsed as an expression too.
moe.graph "g" {
  // expected-error@+1 {{dim 1 'a.b': column 2: expected an operator or the end of the expression, got '.'}}
  %a = moe.input "a" : !moe.tensor<[4, a.b], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{expected a dim: an integer, a symbol or a quoted expression}}
  %a = moe.input "a" : !moe.tensor<[4, [2]], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{unknown tensor flag 'lists' (expected 'list' or 'dynamic')}}
  %a = moe.input "a" : !moe.tensor<[4], f32, lists>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{tile map 'first' and 'last' differ in length}}
  %a = moe.swiglu "s"(%y) -> "a" {deps = [#moe.tile_map<operand = 0, producer = "p", first = [0, 1], last = [1]>], split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{attribute 'deps' failed to satisfy constraint: tile maps}}
  %a = moe.swiglu "s"(%y) -> "a" {deps = [1 : i64], split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{expected ':'}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  // expected-error@+1 {{expected 'task_num'}}
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0], tasks = "4">, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "g" {
  // expected-error@+1 {{result #0 must be a tensor with symbolic or concrete dims, but got 'i32'}}
  %z = "moe.input"() {result_name = "z"} : () -> i32
}

// -----

moe.graph "g" {
  // expected-error@+1 {{tensor must have at least one dim}}
  %a = moe.input "a" : !moe.tensor<[], i64>
}

// -----

// expected-error@+1 {{binding 'a' must be an i64 integer, got "xyz"}}
moe.graph "g" attributes {bindings = {a = "xyz"}} {
}

// -----

// expected-error@+1 {{binding 'b' must be an i64 integer, got true}}
moe.graph "g" attributes {bindings = {b = true}} {
}
