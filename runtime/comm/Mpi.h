//===- Mpi.h - The fabric of ranks that are MPI processes -------*- C++ -*-===//
//
// One process per rank of the EP group, over MPI-3 one-sided communication
// (OpenMPI from Debian). Rank r of the group is rank r of the communicator.
//
//   windows   MPI_Win_allocate, one passive-target epoch (MPI_Win_lock_all)
//             for the window's life, so a put of one tile overlaps the
//             matmuls of another: nothing waits for a fence
//   put       MPI_Put (an hvector type for rows with a stride)
//   signal    MPI_Win_flush of every data window to the peer (the puts are
//             complete at the target), then MPI_Accumulate(MPI_SUM) on the
//             peer's counter and a flush of that: a peer that sees the new
//             count sees the rows
//   read      MPI_Get_accumulate(MPI_NO_OP) of the local counters: atomic
//             with respect to the peers' accumulates
//   exchange  a mailbox window with two slots per rank (by the parity of the
//             exchange's sequence number): each rank puts its block into its
//             slot on every peer, then publishes the sequence number with an
//             atomic MPI_REPLACE after a flush; a rank polls its own mailbox
//             until every peer's number arrived, or the timeout names those
//             that did not. Two slots are enough: a rank can start exchange
//             n + 2 only after every peer has finished reading exchange n.
//
// MPI is initialized with MPI_THREAD_MULTIPLE (workers put and signal
// concurrently); a program that initialized MPI itself must have asked for
// that level. moec never finalizes MPI: the program does (finalizeMpi()).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_COMM_MPI_H
#define MOEC_RUNTIME_COMM_MPI_H

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
};

/// Initializes MPI (with MPI_THREAD_MULTIPLE) unless the program has, and
/// creates the fabric of MPI_COMM_WORLD: its size is R, its rank the rank
/// this process runs. Errors: MPI initialized at a lower thread level.
Status createMpiFabric(std::shared_ptr<Fabric> *out, const MpiOptions &options = {});

/// True when this process was started by an MPI launcher (mpirun sets
/// OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK), so that a tool can choose
/// the MPI fabric without being told.
bool launchedByMpi();

/// The rank of this process in MPI_COMM_WORLD from the launcher's
/// environment (before MPI is initialized), or 0.
int launcherRank();

/// Ends every rank of the job at once (MPI_Abort), for a rank that hit an
/// error the others cannot learn of in a bounded time.
[[noreturn]] void abortMpi(int code);

/// Finalizes MPI if moec initialized it and it is not finalized yet. Call
/// after every fabric and context is gone.
void finalizeMpi();

} // namespace moec::comm

#endif // MOEC_RUNTIME_COMM_MPI_H
