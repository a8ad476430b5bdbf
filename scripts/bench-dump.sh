#!/usr/bin/env bash
# Size and time of `moec dump --json`, full and --compact, for a large
# binary: by default the qwen3-30b-a3b backward at ep 2 on h100 (46,080
# tasks). Each form is written RUNS times; prints the best wall time, the
# peak resident memory of the best run's process, the size, and the time
# Python's json module takes to read it.
#
#   scripts/bench-dump.sh [EP] [TARGET] [RUNS]
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ep="${1:-2}"
target="${2:-h100}"
runs="${3:-3}"

bazel build //tools:moec >/dev/null 2>&1 || bazel build //tools:moec
moec=bazel-bin/tools/moec
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
sed "s/\"ep\": [0-9]*/\"ep\": $ep/" examples/configs/qwen3-30b-a3b.json >"$out/config.json"
"$moec" compile graphs/moe_ffn_bwd.json --config "$out/config.json" --target "$target" \
  -o "$out/bwd.moebin" 2>"$out/compile.log"
echo "moec dump --json benchmark: $(sed "s|$out/||" "$out/compile.log" | cut -d';' -f1)"
echo "  $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
for form in "" "--compact"; do
  best=""
  for _ in $(seq "$runs"); do
    /usr/bin/time -f "%e %M" -o "$out/time" "$moec" dump "$out/bwd.moebin" --json $form \
      -o "$out/dump.json"
    read -r seconds kb <"$out/time"
    if [ -z "$best" ] || awk -v a="$seconds" -v b="$best" 'BEGIN { exit !(a < b) }'; then
      best=$seconds
      bestkb=$kb
    fi
  done
  size=$(stat -c %s "$out/dump.json")
  load=$(python3 -c "import json, sys, time; t = time.time(); json.load(open(sys.argv[1])); print(f'{time.time() - t:.2f}')" "$out/dump.json")
  awk -v f="${form:---json}" -v s="$size" -v t="$best" -v m="$bestkb" -v l="$load" 'BEGIN {
    printf "  %-10s %6.1f MB  written in %.2f s (best), peak RSS %.0f MB, json.load %.2f s\n",
      f, s / 1e6, t, m / 1024, l }'
done
