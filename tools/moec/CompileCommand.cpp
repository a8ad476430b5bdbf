//===- CompileCommand.cpp - moec compile -----------------------------------===//

#include "compiler/config/Config.h"
#include "compiler/lower/Lower.h"
#include "compiler/target/Profile.h"
#include "compiler/target/Schedule.h"
#include "compiler/target/Simulate.h"
#include "compiler/transforms/Passes.h"
#include "runtime/format/TaskBinary.h"
#include "tools/moec/Cli.h"
#include "tools/moec/GraphFrame.h"

#include "mlir/Pass/PassManager.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>

using namespace mlir;
using namespace moec;
using namespace moec::moe;

namespace moec::cli {

const CommandSpec kCompileSpec = {
    "compile",
    "moec compile GRAPH --config CFG [--target PROFILE] [--granularity G] -o OUT [--time]",
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
    "  -o OUT             the task binary to write (required; written whole or not at all)\n"
    "  --time             print the time each phase took to stderr\n",
    {"--config", "--target", "--granularity", "-o"},
    {"--time"},
    1,
    1};

int runCompile(int argc, char **argv, int first) {
  auto checkArgs = [](const Args &args) {
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
    if (*args.value("-o") == "-") {
      std::fprintf(stderr, "moec compile: -o needs a file; a task binary is not for a terminal\n"
                           "usage: %s\n",
                   kCompileSpec.usage);
      return false;
    }
    return true;
  };
  using Clock = std::chrono::steady_clock;
  Clock::time_point start = Clock::now();
  std::string summary; // printed once the binary is written
  auto body = [&](const Args &args, ModuleOp module, std::string &out) {
    auto fail = [](const std::string &message) {
      std::fprintf(stderr, "error: %s\n", message.c_str());
      return int(kError);
    };
    std::vector<std::pair<const char *, double>> phases;
    Clock::time_point mark = Clock::now();
    auto phase = [&](const char *name) {
      Clock::time_point now = Clock::now();
      phases.push_back({name, std::chrono::duration<double, std::milli>(now - mark).count()});
      mark = now;
    };
    phases.push_back(
        {"load", std::chrono::duration<double, std::milli>(mark - start).count()});

    std::string cfgPath = *args.value("--config"), error;
    ModelConfig config;
    if (!loadConfig(cfgPath, &config, &error))
      return fail(error);
    std::string targetSpec = args.value("--target").value_or("cpu");
    lower::LowerOptions options;
    if (Status status = target::resolveProfile(targetSpec, &options.profile); !status)
      return fail(status.message());
    options.granularity =
        *lower::parseGranularity(args.value("--granularity").value_or("per-tile-range"));
    setDefaultCoreCounts(&config, options.profile.cubeCores, options.profile.vectorCores);

    PassManager pm(module.getContext());
    buildGraphPipeline(pm, cfgPath, targetSpec);
    if (failed(pm.run(module)))
      return int(kError);
    phase("graph passes");
    GraphOp graph = *module.getOps<GraphOp>().begin();
    format::TaskProgram program;
    if (failed(lower::lowerGraph(graph, options, &program)))
      return int(kError);
    phase("lower");
    target::ScheduleEstimate estimate;
    if (Status status = target::scheduleQueues(&program, options.profile,
                                               uint32_t(config.numCubeCores),
                                               uint32_t(config.numVectorCores), &estimate);
        !status)
      return fail(status.message());
    phase("schedule");
    if (Status status = target::proveDeadlockFree(program); !status)
      return fail(status.message());
    phase("deadlock proof");
    if (Status status = format::validateTaskProgram(program); !status)
      return fail("the compiled program is invalid: " + status.message());
    std::vector<uint8_t> bytes = format::writeTaskBinary(program);
    out.assign(bytes.begin(), bytes.end());
    phase("write");

    double total = 0;
    for (auto &[name, ms] : phases)
      total += ms;
    summary = fmt::format(
                 "{}: {}, {} ops, {} tasks, {} events, {} cube + {} vector queues, "
                 "{} bytes; estimated {:.3f} ms per pass (critical path {:.3f} ms) on {}; "
                 "compiled in {:.1f} ms\n",
                 *args.value("-o"), graph.getSymName().str(), program.ops.size(),
                 program.tasks.size(), program.events.size(), config.numCubeCores,
                 config.numVectorCores, bytes.size(), estimate.makespan * 1e3,
                 estimate.criticalPath * 1e3, options.profile.name, total);
    if (args.has("--time"))
      for (auto &[name, ms] : phases)
        summary += fmt::format("  {:<15} {:8.1f} ms\n", name, ms);
    return int(kOk);
  };
  return runOnGraph(kCompileSpec, argc, argv, first, checkArgs, body,
                    [&] { std::fputs(summary.c_str(), stderr); });
}

} // namespace moec::cli
