//===- GraphMlirFuzz.cpp - libFuzzer target for MLIR graph text -----------===//
//
// Arbitrary text through the MLIR parser (with moec's nesting bound) and
// the graph pipeline.
//
//===----------------------------------------------------------------------===//

#include "compiler/import/GraphJson.h"
#include "tests/fuzz/GraphFuzz.h"

#include <cstdint>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const llvm::StringRef text(reinterpret_cast<const char *>(data), size);
  moec::fuzz::checkGraphPipeline(
      [&](mlir::MLIRContext *context) { return moec::parseGraphMlir(text, "fuzz.mlir", context); });
  return 0;
}
