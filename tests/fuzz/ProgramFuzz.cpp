//===- ProgramFuzz.cpp - libFuzzer target for readers of a task program ---===//
//
// Feeds arbitrary bytes to the task binary reader (the checksum check off,
// so that mutated files get past it) and, for every program it accepts,
// makes what the tools and the runtime make of it before anything runs:
// what `moec dump` prints (the analysis: costs from the profile the binary
// names, the timed simulation and its deadlock verdict; the text and JSON
// dumps, for the whole group and for rank 0 with one queue in full; the
// task graph and the op graph as dot) and the runtime's reading of it as a
// layer (rt::analyzeLayer: an error or a plan). None may crash, hang or
// read out of bounds on a program the reader accepted.
//
//===----------------------------------------------------------------------===//

#include "compiler/inspect/Analysis.h"
#include "compiler/inspect/Dump.h"
#include "format/TaskBinary.h"
#include "runtime/layer/Layer.h"

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>

using namespace moec;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  format::ReadOptions read;
  read.verifyChecksum = false;
  format::TaskProgram program;
  if (!format::readTaskBinary(data, size, &program, read).ok())
    return 0;
  rt::LayerPlan plan;
  if (const Status status = rt::analyzeLayer(program, &plan);
      !status.ok() && status.message().empty())
    std::abort();
  inspect::Analysis analysis;
  if (!inspect::analyzeBinary(program, std::nullopt, false, "fuzz", &analysis).ok())
    return 0;
  const inspect::FileFacts facts = inspect::factsOf(program, "fuzz");
  inspect::DumpOptions all;
  inspect::DumpOptions one;
  one.rank = 0;
  one.core = inspect::CoreSelector{format::CoreKind::Cube, 0};
  for (const inspect::DumpOptions &options : {all, one}) {
    if (!inspect::checkDumpOptions(program, options).ok())
      continue;
    if (inspect::dumpText(program, facts, options, analysis).empty())
      std::abort();
    if (inspect::dumpJson(program, facts, options, analysis).dump().empty())
      std::abort();
    std::string dot;
    if (!inspect::dumpDot(program, options, &dot).ok() || dot.empty())
      std::abort();
  }
  if (inspect::dumpOpGraph(program).empty())
    std::abort();
  return 0;
}
