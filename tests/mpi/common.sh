# Shared by the MPI tests: the moec binary, mpirun as root, layer configs.
#   MOEC      the moec binary (from the test's environment)
#   GRAPHS    the graphs folder
set -euo pipefail
MOEC="$(realpath "${MOEC:?set MOEC to the moec binary}")"
GRAPHS="$(realpath "${GRAPHS:-graphs}")"
WORK="${TEST_TMPDIR:-$(mktemp -d)}"
# mpirun refuses root unless told; CI runs as root. More ranks than cores
# need --oversubscribe.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
MPIRUN=(mpirun --oversubscribe --bind-to none)
source "$(dirname "${BASH_SOURCE[0]}")/finalizing_job.sh"

# layer NAME H I L K EP DTYPE [extra config JSON]: compiles both graphs
# into $WORK/NAME/{fwd,bwd}.moebin (granularity from $GRANULARITY, peer
# groups from $PEER_GROUPS, EP x $TP ranks; $GRAPH picks other graphs than the full layer's,
# e.g. _lora_transposed_int4 for moe_ffn_{fwd,bwd}_lora_transposed_int4).
layer() {
  local name=$1 H=$2 I=$3 L=$4 K=$5 EP=$6 DT=$7 extra=${8:-}
  local dir="$WORK/$name"
  mkdir -p "$dir"
  echo "{\"name\": \"$name\", \"hidden_size\": $H, \"intermediate_size\": $I, \"num_experts\": $((L * EP)), \"top_k\": $K, \"ep\": $EP, \"tp\": ${TP:-1}, \"seq_size\": 128, \"dtype\": \"$DT\", \"num_cube_cores\": 2, \"num_vector_cores\": 2$extra}" > "$dir/config.json"
  "$MOEC" compile "$GRAPHS/moe_ffn_fwd${GRAPH:-}.json" --config "$dir/config.json" \
    --granularity "${GRANULARITY:-per-tile-range}" ${PEER_GROUPS:+--peer-groups "$PEER_GROUPS"} \
    -o "$dir/fwd.moebin" > /dev/null
  "$MOEC" compile "$GRAPHS/moe_ffn_bwd${GRAPH:-}.json" --config "$dir/config.json" \
    --granularity "${GRANULARITY:-per-tile-range}" ${PEER_GROUPS:+--peer-groups "$PEER_GROUPS"} \
    -o "$dir/bwd.moebin" > /dev/null
}

fail() {
  echo "FAILED: $*" >&2
  exit 1
}

# check NAME RANKS RUN_OPTIONS...: random inputs run in-process, then
# replayed under "${MPIRUN[@]}" -np RANKS (EP x TP) with --verify; every
# output ($OUTPUTS, default the full layer's) must match bit for bit.
# Counts into $passed and $failed.
check() {
  local name=$1 ep=$2 # ranks: EP x TP
  shift 2
  local dir="$WORK/$name"
  "$MOEC" run "$dir/fwd.moebin" "$dir/bwd.moebin" --ranks "$ep" --random 7 \
    --outputs "$dir/inproc" --threads 2 "$@" > "$dir/inproc.log"
  if ! finalizing_job "$dir/mpi.log" "${MPIRUN[@]}" -np "$ep" "$MOEC" run "$dir/fwd.moebin" \
      "$dir/bwd.moebin" --inputs "$dir/inproc" --outputs "$dir/mpi" --verify --threads 1 \
      --timeout 30 --repeat 2; then
    cat "$dir/mpi.log"
    echo "FAILED: $name (mpirun -np $ep)"
    failed=$((failed + 1))
    return
  fi
  grep -q "verify: passed" "$dir/mpi.log" || { cat "$dir/mpi.log"; echo "FAILED: $name: no verify line"; failed=$((failed + 1)); return; }
  grep -q "$ep MPI processes" "$dir/mpi.log" || { echo "FAILED: $name: not $ep processes"; failed=$((failed + 1)); return; }
  for out in ${OUTPUTS:-y dx dtopk_weights dw1 dw2}; do
    if ! cmp -s "$dir/inproc/$out.npy" "$dir/mpi/$out.npy"; then
      echo "FAILED: $name: $out differs from the in-process run"
      failed=$((failed + 1))
      return
    fi
  done
  echo "ok: $name (mpirun -np $ep)"
  passed=$((passed + 1))
}

# Fault tests: ok NAME, bad NAME [LOG] count into $passed and $failed;
# expect NAME LOG PATTERN OUTDIR: the job failed (checked by the caller),
# LOG has PATTERN, OUTDIR holds no output.
ok() { echo "ok: $1"; passed=$((passed + 1)); }
bad() { echo "FAILED: $1"; [ -f "${2:-}" ] && cat "$2"; failed=$((failed + 1)); }
expect() {
  local name=$1 log=$2 pattern=$3 out=$4
  if ! grep -qE "$pattern" "$log"; then bad "$name: no line matches '$pattern'" "$log"; return; fi
  if ls "$out"/*.npy > /dev/null 2>&1; then bad "$name: outputs were written" "$log"; return; fi
  ok "$name"
}
# expect_all NAME LOG OUT PATTERN...: every PATTERN matches a line of LOG,
# and OUT holds no output.
expect_all() {
  local name=$1 log=$2 out=$3 pattern
  shift 3
  for pattern in "$@"; do
    if ! grep -qE -- "$pattern" "$log"; then bad "$name: no line matches '$pattern'" "$log"; return; fi
  done
  if ls "$out"/*.npy > /dev/null 2>&1; then bad "$name: outputs were written" "$log"; return; fi
  ok "$name"
}
# check_trace NAME EP: a job of EP processes with --trace writes one trace
# per pass for the whole job (no file per rank), which passes
# check_trace.py (every task of every rank once, every arrow joins two
# existing slices) and has arrows from one process to another. Counts into
# $passed and $failed.
check_trace() {
  local name=$1 ep=$2 dir="$WORK/$1" pass
  local check="$(realpath "${CHECK_TRACE:?set CHECK_TRACE to check_trace.py}")"
  rm -f "$dir"/trace*.json
  if ! "${MPIRUN[@]}" -np "$ep" "$MOEC" run "$dir/fwd.moebin" "$dir/bwd.moebin" --random 3 \
      --outputs "$dir/traced" --threads 1 --timeout 30 --trace "$dir/trace.json" \
      > "$dir/trace.log" 2>&1; then
    bad "$name: trace (mpirun -np $ep): the job failed" "$dir/trace.log"
    return
  fi
  if [ "$(ls "$dir" | grep -c '^trace.*\.json$')" -ne 2 ]; then
    bad "$name: trace (mpirun -np $ep): not one file per pass: $(ls "$dir" | grep trace)"
    return
  fi
  for pass in fwd bwd; do
    "$MOEC" dump "$dir/$pass.moebin" --json > "$dir/$pass.dump.json"
  done
  if ! python3 "$check" "$dir/trace.json" "$dir/fwd.dump.json" --source measured --phases \
      > "$dir/check.log" 2>&1 ||
     ! python3 "$check" "$dir/trace.bwd.json" "$dir/bwd.dump.json" --source measured --phases \
      >> "$dir/check.log" 2>&1; then
    bad "$name: trace (mpirun -np $ep): check_trace.py" "$dir/check.log"
    return
  fi
  # Every rank has slices in each pass's trace, and some arrow crosses
  # processes in one of the two: an arrow is a wait a signal ended, and
  # whether a core waits on a peer at all depends on timing, so a single
  # pass may have none (a forward of 3 processes on 2 cores had 18 arrows,
  # all within a process; its backward had 6 of 26 across).
  if ! python3 - "$ep" "$dir/trace.json" "$dir/trace.bwd.json" << 'PY' >> "$dir/check.log" 2>&1; then
import json, sys
crossing = 0
for path in sys.argv[2:]:
    events = json.load(open(path))["traceEvents"]
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert pids == set(range(int(sys.argv[1]))), f"{path}: slices of ranks {sorted(pids)}"
    ends = {}
    for e in events:
        if e.get("ph") in ("s", "f"):
            ends.setdefault(e["id"], set()).add(e["pid"])
    crossing += sum(1 for p in ends.values() if len(p) > 1)
assert crossing > 0, "no arrow from one process to another in either pass"
print(f"{crossing} arrows cross processes")
PY
    bad "$name: trace (mpirun -np $ep): ranks or arrows" "$dir/check.log"
    return
  fi
  ok "$name: one trace of mpirun -np $ep ($(tail -1 "$dir/check.log"))"
}

# The lines of the report of a stopped job that rank 0 prints, for a put
# that rank 1 dropped (MOEC_TEST_DROP_PUT=1:N): rank 0 waits for the
# dispatch event whose signal rank 1 did not send (its watchdog fires, or
# rank 1's stop ends the wait first), and rank 1's rows are short; rank 1
# waits for rank 0's combine signals to its terminate event (counted per
# task: tasks share signal records).
DROPPED_PUT_REPORT=(
  "^report of the 2 ranks, gathered on rank 0:"
  "^  \[rank 0\] .*waits for event [0-9]+ 'dispatch\[[0-9.]+\]' \(value [0-9]+, needs [0-9]+; signalled by rank 1 \([0-9]+ of [0-9]+ arrived, 1 missing\)\)"
  "^  \[rank 0\] .*Bytes of rows in this pass: arrived from rank 1 [0-9]+ of [0-9]+ \(short\)"
  "^  \[rank 1\] .*Signals from other processes missing: rank 1 event [0-9]+ 'terminate' is at [0-9]+ of [0-9]+; signalled by rank 0 \([0-9]+ of [0-9]+ arrived, [0-9]+ missing\)"
)
