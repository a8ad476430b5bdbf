//===- Passes.h - moe graph passes -------------------------------*- C++ -*-===//

#ifndef MOEC_COMPILER_TRANSFORMS_PASSES_H
#define MOEC_COMPILER_TRANSFORMS_PASSES_H

#include "compiler/config/Config.h"
#include "compiler/ir/MoeDialect.h"
#include "compiler/target/Profile.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"
#include "mlir/Pass/PassManager.h"

#include <memory>
#include <string>

namespace moec::moe {

#define GEN_PASS_DECL
#include "compiler/transforms/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "compiler/transforms/Passes.h.inc"

/// moe-resolve-shapes with a config the caller loaded, its core counts set
/// (target::loadConfigForTarget): `source`, its path, names it in messages.
std::unique_ptr<mlir::Pass> createResolveShapes(const ModelConfig &config,
                                                const std::string &source);

/// Adds the graph pipeline: resolve shapes with the config at `configPath`
/// (read by the pass) for `target`, quantize dispatches, verify the graph,
/// fuse LoRA products (fusesLowRank), assign missing slots, propagate
/// splits.
void buildGraphPipeline(mlir::OpPassManager &pm, const std::string &configPath,
                        const std::string &target = "cpu");

/// The same pipeline for a config already loaded (its core counts set):
/// what a compile runs, so that the config file is read once. `splits`
/// are moe-propagate-splits' options; `fuseLowRank` adds moe-fuse-low-rank
/// (fusesLowRank of the target's profile).
void buildGraphPipeline(mlir::OpPassManager &pm, const ModelConfig &config,
                        const std::string &source, const PropagateSplitsOptions &splits,
                        bool fuseLowRank);

/// Whether the pipeline folds LoRA adapters' second gmms into their bases'
/// (moe-fuse-low-rank) for `profile`: where its cube cores share no cache
/// (the CPU), whose backend runs a gmm with a low-rank product.
bool fusesLowRank(const target::TargetProfile &profile);

/// moe-propagate-splits' options for `profile`: its defaults, with the GMM
/// kernel's blocks (pad_m, pad_n) the automatic splits cut tiles to.
PropagateSplitsOptions splitOptionsFor(const target::TargetProfile &profile);

/// Registers the passes and the `moe-graph-pipeline` pipeline with the
/// global registry (for moec-opt).
void registerMoePipelines();

} // namespace moec::moe

#endif // MOEC_COMPILER_TRANSFORMS_PASSES_H
