//===- Tile.cuh - What every GMM tile path shares ------------------------===//
//
// Device code, included by Device.cu alone (through Gemm.cuh): element
// access, an operand as a product reads it (Mat), the product a tile
// computes (Gemm), its epilogue, and the shared-memory helpers of the
// pipelined paths.
//
//===----------------------------------------------------------------------===//
#ifndef MOEC_RUNTIME_CUDA_TILE_CUH
#define MOEC_RUNTIME_CUDA_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moec::cuda::device {
namespace {

constexpr uint32_t kF32 = 1, kBF16 = 2, kI32 = 3;
constexpr int kThreads = 256;
constexpr int kBM = 128, kBN = 128, kBK = 32;

__device__ __forceinline__ uint32_t eltSize(uint32_t t) { return t == kBF16 ? 2 : 4; }

__device__ __forceinline__ float loadElt(const void *p, int64_t i, uint32_t t) {
  return t == kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i])
                    : static_cast<const float *>(p)[i];
}

__device__ __forceinline__ void storeElt(void *p, int64_t i, uint32_t t, float v) {
  if (t == kBF16)
    static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float *>(p)[i] = v;
}

__device__ __forceinline__ int64_t loadIndex(const void *p, uint32_t t, int64_t i) {
  return t == kI32 ? static_cast<const int32_t *>(p)[i] : static_cast<const int64_t *>(p)[i];
}

__device__ __forceinline__ const char *offsetBytes(const void *p, int64_t elements, uint32_t t) {
  return static_cast<const char *>(p) + elements * int64_t(eltSize(t));
}

/// An operand as the product reads it: op(i, p) = trans ? p[p * ld + i] :
/// p[i * ld + p].
struct Mat {
  const void *p;
  uint32_t type;
  int64_t ld;
  bool trans;
  __device__ int64_t at(int64_t row, int64_t col) const {
    return trans ? col * ld + row : row * ld + col;
  }
};

/// C[m, n] (+)= D + scale * opA opB over k, at the tile's origin.
struct Gemm {
  Mat a, b;
  void *c;
  uint32_t cType;
  int64_t ldc;
  const void *d; ///< addend (activation form), or null
  uint32_t dType;
  int64_t ldd;
  int64_t m, n, k;
  float scale;
  bool accumulate;
};

__device__ __forceinline__ void epilogue(const Gemm &g, int64_t i, int64_t j, float v) {
  const int64_t at = i * g.ldc + j;
  if (g.accumulate) {
    storeElt(g.c, at, g.cType, loadElt(g.c, at, g.cType) + v);
    return;
  }
  v *= g.scale;
  if (g.d)
    v += loadElt(g.d, i * g.ldd + j, g.dType);
  storeElt(g.c, at, g.cType, v);
}

__device__ __forceinline__ uint32_t sharedAddress(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Whether an operand can be copied 16 bytes at a time: bf16, its stride
/// and address 16-byte aligned, its contiguous extent a multiple of 8.
__device__ __forceinline__ bool vectorizable(const Mat &x, int64_t contiguousExtent) {
  return x.type == kBF16 && x.ld % 8 == 0 && reinterpret_cast<uintptr_t>(x.p) % 16 == 0 &&
         contiguousExtent % 8 == 0;
}

} // namespace
} // namespace moec::cuda::device

#endif // MOEC_RUNTIME_CUDA_TILE_CUH
