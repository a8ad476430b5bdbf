#!/usr/bin/env bash
# The layer under the MPI fabric (one process per rank, mpirun -np 2, 3, 4 on
# this machine) against the reference, and bit for bit against the
# in-process fabric on the same inputs: forward and backward, fp32 and bf16,
# skewed routing, experts and ranks that receive no rows, both event
# granularities, several passes of one context (--repeat).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

passed=0
failed=0
# check NAME EP RUN_OPTIONS...: random inputs run in-process, then replayed
# under mpirun -np EP with --verify; every output must match bit for bit.
check() {
  local name=$1 ep=$2
  shift 2
  local dir="$WORK/$name"
  "$MOEC" run "$dir/fwd.moebin" "$dir/bwd.moebin" --ranks "$ep" --random 7 \
    --outputs "$dir/inproc" --threads 2 "$@" > "$dir/inproc.log"
  if ! "${MPIRUN[@]}" -np "$ep" "$MOEC" run "$dir/fwd.moebin" "$dir/bwd.moebin" \
      --inputs "$dir/inproc" --outputs "$dir/mpi" --verify --threads 1 --timeout 30 \
      --repeat 2 > "$dir/mpi.log" 2>&1; then
    cat "$dir/mpi.log"
    echo "FAILED: $name (mpirun -np $ep)"
    failed=$((failed + 1))
    return
  fi
  grep -q "verify: passed" "$dir/mpi.log" || { cat "$dir/mpi.log"; echo "FAILED: $name: no verify line"; failed=$((failed + 1)); return; }
  grep -q "$ep MPI processes" "$dir/mpi.log" || { echo "FAILED: $name: not $ep processes"; failed=$((failed + 1)); return; }
  for out in y dx dtopk_weights dw1 dw2; do
    if ! cmp -s "$dir/inproc/$out.npy" "$dir/mpi/$out.npy"; then
      echo "FAILED: $name: $out differs from the in-process run"
      failed=$((failed + 1))
      return
    fi
  done
  echo "ok: $name (mpirun -np $ep)"
  passed=$((passed + 1))
}

for ep in 2 3 4; do
  layer "f32-$ep" 64 32 2 2 "$ep" fp32
  check "f32-$ep" "$ep"
  layer "bf16-$ep" 64 32 2 2 "$ep" bf16
  check "bf16-$ep" "$ep" --hot-share 0.5
done
# Skewed routing: most first choices go to expert 0.
layer skew 48 32 3 2 2 fp32
check skew 2 --hot-share 0.9
# Top-1, every token to expert 0: the other experts, and the other ranks'
# experts, receive no rows (dw of them must be zero, as the reference's).
layer zero 32 16 2 1 3 fp32 ', "capacity_factor": 4'
check zero 3 --hot-share 1
# The seed's event granularity: one event per producer op and expert.
GRANULARITY=per-expert layer per-expert 64 32 2 2 2 fp32
check per-expert 2
# Many local experts, top-8.
layer wide 32 16 8 8 2 bf16
check wide 2

echo
echo "mpi conformance: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
