//===- DumpCommand.cpp - moec dump -----------------------------------------===//

#include "compiler/target/Profile.h"
#include "runtime/format/TaskBinary.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Dump.h"

#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>

using namespace moec;

namespace moec::cli {

const CommandSpec kDumpSpec = {
    "dump",
    "moec dump BIN [--core KIND:N] [--rank R] [--target PROFILE] [--json | --dot] [-o OUT]",
    "Prints what the task binary BIN holds: its header (format version, flags, size,\n"
    "CRC-32, EP ranks, local experts, target), tensor slots, ops with their task\n"
    "counts and tile grids, events with their signallers and waiters, and every\n"
    "core's queue (its first tasks; --core lists one queue in full). Then statistics:\n"
    "tasks per core kind, the deadlock proof over all ranks, the critical path, the\n"
    "simulated makespan and the balance of the queues of each core kind. Times come\n"
    "from the cost model of the target profile named in the header; without one\n"
    "(a profile file that is not at hand), the statistics are in task counts.\n"
    "\n"
    "options:\n"
    "  --core KIND:N      only the queue of core N of KIND (cube or vector), in full\n"
    "  --rank R           resolve rank-relative fields for rank R: peer offsets become\n"
    "                     peer ranks, local experts global ones (R * L + e)\n"
    "  --target PROFILE   estimate costs with PROFILE (cpu, ascend-910b, h100, or a\n"
    "                     profile JSON file) instead of the header's target\n"
    "  --json             print everything as one JSON object, every queue in full\n"
    "  --dot              print the task graph as Graphviz dot (at most 2000 tasks;\n"
    "                     with --core, that queue's tasks)\n"
    "  -o OUT             write to OUT instead of stdout\n"
    "\n"
    "Exits with 1 when BIN cannot be read, the core or rank does not exist, or the\n"
    "schedule deadlocks (the dump is printed, the explanation goes to stderr too).\n",
    {"--core", "--rank", "--target", "-o"},
    {"--json", "--dot"},
    1,
    1};

namespace {

/// Prints a usage error of `moec dump` and returns kUsage.
int usageError(const std::string &message) {
  std::fprintf(stderr, "moec dump: %s\nusage: %s\n(see 'moec dump --help')\n", message.c_str(),
               kDumpSpec.usage);
  return kUsage;
}

/// Prints an error of `moec dump` and returns kError.
int error(const std::string &message) {
  std::fprintf(stderr, "moec dump: %s\n", message.c_str());
  return kError;
}

/// Reads the size and checksum from the header of the file `path`, which
/// loadTaskBinaryFile has read and checked.
bool readFacts(const std::string &path, dump::FileFacts *facts, std::string *message) {
  std::ifstream in(path, std::ios::binary);
  format::FileHeader header;
  if (!in.read(reinterpret_cast<char *>(&header), sizeof(header))) {
    *message = fmt::format("{}: cannot read the header: {}", path, std::strerror(errno));
    return false;
  }
  facts->path = path;
  facts->fileSize = header.fileSize;
  facts->crc32 = header.crc32;
  return true;
}

} // namespace

int runDump(int argc, char **argv, int first) {
  std::optional<Args> args = parseArgs(kDumpSpec, argc, argv, first);
  if (!args)
    return kUsage;
  if (args->help) {
    printHelp(kDumpSpec);
    return kOk;
  }
  if (args->has("--json") && args->has("--dot"))
    return usageError("--json and --dot are mutually exclusive");

  dump::DumpOptions options;
  if (auto core = args->value("--core")) {
    dump::CoreSelector selector;
    if (Status status = dump::parseCoreSelector(*core, &selector); !status)
      return usageError(status.message());
    options.core = selector;
  }
  if (auto rank = args->value("--rank")) {
    char *end = nullptr;
    errno = 0;
    unsigned long long value = std::strtoull(rank->c_str(), &end, 10);
    if (rank->empty() || !std::isdigit(static_cast<unsigned char>((*rank)[0])) || *end != '\0' ||
        errno == ERANGE || value > UINT32_MAX)
      return usageError(fmt::format("bad rank '{}': expected a rank index (0, 1, ...)", *rank));
    options.rank = uint32_t(value);
  }

  const std::string &path = args->positional[0];
  format::TaskProgram program;
  if (Status status = format::loadTaskBinaryFile(path, &program); !status)
    return error(status.message());
  dump::FileFacts facts;
  if (std::string message; !readFacts(path, &facts, &message))
    return error(message);
  if (Status status = dump::checkDumpOptions(program, options); !status)
    return error(fmt::format("{}: {}", path, status.message()));

  std::string output;
  bool deadlocked = false;
  std::string deadlock;
  if (args->has("--dot")) {
    if (Status status = dump::dumpDot(program, options, &output); !status)
      return error(fmt::format("{}: {}", path, status.message()));
  } else {
    target::TargetProfile profile;
    bool haveProfile = false;
    std::string note;
    if (auto spec = args->value("--target")) {
      if (Status status = target::resolveProfile(*spec, &profile); !status)
        return error(fmt::format("--target: {}", status.message()));
      haveProfile = true;
    } else {
      std::string name(program.name(program.target));
      if (Status status = target::resolveProfile(name, &profile); status) {
        haveProfile = true;
      } else {
        note = fmt::format("the binary's target '{}' cannot be resolved here ({}); give "
                           "--target PROFILE for time estimates",
                           name, status.message());
      }
    }
    dump::Analysis analysis = dump::analyzeProgram(program, haveProfile ? &profile : nullptr, note);
    if (!analysis.run.ok()) {
      deadlocked = true;
      deadlock = analysis.run.status.message();
    }
    output = args->has("--json") ? dump::dumpJson(program, facts, options, analysis).dump(2) + "\n"
                                 : dump::dumpText(program, facts, options, analysis);
  }

  if (!writeOutput(args->value("-o").value_or("-"), output))
    return kError;
  if (deadlocked)
    return error(fmt::format("{}: {}", path, deadlock));
  return kOk;
}

} // namespace moec::cli
