//===- CStatusTest.cpp - The C APIs' status when memory runs out ---------===//
//
// This binary replaces the global operator new so that a test can make it
// fail: a status that cannot be allocated is the static "out of memory"
// one, which moec_status_free leaves alone, and an allocation failure inside
// a C API call (libmoec's string results) becomes an error, not a crash.
//
//===----------------------------------------------------------------------===//

#include "base/CStatus.h"

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <new>
#include <string>

namespace {
std::atomic<bool> failNew{false};
} // namespace

void *operator new(std::size_t bytes) {
  if (failNew.load())
    throw std::bad_alloc();
  if (void *p = std::malloc(bytes ? bytes : 1))
    return p;
  throw std::bad_alloc();
}
void operator delete(void *p) noexcept { std::free(p); }
void operator delete(void *p, std::size_t) noexcept { std::free(p); }

namespace {

/// Runs `body` with every operator new failing.
template <typename Body> auto withoutMemory(Body &&body) {
  failNew = true;
  auto result = body();
  failNew = false;
  return result;
}

} // namespace

TEST_CASE("a status is the caller's: code, message, free", "[base]") {
  moec_status_t ok = moec::toCStatus(moec::Status::success());
  CHECK(ok == MOEC_OK);
  CHECK(moec_status_code(ok) == MOEC_STATUS_OK);
  CHECK(std::string(moec_status_message(ok)).empty());
  moec_status_free(ok);
  moec_status_t over = moec::toCStatus(
      moec::Status::error("rank 1: 9 rows, room for 8", moec::StatusCode::OverCapacity));
  CHECK(moec_status_code(over) == MOEC_OVER_CAPACITY);
  CHECK(std::string(moec_status_message(over)) == "rank 1: 9 rows, room for 8");
  moec_status_free(over);
}

TEST_CASE("a status that cannot be allocated is a static out-of-memory error", "[base]") {
  const moec::Status missing = moec::Status::error("a file is missing");
  moec_status_t status = withoutMemory([&] { return moec::toCStatus(missing); });
  REQUIRE(status != MOEC_OK);
  CHECK(moec_status_code(status) == MOEC_ERROR);
  CHECK(std::string(moec_status_message(status)) == "out of memory (making an error status)");
  moec_status_free(status); // leaves the static one alone: freeing twice is harmless
  moec_status_free(status);
  CHECK(std::string(moec_status_message(status)) == "out of memory (making an error status)");
  // Memory back: statuses are allocated again.
  moec_status_t again = moec::toCStatus(missing);
  CHECK(again != status);
  CHECK(std::string(moec_status_message(again)) == "a file is missing");
  moec_status_free(again);
}

TEST_CASE("guardedC turns an allocation failure inside a call into an error", "[base]") {
  // A C API body whose result copy fails (libmoec's copyOut throws
  // std::bad_alloc when malloc returns null).
  moec_status_t status = moec::guardedC([]() -> moec::Status { throw std::bad_alloc(); });
  REQUIRE(status != MOEC_OK);
  CHECK(moec_status_code(status) == MOEC_ERROR);
  CHECK(std::string(moec_status_message(status)) == "internal error: std::bad_alloc");
  moec_status_free(status);
  // And when even the error's message cannot be made, the static one.
  status = withoutMemory(
      [] { return moec::guardedC([]() -> moec::Status { throw std::bad_alloc(); }); });
  CHECK(std::string(moec_status_message(status)) == "out of memory (making an error status)");
  moec_status_free(status);
  // Anything else thrown is an error too, never an exception into C.
  status = moec::guardedC([]() -> moec::Status { throw 42; });
  CHECK(std::string(moec_status_message(status)) == "internal error");
  moec_status_free(status);
}
