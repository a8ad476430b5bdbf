#!/usr/bin/env bash
# The LoRA step of a Qwen3-MoE-structured model at qwen3-30b-a3b's MoE shapes,
# patched with moec against unpatched with PEFT's LoRA in plain PyTorch
# (bench.py); then, with --memory, each one's peak RSS. Arguments go to
# bench.py (--layers, --tokens, --threads, --steps). glibc's malloc keeps
# freed memory mapped for both (PyTorch's backward otherwise churns pages).
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bazel build //compiler/api:libmoec.so //ops/torch:moec_torch.so 2>&1 | tail -1
export MALLOC_MMAP_THRESHOLD_=$((1 << 34)) MALLOC_TRIM_THRESHOLD_=$((1 << 34))
exec /usr/bin/python3 examples/hf/bench.py "$@"
