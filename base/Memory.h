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

#include <cstddef>
#include <cstdint>
#include <string>

namespace moec {

struct MemoryLimit {
  uint64_t bytes = 0;  ///< 0: unknown (no check)
  std::string source;  ///< "the machine has", "the cgroup allows", "MOEC_MEMORY_LIMIT='8G' allows"
  std::string error;   ///< set when MOEC_MEMORY_LIMIT is not a size: callers refuse to run
};

/// The memory this process may use (see above).
MemoryLimit memoryLimit();

/// "12.3 GiB", "45.6 MiB" below a GiB, "7.0 KiB" below a MiB.
std::string memoryText(double bytes);

/// Zeroed memory of `bytes` bytes (page-aligned), taken from the kernel as
/// pages that are mapped only when first touched: a buffer sized for a
/// capacity the run does not reach holds only the pages it writes. Null
/// when the kernel refuses. Freed with freeZeroedPages(p, bytes).
void *zeroedPages(size_t bytes);
void freeZeroedPages(void *p, size_t bytes);

/// Bytes of the pages of [p, p + bytes) that are resident in memory now
/// (mincore); 0 where that cannot be told.
size_t residentBytes(const void *p, size_t bytes);

/// Copies `bytes` bytes from `src` to `dst`, past the caches (non-temporal
/// stores) in whole 64-byte lines where `dst` is line-aligned and the CPU
/// has AVX-512, the rest with plain stores: for rows that another core
/// reads next, or nobody soon, whose lines then need not be read from
/// memory before they are written. streamFence() orders the streamed
/// stores before whatever tells a reader they are there.
void streamCopy(void *dst, const void *src, size_t bytes);

/// streamCopy of `rows` rows of `rowBytes` bytes (`srcStride` and
/// `dstStride` bytes apart), four rows side by side, a line of each in
/// turn: four streams from memory at once, which it serves faster than
/// one (a copy past the caches 12.3 GB/s a core against 9.3 on a 2-core
/// Xeon).
void streamCopyRows(void *dst, size_t dstStride, const void *src, size_t srcStride, size_t rows,
                    size_t rowBytes);

/// Orders the stores of streamCopy before the stores after it.
void streamFence();

/// Owns memory from zeroedPages().
class ZeroedPages {
public:
  ZeroedPages() = default;
  explicit ZeroedPages(size_t bytes) : base(zeroedPages(bytes)), size(base ? bytes : 0) {}
  ZeroedPages(ZeroedPages &&other) noexcept : base(other.base), size(other.size) {
    other.base = nullptr;
    other.size = 0;
  }
  ZeroedPages &operator=(ZeroedPages &&other) noexcept {
    if (this != &other) {
      freeZeroedPages(base, size);
      base = other.base;
      size = other.size;
      other.base = nullptr;
      other.size = 0;
    }
    return *this;
  }
  ZeroedPages(const ZeroedPages &) = delete;
  ZeroedPages &operator=(const ZeroedPages &) = delete;
  ~ZeroedPages() { freeZeroedPages(base, size); }

  void *data() const { return base; }
  size_t bytes() const { return size; }

private:
  void *base = nullptr;
  size_t size = 0;
};

} // namespace moec

#endif // MOEC_BASE_MEMORY_H
