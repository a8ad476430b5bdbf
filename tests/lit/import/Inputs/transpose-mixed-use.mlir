// A tensor read transposed by a gmm and also by a swiglu: JSON cannot say it.
moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[8, 4], f32>
  %y = moe.input "y" : !moe.tensor<[8, 6], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  %dw = moe.gmm "wgrad"(%x, %y, %g) -> "dw" {transpose_lhs, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[8, 4], f32>, !moe.tensor<[8, 6], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[2, 4, 6], f32>
  %a = moe.swiglu "act"(%x) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[8, 4], f32>) -> !moe.tensor<[8, 2], f32>
}
