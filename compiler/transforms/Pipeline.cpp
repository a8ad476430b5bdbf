//===- Pipeline.cpp - the graph pipeline and its registration --------------===//

#include "compiler/transforms/Passes.h"

#include "mlir/Pass/PassRegistry.h"

using namespace mlir;

namespace moec::moe {

namespace {
/// The passes after moe-resolve-shapes.
void addGraphPasses(OpPassManager &pm) {
  pm.addPass(createQuantizeDispatch());
  pm.addPass(createVerifyGraph());
  pm.addPass(createAssignSlots());
  pm.addPass(createPropagateSplits());
}
} // namespace

void buildGraphPipeline(OpPassManager &pm, const std::string &configPath,
                        const std::string &target) {
  ResolveShapesOptions options;
  options.configPath = configPath;
  options.target = target;
  pm.addPass(createResolveShapes(options));
  addGraphPasses(pm);
}

void buildGraphPipeline(OpPassManager &pm, const ModelConfig &config, const std::string &source) {
  pm.addPass(createResolveShapes(config, source));
  addGraphPasses(pm);
}

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
      "Resolve shapes, quantize dispatches (dispatch_dtype), verify the graph, assign slots and propagate splits",
      [](OpPassManager &pm, const GraphPipelineOptions &options) {
        buildGraphPipeline(pm, options.config, options.target);
      });
}

} // namespace moec::moe
