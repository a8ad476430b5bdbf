#!/usr/bin/env bash
# The main job, end to end on the default embedded setup: build moec, compile
# the forward and backward MoE-FFN graphs for a config (default: the tiny
# config) and a target (default: cpu, this machine) into task binaries, print
# each binary's ops, queues and schedule statistics, then run both on the CPU
# runtime, verify the outputs against the reference layer and print timings.
#
#   examples/quickstart/run.sh [CONFIG] [TARGET]
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
config="${1:-examples/configs/tiny.json}"
target="${2:-cpu}"
out="${TMPDIR:-/tmp}/moec-quickstart"
mkdir -p "$out"

bazel build //tools:moec
moec=bazel-bin/tools/moec
for pass in fwd bwd; do
  graph="graphs/moe_ffn_$pass.json"
  echo "== moec compile $graph --config $config --target $target -o $out/$pass.moebin"
  "$moec" compile "$graph" --config "$config" --target "$target" -o "$out/$pass.moebin"
  echo
  echo "== moec dump $out/$pass.moebin (ops and statistics)"
  "$moec" dump "$out/$pass.moebin" | sed -n '/^ops/,/^$/p;/^statistics/,$p'
  echo
done

# Run both binaries on the CPU runtime: every rank of the EP group in this
# process, random inputs (written to $out/run for replay with --inputs),
# checked against the reference layer, with the time of each pass.
ranks=$(sed -n 's/.*EP ranks \([0-9]*\);.*/\1/p' <("$moec" dump "$out/fwd.moebin" | head -5))
echo "== moec run $out/fwd.moebin $out/bwd.moebin --ranks $ranks --random 1 --outputs $out/run --verify"
"$moec" run "$out/fwd.moebin" "$out/bwd.moebin" --ranks "$ranks" --random 1 --outputs "$out/run" --verify
