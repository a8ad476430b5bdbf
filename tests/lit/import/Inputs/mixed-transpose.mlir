// Tensor "x" is read transposed by "wgrad" and not by "up".
moe.graph "mixed" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>
  %dy = moe.input "dy" : !moe.tensor<[per_rank_seq, intermediate_size], act>
  %g = moe.input "g" : !moe.tensor<[single_rank_expert_num], i64>
  %y = moe.gmm "up"(%x, %w, %g) -> "y" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  %dw = moe.gmm "wgrad"(%x, %dy, %g) -> "dw" {transpose_lhs, split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[single_rank_expert_num, hidden_size, intermediate_size], act>
}
