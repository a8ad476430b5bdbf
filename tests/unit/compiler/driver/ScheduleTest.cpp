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
#include <functional>
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
                             const std::string &config, bool leadProducts = true) {
  driver::CompileOptions options;
  options.configPath = config;
  options.target = target;
  options.leadProducts = leadProducts;
  driver::CompileResult result;
  const Status status = driver::compileGraphFile(graph, options, &result);
  INFO(graph << " on " << target << ": " << status.message());
  REQUIRE(status.ok());
  return std::move(result.program);
}

} // namespace

/// The index of op `name`.
uint32_t opIndex(const format::TaskProgram &program, const std::string &name) {
  for (uint32_t i = 0; i < program.ops.size(); ++i)
    if (program.name(program.ops[i].name) == name)
      return i;
  FAIL("no op " << name);
  return 0;
}

TEST_CASE("a LoRA adapter's first tile of an expert runs just before its fused base's",
          "[schedule]") {
  // Compiled with --no-lead-products (its tiles tasks of their own).
  const std::string config = loraConfig();
  const uint32_t experts = 8; // 16 experts over 2 ranks
  for (const char *graph :
       {"graphs/moe_ffn_fwd_lora_transposed.json", "graphs/moe_ffn_fwd_lora.json"}) {
    INFO(graph);
    const format::TaskProgram forward = compiled(graph, "cpu", config, false);
    CHECK(chained(forward, "up_proj", "up_lora_a", experts) == experts);
    CHECK(chained(forward, "down_proj", "down_lora_a", experts) == experts);
  }
  const format::TaskProgram backward =
      compiled("graphs/moe_ffn_bwd_lora_transposed.json", "cpu", config, false);
  CHECK(chained(backward, "act_grad", "down_lora_v", experts) == experts);
  CHECK(chained(backward, "gate_grad", "up_lora_v", experts) == experts);
  std::remove(config.c_str());
}

TEST_CASE("a LoRA adapter's first GMM is lowered as a lead product of its fused base",
          "[schedule]") {
  // By default (the cpu target) the first GMM has no tasks: its base's
  // tiles compute U (format::leadOp), and every event that would name its
  // tiles names the base's; the adapter's gradient GMMs that read V wait
  // for the base. For a target with a shared cache nothing is fused, so
  // nothing is a lead.
  const std::string config = loraConfig();
  const std::pair<const char *, const char *> forwardPairs[] = {{"up_proj", "up_lora_a"},
                                                                {"down_proj", "down_lora_a"}};
  const std::pair<const char *, const char *> backwardPairs[] = {{"act_grad", "down_lora_v"},
                                                                 {"gate_grad", "up_lora_v"}};
  const auto check = [](const format::TaskProgram &p, const char *host, const char *lead) {
    INFO(host << " / " << lead);
    const uint32_t h = opIndex(p, host), l = opIndex(p, lead);
    CHECK(p.ops[l].taskCount == 0);
    CHECK(format::leadOp(p, h) == l);
    CHECK(format::leadHost(p, l) == h);
    for (const format::EventRecord &event : p.events)
      CHECK(event.op != l);
  };
  for (const auto &[host, lead] : forwardPairs)
    check(compiled("graphs/moe_ffn_fwd_lora.json", "cpu", config), host, lead);
  const format::TaskProgram backward = compiled("graphs/moe_ffn_bwd_lora.json", "cpu", config);
  for (const auto &[host, lead] : backwardPairs)
    check(backward, host, lead);
  // up_lora_a_grad reads V (lora_v1): it waits for gate_grad's tiles.
  const uint32_t gate = opIndex(backward, "gate_grad");
  const format::OpRecord &grad = backward.ops[opIndex(backward, "up_lora_a_grad")];
  bool waitsOnGate = false;
  for (uint32_t t = grad.firstTask; t < grad.firstTask + grad.taskCount; ++t) {
    const format::TaskRecord &task = backward.tasks[t];
    for (uint32_t w = task.firstWait; w < task.firstWait + task.waitCount; ++w)
      waitsOnGate = waitsOnGate || backward.events[backward.waits[w].event].op == gate;
  }
  CHECK(waitsOnGate);
  // The reader checks the pairing: a lead on another row grid, or of
  // another A, or no host at all, is refused, naming the op.
  REQUIRE(format::validateTaskProgram(backward).ok());
  const uint32_t leadIndex = opIndex(backward, "up_lora_v");
  const auto refused = [&](const std::function<void(format::TaskProgram &)> &spoil,
                           const std::string &says) {
    format::TaskProgram p = backward;
    spoil(p);
    const Status status = format::validateTaskProgram(p);
    INFO(status.message());
    CHECK_FALSE(status.ok());
    CHECK_THAT(status.message(), Catch::Contains("'up_lora_v'") && Catch::Contains(says));
  };
  const auto leadTiling = [&](format::TaskProgram &p) -> format::TilingRecord & {
    return p.tilings[p.ops[leadIndex].tiling];
  };
  refused([&](format::TaskProgram &p) { leadTiling(p).rowTiles = 2; },
          "so it is the lead product of op 7 'gate_grad'");
  refused([&](format::TaskProgram &p) { leadTiling(p).inputSlots[0] = leadTiling(p).outputSlot; },
          "so it is the lead product of op 7 'gate_grad'");
  refused([&](format::TaskProgram &p) { leadTiling(p).outputSlot = leadTiling(p).inputSlots[0]; },
          "has 0 tasks, but its tiling");
  {
    // Two hosts: gate_grad made to read down_lora_v's output as its U too.
    format::TaskProgram p = backward;
    const uint32_t gateGrad = opIndex(p, "gate_grad"), downV = opIndex(p, "down_lora_v");
    p.tilings[p.ops[gateGrad].tiling].lowRankSlots[0] = p.tilings[p.ops[downV].tiling].outputSlot;
    const Status status = format::validateTaskProgram(p);
    INFO(status.message());
    CHECK_THAT(status.message(), Catch::Contains("'down_lora_v': has no tasks, and two ops") &&
                                     Catch::Contains("a lead product has one host"));
  }
  const format::TaskProgram own = compiled("graphs/moe_ffn_fwd_lora.json", "cpu", config, false);
  CHECK(own.ops[opIndex(own, "up_lora_a")].taskCount > 0);
  CHECK(format::leadOp(own, opIndex(own, "up_proj")) == format::kNone);
  const format::TaskProgram h100 = compiled("graphs/moe_ffn_fwd_lora.json", "h100", config);
  CHECK(h100.ops[opIndex(h100, "up_lora_a")].taskCount > 0);
  std::remove(config.c_str());
}
