//===- Hooks.cpp - Test and measurement hooks of the fabrics -------------===//

#include "runtime/comm/Hooks.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace moec::comm {

namespace {
thread_local int64_t dropNextSignalTo = -1;
} // namespace

Status DropPut::fromEnvironment(DropPut *out) {
  *out = DropPut{};
  const char *value = std::getenv("MOEC_TEST_DROP_PUT");
  if (!value)
    return Status::success();
  long long rank = -1;
  unsigned long long nth = 0;
  if (std::sscanf(value, "%lld:%llu", &rank, &nth) != 2 || rank < 0 || nth == 0)
    return Status::error("MOEC_TEST_DROP_PUT='" + std::string(value) +
                         "': expected RANK:N (N >= 1), e.g. 1:3 for the third put rank 1 makes "
                         "to a peer");
  *out = DropPut{rank, nth};
  return Status::success();
}

bool DropPut::dropsPut(uint32_t me, uint32_t peer, std::atomic<uint64_t> &puts) const {
  if (rank != int64_t(me) || puts.fetch_add(1) + 1 != nth)
    return false;
  dropNextSignalTo = peer;
  return true;
}

bool DropPut::dropsSignal(uint32_t peer) {
  if (dropNextSignalTo != int64_t(peer))
    return false;
  dropNextSignalTo = -1;
  return true;
}

bool localPutsRequested() {
  const char *value = std::getenv("MOEC_LOCAL_PUTS");
  return value && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

} // namespace moec::comm
