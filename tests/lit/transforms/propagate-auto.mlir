// RUN: moec-opt %s --split-input-file --verify-diagnostics --moe-resolve-shapes=config=%configs/tiny.json --moe-propagate-splits

// Automatic splits (auto_split): what they refuse. Their grids are checked
// on the shipped graphs (tests/lit/tools/auto-split.test).

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 64], act>
  // expected-error@+1 {{'q': a moe.quantize cannot have an automatic split}}
  %q = moe.quantize "q"(%x) -> "xq" {auto_split, split = #moe.split<inputs = [], output_dims = [0]>, split_value = 0 : i64} : (!moe.tensor<[per_rank_seq, 64], act>) -> !moe.tensor<[per_rank_seq, 68], f8E4M3FN>
}

// -----

moe.graph "g" {
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, 64], act>
  // expected-error@+1 {{an automatic split (split_value "auto") has no task_num: the compiler chooses the task count}}
  %q = moe.quantize "q"(%x) -> "xq" {auto_split, split = #moe.split<inputs = [], output_dims = [0], task_num = "4">, split_value = 0 : i64} : (!moe.tensor<[per_rank_seq, 64], act>) -> !moe.tensor<[per_rank_seq, 68], f8E4M3FN>
}
