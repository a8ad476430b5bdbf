#!/usr/bin/env bash
# The cuda backend against cuBLAS and PyTorch eager on one GPU, in one run:
#
#   examples/cuda/bench.sh [--moec-only] [CUDA_BENCH [BINARIES]]
#
# --moec-only leaves out PyTorch's side (a GPU machine without a CUDA
# PyTorch: tests/cuda/pack_for_gpu.sh's run.sh).
#
# 1. GMM tiles: the persistent kernel's tile function on bf16 products
#    (cuda_bench gmm: square anchors and qwen3-30b-a3b's grouped products,
#    each checked) and cuBLAS on the same products (torch.matmul, torch.bmm).
# 2. The qwen3-30b-a3b layer, forward + backward, EP 8 on the one GPU, with
#    S = 1024 and 4096 tokens per rank: moec (cuda_bench layer, tensors in
#    device memory, a sampled check against the reference) and PyTorch eager
#    on the same 8 * S tokens (bench_torch.py layer: rows sorted by expert
#    once, one matmul pair per expert on unbind slices).
# 3. Frozen experts stored as checkpoints ship them (Hugging Face's [out, in]
#    layout, the *_transposed graphs): the tiles with B as FP8 blocks, int8
#    rows, int4 groups of 128 (cuda_bench decode: the decode alone; then
#    cuda_bench gmm --weight-format), and the
#    frozen layer at S = 1024, forward + backward (dx only), with bf16 and
#    with each format's weights, each checked against the reference on the
#    dequantized weights (decoded whole before each pass, in the pass's
#    time; MOEC_CUDA_DECODE=tiles in the environment times the tiles' own
#    decode instead).
#
# CUDA_BENCH defaults to bazel-bin/examples/cuda/cuda_bench. BINARIES is a
# folder of examples/cuda/compile_binaries.sh's binaries; without it they
# are compiled here (bazel-bin/tools/moec). Needs a CUDA PyTorch for the
# PyTorch side.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
torch=1
if [ "${1:-}" = --moec-only ]; then
  torch=0
  shift
fi
bench="${1:-bazel-bin/examples/cuda/cuda_bench}"
bins="${2:-}"
if [ -z "$bins" ]; then
  bins="$(mktemp -d)"
  trap 'rm -rf "$bins"' EXIT
  bash examples/cuda/compile_binaries.sh "$bins"
fi
pytorch() { [ $torch -eq 0 ] || python3 examples/cuda/bench_torch.py "$@"; }
echo "== GMM tiles: moec's tile function, then cuBLAS"
"$bench" gmm
pytorch gmm
for s in 1024 4096; do
  echo "== qwen3-30b-a3b, EP 8 on one GPU, S $s per rank: moec, then PyTorch eager"
  "$bench" layer "$bins/q$s.fwd.moebin" "$bins/q$s.bwd.moebin" --repeat 5 --sample 16
  pytorch layer --ranks 8 --tokens "$s" --repeat 5
done
echo "== frozen experts as checkpoints store them: tiles with B quantized (qwen3's products)"
"$bench" decode
products="128*512x1536x2048:nt 128*512x2048x768:nt 128*512x768x2048:nn 128*512x2048x1536:nn"
for f in dense fp8_block128 int8 int4_g128; do
  # shellcheck disable=SC2086
  "$bench" gmm --weight-format "$f" $products
done
echo "== the frozen qwen3-30b-a3b layer, EP 8 on one GPU, S 1024: bf16, FP8, int8, int4 weights"
# One process: the random layer is made once for the four.
pairs=()
for f in "" _fp8 _int8 _int4; do
  pairs+=("$bins/frozen$f.fwd.moebin" "$bins/frozen$f.bwd.moebin")
done
"$bench" layer "${pairs[@]}" --repeat 5 --sample 16
