#!/usr/bin/env bash
# Compiles examples/cuda/bench.sh's binaries into DIR (from the repository
# root, with bazel-bin/tools/moec built):
#
#   examples/cuda/compile_binaries.sh DIR
#
# qwen3-30b-a3b for the h100 profile, 16 cube and 16 vector cores a rank
# (8 ranks share the GPU's 132 SMs), --peer-groups 1:
#   q1024.{fwd,bwd}.moebin, q4096.{fwd,bwd}.moebin   the full layer
#   frozen{,_fp8,_int8,_int4}.{fwd,bwd}.moebin        the frozen layer at S 1024,
#       weights stored [out, in]: bf16, FP8 blocks, int8 rows, int4 groups of 128
#   lora{,_fp8,_int8,_int4}.{fwd,bwd}.moebin          the same bases with LoRA
#       adapters of rank 16 (alpha 32) on w1 and w2: the fine-tuning step
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
dir="${1:?usage: examples/cuda/compile_binaries.sh DIR}"
mkdir -p "$dir"
compile() { # compile GRAPH CONFIG OUT
  bazel-bin/tools/moec compile "graphs/$1.json" --config "$2" --target h100 --peer-groups 1 \
    -o "$dir/$3.moebin" --no-progress
}
for s in 1024 4096; do
  python3 - "$s" "$dir/q$s.json" <<'PY'
import json, sys
c = json.load(open("examples/configs/qwen3-30b-a3b.json"))
c.update(seq_size=int(sys.argv[1]), num_cube_cores=16, num_vector_cores=16, weight_group=128)
json.dump(c, open(sys.argv[2], "w"))
json.dump(dict(c, lora_rank=16, lora_alpha=32), open(sys.argv[2][:-5] + "_lora.json", "w"))
PY
  compile moe_ffn_fwd "$dir/q$s.json" "q$s.fwd"
  compile moe_ffn_bwd "$dir/q$s.json" "q$s.bwd"
done
for f in "" _fp8 _int8 _int4; do
  compile "moe_ffn_fwd_transposed$f" "$dir/q1024.json" "frozen$f.fwd"
  compile "moe_ffn_bwd_frozen_transposed$f" "$dir/q1024.json" "frozen$f.bwd"
  compile "moe_ffn_fwd_lora_transposed$f" "$dir/q1024_lora.json" "lora$f.fwd"
  compile "moe_ffn_bwd_lora_transposed$f" "$dir/q1024_lora.json" "lora$f.bwd"
done
