//===- Routing.h - Routing layout: rows sorted expert-major -----*- C++ -*-===//
//
// The layout step of dispatch, on one rank: from topk_ids [S, K] it counts
// the (token, k) rows of every expert and sorts the rows expert-major, stably
// (within an expert: by token, then by k). Row (t, k) is numbered t * K + k.
//
// Since rank r owns experts r*L .. r*L+L-1, the sorted rows are also grouped
// by destination rank: the rows for rank p are the sorted rows
// [offsets[p*L], offsets[(p+1)*L]), and within them those of each of p's local
// experts are contiguous, ready to be put as runs of rows.
//
// Computed on the host for every backend (the runtime API calls it when the
// routing is set).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_LAYER_ROUTING_H
#define MOEC_RUNTIME_LAYER_ROUTING_H

#include "base/Status.h"

#include <cstdint>
#include <vector>

namespace moec::rt {

/// The expert-major order of one rank's (token, k) rows.
struct RoutingLayout {
  int64_t tokens = 0;  ///< S
  int64_t topK = 0;    ///< K
  int64_t experts = 0; ///< E, experts in all

  /// counts[e]: the rows routed to expert e.
  std::vector<int64_t> counts;
  /// offsets[e]: the first sorted row of expert e; offsets[E] = S * K.
  std::vector<int64_t> offsets;
  /// order[i]: the row t * K + k that is sorted row i.
  std::vector<int64_t> order;
  /// position[t * K + k]: the sorted row of (t, k); the inverse of order.
  std::vector<int64_t> position;

  /// Returns the token of sorted row `i`.
  int64_t tokenOf(int64_t i) const { return order[size_t(i)] / topK; }
  /// Returns the top-k position of sorted row `i`.
  int64_t slotOf(int64_t i) const { return order[size_t(i)] % topK; }
};

/// Builds the layout of `tokens` x `topK` expert ids at `topkIds` (row-major)
/// over `experts` experts into *out. Errors (and *out is left unchanged): a
/// negative size; an id outside [0, experts), e.g. "topk_ids[3][1] = 9 is
/// not an expert: expected 0 <= id < 8"; and an expert named twice in a
/// token's top-k, e.g. "topk_ids: token 3 routes to expert 5 twice (top-k
/// positions 0 and 2)". Takes O(S*K + E) time; *out's vectors keep their
/// storage, so a layout rebuilt in the same object every pass allocates
/// nothing new once it has held as many rows.
Status buildRoutingLayout(const int32_t *topkIds, int64_t tokens, int64_t topK, int64_t experts,
                          RoutingLayout *out);

/// buildRoutingLayout for int64 expert ids.
Status buildRoutingLayout(const int64_t *topkIds, int64_t tokens, int64_t topK, int64_t experts,
                          RoutingLayout *out);

} // namespace moec::rt

#endif // MOEC_RUNTIME_LAYER_ROUTING_H
