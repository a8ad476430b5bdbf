#!/usr/bin/env bash
# Runs the conformance suite's binary with one rank per process, under
# mpirun -np 2, 3 and 4 (oversubscribed on this machine's cores):
#   run_mpi.sh SUITE_BINARY
set -uo pipefail
suite="$(realpath "$1")"
source "$(dirname "${BASH_SOURCE[0]}")/../mpi/finalizing_job.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# The suite writes its scratch files under TEST_TMPDIR, which mpirun does not
# pass to the processes it starts unless told (-x): else they land in /tmp.
export TEST_TMPDIR="${TEST_TMPDIR:-$(mktemp -d)}"
failed=0
for np in 2 3 4; do
  log="$TEST_TMPDIR/np$np.log"
  if finalizing_job "$log" timeout 900 mpirun --oversubscribe --bind-to none -x TEST_TMPDIR \
      -np "$np" "$suite" --use-colour no; then
    echo "ok: mpirun -np $np: $(grep -m1 -E '^All tests passed' "$log")"
  else
    cat "$log"
    echo "FAILED: mpirun -np $np"
    failed=$((failed + 1))
  fi
done
echo
echo "conformance under mpi: $((3 - failed)) passed, ${failed} failed"
[ "$failed" -eq 0 ]
