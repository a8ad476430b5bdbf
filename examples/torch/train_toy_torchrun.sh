#!/usr/bin/env bash
# Trains the toy model of train_toy.py with each of R ranks in its own
# process, started by torchrun --nproc_per_node R (default 2): the MoE
# layer runs over torch.distributed's world group (gloo), which also sums
# the dense gradients. Arguments go to train_toy.py (--steps, --dtype,
# --threads, --torch-threads, --seed, --save, --ddp, --checkpoint DIR,
# --resume DIR). RANKS=4 changes the number of processes.
#
# Debian's torchrun (PyTorch 1.13 on Python 3.11) stops at once, in to_map
# ("'NoneType' object has no attribute 'get'"), unless --tee and
# --redirects each name a stream: Python 3.11 no longer lists the zero flag
# Std.NONE when the enum is iterated, so the default "0" maps to nothing.
# "--tee 2 --redirects 2" (stderr to the log folder, and teed to the
# console) works around it; stdout is untouched.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ranks=${RANKS:-2}
bazel build //tools:moec //compiler/api:libmoec.so //ops/torch:moec_torch.so 2>&1 | tail -1
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
torchrun --standalone --nproc_per_node "$ranks" --tee 2 --redirects 2 --log_dir "$logs" \
  examples/torch/train_toy.py --ranks "$ranks" --threads 1 "$@"
