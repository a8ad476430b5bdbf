//===- Hooks.h - Test and measurement hooks of the fabrics ------*- C++ -*-===//
//
// What the environment asks of the fabrics of several processes (the MPI
// fabric, and the torch op's fabric over a torch.distributed group), for
// tests and measurements, never for real runs.
//
// MOEC_TEST_DROP_PUT=RANK:N makes rank RANK drop the N-th put it makes to
// another rank, and the signal that follows it from the same thread to the
// same peer: the peer then waits for that signal as it would for a message
// lost on its way, which is how the tests reach the watchdog and the report
// of a stopped job.
//
// MOEC_LOCAL_PUTS=1 makes every put copy into the process's own window (at
// the offset it would have in the peer's) while the signals still cross: a
// pass keeps its schedule and moves no rows, so its time against a normal
// pass is the communication the schedule leaves exposed. The outputs are
// wrong.
//
// Both are compiled in only with the Bazel define moec_test_hooks=1, which
// `bazel test` sets (.bazelrc, --config=hooks): a release build ignores the
// variables and says so once on stderr, so that a user's environment cannot
// drop a put of a real job or make its outputs wrong.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_COMM_HOOKS_H
#define MOEC_RUNTIME_COMM_HOOKS_H

#include "base/Status.h"

#include <atomic>
#include <cstdint>

namespace moec::comm {

struct DropPut {
  int64_t rank = -1; ///< -1: no put is dropped
  uint64_t nth = 0;

  /// The hook as MOEC_TEST_DROP_PUT says for a group of `ranks` ranks (none
  /// when it is unset or empty, or in a build without test hooks); an error
  /// naming the value when it is not RANK:N with RANK < ranks and N >= 1.
  static Status fromEnvironment(uint32_t ranks, DropPut *out);

  /// Counts, in `puts`, a put that rank `me` makes to `peer`: true when it
  /// is the one to drop (said on stderr, naming the variable); the calling
  /// thread's next signal to `peer` is then dropped too (dropsSignal).
  bool dropsPut(uint32_t me, uint32_t peer, std::atomic<uint64_t> &puts) const;

  /// True, once, for the calling thread's signal to `peer` after a dropped
  /// put.
  static bool dropsSignal(uint32_t peer);
};

/// True when MOEC_LOCAL_PUTS asks for puts into the process's own memory
/// (set, and neither empty nor "0"), in a build with test hooks.
bool localPutsRequested();

/// True when this build has the hooks (the moec_test_hooks define).
bool testHooksBuilt();

} // namespace moec::comm

#endif // MOEC_RUNTIME_COMM_HOOKS_H
