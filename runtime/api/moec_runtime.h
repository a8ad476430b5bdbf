/*===- moec_runtime.h - The moec runtime's C API ------------------*- C -*-===//
 *
 * The C face of the runtime (runtime/api/Runtime.h has the whole story and
 * the C++ API, of which this is a thin layer): programs, contexts, tensor
 * binding by name, routing, passes. Every call that can fail returns a
 * moec_status_t (base/moec_status.h): MOEC_OK (NULL), or an error the
 * caller frees with moec_status_free. It includes nothing of moec's but
 * base/Version.h and base/moec_status.h, and compiles as C or C++.
 *
 *===----------------------------------------------------------------------===*/

#ifndef MOEC_RUNTIME_API_MOEC_RUNTIME_H
#define MOEC_RUNTIME_API_MOEC_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "base/Version.h"
#include "base/moec_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/*===----------------------------------------------------------------------===*
 * C API
 *===----------------------------------------------------------------------===*/

/** Element types; the values equal the task binary's DType. */
typedef enum moec_dtype {
  MOEC_F32 = 1,
  MOEC_BF16 = 2, /**< bfloat16 bits, stored as uint16_t */
  MOEC_I32 = 3,
  MOEC_I64 = 4
} moec_dtype;

/** The most dims a tensor has. */
#define MOEC_MAX_DIMS 4

/** A dense row-major tensor the caller owns. */
typedef struct moec_tensor {
  void *data;
  moec_dtype dtype;
  int32_t ndim;                  /**< 0 .. MOEC_MAX_DIMS */
  int64_t dims[MOEC_MAX_DIMS];   /**< dims[i] for i < ndim */
} moec_tensor;

typedef struct moec_program moec_program; /**< a loaded task binary */
typedef struct moec_context moec_context; /**< an EP group's runtime state */

/** The version of the runtime library this program runs against,
 *  "MAJOR.MINOR.PATCH" (base/Version.h: compare with MOEC_VERSION_STRING,
 *  the header's), and, when `binary_format` is not null, the task binary
 *  format version it reads. */
const char *moec_runtime_version(uint32_t *binary_format);

/** Loads and validates the task binary at `path`. */
moec_status_t moec_program_load(const char *path, moec_program **out);

/** Frees a program (a context that uses it keeps its own reference); once
 *  per handle, null does nothing. */
void moec_program_free(moec_program *program);

/** Creates a context for `forward` and, when not null, `backward`, with
 *  `workers` threads (0: the hardware threads) and a watchdog of
 *  `timeout_seconds`: 0.001 to 1000000, or 0 for the default, 60 s; any
 *  other value (negative, NaN, infinite) is an error. */
moec_status_t moec_context_create(const moec_program *forward, const moec_program *backward,
                                  uint32_t workers, double timeout_seconds, moec_context **out);

/** moec_context_create on a backend: "cpu" (what moec_context_create uses)
 *  or "cuda" (every rank on one NVIDIA GPU; docs/runtime.md). */
moec_status_t moec_context_create_on(const moec_program *forward, const moec_program *backward,
                                     uint32_t workers, double timeout_seconds, const char *backend,
                                     moec_context **out);

/** Frees a context, waiting for a submitted pass first; once per handle,
 *  null does nothing. */
void moec_context_free(moec_context *context);

/** What the last forward pass's routing needed, valid after it ran or was
 *  refused for capacity: need[0] (token, k) rows of the fullest rank (the
 *  binary's limit: S * K), need[1] rows the experts of the fullest rank
 *  receive, need[2] rows the fullest expert receives, need[3] rows the
 *  largest put carries (one rank to one expert). */
moec_status_t moec_capacity_need(const moec_context *context, int64_t need[4]);

/** The number of ranks of the context's EP group. */
uint32_t moec_context_ranks(const moec_context *context);

/** The ranks this process runs: moec_context_first_rank ..
 *  + moec_context_local_ranks - 1 (all R in-process; one under MPI,
 *  runtime/api/RuntimeMpi.h). */
uint32_t moec_context_first_rank(const moec_context *context);
uint32_t moec_context_local_ranks(const moec_context *context);

/** Sets rank `rank`'s routing: topk_ids [S, K] (int32 or int64) and
 *  topk_weights [S, K] (f32). The data is read when a pass runs. */
moec_status_t moec_set_routing(moec_context *context, uint32_t rank, const moec_tensor *topk_ids,
                               const moec_tensor *topk_weights);

/** Binds rank `rank`'s tensor `name` (see the table above). */
moec_status_t moec_bind(moec_context *context, uint32_t rank, const char *name,
                        const moec_tensor *tensor);

/** Runs the forward pass on every rank and returns when it is done. */
moec_status_t moec_forward(moec_context *context);

/** Runs the backward pass (after a forward pass with the same routing). */
moec_status_t moec_backward(moec_context *context);

/** Starts the forward (or backward) pass on a thread of the context and
 *  returns; moec_wait returns its result. */
moec_status_t moec_submit_forward(moec_context *context);
moec_status_t moec_submit_backward(moec_context *context);
moec_status_t moec_wait(moec_context *context);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOEC_RUNTIME_API_MOEC_RUNTIME_H */
