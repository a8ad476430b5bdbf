// The fabrics' test hooks (runtime/comm/Hooks.h): read in a test build,
// ignored in a release build. Built twice: hooks_test links the comm library
// as `bazel test` builds it (with the hooks), hooks_release_test compiles
// Hooks.cpp without the moec_test_hooks define, as `bazel build` does.

#include "runtime/comm/Hooks.h"

#include <catch2/catch.hpp>

#include <cstdlib>

using moec::comm::DropPut;

TEST_CASE("MOEC_TEST_DROP_PUT", "[hooks]") {
  DropPut drop;
  ::setenv("MOEC_TEST_DROP_PUT", "1:3", 1);
  REQUIRE(DropPut::fromEnvironment(2, &drop));
#ifdef MOEC_EXPECT_HOOKS
  REQUIRE(moec::comm::testHooksBuilt());
  CHECK(drop.rank == 1);
  CHECK(drop.nth == 3);
  // A rank the group does not have, and values that are not RANK:N.
  ::setenv("MOEC_TEST_DROP_PUT", "5:1", 1);
  const moec::Status outOfRange = DropPut::fromEnvironment(2, &drop);
  REQUIRE(!outOfRange);
  CHECK(outOfRange.message().find("there is no rank 5 (the group has 2 ranks)") !=
        std::string::npos);
  for (const char *bad : {"1", "1:0", "-1:2", "1:2x", "a:b"}) {
    ::setenv("MOEC_TEST_DROP_PUT", bad, 1);
    CHECK(!DropPut::fromEnvironment(2, &drop));
  }
  ::setenv("MOEC_LOCAL_PUTS", "1", 1);
  CHECK(moec::comm::localPutsRequested());
#else
  // A release build: a user's environment changes nothing.
  REQUIRE(!moec::comm::testHooksBuilt());
  CHECK(drop.rank == -1);
  ::setenv("MOEC_TEST_DROP_PUT", "nonsense", 1);
  CHECK(DropPut::fromEnvironment(2, &drop));
  CHECK(drop.rank == -1);
  ::setenv("MOEC_LOCAL_PUTS", "1", 1);
  CHECK(!moec::comm::localPutsRequested());
#endif
  ::setenv("MOEC_TEST_DROP_PUT", "", 1);
  REQUIRE(DropPut::fromEnvironment(2, &drop));
  CHECK(drop.rank == -1);
  ::unsetenv("MOEC_TEST_DROP_PUT");
  ::unsetenv("MOEC_LOCAL_PUTS");
}
