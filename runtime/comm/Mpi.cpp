//===- Mpi.cpp - The MPI fabric's shared memory, windows and inboxes ------===//
//
// See Mpi.h for the protocol and MpiFabric.h for the classes: the memory
// every rank of a node maps (created after a bounded meeting of the ranks),
// the windows puts land in, the inboxes signals add to.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/MpiFabric.h"

namespace moec::comm::detail {

Status SharedMemory::create(MpiFabric &fabric, size_t bytes) {
  size = bytes;
  // MPI_Win_allocate_shared has no timeout: every rank meets first, bounded,
  // so that a rank whose peers do not come (an error on one rank between
  // two windows) gets an error instead of waiting in it. Two meetings: a
  // rank whose first one timed out never comes to the second (its fabric
  // is unusable), so a peer that came late fails there rather than
  // entering the collective alone (as in creating a fabric, below).
  for (const char *which : {"first", "second"})
    if (Status s = fabric.exchange(nullptr, 0, nullptr, fabric.options.timeoutSeconds); !s)
      return s.withPrefix(fmt::format("creating a window ({} meeting): ", which));
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void *mine = nullptr;
  const int rc = MPI_Win_allocate_shared(MPI_Aint(std::max<size_t>(bytes, 8)), 1, info,
                                         fabric.nodeComm, &mine, &win);
  MPI_Info_free(&info);
  MOEC_MPI(rc, fmt::format("MPI_Win_allocate_shared of {} bytes", bytes));
  MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
  base = static_cast<char *>(mine);
  std::memset(base, 0, std::max<size_t>(bytes, 8));
  peer.assign(fabric.count, nullptr);
  for (uint32_t p = 0; p < fabric.count; ++p) {
    if (p == fabric.me || fabric.nodeRank[p] < 0)
      continue;
    MPI_Aint theirSize = 0;
    int unit = 0;
    void *theirs = nullptr;
    MOEC_MPI(MPI_Win_shared_query(win, fabric.nodeRank[p], &theirSize, &unit, &theirs),
             "MPI_Win_shared_query");
    peer[p] = static_cast<char *>(theirs);
  }
  // No peer may write before every rank has zeroed its memory (MPI does
  // not zero it, and a fast peer's first put would be wiped): a bounded
  // meeting of every rank.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (Status s = fabric.exchange(nullptr, 0, nullptr, fabric.options.timeoutSeconds); !s)
    return s.withPrefix("creating a window: ");
  return Status::success();
}

MpiWindow::~MpiWindow() {
  owner.forgetWindow(id);
  memory.destroy();
}

MpiInbox::~MpiInbox() {
  owner.forgetInbox(id);
  memory.destroy();
}

size_t MpiInbox::counterCount() const { return size_t(count) * (2 + owner.count); }

uint64_t MpiInbox::signalledBy(uint32_t, uint32_t peer, uint32_t event) const {
  if (peer >= owner.count || event >= count)
    return kUnknown;
  return __atomic_load_n(&counters()[peerIndex(peer, event)], __ATOMIC_RELAXED);
}

uint64_t MpiInbox::lastSignaller(uint32_t, uint32_t event) const {
  if (event >= count)
    return kUnknown;
  const uint64_t last = __atomic_load_n(&counters()[lastIndex(event)], __ATOMIC_ACQUIRE);
  return last == 0 ? kUnknown : last - 1;
}

Status MpiInbox::signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) {
  if (DropPut::dropsSignal(peer))
    return Status::success();
  if (owner.sharesMemory(peer)) {
    // After this thread's stores of the rows (seq_cst orders them).
    uint64_t *theirs = reinterpret_cast<uint64_t *>(memory.peer[peer]);
    __atomic_fetch_add(&theirs[peerIndex(owner.me, event)], delta, __ATOMIC_RELAXED);
    __atomic_store_n(&theirs[lastIndex(event)], signaller(owner.me, task) + 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&theirs[event], delta, __ATOMIC_SEQ_CST);
    return Status::success();
  }
  return owner.sendSignal(id, peer, event, delta, task);
}

Status MpiInbox::read(uint32_t, uint64_t *values) {
  if (Status s = owner.progress(); !s)
    return s;
  const uint64_t *counters = this->counters();
  for (uint32_t e = 0; e < count; ++e)
    values[e] = __atomic_load_n(&counters[e], __ATOMIC_ACQUIRE);
  return Status::success();
}

} // namespace moec::comm::detail
