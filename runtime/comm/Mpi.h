//===- Mpi.h - The fabric of ranks that are MPI processes -------*- C++ -*-===//
//
// One process per rank of the EP group (OpenMPI from Debian, on its default
// transports). Rank r of the group is rank r of MPI_COMM_WORLD. Ranks on one
// node share memory; ranks on different nodes share none, and the fabric
// picks the path per pair of ranks (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)
// says which peers share this process's node):
//
//   windows   MPI_Win_allocate_shared over the node's ranks: every rank's
//             receive memory, which its node peers map directly
//   put       to a peer on this node: a store (memcpy) into its memory;
//             to a peer on another node: two-sided messages, a header on
//             the control tag (window, offset, stride, rows, and the tag of
//             the data), then the rows as one message that the receiver
//             takes straight into its window (small puts carry the rows in
//             the header). put() returns once the rows have left this
//             process (the source may be reused).
//   signal    to a node peer: an atomic add on its counter in shared memory,
//             after the stores; to another node: a control message after the
//             put's messages. The receiver applies a signal only once every
//             put whose header it matched before the signal has landed, and
//             MPI's order of the messages of one sender on one tag keeps a
//             thread's puts before its signal: a peer that sees the count
//             sees the rows.
//   progress  whoever waits drives it: the executor's supervising thread,
//             which polls the inbox (read()) all through a pass, an exchange
//             and a barrier. progress() matches control messages, posts the
//             receives of the rows they announce, and applies the signals
//             whose rows have landed. No thread of its own.
//   exchange  two-sided: each rank sends its block to every peer and
//             receives theirs, bounded by the timeout; the blocks carry the
//             exchange's sequence number, so ranks that run different
//             programs are told so.
//   barrier   every rank sends every peer the number of puts it made to it
//             (an exchange); each waits, bounded, until that many have landed.
//
// Every wait is bounded (MpiOptions::timeoutSeconds, and the executor's
// watchdog for a pass). MPI is initialized with MPI_THREAD_MULTIPLE (workers
// put and signal concurrently); a program that initialized MPI itself must
// have asked for that level. moec never finalizes MPI: the program does
// (finalizeMpi()).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_COMM_MPI_H
#define MOEC_RUNTIME_COMM_MPI_H

#include "base/Time.h"
#include "runtime/comm/Fabric.h"

#include <string>

namespace moec::comm {

/// Options of the MPI fabric.
struct MpiOptions {
  /// A measurement mode, not for real runs: every put copies its rows into
  /// this process's own window (at the offset it would have in the peer's)
  /// instead of the peer's, while signals still go to the peer. A pass then
  /// keeps its schedule and its synchronization but moves no data between
  /// processes, so its time against a normal pass is the communication that
  /// the schedule leaves exposed. The outputs are wrong.
  bool localPuts = false;

  /// How long a put or a signal to a peer on another node may wait for its
  /// messages to leave, and a barrier for the puts it expects to land;
  /// then it fails with an error naming the peer. <= 0: no limit.
  double timeoutSeconds = kDefaultTimeoutSeconds;

  /// Treat every peer as one on another node (no shared memory between
  /// processes), as if each rank ran on a host of its own: tests the
  /// cross-node path on one machine.
  bool noSharedMemory = false;
};

/// Initializes MPI (with MPI_THREAD_MULTIPLE) unless the program has, and
/// creates the fabric of MPI_COMM_WORLD: its size is R, its rank the rank
/// this process runs. Collective: every rank creates its fabrics in the same
/// order. Before the collectives that make the fabric's communicators and
/// its first window (which have no timeout), the ranks meet with
/// point-to-point messages, each wait bounded by options.timeoutSeconds
/// (<= 0: no limit): a rank whose peers do not come to create the same
/// fabric (their N-th, counted per process) gets an error naming them
/// instead of waiting without end. Errors: MPI initialized at a lower
/// thread level; ranks that did not come. MOEC_MPI_NO_SHARED_MEMORY=1 in
/// the environment sets options.noSharedMemory.
Status createMpiFabric(std::shared_ptr<Fabric> *out, const MpiOptions &options = {});

/// True when this process was started by an MPI launcher (mpirun sets
/// OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK), so that a tool can choose
/// the MPI fabric without being told.
bool launchedByMpi();

/// The rank of this process in MPI_COMM_WORLD from the launcher's
/// environment (before MPI is initialized), or 0.
int launcherRank();

/// The number of processes the launcher started (1 when not started by one).
int launcherSize();

/// Ends every rank of the job at once (MPI_Abort), for a rank that hit an
/// error the others cannot learn of in a bounded time.
[[noreturn]] void abortMpi(int code);

/// Finalizes MPI if moec initialized it and it is not finalized yet. Call
/// after every fabric and context is gone.
void finalizeMpi();

} // namespace moec::comm

#endif // MOEC_RUNTIME_COMM_MPI_H
