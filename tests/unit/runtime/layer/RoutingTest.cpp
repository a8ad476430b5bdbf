//===- RoutingTest.cpp - Tests for the routing layout --------------------===//
//
// buildRoutingLayout (runtime/layer/Routing.h): the counts, offsets, order
// and positions of a hand-made routing, rows grouped by destination rank,
// random routings, and the routings it refuses with their messages.
//
//===----------------------------------------------------------------------===//

#include "runtime/layer/Routing.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

using moec::Status;
using moec::rt::buildRoutingLayout;
using moec::rt::RoutingLayout;

TEST_CASE("routing layout sorts rows expert-major, stably", "[layer][routing]") {
  // 4 tokens, top-2, 5 experts; expert 2 gets nothing.
  const std::vector<int32_t> ids = {3, 0, 0, 1, 4, 3, 1, 0};
  RoutingLayout layout;
  REQUIRE(buildRoutingLayout(ids.data(), 4, 2, 5, &layout).ok());
  CHECK(layout.counts == std::vector<int64_t>{3, 2, 0, 2, 1});
  CHECK(layout.offsets == std::vector<int64_t>{0, 3, 5, 5, 7, 8});
  // Row ids t*2+k: expert 0 gets (0,1) (1,0) (3,1); expert 1 (1,1) (3,0);
  // expert 3 (0,0) (2,1); expert 4 (2,0).
  CHECK(layout.order == std::vector<int64_t>{1, 2, 7, 3, 6, 0, 5, 4});
  for (int64_t i = 0; i < 8; ++i)
    CHECK(layout.position[size_t(layout.order[size_t(i)])] == i);
  CHECK(layout.tokenOf(2) == 3);
  CHECK(layout.slotOf(2) == 1);

  // int64 ids give the same layout.
  const std::vector<int64_t> ids64(ids.begin(), ids.end());
  RoutingLayout layout64;
  REQUIRE(buildRoutingLayout(ids64.data(), 4, 2, 5, &layout64).ok());
  CHECK(layout64.order == layout.order);
  CHECK(layout64.counts == layout.counts);
}

TEST_CASE("routing layout on random routings", "[layer][routing]") {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t experts = 1 + int64_t(rng() % 16);
    const int64_t topK = 1 + int64_t(rng() % std::min<int64_t>(experts, 4));
    const int64_t tokens = int64_t(rng() % 60);
    std::vector<int64_t> ids(size_t(tokens * topK));
    std::vector<int64_t> perm(static_cast<size_t>(experts));
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t e = 0; e < experts; ++e)
        perm[size_t(e)] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t k = 0; k < topK; ++k)
        ids[size_t(t * topK + k)] = perm[size_t(k)];
    }
    RoutingLayout layout;
    REQUIRE(buildRoutingLayout(ids.data(), tokens, topK, experts, &layout).ok());
    REQUIRE(layout.offsets.back() == tokens * topK);
    // Sorted by expert, and by row id within an expert.
    for (int64_t i = 1; i < tokens * topK; ++i) {
      const int64_t prev = layout.order[size_t(i - 1)], cur = layout.order[size_t(i)];
      const int64_t ePrev = ids[size_t(prev)], eCur = ids[size_t(cur)];
      REQUIRE((ePrev < eCur || (ePrev == eCur && prev < cur)));
    }
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t i = layout.offsets[size_t(e)]; i < layout.offsets[size_t(e) + 1]; ++i)
        REQUIRE(ids[size_t(layout.order[size_t(i)])] == e);
  }
}

TEST_CASE("routing layout errors", "[layer][routing]") {
  RoutingLayout layout;
  layout.tokens = 99; // left alone on error

  const std::vector<int32_t> outOfRange = {0, 1, 2, 8, 3, 1};
  Status status = buildRoutingLayout(outOfRange.data(), 3, 2, 8, &layout);
  REQUIRE(!status.ok());
  CHECK(status.message() == "topk_ids[1][1] = 8 is not an expert: expected 0 <= id < 8");

  const std::vector<int64_t> negative = {0, -1};
  status = buildRoutingLayout(negative.data(), 1, 2, 8, &layout);
  REQUIRE(!status.ok());
  CHECK(status.message() == "topk_ids[0][1] = -1 is not an expert: expected 0 <= id < 8");

  const std::vector<int32_t> duplicate = {0, 1, 2, 4, 5, 4, 7, 6, 3};
  status = buildRoutingLayout(duplicate.data(), 3, 3, 8, &layout);
  REQUIRE(!status.ok());
  CHECK(status.message() == "topk_ids: token 1 routes to expert 4 twice (top-k positions 0 and 2)");

  // The same expert in different tokens is fine.
  const std::vector<int32_t> shared = {4, 4, 4};
  CHECK(buildRoutingLayout(shared.data(), 3, 1, 8, &layout).ok());
  CHECK(layout.counts[4] == 3);

  layout.tokens = 99;
  status = buildRoutingLayout(shared.data(), -1, 1, 8, &layout);
  CHECK(!status.ok());
  CHECK(layout.tokens == 99);

  // No tokens: every expert empty.
  REQUIRE(buildRoutingLayout(static_cast<const int32_t *>(nullptr), 0, 2, 4, &layout).ok());
  CHECK(layout.counts == std::vector<int64_t>{0, 0, 0, 0});
  CHECK(layout.offsets == std::vector<int64_t>{0, 0, 0, 0, 0});
  CHECK(layout.order.empty());
}

TEST_CASE("the sorted rows of a rank's experts are one run per destination rank",
          "[layer][routing]") {
  // 3 EP ranks of 2 local experts (E = 6); 5 tokens, top-2. Rows t*2+k:
  //   row:    0  1  2  3  4  5  6  7  8  9
  //   expert: 5  0  2  3  0  4  1  5  3  2
  const std::vector<int32_t> ids = {5, 0, 2, 3, 0, 4, 1, 5, 3, 2};
  RoutingLayout layout;
  Status status = buildRoutingLayout(ids.data(), 5, 2, 6, &layout);
  INFO(status.message());
  REQUIRE(status.ok());
  CHECK(layout.tokens == 5);
  CHECK(layout.topK == 2);
  CHECK(layout.experts == 6);
  CHECK(layout.counts == std::vector<int64_t>{2, 1, 2, 2, 1, 2});
  CHECK(layout.offsets == std::vector<int64_t>{0, 2, 3, 5, 7, 8, 10});
  // Expert-major; within an expert, by token and then by k.
  CHECK(layout.order == std::vector<int64_t>{1, 4, 6, 2, 9, 3, 8, 5, 0, 7});
  CHECK(layout.position == std::vector<int64_t>{8, 0, 3, 5, 1, 7, 2, 9, 6, 4});
  std::vector<int64_t> tokens, slots;
  for (int64_t i = 0; i < 10; ++i) {
    tokens.push_back(layout.tokenOf(i));
    slots.push_back(layout.slotOf(i));
  }
  CHECK(tokens == std::vector<int64_t>{0, 2, 3, 1, 4, 1, 4, 2, 0, 3});
  CHECK(slots == std::vector<int64_t>{1, 0, 0, 0, 1, 1, 0, 1, 0, 1});

  // Rank p's rows are the sorted rows [offsets[p*L], offsets[(p+1)*L]):
  // exactly the rows routed to one of p's experts, each expert's contiguous.
  const int64_t L = 2;
  const std::vector<std::vector<int64_t>> rowsOfRank = {{1, 4, 6}, {2, 9, 3, 8}, {5, 0, 7}};
  for (int64_t p = 0; p < 3; ++p) {
    INFO("rank " << p);
    const int64_t begin = layout.offsets[size_t(p * L)], end = layout.offsets[size_t((p + 1) * L)];
    CHECK(std::vector<int64_t>(layout.order.begin() + begin, layout.order.begin() + end) ==
          rowsOfRank[size_t(p)]);
    for (int64_t i = begin; i < end; ++i)
      CHECK(ids[size_t(layout.order[size_t(i)])] / L == p);
  }
}

TEST_CASE("one expert's rows keep the tokens' order", "[layer][routing]") {
  // Top-1, every token to expert 1 of 3: the identity order.
  const std::vector<int64_t> ids(7, 1);
  RoutingLayout layout;
  REQUIRE(buildRoutingLayout(ids.data(), 7, 1, 3, &layout).ok());
  CHECK(layout.counts == std::vector<int64_t>{0, 7, 0});
  CHECK(layout.offsets == std::vector<int64_t>{0, 0, 7, 7});
  CHECK(layout.order == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6});
  CHECK(layout.position == layout.order);

  // Top-0: tokens without rows.
  REQUIRE(buildRoutingLayout(static_cast<const int32_t *>(nullptr), 3, 0, 2, &layout).ok());
  CHECK(layout.tokens == 3);
  CHECK(layout.counts == std::vector<int64_t>{0, 0});
  CHECK(layout.offsets == std::vector<int64_t>{0, 0, 0});
  CHECK(layout.order.empty());
  CHECK(layout.position.empty());
}

TEST_CASE("routing layout refuses sizes, a null routing and wide ids, and names them",
          "[layer][routing]") {
  RoutingLayout layout;
  const std::vector<int32_t> ok = {1, 0};
  REQUIRE(buildRoutingLayout(ok.data(), 1, 2, 4, &layout).ok());
  const RoutingLayout before = layout;
  const auto unchanged = [&] {
    CHECK(layout.tokens == before.tokens);
    CHECK(layout.counts == before.counts);
    CHECK(layout.offsets == before.offsets);
    CHECK(layout.order == before.order);
  };

  Status status = buildRoutingLayout(ok.data(), 2, -1, 4, &layout);
  CHECK(status.message() == "routing layout: negative size (tokens 2, top-k -1, experts 4)");
  unchanged();
  status = buildRoutingLayout(ok.data(), 1, 2, -3, &layout);
  CHECK(status.message() == "routing layout: negative size (tokens 1, top-k 2, experts -3)");
  unchanged();

  status = buildRoutingLayout(static_cast<const int64_t *>(nullptr), 1, 2, 4, &layout);
  CHECK(status.message() == "routing layout: topk_ids is null");
  unchanged();

  // No experts: any id is out of range.
  status = buildRoutingLayout(ok.data(), 1, 2, 0, &layout);
  CHECK(status.message() == "topk_ids[0][0] = 1 is not an expert: expected 0 <= id < 0");
  unchanged();

  // An int64 id is checked whole, not as its low 32 bits (which are 0, a
  // valid expert), and is refused even after valid tokens.
  const std::vector<int64_t> wide = {0, 1, int64_t(1) << 32, 2};
  status = buildRoutingLayout(wide.data(), 2, 2, 4, &layout);
  CHECK(status.message() == "topk_ids[1][0] = 4294967296 is not an expert: expected 0 <= id < 4");
  unchanged();

  // The last row of the last token is checked too.
  const std::vector<int32_t> lastBad = {0, 1, 2, 3, 3, 4};
  status = buildRoutingLayout(lastBad.data(), 3, 2, 4, &layout);
  CHECK(status.message() == "topk_ids[2][1] = 4 is not an expert: expected 0 <= id < 4");
  unchanged();
}
