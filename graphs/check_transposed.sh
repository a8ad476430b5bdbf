#!/usr/bin/env bash
# Checks the graphs/*_transposed.json files against transpose_weights.py.
set -euo pipefail
script="$1"
python3 "$script" --check --dir "$(dirname "$script")"
