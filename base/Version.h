/*===- Version.h - moec's version -------------------------------*- C -*-===*
 *
 * The one place moec's version is written. Both C APIs (runtime/api/Runtime.h,
 * compiler/api/moec.h) include it, and give the version of the library a
 * program runs against (moec_runtime_version, moec_compiler_version), so that
 * the program can compare that with the version of the header it was built
 * with. `moec --version` prints it. Plain C: macros only.
 *
 *===---------------------------------------------------------------------===*/

#ifndef MOEC_BASE_VERSION_H
#define MOEC_BASE_VERSION_H

#define MOEC_VERSION_MAJOR 0
#define MOEC_VERSION_MINOR 2
#define MOEC_VERSION_PATCH 0
/** "MAJOR.MINOR.PATCH" of the macros above. */
#define MOEC_VERSION_STRING "0.2.0"

#endif /* MOEC_BASE_VERSION_H */
