#!/usr/bin/env bash
# Every shell script the project ships answers --help and -h with its usage
# and does nothing else: exit 0, its leading comment (the first line of it
# first) on stdout, and no tool run (bazel, mpirun, torchrun, nvcc, git,
# apt-get and sudo are stubs on PATH that leave a mark). Every program after
# `--` answers --help with a usage on stdout and exit 0.
#
#   scripts/help_test.sh SCRIPT... [-- PROGRAM...]
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/help_test.sh SCRIPT... [-- PROGRAM...]" >&2; exit 2; }
scripts=() programs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  scripts+=("$1")
  shift
done
[ $# -gt 0 ] && shift
programs=("$@")
stubs="$(mktemp -d)"
trap 'rm -rf "$stubs"' EXIT
marks="$stubs/marks"
for tool in bazel mpirun torchrun nvcc git apt-get sudo; do
  printf '#!/bin/sh\necho "%s $*" >> "%s"\nexit 3\n' "$tool" "$marks" > "$stubs/$tool"
  chmod +x "$stubs/$tool"
done
fails=0
for script in "${scripts[@]}"; do
  first="$(awk 'NR == 2 {sub(/^# ?/, ""); print; exit}' "$script")"
  for flag in --help -h; do
    rm -f "$marks"
    out="$(PATH="$stubs:$PATH" timeout 20 bash "$script" "$flag" 2>&1)"
    rc=$?
    if [ $rc -ne 0 ] || [ -z "$first" ] || [[ "$out" != "$first"* ]] || [ -e "$marks" ]; then
      echo "FAIL: $script $flag -> exit $rc; ran: $(head -2 "$marks" 2>/dev/null | tr '\n' ' ')"
      echo "  printed: $(echo "$out" | head -2 | tr '\n' ' ')"
      echo "  (wanted exit 0, '$first' first, and nothing run)"
      fails=$((fails + 1))
    fi
  done
done
for program in "${programs[@]}"; do
  out="$(timeout 20 "$program" --help 2>/dev/null)"
  rc=$?
  if [ $rc -ne 0 ] || ! grep -qi "usage" <<<"$out"; then
    echo "FAIL: $program --help -> exit $rc, '$(echo "$out" | head -1)' (wanted exit 0 and a usage)"
    fails=$((fails + 1))
  fi
done
echo "help_test: ${#scripts[@]} scripts, ${#programs[@]} programs, $fails failures"
exit $((fails > 0))
