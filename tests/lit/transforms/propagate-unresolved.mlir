// RUN: not moec-opt %s --moe-propagate-splits 2>&1 | FileCheck %s

// A `bindings` attribute alone does not make shapes resolved: every tensor
// must have integer dims and a bound dtype.

// CHECK: error: tensor 'y' has unresolved dims or dtype: run moe-resolve-shapes first
moe.graph "g" attributes {bindings = {}} {
  %y = moe.input "y" : !moe.tensor<[m, "2*n"], f32>
  %a = moe.swiglu "s"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[m, "2*n"], f32>) -> !moe.tensor<[m, n], f32>
}
