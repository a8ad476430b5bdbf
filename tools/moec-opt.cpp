//===- moec-opt.cpp - run moe graph passes on .mlir files ------------------===//
//
// The mlir-opt driver of the moe dialect: only moe is registered, with its
// passes and the moe-graph-pipeline. It reads its input itself so that text
// nested too deep for MLIR's recursive parser is refused first.
//
//===----------------------------------------------------------------------===//

#include "compiler/ir/MoeDialect.h"
#include "compiler/support/Nesting.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/AsmState.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"
#include "mlir/Support/FileUtilities.h"
#include "mlir/Support/Timing.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/WithColor.h"

#include <optional>
#include <string>

namespace cl = llvm::cl;

int main(int argc, char **argv) {
  llvm::InitLLVM init(argc, argv);
  static cl::opt<std::string> inputFilename(cl::Positional, cl::desc("<input file>"),
                                            cl::init("-"));
  static cl::opt<std::string> outputFilename("o", cl::desc("Output filename"),
                                             cl::value_desc("filename"), cl::init("-"));
  static cl::opt<bool> splitInputFile(
      "split-input-file", cl::desc("Split the input at '// -----' and run each part alone"));
  static cl::opt<bool> verifyDiagnostics(
      "verify-diagnostics", cl::desc("Check that the diagnostics match expected-* comments"));
  static cl::opt<bool> verifyPasses("verify-each", cl::desc("Verify the IR after each pass"),
                                    cl::init(true));
  mlir::registerAsmPrinterCLOptions();
  mlir::registerMLIRContextCLOptions();
  mlir::registerPassManagerCLOptions();
  mlir::registerDefaultTimingManagerCLOptions();
  moec::moe::registerMoePipelines();
  mlir::PassPipelineCLParser passPipeline("", "Compiler passes to run", "p");
  cl::ParseCommandLineOptions(argc, argv, "moec-opt: moe graph passes\n");

  std::string error;
  std::unique_ptr<llvm::MemoryBuffer> input = mlir::openInputFile(inputFilename, &error);
  if (!input) {
    llvm::WithColor::error(llvm::errs(), "moec-opt") << error << "\n";
    return 1;
  }
  const llvm::StringRef text = input->getBuffer();
  if (std::optional<moec::DeepNesting> deep =
          moec::findDeepNesting(std::string_view(text.data(), text.size()))) {
    llvm::errs() << inputFilename << ":" << deep->line << ":" << deep->column
                 << ": error: " << deep->message << "\n";
    return 1;
  }
  std::unique_ptr<llvm::ToolOutputFile> output = mlir::openOutputFile(outputFilename, &error);
  if (!output) {
    llvm::WithColor::error(llvm::errs(), "moec-opt") << error << "\n";
    return 1;
  }
  mlir::DialectRegistry registry;
  registry.insert<moec::moe::MoeDialect>();
  if (mlir::failed(mlir::MlirOptMain(output->os(), std::move(input), passPipeline, registry,
                                     splitInputFile, verifyDiagnostics, verifyPasses,
                                     /*allowUnregisteredDialects=*/false,
                                     /*preloadDialectsInContext=*/false,
                                     /*emitBytecode=*/false,
                                     /*implicitModule=*/true))) // top-level moe.graph ops
                                                                // get a module around them
    return 1; // the output file is removed: it was not kept
  output->keep();
  return 0;
}
