//===- CudaError.cuh - A CUDA call's error as the backend's Error ---------===//
#ifndef MOEC_RUNTIME_CUDA_CUDAERROR_CUH
#define MOEC_RUNTIME_CUDA_CUDAERROR_CUH

#include "runtime/cuda/Device.h"

#include <cuda_runtime.h>

#include <string>

namespace moec::cuda::device {
namespace {

Error cudaText(const std::string &what, cudaError_t e) {
  return what + ": " + cudaGetErrorString(e);
}

} // namespace
} // namespace moec::cuda::device

/// Returns "what: CUDA's message" from the enclosing function when `call`
/// fails.
#define MOEC_CUDA(what, call)                                                                      \
  do {                                                                                             \
    const cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess)                                                                         \
      return cudaText(what, e_);                                                                   \
  } while (0)

#endif // MOEC_RUNTIME_CUDA_CUDAERROR_CUH
