#!/usr/bin/env bash
# Checks scripts/ab.sh on two made-up builds whose "benchmark" prints a rate
# (100 on A, 110 on B, 1% up and down by round) and a size the same on both:
# the rounds alternate A B, B A; B/A is 1.100 with its range; the size is
# left as it is; a table row padded differently by run still matches, and a
# line not in every run is counted; {bin} and MOEC_BIN name each side's
# folder; --env-a and --env-b reach only their side's runs; `save` keeps a
# build's files; a failing run, a missing `--`, a bad --rounds and a bad or
# missing --env-a/-b value are errors.
#
#   scripts/ab_test.sh AB_SH
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
[ $# -eq 1 ] || { echo "usage: scripts/ab_test.sh AB_SH" >&2; exit 2; }
ab="$(realpath "$1")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*"; exit 1; }

# Two builds: tools/bench/fake prints its side's rate, nudged by a counter
# of its runs, and the order of the runs.
for side in A B; do
  mkdir -p "build$side/tools/bench" "build$side/tools"
  rate=$([ $side = A ] && echo 100 || echo 110)
  cat > "build$side/tools/bench/fake" <<EOF
#!/usr/bin/env bash
n=\$(cat "$work/count.$side" 2>/dev/null || echo 0); echo \$((n + 1)) > "$work/count.$side"
echo $side >> "$work/order"
# 1% more on odd runs of each side: a ratio range, the same median.
awk -v r=$rate -v n=\$n 'BEGIN { printf "tile 128 x 1536: %.1f GFLOP/s\n", r * (n % 2 ? 1.01 : 1) }'
echo "\$MOEC_BIN" > "$work/bin.$side"
echo "knob \${KNOB:-1} \${OTHER:-5}"
# A table's row, its columns padded to the numbers' widths: 9.5 on odd
# runs, 10.5 on even ones (B/A 1.000, whatever the padding).
awk -v n=\$n 'BEGIN { printf "  %-8s %8.1f ms\n", "lora_b", n % 2 ? 9.5 : 10.5 }'
# A line only even runs print (the first of each side's among them): not
# in every run, left out and counted.
[ \$((n % 2)) -eq 1 ] || echo "stalled 3 ms"
EOF
  chmod +x "build$side/tools/bench/fake"
  echo "$side" > "build$side/tools/moec"
done

"$ab" --rounds 2 buildA buildB -- {bin}/tools/bench/fake > out.txt 2> err.txt || fail "ab.sh failed: $(cat err.txt)"
[ "$(tr '\n' ' ' < order)" = "A B B A " ] || fail "the runs went $(tr '\n' ' ' < order), not A B B A"
grep -q "^tile 128 x 1536: " out.txt || fail "the tile line is missing: $(cat out.txt)"
# A's runs 100, 101 (median 100.5); B's 110, 111.1; B/A 1.100 both rounds.
grep -qE "^    100\.5: 1\.100 \[1\.100, 1\.100\]$" out.txt || fail "no B/A 1.100 for the rate: $(cat out.txt)"
grep -q "128: " out.txt && fail "a number the same in every run got a ratio: $(cat out.txt)"
# The padded row matched across the runs although its spaces differ.
grep -qE "^    10: 1\.000 \[1\.000, 1\.000\]$" out.txt || fail "the padded row was not matched: $(cat out.txt)"
grep -q "^(1 line of A's first run with numbers not in every run, left out)$" out.txt ||
  fail "the line not in every run was not counted: $(cat out.txt)"
grep -q "round 2 of 2 done" err.txt || fail "no progress on stderr: $(cat err.txt)"
# {bin} and MOEC_BIN were each side's folder.
for side in A B; do
  [ "$(cat "bin.$side")" = "$work/build$side/tools/moec" ] ||
    fail "side $side's MOEC_BIN was $(cat "bin.$side")"
done

# --env-a / --env-b: one build, a variable set on one side only (KNOB 2 on
# B: 2.000), two on the other (OTHER 10 on A: B/A 0.5); the header names
# them.
rm -f order
"$ab" --rounds 2 --env-b KNOB=2 --env-a OTHER=10 --env-a UNUSED=x buildA buildA -- \
    {bin}/tools/bench/fake > env.txt 2> err.txt || fail "ab.sh with --env-b failed: $(cat err.txt)"
grep -qE "^    1: 2\.000 \[2\.000, 2\.000\]   10: 0\.500 \[0\.500, 0\.500\]$" env.txt ||
  fail "--env-a/--env-b did not reach their sides: $(cat env.txt)"
grep -q "A = buildA with OTHER=10 UNUSED=x, B = buildA with KNOB=2," env.txt ||
  fail "the header does not name the variables: $(head -1 env.txt)"
"$ab" --env-b 2 buildA buildB -- true > /dev/null 2> err.txt
[ $? -eq 2 ] && grep -q "takes NAME=VALUE, not '2'" err.txt || fail "--env-b 2 was taken: $(cat err.txt)"
"$ab" --env-a > /dev/null 2> err.txt
[ $? -eq 2 ] && grep -q "^usage:" err.txt || fail "--env-a without a value was not a usage error"

# save: the build's files under the same paths.
"$ab" save kept --from buildB > save.txt || fail "save failed"
[ "$(cat kept/tools/moec)" = B ] || fail "save did not keep tools/moec"
[ -x kept/tools/bench/fake ] && fail "save kept a file it does not know"
"$ab" save kept2 --from nothing-here 2> err.txt && fail "save from a missing folder passed"
grep -q "nothing-here is not a folder" err.txt || fail "save's error: $(cat err.txt)"
mkdir empty
"$ab" save kept3 --from empty 2> err.txt && fail "save from a folder with no build passed"
grep -q "none of .* is in empty (build first)" err.txt || fail "save's error for no build: $(cat err.txt)"
[ -e kept3 ] && fail "save made its folder with nothing to keep"

# Errors: a run that fails names its side and round; bad usage exits 2.
printf '#!/bin/sh\necho broken; exit 3\n' > buildB/tools/bench/fake
"$ab" --rounds 1 buildA buildB -- {bin}/tools/bench/fake > /dev/null 2> err.txt && fail "a failing run passed"
grep -q "side B (buildB), round 1: the command failed" err.txt || fail "the failure's message: $(cat err.txt)"
"$ab" buildA buildB {bin}/tools/bench/fake > /dev/null 2> err.txt
[ $? -eq 2 ] && grep -q "^usage:" err.txt || fail "a missing -- was not a usage error"
"$ab" --rounds 0 buildA buildB -- true > /dev/null 2> err.txt
[ $? -eq 2 ] && grep -q "whole number of 1 or more" err.txt || fail "--rounds 0 was taken: $(cat err.txt)"
echo "ab.sh: ok"
