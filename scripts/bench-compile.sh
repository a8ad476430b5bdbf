#!/usr/bin/env bash
# Compile-time and binary-size benchmark of `moec compile`: the forward and
# backward graphs for a config on a target (default: deepseek-v3, ep 32,
# seq_size 4096, on ascend-910b), each compiled RUNS times; prints the best
# and median wall time of the whole command and of each phase, and the binary
# size against a tenth of the seed's fixed 15 MB runtime struct.
#
#   scripts/bench-compile.sh [CONFIG] [TARGET] [RUNS]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
config="${1:-examples/configs/deepseek-v3.json}"
target="${2:-ascend-910b}"
runs="${3:-5}"

bazel build //tools:moec >/dev/null 2>&1 || bazel build //tools:moec
moec=bazel-bin/tools/moec
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
budget=$((15 * 1024 * 1024 / 10))

echo "moec compile benchmark: config $config, target $target, $runs runs each, $(nproc) cores"
for graph in graphs/moe_ffn_fwd.json graphs/moe_ffn_bwd.json; do
  times=()
  for _ in $(seq "$runs"); do
    start=$(date +%s%N)
    "$moec" compile "$graph" --config "$config" --target "$target" -o "$out/bin" --time \
      2>"$out/log"
    end=$(date +%s%N)
    times+=($(( (end - start) / 1000 )))
  done
  sorted=($(printf '%s\n' "${times[@]}" | sort -n))
  best=${sorted[0]}
  median=${sorted[$(( runs / 2 ))]}
  size=$(stat -c %s "$out/bin")
  echo
  echo "$graph"
  awk -v b="$best" -v m="$median" \
    'BEGIN { printf "  wall time (the whole process): best %.1f ms, median %.1f ms\n", b / 1000, m / 1000 }' 
  echo "  phases of the last run:"
  tail -n +2 "$out/log" | sed 's/^/  /'
  echo "  summary: $(head -1 "$out/log" | sed "s|$out/bin: ||")"
  awk -v s="$size" -v b="$budget" 'BEGIN {
    printf "  binary: %d bytes = %.2f MiB; budget (15 MiB / 10): %d bytes -> %s\n", s, s / 1048576, b,
      (s <= b ? "ok" : "OVER") }' 
done
