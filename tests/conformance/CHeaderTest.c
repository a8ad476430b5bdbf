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
  if (!version || strcmp(version, MOEC_VERSION_STRING) != 0 || format != 2) {
    fprintf(stderr, "moec_runtime_version: %s, format %u\n", version ? version : "(null)",
            (unsigned)format);
    return 1;
  }
  /* An error is readable from C: a binary that is not there. */
  moec_program *program = NULL;
  if (moec_program_load("/nonexistent/fwd.moebin", &program) == 0 || program != NULL ||
      strstr(moec_last_error(), "/nonexistent/fwd.moebin") == NULL) {
    fprintf(stderr, "moec_program_load of a missing file: %s\n", moec_last_error());
    return 1;
  }
  printf("C API %s, task binary format %u\n", version, (unsigned)format);
  return 0;
}
