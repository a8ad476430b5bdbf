//===- DumpCommand.cpp - moec dump -----------------------------------------===//

#include "base/File.h"
#include "compiler/target/Profile.h"
#include "format/TaskBinary.h"
#include "runtime/trace/Trace.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"
#include "compiler/inspect/Dump.h"

#include <fmt/format.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <vector>

using namespace moec;

namespace moec::cli {

const CommandSpec kDumpSpec = {
    "dump",
    "moec dump BIN [--core KIND:N] [--rank R] [--ops NAMES] [--target PROFILE] [--json [--compact] | "
    "--dot | --op-graph | --trace] [-o OUT]",
    "Prints what the task binary BIN holds: its header (format version, flags, size,\n"
    "CRC-32, EP ranks, local experts, target), tensor slots, ops with their task\n"
    "counts and tile grids, events with their signallers and waiters, and every\n"
    "core's queue (its first tasks; --core lists one queue in full). Then statistics:\n"
    "tasks per core kind, the deadlock proof over all ranks, the critical path (its\n"
    "tasks one by one), the simulated makespan and the balance of the queues of each\n"
    "core kind. Times come from the cost model of the target profile named in the\n"
    "header; without one (a profile file that is not at hand), the statistics are\n"
    "in task counts.\n"
    "\n"
    "options:\n"
    "  --core KIND:N      only the queue of core N of KIND (cube or vector), in full\n"
    "  --rank R           resolve rank-relative fields for rank R: peer offsets become\n"
    "                     peer ranks, local experts global ones (a dispatch tile names\n"
    "                     an expert of the rank its rows go to)\n"
    "  --ops NAMES        with --dot: only the tasks of these ops (comma-separated)\n"
    "  --target PROFILE   estimate costs with PROFILE (cpu, ascend-910b, h100, or a\n"
    "                     profile JSON file) instead of the header's target; warns when\n"
    "                     its core counts are not the binary's (the queues stay the\n"
    "                     binary's)\n"
    "  --json             print everything as one JSON object, every queue in full\n"
    "  --compact          with --json: no indentation, and each queue's tasks as rows\n"
    "                     of a table whose columns \"entry_columns\" names (waits as\n"
    "                     [event, threshold], signals as [event, increment, peer\n"
    "                     offset, or peer rank with --rank]; names only in \"ops\" and\n"
    "                     \"events\"): about a tenth of the size\n"
    "  --dot              print the task graph as Graphviz dot (--core, --ops and\n"
    "                     --rank select and label what is drawn)\n"
    "  --op-graph         print the op graph as Graphviz dot: ops, tensors, and tile\n"
    "                     and wait counts on the edges\n"
    "  --trace            write the simulated run of every rank as a Chrome/Perfetto\n"
    "                     trace (the format `moec run --trace` writes; needs -o)\n"
    "  -o OUT             write to OUT instead of stdout; with --dot or --op-graph, an\n"
    "                     OUT ending in .svg or .png is rendered by graphviz's dot\n"
    "\n"
    "Exits with 1 when BIN cannot be read, the core, rank or op does not exist, or\n"
    "the schedule deadlocks (the dump is printed, the explanation goes to stderr too).\n",
    {"--core", "--rank", "--target", "--ops", "-o"},
    {"--json", "--compact", "--dot", "--op-graph", "--trace"},
    1,
    1,
    {"-o"},
    {"--target"}};

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
bool readFacts(const std::string &path, inspect::FileFacts *facts, std::string *message) {
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

/// Returns "svg" or "png" when `path` ends in .svg or .png, else null.
const char *renderedFormat(const std::string &path) {
  for (const char *format : {"svg", "png"}) {
    std::string suffix = std::string(".") + format;
    if (path.size() > suffix.size() &&
        path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0)
      return format;
  }
  return nullptr;
}

/// Renders the dot text `dot` with graphviz into `path` (its format from
/// the suffix): in a temporary folder of its own, then written to `path` as
/// every output is (whole or not at all, through a symlink, into a device).
Status renderDot(const std::string &dot, const std::string &path) {
  std::string folder = std::filesystem::temp_directory_path().string() + "/moec-dot-XXXXXX";
  if (!::mkdtemp(folder.data()))
    return Status::error(fmt::format("{}: cannot create a temporary folder: {}", folder,
                                     std::strerror(errno)));
  struct Cleanup {
    std::string folder;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(folder, ec);
    }
  } cleanup{folder};
  const std::string dotFile = folder + "/graph.dot", rendered = folder + "/graph.out";
  if (Status status = writeFileAtomically(dotFile, {{dot.data(), dot.size()}}); !status)
    return status;
  auto quote = [](const std::string &text) {
    std::string out = "'";
    for (char c : text)
      out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return out + "'";
  };
  std::string command = fmt::format("dot -T{} -o {} {} 2>&1", renderedFormat(path),
                                    quote(rendered), quote(dotFile));
  std::string messages;
  int code = -1;
  if (FILE *pipe = popen(command.c_str(), "r")) {
    char buffer[512];
    while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe))
      messages.append(buffer, n);
    code = pclose(pipe);
  }
  if (code != 0) {
    if (code == 127 << 8 || messages.find("not found") != std::string::npos)
      return Status::error(fmt::format("{}: rendering needs graphviz's 'dot' on the PATH (Debian "
                                       "package graphviz); or write dot text to a .dot file",
                                       path));
    return Status::error(fmt::format("{}: graphviz's dot failed: {}", path, messages));
  }
  std::vector<uint8_t> bytes;
  if (Status status = readWholeFile(rendered, &bytes); !status)
    return status;
  return writeFileAtomically(path, {{bytes.data(), bytes.size()}});
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
  inspect::DumpOptions options;
  int formats = args->has("--json") + args->has("--dot") + args->has("--op-graph") +
                args->has("--trace");
  if (formats > 1)
    return usageError("--json, --dot, --op-graph and --trace are mutually exclusive");
  if (args->has("--trace") && args->value("-o").value_or("-") == "-")
    return usageError("--trace writes a file: give -o FILE");
  if (args->value("--ops") && !args->has("--dot"))
    return usageError("--ops selects what --dot draws; add --dot");
  if (int code = checkOutputs(kDumpSpec, *args); code != kOk)
    return code;
  if (args->has("--compact") && !args->has("--json"))
    return usageError("--compact is a form of --json; add --json");
  options.compact = args->has("--compact");
  if (auto ops = args->value("--ops")) {
    size_t begin = 0;
    for (;;) {
      size_t end = ops->find(',', begin);
      std::string name = ops->substr(begin, end == std::string::npos ? end : end - begin);
      if (name.empty())
        return usageError(fmt::format("--ops '{}': an empty op name", *ops));
      options.ops.push_back(name);
      if (end == std::string::npos)
        break;
      begin = end + 1;
    }
  }

  if (auto core = args->value("--core")) {
    inspect::CoreSelector selector;
    if (Status status = inspect::parseCoreSelector(*core, &selector); !status)
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
  inspect::FileFacts facts;
  if (std::string message; !readFacts(path, &facts, &message))
    return error(message);
  if (Status status = inspect::checkDumpOptions(program, options); !status)
    return error(fmt::format("{}: {}", path, status.message()));

  std::string output;
  bool deadlocked = false;
  std::string deadlock;
  const std::string outPath = args->value("-o").value_or("-");
  if (args->has("--dot") || args->has("--op-graph")) {
    if (args->has("--op-graph")) {
      output = inspect::dumpOpGraph(program);
    } else {
      size_t drawn = 0;
      if (Status status = inspect::dumpDot(program, options, &output, &drawn); !status)
        return error(fmt::format("{}: {}", path, status.message()));
      if (drawn > inspect::kLargeDotTasks)
        std::fprintf(stderr,
                     "moec dump: note: drawing %zu tasks; graphviz lays out graphs this large "
                     "slowly (select with --core KIND:N or --ops NAMES)\n",
                     drawn);
    }
    if (renderedFormat(outPath)) {
      if (Status status = renderDot(output, outPath); !status)
        return error(status.message());
      return kOk;
    }
  } else {
    inspect::Analysis analysis;
    if (Status status =
            inspect::analyzeBinary(program, args->value("--target"), args->has("--trace"), path,
                                   &analysis);
        !status)
      return error(status.message());
    for (const std::string &warning : analysis.warnings)
      std::fprintf(stderr, "moec dump: warning: %s: %s\n", path.c_str(), warning.c_str());
    if (!analysis.run.ok()) {
      deadlocked = true;
      deadlock = analysis.run.status.message();
    }
    if (args->has("--trace")) {
      if (deadlocked)
        return error(fmt::format("{}: {}", path, deadlock));
      if (Status status = trace::writeChromeTrace(program, analysis.run.trace, outPath, path);
          !status)
        return error(status.message());
      return kOk;
    }
    output = args->has("--json")
                 ? inspect::dumpJson(program, facts, options, analysis).dump(options.compact ? -1 : 2) +
                       "\n"
                                 : inspect::dumpText(program, facts, options, analysis);
  }

  if (!writeOutput(outPath, output))
    return kError;
  if (deadlocked)
    return error(fmt::format("{}: {}", path, deadlock));
  return kOk;
}

} // namespace moec::cli
