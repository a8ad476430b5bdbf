//===- ScaleRule.h - What a quantized weight's scale may hold --*- C++ -*-===//
//
// The one rule a quantized weight's scales (and an int4 layer's zero
// points) obey, for the host's check (backend::findBadScaleOnHost) and the
// cuda backend's check in device memory (runtime/cuda/Device.cu), which
// compiles it as device code too. No includes: nvcc reads it as it is.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_BACKEND_SCALERULE_H
#define MOEC_RUNTIME_BACKEND_SCALERULE_H

#ifdef __CUDACC__
#define MOEC_SCALE_RULE __host__ __device__
#else
#define MOEC_SCALE_RULE
#endif

namespace moec::backend {

/// Whether `v` is a quantized weight's scale (finite and positive) or, with
/// `zeroPoint`, an int4 zero point (a finite number from 0 to 15). A NaN
/// fails every comparison; the largest finite float bounds out infinity.
MOEC_SCALE_RULE inline bool goodScale(float v, bool zeroPoint) {
  return zeroPoint ? v >= 0.0f && v <= 15.0f : v > 0.0f && v <= 3.40282347e+38f;
}

} // namespace moec::backend

#undef MOEC_SCALE_RULE

#endif // MOEC_RUNTIME_BACKEND_SCALERULE_H
