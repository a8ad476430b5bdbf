#!/usr/bin/env bash
# The README's third command: the tiny layer's forward and backward with
# each of 2 ranks in its own process (the MPI fabric), on this machine. The
# same inputs run first with both ranks in this process; the MPI run must
# verify against the reference and give the same outputs, bit for bit.
#
#   bash examples/mpi/run.sh [CONFIG] [RANKS]
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
config=${1:-examples/configs/tiny.json}
ranks=${2:-2}
bazel build //tools:moec 2>&1 | tail -1
moec=bazel-bin/tools/moec
out=$(mktemp -d /tmp/moec-mpi.XXXXXX)
cfg="$out/config.json"
# The config's ep is the number of processes.
python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c['ep']=int(sys.argv[2]); json.dump(c, open(sys.argv[3], 'w'))" \
  "$config" "$ranks" "$cfg"
$moec compile graphs/moe_ffn_fwd.json --config "$cfg" -o "$out/fwd.moebin"
$moec compile graphs/moe_ffn_bwd.json --config "$cfg" -o "$out/bwd.moebin"

echo "== $ranks ranks in this process"
$moec run "$out/fwd.moebin" "$out/bwd.moebin" --ranks "$ranks" --random 1 \
  --outputs "$out/inproc" --threads 2 | grep -E "^moec run|^  (forward|backward) .* ms "

echo "== $ranks ranks as MPI processes (mpirun -np $ranks)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpirun --oversubscribe --bind-to none -np "$ranks" $moec run "$out/fwd.moebin" "$out/bwd.moebin" \
  --inputs "$out/inproc" --outputs "$out/mpi" --verify --threads 1

for f in y dx dtopk_weights dw1 dw2; do
  cmp "$out/inproc/$f.npy" "$out/mpi/$f.npy"
done
echo "bitwise equal to the in-process run: y, dx, dtopk_weights, dw1, dw2 (in $out)"
