// A weight-gradient gmm accumulating into an fp32 buffer, with tensors
// without slots, a tensor read before the op writing it, and concrete dims.
moe.graph "wgrad" attributes {edges = [["act", "wgrad"]]} {
  %y = moe.input "y" {slot = 4 : i64} : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], bf16, list, dynamic>
  %dw = moe.gmm "wgrad"(%y, %a, %g) -> "dw" {accumulate, transpose_lhs, fill = {advance = "cube_custom", event_delta = 1 : i64, offset_inputs = [0, 1]}, split = #moe.split<inputs = [1:0], output_dims = [0], task_num = "num_cube_cores * single_rank_expert_num">, split_value = 4096 : i64, tiling_slot = 3 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], bf16, list, dynamic>, !moe.tensor<[per_rank_seq, intermediate_size], bf16>, !moe.tensor<[2], i32>) -> !moe.tensor<[2, "2 * intermediate_size", intermediate_size], f32>
  %a = moe.swiglu "act"(%z) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], bf16>) -> !moe.tensor<[per_rank_seq, intermediate_size], bf16>
  %g = moe.input "g" : !moe.tensor<[2], i32>
  %z = moe.input "z" {slot = 0 : i64} : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], bf16>
}
