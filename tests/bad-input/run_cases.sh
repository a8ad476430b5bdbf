#!/usr/bin/env bash
# The bad-input matrix under `bazel test`:
#   run_cases.sh MOEC MOEC_OPT MOEC_TORCH_SO LIBMOEC_SO
set -euo pipefail
exec /usr/bin/python3 tests/bad-input/run_cases.py --moec "$1" --moec-opt "$2" --torch-lib "$3" --moec-lib "$4"
