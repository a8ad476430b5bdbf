//===- Backend.cpp - The CPU backend behind the seam ----------------------===//

#include "runtime/backend/Registry.h"
#include "runtime/cpu/Pass.h"

#include <vector>

namespace moec::cpu {
namespace {

/// The CPU passes of one context: they share one Scratch per worker (a
/// context runs one pass at a time).
class CpuBackend final : public backend::Backend {
public:
  explicit CpuBackend(uint32_t workers) : scratch(workers) {}

  backend::Kind kind() const override { return backend::Kind::Cpu; }

  Status createPass(const format::TaskProgram &program, const rt::LayerPlan &plan,
                    const backend::PassOptions &options,
                    std::unique_ptr<backend::Pass> *out) override {
    std::unique_ptr<Pass> made;
    Status s = Pass::create(program, plan, options, &scratch, &made);
    *out = std::move(made);
    return s;
  }

  size_t scratchBytes() const override { return Scratch::heldBytes(); }

private:
  std::vector<Scratch> scratch; ///< per worker
};

} // namespace
} // namespace moec::cpu

namespace moec::backend {

MOEC_REGISTER_BACKEND(cpu, BackendInfo{Kind::Cpu,
                                       kindName(Kind::Cpu),
                                       "worker threads on this machine's cores",
                                       {},
                                       [](const BackendOptions &options) {
                                         return std::make_unique<cpu::CpuBackend>(options.workers);
                                       }});

} // namespace moec::backend
