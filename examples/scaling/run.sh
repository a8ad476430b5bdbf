#!/usr/bin/env bash
# Builds the moec CLI, then runs scaling.py (step time and GFLOP/s against
# tokens, experts and ranks). Arguments go to scaling.py, e.g.
#   bash examples/scaling/run.sh --csv docs/scaling.csv --png docs/scaling.png
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bazel build //tools:moec
exec /usr/bin/python3 examples/scaling/scaling.py --moec bazel-bin/tools/moec "$@"
