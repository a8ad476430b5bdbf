//===- Fabric.h - What a rank does to its peers -----------------*- C++ -*-===//
//
// A fabric connects the R ranks of an EP group. The runtime's pass needs
// five things of it, and nothing else crosses ranks:
//
//   window    receive memory of every rank, created by all ranks together
//             with the same size; a put writes rows into a peer's window
//   put       copy rows from this process into a peer's window at an offset
//   signal    add a delta to one of a peer's event counters (an inbox),
//             ordered after every put the calling thread made to that peer
//   exchange  every rank contributes a small block and receives all of them
//             (per-expert token counts before a pass, fingerprints at context
//             creation); it is also the point where ranks meet
//   barrier   complete every put and wait for every rank
//
// Two fabrics of the runtime implement it (a third, over a torch.distributed
// process group, lives with the torch op: ops/torch/csrc/GroupFabric.h):
//
//   in-process (inProcessFabric, here): all R ranks are threads of this
//     process; a window is R buffers, a put is a memcpy, events never leave
//     the executor, and an exchange is a copy.
//   MPI (runtime/comm/Mpi.h, a separate library): one process per rank;
//     between ranks on one node a window is shared memory, a put a store and
//     a signal an atomic add; between nodes a put and a signal are two-sided
//     messages, placed and applied in order by the receiver.
//
// exchange(), barrier(), finish() and gather() are bounded by a timeout, and
// a timeout is an error that names the ranks that did not arrive; a pass's
// waits for peers' signals are bounded by the executor's watchdog. Creating
// windows and inboxes and destroying them are plain MPI collectives without a
// timeout: the MPI fabric enters a creation (and its own, Mpi.h) only after
// bounded meetings of every rank, a rank that dies there ends the job through
// mpirun, and a job meets in finish() before it destroys them, so that none
// waits there for a rank that stopped. A rank whose job failed calls stopJob(): its peers'
// waits fail, and rank 0 prints every rank's report. A fabric's collectives
// (creation, exchange, barrier, finish, gather, destruction) are called from
// one thread at a time, in the same order on every rank; put() and
// Inbox::signal() from any thread.
//
// No MLIR/LLVM dependency; this header does not include MPI.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_COMM_FABRIC_H
#define MOEC_RUNTIME_COMM_FABRIC_H

#include "base/Memory.h"
#include "base/Status.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

namespace moec::comm {

/// Receive memory of every rank of the group, `bytes()` long on each, zeroed
/// when created.
class Window {
public:
  virtual ~Window() = default;
  /// The memory of rank `rank`, which must be a rank this process runs.
  virtual void *local(uint32_t rank) const = 0;
  /// The size of each rank's memory in bytes.
  virtual size_t bytes() const = 0;
};

/// Event counters that peers add to: `events()` 64-bit counters on every
/// rank (an executor's events of the ranks it does not run).
class Inbox {
public:
  virtual ~Inbox() = default;
  /// The number of counters per rank.
  virtual uint32_t events() const = 0;
  /// Adds `delta` to counter `event` of rank `peer` (not run by this
  /// process), once every put the calling thread made to `peer` is complete
  /// there; `task` (the signalling task of this process's rank) goes with
  /// it, for traces (lastSignaller). Called from many threads at once.
  virtual Status signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) = 0;
  /// Reads the counters of local rank `rank` into `values` [events()]. Each
  /// value is read atomically with respect to signals. Called from one thread
  /// at a time.
  virtual Status read(uint32_t rank, uint64_t *values) = 0;
  /// Zeroes the counters of every local rank. The caller makes sure that no
  /// peer signals them meanwhile (a pass resets its inbox once it is over,
  /// and peers signal the next pass only after its exchange).
  virtual void reset() = 0;
  /// What rank `peer` alone added to counter `event` of local rank `rank`
  /// since the last reset(), or kUnknown where the inbox does not keep it.
  /// For reports; read without ordering against signals.
  virtual uint64_t signalledBy(uint32_t rank, uint32_t peer, uint32_t event) const {
    (void)rank, (void)peer, (void)event;
    return kUnknown;
  }
  /// The rank and task of the latest signal applied to counter `event` of
  /// local rank `rank`, as rank << 32 | task, or kUnknown. Read after a
  /// counter moved, it names the signal that moved it last.
  virtual uint64_t lastSignaller(uint32_t rank, uint32_t event) const {
    (void)rank, (void)event;
    return kUnknown;
  }
  static constexpr uint64_t kUnknown = ~uint64_t(0);
};

/// Bytes of rows between this process's rank and one peer, counted since
/// the fabric was created: those it put to the peer, and those of the
/// peer's puts that have landed in its windows.
struct Traffic {
  uint64_t sent = 0;
  uint64_t arrived = 0;
};

/// The ranks of an EP group and the way they reach each other.
class Fabric {
public:
  virtual ~Fabric() = default;

  /// "in-process", "mpi" or "process-group".
  virtual const char *name() const = 0;
  /// R, the ranks of the group.
  virtual uint32_t ranks() const = 0;
  /// The ranks this process runs: firstLocal() .. firstLocal() + localRanks() - 1.
  virtual uint32_t firstLocal() const = 0;
  virtual uint32_t localRanks() const = 0;

  /// True when this process runs rank `rank`.
  bool isLocal(uint32_t rank) const {
    return rank >= firstLocal() && rank - firstLocal() < localRanks();
  }
  /// True when this process runs every rank.
  bool allLocal() const { return localRanks() == ranks(); }

  /// Creates a window of `bytes` per rank. Collective: every rank creates its
  /// windows in the same order with the same sizes.
  virtual Status createWindow(size_t bytes, std::unique_ptr<Window> *out) = 0;

  /// Creates an inbox of `events` counters per rank. Collective, like
  /// createWindow.
  virtual Status createInbox(uint32_t events, std::unique_ptr<Inbox> *out) = 0;

  /// Copies `rows` rows of `rowBytes` bytes from `src` (rows `srcStride`
  /// bytes apart) into `window` of rank `peer`, at byte `offset`, rows
  /// `dstStride` bytes apart. Called from many threads at once; the rows are
  /// at the peer once a later signal() of the same thread reaches it (or
  /// after barrier()).
  virtual Status put(const Window &window, uint32_t peer, size_t offset, size_t dstStride,
                     const void *src, size_t srcStride, size_t rows, size_t rowBytes) = 0;

  /// Every rank contributes `bytes` bytes per local rank (`mine` holds
  /// localRanks() blocks, in rank order), and `all` receives the blocks of
  /// all ranks() ranks, in rank order. Collective. Waits at most
  /// `timeoutSeconds` (<= 0: no limit) for the other ranks; the error names
  /// the ranks that did not come.
  virtual Status exchange(const void *mine, size_t bytes, void *all, double timeoutSeconds) = 0;

  /// Completes every put of this process, then waits for every rank to get
  /// here (bounded as exchange()).
  virtual Status barrier(double timeoutSeconds) = 0;

  /// Collects `bytes` bytes per local rank on the process that runs rank 0,
  /// into `all` (ranks() blocks in rank order; unused elsewhere).
  /// Collective.
  virtual Status gather(const void *mine, size_t bytes, void *all) = 0;

  /// The rows moved between this process's rank and `peer` (a fabric of one
  /// local rank per process; others return zeros).
  virtual Traffic traffic(uint32_t peer) const {
    (void)peer;
    return {};
  }

  /// Meets every rank at the end of a job, before the collectives that
  /// destroy windows and inboxes (which have no timeout): waits at most
  /// `timeoutSeconds` (<= 0: no limit) for every rank to get here, and
  /// fails at once when a peer stops the job meanwhile (stopJob).
  virtual Status finish(double timeoutSeconds) {
    return barrier(timeoutSeconds);
  }

  /// Stops a job that failed in this process and collects the report of
  /// every rank: tells every peer that the job stops (their next wait on
  /// the fabric fails, and they report too), and gathers the reports on
  /// rank 0, waiting at most `seconds` for them. `report` is this process's
  /// part. Returns what this process prints: on rank 0 every rank's part,
  /// naming the ranks that sent none; elsewhere nothing when rank 0 took the
  /// part, else a line saying that it did not (then the caller prints its
  /// part itself). Called once, from one thread; the fabric is unusable
  /// afterwards.
  virtual std::string stopJob(const std::string &report, double seconds) {
    (void)seconds;
    return report;
  }
};

/// Copies `rows` rows of `rowBytes` from `src` (`srcStride` apart) to `dst`
/// (`dstStride` apart): a put's rows, for the fabrics.
inline void copyRows(char *dst, size_t dstStride, const char *src, size_t srcStride,
                     size_t rows, size_t rowBytes) {
  if (rowBytes == srcStride && rowBytes == dstStride) {
    std::memcpy(dst, src, rows * rowBytes);
    return;
  }
  for (size_t i = 0; i < rows; ++i)
    std::memcpy(dst + i * dstStride, src + i * srcStride, rowBytes);
}

/// copyRows with the stores past the caches (base::streamCopyRows, four
/// rows side by side), then ordered before the stores after it: a put's
/// rows into a window that another core reads next (a peer's tile, the
/// combine after the pass).
inline void streamRows(char *dst, size_t dstStride, const char *src, size_t srcStride, size_t rows,
                       size_t rowBytes) {
  streamCopyRows(dst, dstStride, src, srcStride, rows, rowBytes);
  streamFence();
}

/// Returns the in-process fabric of `ranks` ranks, all run by this process.
std::shared_ptr<Fabric> inProcessFabric(uint32_t ranks);

} // namespace moec::comm

#endif // MOEC_RUNTIME_COMM_FABRIC_H
