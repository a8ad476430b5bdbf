#!/usr/bin/env bash
# Packs what the cuda backend's checks need on a GPU machine without Debian's
# packages (no moec compiler there), into one folder:
#
#   tests/cuda/pack_for_gpu.sh DIR        (from the repository root, where moec builds)
#
# DIR gets the GPU suite, its probe and cuda_bench (built here with the CUDA
# toolkit), the suite's layers compiled as the GPU runs them (the binary
# cache), the qwen3-30b-a3b binaries of examples/cuda/bench.sh, the shared
# libraries those programs link beyond the C/C++ runtime (xz-compressed),
# and DIR/run.sh. On the GPU machine, from a checkout of the same commit:
#
#   bash DIR/run.sh [suite] [tiles] [layers]      (default: all three)
#
# runs the conformance suite's [gpu] cases, cuda_bench gmm (bf16 and every
# weight format) and cuda_bench layer (the full layer at S 1024 and 4096,
# the frozen layer with bf16, FP8, int8 and int4 weights), each layer
# checked against the reference on 16 sampled tokens. PyTorch's side of
# bench.sh (bench_torch.py) is not in it.
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

# bench.sh's binaries: S 1024 and 4096, and the frozen layer's formats.
for s in 1024 4096; do
  python3 - "$s" "$out/bins/q$s.json" <<'PY'
import json, sys
c = json.load(open("examples/configs/qwen3-30b-a3b.json"))
c.update(seq_size=int(sys.argv[1]), num_cube_cores=16, num_vector_cores=16, weight_group=128)
json.dump(c, open(sys.argv[2], "w"))
PY
  for g in fwd bwd; do
    bazel-bin/tools/moec compile "graphs/moe_ffn_$g.json" --config "$out/bins/q$s.json" \
      --target h100 --peer-groups 1 -o "$out/bins/q$s.$g.moebin" --no-progress
  done
done
for f in "" _fp8 _int8 _int4; do
  for g in fwd_transposed bwd_frozen_transposed; do
    bazel-bin/tools/moec compile "graphs/moe_ffn_$g$f.json" --config "$out/bins/q1024.json" \
      --target h100 --peer-groups 1 -o "$out/bins/frozen$f.${g%%_*}.moebin" --no-progress
  done
done

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
#   bash run.sh [suite] [tiles] [layers]   from a checkout of the same commit
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
parts="${*:-suite tiles layers}"
mkdir -p /tmp/moec-gpu && tar -C /tmp/moec-gpu -xJf "$here/lib.tar.xz"
export LD_LIBRARY_PATH="/tmp/moec-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
rc=0
if [[ " $parts " == *" suite "* ]]; then
  echo "== the conformance suite's [gpu] cases"
  MOEC_BINARY_CACHE="$here/cache" bash tests/cuda/run_gpu.sh "$here/gpu_probe" "$here/gpu_suite" |
    tail -4 || rc=1
fi
if [[ " $parts " == *" tiles "* ]]; then
  echo "== GMM tiles (bf16; then B in each weight format, qwen3's products)"
  "$here/cuda_bench" gmm || rc=1
  products="128*512x1536x2048:nt 128*512x2048x768:nt 128*512x768x2048:nn 128*512x2048x1536:nn"
  for f in fp8_block128 int8 int4_g128 int4_g32_zp; do
    # shellcheck disable=SC2086
    "$here/cuda_bench" gmm --weight-format "$f" $products || rc=1
  done
fi
if [[ " $parts " == *" layers "* ]]; then
  b="$here/bins"
  for s in 1024 4096; do
    echo "== qwen3-30b-a3b, EP 8 on the GPU, S $s, fwd + bwd"
    "$here/cuda_bench" layer "$b/q$s.fwd.moebin" "$b/q$s.bwd.moebin" --repeat 5 --sample 16 || rc=1
  done
  for f in "" _fp8 _int8 _int4; do
    label="${f#_}"
    echo "== the frozen layer, S 1024, weights ${label:-bf16}"
    "$here/cuda_bench" layer "$b/frozen$f.fwd.moebin" "$b/frozen$f.bwd.moebin" --repeat 5 \
      --sample 16 || rc=1
  done
fi
exit $rc
RUN
chmod 755 "$out/run.sh"
du -sh "$out"
