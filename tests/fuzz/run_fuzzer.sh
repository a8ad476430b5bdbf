#!/usr/bin/env bash
# Builds a libFuzzer target with clang-14 (address and undefined-behaviour
# sanitizers) and runs it for a bounded time from a seed corpus. Fails on any
# crash, sanitizer report, leak or timeout the fuzzer finds.
#
#   run_fuzzer.sh SECONDS CORPUS_DIR SOURCE...
set -euo pipefail
seconds="$1"
corpus_in="$2"
shift 2
work="${TEST_TMPDIR:-$(mktemp -d)}"
bin="$work/fuzzer"
clang++-14 -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined -I . "$@" -lfmt -o "$bin"
# The fuzzer adds what it finds to the first corpus folder: work on a copy.
mkdir -p "$work/corpus"
cp "$corpus_in"/* "$work/corpus/"
"$bin" "$work/corpus" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$work/" 2>&1 | tail -n 20
