#!/usr/bin/env bash
# Two builds of moec side by side: runs one command on each in turn, the
# rounds alternating (A B, B A, A B, ...), and prints every number of its
# output that moved as B over A, the median of the rounds' ratios and their
# range: a change's speed told apart from a noisy machine's.
#
#   bash scripts/ab.sh save DIR [--from FOLDER]   keep the built binaries in DIR
#   bash scripts/ab.sh [--rounds N] [--env-a NAME=VALUE] [--env-b NAME=VALUE]
#       A B -- COMMAND [ARG...]
#
# `save` copies moec, the benchmarks (tools/bench), moec_torch.so and
# libmoec.so from FOLDER (default: this checkout's bazel-bin) into DIR, laid
# out as in bazel-bin, so that a build can be kept before the next change.
# A and B are such folders (or bazel-bin itself). In COMMAND, {bin} stands
# for the side's folder, and MOEC_BIN, MOEC_TORCH_LIB and MOEC_LIB name its
# moec, moec_torch.so and libmoec.so (what examples/torch/bench.py and the
# torch op load). N rounds (default 4) run COMMAND 2N times; a run that
# fails stops it all, naming the side and round, exit 1. --env-a and
# --env-b (each as often as needed) set a variable in the environment of
# that side's runs only: two settings of one build compared the same way,
# A and B then the same folder (for example --env-b MOEC_GEMM=moec).
#
# The output's lines are matched across the runs by their text with the
# numbers taken out and runs of spaces made one (the k-th such line of each
# run; a table's columns padded to other widths still match); a number that
# is the same in every run is left as it is, and the count of lines not in
# every run (a list whose entries differ) is said at the end. For example,
# the qwen3 tiles of the build saved before a change against bazel-bin's,
# three rounds:
#
#   bash scripts/ab.sh save /tmp/before      # (before the change)
#   bash scripts/ab.sh --rounds 3 /tmp/before bazel-bin -- \
#       {bin}/tools/bench/gmm_bench --layer 32 3 2
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
usage() {
  echo "usage: bash scripts/ab.sh save DIR [--from FOLDER]" >&2
  echo "       bash scripts/ab.sh [--rounds N] [--env-a NAME=VALUE] [--env-b NAME=VALUE] A B -- COMMAND [ARG...]" >&2
  exit 2
}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
files=(tools/moec tools/bench/gmm_bench tools/bench/exec_bench tools/bench/fabric_bench
  ops/torch/moec_torch.so compiler/api/libmoec.so)

if [ "${1:-}" = save ]; then
  [ $# -eq 2 ] || [ $# -eq 4 ] || usage
  dir="$2" from="$here/bazel-bin"
  if [ $# -eq 4 ]; then
    [ "$3" = --from ] || usage
    from="$4"
  fi
  [ -d "$from" ] || { echo "ab.sh: $from is not a folder (build first)" >&2; exit 1; }
  saved=0
  for f in "${files[@]}"; do
    [ -f "$from/$f" ] || continue
    mkdir -p "$dir/$(dirname "$f")"
    cp -L "$from/$f" "$dir/$f"
    saved=$((saved + 1))
  done
  [ $saved -gt 0 ] || { echo "ab.sh: none of ${files[*]} is in $from (build first)" >&2; exit 1; }
  echo "ab.sh: saved $saved files of $from in $dir"
  exit 0
fi

rounds=4
envA=() envB=()
while [ $# -ge 1 ]; do
  case "$1" in
    --rounds) [ $# -ge 2 ] || usage; rounds="$2"; shift 2 ;;
    --env-a | --env-b)
      [ $# -ge 2 ] || usage
      [[ "$2" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
        { echo "ab.sh: $1 takes NAME=VALUE, not '$2'" >&2; exit 2; }
      if [ "$1" = --env-a ]; then envA+=("$2"); else envB+=("$2"); fi
      shift 2 ;;
    *) break ;;
  esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ab.sh: --rounds takes a whole number of 1 or more, not '$rounds'" >&2; exit 2; }
[ $# -ge 4 ] && [ "$3" = -- ] || usage
a="$1" b="$2"
shift 3
for side in "$a" "$b"; do
  [ -d "$side" ] || { echo "ab.sh: $side is not a folder" >&2; exit 1; }
done
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

run() { # run SIDE-NAME FOLDER ROUND
  local name="$1" dir
  dir="$(cd "$2" && pwd)"
  local argv=() vars=()
  for arg in "${command[@]}"; do argv+=("${arg//\{bin\}/$dir}"); done
  if [ "$name" = A ]; then vars=(${envA[@]+"${envA[@]}"}); else vars=(${envB[@]+"${envB[@]}"}); fi
  if ! env MOEC_BIN="$dir/tools/moec" MOEC_TORCH_LIB="$dir/ops/torch/moec_torch.so" \
    MOEC_LIB="$dir/compiler/api/libmoec.so" ${vars[@]+"${vars[@]}"} "${argv[@]}" \
    > "$out/$name.$3" 2>&1; then
    echo "ab.sh: side $name ($2), round $3: the command failed; its output ends:" >&2
    tail -5 "$out/$name.$3" >&2
    exit 1
  fi
}
command=("$@")
for ((r = 1; r <= rounds; r++)); do
  if [ $((r % 2)) -eq 1 ]; then
    run A "$a" "$r"; run B "$b" "$r"
  else
    run B "$b" "$r"; run A "$a" "$r"
  fi
  echo "ab.sh: round $r of $rounds done" >&2
done

side() { # side FOLDER VAR...: the folder, and its variables where it has any
  local folder="$1"
  shift
  if [ $# -gt 0 ]; then echo "$folder with $*"; else echo "$folder"; fi
}
python3 - "$out" "$rounds" "$(side "$a" ${envA[@]+"${envA[@]}"})" \
  "$(side "$b" ${envB[@]+"${envB[@]}"})" <<'PY'
import re, statistics, sys
out, rounds, a, b = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
number = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")

def lines(path):
    """The run's lines with numbers, keyed by (shape, k-th of that shape)."""
    seen, keyed = {}, {}
    for line in open(path, errors="replace").read().splitlines():
        values = number.findall(line)
        if not values:
            continue
        # (Spaces collapsed: a table pads its columns to the numbers'
        # widths, which differ from run to run.)
        shape = " ".join(number.sub("#", line).split())
        k = seen.get(shape, 0)
        seen[shape] = k + 1
        keyed[(shape, k)] = (line, [float(v) for v in values])
    return keyed

runs = {side: [lines(f"{out}/{side}.{r}") for r in range(1, rounds + 1)] for side in "AB"}
first = runs["A"][0]
print(f"ab.sh: {rounds} rounds, A = {a}, B = {b}, alternating; each number that moved: "
      "A's median, then B/A as the median of the rounds' ratios [lowest, highest]")
shown = missing = 0
for key, (line, _) in first.items():
    if not all(key in run for side in "AB" for run in runs[side]):
        missing += 1
        continue
    columns = list(zip(*(run[key][1] for side in "AB" for run in runs[side])))
    notes = []
    for i, column in enumerate(columns):
        if len(set(column)) == 1:
            continue
        av = [runs["A"][r][key][1][i] for r in range(rounds)]
        bv = [runs["B"][r][key][1][i] for r in range(rounds)]
        if any(x == 0 for x in av):
            continue
        ratios = [y / x for x, y in zip(av, bv)]
        notes.append(f"{statistics.median(av):.4g}: {statistics.median(ratios):.3f} "
                     f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    if notes:
        print(line)
        print("    " + "   ".join(notes))
        shown += 1
if shown == 0:
    print("(no number of the output moved between the runs)")
if missing:
    print(f"({missing} line{'s' if missing > 1 else ''} of A's first run with numbers "
          "not in every run, left out)")
PY
