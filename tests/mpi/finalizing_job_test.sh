#!/usr/bin/env bash
# finalizing_job (finalizing_job.sh) on stand-in jobs: a job that fails once with
# Open MPI's lost-finalize report runs once more and passes; one that fails
# with it every time fails after two runs; one that fails otherwise, or
# passes, runs once.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/finalizing_job.sh"
cd "${TEST_TMPDIR:-$(mktemp -d)}"
failures=0
bad() {
  echo "FAILED: $*"
  failures=$((failures + 1))
}

lost() {
  printf 'mpirun has exited due to process rank 1 with PID 0 on\n'
  printf 'node vm exiting improperly. There are three reasons this could occur:\n'
}
# job KIND: counts its runs in runs.KIND; lost-once fails with the report on
# its first run only.
job() {
  echo run >> "runs.$1"
  case $1 in
    passes) echo "verify: passed" ;;
    lost-once) [ "$(wc -l < "runs.$1")" -gt 1 ] && echo "verify: passed" && return 0
      lost; return 1 ;;
    lost-always) lost; return 1 ;;
    other-pid) lost | sed 's/PID 0 on/PID 4242 on/'; return 1 ;;
    rank-failed) echo "mpirun detected that one or more processes exited with non-zero status"
      return 1 ;;
  esac
}

# expect KIND PASSES RUNS
expect() {
  local kind=$1 passes=$2 runs=$3 got=fails
  finalizing_job "log.$kind" job "$kind" && got=passes
  [ "$got" = "$passes" ] || bad "$kind: the job $got, expected it $passes"
  [ "$(wc -l < "runs.$kind")" -eq "$runs" ] ||
    bad "$kind: ran $(wc -l < "runs.$kind") times, expected $runs"
}
expect passes passes 1
expect lost-once passes 2
grep -q "verify: passed" log.lost-once || bad "lost-once: the log is not the second run's"
expect lost-always fails 2
expect other-pid fails 1
expect rank-failed fails 1

[ "$failures" -eq 0 ] && echo "finalizing_job: ok"
exit "$failures"
