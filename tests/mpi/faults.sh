#!/usr/bin/env bash
# Faults under the MPI fabric: every one ends the whole job in bounded time
# with a message that names the rank at fault, and no output is written.
#   - a rank killed in the middle of a pass
#   - a rank that never submits the pass the others run
#   - a put lost on its way (a test hook drops it and its signal), on the
#     shared-memory path and on the path of ranks that share no memory
#   - a rank given a different binary, or a binary for another EP size
#   - routing over capacity on one rank
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

passed=0
failed=0

layer small 64 32 2 2 2 fp32
layer other 96 32 2 2 2 fp32
layer three 64 32 2 2 3 fp32
layer big 512 512 4 2 2 fp32
layer tight 64 32 2 2 2 fp32 ', "capacity_factor": 1'
S=(--threads 1 --timeout 5)

# A rank killed with SIGKILL while passes run: mpirun ends the job and names
# it; nothing is written.
out="$WORK/killed"
start=$(date +%s)
"${MPIRUN[@]}" -np 2 "$MOEC" run "$WORK/big/fwd.moebin" "$WORK/big/bwd.moebin" --random 1 \
  --outputs "$out" --repeat 100000 "${S[@]}" > "$WORK/killed.log" 2>&1 &
job=$!
victim=""
for _ in $(seq 1 100); do
  sleep 0.2
  for pid in $(pgrep -f "moec run $WORK/big/fwd.moebin" || true); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1; then
      victim=$pid
    fi
  done
  [ -n "$victim" ] && break
done
sleep 2 # well inside the passes (each takes milliseconds; 100000 of them)
if [ -z "$victim" ]; then
  bad "killed rank: rank 1 never started"
  kill "$job" 2> /dev/null || true
else
  kill -9 "$victim" || true
  if wait "$job"; then
    bad "killed rank: mpirun exited 0" "$WORK/killed.log"
  elif [ $(($(date +%s) - start)) -gt 60 ]; then
    bad "killed rank: the job took more than 60 s to end" "$WORK/killed.log"
  else
    expect "killed rank" "$WORK/killed.log" "rank 1 .*(Killed|signal 9)" "$out"
  fi
fi

# fails NAME PATTERN COMMAND...: the job must fail, its output match PATTERN,
# and $WORK/NAME (its --outputs) hold no output.
fails() {
  local name=$1 pattern=$2
  shift 2
  local log="$WORK/$name.log"
  if "$@" > "$log" 2>&1; then
    bad "$name: the job exited 0" "$log"
  else
    expect "$name" "$log" "$pattern" "$WORK/$name"
  fi
}
RUN=("${MPIRUN[@]}" -np)

# A rank that never submits the pass the others wait for: rank 1 runs the
# layer twice, rank 0 once. Rank 1's watchdog names rank 0.
fails silent-rank "rank 1: rank 0 did not reach the exchange within 5 s" \
  "${RUN[@]}" 1 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --random 1 \
  --outputs "$WORK/silent-rank" --repeat 1 "${S[@]}" : \
  -np 1 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --random 1 \
  --outputs "$WORK/silent-rank" --repeat 2 "${S[@]}"

# The report of that job, on rank 0: rank 1's part (the exchange it waited
# for, and why: rank 0 ended its job), and rank 0's (stopped by rank 1, or
# its own wait for rank 1 at the end of the job, whichever ends first).
expect_all silent-rank-report "$WORK/silent-rank.log" "$WORK/silent-rank" \
  "^report of the 2 ranks, gathered on rank 0:" \
  "^  \[rank 0\] at the end of the job: (rank 1 stopped the job: rank 1: rank 0 did not reach the exchange|rank 0: rank 1 did not reach the end of the job within 5 s)" \
  "^  \[rank 1\] rank 1: rank 0 did not reach the exchange within 5 s \(rank 0 reached the end of the job: it ran fewer passes than this rank\)"

# A put lost on its way: rank 1 drops its second put to rank 0 and the
# signal after it. Rank 0's watchdog fires; the report names the event, the
# peer whose signal is missing and the bytes that did not arrive.
for path in shared-memory no-shared-memory; do
  fails "dropped-put-$path" "^report of the 2 ranks" \
    "${RUN[@]}" 2 -x MOEC_TEST_DROP_PUT=1:2 \
    -x MOEC_MPI_NO_SHARED_MEMORY=$([ "$path" = shared-memory ] && echo 0 || echo 1) \
    "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --random 1 \
    --outputs "$WORK/dropped-put-$path" "${S[@]}"
  expect_all "dropped-put-$path-report" "$WORK/dropped-put-$path.log" "$WORK/dropped-put-$path" \
    "${DROPPED_PUT_REPORT[@]}"
done

# The test hook itself refuses what it cannot read.
fails bad-hook "MOEC_TEST_DROP_PUT='1': expected RANK:N" \
  "${RUN[@]}" 2 -x MOEC_TEST_DROP_PUT=1 "$MOEC" run "$WORK/small/fwd.moebin" --random 1 \
  --outputs "$WORK/bad-hook" "${S[@]}"

# A rank given another binary: refused when the context is created, naming
# both ranks' binaries.
fails different-binary \
  "ranks 0 and 1 run different layers: rank 0 runs forward '.*small/fwd.moebin'.*H 64.*rank 1 runs forward '.*other/fwd.moebin'.*H 96" \
  "${RUN[@]}" 1 "$MOEC" run "$WORK/small/fwd.moebin" --random 1 \
  --outputs "$WORK/different-binary" "${S[@]}" : \
  -np 1 "$MOEC" run "$WORK/other/fwd.moebin" --random 1 --outputs "$WORK/different-binary" "${S[@]}"

# A binary for 3 ranks under 2 processes.
fails ep-size "mpirun started 2 processes, but .*three/fwd.moebin was compiled for 3 ranks .*mpirun -np 3" \
  "${RUN[@]}" 2 "$MOEC" run "$WORK/three/fwd.moebin" --random 1 --outputs "$WORK/ep-size" "${S[@]}"

# edit_ids DIR PYTHON: changes DIR/topk_ids.npy (numpy array `ids`
# [R, S, K]) with the statement PYTHON.
edit_ids() {
  /usr/bin/python3 -c "import sys, numpy as np; ids = np.load(sys.argv[1]); $2; np.save(sys.argv[1], ids)" \
    "$1/topk_ids.npy"
  rm -f "$1/manifest.json" # the folder is no longer the run's
}
in="$WORK/capacity-in"
"$MOEC" run "$WORK/tight/fwd.moebin" "$WORK/tight/bwd.moebin" --ranks 2 --random 1 \
  --outputs "$in" --threads 1 > /dev/null

# Routing over capacity caused by rank 1's routing only (every token of rank
# 1 to experts 0 and 1): every rank stops with the same message before
# anything is written.
edit_ids "$in" "ids[1, :, 0] = 0; ids[1, :, 1] = 1"
fails over-capacity "\[process of rank 0\] routing over capacity: the experts of rank 0 receive" \
  "${RUN[@]}" 2 "$MOEC" run "$WORK/tight/fwd.moebin" "$WORK/tight/bwd.moebin" --inputs "$in" \
  --outputs "$WORK/over-capacity" "${S[@]}"

# An expert id out of range in rank 1's routing only: rank 0 stops with
# rank 1's message.
edit_ids "$in" "ids[1, 5, 1] = 9"
fails bad-id "\[process of rank 0\] rank 1: topk_ids\[5\]\[1\] = 9 is not an expert" \
  "${RUN[@]}" 2 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --inputs "$in" \
  --outputs "$WORK/bad-id" "${S[@]}"

echo
echo "mpi faults: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
