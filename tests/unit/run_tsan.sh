#!/usr/bin/env bash
# Builds a Catch2 test and the sources it needs with g++ and ThreadSanitizer,
# outside Bazel's toolchain, and runs it. Fails on any data race the
# sanitizer reports (halt_on_error) or any failing test.
#
#   run_tsan.sh REPEATS SOURCE|@LIST... [-lLIB...]
#
# @LIST is a file of sources, one a line (a cc_sources target's list:
# bazel/sources.bzl). Each source is compiled on its own, as many at a time as there are CPUs;
# the -l arguments are linked after them (besides -lfmt and -pthread). Code
# that is not built here (libstdc++, fmt, oneDNN, a subprocess) is not
# instrumented: the sanitizer sees its locks and threads, not its accesses.
set -euo pipefail
repeats="$1"
shift
sources=()
libs=()
for arg in "$@"; do
  case "$arg" in
    -l*) libs+=("$arg") ;;
    @*) mapfile -t listed < "${arg#@}" && sources+=("${listed[@]}") ;;
    *) sources+=("$arg") ;;
  esac
done
work="${TEST_TMPDIR:-$(mktemp -d)}"
bin="$work/tsan_test"
mkdir -p "$work/obj"
export TSAN_CXXFLAGS="-std=c++17 -O1 -g -fsanitize=thread -I ."
objects=()
for src in "${sources[@]}"; do
  objects+=("$work/obj/${src//\//_}.o")
done
# Source i goes to object i; xargs stops the build (exit 255) on a failure.
for i in "${!sources[@]}"; do
  printf '%s\0%s\0' "${sources[$i]}" "${objects[$i]}"
done | xargs -0 -n 2 -P "$(nproc)" sh -c 'g++ $TSAN_CXXFLAGS -c "$1" -o "$2" || exit 255' g++
g++ -fsanitize=thread "${objects[@]}" "${libs[@]}" -lfmt -pthread -o "$bin"
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
for ((i = 1; i <= repeats; ++i)); do
  "$bin" --order rand --rng-seed "$i" | tail -n 3
done
