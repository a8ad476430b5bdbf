#!/usr/bin/env bash
# What ptxas gives the cuda backend's two kernels built for sm_90a (the
# wgmma path): registers a thread, spilled bytes and stack, for the
# persistent kernel (Device.cu, which runs every task) and cuda_bench's GMM
# kernel (GemmBench.cu, the tile alone):
#
#   tests/cuda/registers.sh [--base REV]     (from the repository root)
#
# With --base REV, REV's figures first (built in a temporary git worktree),
# then this tree's. Needs nvcc (MOEC_CUDA_HOME or /usr/local/cuda), no GPU:
# a change to the tiles can be checked for spills here before a GPU
# machine's time is spent on it. The two files build side by side (about a
# minute and a half each on two cores).
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
usage="usage: tests/cuda/registers.sh [--base REV]"
# shellcheck source=tests/cuda/base_option.sh
source "$(dirname "${BASH_SOURCE[0]}")/base_option.sh"
base_option registers "$usage" "$@"
nvcc="${MOEC_CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
[ -x "$nvcc" ] || { echo "registers: no nvcc at $nvcc (set MOEC_CUDA_HOME)" >&2; exit 1; }
work="$(mktemp -d)"
cleanup() {
  [ -d "$work/src" ] && git worktree remove --force "$work/src" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

# report ROOT LABEL: both kernels of the tree at ROOT.
report() {
  local root="$1" label="$2" f
  for f in Device GemmBench; do
    (cd "$root" && "$nvcc" -std=c++17 -O3 -I. -Xptxas -v -gencode arch=compute_90a,code=sm_90a \
      -c "runtime/cuda/$f.cu" -o "$work/$label.$f.o" > "$work/$label.$f.log" 2>&1) &
  done
  wait || true
  for f in Device GemmBench; do
    local kernel=persistentKernel
    [ $f = GemmBench ] && kernel=benchKernel
    if ! grep -q "Compiling entry function '.*$kernel" "$work/$label.$f.log"; then
      echo "registers: runtime/cuda/$f.cu did not build ($label):" >&2
      grep -E "error" "$work/$label.$f.log" | head -5 >&2
      return 1
    fi
    # The lines after the entry's: its properties (stack, spills), then its registers.
    awk -v k="$kernel" -v label="$label" '
      index($0, "Compiling entry function") && index($0, k) { on = 1; next }
      on && /spill stores/ { stack = $1; stores = $5; loads = $9 }
      on && /Used [0-9]+ registers/ {
        for (i = 1; i <= NF; ++i) if ($i == "Used") regs = $(i + 1)
        printf "%-10s %-17s %3d registers, %5d bytes spill stores, %5d spill loads, %5d stack\n",
               label, k, regs, stores, loads, stack
        exit
      }' "$work/$label.$f.log"
  done
}

if [ -n "$base" ]; then
  git worktree add --detach -q "$work/src" "$base"
  report "$work/src" "$(git rev-parse --short "$base")"
fi
report "$(pwd)" "this tree"
