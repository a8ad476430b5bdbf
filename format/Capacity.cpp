//===- Capacity.cpp - The rows a compiled layer holds ---------------------===//

#include "format/Capacity.h"

#include <algorithm>
#include <cmath>

namespace moec::format {

int64_t receiveCapacityRows(const CapacityInputs &c) {
  const int64_t balanced = rowCapacityRows(c);
  const int64_t worst = c.seqSize * c.epRanks * std::min(c.topK, c.localExperts);
  const int64_t scaled = int64_t(std::ceil(c.capacityFactor * double(balanced)));
  return std::max(balanced, std::min(scaled, worst));
}

CapacityAdvice adviseCapacity(const CapacityInputs &c, int64_t rowsPerRank,
                              int64_t receivePerRank, bool headroom) {
  const int64_t topK = std::max<int64_t>(1, c.topK);
  CapacityAdvice advice;
  // Needs beyond any config's sizes are held to just past them, so that no
  // product below overflows; such a need does not fit.
  constexpr int64_t kBeyond = int64_t(1) << 40;
  rowsPerRank = std::clamp<int64_t>(rowsPerRank, 0, kBeyond);
  receivePerRank = std::clamp<int64_t>(receivePerRank, 0, kBeyond);
  advice.seqSize = std::max(c.seqSize, rowsPerRank / topK + (rowsPerRank % topK != 0));
  CapacityInputs changed = c;
  changed.seqSize = advice.seqSize;
  // capacity_factor scales the balanced load S * K, in hundredths: the least
  // one whose receive capacity holds the need (receiveCapacityRows rounds
  // up, so (need - 1) / balanced is a lower bound), or with headroom the
  // need grown.
  const double balanced = double(std::max<int64_t>(1, rowCapacityRows(changed)));
  const double past = kMaxCapacityFactor + 1;
  int64_t hundredths;
  if (headroom) {
    const double grown =
        std::max(double(receivePerRank) / balanced * 1.25, c.capacityFactor * 1.5);
    hundredths = int64_t(std::ceil(std::min(grown, past) * 100.0 - 1e-9));
  } else {
    hundredths = std::max<int64_t>(
        100, int64_t(std::min(past, double(receivePerRank - 1) / balanced) * 100.0));
    for (changed.capacityFactor = double(hundredths) / 100.0;
         hundredths < int64_t(kMaxCapacityFactor * 100) &&
         receiveCapacityRows(changed) < receivePerRank;
         changed.capacityFactor = double(hundredths) / 100.0)
      ++hundredths;
  }
  changed.capacityFactor =
      std::min(kMaxCapacityFactor, std::max(c.capacityFactor, double(hundredths) / 100.0));
  advice.capacityFactor = changed.capacityFactor;
  advice.rowCapacity = advice.seqSize * topK;
  advice.receiveCapacity = receiveCapacityRows(changed);
  advice.fits = advice.rowCapacity >= rowsPerRank && advice.receiveCapacity >= receivePerRank &&
                advice.seqSize <= kMaxSeqSize;
  return advice;
}

} // namespace moec::format
