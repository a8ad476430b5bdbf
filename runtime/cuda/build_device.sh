#!/usr/bin/env bash
# Builds the CUDA backend's device side into one static archive:
#   build_device.sh OUT.a Device.cu DeviceStub.cpp [CUDA_HOME]
# With nvcc (CUDA_HOME/bin/nvcc, default /usr/local/cuda): Device.cu for
# sm_80 and sm_90 (and PTX for newer GPUs), with cudart_static's objects
# merged into the archive, so nothing links libcudart.so. Without nvcc:
# DeviceStub.cpp, whose every call says the toolkit was missing.
set -euo pipefail
out="$1" cu="$2" stub="$3" cuda="${4:-${MOEC_CUDA_HOME:-/usr/local/cuda}}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
root="$(pwd)"
if [ -x "$cuda/bin/nvcc" ] && [ -f "$cuda/lib64/libcudart_static.a" ]; then
  "$cuda/bin/nvcc" -std=c++17 -O3 -I"$root" -Xcompiler -fPIC \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -gencode arch=compute_90,code=compute_90 \
    -c "$cu" -o "$work/device.o"
  printf 'create %s\naddmod %s\naddlib %s\nsave\nend\n' "$work/out.a" "$work/device.o" \
    "$cuda/lib64/libcudart_static.a" | ar -M
else
  echo "build_device.sh: no CUDA toolkit at $cuda: the cuda backend is built as a stub" >&2
  "${CXX:-g++}" -std=c++17 -O2 -fPIC -I"$root" -c "$stub" -o "$work/device.o"
  ar rcs "$work/out.a" "$work/device.o"
fi
cp "$work/out.a" "$out"
