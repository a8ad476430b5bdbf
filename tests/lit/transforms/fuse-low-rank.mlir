// RUN: moec import %graphs/moe_ffn_fwd_lora.json -o %t.fwd.mlir
// RUN: moec-opt %t.fwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-lora.json | FileCheck %s --check-prefix=CPU
// RUN: moec-opt %t.fwd.mlir "--moe-graph-pipeline=config=%S/Inputs/tiny-lora.json target=h100" | FileCheck %s --check-prefix=H100
// RUN: moec import %graphs/moe_ffn_bwd_lora_transposed.json -o %t.bwd.mlir
// RUN: moec-opt %t.bwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-lora.json | FileCheck %s --check-prefix=BWD
// RUN: moec-opt %s --moe-fuse-low-rank --split-input-file | FileCheck %s --check-prefix=KEEP
// RUN: not moec export %S/Inputs/fused-gmm.mlir 2>&1 | FileCheck %s --check-prefix=EXPORT

// moe-fuse-low-rank: for the cpu target (no shared cache), each LoRA
// adapter's second gmm (U x B onto the base's output) becomes the base
// gmm's low-rank pair, under the base's name and the adapter gmm's result
// name; the base's output tensor and the adapter gmm are gone, and the
// base's tiles wait for the adapter's rank-r tiles of their expert.
// CPU-NOT: "up_proj_base_y"
// CPU-NOT: moe.gmm "up_lora_b"
// CPU: %[[U:.*]] = moe.gmm "up_lora_a"
// CPU: moe.gmm "up_proj"(%{{.*}}, %{{.*}}, %{{.*}}, %[[U]], %{{.*}}) -> "up_proj_y" {{.*}}#moe.tile_map<operand = 3, producer = "up_lora_a"
// CPU-NOT: moe.gmm "down_lora_b"
// CPU: moe.gmm "down_proj"({{.*}}) -> "down_proj_y"

// A target with a shared cache keeps the two gmms.
// H100: moe.gmm "up_proj"(%{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}) -> "up_proj_base_y"
// H100: moe.gmm "up_lora_b"

// Backward: V A^T onto the data gradients, A^T read transposed.
// BWD: moe.gmm "act_grad"({{.*}}) -> "act_grad_y" {{.*}}transpose_low_rhs
// BWD: moe.gmm "gate_grad"({{.*}}) -> "gate_grad_y" {{.*}}transpose_low_rhs

// A graph file cannot hold a fused gmm.
// EXPORT: error: gmm 'base' has a low-rank product (moe-fuse-low-rank makes one), which a graph file cannot hold; export the graph before the passes

// Not fused: the base's output has another reader.
// KEEP-LABEL: moe.graph "two_readers"
// KEEP: moe.gmm "base"(%{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}) -> "by"
// KEEP: moe.gmm "add"
moe.graph "two_readers" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  %by = moe.gmm "base"(%x, %w, %gl) -> "by" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 48], bf16>
  %y = moe.gmm "add"(%u, %b, %gl, %by) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
  %s = moe.swiglu "s"(%by) -> "s" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 48], bf16>) -> !moe.tensor<[64, 24], bf16>
}

// -----

// Not fused: the adapter gmm scales its product.
// KEEP-LABEL: moe.graph "scaled"
// KEEP: moe.gmm "base"(%{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}) -> "by"
// KEEP: moe.gmm "add"
moe.graph "scaled" {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u = moe.input "u" : !moe.tensor<[64, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  %by = moe.gmm "base"(%x, %w, %gl) -> "by" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 48], bf16>
  %y = moe.gmm "add"(%u, %b, %gl, %by) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64, scale = 2.0 : f64} : (!moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}

// -----

// Fused: the edge into the adapter gmm now names the base.
// KEEP-LABEL: moe.graph "fused"
// KEEP-SAME: edges = {{\[\[}}"pre", "base"]]
// KEEP-NOT: moe.gmm "add"
// KEEP: moe.gmm "base"(%{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}, %{{[0-9a-z_]+}}) -> "y"
moe.graph "fused" attributes {edges = [["pre", "add"], ["base", "add"]]} {
  %x = moe.input "x" : !moe.tensor<[64, 32], bf16>
  %w = moe.input "w" : !moe.tensor<[2, 32, 48], bf16>
  %gl = moe.input "gl" : !moe.tensor<[2], i64>
  %u0 = moe.input "u0" : !moe.tensor<[64, 32], bf16>
  %a = moe.input "a" : !moe.tensor<[2, 32, 4], bf16>
  %b = moe.input "b" : !moe.tensor<[2, 4, 48], bf16>
  %u = moe.gmm "pre"(%u0, %a, %gl) -> "u" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 4], bf16>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 4], bf16>
  %by = moe.gmm "base"(%x, %w, %gl) -> "by" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 32], bf16>, !moe.tensor<[2, 32, 48], bf16>, !moe.tensor<[2], i64>) -> !moe.tensor<[64, 48], bf16>
  %y = moe.gmm "add"(%u, %b, %gl, %by) -> "y" {split = #moe.split<inputs = [0:0], output_dims = [0]>, split_value = 64 : i64} : (!moe.tensor<[64, 4], bf16>, !moe.tensor<[2, 4, 48], bf16>, !moe.tensor<[2], i64>, !moe.tensor<[64, 48], bf16>) -> !moe.tensor<[64, 48], bf16>
}
