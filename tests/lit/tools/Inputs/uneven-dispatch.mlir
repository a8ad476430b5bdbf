// A dispatch of task_num 2 tasks: a put's grid is local experts x ranks x
// row tiles, 4 x T tasks with a 2-rank config of 2 local experts. (A count
// the split value derives is rounded up to fit; an explicit one is not.)
module {
  moe.graph "uneven" {
    %off = moe.input "off" : !moe.tensor<[num_experts], i64>
    %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
    %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
    %n = moe.input "n" : !moe.tensor<[num_experts], i32>
    %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0], task_num = "per_rank_seq / split_value">, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
  }
}
