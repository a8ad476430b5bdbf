// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes="config=%configs/seed-test.json target=ascend-910b" | FileCheck %s --check-prefix=ASCEND
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-graph-pipeline="config=%configs/seed-test.json target=ascend-910b" | FileCheck %s --check-prefix=ASCEND
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes="config=%configs/seed-test.json target=h100" | FileCheck %s --check-prefix=H100
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes="config=%configs/tiny.json target=ascend-910b" | FileCheck %s --check-prefix=PINNED
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes=config=%configs/seed-test.json | FileCheck %s --check-prefix=CPU
// RUN: echo '{"name": "mini", "cube_cores": 3, "vector_cores": 5}' > %t.json
// RUN: moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes="config=%configs/seed-test.json target=%t.json" | FileCheck %s --check-prefix=FILE
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes="config=%configs/seed-test.json target=ascend910b" 2>&1 | FileCheck %s --check-prefix=UNKNOWN
// The pipeline reads the target's kernel blocks for the split pass too; an
// unknown target is still moe-resolve-shapes' error.
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-graph-pipeline="config=%configs/seed-test.json target=ascend910b" 2>&1 | FileCheck %s --check-prefix=UNKNOWN
// RUN: not moec-opt %graphs/moe_ffn_fwd.mlir --moe-resolve-shapes="config=%configs/seed-test.json target=%t.missing.json" 2>&1 | FileCheck %s --check-prefix=MISSING

// seed-test.json sets no core counts: the target gives them.
// ASCEND: moe.graph "moe_ffn_fwd"
// ASCEND-SAME: num_cube_cores = 24 : i64
// ASCEND-SAME: num_vector_cores = 48 : i64
// H100: moe.graph "moe_ffn_fwd"
// H100-SAME: num_cube_cores = 132 : i64
// H100-SAME: num_vector_cores = 132 : i64
// FILE: moe.graph "moe_ffn_fwd"
// FILE-SAME: num_cube_cores = 3 : i64
// FILE-SAME: num_vector_cores = 5 : i64

// The default target, cpu, gives this machine's hardware threads: some
// positive count, the same for both kinds.
// CPU: moe.graph "moe_ffn_fwd"
// CPU-SAME: num_cube_cores = [[N:[1-9][0-9]*]] : i64
// CPU-SAME: num_vector_cores = [[N]] : i64

// tiny.json sets them (2 cube, 4 vector): they win over the target's.
// PINNED: moe.graph "moe_ffn_fwd"
// PINNED-SAME: num_cube_cores = 2 : i64
// PINNED-SAME: num_vector_cores = 4 : i64

// UNKNOWN: error: unknown target 'ascend910b' (known: cpu, ascend-910b, h100, or a profile JSON file); did you mean 'ascend-910b'?
// MISSING: error: {{.*}}.missing.json: cannot open: No such file or directory
