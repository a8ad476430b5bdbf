//===- CApi.h - What the C API's other libraries share ----------*- C++ -*-===//
//
// Internal to the runtime's C API: the creation of a moec_context from full
// ContextOptions, which moec_context_create_on (Runtime.cpp) and the MPI C
// API (RuntimeMpi.cpp, its own library) both use, so that the C API's
// context and error reporting live in one place.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_API_CAPI_H
#define MOEC_RUNTIME_API_CAPI_H

#include "runtime/api/Runtime.h"

namespace moec::rt::detail {

/// Creates a context of `forward` and `backward` (may be null) with
/// `options` into *out, as the C API does: 0, or an error code with
/// moec_last_error() set (its message starts with `who`).
int createCContext(const moec_program *forward, const moec_program *backward,
                   const ContextOptions &options, const char *who, moec_context **out);

/// Reports `status` as the C API does: 0, or its code with
/// moec_last_error() set.
int reportC(const Status &status);

/// The timeout a C entry point `who` was given: 0 is the default
/// (kDefaultTimeoutSeconds), else it must be in base/Time.h's range; the
/// error names `who`.
Status cTimeout(double seconds, const char *who, double *out);

} // namespace moec::rt::detail

#endif // MOEC_RUNTIME_API_CAPI_H
