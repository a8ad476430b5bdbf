#!/usr/bin/env bash
# Faults under the MPI fabric: every one ends the whole job in bounded time
# with a message that names the rank at fault, and no output is written.
#   - a rank killed in the middle of a pass
#   - a rank that never submits the pass the others run
#   - a put lost on its way (a test hook drops it and its signal), on the
#     shared-memory path and on the path of ranks that share no memory
#   - a rank given a different binary, or a binary for another EP size
#   - routing over capacity on one rank
#   - ranks given inputs of other shapes, other inputs, other seeds, skew
#     or options: refused on every rank before any pass, naming both ranks
#   - a rank stopped by SIGSTOP: the others' watchdog names it
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

passed=0
failed=0

layer small 64 32 2 2 2 fp32
layer other 96 32 2 2 2 fp32
layer three 64 32 2 2 3 fp32
layer big 512 512 4 2 2 fp32
layer tight 64 32 2 2 2 fp32 ', "capacity_factor": 1'
S=(--threads 1 --timeout 5)

# rank_one_pid: the pid of rank 1 of a job running the big layer, once it
# has started (within 20 s); empty if it never does.
rank_one_pid() {
  local pid
  for _ in $(seq 1 100); do
    sleep 0.2
    for pid in $(pgrep -f "moec run $WORK/big/fwd.moebin" || true); do
      if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx OMPI_COMM_WORLD_RANK=1; then
        echo "$pid"
        return
      fi
    done
  done
}

# A rank killed with SIGKILL while passes run: mpirun ends the job and names
# it; nothing is written.
out="$WORK/killed"
start=$(date +%s)
"${MPIRUN[@]}" -np 2 "$MOEC" run "$WORK/big/fwd.moebin" "$WORK/big/bwd.moebin" --random 1 \
  --outputs "$out" --repeat 100000 "${S[@]}" > "$WORK/killed.log" 2>&1 &
job=$!
victim=$(rank_one_pid)
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
# layer twice, rank 0 once. Whichever waits out the timeout first names the
# other: rank 1 names rank 0 at its exchange (rank 0 ended its job), or rank
# 0 names rank 1 at the end of the job (it runs more passes).
fails silent-rank "rank 1: rank 0 did not reach the exchange within 5 s|rank 0: rank 1 did not reach the end of the job within 5 s" \
  "${RUN[@]}" 1 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --random 1 \
  --outputs "$WORK/silent-rank" --repeat 1 "${S[@]}" : \
  -np 1 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --random 1 \
  --outputs "$WORK/silent-rank" --repeat 2 "${S[@]}"

# The report of that job, on rank 0: both ranks' parts, each saying why.
expect_all silent-rank-report "$WORK/silent-rank.log" "$WORK/silent-rank" \
  "^report of the 2 ranks, gathered on rank 0:" \
  "^  \[rank 0\] at the end of the job: (rank 1 stopped the job: rank 1: rank 0 did not reach the exchange|rank 0: rank 1 did not reach the end of the job within 5 s)" \
  "^  \[rank 1\] (rank 1: rank 0 did not reach the exchange within 5 s \(rank 0 reached the end of the job: it ran fewer passes than this rank\)|rank 0 stopped the job: at the end of the job: rank 0: rank 1 did not reach the end of the job)"

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

# A put dropped in a backward pass (the 10th put of rank 1 lands in the
# backward of the big layer): the report counts the bytes of that pass
# alone, never more arrived than expected (a backward has no exchange of its
# own to count from).
log="$WORK/dropped-put-backward.log"
if "${RUN[@]}" 2 -x MOEC_TEST_DROP_PUT=1:10 "$MOEC" run "$WORK/big/fwd.moebin" \
    "$WORK/big/bwd.moebin" --random 1 --outputs "$WORK/dropped-put-backward" "${S[@]}" \
    > "$log" 2>&1; then
  bad "dropped-put-backward: the job exited 0" "$log"
elif ! grep -qE "op '(act_grad|gate_grad|down_grad|up_grad|swiglu_grad)[^']*'" "$log"; then
  bad "dropped-put-backward: the report names no op of the backward" "$log"
elif ! grep -q "MOEC_TEST_DROP_PUT=1:10: this rank's put number 10" "$log"; then
  bad "dropped-put-backward: the log does not say that the test hook dropped the put" "$log"
elif grep -oE "arrived from rank [0-9]+ [0-9]+ of [0-9]+" "$log" |
    awk '$5 > $7 { bad = 1 } END { exit !bad }'; then
  bad "dropped-put-backward: more bytes arrived than the pass expects" "$log"
elif ! grep -qE "arrived from rank 1 [0-9]+ of [0-9]+ \(short\)" "$log"; then
  bad "dropped-put-backward: the report does not say the rows from rank 1 are short" "$log"
else
  ok dropped-put-backward
fi

# The test hook itself refuses what it cannot read, and a rank the group
# does not have.
fails bad-hook "MOEC_TEST_DROP_PUT='1': expected RANK:N" \
  "${RUN[@]}" 2 -x MOEC_TEST_DROP_PUT=1 "$MOEC" run "$WORK/small/fwd.moebin" --random 1 \
  --outputs "$WORK/bad-hook" "${S[@]}"
fails hook-rank-out-of-range "MOEC_TEST_DROP_PUT='5:1': there is no rank 5 \(the group has 2 ranks\)" \
  "${RUN[@]}" 2 -x MOEC_TEST_DROP_PUT=5:1 "$MOEC" run "$WORK/small/fwd.moebin" --random 1 \
  --outputs "$WORK/hook-rank-out-of-range" "${S[@]}"

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
# The inputs come from the small layer (the tight one's shapes, room for any
# routing): a random routing may itself exceed capacity_factor 1.
"$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --ranks 2 --random 1 \
  --outputs "$in" --threads 1 > /dev/null

# Routing over capacity caused by rank 1's routing only (every token of rank
# 1 to experts 0 and 1): every rank stops with the same message before
# anything is written.
edit_ids "$in" "ids[1, :, 0] = 0; ids[1, :, 1] = 1"
fails over-capacity "\[process of rank 0\] routing over capacity: the experts of rank 0 receive" \
  "${RUN[@]}" 2 "$MOEC" run "$WORK/tight/fwd.moebin" "$WORK/tight/bwd.moebin" --inputs "$in" --hand-made \
  --outputs "$WORK/over-capacity" "${S[@]}"

# An expert id out of range in rank 1's routing only: rank 0 stops with
# rank 1's message.
edit_ids "$in" "ids[1, 5, 1] = 9"
fails bad-id "\[process of rank 0\] rank 1: topk_ids\[5\]\[1\] = 9 is not an expert" \
  "${RUN[@]}" 2 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --inputs "$in" --hand-made \
  --outputs "$WORK/bad-id" "${S[@]}"

# Ranks given other inputs or options: refused on every rank before any
# pass, naming both ranks and what differs; never a crash, never outputs
# that no single set of inputs gives.
full="$WORK/full-in"
"$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" --ranks 2 --random 1 \
  --outputs "$full" --threads 1 > /dev/null
half="$WORK/half-in" # the same tokens, S 64 of the binary's 128
cp -r "$full" "$half"
rm -f "$half/manifest.json"
/usr/bin/python3 -c "
import sys, numpy as np
for name in ('x', 'topk_ids', 'topk_weights', 'dy'):
    path = f'{sys.argv[1]}/{name}.npy'
    np.save(path, np.load(path)[:, :64])" "$half"
rerouted="$WORK/rerouted-in"
cp -r "$full" "$rerouted"
edit_ids "$rerouted" "ids[0, 3, :] = ids[0, 3, ::-1]"
# on_ranks NAME PATTERN RANK0_OPTIONS -- RANK1_OPTIONS: the small layer's
# forward and backward, rank 0 and rank 1 with their own options.
on_ranks() {
  local name=$1 pattern=$2 first=() second=()
  shift 2
  while [ "$1" != "--" ]; do first+=("$1"); shift; done
  shift
  second=("$@")
  fails "$name" "$pattern" "${RUN[@]}" 1 "$MOEC" run "$WORK/small/fwd.moebin" \
    "$WORK/small/bwd.moebin" --outputs "$WORK/$name" "${S[@]}" "${first[@]}" : \
    -np 1 "$MOEC" run "$WORK/small/fwd.moebin" "$WORK/small/bwd.moebin" \
    --outputs "$WORK/$name" "${S[@]}" "${second[@]}"
}
on_ranks other-shape-first "rank 1 read inputs of another shape than rank 0: R 2, S 128, .* against R 2, S 64" \
  --inputs "$half" --hand-made -- --inputs "$full" --hand-made
on_ranks other-shape-second "rank 1 read inputs of another shape than rank 0: R 2, S 64, .* against R 2, S 128" \
  --inputs "$full" --hand-made -- --inputs "$half" --hand-made
on_ranks other-inputs-folder "rank 1 read another topk_ids.npy than rank 0" \
  --inputs "$full" --hand-made -- --inputs "$rerouted" --hand-made
on_ranks other-seed "rank 1 read another x.npy than rank 0" --random 1 -- --random 2
on_ranks hot-share-on-one-rank "rank 1 was started with other options than rank 0: '--hot-share 0.5' against '\(none\)'" \
  --random 1 -- --random 1 --hot-share 0.5
on_ranks local-puts-on-one-rank "rank 1 was started with other options than rank 0: '--local-puts' against '\(none\)'" \
  --random 1 -- --random 1 --local-puts
on_ranks op-by-op-on-one-rank "rank 1 was started with other options than rank 0: '--op-by-op' against '\(none\)'" \
  --random 1 -- --random 1 --op-by-op

# A job one of whose processes is no moec run: MPI's start-up waits for it
# without a bound of its own, and moec's watchdog ends the job.
fails peer-not-moec "MPI's start-up did not end within 5 s: some process of the job did not start MPI|exiting improperly" \
  "${RUN[@]}" 1 "$MOEC" run "$WORK/small/fwd.moebin" --random 1 --outputs "$WORK/peer-not-moec" \
  "${S[@]}" : -np 1 "$MOEC" dump "$WORK/small/fwd.moebin"
# The in-process fabric under mpirun: each process would run the whole layer.
fails inproc-under-mpirun "fabric inproc runs every rank in this process, but mpirun started 2 processes" \
  "${RUN[@]}" 2 "$MOEC" run "$WORK/small/fwd.moebin" --ranks 2 --fabric inproc --random 1 \
  --outputs "$WORK/inproc-under-mpirun" "${S[@]}"

# A rank stopped by SIGSTOP in the middle of the passes: rank 0's watchdog
# names rank 1, and the job ends in bounded time.
out="$WORK/stopped"
"${MPIRUN[@]}" -np 2 "$MOEC" run "$WORK/big/fwd.moebin" "$WORK/big/bwd.moebin" --random 1 \
  --outputs "$out" --repeat 100000 "${S[@]}" > "$WORK/stopped.log" 2>&1 &
job=$!
victim=$(rank_one_pid)
# Stopped in the passes, not in MPI's start-up (which has no bound of
# moec's): rank 0 prints the schedule once every rank has its inputs.
for _ in $(seq 1 100); do
  grep -q "^schedule:" "$WORK/stopped.log" && break
  sleep 0.2
done
sleep 1
if [ -z "$victim" ]; then
  bad "stopped rank: rank 1 never started"
  kill "$job" 2> /dev/null || true
else
  start=$(date +%s)
  kill -STOP "$victim" || true
  ( sleep 60; kill -9 "$victim" 2> /dev/null ) &
  reaper=$!
  if wait "$job"; then
    bad "stopped rank: mpirun exited 0" "$WORK/stopped.log"
  elif [ $(($(date +%s) - start)) -gt 55 ]; then
    bad "stopped rank: the job took more than 55 s to end" "$WORK/stopped.log"
  else
    expect "stopped rank" "$WORK/stopped.log" "(signalled by|from|to) rank 1|rank 1 did not" "$out"
    if grep -q "0 queues on 0 ranks" "$WORK/stopped.log"; then
      bad "stopped rank: the report names no rank" "$WORK/stopped.log"
    fi
  fi
  kill -9 "$victim" 2> /dev/null || true
  kill "$reaper" 2> /dev/null || true
fi

echo
echo "mpi faults: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
