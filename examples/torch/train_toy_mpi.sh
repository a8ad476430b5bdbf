#!/usr/bin/env bash
# Trains the toy model of train_toy.py with each of R ranks in its own
# process: mpirun -np R (default 2), moec's MPI fabric for the MoE layer and
# torch.distributed (gloo, over loopback) for the dense gradients. Arguments
# go to train_toy.py (--steps, --dtype, --threads, --torch-threads, --seed,
# --save, --ddp, --checkpoint DIR, --resume DIR). RANKS=4 changes the number
# of processes.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ranks=${RANKS:-2}
bazel build //tools:moec //compiler/api:libmoec.so //ops/torch:moec_torch.so 2>&1 | tail -1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MASTER_ADDR=127.0.0.1
export MASTER_PORT=$(/usr/bin/python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
exec mpirun --oversubscribe --bind-to none -np "$ranks" -x MASTER_ADDR -x MASTER_PORT \
  /usr/bin/python3 examples/torch/train_toy.py --ranks "$ranks" --threads 1 "$@"
