//===- ScheduleTest.cpp - The queues the compiler builds for shipped graphs ===//
//
// A LoRA layer compiled for the cpu target has each adapter's second GMM
// fused into its base's (moe-fuse-low-rank), which then reads the rank-r
// rows of the adapter's first GMM: a small task ahead of a large one. The
// scheduler (compiler/target/Schedule.cpp) gives such a task its
// successor's priority, so that each expert's small tile runs just before
// the base's on one core; by priority alone every small tile of an op would
// run first, and the in-order queues would hold each base tile behind the
// last expert's small one.
//
//===----------------------------------------------------------------------===//

#include "compiler/driver/Compile.h"
#include "format/TaskBinary.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

using namespace moec;

namespace {

/// A small LoRA layer's config, written to the test's temporary folder.
std::string loraConfig() {
  const char *tmp = std::getenv("TEST_TMPDIR");
  const std::string path = fmt::format("{}/lora-{}.json", tmp ? tmp : "/tmp", getpid());
  std::ofstream(path) << R"({"name": "lora", "hidden_size": 1024, "intermediate_size": 256,
    "num_experts": 16, "top_k": 2, "ep": 2, "tp": 1, "seq_size": 128, "dtype": "bf16",
    "lora_rank": 8, "lora_alpha": 16})";
  return path;
}

/// Where each task of `program` sits: its queue and its place in it.
struct Place {
  size_t queue = 0, index = 0;
};

std::vector<Place> places(const format::TaskProgram &program) {
  std::vector<Place> at(program.tasks.size());
  for (size_t q = 0; q < program.queues.size(); ++q) {
    const format::QueueRecord &queue = program.queues[q];
    for (uint32_t i = 0; i < queue.entryCount; ++i)
      at[program.queueEntries[queue.firstEntry + i]] = {q, i};
  }
  return at;
}

/// The task of op `name` for local expert `expert` (the graphs cut one
/// tile an expert for these sizes).
uint32_t taskOf(const format::TaskProgram &program, const std::string &name, uint32_t expert) {
  for (const format::OpRecord &op : program.ops)
    if (program.name(op.name) == name) {
      REQUIRE(op.taskCount > expert);
      return op.firstTask + expert;
    }
  FAIL("no op " << name);
  return 0;
}

/// How many experts' `consumer` tiles run right after their `producer`
/// tiles, on the same queue.
uint32_t chained(const format::TaskProgram &program, const std::string &consumer,
                 const std::string &producer, uint32_t experts) {
  const std::vector<Place> at = places(program);
  uint32_t count = 0;
  for (uint32_t e = 0; e < experts; ++e) {
    const Place c = at[taskOf(program, consumer, e)], p = at[taskOf(program, producer, e)];
    count += p.queue == c.queue && c.index == p.index + 1;
  }
  return count;
}

format::TaskProgram compiled(const std::string &graph, const std::string &target,
                             const std::string &config) {
  driver::CompileOptions options;
  options.configPath = config;
  options.target = target;
  driver::CompileResult result;
  const Status status = driver::compileGraphFile(graph, options, &result);
  INFO(graph << " on " << target << ": " << status.message());
  REQUIRE(status.ok());
  return std::move(result.program);
}

} // namespace

TEST_CASE("a LoRA adapter's first tile of an expert runs just before its fused base's",
          "[schedule]") {
  const std::string config = loraConfig();
  const uint32_t experts = 8; // 16 experts over 2 ranks
  for (const char *graph :
       {"graphs/moe_ffn_fwd_lora_transposed.json", "graphs/moe_ffn_fwd_lora.json"}) {
    INFO(graph);
    const format::TaskProgram forward = compiled(graph, "cpu", config);
    CHECK(chained(forward, "up_proj", "up_lora_a", experts) == experts);
    CHECK(chained(forward, "down_proj", "down_lora_a", experts) == experts);
  }
  const format::TaskProgram backward =
      compiled("graphs/moe_ffn_bwd_lora_transposed.json", "cpu", config);
  CHECK(chained(backward, "act_grad", "down_lora_v", experts) == experts);
  CHECK(chained(backward, "gate_grad", "up_lora_v", experts) == experts);
  std::remove(config.c_str());
}
