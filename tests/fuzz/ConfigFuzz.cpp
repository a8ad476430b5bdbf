//===- ConfigFuzz.cpp - libFuzzer target for the config loader --------------===//
//
// Feeds arbitrary text to parseConfig. It must return an error with a message
// or a config that validates, and never crash, hang or overflow; for a config
// it accepts, the derived task-split values and the receive capacity must
// compute without overflow (UBSan reports a signed overflow) and be positive.
//
//===----------------------------------------------------------------------===//

#include "compiler/config/Config.h"

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::string_view text(reinterpret_cast<const char *>(data), size);
  moec::ModelConfig config;
  std::string error;
  if (!moec::parseConfig(text, "fuzz.json", &config, &error)) {
    if (error.empty())
      std::abort(); // a refusal says why
    return 0;
  }
  const moec::TaskSplitValue v = moec::deriveTaskSplitValue(config);
  if (v.singleRankExpertNum <= 0 || v.perRankSeq <= 0 || v.perExpertSeqToOther <= 0)
    std::abort();
  const moec::format::LayerRecord record = moec::layerRecord(config);
  if (record.receiveCapacity < v.perRankSeq || record.rowCapacity != v.perRankSeq ||
      record.receiveCapacity != moec::format::receiveCapacityRows(moec::capacityInputs(config)))
    std::abort();
  return 0;
}
