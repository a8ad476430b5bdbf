#!/usr/bin/env bash
# Runs the pytest suite of the torch op under `bazel test`:
#   run_pytest.sh OP_LIBRARY COMPILER_LIBRARY [pytest args...]
# with Debian's Python (/usr/bin/python3: python3-torch, python3-pytest).
set -euo pipefail
export MOEC_TORCH_LIB="$(realpath "$1")"
export MOEC_LIB="$(realpath "$2")"
shift 2
export MOEC_GRAPHS="$PWD/graphs"
export MOEC_CACHE_DIR="${TEST_TMPDIR:-$(mktemp -d)}/moec-cache"
export PYTHONPATH="$PWD/ops/torch:$PWD/examples/torch${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 -m pytest -p no:cacheprovider -q "$@" ops/torch/tests
