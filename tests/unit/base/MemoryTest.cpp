//===- MemoryTest.cpp - Tests for zeroed pages and resident bytes ---------===//

#include "base/Memory.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <unistd.h>

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
