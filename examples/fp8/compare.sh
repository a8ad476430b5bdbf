#!/usr/bin/env bash
# FP8 dispatch against the compute dtype's, side by side: the qwen3-30b-a3b
# layer (H 2048, I 768, E 128, top-8, bf16) at S tokens per rank on 2 ranks,
# compiled with and without "dispatch_dtype": "fp8_e4m3", run
#   - with both ranks in this process (2 worker threads);
#   - as 2 MPI processes on this machine (1 thread each), and again with
#     --local-puts (rows land in the sender's own memory): the difference is
#     the exposed communication;
#   - across 2 simulated hosts (scripts/hosts.sh, needs root; TCP through
#     OpenMPI's btl/tcp on its defaults), with and without --local-puts.
# Prints, per case, the best forward and backward seconds of REPEAT steps
# and the bytes the forward dispatch put between ranks.
#
#   bash examples/fp8/compare.sh [S] [REPEAT]
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=${1:-1024}
REPEAT=${2:-3}
bazel build //tools:moec 2>&1 | tail -1
moec=$PWD/bazel-bin/tools/moec
out=$(mktemp -d /tmp/moec-fp8.XXXXXX)
trap 'rm -rf "$out"' EXIT
for kind in bf16 fp8; do
  python3 - "$S" "$kind" "$out/$kind.json" <<'PY'
import json, sys
c = json.load(open("examples/configs/qwen3-30b-a3b.json"))
c.update(ep=2, seq_size=int(sys.argv[1]), dtype="bf16", capacity_factor=2)
if sys.argv[2] == "fp8":
    c["dispatch_dtype"] = "fp8_e4m3"
json.dump(c, open(sys.argv[3], "w"))
PY
  $moec compile graphs/moe_ffn_fwd.json --config "$out/$kind.json" -o "$out/$kind-fwd.moebin" > /dev/null 2>&1
  $moec compile graphs/moe_ffn_bwd.json --config "$out/$kind.json" -o "$out/$kind-bwd.moebin" > /dev/null 2>&1
done

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One line per run: case, dispatch, forward s, backward s, forward dispatch bytes.
row() {
  local case=$1 kind=$2 log=$3
  python3 - "$case" "$kind" "$log" <<'PY'
import re, sys
text = open(sys.argv[3]).read()
f = re.search(r"forward\s+([\d.]+) ms", text)
b = re.search(r"backward\s+([\d.]+) ms", text)
d = re.search(r"forward dispatch [^(]*\((\d+) B\)", text)
print(f"{sys.argv[1]:<24} {sys.argv[2]:<5} {float(f.group(1))/1e3:>9.3f} {float(b.group(1))/1e3:>9.3f} "
      f"{int(d.group(1)) / 2**20 if d else float('nan'):>12.1f}")
PY
}
run() { # case kind launcher... -- extra moec run args
  local case=$1 kind=$2
  shift 2
  local log="$out/$case-$kind.log"
  "$@" "$moec" run "$out/$kind-fwd.moebin" "$out/$kind-bwd.moebin" --random 1 \
    --repeat "$REPEAT" --no-progress ${EXTRA:-} > "$log" 2>&1 || { cat "$log"; exit 1; }
  row "$case" "$kind" "$log"
}

echo "qwen3-30b-a3b, bf16, S $S per rank, 2 ranks; best of $REPEAT steps"
printf "%-24s %-5s %9s %9s %12s\n" case rows "fwd s" "bwd s" "dispatch MiB"
for kind in bf16 fp8; do
  EXTRA="--ranks 2 --threads 2 --outputs $out/o-$kind" run "in process" "$kind" env
done
for kind in bf16 fp8; do
  EXTRA="--threads 1 --outputs $out/m-$kind" run "mpi, this machine" "$kind" \
    mpirun --oversubscribe --bind-to none -np 2
  EXTRA="--threads 1 --local-puts --outputs $out/l-$kind" run "mpi, --local-puts" "$kind" \
    mpirun --oversubscribe --bind-to none -np 2
done
if bash scripts/hosts.sh check > /dev/null 2>&1; then
  bash scripts/hosts.sh up 2 --slots 1 --dir "$out/hosts" > /dev/null
  trap 'bash scripts/hosts.sh down --dir "$out/hosts" > /dev/null; rm -rf "$out"' EXIT
  hosts=(bash scripts/hosts.sh run moec-h0 env "PATH=$out/hosts/bin:$PATH" mpirun
         --hostfile "$out/hosts/hostfile" --map-by node --bind-to none -np 2)
  for kind in bf16 fp8; do
    EXTRA="--threads 1 --outputs $out/h-$kind" run "2 hosts (tcp)" "$kind" "${hosts[@]}"
    EXTRA="--threads 1 --local-puts --outputs $out/hl-$kind" run "2 hosts, --local-puts" "$kind" "${hosts[@]}"
  done
else
  echo "(no simulated hosts here: scripts/hosts.sh check failed)"
fi
for f in y dx dw1; do
  cmp "$out/o-fp8/$f.npy" "$out/m-fp8/$f.npy"
  [ ! -d "$out/h-fp8" ] || cmp "$out/o-fp8/$f.npy" "$out/h-fp8/$f.npy"
done
echo "fp8: the MPI and cross-host outputs are bitwise those of the in-process run"
