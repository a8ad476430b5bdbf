#!/usr/bin/env bash
# Builds the CUDA backend's device side into one static archive:
#   build_device.sh OUT.a DeviceStub.cpp CU... [-- CUDA_HOME]
# With nvcc (CUDA_HOME/bin/nvcc, default /usr/local/cuda): each .cu for
# sm_80 and sm_90a (wgmma, GemmSm90.cuh; it runs on compute capability 9.0
# alone), and PTX of compute_90 for newer GPUs, with cudart_static's
# objects merged into the archive, so nothing links libcudart.so. Without
# nvcc: DeviceStub.cpp, whose every call says the toolkit was missing.
# MOEC_NVCC_FLAGS adds flags (e.g. -Xptxas -v for the register report).
set -euo pipefail
out="$1" stub="$2"
shift 2
cus=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  cus+=("$1")
  shift
done
[ $# -gt 0 ] && shift
cuda="${1:-${MOEC_CUDA_HOME:-/usr/local/cuda}}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$(pwd)"
if [ -x "$cuda/bin/nvcc" ] && [ -f "$cuda/lib64/libcudart_static.a" ]; then
  objects=()
  for cu in "${cus[@]}"; do
    o="$work/$(basename "$cu" .cu).o"
    # shellcheck disable=SC2086
    "$cuda/bin/nvcc" -std=c++17 -O3 --threads 0 -I"$root" -Xcompiler -fPIC ${MOEC_NVCC_FLAGS:-} \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a \
      -gencode arch=compute_90,code=compute_90 \
      -c "$cu" -o "$o"
    objects+=("$o")
  done
  {
    echo "create $work/out.a"
    for o in "${objects[@]}"; do echo "addmod $o"; done
    echo "addlib $cuda/lib64/libcudart_static.a"
    echo "save"
    echo "end"
  } | ar -M
else
  echo "build_device.sh: no CUDA toolkit at $cuda: the cuda backend is built as a stub" >&2
  "${CXX:-g++}" -std=c++17 -O2 -fPIC -I"$root" -c "$stub" -o "$work/device.o"
  ar rcs "$work/out.a" "$work/device.o"
fi
cp "$work/out.a" "$out"
