//===- FabricBench.cpp - Put bandwidth of a fabric against memcpy -----------===//
//
//   mpirun -np 2 bazel-bin/tools/bench/fabric_bench [MiB [repeats]]
//
// Rank 0 puts blocks of 64 KiB .. MiB into rank 1's window (each put made
// visible with a signal, as a pass does); a put's time runs until its rows
// have landed in rank 1's window (a barrier, which waits for that, ends
// it). The same bytes are copied with memcpy in the same process, in the
// same run, so the fabric's cost is a ratio. Without mpirun it measures the
// in-process fabric of 2 ranks.
//
//===----------------------------------------------------------------------===//

#include "base/Time.h"
#include "runtime/comm/Mpi.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace moec;

namespace {

int fail(const Status &status) {
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  if (comm::launchedByMpi())
    comm::abortMpi(1);
  return 1;
}

} // namespace

int main(int argc, char **argv) {
  const char *usage =
      "usage: fabric_bench [MiB [repeats]]   (mpirun -np 2 for the MPI fabric)\n"
      "  rank 0 puts blocks of 64 KiB .. MiB (default 64) into rank 1's window,\n"
      "  each the best of `repeats` (default 20), against memcpy of the same bytes;\n"
      "  without mpirun, the in-process fabric of 2 ranks\n";
  if (argc > 1 && (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0)) {
    std::printf("%s", usage);
    return 0;
  }
  const size_t maxMiB = argc > 1 ? size_t(std::atol(argv[1])) : 64;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 20;
  if (maxMiB == 0 || repeats <= 0) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  std::shared_ptr<comm::Fabric> fabric;
  if (comm::launchedByMpi()) {
    if (Status s = comm::createMpiFabric(&fabric); !s)
      return fail(s);
  } else {
    fabric = comm::inProcessFabric(2);
  }
  if (fabric->ranks() < 2)
    return fail(Status::error("needs 2 ranks (mpirun -np 2)"));
  const size_t maxBytes = maxMiB << 20;
  std::unique_ptr<comm::Window> window;
  std::unique_ptr<comm::Inbox> inbox;
  if (Status s = fabric->createWindow(maxBytes, &window); !s)
    return fail(s);
  if (Status s = fabric->createInbox(1, &inbox); !s)
    return fail(s);
  const bool sender = fabric->isLocal(0);
  std::vector<char> src(maxBytes, 1), dst(maxBytes, 0);
  if (sender)
    std::printf("fabric: %s, rank 0 -> rank 1, best of %d\n%10s %12s %12s %9s\n", fabric->name(),
                repeats, "bytes", "put GB/s", "memcpy GB/s", "put/copy");
  for (size_t bytes = 64 << 10; bytes <= maxBytes; bytes *= 4) {
    if (Status s = fabric->barrier(60); !s)
      return fail(s);
    double best = 1e30, bestCopy = 1e30;
    for (int i = 0; i < repeats; ++i) {
      // From the put's start until the rows are in the peer's window: the
      // barrier returns once every put made to each rank has landed there.
      const Clock::time_point t0 = Clock::now();
      if (sender) {
        if (Status s = fabric->put(*window, 1, 0, bytes, src.data(), bytes, 1, bytes); !s)
          return fail(s);
        if (!fabric->allLocal())
          if (Status s = inbox->signal(1, 0, 1, 0); !s)
            return fail(s);
      }
      if (Status s = fabric->barrier(60); !s)
        return fail(s);
      best = std::min(best, secondsSince(t0));
      if (sender) {
        const Clock::time_point t1 = Clock::now();
        std::memcpy(dst.data(), src.data(), bytes);
        bestCopy = std::min(bestCopy, secondsSince(t1));
      }
    }
    if (sender)
      std::printf("%10zu %12.2f %12.2f %9.2f\n", bytes, double(bytes) / best * 1e-9,
                  double(bytes) / bestCopy * 1e-9, bestCopy / best);
  }
  if (Status s = fabric->barrier(60); !s)
    return fail(s);
  inbox.reset();
  window.reset();
  fabric.reset();
  comm::finalizeMpi();
  return 0;
}
