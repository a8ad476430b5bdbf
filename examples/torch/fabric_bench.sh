#!/usr/bin/env bash
# examples/torch/fabric_bench.py under mpirun: the torch op on moec's MPI
# fabric and over a torch.distributed group (gloo) in one job, with the
# exposed communication of each, and moec's dispatch + combine against
# torch.distributed.all_to_all_single.
#
#   bash examples/torch/fabric_bench.sh [REPEAT]           2 ranks on this machine
#   bash examples/torch/fabric_bench.sh --hosts [REPEAT]   across 2 simulated
#       hosts (scripts/hosts.sh; root): 1 + 1 and 2 + 2 ranks
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
hosts=0
if [ "${1:-}" = --hosts ]; then
  hosts=1
  shift
fi
repeat=${1:-5}
# --config=hooks: the measurement hook MOEC_LOCAL_PUTS (runtime/comm/Hooks.h).
bazel build --config=hooks //tools:moec //compiler/api:libmoec.so //ops/torch:moec_torch.so 2>&1 | tail -1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MOEC_TORCH_LIB=$PWD/bazel-bin/ops/torch/moec_torch.so MOEC_LIB=$PWD/bazel-bin/compiler/api/libmoec.so
export MOEC_GRAPHS=$PWD/graphs PYTHONPATH=$PWD/ops/torch
export MASTER_PORT=$(/usr/bin/python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
pass=(-x MASTER_ADDR -x MASTER_PORT -x MOEC_TORCH_LIB -x MOEC_LIB -x MOEC_GRAPHS -x PYTHONPATH)
grep -m1 "model name" /proc/cpuinfo
echo "cores: $(nproc)"
if [ "$hosts" = 1 ]; then
  work=$(mktemp -d)
  trap 'bash scripts/hosts.sh down --dir "$work/hosts"; rm -rf "$work"' EXIT
  bash scripts/hosts.sh up 2 --slots 2 --dir "$work/hosts" > /dev/null
  # shellcheck disable=SC1091
  source "$work/hosts/env"
  export MASTER_ADDR=moec-h0 GLOO_SOCKET_IFNAME=eth0
  for spread in "2 --map-by node" "4"; do
    echo "== across 2 simulated hosts (veth), mpirun -np $spread"
    # shellcheck disable=SC2086
    bash scripts/hosts.sh run moec-h0 mpirun --hostfile "$work/hosts/hostfile" --bind-to none \
      -np $spread "${pass[@]}" -x GLOO_SOCKET_IFNAME /usr/bin/python3 \
      examples/torch/fabric_bench.py --repeat "$repeat"
  done
else
  export MASTER_ADDR=127.0.0.1
  echo "== this machine, mpirun -np 2"
  mpirun --oversubscribe --bind-to none -np 2 "${pass[@]}" /usr/bin/python3 \
    examples/torch/fabric_bench.py --repeat "$repeat"
fi
