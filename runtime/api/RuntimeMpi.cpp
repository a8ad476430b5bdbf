//===- RuntimeMpi.cpp - The C API of contexts whose ranks are MPI processes -===//

#include "runtime/api/RuntimeMpi.h"

#include "base/CStatus.h"
#include "runtime/api/CApi.h"
#include "runtime/comm/Mpi.h"

extern "C" {

moec_status_t moec_context_create_mpi(const moec_program *forward, const moec_program *backward,
                                      uint32_t workers, double timeout_seconds,
                                      moec_context **out) {
  moec::rt::ContextOptions options;
  options.workers = workers;
  if (moec::Status s = moec::rt::detail::cTimeout(timeout_seconds, "moec_context_create_mpi",
                                                  &options.timeoutSeconds);
      !s)
    return moec::toCStatus(s);
  moec::comm::MpiOptions mpi;
  mpi.timeoutSeconds = options.timeoutSeconds;
  if (moec::Status s = moec::comm::createMpiFabric(&options.fabric, mpi); !s)
    return moec::toCStatus(s.withPrefix("moec_context_create_mpi: "));
  return moec::rt::detail::createCContext(forward, backward, options, "moec_context_create_mpi",
                                          out);
}

void moec_mpi_finalize(void) { moec::comm::finalizeMpi(); }

} // extern "C"
