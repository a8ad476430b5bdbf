#!/usr/bin/env bash
# The measured trace (moec run --trace) and the simulated trace (moec dump
# --trace) of the same binaries: both pass check_trace.py (schema, every
# task of every rank once, waits that name their event and end before their
# task, flow arrows whose two ends lie in task slices), and the measured one
# has the prepare/tasks/finish phases. --profile prints each pass's ops with
# their work, the workers and the waits.
set -euo pipefail
moec="$PWD/$MOEC"
check="$(cd "$(dirname "$0")" && pwd)/check_trace.py"
graphs="$PWD/graphs"
cd "${TEST_TMPDIR:-$(mktemp -d)}"
cat > tiny.json <<'CFG'
{"name": "tiny", "hidden_size": 64, "intermediate_size": 32, "num_experts": 4, "top_k": 2,
 "ep": 2, "tp": 1, "seq_size": 128, "dtype": "fp32", "num_cube_cores": 2, "num_vector_cores": 4}
CFG
for pass in fwd bwd; do
  "$moec" compile "$graphs/moe_ffn_$pass.json" --config tiny.json -o $pass.bin 2>/dev/null
  "$moec" dump $pass.bin --json > $pass.dump.json
  "$moec" dump $pass.bin --trace -o $pass.sim.json
  python3 "$check" $pass.sim.json $pass.dump.json --source simulated
done
"$moec" run fwd.bin bwd.bin --ranks 2 --random 3 --outputs out --repeat 2 --trace run.json > /dev/null
python3 "$check" run.json fwd.dump.json --source measured --phases
python3 "$check" run.bwd.json bwd.dump.json --source measured --phases
# Op by op, each op runs as a program of its own: the trace still names the
# whole program's tasks.
"$moec" run fwd.bin bwd.bin --ranks 2 --random 3 --outputs out2 --op-by-op --trace obo.json > /dev/null
python3 "$check" obo.json fwd.dump.json --source measured --phases
python3 "$check" obo.bwd.json bwd.dump.json --source measured --phases
# A trace of the simulation needs a profile, and a file to go to.
if "$moec" dump fwd.bin --trace 2> err.txt; then echo "dump --trace without -o passed"; exit 1; fi
grep -q -- "--trace writes a file" err.txt
# The checker itself fails on a broken arrow.
python3 - run.json broken.json <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
flows = [e for e in t["traceEvents"] if e["ph"] == "f"]
assert flows, "no arrows in the measured trace"
t["traceEvents"].remove(flows[0])
json.dump(t, open(sys.argv[2], "w"))
PY
if python3 "$check" broken.json fwd.dump.json > broken.txt; then echo "a broken arrow passed"; exit 1; fi
grep -q "has ends" broken.txt
# --profile: every op of each pass with its work counted on the routed rows
# (tiny: R 2, S 128, K 2, H 64, I 32: 512 rows; up_proj 2 * 512 * 64 * 64
# FLOP, down_proj 2 * 512 * 32 * 64), the workers, the slow runs and the
# waits.
"$moec" run fwd.bin bwd.bin --ranks 2 --random 3 --outputs out3 --threads 2 --profile > profile.txt
for pattern in "^profile of the last forward pass: .*prepare .*tasks .*finish" \
    "^  up_proj +gmm +[0-9]+ +[0-9.]+ +[0-9.]+% +4\.19 MFLOP +[0-9.]+ GFLOP/s +[0-9]+%" \
    "^  down_proj +gmm +[0-9]+ +[0-9.]+ +[0-9.]+% +2\.10 MFLOP" \
    "^  dispatch +dispatch +[0-9]+ .* GB/s" "^  swiglu +swiglu " "^  combine +combine " \
    "^profile of the last backward pass" "^  swiglu_grad +swiglu_grad " \
    "^  worker 1 +busy +[0-9.]+ ms, idle +[0-9.]+ ms, off its core in runs +[0-9.]+ ms$" \
    "^  of that busy time [0-9.]+ ms \([0-9.]+%\) off the cores" \
    "^task runs that took 3x or more their op's median time for their work \([0-9]+ in all" \
    "^waits of parked cores, by event"; do
  grep -qE "$pattern" profile.txt || { cat profile.txt; echo "no line matches '$pattern'"; exit 1; }
done
# --workspace: each pass's tensors; backward's send rows live in a dead
# forward slot; the totals line of the report agrees with the table's.
"$moec" run fwd.bin bwd.bin --ranks 2 --random 3 --outputs out5 --threads 2 --workspace > ws.txt
for pattern in "^  workspace [0-9.]+ MiB allocated, [0-9.]+ MiB resident; kernel scratch" \
    "^workspace of this process \(2 ranks\): [0-9.]+ MiB allocated" \
    "^  forward +target +[0-9.]+ +[0-9.]+ +window" "^  forward +up_proj_y +[0-9.]+ +[0-9.]+ +plain" \
    "^  backward +src +[0-9.]+ +- +in a dead forward slot" \
    "^  backward +\(layout\) +[0-9.]+ +[0-9.]+ +7 routing layout tensors"; do
  grep -qE "$pattern" ws.txt || { cat ws.txt; echo "no line matches '$pattern'"; exit 1; }
done
# The table's rows with memory of their own add up to the total allocated
# (each row is rounded to 0.1 MiB, hence the tolerance).
total=$(sed -nE 's/^  workspace ([0-9.]+) MiB allocated.*/\1/p' ws.txt)
awk -v total="$total" '
  /^  (forward|backward) / && $4 != "-" { sum += $3; rows++ }
  END { d = sum - total; if (d < 0) d = -d; exit !(rows > 0 && d <= 0.05 * rows + 0.05) }' ws.txt ||
  { cat ws.txt; echo "the table's rows do not add up to the total ${total} MiB"; exit 1; }
if "$moec" run fwd.bin --ranks 2 --random 3 --outputs out4 --profile --backend cuda 2> err.txt; then
  echo "--profile on the cuda backend passed"; exit 1
fi
grep -q -- "--trace and --profile run on the cpu backend only" err.txt
echo "trace test passed"
