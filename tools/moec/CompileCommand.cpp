//===- CompileCommand.cpp - moec compile -----------------------------------===//

#include "compiler/driver/Compile.h"
#include "format/TaskBinary.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"
#include "tools/moec/GraphFrame.h"
#include "tools/moec/Progress.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>

using namespace mlir;
using namespace moec;
using namespace moec::moe;

namespace moec::cli {

const CommandSpec kCompileSpec = {
    "compile",
    "moec compile GRAPH --config CFG [--target PROFILE] [--granularity G] [--peer-groups N] "
    "[--no-lead-products] -o OUT [--time] [--progress | --no-progress]",
    "Compiles GRAPH (.json graph description or .mlir) for the model/parallel config\n"
    "CFG into a task binary: the graph pipeline (shapes, verification, slots, split\n"
    "propagation), then tile tasks with tiling descriptors, events from the tile\n"
    "maps, per-core queues ordered critical path first and balanced across cores,\n"
    "and a deadlock proof that simulates every rank of the EP group. One binary\n"
    "serves every rank. Prints a one-line summary to stderr.\n"
    "\n"
    "options:\n"
    "  --config CFG       model/parallel config (JSON; see docs/graph-format.md)\n"
    "  --target PROFILE   cpu (default: this machine's hardware threads), ascend-910b\n"
    "                     (24 cube + 48 vector cores), h100 (132 SMs), or a profile\n"
    "                     JSON file; a config's num_cube_cores/num_vector_cores win\n"
    "  --granularity G    per-tile-range (default): a consumer tile waits only for the\n"
    "                     producer tiles it reads; per-expert: for every producer tile\n"
    "                     of the experts it touches, as the seed does\n"
    "  --peer-groups N    automatic splits: cut each expert's rows into N groups by the\n"
    "                     rank they came from, so that a group's tiles start when its\n"
    "                     ranks' rows have arrived (1: no groups; past the EP degree, one a\n"
    "                     rank; default: the compiler tries 1, 4 and 16, at most one a rank\n"
    "                     and a GMM tile's rows (128 or more) a group; keeps the fastest)\n"
    "  --no-lead-products keep a LoRA adapter's first GMM (U = s X A) a GMM of its own\n"
    "                     tasks; by default, where its base adds U's product inside its\n"
    "                     tile (the cpu target), the base's tiles compute their rows of U\n"
    "                     first (X read once for both). The same bits either way\n"
    "  -o OUT             the task binary to write (required; written whole or not at all)\n"
    "  --time             print the time each phase took to stderr\n"
    "  --progress         print each step on stderr as it ends, even when stderr is not\n"
    "                     a terminal (on a terminal, a step that takes over half a\n"
    "                     second is shown as it runs)\n"
    "  --no-progress      no progress output\n",
    {"--config", "--target", "--granularity", "--peer-groups", "-o"},
    {"--time", "--progress", "--no-progress", "--no-lead-products"},
    1,
    1,
    {"-o"},
    {"--config", "--target"}};

namespace {
/// A --peer-groups value: 1..65536.
std::optional<int64_t> parsePeerGroups(const std::string &text) {
  if (text.empty() || text.size() > 5 || text.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  const int64_t n = std::stoll(text);
  if (n < 1 || n > 65536)
    return std::nullopt;
  return n;
}
} // namespace

int runCompile(int argc, char **argv, int first) {
  std::optional<Progress> progress;
  auto checkArgs = [&progress](const Args &args) {
    if (args.has("--progress") && args.has("--no-progress")) {
      std::fprintf(stderr, "moec compile: --progress and --no-progress exclude each other\n"
                           "usage: %s\n",
                   kCompileSpec.usage);
      return false;
    }
    const char *missing = !args.value("--config") ? "--config CFG"
                          : !args.value("-o")     ? "-o OUT"
                                                  : nullptr;
    if (missing) {
      std::fprintf(stderr, "moec compile: missing %s\nusage: %s\n", missing, kCompileSpec.usage);
      return false;
    }
    if (auto g = args.value("--granularity"); g && !lower::parseGranularity(*g)) {
      std::fprintf(stderr,
                   "moec compile: --granularity must be per-expert or per-tile-range, got '%s'\n"
                   "usage: %s\n",
                   g->c_str(), kCompileSpec.usage);
      return false;
    }
    if (auto g = args.value("--peer-groups"); g && !parsePeerGroups(*g)) {
      std::fprintf(stderr,
                   "moec compile: --peer-groups must be a whole number from 1 to 65536, got "
                   "'%s'\nusage: %s\n",
                   g->c_str(), kCompileSpec.usage);
      return false;
    }
    if (*args.value("-o") == "-") {
      std::fprintf(stderr, "moec compile: -o needs a file; a task binary is not for a terminal\n"
                           "usage: %s\n",
                   kCompileSpec.usage);
      return false;
    }
    progress.emplace("moec compile", progressMode(args.has("--progress"), args.has("--no-progress")));
    progress->begin("load");
    return true;
  };
  using Clock = std::chrono::steady_clock;
  Clock::time_point start = Clock::now();
  std::string summary; // printed once the binary is written
  auto body = [&](const Args &args, ModuleOp module, std::string &out) {
    const double loadMs = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    driver::CompileOptions options;
    options.configPath = *args.value("--config");
    options.target = args.value("--target").value_or("cpu");
    options.granularity =
        *lower::parseGranularity(args.value("--granularity").value_or("per-tile-range"));
    if (auto g = args.value("--peer-groups"))
      options.peerGroups = *parsePeerGroups(*g);
    options.leadProducts = !args.has("--no-lead-products");
    options.onStep = [&progress](const char *step) { progress->begin(step); };
    driver::CompileResult result;
    if (Status status = driver::compileModule(module, options, &result); !status) {
      Progress::abandonCurrent();
      std::fprintf(stderr, "error: %s\n", status.message().c_str());
      return int(kError);
    }
    for (const std::string &note : configNotes(result.config, options.configPath)) {
      Progress::abandonCurrent();
      std::fprintf(stderr, "note: %s\n", note.c_str());
    }
    progress->begin("write");
    Clock::time_point mark = Clock::now();
    std::vector<uint8_t> bytes = format::writeTaskBinary(result.program);
    out.assign(bytes.begin(), bytes.end());
    std::vector<std::pair<const char *, double>> phases = {{"load", loadMs}};
    phases.insert(phases.end(), result.phases.begin(), result.phases.end());
    phases.push_back(
        {"write", std::chrono::duration<double, std::milli>(Clock::now() - mark).count()});

    double total = 0;
    for (auto &[name, ms] : phases)
      total += ms;
    const format::TaskProgram &program = result.program;
    summary = fmt::format(
        "{}: {}, {} ops, {} tasks, {} events, {} cube + {} vector queues, "
        "{} bytes; estimated {:.3f} ms per pass (critical path {:.3f} ms) on {}; "
        "compiled in {:.1f} ms\n",
        *args.value("-o"), result.graphName, program.ops.size(), program.tasks.size(),
        program.events.size(), result.config.numCubeCores, result.config.numVectorCores,
        bytes.size(), result.estimate.makespan * 1e3, result.estimate.criticalPath * 1e3,
        result.profile.name, total);
    if (args.has("--time"))
      for (auto &[name, ms] : phases)
        summary += fmt::format("  {:<15} {:8.1f} ms\n", name, ms);
    return int(kOk);
  };
  return runOnGraph(kCompileSpec, argc, argv, first, checkArgs, body, [&] {
    progress->end();
    std::fputs(summary.c_str(), stderr);
  });
}

} // namespace moec::cli
