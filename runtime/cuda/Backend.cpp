//===- Backend.cpp - The CUDA backend behind the seam ---------------------===//

#include "runtime/backend/Registry.h"
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
      return backend::requireFeature(backend::Kind::Cuda, backend::Feature::OpByOp);
    std::unique_ptr<Pass> made;
    Status s = Pass::create(program, plan, options, &made);
    *out = std::move(made);
    return s;
  }
};

} // namespace
} // namespace moec::cuda

namespace moec::backend {

MOEC_REGISTER_BACKEND(
    cuda,
    BackendInfo{Kind::Cuda,
                kindName(Kind::Cuda),
                "every rank on one NVIDIA GPU, the task program as one persistent kernel",
                {Feature::MultiProcess, Feature::OpByOp, Feature::TaskTrace, Feature::Exchange,
                 Feature::SlotItems},
                [](const BackendOptions &) { return std::make_unique<cuda::CudaBackend>(); }});

} // namespace moec::backend
