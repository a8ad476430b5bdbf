//===- moec-opt.cpp - run moe graph passes on .mlir files ------------------===//
//
// The MlirOptMain driver of the moe dialect: only moe is registered, with
// its passes and the moe-graph-pipeline.
//
//===----------------------------------------------------------------------===//

#include "compiler/ir/MoeDialect.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"

int main(int argc, char **argv) {
  mlir::DialectRegistry registry;
  registry.insert<moec::moe::MoeDialect>();
  moec::moe::registerMoePipelines();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "moec-opt: moe graph passes\n", registry));
}
