//===- Compile.cpp - Graph to task program, the whole compiler ------------===//
//
// See Compile.h.
//
//===----------------------------------------------------------------------===//

#include "compiler/driver/Compile.h"

#include "compiler/import/GraphJson.h"
#include "compiler/ir/MoeDialect.h"
#include "compiler/target/Simulate.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"

#include <chrono>

namespace moec::driver {

Status compileModule(mlir::ModuleOp module, const CompileOptions &options, CompileResult *out) {
  using Clock = std::chrono::steady_clock;
  Clock::time_point mark = Clock::now();
  std::vector<std::pair<const char *, double>> phases;
  auto phase = [&](const char *name) {
    Clock::time_point now = Clock::now();
    phases.push_back({name, std::chrono::duration<double, std::milli>(now - mark).count()});
    mark = now;
  };
  auto starting = [&](const char *name) {
    if (options.onStep)
      options.onStep(name);
  };

  CompileResult result;
  lower::LowerOptions lowerOptions;
  if (Status status = target::loadConfigForTarget(options.configPath, options.target,
                                                  &result.config, &lowerOptions.profile);
      !status)
    return status;
  lowerOptions.granularity = options.granularity;
  lowerOptions.receiveCapacity = receiveCapacityRows(result.config);
  result.profile = lowerOptions.profile;

  starting("graph passes");
  mlir::PassManager pm(module.getContext());
  moe::buildGraphPipeline(pm, result.config, options.configPath);
  if (mlir::failed(pm.run(module)))
    return Status::error("the graph passes failed");
  phase("graph passes");
  auto graphs = module.getOps<moe::GraphOp>();
  if (graphs.empty())
    return Status::error("the module holds no moe.graph");
  moe::GraphOp graph = *graphs.begin();
  result.graphName = graph.getSymName().str();
  starting("lower");
  if (mlir::failed(lower::lowerGraph(graph, lowerOptions, &result.program)))
    return Status::error("lowering failed");
  phase("lower");
  starting("schedule");
  if (Status status = target::scheduleQueues(
          &result.program, lowerOptions.profile, uint32_t(result.config.numCubeCores),
          uint32_t(result.config.numVectorCores), &result.estimate);
      !status)
    return status;
  phase("schedule");
  starting("deadlock proof");
  if (Status status = target::proveDeadlockFree(result.program); !status)
    return status;
  phase("deadlock proof");
  if (Status status = format::validateTaskProgram(result.program); !status)
    return Status::error("the compiled program is invalid: " + status.message());
  result.phases = std::move(phases);
  *out = std::move(result);
  return Status::success();
}

Status compileGraphFile(const std::string &graphPath, const CompileOptions &options,
                        CompileResult *out) {
  mlir::MLIRContext context(mlir::MLIRContext::Threading::DISABLED);
  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler(&context, [&](mlir::Diagnostic &diag) {
    if (diag.getSeverity() == mlir::DiagnosticSeverity::Error)
      diagnostics += diag.str() + "\n";
    return mlir::success();
  });
  context.printOpOnDiagnostic(false);
  mlir::OwningOpRef<mlir::ModuleOp> module = loadGraph(graphPath, &context);
  if (!module)
    return Status::error(graphPath + ": " + diagnostics);
  Status status = compileModule(*module, options, out);
  if (!status && !diagnostics.empty())
    return Status::error(status.message() + ": " + diagnostics);
  return status;
}

} // namespace moec::driver
