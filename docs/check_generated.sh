#!/usr/bin/env bash
# Usage: check_generated.sh GENERATED COMMITTED [GENERATED COMMITTED ...]
status=0
while [ $# -ge 2 ]; do
  if ! diff -u "$2" "$1"; then
    echo "$2 is stale: run scripts/update-docs.sh" >&2
    status=1
  fi
  shift 2
done
exit $status
