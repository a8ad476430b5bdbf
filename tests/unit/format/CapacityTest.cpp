//===- CapacityTest.cpp - The rows a compiled layer holds ----------------===//
//
// format/Capacity.h: receiveCapacityRows and its inverse, adviseCapacity.
//
//===----------------------------------------------------------------------===//

#include "format/Capacity.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>

using namespace moec::format;

namespace {

/// tiny.json's layer: seq_size 128, top_k 2, ep 2, 2 local experts (the
/// balanced load 256 rows a rank, the worst case 512), with `factor`.
CapacityInputs tiny(double factor) {
  CapacityInputs c;
  c.seqSize = 128;
  c.topK = 2;
  c.epRanks = 2;
  c.localExperts = 2;
  c.capacityFactor = factor;
  return c;
}

} // namespace

TEST_CASE("receiveCapacityRows: the balanced load scaled, within the worst case", "[format][capacity]") {
  CapacityInputs c = tiny(2.0);
  CHECK(rowCapacityRows(c) == 256);
  CHECK(receiveCapacityRows(c) == 512); // 2 x 256: the worst case, 128 x 2 x min(2, 2)
  c.capacityFactor = 4.0;
  CHECK(receiveCapacityRows(c) == 512); // no more than the worst case
  c.localExperts = 1;
  CHECK(receiveCapacityRows(c) == 256); // worst: 128 x 2 x min(2, 1); never under the balanced load
  c.localExperts = 8;
  c.capacityFactor = 1.001;
  CHECK(receiveCapacityRows(c) == 257); // rounded up
}

TEST_CASE("adviseCapacity inverts receiveCapacityRows", "[format][capacity]") {
  const CapacityInputs c = tiny(1.0);
  REQUIRE(receiveCapacityRows(c) == 256);

  // A routing that fits keeps the config.
  CapacityAdvice a = adviseCapacity(c, 256, 200, false);
  CHECK(a.seqSize == 128);
  CHECK(a.capacityFactor == 1.0);
  CHECK(a.rowCapacity == 256);
  CHECK(a.receiveCapacity == 256);
  CHECK(a.fits);

  // More received rows: the least factor in hundredths that holds them.
  a = adviseCapacity(c, 256, 300, false); // 300 / 256 = 1.17...
  CHECK(a.capacityFactor == Approx(1.17));
  CHECK(a.receiveCapacity == 300); // ceil(1.17 * 256)
  CHECK(a.fits);

  // More routed rows: seq_size grows to hold them, and the factor scales
  // the new balanced load (300 rows).
  a = adviseCapacity(c, 300, 390, false);
  CHECK(a.seqSize == 150);
  CHECK(a.rowCapacity == 300);
  CHECK(a.capacityFactor == Approx(1.3));
  CHECK(a.receiveCapacity == 390);
  CHECK(a.fits);

  // With headroom: 1.25 x the need, and at least 1.5 x the config's factor.
  a = adviseCapacity(c, 256, 300, true);
  CHECK(a.capacityFactor == Approx(1.5));
  CHECK(a.receiveCapacity == 384);
  a = adviseCapacity(c, 256, 400, true); // 400 / 256 * 1.25 = 1.95...
  CHECK(a.capacityFactor == Approx(1.96));

  // A need past any config's sizes does not fit, and overflows nothing.
  a = adviseCapacity(c, std::numeric_limits<int64_t>::max(), 10, false);
  CHECK_FALSE(a.fits);
  a = adviseCapacity(c, 256, std::numeric_limits<int64_t>::max(), true);
  CHECK_FALSE(a.fits);
  CHECK(a.capacityFactor == 1024.0);

  // For every need up to the worst case: what it advises holds the routing,
  // and a hundredth less would not (the advice is the least).
  for (int64_t receive = 1; receive <= 512; ++receive) {
    a = adviseCapacity(c, 256, receive, false);
    INFO("receive " << receive << " factor " << a.capacityFactor);
    CHECK(a.fits);
    CapacityInputs changed = c;
    changed.capacityFactor = a.capacityFactor;
    CHECK(receiveCapacityRows(changed) == a.receiveCapacity);
    if (a.capacityFactor > c.capacityFactor) {
      changed.capacityFactor = a.capacityFactor - 0.01;
      CHECK(receiveCapacityRows(changed) < receive);
    }
  }
}
