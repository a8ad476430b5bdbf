//===- Memory.h - How much memory this process may use ----------*- C++ -*-===//
//
// Runs check what they are about to allocate against this before they
// allocate it, so that a layer too large for the machine is an error that
// says so, not a process killed for memory. The limit is the smallest of
// the machine's physical memory, the cgroup's memory limit (a container or
// a batch job's allocation) and MOEC_MEMORY_LIMIT (bytes, or with a K, M or
// G suffix: a budget the user sets for a shared node).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_MEMORY_H
#define MOEC_BASE_MEMORY_H

#include <cstdint>
#include <string>

namespace moec {

struct MemoryLimit {
  uint64_t bytes = 0;  ///< 0: unknown (no check)
  std::string source;  ///< "the machine has", "the cgroup allows", "MOEC_MEMORY_LIMIT is"
  std::string error;   ///< set when MOEC_MEMORY_LIMIT is not a size: callers refuse to run
};

/// The memory this process may use (see above).
MemoryLimit memoryLimit();

/// "12.3 GiB", or "45.6 MiB" below a GiB.
std::string memoryText(double bytes);

} // namespace moec

#endif // MOEC_BASE_MEMORY_H
