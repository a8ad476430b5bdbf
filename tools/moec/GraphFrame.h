//===- GraphFrame.h - the frame of the commands that load a graph -*- C++ -*-===//

#ifndef MOEC_TOOLS_MOEC_GRAPHFRAME_H
#define MOEC_TOOLS_MOEC_GRAPHFRAME_H

#include "tools/moec/Cli.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/ADT/STLFunctionalExtras.h"

#include <string>

namespace moec::cli {

/// The frame of every graph command: parse the arguments (answering --help),
/// check them with `checkArgs` (false: a usage error, already printed), load
/// GRAPH (.json or .mlir) with diagnostics printed as file:line:col, run
/// `body`, and write what it put in its string to -o (default stdout) when it
/// returns kOk; then, once the output is written, call `afterWrite` (if any).
/// Returns the exit code.
int runOnGraph(const CommandSpec &spec, int argc, char **argv, int first,
               llvm::function_ref<bool(const Args &)> checkArgs,
               llvm::function_ref<int(const Args &, mlir::ModuleOp, std::string &)> body,
               llvm::function_ref<void()> afterWrite = {});

} // namespace moec::cli

#endif // MOEC_TOOLS_MOEC_GRAPHFRAME_H
