//===- CStatus.h - Status to the C APIs' moec_status_t ----------*- C++ -*-===//
//
// How the C APIs (runtime/api/CApi.cpp, RuntimeMpi.cpp, compiler/api/
// Moec.cpp) hand a Status to C: toCStatus, and guardedC, which also turns
// an exception into an error so that none crosses into C.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_CSTATUS_H
#define MOEC_BASE_CSTATUS_H

#include "base/Status.h"
#include "base/moec_status.h"

#include <exception>
#include <string>

namespace moec {

/// NULL for a success, else a new moec_status_t with its code and message
/// (or, when even that cannot be allocated, a static "out of memory" error
/// that moec_status_free leaves alone).
moec_status_t toCStatus(const Status &status);

/// The error status "internal error: `what`" ("internal error" for null);
/// never throws (the static out-of-memory status when memory is short).
moec_status_t internalErrorCStatus(const char *what) noexcept;

/// Runs `body` (which returns a Status) and returns its result as a
/// moec_status_t; an exception becomes an "internal error: ..." status, and
/// none leaves (not even one from making that status).
template <typename Body> moec_status_t guardedC(Body &&body) noexcept {
  try {
    return toCStatus(body());
  } catch (const std::exception &e) {
    return internalErrorCStatus(e.what());
  } catch (...) {
    return internalErrorCStatus(nullptr);
  }
}

} // namespace moec

#endif // MOEC_BASE_CSTATUS_H
