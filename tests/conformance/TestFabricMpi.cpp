//===- TestFabricMpi.cpp - The suite with one rank per MPI process ----------===//
//
// The world fabric is created at the first case and kept; MPI is finalized
// at exit, after the fabric is gone (every context is gone by then: each
// lives in one test case).
//
//===----------------------------------------------------------------------===//

#include "runtime/api/RuntimeMpi.h"
#include "runtime/comm/Mpi.h"
#include "tests/conformance/TestFabric.h"

#include <cstdio>
#include <cstdlib>

namespace moec::test {

namespace {

std::shared_ptr<comm::Fabric> world;

void finalize() {
  world.reset();
  comm::finalizeMpi();
}

} // namespace

std::shared_ptr<comm::Fabric> testFabric(uint32_t ranks, bool *runs) {
  if (!world) {
    if (Status s = comm::createMpiFabric(&world); !s) {
      std::fprintf(stderr, "conformance: %s\n", s.message().c_str());
      std::exit(1);
    }
    std::atexit(finalize);
  }
  *runs = world->ranks() == ranks;
  return world;
}

const char *testFabricName() { return "mpi"; }

moec_status_t testCContext(const moec_program *forward, const moec_program *backward,
                           uint32_t workers, double timeoutSeconds, moec_context **out) {
  return moec_context_create_mpi(forward, backward, workers, timeoutSeconds, out);
}

} // namespace moec::test
