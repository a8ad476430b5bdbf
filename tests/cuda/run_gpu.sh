#!/usr/bin/env bash
# The runtime conformance suite on the GPU (the cuda backend):
#
#   run_gpu.sh GPU_PROBE GPU_SUITE [MOEC]
#
# Without a GPU (or without the CUDA toolkit at build time) it checks that
# the backend says why, and reports the GPU suite as skipped. With one, it
# runs the suite's layers on the GPU against the reference: fp32 and bf16,
# 1 to 4 ranks, skewed routing, experts with no tokens, both granularities,
# base weights stored transposed and quantized (FP8 blocks, int8, int4;
# decoded before the tasks, then again decoded in the tiles), and a binary
# whose event is never reached (the device watchdog's error).
# The layers come from MOEC_BINARY_CACHE (default: a folder of the test's
# temporary directory), compiled by MOEC when missing.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
probe="$1" suite="$2"
[ $# -ge 3 ] && export MOEC="$3"
export MOEC_BINARY_CACHE="${MOEC_BINARY_CACHE:-${TEST_TMPDIR:-/tmp}/moec-binary-cache}"
mkdir -p "$MOEC_BINARY_CACHE"

gpu="$("$probe")"
if [ $? -ne 0 ]; then
  case "$gpu" in
  *"no CUDA device"* | *"without the CUDA toolkit"*)
    echo "cuda_backend_test: no GPU here ($gpu); the cuda backend refuses with that message."
    echo "cuda_backend_test: the GPU suite is SKIPPED (it runs where a GPU is: docs/development.md)"
    exit 0
    ;;
  *)
    echo "cuda_backend_test: the probe failed without a reason it should give: $gpu" >&2
    exit 1
    ;;
  esac
fi
echo "cuda_backend_test: running the conformance suite on $gpu"
# The suite's cases tagged [gpu]: the others need the CPU backend (the
# op-by-op schedule, task traces, the C API's default context, the
# exchange).
rc=0
MOEC_TEST_BACKEND=cuda "$suite" --use-colour no "[gpu]" || rc=1
# Quantized weights are decoded whole before the tasks by default; the
# tiles' own decode (MOEC_CUDA_DECODE=tiles) is checked too.
echo "cuda_backend_test: again, quantized weights decoded in the tiles (MOEC_CUDA_DECODE=tiles)"
MOEC_CUDA_DECODE=tiles MOEC_TEST_BACKEND=cuda "$suite" --use-colour no "[gpu]" || rc=1
exit $rc
