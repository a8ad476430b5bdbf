// Expert tensor parallelism (tp > 1): the combines of a layer are marked
// reduce_tp, and the experts' weights hold local_intermediate_size =
// intermediate_size / tp columns (tiny-tp2.json: I 32, tp 2, so 16).
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2.json | FileCheck %s --check-prefix=FWD
// RUN: moec-opt %graphs/moe_ffn_bwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2.json | FileCheck %s --check-prefix=BWD
//
// A combine that is not marked: its rows would be summed as if whole.
// RUN: sed 's/ reduce_tp,//' %graphs/moe_ffn_fwd.mlir | not moec-opt --moe-graph-pipeline=config=%S/Inputs/tiny-tp2.json 2>&1 | FileCheck %s --check-prefix=UNMARKED
// With tp 1 the mark changes nothing: the same graph compiles either way.
// RUN: sed 's/ reduce_tp,//' %graphs/moe_ffn_fwd.mlir | moec-opt --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s --check-prefix=PLAIN
//
// LoRA adapters with tp > 1: B of w1's adapter holds the gate and up columns
// of the TP rank's slice, A of w2's its rows; A of w1 and B of w2 are whole
// (each TP rank's gradients of them are partial sums over the TP ranks).
// RUN: moec import %graphs/moe_ffn_fwd_lora.json -o %t.lora.mlir
// RUN: moec-opt %t.lora.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2-lora.json | FileCheck %s --check-prefix=LORA
// RUN: moec import %graphs/moe_ffn_bwd_lora.json -o %t.lora-bwd.mlir
// RUN: moec-opt %t.lora-bwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2-lora.json | FileCheck %s --check-prefix=LORABWD
//
// Refused with tp > 1: a graph of dispatches and combines alone (no expert
// weights to split).
// RUN: moec import %graphs/moe_dispatch.json -o %t.dispatch.mlir
// RUN: not moec-opt %t.dispatch.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2.json 2>&1 | FileCheck %s --check-prefix=EXCHANGE

// FWD: bindings = {{{.*}}intermediate_size = 32 : i64, local_intermediate_size = 16 : i64{{.*}}tp = 2 : i64}
// FWD: moe.input "up_proj_weight" {slot = 5 : i64} : <[2, 64, 32], f32, list>
// FWD: moe.input "down_proj_weight" {slot = 8 : i64} : <[2, 16, 64], f32, list>
// FWD: moe.combine "combine"
// FWD-SAME: reduce_tp

// BWD: moe.combine "combine"
// BWD-SAME: reduce_tp

// UNMARKED: error: 'combine': the config's tp is 2, so the rows it returns are partial sums over 2 tensor-parallel ranks, but it is not marked reduce_tp

// PLAIN: moe.combine "combine"
// PLAIN-NOT: reduce_tp

// LORA: moe.input "lora_a1" {slot = 15 : i64} : <[2, 64, 4], f32, list>
// LORA: moe.input "lora_b1" {slot = 18 : i64} : <[2, 4, 32], f32, list>
// LORA: moe.input "lora_a2" {slot = 19 : i64} : <[2, 16, 4], f32, list>
// LORA: moe.input "lora_b2" {slot = 22 : i64} : <[2, 4, 64], f32, list>
// LORA: moe.combine "combine"
// LORA-SAME: reduce_tp

// LORABWD: moe.gmm "down_lora_a_grad"{{.*}} -> !moe.tensor<[2, 16, 4], f32, list>
// LORABWD: moe.combine "combine"
// LORABWD-SAME: reduce_tp

// EXCHANGE: error: graph 'moe_dispatch': the config's tp is 2, but the graph has no expert weights for tp to split (only dispatches and combines); use a config with tp 1
