#!/usr/bin/env bash
# Builds a Catch2 test and the sources it needs with g++ and ThreadSanitizer,
# outside Bazel's toolchain, and runs it. Fails on any data race the
# sanitizer reports (halt_on_error) or any failing test.
#
#   run_tsan.sh REPEATS SOURCE...
set -euo pipefail
repeats="$1"
shift
work="${TEST_TMPDIR:-$(mktemp -d)}"
bin="$work/tsan_test"
g++ -std=c++17 -O1 -g -fsanitize=thread -I . "$@" -lfmt -pthread -o "$bin"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
for ((i = 1; i <= repeats; ++i)); do
  "$bin" --order rand --rng-seed "$i" | tail -n 3
done
