//===- Main.cpp - moec: the command dispatcher -----------------------------===//

#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"

#include "base/File.h"
#include "base/Version.h"
#include "format/TaskBinary.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fcntl.h>
#include <unistd.h>

namespace {

const char *kTopHelp =
    "usage: moec <command> [options]\n"
    "\n"
    "moec compiles graph descriptions of fused MoE-FFN layers (forward and\n"
    "backward) for a model/parallel config into task binaries: per-core task\n"
    "queues, events and tiling descriptors that one EP group runs on cube and\n"
    "vector cores, and runs them on the CPU runtime: R ranks in one process or\n"
    "one per MPI process, logical cores multiplexed onto worker threads.\n"
    "\n"
    "commands:\n"
    "  check    resolve shapes for a config, verify the graph, propagate splits,\n"
    "           and print each op's task count and tile dependencies\n"
    "  compile  compile a graph for a config and target into a task binary\n"
    "  dump     print what a task binary holds: header, slots, ops, events,\n"
    "           per-core queues, critical path, makespan and queue balance\n"
    "  run      run a forward (and backward) binary on R ranks, in one process\n"
    "           or one per process under mpirun (across hosts too), on .npy or\n"
    "           random inputs; --verify checks against the reference\n"
    "  bench    measure the FMA peak, GMM tiles as a share of it, and whole\n"
    "           layers fused against op by op, uniform and skewed, 1/2/4 ranks\n"
    "  import   convert a JSON graph description to the moe dialect (.mlir)\n"
    "  export   convert a moe dialect graph (.mlir) to a JSON description\n"
    "\n"
    "'moec <command> --help' describes a command; 'moec --version' prints\n"
    "moec's version and the task binary format it writes and reads. Exit\n"
    "codes: 0 success, 1 error, 2 usage error.\n";

/// Holds the standard descriptors a parent closed with a file that cannot be
/// written, so that no file moec opens becomes its standard output by
/// accident, and a print to a closed stdout fails (and is reported).
void holdClosedStandardDescriptors() {
  for (int fd = 0; fd <= 2; ++fd)
    if (::fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
      const int held = ::open("/dev/null", O_RDONLY);
      if (held >= 0 && held != fd) {
        ::dup2(held, fd);
        ::close(held);
      }
    }
}

int dispatch(int argc, char **argv);

} // namespace

int main(int argc, char **argv) {
  holdClosedStandardDescriptors();
  moec::removeTemporariesOnSignal();
  const int code = dispatch(argc, argv);
  // What a command printed must have reached its reader: a full disk or a
  // closed stdout is an error, not a success.
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::fprintf(stderr, "moec: cannot write to standard output: %s\n",
                 errno ? std::strerror(errno) : "write error");
    return code == moec::cli::kOk ? moec::cli::kError : code;
  }
  return code;
}

namespace {

int dispatch(int argc, char **argv) {
  using namespace moec::cli;
  if (argc < 2) {
    std::fputs(kTopHelp, stderr);
    return kUsage;
  }
  std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    std::fputs(kTopHelp, stdout);
    return kOk;
  }
  if (cmd == "--version") {
    std::printf("moec %s (task binary format %u)\n", MOEC_VERSION_STRING,
                unsigned(moec::format::kFormatVersion));
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

} // namespace
