//===- Hooks.cpp - Test and measurement hooks of the fabrics -------------===//

#include "runtime/comm/Hooks.h"

#include "base/Env.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace moec::comm {

namespace {
thread_local int64_t dropNextSignalTo = -1;

/// The variable's value, or null when it is unset or empty. In a build
/// without hooks, null always, and a set variable is said once on stderr.
const char *hookVariable(const char *name) {
  const char *value = envValue(name);
  if (!value)
    return nullptr;
  if (testHooksBuilt())
    return value;
  static std::once_flag said[2];
  std::call_once(said[std::strcmp(name, "MOEC_LOCAL_PUTS") == 0], [name] {
    std::fprintf(stderr,
                 "moec: %s is set, but this build has no test hooks; ignored (they are "
                 "compiled into test builds: bazel test, or bazel build --config=hooks)\n",
                 name);
  });
  return nullptr;
}
} // namespace

bool testHooksBuilt() {
#ifdef MOEC_TEST_HOOKS
  return true;
#else
  return false;
#endif
}

Status DropPut::fromEnvironment(uint32_t ranks, DropPut *out) {
  *out = DropPut{};
  const char *value = hookVariable("MOEC_TEST_DROP_PUT");
  if (!value)
    return Status::success();
  long long rank = -1;
  unsigned long long nth = 0;
  char end = 0;
  if (std::sscanf(value, "%lld:%llu%c", &rank, &nth, &end) != 2 || rank < 0 || nth == 0)
    return Status::error(envShown("MOEC_TEST_DROP_PUT", value) +
                         ": expected RANK:N (N >= 1), e.g. 1:3 for the third put rank 1 makes "
                         "to a peer");
  if (rank >= ranks)
    return Status::error(envShown("MOEC_TEST_DROP_PUT", value) + ": there is no rank " +
                         std::to_string(rank) + " (the group has " + std::to_string(ranks) +
                         " ranks)");
  *out = DropPut{rank, nth};
  return Status::success();
}

bool DropPut::dropsPut(uint32_t me, uint32_t peer, std::atomic<uint64_t> &puts) const {
  if (rank != int64_t(me) || puts.fetch_add(1) + 1 != nth)
    return false;
  dropNextSignalTo = peer;
  std::fprintf(stderr,
               "moec: rank %u: MOEC_TEST_DROP_PUT=%lld:%llu: this rank's put number %llu to a "
               "peer (to rank %u) and the signal after it are dropped (a test hook)\n",
               me, static_cast<long long>(rank), static_cast<unsigned long long>(nth),
               static_cast<unsigned long long>(nth), peer);
  return true;
}

bool DropPut::dropsSignal(uint32_t peer) {
  if (dropNextSignalTo != int64_t(peer))
    return false;
  dropNextSignalTo = -1;
  return true;
}

bool localPutsRequested() {
  const char *value = hookVariable("MOEC_LOCAL_PUTS");
  return value && std::strcmp(value, "0") != 0;
}

} // namespace moec::comm
