//===- Backend.cpp - The CUDA backend behind the seam ---------------------===//

#include "runtime/backend/Backend.h"
#include "runtime/cuda/Pass.h"

namespace moec::cuda {
namespace {

/// The CUDA passes of one context.
class CudaBackend final : public backend::Backend {
public:
  backend::Kind kind() const override { return backend::Kind::Cuda; }

  Status createPass(const format::TaskProgram &program, const rt::LayerPlan &plan,
                    const backend::PassOptions &options,
                    std::unique_ptr<backend::Pass> *out) override {
    if (options.opByOp)
      return Status::error("the op-by-op schedule runs on the cpu backend only");
    std::unique_ptr<Pass> made;
    Status s = Pass::create(program, plan, options, &made);
    *out = std::move(made);
    return s;
  }
};

} // namespace
} // namespace moec::cuda

namespace moec::backend {

std::unique_ptr<Backend> createCudaBackend() { return std::make_unique<cuda::CudaBackend>(); }

} // namespace moec::backend
