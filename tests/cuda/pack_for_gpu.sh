#!/usr/bin/env bash
# Packs what the cuda backend's checks need on a GPU machine without Debian's
# packages (no moec compiler there), into one folder:
#
#   tests/cuda/pack_for_gpu.sh DIR        (from the repository root, where moec builds)
#
# DIR gets the GPU suite, its probe and cuda_bench (built here with the CUDA
# toolkit; without it they would be stubs, so the script stops), the
# suite's layers compiled as the GPU runs them (the binary cache),
# examples/cuda/compile_binaries.sh's binaries, the shared
# libraries those programs link beyond the C/C++ runtime (xz-compressed),
# and DIR/run.sh. On the GPU machine, from a checkout of the same commit:
#
#   bash DIR/run.sh [suite] [bench]      (default: both)
#
# runs the conformance suite's [gpu] cases and examples/cuda/bench.sh
# --moec-only on the packed programs and binaries (its PyTorch side left
# out): the tiles, the full layer at S 1024 and 4096, the frozen layer with
# bf16, FP8, int8 and int4 weights, each layer checked against the
# reference on 16 sampled tokens.
set -euo pipefail
out="${1:?usage: tests/cuda/pack_for_gpu.sh DIR}"
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

# The suite's layers, compiled as the GPU runs them (--peer-groups 1): the
# suite passes on the CPU while it fills the cache.
MOEC_TEST_COMPILE_FOR=cuda MOEC_BINARY_CACHE="$out/cache" MOEC=bazel-bin/tools/moec \
  "$out/gpu_suite" "[gpu]" | tail -2

# bench.sh's binaries.
bash examples/cuda/compile_binaries.sh "$out/bins"

# The libraries beyond libc, libm, libstdc++ and libgcc.
libs="$(mktemp -d)"
trap 'rm -rf "$libs"' EXIT
mkdir "$libs/lib"
ldd "$out/gpu_suite" "$out/cuda_bench" | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*|libpthread|libdl|librt)\.so' |
  while read -r lib; do cp -L "$lib" "$libs/lib/"; done
tar -C "$libs" -cJf "$out/lib.tar.xz" lib

cat >"$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# The cuda backend's checks on this GPU (made by tests/cuda/pack_for_gpu.sh):
#   bash run.sh [suite] [bench]   from a checkout of the same commit (default: both)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
parts="${*:-suite bench}"
mkdir -p /tmp/moec-gpu && tar -C /tmp/moec-gpu -xJf "$here/lib.tar.xz"
export LD_LIBRARY_PATH="/tmp/moec-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
if [[ " $parts " == *" suite "* ]]; then
  echo "== the conformance suite's [gpu] cases"
  MOEC_BINARY_CACHE="$here/cache" bash tests/cuda/run_gpu.sh "$here/gpu_probe" "$here/gpu_suite" |
    tail -4 || rc=1
fi
if [[ " $parts " == *" bench "* ]]; then
  bash examples/cuda/bench.sh --moec-only "$here/cuda_bench" "$here/bins" || rc=1
fi
exit $rc
RUN
chmod 755 "$out/run.sh"
du -sh "$out"
