#!/usr/bin/env bash
# Builds libFuzzer targets with clang-14 (address and undefined-behaviour
# sanitizers) and runs each for a bounded time from its seed corpus. Fails on
# any crash, sanitizer report, leak or timeout the fuzzer finds.
#
#   run_fuzzer.sh SECONDS TARGET.cpp=CORPUS_DIR... -- SOURCE_OR_FLAG|@LIST...
#
# @LIST is a file of sources, one a line (a cc_sources target's list:
# bazel/sources.bzl). The sources after "--" are compiled once (in parallel) and linked into
# every target; flags there go to the compile (-I, -D, ...) or the link
# (-L, -l, -Wl,...). Each target runs for SECONDS on a copy of its corpus.
set -euo pipefail
seconds="$1"
shift
targets=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
  targets+=("$1")
  shift
done
[[ $# -gt 0 ]] && shift
sources=()
flags=()     # for the compile
linkflags=() # for the link
for arg in "$@"; do
  case "$arg" in
    @*) mapfile -t listed < "${arg#@}" && sources+=("${listed[@]}") ;;
    -l* | -L* | -Wl,*) linkflags+=("$arg") ;;
    -*) flags+=("$arg") ;;
    *) sources+=("$arg") ;;
  esac
done
work="${TEST_TMPDIR:-$(mktemp -d)}"
cflags=(-std=c++17 -O1 -g -fno-sanitize-recover=undefined -I .)
compile() { # SOURCE OBJECT
  clang++-14 "${cflags[@]}" -fsanitize=fuzzer-no-link,address,undefined \
    "${flags[@]}" -c "$1" -o "$2"
}
objects=()
jobs=0
for src in "${sources[@]}" "${targets[@]%%=*}"; do
  obj="$work/$(echo "$src" | tr / _).o"
  compile "$src" "$obj" &
  jobs=$((jobs + 1))
  if [[ $jobs -ge $(nproc) ]]; then wait -n; jobs=$((jobs - 1)); fi
done
while [[ $jobs -gt 0 ]]; do wait -n; jobs=$((jobs - 1)); done
for src in "${sources[@]}"; do objects+=("$work/$(echo "$src" | tr / _).o"); done
for target in "${targets[@]}"; do
  src="${target%%=*}"
  corpus_in="${target#*=}"
  name="$(basename "$src" .cpp)"
  bin="$work/$name"
  clang++-14 -fsanitize=fuzzer,address,undefined "${objects[@]}" \
    "$work/$(echo "$src" | tr / _).o" "${linkflags[@]}" -lfmt -o "$bin"
  # The fuzzer adds what it finds to the first corpus folder: work on a copy.
  mkdir -p "$work/corpus-$name"
  cp "$corpus_in"/* "$work/corpus-$name/"
  echo "== $name"
  "$bin" "$work/corpus-$name" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$work/$name-" 2>&1 | tail -n 20
done
