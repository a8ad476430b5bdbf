//===- Dump.cpp - the options of a dump, checked --------------------------===//

#include "compiler/inspect/Dump.h"

#include "compiler/inspect/Describe.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstring>

namespace moec::inspect {

using namespace moec::format;
using json = nlohmann::ordered_json;

Status parseCoreSelector(const std::string &text, CoreSelector *out) {
  auto bad = [&] {
    return Status::error(fmt::format(
        "bad core '{}': expected cube:N or vector:N (N a core index, e.g. cube:3)", text));
  };
  size_t colon = text.find(':');
  if (colon == std::string::npos)
    return bad();
  std::string kind = text.substr(0, colon), index = text.substr(colon + 1);
  CoreSelector core;
  if (kind == "cube")
    core.kind = CoreKind::Cube;
  else if (kind == "vector")
    core.kind = CoreKind::Vector;
  else
    return bad();
  if (index.empty() || index.size() > 10 || !std::all_of(index.begin(), index.end(), [](char c) {
        return std::isdigit((unsigned char)c);
      }))
    return bad();
  uint64_t value = std::stoull(index);
  if (value > UINT32_MAX)
    return bad();
  core.index = uint32_t(value);
  *out = core;
  return Status::success();
}

FileFacts factsOf(const TaskProgram &program, const std::string &path) {
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  FileFacts facts;
  facts.path = path;
  facts.fileSize = bytes.size();
  std::memcpy(&facts.crc32, bytes.data() + offsetof(FileHeader, crc32), sizeof(facts.crc32));
  return facts;
}


Status checkDumpOptions(const TaskProgram &program, const DumpOptions &options) {
  if (options.rank && *options.rank >= program.ranks())
    return Status::error(fmt::format("--rank {}: the binary runs on {} rank{} (0..{})",
                                     *options.rank, program.ranks(),
                                     program.ranks() == 1 ? "" : "s", program.ranks() - 1));
  if (options.core && shownQueues(program, options).empty()) {
    std::vector<uint32_t> indices;
    for (const QueueRecord &queue : program.queues)
      if (queue.coreKind == options.core->kind)
        indices.push_back(queue.coreIndex);
    std::sort(indices.begin(), indices.end());
    const char *kind = coreKindName(options.core->kind);
    std::string have;
    if (indices.empty())
      have = fmt::format("it has no {} cores", kind);
    else if (indices.back() - indices.front() + 1 == indices.size())
      have = fmt::format("its {} cores are {}..{}", kind, indices.front(), indices.back());
    else {
      have = fmt::format("its {} cores are", kind);
      for (size_t i = 0; i < indices.size() && i < 16; ++i)
        have += fmt::format("{} {}", i ? "," : "", indices[i]);
      if (indices.size() > 16)
        have += ", ...";
    }
    return Status::error(fmt::format("the binary has no {} ({})",
                                     coreLabel(options.core->kind, options.core->index), have));
  }
  return Status::success();
}

} // namespace moec::inspect
