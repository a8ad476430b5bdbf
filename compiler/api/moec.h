/*===- moec.h - The compiler and the dump tool as a C library ------------===*
 *
 * What `moec compile` and `moec dump` do, and the capacity arithmetic of a
 * config, as calls of libmoec.so, so that a framework (the Python package
 * moec_torch, through ctypes) compiles and inspects layers without a moec
 * executable or a build tree at hand.
 *
 * Every call that can fail returns a moec_status_t (base/moec_status.h, the
 * runtime's C API's too): MOEC_OK (NULL) on success, else an error the
 * caller frees with moec_status_free, whose moec_status_message() says what
 * was wrong; nothing is written then. Strings the library returns are freed
 * with moec_free. The calls may run from several threads at once.
 *
 *===---------------------------------------------------------------------===*/

#ifndef MOEC_COMPILER_API_MOEC_H
#define MOEC_COMPILER_API_MOEC_H

#include "base/Version.h"
#include "base/moec_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the compiler library this program runs against,
 * "MAJOR.MINOR.PATCH" (base/Version.h: compare with MOEC_VERSION_STRING, the
 * header's), and, when `binary_format` is not null, the task binary format
 * version it writes. */
const char *moec_compiler_version(unsigned *binary_format);

/* Compiles the graph description `graph` (.json or .mlir) for the config
 * file `config` into the task binary `out` (written whole or not at all):
 * `target` is a profile name or profile JSON path (NULL: "cpu"),
 * `granularity` "per-tile-range" or "per-expert" (NULL: the first). With
 * `summary`, *summary is the one-line summary `moec compile` prints. */
moec_status_t moec_compile(const char *graph, const char *config, const char *target,
                           const char *granularity, const char *out, char **summary);

/* Sets *json to what `moec dump BIN --json` prints: the binary's header,
 * slots, ops, events, every queue and the statistics, with `target` (NULL:
 * the binary's own) and resolved for `rank` (negative: rank-relative). */
moec_status_t moec_dump_json(const char *binary, const char *target, int rank, char **json);

/* Writes the simulated run of the binary (every rank) on `target` (NULL:
 * the binary's own) to `out` as a Chrome/Perfetto trace: the format the
 * runtime's measured traces have. */
moec_status_t moec_simulate_trace(const char *binary, const char *target, const char *out);

/* Sets *advice to a JSON object saying how to change the config `config`
 * (JSON text) so that a routing that routes `rows_per_rank` rows from its
 * fullest rank and puts `receive_per_rank` rows on the experts of its
 * fullest rank fits (what the runtime reports as a capacity need):
 * {"seq_size", "capacity_factor", "row_capacity", "receive_capacity",
 * "fits"}. With `headroom` nonzero the factor grows beyond the need (1.25
 * times it, at least 1.5 times the config's), as before a recompile. The
 * arithmetic is format/Capacity.h's, which the compiler sizes binaries
 * with and the runtime advises from a binary's layer record. */
moec_status_t moec_capacity_advice(const char *config, long long rows_per_rank,
                                   long long receive_per_rank, int headroom, char **advice);

/* Checks the config `config` (JSON text) as `moec compile` does (its keys,
 * their types and ranges, and the rules between them, e.g. that
 * "dispatch_dtype" is "fp8_e4m3" or the config's dtype). An error's message
 * is the compiler's, which names the config as "the config". */
moec_status_t moec_config_check(const char *config);

/* Frees a string the library returned. */
void moec_free(char *text);

#ifdef __cplusplus
}
#endif

#endif /* MOEC_COMPILER_API_MOEC_H */
