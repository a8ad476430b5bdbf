//===- GraphFuzz.h - What the graph fuzz targets share ---------*- C++ -*-===//
//
// The JSON graph import and the MLIR text parser feed the same graph pass
// pipeline (moec check's and moec-opt's path). Each target parses the input
// its way and hands the module to checkGraphPipeline: a refusal must say
// why (an error diagnostic), and a graph that passes must verify.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TESTS_FUZZ_GRAPHFUZZ_H
#define MOEC_TESTS_FUZZ_GRAPHFUZZ_H

#include "compiler/ir/MoeDialect.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/OwningOpRef.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Pass/PassManager.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

namespace moec::fuzz {

/// A context for many inputs (a fresh one per input would cost more than
/// the parse), with a handler that records whether an error was said.
struct GraphFuzzContext {
  mlir::MLIRContext context;
  bool errorSaid = false;
  mlir::ScopedDiagnosticHandler handler;
  std::string config;

  GraphFuzzContext()
      : context(mlir::MLIRContext::Threading::DISABLED),
        handler(&context, [this](mlir::Diagnostic &d) {
          if (d.getSeverity() == mlir::DiagnosticSeverity::Error)
            errorSaid = true;
          return mlir::success();
        }) {
    context.getOrLoadDialect<moe::MoeDialect>();
    const char *path = std::getenv("MOEC_FUZZ_CONFIG");
    config = path ? path : "examples/configs/tiny.json";
    // Every input would be refused for want of the config, with an error
    // said, and the run would pass having tested nothing.
    if (!std::ifstream(config)) {
      std::fprintf(stderr, "graph fuzz: cannot read the config %s (MOEC_FUZZ_CONFIG)\n",
                   config.c_str());
      std::abort();
    }
  }
};

/// Parses one input with `parse` and runs the graph pipeline on what it
/// gives; aborts (a finding) when a failure says nothing, or when a module
/// that passed does not verify.
inline void checkGraphPipeline(
    const std::function<mlir::OwningOpRef<mlir::ModuleOp>(mlir::MLIRContext *)> &parse) {
  // What a context interns is never freed: a fresh one every so often keeps
  // the run's memory bounded.
  static std::unique_ptr<GraphFuzzContext> current;
  static int inputs = 0;
  if (!current || ++inputs % 2000 == 0)
    current = std::make_unique<GraphFuzzContext>();
  GraphFuzzContext &fuzz = *current;
  fuzz.errorSaid = false;
  mlir::OwningOpRef<mlir::ModuleOp> module = parse(&fuzz.context);
  if (!module) {
    if (!fuzz.errorSaid)
      std::abort();
    return;
  }
  mlir::PassManager pm(&fuzz.context);
  moe::buildGraphPipeline(pm, fuzz.config, "cpu");
  if (mlir::failed(pm.run(*module))) {
    if (!fuzz.errorSaid)
      std::abort();
    return;
  }
  if (mlir::failed(mlir::verify(*module)))
    std::abort();
}

} // namespace moec::fuzz

#endif // MOEC_TESTS_FUZZ_GRAPHFUZZ_H
