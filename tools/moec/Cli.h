//===- Cli.h - the moec command line ----------------------------*- C++ -*-===//
//
// The argument library every moec command parses with, and its atomic
// output writer. Exit codes: 0 success, 1 error, 2 usage error.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TOOLS_MOEC_CLI_H
#define MOEC_TOOLS_MOEC_CLI_H

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace moec::cli {

enum ExitCode { kOk = 0, kError = 1, kUsage = 2 };

/// One command's options: which flags take a value, which are switches.
struct CommandSpec {
  const char *name;
  const char *usage;   // one line: "moec check GRAPH --config CFG [--json]"
  const char *help;    // the full --help text after the usage line
  std::vector<std::string> valueFlags;
  std::vector<std::string> switchFlags;
  unsigned minPositional, maxPositional;
  /// Value flags that name a file the command writes ("-o", "--trace"), and
  /// those that name a file it reads besides its positional arguments:
  /// checkOutputs refuses an output that is one of the inputs.
  std::vector<std::string> outputFlags = {};
  std::vector<std::string> inputFlags = {};
};

/// Parsed arguments of one command.
struct Args {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;
  std::map<std::string, bool> switches;
  bool help = false;

  std::optional<std::string> value(const std::string &flag) const;
  bool has(const std::string &flag) const { return switches.count(flag) != 0; }
};

/// Parses argv[first..] for `spec`. On a usage error prints the message and
/// the usage line to stderr and returns std::nullopt.
std::optional<Args> parseArgs(const CommandSpec &spec, int argc, char **argv, int first);

/// Checks every path of `args` before the command does any work: no input
/// path empty, every output (the spec's output flags, `moreOutputs` as
/// {what, path}, and standard output) none of the inputs (the positional
/// arguments, the spec's input flags and `moreInputs`) under any name
/// (kUsage), and every output writable where it points (kError). Prints the
/// error and returns its exit code, or kOk.
int checkOutputs(const CommandSpec &spec, const Args &args,
                 const std::vector<std::string> &moreInputs = {},
                 const std::vector<std::pair<std::string, std::string>> &moreOutputs = {});

/// Prints `spec`'s usage and help to stdout.
void printHelp(const CommandSpec &spec);

/// Writes `content` to `path` through a temporary file in the same folder,
/// so a failed run leaves nothing half-written. "-" writes to stdout.
/// On failure prints an error and returns false.
bool writeOutput(const std::string &path, const std::string &content);

} // namespace moec::cli

#endif // MOEC_TOOLS_MOEC_CLI_H
