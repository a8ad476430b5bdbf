// A graph with a gmm that moe-fuse-low-rank made (a low-rank pair), which
// a JSON graph file cannot hold.
moe.graph "fused" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  %y = moe.gmm "base"(%x, %w, %gl, %u, %b) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}
