#!/usr/bin/env bash
# Compile-time and binary-size benchmark of `moec compile`: the forward and
# backward graphs for a config on a target (default: deepseek-v3, ep 32,
# seq_size 4096, on ascend-910b), each compiled RUNS times; prints the best
# and median wall time of the whole command, the best compile time in
# process (what `moec compile` reports: the graph's load to the binary's
# write), the phases of the last run, and the binary size against a tenth
# of the seed's fixed 15 MB runtime struct.
#
#   scripts/bench-compile.sh [CONFIG] [TARGET] [RUNS] [--all [EP]]
#
# --all compiles every shipped graph (graphs/*.json) instead, with the
# config's `ep` set to EP (default 256) and `lora_rank` to 16 unless the
# config gives one (the LoRA graphs need it), and ends with a table of the
# best in-process times.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config="${1:-examples/configs/deepseek-v3.json}"
target="${2:-ascend-910b}"
runs="${3:-5}"
all="${4:-}"
if [ -n "$all" ] && [ "$all" != "--all" ]; then
  echo "usage: scripts/bench-compile.sh [CONFIG] [TARGET] [RUNS] [--all [EP]]" >&2
  exit 2
fi

bazel build //tools:moec >/dev/null 2>&1 || bazel build //tools:moec
moec=bazel-bin/tools/moec
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
budget=$((15 * 1024 * 1024 / 10))

graphList=(graphs/moe_ffn_fwd.json graphs/moe_ffn_bwd.json)
if [ -n "$all" ]; then
  ep="${5:-256}"
  python3 - "$config" "$ep" "$out/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["ep"] = int(sys.argv[2])
c.setdefault("lora_rank", 16)
json.dump(c, open(sys.argv[3], "w"))
PY
  config="$out/config.json"
  graphList=(graphs/*.json)
  echo "every shipped graph, ep $ep, lora_rank $(python3 -c "import json; print(json.load(open('$config'))['lora_rank'])")"
fi

echo "moec compile benchmark: config $config, target $target, $runs runs each, $(nproc) cores"
table=()
for graph in "${graphList[@]}"; do
  times=()
  inProcess=()
  for _ in $(seq "$runs"); do
    start=$(date +%s%N)
    "$moec" compile "$graph" --config "$config" --target "$target" -o "$out/bin" --time \
      2>"$out/log"
    end=$(date +%s%N)
    times+=($(( (end - start) / 1000 )))
    inProcess+=("$(head -1 "$out/log" | sed -n 's/.*compiled in \([0-9.]*\) ms.*/\1/p')")
  done
  sorted=($(printf '%s\n' "${times[@]}" | sort -n))
  best=${sorted[0]}
  median=${sorted[$(( runs / 2 ))]}
  bestIn=$(printf '%s\n' "${inProcess[@]}" | sort -g | head -1)
  size=$(stat -c %s "$out/bin")
  table+=("$(printf '  %-32s %8s ms' "$(basename "$graph")" "$bestIn")")
  echo
  echo "$graph"
  awk -v b="$best" -v m="$median" -v i="$bestIn" \
    'BEGIN { printf "  wall time (the whole process): best %.1f ms, median %.1f ms; in process: best %s ms\n", b / 1000, m / 1000, i }'
  echo "  phases of the last run:"
  tail -n +2 "$out/log" | sed 's/^/  /'
  echo "  summary: $(head -1 "$out/log" | sed "s|$out/bin: ||")"
  awk -v s="$size" -v b="$budget" 'BEGIN {
    printf "  binary: %d bytes = %.2f MiB; budget (15 MiB / 10): %d bytes -> %s\n", s, s / 1048576, b,
      (s <= b ? "ok" : "OVER") }'
done
echo
echo "best compile time in process, $target:"
printf '%s\n' "${table[@]}"
