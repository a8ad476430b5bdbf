#!/usr/bin/env bash
# Packs what the cuda backend's checks need on a GPU machine without Debian's
# packages (no moec compiler there), into one folder:
#
#   tests/cuda/pack_for_gpu.sh DIR [--base REV]   (from the repository root, where moec builds)
#
# DIR gets the GPU suite, its probe and cuda_bench (built here with the CUDA
# toolkit; without it they would be stubs, so the script stops), the
# suite's layers compiled as the GPU runs them (the binary cache),
# examples/cuda/compile_binaries.sh's binaries, the shared
# libraries those programs link beyond the C/C++ runtime (xz-compressed),
# and DIR/run.sh. On the GPU machine, from a checkout of the same commit:
#
#   bash DIR/run.sh [suite] [bench] [pack] [lora]   (default: suite and bench)
#
# runs the conformance suite's [gpu] cases and examples/cuda/bench.sh
# --moec-only on the packed programs and binaries (its PyTorch side left
# out): the tiles, the full layer at S 1024 and 4096, the frozen layer with
# bf16, FP8, int8 and int4 weights, each layer checked against the
# reference on 16 sampled tokens. `lora` times the frozen + LoRA step
# (rank 16 on w1 and w2) on each base, bf16, FP8, int8 and int4, beside the
# frozen step on the same base, with the packed-weight store (two rounds,
# checked the same way).
#
# With --base REV, DIR/base/cuda_bench is REV's (built in a temporary git
# worktree), and `bash DIR/run.sh ab` times REV's against this tree's side
# by side: the frozen formats' tiles on qwen3's products (three rounds) and
# the frozen qwen3 layer with bf16, FP8, int8 and int4 weights (two
# rounds), the two programs alternating, every run checked as bench.sh
# checks it.
case "${1:-}" in -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
usage="usage: tests/cuda/pack_for_gpu.sh DIR [--base REV]"
out="${1:?$usage}"
# shellcheck source=tests/cuda/base_option.sh
source "$(dirname "${BASH_SOURCE[0]}")/base_option.sh"
base_option pack_for_gpu "$usage" "${@:2}"
[ -x /usr/local/cuda/bin/nvcc ] || {
  echo "pack_for_gpu: no CUDA toolkit at /usr/local/cuda: the programs would be stubs" >&2
  exit 1
}
mkdir -p "$out/cache" "$out/bins"
out="$(cd "$out" && pwd)"
bazel build //tools:moec //tests/cuda:gpu_suite //tests/cuda:gpu_probe //examples/cuda:cuda_bench
for p in tests/cuda/gpu_suite tests/cuda/gpu_probe examples/cuda/cuda_bench; do
  install -m 755 "bazel-bin/$p" "$out/"
done

# The baseline's cuda_bench, built where REV is checked out.
if [ -n "$base" ]; then
  tree="$(mktemp -d)"
  git worktree add --detach -q "$tree/src" "$base"
  mkdir -p "$out/base"
  (cd "$tree/src" && bazel build //examples/cuda:cuda_bench &&
    install -m 755 bazel-bin/examples/cuda/cuda_bench "$out/base/cuda_bench")
  (cd "$tree/src" && bazel clean --expunge 2>/dev/null)
  git worktree remove --force "$tree/src"
  rm -rf "$tree"
fi

# The suite's layers, compiled as the GPU runs them (--peer-groups 1): the
# suite passes on the CPU while it fills the cache. Its scratch files go
# under TEST_TMPDIR (else /tmp, where they would stay).
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
TEST_TMPDIR="$scratch" MOEC_TEST_COMPILE_FOR=cuda MOEC_BINARY_CACHE="$out/cache" \
  MOEC=bazel-bin/tools/moec "$out/gpu_suite" "[gpu]" | tail -2

# bench.sh's binaries.
bash examples/cuda/compile_binaries.sh "$out/bins"

# The libraries beyond libc, libm, libstdc++ and libgcc.
libs="$(mktemp -d)"
trap 'rm -rf "$scratch" "$libs"' EXIT
mkdir "$libs/lib"
ldd "$out/gpu_suite" "$out/cuda_bench" ${base:+"$out/base/cuda_bench"} | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt)\.so' |
  while read -r lib; do cp -L "$lib" "$libs/lib/"; done
tar -C "$libs" -cJf "$out/lib.tar.xz" lib

cat >"$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# The cuda backend's checks on this GPU (made by tests/cuda/pack_for_gpu.sh):
#   bash run.sh [suite] [bench] [pack] [lora] [ab]   from a checkout of the same commit
# (default: suite and bench; pack: the frozen layers without and with the
# packed-weight store; lora: the frozen + LoRA step beside the frozen one,
# per base format; ab: the --base build against this one)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
parts="${*:-suite bench}"
# The layers are .moebin files, which git ignores: a copy of DIR made by
# way of a checkout's untracked files arrives without them.
for d in cache bins; do
  if ! compgen -G "$here/$d/*.moebin" >/dev/null; then
    echo "run.sh: $here/$d has no .moebin files: copy the packed folder whole (git ignores *.moebin)" >&2
    exit 2
  fi
done
mkdir -p /tmp/moec-gpu && tar -C /tmp/moec-gpu -xJf "$here/lib.tar.xz"
# The suite's scratch files (under /tmp without TEST_TMPDIR, left there).
export TEST_TMPDIR="${TEST_TMPDIR:-$(mktemp -d)}"
export LD_LIBRARY_PATH="/tmp/moec-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
if [[ " $parts " == *" suite "* ]]; then
  echo "== the conformance suite's [gpu] cases"
  MOEC_BINARY_CACHE="$here/cache" bash tests/cuda/run_gpu.sh "$here/gpu_probe" "$here/gpu_suite" |
    grep -E -A4 "^(cuda_backend_test|test cases|All tests passed)|FAILED" || rc=1
fi
if [[ " $parts " == *" bench "* ]]; then
  bash examples/cuda/bench.sh --moec-only "$here/cuda_bench" "$here/bins" || rc=1
fi
if [[ " $parts " == *" pack "* ]]; then
  # The frozen layer's quantized weights decoded each pass against kept
  # decoded (the packed-weight store), each pair both ways, two rounds.
  for round in 1 2; do
    echo "== the frozen layer (bf16, FP8, int8, int4 weights), without and with --pack-weights, round $round"
    for f in "" _fp8 _int8 _int4; do
      "$here/cuda_bench" layer "$here/bins/frozen$f.fwd.moebin" "$here/bins/frozen$f.bwd.moebin" \
        --repeat 5 --sample 16 --pack-weights both |
        grep -E "^layer:|median|around|packed weights|verify" || rc=1
    done
  done
fi
if [[ " $parts " == *" lora "* ]]; then
  # The fine-tuning step: LoRA r 16 on each base format beside the frozen
  # layer on it, one process a round (the random layer made once).
  for round in 1 2; do
    echo "== frozen and frozen + LoRA r 16 (bf16, FP8, int8, int4 bases), --pack-weights on, round $round"
    pairs=()
    for f in "" _fp8 _int8 _int4; do
      pairs+=("$here/bins/frozen$f.fwd.moebin" "$here/bins/frozen$f.bwd.moebin"
        "$here/bins/lora$f.fwd.moebin" "$here/bins/lora$f.bwd.moebin")
    done
    "$here/cuda_bench" layer "${pairs[@]}" --repeat 5 --sample 16 --pack-weights on |
      grep -E "^layer:|median|around|packed weights|verify" || rc=1
  done
fi
if [[ " $parts " == *" ab "* ]]; then
  if [ ! -x "$here/base/cuda_bench" ]; then
    echo "run.sh ab: no $here/base/cuda_bench (pack with --base REV)" >&2
    exit 2
  fi
  if ! gpu="$("$here/gpu_probe")"; then
    echo "run.sh ab: $gpu" >&2
    exit 1
  fi
  echo "== $gpu: $here/base/cuda_bench (base) against $here/cuda_bench (new)"
  products="128*512x1536x2048:nt 128*512x2048x768:nt 128*512x768x2048:nn 128*512x2048x1536:nn"
  pairs=()
  for f in "" _fp8 _int8 _int4; do
    pairs+=("$here/bins/frozen$f.fwd.moebin" "$here/bins/frozen$f.bwd.moebin")
  done
  for round in 1 2 3; do
    for f in fp8_block128 int8 int4_g128; do
      for side in base new; do
        b="$here/cuda_bench"
        [ $side = base ] && b="$here/base/cuda_bench"
        echo "== tiles, B $f, round $round: $side"
        # shellcheck disable=SC2086
        "$b" gmm --weight-format "$f" $products | tail -4 || rc=1
      done
    done
  done
  for round in 1 2; do
    for side in base new; do
      b="$here/cuda_bench"
      [ $side = base ] && b="$here/base/cuda_bench"
      echo "== the frozen layer (bf16, FP8, int8, int4 weights), round $round: $side"
      "$b" layer "${pairs[@]}" --repeat 5 --sample 16 | grep -E "^layer:|median|around|verify" || rc=1
    done
  done
fi
exit $rc
RUN
chmod 755 "$out/run.sh"
du -sh "$out"
