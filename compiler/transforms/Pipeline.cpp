//===- Pipeline.cpp - the graph pipeline and its registration --------------===//

#include "compiler/transforms/Passes.h"

#include "mlir/Pass/PassRegistry.h"

using namespace mlir;

namespace moec::moe {

namespace {
/// The passes after moe-resolve-shapes.
void addGraphPasses(OpPassManager &pm, const PropagateSplitsOptions &splits, bool fuseLowRank) {
  pm.addPass(createQuantizeDispatch());
  pm.addPass(createVerifyGraph());
  if (fuseLowRank)
    pm.addPass(createFuseLowRank());
  pm.addPass(createAssignSlots());
  pm.addPass(createPropagateSplits(splits));
}
} // namespace

PropagateSplitsOptions splitOptionsFor(const target::TargetProfile &profile) {
  PropagateSplitsOptions options;
  options.padM = profile.padM;
  options.padN = profile.padN;
  return options;
}

void buildGraphPipeline(OpPassManager &pm, const std::string &configPath,
                        const std::string &target) {
  ResolveShapesOptions options;
  options.configPath = configPath;
  options.target = target;
  pm.addPass(createResolveShapes(options));
  // A target that does not resolve fails in moe-resolve-shapes.
  target::TargetProfile profile;
  const bool resolved = bool(target::resolveProfile(target, &profile));
  addGraphPasses(pm, resolved ? splitOptionsFor(profile) : PropagateSplitsOptions{},
                 resolved && fusesLowRank(profile));
}

void buildGraphPipeline(OpPassManager &pm, const ModelConfig &config, const std::string &source,
                        const PropagateSplitsOptions &splits, bool fuseLowRank) {
  pm.addPass(createResolveShapes(config, source));
  addGraphPasses(pm, splits, fuseLowRank);
}

bool fusesLowRank(const target::TargetProfile &profile) { return !profile.sharedCache; }

namespace {
struct GraphPipelineOptions : PassPipelineOptions<GraphPipelineOptions> {
  Option<std::string> config{*this, "config",
                             llvm::cl::desc("path of the model/parallel config JSON")};
  Option<std::string> target{*this, "target",
                             llvm::cl::desc("target profile: cpu, ascend-910b, h100 or a JSON file"),
                             llvm::cl::init("cpu")};
};
} // namespace

void registerMoePipelines() {
  registerMoePasses();
  PassPipelineRegistration<GraphPipelineOptions>(
      "moe-graph-pipeline",
      "Resolve shapes, quantize dispatches (dispatch_dtype), verify the graph, fuse LoRA products "
      "into their bases (targets without a shared cache), assign slots and propagate splits",
      [](OpPassManager &pm, const GraphPipelineOptions &options) {
        buildGraphPipeline(pm, options.config, options.target);
      });
}

} // namespace moec::moe
