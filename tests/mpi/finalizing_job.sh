# Sourced by the tests that run jobs under mpirun: common.sh (and through it
# the tests across hosts) and tests/conformance/run_mpi.sh.
#
# finalizing_job LOG MPIRUN_COMMAND...: runs a job whose processes all end by
# finalizing MPI, its output to LOG; runs it once more where it failed only
# by Open MPI 4.1's shutdown race: a process's finalize that its launcher,
# slow on a loaded machine, had not acknowledged within PMIx's 2 s when the
# process ended, reported as "exiting improperly" with PID 0
# (open-mpi/ompi#7833). The second run must pass on its own.
finalizing_job() {
  local log=$1
  shift
  "$@" > "$log" 2>&1 && return 0
  grep -q "exiting improperly" "$log" && grep -Eq "process rank [0-9]+ with PID 0 on" "$log" ||
    return 1
  "$@" > "$log" 2>&1
}
