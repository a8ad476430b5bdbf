/* The runtime's C headers, compiled as C (C11), with nothing of moec's C++
 * beside them: a C program includes moec_runtime.h (and RuntimeMpi.h for
 * MPI contexts) alone, links the runtime, and reads its version. Fails to
 * compile if a C header pulls in C++; fails to run if the version query
 * disagrees with the format the runtime reads. */

#include "runtime/api/moec_runtime.h"
#include "runtime/api/RuntimeMpi.h"

#include <stdio.h>
#include <string.h>

int main(void) {
  uint32_t format = 0;
  const char *version = moec_runtime_version(&format);
  if (!version || strcmp(version, MOEC_VERSION_STRING) != 0 || format != 4) {
    fprintf(stderr, "moec_runtime_version: %s, format %u\n", version ? version : "(null)",
            (unsigned)format);
    return 1;
  }
  /* An error is readable from C: a binary that is not there gives a status
   * the caller owns, with its code and message; success is NULL. */
  moec_program *program = NULL;
  moec_status_t status = moec_program_load("/nonexistent/fwd.moebin", &program);
  if (status == MOEC_OK || program != NULL || moec_status_code(status) != MOEC_ERROR ||
      strstr(moec_status_message(status), "/nonexistent/fwd.moebin") == NULL) {
    fprintf(stderr, "moec_program_load of a missing file: %s\n", moec_status_message(status));
    moec_status_free(status);
    return 1;
  }
  moec_status_free(status);
  if (moec_status_code(MOEC_OK) != MOEC_STATUS_OK ||
      strcmp(moec_status_message(MOEC_OK), "") != 0) {
    fprintf(stderr, "the success status is not NULL's\n");
    return 1;
  }
  moec_status_free(MOEC_OK);
  printf("C API %s, task binary format %u\n", version, (unsigned)format);
  return 0;
}
