#!/usr/bin/env bash
# Regenerates docs/generated/ from the dialect and pass .td files.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bazel build //compiler/ir:ops_inc_gen //compiler/transforms:pass_inc_gen
mkdir -p docs/generated
cp -f bazel-bin/compiler/ir/MoeDialect.md docs/generated/MoeDialect.md
cp -f bazel-bin/compiler/transforms/Passes.md docs/generated/Passes.md
chmod 644 docs/generated/*.md
