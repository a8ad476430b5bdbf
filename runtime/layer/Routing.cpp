//===- Routing.cpp - Routing layout: rows sorted expert-major -------------===//

#include "runtime/layer/Routing.h"

#include <algorithm>
#include <string>
#include <utility>

namespace moec::rt {

namespace {

template <typename Id>
Status buildLayout(const Id *topkIds, int64_t tokens, int64_t topK, int64_t experts,
                   RoutingLayout *out) {
  if (tokens < 0 || topK < 0 || experts < 0)
    return Status::error("routing layout: negative size (tokens " + std::to_string(tokens) +
                         ", top-k " + std::to_string(topK) + ", experts " +
                         std::to_string(experts) + ")");
  const int64_t rows = tokens * topK;
  if (rows > 0 && topkIds == nullptr)
    return Status::error("routing layout: topk_ids is null");

  // The checks and counts first, in scratch of E entries: *out is written
  // only once every id has passed. lastToken/lastSlot remember where each
  // expert was last seen, which finds a duplicate within a token in O(1) (a
  // token's ids are visited together).
  std::vector<int64_t> counts(size_t(experts), 0);
  std::vector<int64_t> lastToken(size_t(experts), -1), lastSlot(size_t(experts), -1);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < topK; ++k) {
      const int64_t id = int64_t(topkIds[t * topK + k]);
      if (id < 0 || id >= experts)
        return Status::error("topk_ids[" + std::to_string(t) + "][" + std::to_string(k) +
                             "] = " + std::to_string(id) + " is not an expert: expected 0 <= id < " +
                             std::to_string(experts));
      if (lastToken[size_t(id)] == t)
        return Status::error("topk_ids: token " + std::to_string(t) + " routes to expert " +
                             std::to_string(id) + " twice (top-k positions " +
                             std::to_string(lastSlot[size_t(id)]) + " and " +
                             std::to_string(k) + ")");
      lastToken[size_t(id)] = t;
      lastSlot[size_t(id)] = k;
      ++counts[size_t(id)];
    }
  }

  // Counting sort: visiting rows in (token, k) order keeps it stable. The
  // vectors of *out keep their storage from the last layout built into it,
  // so a caller that reuses one pays no fresh pages a pass.
  RoutingLayout &layout = *out;
  layout.tokens = tokens;
  layout.topK = topK;
  layout.experts = experts;
  layout.counts.swap(counts);
  layout.offsets.assign(size_t(experts) + 1, 0);
  for (int64_t e = 0; e < experts; ++e)
    layout.offsets[size_t(e) + 1] = layout.offsets[size_t(e)] + layout.counts[size_t(e)];
  std::vector<int64_t> &next = lastToken; // reused: the next free sorted row of each expert
  std::copy(layout.offsets.begin(), layout.offsets.end() - 1, next.begin());
  layout.order.resize(size_t(rows));
  layout.position.resize(size_t(rows));
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = next[size_t(topkIds[row])]++;
    layout.order[size_t(i)] = row;
    layout.position[size_t(row)] = i;
  }
  return Status::success();
}

} // namespace

Status buildRoutingLayout(const int32_t *topkIds, int64_t tokens, int64_t topK, int64_t experts,
                          RoutingLayout *out) {
  return buildLayout(topkIds, tokens, topK, experts, out);
}

Status buildRoutingLayout(const int64_t *topkIds, int64_t tokens, int64_t topK, int64_t experts,
                          RoutingLayout *out) {
  return buildLayout(topkIds, tokens, topK, experts, out);
}

} // namespace moec::rt
