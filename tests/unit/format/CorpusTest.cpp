//===- CorpusTest.cpp - The reader's fuzz seeds are of today's format -----===//
//
// The task binary fuzzer (tests/fuzz:read_task_binary_fuzz) starts from the
// binaries in tests/fuzz/corpus. A seed the reader refuses at its version
// check leaves the fuzzer nothing past the header to explore, so each seed
// must read and validate with this reader, and together they must hold the
// records the reader checks most: a layer section, a low-rank product, a
// lead product and a quantized weight. After a format change,
// tests/fuzz/make_corpus.sh writes them again.
//
//===----------------------------------------------------------------------===//

#include "format/TaskBinary.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

using namespace moec::format;

TEST_CASE("the fuzz corpus's binaries are of the format the reader reads", "[task-binary]") {
  bool layer = false, lowRank = false, lead = false, quantized = false;
  for (const char *name : {"plain-fwd", "lora-fwd", "lora-bwd", "fp8-bwd"}) {
    const std::string path = std::string("tests/fuzz/corpus/") + name + ".bin";
    INFO(path << " (tests/fuzz/make_corpus.sh writes it)");
    TaskProgram program;
    const moec::Status status = loadTaskBinaryFile(path, &program);
    INFO(status.message());
    REQUIRE(status.ok());
    CHECK(validateTaskProgram(program).ok());
    layer = layer || program.layer.has_value();
    for (uint32_t i = 0; i < program.ops.size(); ++i) {
      const TilingRecord &t = program.tilings[program.ops[i].tiling];
      lowRank = lowRank || t.lowRank();
      lead = lead || leadHost(program, i) != kNone;
      quantized = quantized || (t.flags & kTilingQuantizedB) != 0;
    }
  }
  CHECK(layer);
  CHECK(lowRank);
  CHECK(lead);
  CHECK(quantized);
}
