#!/usr/bin/env bash
# Builds the moec CLI and the torch op library, then runs bench.py (MoeFFN
# against the plain PyTorch layer) with Debian's PyTorch. Arguments go to
# bench.py.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bazel build //tools:moec //compiler/api:libmoec.so //ops/torch:moec_torch.so
exec /usr/bin/python3 examples/torch/bench.py --moec bazel-bin/tools/moec "$@"
