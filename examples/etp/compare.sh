#!/usr/bin/env bash
# Expert tensor parallelism against expert parallelism alone on the same 4
# ranks: the qwen3-30b-a3b layer (H 2048, I 768, E 128, top-8, bf16) as
#   ep 4 x tp 1: 32 experts per rank, S tokens per rank;
#   ep 2 x tp 2: 64 experts per EP rank, each rank half of every expert's I,
#                2S tokens per EP rank (shared by its 2 TP ranks),
# so both steps cover the same 4S tokens and the same work. Each runs with
# the 4 ranks in this process (2 worker threads); the two alternate, REPEAT
# steps each, ROUNDS times. (Under mpirun every process of `moec run
# --random` draws the whole layer's inputs, some 6 GB at these sizes: 4 of
# them do not fit a 24 GB machine.) Prints per run the best
# forward and backward seconds and the bytes the dispatch and the combine
# moved between ranks (forward pass; the backward moves the same).
#
#   bash examples/etp/compare.sh [S] [REPEAT] [ROUNDS]
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=${1:-512}
REPEAT=${2:-3}
ROUNDS=${3:-2}
bazel build //tools:moec 2>&1 | tail -1
moec=$PWD/bazel-bin/tools/moec
out=$(mktemp -d /tmp/moec-etp.XXXXXX)
trap 'rm -rf "$out"' EXIT
for mesh in "4 1" "2 2"; do
  set -- $mesh
  python3 - "$1" "$2" "$S" "$out/ep$1tp$2.json" <<'PY'
import json, sys
ep, tp, s = (int(v) for v in sys.argv[1:4])
c = json.load(open("examples/configs/qwen3-30b-a3b.json"))
c.update(ep=ep, tp=tp, seq_size=s * 4 // ep, dtype="bf16", capacity_factor=2)
json.dump(c, open(sys.argv[4], "w"))
PY
  $moec compile graphs/moe_ffn_fwd.json --config "$out/ep$1tp$2.json" -o "$out/ep$1tp$2-fwd.moebin" > /dev/null 2>&1
  $moec compile graphs/moe_ffn_bwd.json --config "$out/ep$1tp$2.json" -o "$out/ep$1tp$2-bwd.moebin" > /dev/null 2>&1
done

row() {
  python3 - "$@" <<'PY'
import re, sys
case, mesh, log = sys.argv[1:4]
text = open(log).read()
f = re.search(r"forward\s+([\d.]+) ms", text)
b = re.search(r"backward\s+([\d.]+) ms", text)
d = re.search(r"forward dispatch [^(]*\((\d+) B\), combine [^(]*\((\d+) B\)", text)
print(f"{case:<12} {mesh:<10} {float(f.group(1))/1e3:>8.3f} {float(b.group(1))/1e3:>8.3f} "
      f"{int(d.group(1)) / 2**20:>13.1f} {int(d.group(2)) / 2**20:>12.1f}")
PY
}
run() { # case mesh "launcher" "moec run options"
  local case=$1 mesh=$2 launcher=$3 options=$4
  local log="$out/$case-$mesh.log"
  # shellcheck disable=SC2086 # word lists
  $launcher "$moec" run "$out/$mesh-fwd.moebin" "$out/$mesh-bwd.moebin" --random 1 \
    --repeat "$REPEAT" --no-progress --outputs "$out/o-$case-$mesh" $options > "$log" 2>&1 || { cat "$log"; exit 1; }
  row "$case" "$mesh" "$log"
}

echo "qwen3-30b-a3b, bf16, 4 ranks, $((4 * S)) tokens per step; best of $REPEAT steps"
printf "%-12s %-10s %8s %8s %13s %12s\n" case mesh "fwd s" "bwd s" "dispatch MiB" "combine MiB"
for round in $(seq "$ROUNDS"); do
  for mesh in ep4tp1 ep2tp2; do
    run in-process "$mesh" "" "--ranks 4 --threads 2"
  done
done
