#!/usr/bin/env bash
# Builds the moec CLI, then runs scaling.py (step time and GFLOP/s against
# tokens, experts and ranks). Arguments go to scaling.py, e.g.
#   bash examples/scaling/run.sh --csv docs/scaling.csv --png docs/scaling.png
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bazel build //tools:moec
exec /usr/bin/python3 examples/scaling/scaling.py --moec bazel-bin/tools/moec "$@"
