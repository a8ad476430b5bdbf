module {
  moe.graph "moe_ffn_fwd" attributes {edges = [["dispatch", "up_proj"], ["up_proj", "swiglu"], ["swiglu", "down_proj"], ["down_proj", "combine"]]} {
    %0 = moe.input "target_offset" {slot = 1 : i64} : <[num_experts], i64>
    %1 = moe.input "src" {slot = 2 : i64} : <[per_rank_seq, hidden_size], act, list>
    %2 = moe.input "src_offset" {slot = 3 : i64} : <[num_experts], i64>
    %3 = moe.input "size_d" {slot = 4 : i64} : <[num_experts], i32>
    %4 = moe.input "up_proj_weight" {slot = 5 : i64} : <[single_rank_expert_num, hidden_size, "2 * local_intermediate_size"], act, list>
    %5 = moe.input "down_proj_weight" {slot = 8 : i64} : <[single_rank_expert_num, local_intermediate_size, hidden_size], act, list>
    %6 = moe.input "target_offset_c" {slot = 11 : i64} : <[num_experts], i64>
    %7 = moe.input "src_offset_c" {slot = 12 : i64} : <[num_experts], i64>
    %8 = moe.input "size_c" {slot = 13 : i64} : <[num_experts], i32>
    %9 = moe.input "glist" {slot = 14 : i64} : <[single_rank_expert_num], i64>
    %10 = moe.dispatch "dispatch"(%0, %1, %2, %3) -> "target" {fill = {advance = "vector", event_group = "num_experts"}, quantizable, slot = 0 : i64, split = #moe.split<inputs = [], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 128 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
    %11 = moe.gmm "up_proj"(%10, %4, %9) -> "up_proj_y" {fill = {advance = "cube_only", global_trigger = false, num_cube_cores = "num_cube_cores", offset_inputs = [0], out_offset = true, rank_in_event = true}, slot = 6 : i64, split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "num_cube_cores * single_rank_expert_num">, split_value = 4096 : i64, tiling_slot = 0 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * local_intermediate_size"], act, list>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * local_intermediate_size"], act, list, dynamic>
    %12 = moe.swiglu "swiglu"(%11) -> "swiglu_out" {slot = 7 : i64, split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "(per_expert_seq / split_value) * single_rank_expert_num">, split_value = 128 : i64, tiling_slot = 1 : i64} : (!moe.tensor<[per_rank_seq, "2 * local_intermediate_size"], act, list, dynamic>) -> !moe.tensor<[per_rank_seq, local_intermediate_size], act, list, dynamic>
    %13 = moe.gmm "down_proj"(%12, %5, %9) -> "down_proj_y" {fill = {advance = "cube", global_trigger = false, num_cube_cores = "num_cube_cores", offset_inputs = [0], out_offset = true, rank_in_event = false}, slot = 9 : i64, split = #moe.split<inputs = [0:0], output_dims = [0], task_num = "num_cube_cores * single_rank_expert_num">, split_value = 4096 : i64, tiling_slot = 2 : i64} : (!moe.tensor<[per_rank_seq, local_intermediate_size], act, list, dynamic>, !moe.tensor<[single_rank_expert_num, local_intermediate_size, hidden_size], act, list>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>
    %14 = moe.combine "combine"(%6, %13, %7, %8) -> "combine_out" {fill = {advance = "vector_only", event_group = 1 : i64}, reduce_tp, slot = 10 : i64, split = #moe.split<inputs = [1:0], output_dims = [0], task_num = "num_experts * (per_expert_seq_to_other / split_value)">, split_value = 128 : i64, tiling_slot = -1 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act, list>
  }
}

