//===- Capacity.h - The rows a compiled layer holds -------------*- C++ -*-===//
//
// The one place that computes a layer's capacities from its config's values
// and inverts that computation: the compiler sizes the dynamic tensors with
// receiveCapacityRows() and records the result in the binary's layer record;
// `moec run`'s hint and the torch op's capacity growth ask adviseCapacity()
// what a config must change to hold a routing, from the same record.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_FORMAT_CAPACITY_H
#define MOEC_FORMAT_CAPACITY_H

#include <cstdint>

namespace moec::format {

/// The most a config may ask for: "seq_size" up to 2^24 tokens, and a
/// "capacity_factor" between 1 and 1024; hidden and intermediate sizes up
/// to 2^20, experts, top-k, LoRA ranks and int4 groups up to 2^16. They
/// keep every product of sizes the compiler and runtime form (tokens x
/// ranks x top-k x hidden, a weight's experts x H x 2I) far inside 64 bits,
/// and far above any real layer (DeepSeek-V3: H 7168, E 256, top-8). The
/// config loader and the task binary's reader (its layer record) both hold
/// to them.
inline constexpr int64_t kMaxSeqSize = int64_t(1) << 24;
inline constexpr int64_t kMaxModelWidth = int64_t(1) << 20;
inline constexpr int64_t kMaxCount = int64_t(1) << 16;
inline constexpr double kMinCapacityFactor = 1.0;
inline constexpr double kMaxCapacityFactor = 1024.0;

/// The config's values a layer's capacities follow from, in this order.
struct CapacityInputs {
  int64_t seqSize = 0;       ///< S: tokens per EP rank ("seq_size")
  int64_t topK = 0;          ///< K ("top_k")
  int64_t epRanks = 1;       ///< P ("ep")
  int64_t localExperts = 1;  ///< L: experts of one EP rank
  double capacityFactor = 2; ///< "capacity_factor"
};

/// The rows a rank routes: S * K.
inline int64_t rowCapacityRows(const CapacityInputs &c) { return c.seqSize * c.topK; }

/// The rows of dispatched activations one rank's experts can hold in all (the
/// capacity of the dynamic tensors): ceil(capacity_factor * S * K), the
/// balanced load scaled, but no more than the worst case, when every token
/// of every rank picks min(K, L) of the rank's L experts: S * P * min(K, L);
/// and no less than the balanced load.
int64_t receiveCapacityRows(const CapacityInputs &c);

/// What a config must change to hold a routing that routes `rowsPerRank`
/// rows from its fullest rank and puts `receivePerRank` rows on the experts
/// of its fullest rank (the runtime's CapacityNeed), and what the changed
/// config holds.
struct CapacityAdvice {
  int64_t seqSize = 0;         ///< the config's S, or raised to hold rowsPerRank
  double capacityFactor = 0;   ///< the config's, or raised to hold receivePerRank (at most 1024)
  int64_t rowCapacity = 0;     ///< seqSize * K: the rows a rank may route
  int64_t receiveCapacity = 0; ///< receiveCapacityRows of the changed config
  bool fits = false;           ///< whether a config can hold the routing at all
};

/// The inverse of receiveCapacityRows(). Factors are rounded up to
/// hundredths. With `headroom`, the factor is raised beyond the need (1.25
/// times it, and at least 1.5 times the config's): a router's balance
/// drifts, and a recompile per small growth costs more than the memory.
CapacityAdvice adviseCapacity(const CapacityInputs &c, int64_t rowsPerRank,
                              int64_t receivePerRank, bool headroom);

} // namespace moec::format

#endif // MOEC_FORMAT_CAPACITY_H
