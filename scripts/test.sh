#!/usr/bin/env bash
# Builds everything and runs every test (Catch2 unit tests, lit/FileCheck tests
# and the pytest suite of the torch op), then prints one summary line:
# "tests: N passed, N failed".
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
log="$(mktemp)"
bazel test //... --test_summary=short "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|FLAKY)' "$log")
rm -f "$log"
echo
echo "tests: ${passed} passed, ${failed} failed"
exit "$status"
