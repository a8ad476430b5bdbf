//===- RunOptions.h - moec run's options, checked -----------------*- C++ -*-===//
//
// `moec run`'s command line: its spec and help (kRunSpec), its options
// checked into RunOptions, its folders and trace paths checked against each
// other, and the options every MPI rank must share as text. RunCommand.cpp
// runs what they say.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TOOLS_MOEC_RUNOPTIONS_H
#define MOEC_TOOLS_MOEC_RUNOPTIONS_H

#include "base/Time.h"
#include "runtime/backend/Kind.h"
#include "tools/moec/Cli.h"

#include <cstdint>
#include <string>

namespace moec::cli {

extern const CommandSpec kRunSpec;

/// The options of `moec run` past the files it reads and writes, checked.
struct RunOptions {
  bool mpi = false;          ///< --fabric mpi (the default under mpirun)
  bool localPuts = false;    ///< --local-puts
  bool verify = false;       ///< --verify, or --verify-sample
  uint64_t sampleTokens = 0; ///< --verify-sample
  uint64_t ranks = 0, threads = 0, repeat = 1, warmup = 1, seed = 0;
  double timeout = kDefaultTimeoutSeconds;
  backend::Kind backend = backend::Kind::Cpu;
  double hotShare = 0; ///< --hot-share
};

/// Checks `args`' options into *o; returns kOk, or the usage error's code
/// after printing it.
int parseRunOptions(const Args &args, RunOptions *o);

/// The folders and trace paths of `moec run` against each other: no empty
/// folder, no output over an input, no trace among the run's own files.
int checkRunPaths(const Args &args);

/// Prints `message` and moec run's usage; returns kUsage.
int usage(const char *message);

/// The options that decide what a run computes and how, as text (see
/// RunOptions.cpp): under MPI every rank must be given the same.
std::string runOptionsText(const Args &args);

/// `path` with `suffix` before its extension: the backward pass's trace.
std::string tracePath(const std::string &path, const char *suffix);

} // namespace moec::cli

#endif // MOEC_TOOLS_MOEC_RUNOPTIONS_H
