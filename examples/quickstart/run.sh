#!/usr/bin/env bash
# The main job, end to end on the default embedded setup: build moec, then
# compile-check the forward and backward MoE-FFN graphs for a config (default:
# the tiny config) and print the propagated splits of every op.
#
#   examples/quickstart/run.sh [CONFIG]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
config="${1:-examples/configs/tiny.json}"

bazel build //tools:moec
moec=bazel-bin/tools/moec
for graph in graphs/moe_ffn_fwd.json graphs/moe_ffn_bwd.json; do
  echo "== moec check $graph --config $config"
  "$moec" check "$graph" --config "$config"
  echo
done
