#!/usr/bin/env bash
# The main job, end to end on the default embedded setup: build moec, compile
# the forward and backward MoE-FFN graphs for a config (default: the tiny
# config) and a target (default: cpu, this machine) into task binaries, and
# print each binary's ops, queues and schedule statistics.
#
#   examples/quickstart/run.sh [CONFIG] [TARGET]
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
