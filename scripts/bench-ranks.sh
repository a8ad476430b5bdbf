#!/usr/bin/env bash
# The shipped graphs (automatic splits) on the CPU runtime, in-process ranks
# 1, 2, 4 and 8 at equal work per rank (every rank sends S tokens to one expert each and
# receives S rows on average), with 1 and with 4 experts per rank: the
# measured pass (the task program's wall time, best of REPEAT after a
# warm-up) against the timed simulation of the binary with PROFILE (a
# calibrated cpu profile: `moec bench --calibrate -o PROFILE`).
#
#   scripts/bench-ranks.sh PROFILE [THREADS] [REPEAT]
#
# The ranks share this machine's THREADS worker threads (default 2), so a
# pass of R ranks does R ranks' work: the table also gives the time per
# rank's work (measured / R).
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
profile="${1:?usage: scripts/bench-ranks.sh PROFILE [THREADS] [REPEAT]}"
threads="${2:-2}"
repeat="${3:-3}"
bazel build //tools:moec >/dev/null 2>&1 || bazel build //tools:moec
moec="$PWD/bazel-bin/tools/moec"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "H 1024, I 512, top-1, S 1024 a rank, fp32; $threads worker threads; profile $profile"
printf '%-7s %-5s %-4s %12s %14s %13s %7s\n' experts pass ranks "measured ms" "per rank's ms" "simulated ms" error
for L in 1 4; do
  for R in 1 2 4 8; do
    printf '{"name":"ranks","hidden_size":1024,"intermediate_size":512,"num_experts":%d,"top_k":1,"ep":%d,"tp":1,"seq_size":1024,"dtype":"fp32"}\n' \
      $((L * R)) "$R" > "$work/config.json"
    for g in fwd bwd; do
      "$moec" compile "graphs/moe_ffn_$g.json" --config "$work/config.json" --target "$profile" \
        -o "$work/$g.moebin" --no-progress 2> /dev/null
    done
    rm -rf "$work/out"
    "$moec" run "$work/fwd.moebin" "$work/bwd.moebin" --ranks "$R" --random 1 --outputs "$work/out" \
      --threads "$threads" --repeat "$repeat" --no-progress > "$work/run.txt" 2>&1
    for pass in forward backward; do
      g=$([ "$pass" = forward ] && echo fwd || echo bwd)
      measured=$(awk -v p="$pass" '$1 == p { for (i = 1; i <= NF; ++i) if ($i == "tasks") print $(i + 1) }' "$work/run.txt")
      simulated=$("$moec" dump "$work/$g.moebin" --target "$profile" --json | python3 -c \
        'import json,sys; print(json.load(sys.stdin)["statistics"]["makespan"] * 1e3)')
      awk -v L="$L" -v p="$pass" -v R="$R" -v m="$measured" -v s="$simulated" 'BEGIN {
        printf "%-7s %-5s %-4s %12.2f %14.2f %13.2f %+6.0f%%\n", L, substr(p, 1, 3), R, m, m / R, s, 100 * (s - m) / m }'
    done
  done
done
