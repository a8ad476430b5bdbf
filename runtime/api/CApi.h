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
/// `options` into *out, as the C API does: MOEC_OK, or an error whose
/// message starts with `who`.
moec_status_t createCContext(const moec_program *forward, const moec_program *backward,
                             const ContextOptions &options, const char *who, moec_context **out);

/// The timeout a C entry point `who` was given: 0 is the default
/// (kDefaultTimeoutSeconds), else it must be in base/Time.h's range; the
/// error names `who`.
Status cTimeout(double seconds, const char *who, double *out);

} // namespace moec::rt::detail

#endif // MOEC_RUNTIME_API_CAPI_H
