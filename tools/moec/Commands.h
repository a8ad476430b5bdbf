//===- Commands.h - the entry points of the moec commands -------*- C++ -*-===//
//
// What main() (Main.cpp) dispatches to: one function per command, each
// parsing its own arguments with Cli.h and returning an ExitCode.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TOOLS_MOEC_COMMANDS_H
#define MOEC_TOOLS_MOEC_COMMANDS_H

#include "tools/moec/Cli.h"

namespace moec::cli {

// Commands. Each returns an ExitCode.
int runCheck(int argc, char **argv, int first);
int runImport(int argc, char **argv, int first);
int runExport(int argc, char **argv, int first);
int runCompile(int argc, char **argv, int first);
int runDump(int argc, char **argv, int first);
int runRun(int argc, char **argv, int first);
int runBench(int argc, char **argv, int first);


} // namespace moec::cli

#endif // MOEC_TOOLS_MOEC_COMMANDS_H
