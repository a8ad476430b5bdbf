//===- Memory.cpp - How much memory this process may use ------------------===//

#include "base/Memory.h"

#include "base/Env.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <fstream>
#include <vector>

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <sys/mman.h>
#include <unistd.h>

namespace moec {

namespace {

/// Parses "123", "64K", "12M", "2G" (powers of 1024); false otherwise.
bool parseBytes(const std::string &text, uint64_t *out) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])))
    ++digits;
  if (digits == 0 || digits > 15)
    return false;
  uint64_t value = std::strtoull(text.substr(0, digits).c_str(), nullptr, 10);
  const std::string suffix = text.substr(digits);
  if (suffix == "K" || suffix == "k")
    value <<= 10;
  else if (suffix == "M" || suffix == "m")
    value <<= 20;
  else if (suffix == "G" || suffix == "g")
    value <<= 30;
  else if (!suffix.empty())
    return false;
  *out = value;
  return value > 0;
}

/// The number in the first line of `path`, when there is one.
bool readNumber(const char *path, uint64_t *out) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line) || line.empty())
    return false;
  for (char c : line)
    if (!std::isdigit(static_cast<unsigned char>(c)))
      return false; // "max": no limit
  return parseBytes(line, out);
}

} // namespace

MemoryLimit memoryLimit() {
  MemoryLimit limit;
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0)
    limit = {uint64_t(pages) * uint64_t(page), "the machine has"};
  const auto lower = [&](uint64_t bytes, const char *source) {
    if (bytes > 0 && (limit.bytes == 0 || bytes < limit.bytes))
      limit = {bytes, source};
  };
  uint64_t cgroup = 0;
  if (readNumber("/sys/fs/cgroup/memory.max", &cgroup) ||
      readNumber("/sys/fs/cgroup/memory/memory.limit_in_bytes", &cgroup))
    lower(cgroup, "the cgroup allows");
  if (const char *env = envValue("MOEC_MEMORY_LIMIT")) {
    uint64_t bytes = 0;
    const std::string shown = envShown("MOEC_MEMORY_LIMIT", env);
    if (parseBytes(env, &bytes))
      lower(bytes, (shown + " allows").c_str());
    else
      limit.error = shown + ": expected a positive number of bytes, optionally with a K, M or "
                            "G suffix";
  }
  return limit;
}

std::string memoryText(double bytes) {
  char text[32];
  if (bytes < double(1 << 20))
    std::snprintf(text, sizeof text, "%.1f KiB", bytes / double(1 << 10));
  else if (bytes < double(1 << 30))
    std::snprintf(text, sizeof text, "%.1f MiB", bytes / double(1 << 20));
  else
    std::snprintf(text, sizeof text, "%.1f GiB", bytes / double(uint64_t(1) << 30));
  return text;
}

void *zeroedPages(size_t bytes) {
  // An anonymous private mapping is zero-filled by the kernel, page by page,
  // on first touch.
  void *p = ::mmap(nullptr, bytes ? bytes : 1, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void freeZeroedPages(void *p, size_t bytes) {
  if (p)
    ::munmap(p, bytes ? bytes : 1);
}

size_t residentBytes(const void *p, size_t bytes) {
  if (!p || bytes == 0)
    return 0;
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = uintptr_t(p) / page * page;
  const uintptr_t end = (uintptr_t(p) + bytes + page - 1) / page * page;
  std::vector<unsigned char> in((end - begin) / page);
  if (::mincore(reinterpret_cast<void *>(begin), end - begin, in.data()) != 0)
    return 0;
  size_t pages = 0;
  for (unsigned char c : in)
    pages += c & 1;
  return std::min(pages * page, size_t(end - begin));
}

#if defined(__x86_64__)

namespace {
__attribute__((target("avx512f"))) size_t streamLines(char *dst, const char *src, size_t bytes) {
  size_t b = 0;
  for (; b + 64 <= bytes; b += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i *>(dst + b), _mm512_loadu_si512(src + b));
  return b;
}
} // namespace

void streamCopy(void *dst, const void *src, size_t bytes) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  char *to = static_cast<char *>(dst);
  const char *from = static_cast<const char *>(src);
  size_t b = 0;
  if (avx512 && (reinterpret_cast<uintptr_t>(to) & 63) == 0)
    b = streamLines(to, from, bytes);
  std::memcpy(to + b, from + b, bytes - b);
}

namespace {
/// The whole lines of four rows, a line of each in turn.
__attribute__((target("avx512f"))) void streamFourRows(char *dst, size_t dstStride, const char *src,
                                                       size_t srcStride, size_t lines) {
  for (size_t b = 0; b < lines * 64; b += 64)
    for (size_t r = 0; r < 4; ++r)
      _mm512_stream_si512(reinterpret_cast<__m512i *>(dst + r * dstStride + b),
                          _mm512_loadu_si512(src + r * srcStride + b));
}
} // namespace

void streamCopyRows(void *dst, size_t dstStride, const void *src, size_t srcStride, size_t rows,
                    size_t rowBytes) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  char *to = static_cast<char *>(dst);
  const char *from = static_cast<const char *>(src);
  size_t i = 0;
  // Four rows at a time where every row starts on a line (else row by row).
  if (avx512 && (reinterpret_cast<uintptr_t>(to) & 63) == 0 && dstStride % 64 == 0 &&
      rowBytes >= 64) {
    const size_t lines = rowBytes / 64, rest = rowBytes % 64;
    for (; i + 4 <= rows; i += 4) {
      streamFourRows(to + i * dstStride, dstStride, from + i * srcStride, srcStride, lines);
      for (size_t r = 0; r < 4 && rest; ++r)
        std::memcpy(to + (i + r) * dstStride + lines * 64, from + (i + r) * srcStride + lines * 64,
                    rest);
    }
  }
  for (; i < rows; ++i)
    streamCopy(to + i * dstStride, from + i * srcStride, rowBytes);
}

void streamFence() { _mm_sfence(); }

#else

void streamCopy(void *dst, const void *src, size_t bytes) { std::memcpy(dst, src, bytes); }

void streamCopyRows(void *dst, size_t dstStride, const void *src, size_t srcStride, size_t rows,
                    size_t rowBytes) {
  for (size_t i = 0; i < rows; ++i)
    std::memcpy(static_cast<char *>(dst) + i * dstStride,
                static_cast<const char *>(src) + i * srcStride, rowBytes);
}

void streamFence() {}

#endif

} // namespace moec
