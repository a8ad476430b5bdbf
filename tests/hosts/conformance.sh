#!/usr/bin/env bash
# The layer across 2 simulated hosts (ranks that share no memory with the
# other host's), on OpenMPI's defaults: 1 + 1 and 2 + 2 ranks, outputs bit
# for bit against the in-process run and --verify against the reference;
# then the runtime conformance suite (runtime/api over the MPI fabric, the C
# API included) across the same hosts.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

passed=0
failed=0
# 1 + 1: rank 0 on moec-h0, rank 1 on moec-h1; every put crosses hosts.
BOTH=("${MPIRUN[@]}")
MPIRUN=("${BOTH[@]}" --map-by node)
layer f32-2 64 32 2 2 2 fp32
check f32-2 2
layer bf16-2 48 32 3 2 2 bf16
check bf16-2 2 --hot-share 0.5
# Rows larger than a control message's inline part (16 KiB): the rows go
# as a message of their own, straight into the window.
layer big-2 512 256 2 2 2 fp32
check big-2 2
# 2 + 2: puts between ranks of one host are stores, across hosts messages.
MPIRUN=("${BOTH[@]}")
layer f32-4 64 32 2 2 4 fp32
check f32-4 4
layer bf16-4 64 32 2 2 4 bf16 ', "capacity_factor": 4'
check bf16-4 4 --hot-share 0.9
GRANULARITY=per-expert layer per-expert-4 256 128 2 2 4 fp32
check per-expert-4 4
# One trace of the whole job, across the hosts.
check_trace f32-4 4

# The conformance suite, 1 + 1 and 2 + 2 (it picks the cases of its size).
# Its scratch files go under TEST_TMPDIR, which mpirun passes to the ranks
# only when told (-x): else they land in /tmp, and stay there.
SUITE="$(realpath "${SUITE:?set SUITE to the conformance suite binary}")"
for spread in "2 --map-by node" "4"; do
  log="$WORK/suite-${spread// /}.log" scratch="$WORK/suite-${spread// /}"
  mkdir -p "$scratch"
  if finalizing_job "$log" timeout 900 "${BOTH[@]}" -x TEST_TMPDIR="$scratch" -np $spread "$SUITE" \
      --use-colour no &&
      [ "$(grep -c '^All tests passed' "$log")" -eq "${spread%% *}" ] &&
      compgen -G "$scratch/*_runtime_*.json" >/dev/null; then
    echo "ok: conformance suite, mpirun -np $spread across 2 hosts"
    passed=$((passed + 1))
  else
    tail -40 "$log"
    echo "FAILED: conformance suite, mpirun -np $spread across 2 hosts"
    failed=$((failed + 1))
  fi
done

echo
echo "across hosts: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
