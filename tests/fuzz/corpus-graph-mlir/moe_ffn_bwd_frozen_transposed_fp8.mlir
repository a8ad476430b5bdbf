module {
  moe.graph "moe_ffn_bwd_frozen_transposed_fp8" attributes {edges = [["dispatch", "act_grad"], ["act_grad", "swiglu_grad"], ["swiglu_grad", "gate_grad"], ["gate_grad", "combine"]]} {
    %0 = moe.input "target_offset" {slot = 1 : i64} : <[num_experts], i64>
    %1 = moe.input "src" {slot = 2 : i64} : <[per_rank_seq, hidden_size], act, list>
    %2 = moe.input "src_offset" {slot = 3 : i64} : <[num_experts], i64>
    %3 = moe.input "size_d" {slot = 4 : i64} : <[num_experts], i32>
    %4 = moe.input "act_grad_weight" {slot = 5 : i64} : <[single_rank_expert_num, hidden_size, local_intermediate_size], f8E4M3FN, list>
    %5 = moe.input "swiglu_dy" {slot = 7 : i64} : <[per_rank_seq, "2 * local_intermediate_size"], act, list, dynamic>
    %6 = moe.input "gate_grad_weight" {slot = 9 : i64} : <[single_rank_expert_num, "2 * local_intermediate_size", hidden_size], f8E4M3FN, list>
    %7 = moe.input "target_offset_c" {slot = 12 : i64} : <[num_experts], i64>
    %8 = moe.input "src_offset_c" {slot = 13 : i64} : <[num_experts], i64>
    %9 = moe.input "size_c" {slot = 14 : i64} : <[num_experts], i32>
    %10 = moe.input "glist" {slot = 15 : i64} : <[single_rank_expert_num], i64>
    %11 = moe.input "act_grad_weight_scale" {slot = 16 : i64} : <[single_rank_expert_num, "(hidden_size) / 128", "(local_intermediate_size) / 128"], f32, list>
    %12 = moe.input "gate_grad_weight_scale" {slot = 17 : i64} : <[single_rank_expert_num, "(2 * local_intermediate_size) / 128", "(hidden_size) / 128"], f32, list>
    %13 = moe.dispatch "dispatch"(%0, %1, %2, %3) -> "target" {auto_split, fill = {advance = "vector", event_group = "num_experts"}, slot = 0 : i64, split = #moe.split<inputs = [], output_dims = [0]>, split_value = 0 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
    %14 = moe.gmm "act_grad"(%13, %4, %10, %11) -> "act_grad_y" {auto_split, fill = {advance = "cube_only", global_trigger = false, num_cube_cores = "num_cube_cores", offset_inputs = [0], out_offset = true, rank_in_event = true}, slot = 6 : i64, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 0 : i64, tiling_slot = 20 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>, !moe.tensor<[single_rank_expert_num, hidden_size, local_intermediate_size], f8E4M3FN, list>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, "(hidden_size) / 128", "(local_intermediate_size) / 128"], f32, list>) -> !moe.tensor<[per_rank_seq, local_intermediate_size], act, list, dynamic>
    %15 = moe.swiglu_grad "swiglu_grad"(%14, %5) -> "swiglu_out" {auto_split, slot = 8 : i64, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 0 : i64, tiling_slot = 21 : i64} : (!moe.tensor<[per_rank_seq, local_intermediate_size], act, list, dynamic>, !moe.tensor<[per_rank_seq, "2 * local_intermediate_size"], act, list, dynamic>) -> !moe.tensor<[per_rank_seq, "2 * local_intermediate_size"], act, list, dynamic>
    %16 = moe.gmm "gate_grad"(%15, %6, %10, %12) -> "gate_grad_y" {auto_split, fill = {advance = "cube", global_trigger = false, num_cube_cores = "num_cube_cores", offset_inputs = [0], out_offset = true, rank_in_event = false}, slot = 10 : i64, split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 0 : i64, tiling_slot = 22 : i64} : (!moe.tensor<[per_rank_seq, "2 * local_intermediate_size"], act, list, dynamic>, !moe.tensor<[single_rank_expert_num, "2 * local_intermediate_size", hidden_size], f8E4M3FN, list>, !moe.tensor<[single_rank_expert_num], i64>, !moe.tensor<[single_rank_expert_num, "(2 * local_intermediate_size) / 128", "(hidden_size) / 128"], f32, list>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
    %17 = moe.combine "combine"(%7, %16, %8, %9) -> "combine_out" {auto_split, fill = {advance = "vector_only", event_group = 1 : i64}, reduce_tp, slot = 11 : i64, split = #moe.split<inputs = [1:0], output_dims = [0]>, split_value = 0 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list>
  }
}

