//===- Passes.h - moe graph passes -------------------------------*- C++ -*-===//

#ifndef MOEC_COMPILER_TRANSFORMS_PASSES_H
#define MOEC_COMPILER_TRANSFORMS_PASSES_H

#include "compiler/ir/MoeDialect.h"

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

/// Adds the graph pipeline: resolve shapes with the config at `configPath`,
/// verify the graph, assign missing slots, propagate splits.
void buildGraphPipeline(mlir::OpPassManager &pm, const std::string &configPath,
                        const std::string &target = "cpu");

/// Registers the passes and the `moe-graph-pipeline` pipeline with the
/// global registry (for moec-opt).
void registerMoePipelines();

} // namespace moec::moe

#endif // MOEC_COMPILER_TRANSFORMS_PASSES_H
