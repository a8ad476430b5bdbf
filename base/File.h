//===- File.h - Reading a whole file ----------------------------*- C++ -*-===//
//
// The one place that reads an input file into memory (task binaries, .npy
// files). It refuses what is not a regular file (a directory, a device)
// with a message, instead of trusting the size a seek reports, and reads a
// pipe or a growing file to its end.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_FILE_H
#define MOEC_BASE_FILE_H

#include "base/Status.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moec {

/// Reads the file at `path` into *out. Errors start with the path: "PATH:
/// cannot open: No such file or directory", "PATH: is a directory, not a
/// file".
Status readWholeFile(const std::string &path, std::vector<uint8_t> *out);

} // namespace moec

#endif // MOEC_BASE_FILE_H
