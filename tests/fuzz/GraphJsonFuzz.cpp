//===- GraphJsonFuzz.cpp - libFuzzer target for the JSON graph import -----===//
//
// Arbitrary text through importGraphJson and the graph pipeline.
//
//===----------------------------------------------------------------------===//

#include "compiler/import/GraphJson.h"
#include "tests/fuzz/GraphFuzz.h"

#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const std::string_view text(reinterpret_cast<const char *>(data), size);
  moec::fuzz::checkGraphPipeline(
      [&](mlir::MLIRContext *context) { return moec::importGraphJson(text, "fuzz.json", context); });
  return 0;
}
