//===- Main.cpp - moec: the command dispatcher -----------------------------===//

#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"

#include "base/File.h"

#include <cstdio>

namespace {

const char *kTopHelp =
    "usage: moec <command> [options]\n"
    "\n"
    "moec compiles graph descriptions of fused MoE-FFN layers (forward and\n"
    "backward) for a model/parallel config into task binaries: per-core task\n"
    "queues, events and tiling descriptors that one EP group runs on cube and\n"
    "vector cores, and runs them on the CPU runtime: R ranks in one process,\n"
    "logical cores multiplexed onto worker threads.\n"
    "\n"
    "commands:\n"
    "  check    resolve shapes for a config, verify the graph, propagate splits,\n"
    "           and print each op's task count and tile dependencies\n"
    "  compile  compile a graph for a config and target into a task binary\n"
    "  dump     print what a task binary holds: header, slots, ops, events,\n"
    "           per-core queues, critical path, makespan and queue balance\n"
    "  run      run a forward (and backward) binary on R in-process ranks, on\n"
    "           .npy or random inputs; --verify checks against the reference\n"
    "  bench    measure the FMA peak, GMM tiles as a share of it, and whole\n"
    "           layers fused against op by op, uniform and skewed, 1/2/4 ranks\n"
    "  import   convert a JSON graph description to the moe dialect (.mlir)\n"
    "  export   convert a moe dialect graph (.mlir) to a JSON description\n"
    "\n"
    "'moec <command> --help' describes a command. Exit codes: 0 success,\n"
    "1 error, 2 usage error.\n";

} // namespace

int main(int argc, char **argv) {
  using namespace moec::cli;
  moec::removeTemporariesOnSignal();
  if (argc < 2) {
    std::fputs(kTopHelp, stderr);
    return kUsage;
  }
  std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    std::fputs(kTopHelp, stdout);
    return kOk;
  }
  if (cmd == "check")
    return runCheck(argc, argv, 2);
  if (cmd == "compile")
    return runCompile(argc, argv, 2);
  if (cmd == "dump")
    return runDump(argc, argv, 2);
  if (cmd == "run")
    return runRun(argc, argv, 2);
  if (cmd == "bench")
    return runBench(argc, argv, 2);
  if (cmd == "import")
    return runImport(argc, argv, 2);
  if (cmd == "export")
    return runExport(argc, argv, 2);
  std::fprintf(stderr, "moec: unknown command '%s'\n\n%s", cmd.c_str(), kTopHelp);
  return kUsage;
}
