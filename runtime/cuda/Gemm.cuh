//===- Gemm.cuh - The GMM tile function of the persistent kernel ---------===//
//
// Device code, included by Device.cu alone. gemm() computes one tile's
// product with the fastest path the GPU and the operands allow:
//   GemmSm90.cuh   wgmma (compute capability 9.0, built for sm_90a), for
//                  16-byte-aligned bf16 operands over 32 columns wide;
//   GemmSm80.cuh   mma.sync for those elsewhere, wmma for other bf16
//                  tiles, fp32 FMA for other operand types.
// A quantized weight B (Mat::quant) is decoded as it is loaded: 8 values at
// a time into wgmma's stages, else a value at a time (wmma, FMA).
// The shared memory a block needs (Smem) depends on the path: on a GPU
// without the sm_90a code the launch asks for SmemSm80 only (smemBytes in
// Device.cu).
//
//===----------------------------------------------------------------------===//
#ifndef MOEC_RUNTIME_CUDA_GEMM_CUH
#define MOEC_RUNTIME_CUDA_GEMM_CUH

#include "runtime/cuda/GemmSm80.cuh"
#include "runtime/cuda/GemmSm90.cuh"

namespace moec::cuda::device {
namespace {

union SmemSm80 {
  SmemTc tc;
  SmemF32 f;
  SmemMma mma;
};
union Smem {
  SmemSm80 sm80;
  unsigned char wg[kWgSmemBytes];
};

__device__ __forceinline__ void gemm(const Gemm &g, Smem &s) {
  if (g.m <= 0 || g.n <= 0)
    return;
  if (g.a.type == kBF16 && g.b.type == kBF16) {
    // Wide tiles of 16-byte-aligned operands take the pipelined path;
    // narrow tiles (a column split over many cores) narrower wmma blocks.
    // A quantized B (decoded to bf16) takes wgmma where it runs, else wmma.
    const bool quantized = g.b.quant != kDense;
    const bool aligned = vectorizable(g.a, g.a.trans ? g.m : g.k) &&
                         (quantized ? quantVectors(g.b, g.b.trans ? g.k : g.n)
                                    : vectorizable(g.b, g.b.trans ? g.k : g.n));
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (aligned && g.n > 32) {
      if (g.n > 128 && !quantized) // gemmWgmma: a quantized B 128 at a time
        gemmWgmma<256>(g, s.wg);
      else if (g.n > 64)
        gemmWgmma<128>(g, s.wg);
      else
        gemmWgmma<64>(g, s.wg);
      return;
    }
#else
    if (aligned && !quantized && g.n > 32) {
      if (g.n > 64)
        gemmMma<128>(g, s.sm80.mma);
      else
        gemmMma<64>(g, s.sm80.mma);
      return;
    }
#endif
    if (g.n <= 32)
      gemmTensorCores<32>(g, s.sm80.tc);
    else if (g.n <= 64)
      gemmTensorCores<64>(g, s.sm80.tc);
    else
      gemmTensorCores<128>(g, s.sm80.tc);
  }
  else
    gemmFp32(g, s.sm80.f);
}

/// The dynamic shared memory a block of the tile function needs on this
/// GPU: all of Smem where the sm_90a code runs (compute capability 9.0),
/// SmemSm80 elsewhere.
size_t smemBytes() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return sizeof(SmemSm80);
  return major == 9 && minor == 0 ? sizeof(Smem) : sizeof(SmemSm80);
}

/// Lets `kernel` take `bytes` of dynamic shared memory (over the default
/// 48 KiB).
template <typename Kernel> cudaError_t allowSmem(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

} // namespace
} // namespace moec::cuda::device

#endif // MOEC_RUNTIME_CUDA_GEMM_CUH
