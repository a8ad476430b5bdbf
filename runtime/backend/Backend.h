//===- Backend.h - The backend seam: what makes a context's passes -*- C++ -*-===//
//
// A context (or an exchange) of the runtime API holds one Backend: it makes
// the context's passes (Pass.h) and owns what they share, e.g. the CPU
// backend's per-worker scratch. The runtime API reaches every backend
// through this header, Pass.h and Registry.h alone; each backend's folder
// implements its Backend and registers it (runtime/cpu/Backend.cpp,
// runtime/cuda/Backend.cpp).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_BACKEND_BACKEND_H
#define MOEC_RUNTIME_BACKEND_BACKEND_H

#include "base/Status.h"
#include "runtime/backend/Pass.h"
#include "format/TaskBinary.h"
#include "runtime/layer/Layer.h"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace moec::backend {

/// The passes of one context, on one backend.
class Backend {
public:
  virtual ~Backend() = default;

  virtual Kind kind() const = 0;

  /// Creates the pass of `program` (whose roles are `plan`; both must
  /// outlive the pass). Its passes never run at once, so they may share
  /// memory. Collective under a fabric of several processes. Fails for
  /// options the backend cannot honour (e.g. the op-by-op schedule on
  /// CUDA), with a message that says so.
  virtual Status createPass(const format::TaskProgram &program, const rt::LayerPlan &plan,
                            const PassOptions &options, std::unique_ptr<Pass> *out) = 0;

  /// Bytes of scratch its passes hold beyond their workspace (the CPU: every
  /// worker's packing buffers, process-wide).
  virtual size_t scratchBytes() const { return 0; }
};

} // namespace moec::backend

#endif // MOEC_RUNTIME_BACKEND_BACKEND_H
