moe.graph "first" {
  %x = moe.input "x" : !moe.tensor<[4], i64>
}
moe.graph "second" {
  %x = moe.input "x" : !moe.tensor<[4], i64>
}
