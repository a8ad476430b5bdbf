//===- MemoryTest.cpp - Tests for zeroed pages and resident bytes ---------===//

#include "base/Memory.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <vector>

using namespace moec;

TEST_CASE("zeroed pages are zero, and resident only once written", "[memory]") {
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t bytes = 256 * page;
  ZeroedPages pages(bytes);
  REQUIRE(pages.data() != nullptr);
  REQUIRE(pages.bytes() == bytes);
  auto *p = static_cast<unsigned char *>(pages.data());
  CHECK(residentBytes(p, bytes) == 0);
  // Write three pages: exactly those become resident.
  p[0] = 1;
  p[10 * page + 5] = 2;
  p[bytes - 1] = 3;
  CHECK(residentBytes(p, bytes) == 3 * page);
  // Reading the rest maps the shared zero page, not memory of its own;
  // whatever mincore says of it, every byte reads zero.
  size_t nonzero = 0;
  for (size_t i = 0; i < bytes; ++i)
    nonzero += p[i] != 0;
  CHECK(nonzero == 3);
  // A range inside a page counts that page.
  CHECK(residentBytes(p + 10 * page + 100, 8) == page);
  CHECK(residentBytes(nullptr, 8) == 0);

  // Moving hands the pages over; the source holds none.
  ZeroedPages moved(std::move(pages));
  CHECK(moved.data() == p);
  CHECK(pages.data() == nullptr);
  CHECK(pages.bytes() == 0);
}

TEST_CASE("streamCopy copies every byte, aligned or not, whole lines or not", "[memory]") {
  // Destinations at each offset in a line (line-aligned ones take the
  // streamed stores), lengths around whole lines; the bytes around the
  // copy stay as they were.
  std::vector<unsigned char> src(1200), memory(1400);
  for (size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<unsigned char>(i * 7 + 3);
  unsigned char *line = memory.data() + (64 - reinterpret_cast<uintptr_t>(memory.data()) % 64) % 64;
  for (size_t offset : {0, 1, 8, 63, 64})
    for (size_t bytes : {0, 1, 63, 64, 65, 128, 1000, 1088}) {
      INFO("offset " << offset << ", " << bytes << " bytes");
      std::memset(memory.data(), 0xAB, memory.size());
      unsigned char *dst = line + offset;
      moec::streamCopy(dst, src.data() + 5, bytes);
      moec::streamFence();
      CHECK(std::memcmp(dst, src.data() + 5, bytes) == 0);
      bool around = true;
      for (unsigned char *p = memory.data(); p < memory.data() + memory.size(); ++p)
        if ((p < dst || p >= dst + bytes) && *p != 0xAB)
          around = false;
      CHECK(around);
    }
}

TEST_CASE("streamCopyRows copies every row and nothing between them", "[memory]") {
  // Row counts around multiples of four (the rows it copies side by side),
  // row lengths around whole lines, destinations on a line and off it, and
  // strides past the rows: the rows arrive, the gaps between them and the
  // bytes around stay as they were.
  std::vector<unsigned char> src(64 * 1024), memory(80 * 1024);
  for (size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<unsigned char>(i * 13 + 1);
  unsigned char *line = memory.data() + (64 - reinterpret_cast<uintptr_t>(memory.data()) % 64) % 64;
  for (size_t offset : {0, 8})
    for (size_t rows : {0, 1, 3, 4, 5, 8, 11})
      for (size_t rowBytes : {1, 63, 64, 100, 128, 1000}) {
        const size_t dstStride = (rowBytes + 63) / 64 * 64 + 64, srcStride = rowBytes + 9;
        INFO("offset " << offset << ", " << rows << " rows of " << rowBytes << " bytes");
        std::memset(memory.data(), 0xAB, memory.size());
        unsigned char *dst = line + offset;
        moec::streamCopyRows(dst, dstStride, src.data() + 3, srcStride, rows, rowBytes);
        moec::streamFence();
        bool rowsThere = true, rest = true;
        for (size_t r = 0; r < rows; ++r)
          rowsThere &=
              std::memcmp(dst + r * dstStride, src.data() + 3 + r * srcStride, rowBytes) == 0;
        for (size_t at = 0; at < memory.size(); ++at) {
          const unsigned char *p = memory.data() + at;
          const bool inRow = p >= dst && size_t(p - dst) < rows * dstStride &&
                             size_t(p - dst) % dstStride < rowBytes;
          if (!inRow && *p != 0xAB)
            rest = false;
        }
        CHECK(rowsThere);
        CHECK(rest);
      }
}
