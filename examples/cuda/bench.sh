#!/usr/bin/env bash
# The cuda backend against cuBLAS and PyTorch eager on one GPU, in one run:
#
#   examples/cuda/bench.sh [CUDA_BENCH [BINARIES]]
#
# 1. GMM tiles: the persistent kernel's tile function on bf16 products
#    (cuda_bench gmm: square anchors and qwen3-30b-a3b's grouped products,
#    each checked) and cuBLAS on the same products (torch.matmul, torch.bmm).
# 2. The qwen3-30b-a3b layer, forward + backward, EP 8 on the one GPU, with
#    S = 1024 and 4096 tokens per rank: moec (cuda_bench layer, tensors in
#    device memory, a sampled check against the reference) and PyTorch eager
#    on the same 8 * S tokens (bench_torch.py layer: rows sorted by expert
#    once, one matmul pair per expert on unbind slices).
#
# CUDA_BENCH defaults to bazel-bin/examples/cuda/cuda_bench. BINARIES is a
# folder with q1024.{fwd,bwd}.moebin and q4096.{fwd,bwd}.moebin; without it
# they are compiled here (bazel-bin/tools/moec) for the h100 profile with 16
# cube and 16 vector cores per rank (8 ranks share the GPU's 132 SMs).
# Needs a CUDA PyTorch for the PyTorch side.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bench="${1:-bazel-bin/examples/cuda/cuda_bench}"
bins="${2:-}"
if [ -z "$bins" ]; then
  bins="$(mktemp -d)"
  trap 'rm -rf "$bins"' EXIT
  for s in 1024 4096; do
    python3 - "$s" "$bins/q$s.json" <<'PY'
import json, sys
c = json.load(open("examples/configs/qwen3-30b-a3b.json"))
c.update(seq_size=int(sys.argv[1]), num_cube_cores=16, num_vector_cores=16)
json.dump(c, open(sys.argv[2], "w"))
PY
    for g in fwd bwd; do
      bazel-bin/tools/moec compile "graphs/moe_ffn_$g.json" --config "$bins/q$s.json" \
        --target h100 --peer-groups 1 -o "$bins/q$s.$g.moebin" --no-progress
    done
  done
fi
echo "== GMM tiles: moec's tile function, then cuBLAS"
"$bench" gmm
python3 examples/cuda/bench_torch.py gmm
for s in 1024 4096; do
  echo "== qwen3-30b-a3b, EP 8 on one GPU, S $s per rank: moec, then PyTorch eager"
  "$bench" layer "$bins/q$s.fwd.moebin" "$bins/q$s.bwd.moebin" --repeat 5 --sample 16
  python3 examples/cuda/bench_torch.py layer --ranks 8 --tokens "$s" --repeat 5
done
