#!/usr/bin/env bash
# Runs one lit test file with the project's lit.cfg.py. Called by glob_lit_tests.
set -euo pipefail
test_file="$1"
cfg_dir="$(pwd)/tests/lit"
export MOEC_TOOLS_DIR="$(pwd)/tools"
export MOEC_SRC_ROOT="$(pwd)"
exec python3 /usr/lib/llvm-16/build/utils/lit/lit.py -v \
  --param moec_tools_dir="$MOEC_TOOLS_DIR" \
  "$test_file"
