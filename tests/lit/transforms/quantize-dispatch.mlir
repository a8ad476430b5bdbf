// RUN: moec-opt %graphs/seed/moe_ffn_fwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-fp8.json | FileCheck %s --check-prefix=FP8
// RUN: moec-opt %graphs/seed/moe_ffn_fwd.mlir --moe-graph-pipeline=config=%configs/tiny.json | FileCheck %s --check-prefix=PLAIN
// RUN: moec-opt %graphs/seed/moe_ffn_bwd.mlir --moe-graph-pipeline=config=%S/Inputs/tiny-fp8.json | FileCheck %s --check-prefix=BWD
// RUN: not moec-opt %graphs/seed/moe_ffn_fwd.mlir --moe-quantize-dispatch 2>&1 | FileCheck %s --check-prefix=UNRESOLVED

// tiny-fp8.json: tiny.json with hidden_size 200 (two blocks of 128: the last
// one short) and "dispatch_dtype": "fp8_e4m3". A quantized row is
// 200 + 4 * 2 = 208 bytes.

// The edge dispatch -> up_proj now leaves the dequantize.
// FP8: moe.graph "moe_ffn_fwd" attributes {{.*}}edges = {{\[\[}}"dispatch_dequantize", "up_proj"]
// The quantize cuts the 256 rows to send into row tiles of the dispatch's
// split value (128), not per expert: grid 1 x 1 x 2 x 1.
// FP8: %[[Q:.*]] = moe.quantize "dispatch_quantize"(%{{.*}}) -> "src_fp8" {deps = [], grid = array<i64: 1, 1, 2, 1, 256, 200>{{.*}}tasks = 2 : i64{{.*}} : (!moe.tensor<[256, 200], f32, list>) -> !moe.tensor<[256, 208], f8E4M3FN, list>
// Every dispatch tile waits for every quantize tile (the rows a tile sends
// are known at run time only).
// FP8: %[[D:.*]] = moe.dispatch "dispatch"(%{{.*}}, %[[Q]], %{{.*}}, %{{.*}}) -> "target_fp8" {deps = [#moe.tile_map<operand = 1, producer = "dispatch_quantize", first = [0, 0, 0, 0], last = [1, 1, 1, 1]>]{{.*}}quantizable{{.*}} -> !moe.tensor<[256, 208], f8E4M3FN, list, dynamic>
// The dequantize writes the old name and slot, in row tiles of each expert's
// segment, each waiting for the puts into its expert from every peer.
// FP8: %[[X:.*]] = moe.dequantize "dispatch_dequantize"(%[[D]]) -> "target" {deps = [#moe.tile_map<operand = 0, producer = "dispatch", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>], grid = array<i64: 2, 1, 2, 1, 256, 200>, slot = 0 : i64{{.*}} -> !moe.tensor<[256, 200], f32, list, dynamic>
// FP8: moe.gmm "up_proj"(%[[X]], {{.*}}deps = [#moe.tile_map<operand = 0, producer = "dispatch_dequantize", first = [0, 0, 2, 2], last = [1, 1, 3, 3]>]

// Without dispatch_dtype nothing changes.
// PLAIN-NOT: moe.quantize
// PLAIN-NOT: moe.dequantize
// PLAIN: moe.dispatch "dispatch"({{.*}}) -> "target"

// The backward's dispatch (of dy) is not quantizable: it keeps the compute dtype.
// BWD-NOT: moe.quantize
// BWD: moe.dispatch "dispatch"({{.*}}) -> "target" {{.*}}-> !moe.tensor<[256, 200], f32, list, dynamic>

// The pass needs the config's bindings.
// UNRESOLVED: error: graph 'moe_ffn_fwd' has unresolved shapes: run moe-resolve-shapes first
