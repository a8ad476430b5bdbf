/*===- RuntimeMpi.h - The C API of contexts whose ranks are MPI processes -===*
 *
 * The C API of runtime/api/moec_runtime.h makes in-process contexts; this one,
 * in a library of its own (//runtime/api:mpi, which links MPI), makes a
 * context whose ranks are the processes of MPI_COMM_WORLD (the MPI fabric,
 * runtime/comm/Mpi.h: shared memory between ranks of a node, two-sided
 * messages between nodes, OpenMPI's defaults). This process runs one rank,
 * moec_context_first_rank(); bind and route only that rank. Creating,
 * forward and backward are collective: every process calls them, in the
 * same order. A program that does not link this library never links MPI.
 *
 *===----------------------------------------------------------------------===*/

#ifndef MOEC_RUNTIME_API_RUNTIMEMPI_H
#define MOEC_RUNTIME_API_RUNTIMEMPI_H

#include "runtime/api/moec_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Creates a context of `forward` and, when not null, `backward` whose EP
 *  group is MPI_COMM_WORLD (its size must be the binaries' R), with
 *  `workers` threads in this process (0: the hardware threads) and a
 *  watchdog and MPI waits of `timeout_seconds` (0.001 to 10^6, or 0: the
 *  default, 60 s; anything else is an error, as moec_context_create). Initializes
 *  MPI with MPI_THREAD_MULTIPLE unless the program has (then it must have
 *  asked for that level). Collective. */
moec_status_t moec_context_create_mpi(const moec_program *forward, const moec_program *backward,
                                      uint32_t workers, double timeout_seconds, moec_context **out);

/** Finalizes MPI if moec initialized it; call once every context is freed. */
void moec_mpi_finalize(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEC_RUNTIME_API_RUNTIMEMPI_H */
