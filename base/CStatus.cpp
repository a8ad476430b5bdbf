//===- CStatus.cpp - The C APIs' moec_status_t -----------------------------===//

#include "base/CStatus.h"

#include <new>

struct moec_status_object {
  moec_status_code_t code;
  std::string message;
};

namespace {

/// What toCStatus returns when it cannot allocate a status: never freed.
moec_status_object outOfMemory{MOEC_ERROR, "out of memory (making an error status)"};

} // namespace

namespace moec {

static_assert(int(StatusCode::Ok) == MOEC_STATUS_OK && int(StatusCode::Error) == MOEC_ERROR &&
                  int(StatusCode::OverCapacity) == MOEC_OVER_CAPACITY,
              "moec_status_code mirrors moec::StatusCode");

moec_status_t toCStatus(const Status &status) {
  if (status.ok())
    return MOEC_OK;
  try {
    return new moec_status_object{moec_status_code_t(status.code()), status.message()};
  } catch (const std::bad_alloc &) {
    return &outOfMemory;
  }
}

moec_status_t internalErrorCStatus(const char *what) noexcept {
  try {
    return toCStatus(
        Status::error(what ? std::string("internal error: ") + what : "internal error"));
  } catch (...) {
    return &outOfMemory;
  }
}

} // namespace moec

extern "C" moec_status_code_t moec_status_code(moec_status_t status) {
  return status ? status->code : MOEC_STATUS_OK;
}

extern "C" const char *moec_status_message(moec_status_t status) {
  return status ? status->message.c_str() : "";
}

extern "C" void moec_status_free(moec_status_t status) {
  if (status != &outOfMemory)
    delete status;
}
