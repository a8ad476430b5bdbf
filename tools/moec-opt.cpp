//===- moec-opt.cpp - run moe graph passes on .mlir files ------------------===//
//
// The mlir-opt driver of the moe dialect: only moe is registered, with its
// passes and the moe-graph-pipeline. It reads its input itself (a regular
// file or standard input, bounded, as moec reads its inputs) so that text nested too deep for MLIR's
// recursive parser is refused first, and writes its output only when every
// pass succeeded, through a temporary file: a failure leaves the output
// path as it was, and an output that is the input is refused.
//
//===----------------------------------------------------------------------===//

#include "base/File.h"
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
#include "llvm/Support/raw_ostream.h"
#include "llvm/Support/WithColor.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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

  auto fail = [](const std::string &message) {
    llvm::WithColor::error(llvm::errs(), "moec-opt") << message << "\n";
    return 1;
  };
  // The inputs: the graph, and the configs its passes read (config=PATH in
  // a pass's options). The outputs: -o, standard output, and MLIR's crash
  // reproducer.
  std::vector<std::string> inputs = {inputFilename};
  std::vector<std::pair<std::string, std::string>> outputs = {{"-o", outputFilename},
                                                              {"standard output", "-"}};
  const std::string reproducerFlag = "--mlir-pass-pipeline-crash-reproducer=";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    for (size_t at = arg.find("config="); at != std::string::npos;
         at = arg.find("config=", at + 1)) {
      const size_t from = at + 7, to = arg.find_first_of(" ,}'\"", from);
      inputs.push_back(arg.substr(from, to == std::string::npos ? std::string::npos : to - from));
    }
    if (arg.rfind(reproducerFlag, 0) == 0)
      outputs.push_back({"the crash reproducer", arg.substr(reproducerFlag.size())});
  }
  for (const auto &[what, path] : outputs)
    if (moec::Status s = moec::checkOutputPath(what, path, inputs); !s)
      return fail(s.message());
  std::string content;
  if (moec::Status s = moec::readTextFile(inputFilename, &content); !s)
    return fail(s.message());
  if (std::optional<moec::DeepNesting> deep = moec::findDeepNesting(content)) {
    llvm::errs() << inputFilename << ":" << deep->line << ":" << deep->column
                 << ": error: " << deep->message << "\n";
    return 1;
  }
  std::unique_ptr<llvm::MemoryBuffer> input = llvm::MemoryBuffer::getMemBufferCopy(
      content, inputFilename == "-" ? "<stdin>" : inputFilename.getValue());
  std::string rendered;
  llvm::raw_string_ostream os(rendered);
  mlir::DialectRegistry registry;
  registry.insert<moec::moe::MoeDialect>();
  if (mlir::failed(mlir::MlirOptMain(os, std::move(input), passPipeline, registry,
                                     splitInputFile, verifyDiagnostics, verifyPasses,
                                     /*allowUnregisteredDialects=*/false,
                                     /*preloadDialectsInContext=*/false,
                                     /*emitBytecode=*/false,
                                     /*implicitModule=*/true))) // top-level moe.graph ops
                                                                // get a module around them
    return 1; // nothing is written
  os.flush();
  if (outputFilename == "-") {
    if (std::fwrite(rendered.data(), 1, rendered.size(), stdout) != rendered.size() ||
        std::fflush(stdout) != 0)
      return fail(std::string("standard output: cannot write: ") + std::strerror(errno));
    return 0;
  }
  if (moec::Status s = moec::writeFileAtomically(outputFilename, {{rendered.data(), rendered.size()}});
      !s)
    return fail(s.message());
  return 0;
}
