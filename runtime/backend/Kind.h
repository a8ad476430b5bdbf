//===- Kind.h - The backends a context can run its passes on ----*- C++ -*-===//
//
// A name the runtime API's options carry (ContextOptions::backend) without
// the backend seam itself (Pass.h, Backend.h), which the API's users need
// not see.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_BACKEND_KIND_H
#define MOEC_RUNTIME_BACKEND_KIND_H

#include <cstdint>

namespace moec::backend {

/// The backends a context can run its passes on.
enum class Kind : uint8_t {
  Cpu,  ///< runtime/cpu: worker threads on this machine's cores
  Cuda, ///< runtime/cuda: one persistent kernel on an NVIDIA GPU
};

/// "cpu" or "cuda".
inline const char *kindName(Kind kind) {
  switch (kind) {
  case Kind::Cpu:
    return "cpu";
  case Kind::Cuda:
    return "cuda";
  }
  return "unknown";
}

} // namespace moec::backend

#endif // MOEC_RUNTIME_BACKEND_KIND_H
