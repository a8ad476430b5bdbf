//===- File.h - Reading and writing whole files -----------------*- C++ -*-===//
//
// The one place that reads an input file into memory (task binaries, .npy
// files, graphs, configs, target profiles, manifests). It opens only regular
// files, after following symlinks: a directory, a device (/dev/zero), a FIFO
// or a socket is refused with a message, never read without end or waited
// on, and it reads no more than a bound.
//
// And the one place that writes an output file: into a temporary file
// beside it, renamed over the target when whole, so that a reader never sees
// half a file. A symlink is written through to the regular file it names
// (the link stays), and a character device or a FIFO (/dev/null,
// /proc/self/fd/1) is written into, never replaced. A process that installs
// removeTemporariesOnSignal() also removes the temporaries it is writing
// when SIGINT, SIGTERM, SIGHUP or SIGQUIT ends it.
//
// checkOutputPaths() is the one check that an output of a command names
// none of its inputs (the same file under any name).
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

/// The most bytes readWholeFile reads unless told otherwise: task binaries
/// and .npy files of real layers are gigabytes.
constexpr uint64_t kMaxInputBytes = uint64_t(1) << 40;

/// The most bytes a text input (a graph, a config, a target profile, a
/// manifest) may hold.
constexpr uint64_t kMaxTextBytes = uint64_t(1) << 28;

/// Reads the regular file at `path` (symlinks followed; "-": standard input)
/// into *out, refusing
/// one over `maxBytes`. Errors start with the path: "PATH: cannot open: No
/// such file or directory", "PATH: is a directory, not a file", "PATH: is a
/// character device, not a regular file", "PATH: holds N bytes, more than
/// the M an input may hold".
Status readWholeFile(const std::string &path, std::vector<uint8_t> *out,
                     uint64_t maxBytes = kMaxInputBytes);

/// The first `maxBytes` bytes of the regular file at `path` (all of a
/// shorter one), and in *fileSize the size the file states: a loader checks
/// a header against the size before it reads the rest.
Status readFileHead(const std::string &path, uint64_t maxBytes, std::vector<uint8_t> *out,
                    uint64_t *fileSize);

/// readWholeFile into a string, bounded by kMaxTextBytes.
Status readTextFile(const std::string &path, std::string *out,
                    uint64_t maxBytes = kMaxTextBytes);

/// Refuses an output path that cannot be one: empty, or naming an existing
/// file that is also one of `inputs` (compared by device and inode, so any
/// name of it counts). `what` names the output in the message, e.g. "-o".
/// "-" (standard output) is refused when it is redirected onto an input.
Status checkOutputPath(const std::string &what, const std::string &path,
                       const std::vector<std::string> &inputs);

/// Refuses an output path that writeFileAtomically could not write, before
/// any work is done: a directory, a symlink loop or one to nothing, a folder
/// that does not exist or cannot be written. "-" is always fine.
Status checkWritable(const std::string &path);

/// True when `a` and `b` both exist and are the same file.
bool sameFile(const std::string &a, const std::string &b);

/// A span of bytes to write.
struct ByteSpan {
  const void *data;
  size_t size;
};

/// Writes the concatenation of `parts` to `path` through a temporary
/// "PATH.tmp.PID.N", flushed to disk and renamed over it. On failure `path`
/// is as it was, no temporary is left, and the error starts with the path;
/// temporaries of writers of `path` that died are removed first. A `path` that is
/// a symlink is written through to the file it names; one that names a
/// character device or a FIFO is written into directly; a symlink loop, a
/// dangling symlink and an empty path are refused.
Status writeFileAtomically(const std::string &path, std::initializer_list<ByteSpan> parts);

/// Removes the entries of folder `dir` named `prefix` + PID + anything,
/// where PID is a process of this machine that no longer runs: what a
/// writer killed by SIGKILL (or a power cut) left behind. writeFileAtomically
/// calls it for its temporaries, a run's outputs folder for its new folder.
void removeStaleTemporaries(const std::string &dir, const std::string &prefix);

/// Installs handlers for SIGINT, SIGTERM, SIGHUP and SIGQUIT that remove
/// the temporaries writeFileAtomically is writing, then end the process as
/// the signal would have; and ignores SIGXFSZ, so that a write past the
/// file size limit fails as an error. For command-line tools: a host that handles these
/// signals itself (Python) keeps its own handlers.
void removeTemporariesOnSignal();

} // namespace moec

#endif // MOEC_BASE_FILE_H
