//===- File.h - Reading and writing whole files -----------------*- C++ -*-===//
//
// The one place that reads an input file into memory (task binaries, .npy
// files). It refuses what is not a regular file (a directory, a device)
// with a message, instead of trusting the size a seek reports, and reads a
// pipe or a growing file to its end.
//
// And the one place that writes an output file: into a temporary file
// beside it, renamed over the target when whole, so that a reader never sees
// half a file. A process that installs removeTemporariesOnSignal() also
// removes the temporaries it is writing when SIGINT, SIGTERM, SIGHUP or
// SIGQUIT ends it.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_FILE_H
#define MOEC_BASE_FILE_H

#include "base/Status.h"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace moec {

/// Reads the file at `path` into *out. Errors start with the path: "PATH:
/// cannot open: No such file or directory", "PATH: is a directory, not a
/// file".
Status readWholeFile(const std::string &path, std::vector<uint8_t> *out);

/// A span of bytes to write.
struct ByteSpan {
  const void *data;
  size_t size;
};

/// Writes the concatenation of `parts` to `path` through a temporary
/// "PATH.tmp.PID.N" renamed over it. On failure `path` is as it was, no
/// temporary is left, and the error starts with the path.
Status writeFileAtomically(const std::string &path, std::initializer_list<ByteSpan> parts);

/// Installs handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT that remove
/// the temporaries writeFileAtomically is writing, then end the process as
/// the signal would have. For command-line tools: a host that handles these
/// signals itself (Python) keeps its own handlers.
void removeTemporariesOnSignal();

} // namespace moec

#endif // MOEC_BASE_FILE_H
