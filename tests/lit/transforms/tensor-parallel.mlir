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
// Refused with tp > 1: LoRA adapters, and a graph of dispatches and
// combines alone (no expert weights to split).
// RUN: moec import %graphs/moe_ffn_fwd_lora.json -o %t.lora.mlir
// RUN: not moec-opt %t.lora.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2-lora.json 2>&1 | FileCheck %s --check-prefix=LORA
// RUN: not moec-opt %S/Inputs/fused-gmm.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-tp2.json 2>&1 | FileCheck %s --check-prefix=FUSED
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

// LORA: error: 'up_lora_b' adds a LoRA adapter's product, and the config's tp is 2: LoRA adapters are not supported with tensor parallelism
// A gmm with a low-rank pair (a fused adapter, as moe-fuse-low-rank makes one) too.
// FUSED: error: 'base' adds a LoRA adapter's product, and the config's tp is 2

// EXCHANGE: error: graph 'moe_dispatch': the config's tp is 2, but the graph has no expert weights for tp to split (only dispatches and combines); use a config with tp 1
