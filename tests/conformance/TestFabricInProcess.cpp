//===- TestFabricInProcess.cpp - The suite on the in-process fabric ---------===//

#include "tests/conformance/TestFabric.h"

namespace moec::test {

std::shared_ptr<comm::Fabric> testFabric(uint32_t, bool *runs) {
  *runs = true;
  return nullptr;
}

const char *testFabricName() { return "in-process"; }

moec_status_t testCContext(const moec_program *forward, const moec_program *backward,
                           uint32_t workers, double timeoutSeconds, moec_context **out) {
  return moec_context_create(forward, backward, workers, timeoutSeconds, out);
}

} // namespace moec::test
