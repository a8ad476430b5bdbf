// RUN: moec-opt %s --split-input-file --verify-diagnostics --moe-verify-graph | FileCheck %s
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-verify-graph --verify-diagnostics | FileCheck %s --check-prefix=FWD
// RUN: moec-opt %graphs/moe_ffn_bwd.mlir --moe-verify-graph --verify-diagnostics | FileCheck %s --check-prefix=BWD
// RUN: not moec-opt %s --moe-verify-graph 2>&1 | FileCheck %s --check-prefix=LOC

// Without --split-input-file all graphs form one module; LOC checks the
// diagnostics' file:line:col.

// The real graphs pass unchanged, with no diagnostics.
// FWD: moe.graph "moe_ffn_fwd"
// FWD: moe.combine "combine"
// BWD: moe.graph "moe_ffn_bwd"
// BWD: moe.gmm "w2_grad"

// A chain where every split input is produced by an op passes unchanged.
// CHECK-LABEL: moe.graph "chain"
// CHECK: moe.swiglu "act"
// CHECK: moe.dispatch "dispatch"
// CHECK: moe.gmm "up"
moe.graph "chain" attributes {edges = [["dispatch", "act"]]} {
  %off = moe.input "off" : !moe.tensor<[num_experts], i64>
  %x = moe.input "x" : !moe.tensor<[per_rank_seq, hidden_size], act>
  %soff = moe.input "soff" : !moe.tensor<[num_experts], i64>
  %n = moe.input "n" : !moe.tensor<[num_experts], i32>
  %w = moe.input "w" : !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>
  %g = moe.input "g" : !moe.tensor<[single_rank_expert_num], i64>
  // Ops may appear in any order in the graph region.
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  %t = moe.dispatch "dispatch"(%off, %x, %soff, %n) -> "t" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[num_experts], i64>, !moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[num_experts], i64>, !moe.tensor<[num_experts], i32>) -> !moe.tensor<[per_rank_seq, hidden_size], act>
  %y = moe.gmm "up"(%t, %w, %g) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4096 : i64} : (!moe.tensor<[per_rank_seq, hidden_size], act>, !moe.tensor<[single_rank_expert_num, hidden_size, "2 * intermediate_size"], act>, !moe.tensor<[single_rank_expert_num], i64>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

// An op reading its own result.
// LOC: verify-graph.mlir:[[@LINE+2]]:1: error: graph 'self_loop' has a cycle: 'a' -> 'a'
// expected-error@+1 {{graph 'self_loop' has a cycle: 'a' -> 'a'}}
moe.graph "self_loop" {
  %w = moe.input "w" : !moe.tensor<[2, 8, 8], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  %a = moe.gmm "a"(%a, %w, %g) -> "ta" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
}

// -----

// A cycle through three ops, named in data-flow order: 'a' reads 'c', 'b'
// reads 'a', 'c' reads 'b'.
// LOC: verify-graph.mlir:[[@LINE+2]]:1: error: graph 'three' has a cycle: 'a' -> 'b' -> 'c' -> 'a'
// expected-error@+1 {{graph 'three' has a cycle: 'a' -> 'b' -> 'c' -> 'a'}}
moe.graph "three" {
  %w = moe.input "w" : !moe.tensor<[2, 8, 8], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  %a = moe.gmm "a"(%c, %w, %g) -> "ta" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
  %b = moe.gmm "b"(%a, %w, %g) -> "tb" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
  %c = moe.gmm "c"(%b, %w, %g) -> "tc" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
}

// -----

// A cycle closed by an ordering edge: 'down' reads 'up', and the edge
// makes 'up' wait for 'down'.
// LOC: verify-graph.mlir:[[@LINE+2]]:1: error: graph 'ordering' has a cycle: 'up' -> 'down' -> 'up'
// expected-error@+1 {{graph 'ordering' has a cycle: 'up' -> 'down' -> 'up'}}
moe.graph "ordering" attributes {edges = [["down", "up"]]} {
  %x = moe.input "x" : !moe.tensor<[16, 8], f32>
  %w = moe.input "w" : !moe.tensor<[2, 8, 8], f32>
  %g = moe.input "g" : !moe.tensor<[2], i64>
  %up = moe.gmm "up"(%x, %w, %g) -> "y" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
  %down = moe.gmm "down"(%up, %w, %g) -> "z" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>, !moe.tensor<[2, 8, 8], f32>, !moe.tensor<[2], i64>) -> !moe.tensor<[16, 8], f32>
}

// -----

// Two ops ordered both ways by edges alone.
// expected-error@+1 {{graph 'edges_only' has a cycle: 'p' -> 'q' -> 'p'}}
moe.graph "edges_only" attributes {edges = [["p", "q"], ["q", "p"]]} {
  %y = moe.input "y" : !moe.tensor<[16, 8], f32>
  %p = moe.swiglu "p"(%y) -> "tp" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
  %q = moe.swiglu "q"(%y) -> "tq" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 4 : i64} : (!moe.tensor<[16, 8], f32>) -> !moe.tensor<[16, 4], f32>
}

// -----

moe.graph "split_graph_input" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // LOC: verify-graph.mlir:[[@LINE+2]]:8: error: 'act' splits operand 0 ('y'), which is a graph input: there are no producer tiles to follow
  // expected-error@+1 {{'act' splits operand 0 ('y'), which is a graph input: there are no producer tiles to follow (the seed silently used a task count of 1 here); split a tensor an op produces, or make the op a source (no split inputs)}}
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// Every offending op is reported, and every offending split input: here the
// second split input of 'grad' is a graph input, its first is produced.
moe.graph "two_errors" {
  %da = moe.input "da" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // expected-error@+1 {{'act' splits operand 0 ('da'), which is a graph input}}
  %a = moe.swiglu "act"(%da) -> "a" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
  // expected-error@+1 {{'grad' splits operand 1 ('y'), which is a graph input}}
  %b = moe.swiglu_grad "grad"(%a, %y) -> "b" {split = #moe.split<inputs = [0:0, 1:0], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, intermediate_size], act>, !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
}

// -----

// A source op (no split inputs) may read graph inputs only.
// CHECK-LABEL: moe.graph "source"
// CHECK: moe.swiglu "act"
moe.graph "source" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}

// -----

// A graph input no op reads is a warning; the graph still passes.
// CHECK-LABEL: moe.graph "unread"
// CHECK: moe.input "spare"
moe.graph "unread" {
  %y = moe.input "y" : !moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>
  // LOC: verify-graph.mlir:[[@LINE+2]]:8: warning: graph input 'spare' is never read
  // expected-warning@+1 {{graph input 'spare' is never read}}
  %s = moe.input "spare" {slot = 7 : i64} : !moe.tensor<[num_experts], i64>
  %a = moe.swiglu "act"(%y) -> "a" {split = #moe.split<inputs = [], output_dims = [0]>, split_value = 128 : i64} : (!moe.tensor<[per_rank_seq, "2 * intermediate_size"], act>) -> !moe.tensor<[per_rank_seq, intermediate_size], act>
}
