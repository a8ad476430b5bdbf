//===- LayerTest.cpp - Tests for a binary read as a MoE-FFN layer ---------===//
//
// analyzeLayer (runtime/layer/Layer.h) on binaries compiled from the shipped
// graphs with the tiny config (H 64, I 32, 4 experts over 2 EP ranks, top-2,
// 128 tokens, fp32): the role of every slot and op in forward, backward,
// frozen, LoRA and FP8-dispatch layers and in the dispatch and combine
// binaries; the slot lists the runtime binds, fills and keeps; the checks
// that pair binaries; and the shape, tiling and dataflow errors of binaries
// changed by hand, with their messages.
//
//===----------------------------------------------------------------------===//

#include "runtime/layer/Layer.h"
#include "compiler/driver/Compile.h"
#include "format/TaskBinary.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

using namespace moec;
using moec::format::DType;
using moec::format::OpKind;
using moec::format::TaskProgram;
using moec::rt::analyzeLayer;
using moec::rt::checkExchangeMatch;
using moec::rt::checkPassesMatch;
using moec::rt::kNoSlot;
using moec::rt::LayerPlan;
using moec::rt::PlanKind;

namespace {

std::string tempPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

/// The tiny config (examples/configs/tiny.json) with `extra` keys added,
/// written to a scratch file; returns its path.
std::string tinyConfig(const std::string &name, const std::string &extra = "",
                       int64_t hidden = 64) {
  const std::string path = tempPath(name + ".json");
  std::ofstream out(path);
  out << "{\"name\": \"" << name << "\", \"hidden_size\": " << hidden
      << ", \"intermediate_size\": 32, \"num_experts\": 4, \"top_k\": 2, \"ep\": 2, \"tp\": 1, "
         "\"seq_size\": 128, \"dtype\": \"fp32\", \"num_cube_cores\": 2, "
         "\"num_vector_cores\": 4"
      << extra << "}";
  return path;
}

/// `graph` (a file under graphs/) compiled for the CPU with `config`;
/// compiled once per test binary.
const TaskProgram &compiled(const std::string &graph, const std::string &config) {
  static std::map<std::string, TaskProgram> cache;
  const std::string key = graph + "|" + config;
  if (auto it = cache.find(key); it != cache.end())
    return it->second;
  driver::CompileOptions options;
  options.configPath = config;
  options.target = "cpu";
  driver::CompileResult result;
  Status status = driver::compileGraphFile("graphs/" + graph, options, &result);
  INFO(graph << " with " << config << ": " << status.message());
  REQUIRE(status.ok());
  return cache[key] = std::move(result.program);
}

const TaskProgram &tiny(const std::string &graph) {
  return compiled(graph, "examples/configs/tiny.json");
}

LayerPlan analyzeOk(const TaskProgram &program) {
  LayerPlan plan;
  Status status = analyzeLayer(program, &plan);
  INFO(status.message());
  REQUIRE(status.ok());
  return plan;
}

std::string analyzeError(const TaskProgram &program) {
  LayerPlan plan;
  Status status = analyzeLayer(program, &plan);
  REQUIRE_FALSE(status.ok());
  return status.message();
}

/// The name of `slot`, or "-" for none.
std::string slotName(const TaskProgram &p, uint32_t slot) {
  if (slot == kNoSlot)
    return "-";
  REQUIRE(slot < p.slots.size());
  return std::string(p.name(p.slots[slot].name));
}

std::vector<std::string> slotNames(const TaskProgram &p, const std::vector<uint32_t> &slots) {
  std::vector<std::string> names;
  for (uint32_t slot : slots)
    names.push_back(slotName(p, slot));
  return names;
}

uint32_t slotNamed(const TaskProgram &p, const std::string &name) {
  for (uint32_t i = 0; i < p.slots.size(); ++i)
    if (p.name(p.slots[i].name) == name)
      return i;
  FAIL("no slot " << name);
  return kNoSlot;
}

uint32_t opNamed(const TaskProgram &p, const std::string &name) {
  for (uint32_t i = 0; i < p.ops.size(); ++i)
    if (p.name(p.ops[i].name) == name)
      return i;
  FAIL("no op " << name);
  return kNoSlot;
}

format::TilingRecord &tilingOf(TaskProgram &p, const std::string &op) {
  return p.tilings[p.ops[opNamed(p, op)].tiling];
}

/// Rows of a slot: its capacity when dynamic, else dim 0.
int64_t rowsOf(const TaskProgram &p, uint32_t slot) {
  const format::SlotRecord &s = p.slots[slot];
  return (s.flags & format::kSlotDynamic) ? int64_t(s.capacityRows) : int64_t(s.dims[0]);
}

} // namespace

//===----------------------------------------------------------------------===//
// Roles
//===----------------------------------------------------------------------===//

TEST_CASE("a forward binary: the layer's shape and every slot's role", "[layer]") {
  const TaskProgram &p = tiny("moe_ffn_fwd.json");
  const LayerPlan plan = analyzeOk(p);
  CHECK(plan.kind == PlanKind::Layer);

  const LayerShape &s = plan.shape;
  CHECK_FALSE(s.backward);
  CHECK(s.ranks == 2);
  CHECK(s.tp == 1);
  CHECK(s.localExperts == 2);
  CHECK(s.experts() == 4);
  CHECK(s.hidden == 64);
  CHECK(s.inter == 32);
  CHECK(s.tokens == 128);
  CHECK(s.topK == 2);
  CHECK(s.rowCapacity == 256); // S * K
  CHECK(s.activations == DType::F32);
  CHECK(s.receiveCapacity == rowsOf(p, slotNamed(p, "target")));
  CHECK(s.expertCapacity > 0);
  CHECK(s.expertCapacity <= s.receiveCapacity);
  CHECK(s.putCapacity > 0);
  CHECK(s.putCapacity <= s.expertCapacity);
  CHECK_FALSE(s.frozen);
  CHECK_FALSE(s.fp8Dispatch);
  CHECK(s.loraTargets == 0);

  CHECK(p.name(p.ops[plan.dispatchOp].name) == "dispatch");
  CHECK(p.name(p.ops[plan.combineOp].name) == "combine");
  CHECK(plan.quantizeOp == kNoSlot);
  CHECK(plan.dequantizeOp == kNoSlot);

  const std::map<std::string, uint32_t> roles = {
      {"src", plan.src},
      {"target", plan.dispatched},
      {"up_proj_weight", plan.w1},
      {"down_proj_weight", plan.w2},
      {"up_proj_y", plan.upOut},
      {"swiglu_out", plan.swigluOut},
      {"down_proj_y", plan.toReturn},
      {"combine_out", plan.returned},
      {"target_offset", plan.dTargetOffset},
      {"src_offset", plan.dSrcOffset},
      {"size_d", plan.dSize},
      {"target_offset_c", plan.cTargetOffset},
      {"src_offset_c", plan.cSrcOffset},
      {"size_c", plan.cSize},
      {"glist", plan.glist},
  };
  for (const auto &[name, slot] : roles) {
    INFO("slot " << name);
    CHECK(slotName(p, slot) == name);
  }
  CHECK(plan.dw1 == kNoSlot);
  CHECK(plan.dw2 == kNoSlot);
  CHECK(plan.srcFp8 == kNoSlot);
  CHECK(plan.lora[0].a == kNoSlot);
  CHECK(plan.lora[1].a == kNoSlot);

  // Each op's inputs, in operand order.
  REQUIRE(plan.inputs.size() == p.ops.size());
  const auto &up = plan.inputs[opNamed(p, "up_proj")];
  CHECK(slotNames(p, {up[0], up[1], up[2], up[3]}) ==
        std::vector<std::string>{"target", "up_proj_weight", "glist", "-"});
  const auto &combine = plan.inputs[plan.combineOp];
  CHECK(slotNames(p, {combine[0], combine[1], combine[2], combine[3]}) ==
        std::vector<std::string>{"target_offset_c", "down_proj_y", "src_offset_c", "size_c"});

  // What the runtime binds to the caller's tensors, fills from the routing,
  // and keeps for backward.
  CHECK(slotNames(p, plan.boundSlots()) ==
        std::vector<std::string>{"up_proj_weight", "down_proj_weight"});
  CHECK(slotNames(p, plan.layoutSlots()) ==
        std::vector<std::string>{"size_d", "src_offset", "target_offset", "size_c", "src_offset_c",
                                 "target_offset_c", "glist"});
  CHECK(slotNames(p, plan.readByBackward()) ==
        std::vector<std::string>{"target", "up_proj_y", "swiglu_out", "combine_out"});
}

TEST_CASE("a backward binary: the gradients' roles, and the pair with its forward", "[layer]") {
  const TaskProgram &p = tiny("moe_ffn_bwd.json");
  const LayerPlan bwd = analyzeOk(p);
  const LayerPlan fwd = analyzeOk(tiny("moe_ffn_fwd.json"));
  CHECK(bwd.kind == PlanKind::Layer);
  CHECK(bwd.shape.backward);
  CHECK_FALSE(bwd.shape.frozen);
  CHECK(bwd.shape.hidden == 64);
  CHECK(bwd.shape.inter == 32);
  CHECK(bwd.shape.weightGrads == DType::F32);
  CHECK_FALSE(bwd.shape.accumulateWeightGrads);

  // The seed's names: its "act_grad" multiplies by w2 and its "gate_grad"
  // by w1; "w1_grad" makes dw2 = A^T dZ and "w2_grad" dw1 = X^T dY.
  const std::map<std::string, uint32_t> roles = {
      {"src", bwd.src},               // w * dy rows to send
      {"act_grad_weight", bwd.w2},    // [L, I, H]
      {"gate_grad_weight", bwd.w1},   // [L, H, 2I]
      {"swiglu_dy", bwd.upOut},       // forward's Y
      {"w1_grad_x1", bwd.swigluOut},  // forward's A
      {"w2_grad_x1", bwd.dispatched}, // forward's X
      {"w1_grad_y", bwd.dw2},
      {"w2_grad_y", bwd.dw1},
      {"gate_grad_y", bwd.toReturn}, // dX rows to return
      {"combine_out", bwd.returned},
      {"glist", bwd.glist},
  };
  for (const auto &[name, slot] : roles) {
    INFO("slot " << name);
    CHECK(slotName(p, slot) == name);
  }
  CHECK(slotNames(p, bwd.boundSlots()) ==
        std::vector<std::string>{"gate_grad_weight", "act_grad_weight", "w2_grad_y", "w1_grad_y",
                                 "w2_grad_x1", "swiglu_dy", "w1_grad_x1"});

  CHECK(checkPassesMatch(fwd, bwd).ok());
  CHECK(checkPassesMatch(bwd, bwd).message() == "the forward program is a backward pass");
  CHECK(checkPassesMatch(fwd, fwd).message() == "the backward program is a forward pass");

  // A backward pass of another layer.
  const LayerPlan wider = analyzeOk(compiled("moe_ffn_bwd.json", tinyConfig("h32", "", 32)));
  CHECK(checkPassesMatch(fwd, wider).message() ==
        "the forward and backward programs are for different layers: hidden size 64 and 32");
}

TEST_CASE("a frozen backward has no weight gradients to bind", "[layer]") {
  const TaskProgram &p = tiny("moe_ffn_bwd_frozen.json");
  const LayerPlan plan = analyzeOk(p);
  CHECK(plan.shape.backward);
  CHECK(plan.shape.frozen);
  CHECK(plan.dw1 == kNoSlot);
  CHECK(plan.dw2 == kNoSlot);
  CHECK(plan.dispatched == kNoSlot);
  CHECK(plan.swigluOut == kNoSlot);
  CHECK(slotNames(p, plan.boundSlots()) ==
        std::vector<std::string>{"gate_grad_weight", "act_grad_weight", "swiglu_dy"});
  CHECK(checkPassesMatch(analyzeOk(tiny("moe_ffn_fwd.json")), plan).ok());
}

TEST_CASE("LoRA adapters: their slots, rank and scale", "[layer][lora]") {
  const std::string config = tinyConfig("lora", ", \"lora_rank\": 4, \"lora_alpha\": 8");
  const TaskProgram &p = compiled("moe_ffn_fwd_lora.json", config);
  const LayerPlan plan = analyzeOk(p);
  CHECK(plan.shape.loraTargets == 3); // w1 and w2
  CHECK(plan.shape.loraRank == 4);
  CHECK(plan.shape.loraScaling == 2.0f); // lora_alpha / lora_rank
  CHECK(slotName(p, plan.w1) == "up_proj_weight");
  CHECK(slotName(p, plan.w2) == "down_proj_weight");
  CHECK(slotName(p, plan.lora[0].a) == "lora_a1");
  CHECK(slotName(p, plan.lora[0].b) == "lora_b1");
  CHECK(slotName(p, plan.lora[0].u) == "lora_u1");
  CHECK(slotName(p, plan.lora[1].a) == "lora_a2");
  CHECK(slotName(p, plan.lora[1].b) == "lora_b2");
  CHECK(slotName(p, plan.lora[1].u) == "lora_u2");
  CHECK(plan.lora[0].da == kNoSlot); // gradients are backward's
  CHECK(slotNames(p, plan.boundSlots()) ==
        std::vector<std::string>{"up_proj_weight", "down_proj_weight", "lora_a1", "lora_b1",
                                 "lora_a2", "lora_b2"});
  CHECK(slotNames(p, plan.readByBackward()) == std::vector<std::string>{"target", "up_proj_y",
                                                                        "swiglu_out", "combine_out",
                                                                        "lora_u1", "lora_u2"});

  // For the cpu target each adapter's second GMM is its base's low-rank
  // pair: the base's U must be the rank-r GMM's, of the rows it reads.
  uint32_t upProj = 0;
  for (uint32_t i = 0; i < p.ops.size(); ++i)
    if (p.name(p.ops[i].name) == "up_proj")
      upProj = i;
  REQUIRE(p.tilings[p.ops[upProj].tiling].lowRank());
  TaskProgram broken = p;
  broken.tilings[broken.ops[upProj].tiling].lowRankSlots[0] =
      broken.tilings[broken.ops[upProj].tiling].inputSlots[0];
  CHECK(analyzeError(broken) ==
        "not a MoE-FFN forward layer the runtime can run: op 'up_proj' (gmm) adds a low-rank "
        "product of 'target', which is not written by the rank-r gmm of the up projection "
        "reading 'target'");

  // A forward with adapters and a backward without are different layers.
  CHECK(checkPassesMatch(plan, analyzeOk(tiny("moe_ffn_bwd.json"))).message() ==
        "the forward and backward programs are for different layers: LoRA targets (bit 0: "
        "w1, bit 1: w2) 3 and 0");
}

TEST_CASE("FP8 dispatch: a quantize before the dispatch, a dequantize after it", "[layer][fp8]") {
  const std::string config = tinyConfig("fp8", ", \"dispatch_dtype\": \"fp8_e4m3\"");
  const TaskProgram &p = compiled("moe_ffn_fwd.json", config);
  const LayerPlan plan = analyzeOk(p);
  CHECK(plan.shape.fp8Dispatch);
  REQUIRE(plan.quantizeOp != kNoSlot);
  REQUIRE(plan.dequantizeOp != kNoSlot);
  CHECK(p.ops[plan.quantizeOp].kind == OpKind::Quantize);
  CHECK(p.ops[plan.dequantizeOp].kind == OpKind::Dequantize);
  // The rows to send are still the f32 'src'; the quantized rows are
  // [N, W] and [T, W], W = H + 4 * ceil(H / 128) = 68 bytes.
  CHECK(slotName(p, plan.src) == "src");
  for (uint32_t slot : {plan.srcFp8, plan.receivedFp8}) {
    REQUIRE(slot != kNoSlot);
    CHECK(p.slots[slot].dtype == DType::F8E4M3);
    CHECK(p.slots[slot].dims[1] == 68);
  }
  CHECK(rowsOf(p, plan.srcFp8) == 256);
  CHECK(rowsOf(p, plan.receivedFp8) == plan.shape.receiveCapacity);
  // The experts read the dequantized rows.
  CHECK(plan.dispatched == p.tilings[p.ops[plan.dequantizeOp].tiling].outputSlot);
  CHECK(p.slots[plan.dispatched].dtype == DType::F32);
}

TEST_CASE("dispatch and combine binaries alone are the halves of one exchange", "[layer]") {
  const TaskProgram &d = tiny("moe_dispatch.json");
  const TaskProgram &c = tiny("moe_combine.json");
  const LayerPlan dispatch = analyzeOk(d);
  const LayerPlan combine = analyzeOk(c);
  CHECK(dispatch.kind == PlanKind::Dispatch);
  CHECK(combine.kind == PlanKind::Combine);
  for (const LayerPlan *plan : {&dispatch, &combine}) {
    CHECK(plan->shape.ranks == 2);
    CHECK(plan->shape.localExperts == 2);
    CHECK(plan->shape.hidden == 64);
    CHECK(plan->shape.inter == 0);
    CHECK(plan->shape.rowCapacity == 256);
    CHECK(plan->shape.tokens == 128);
    CHECK(plan->shape.topK == 2);
  }
  CHECK(slotName(d, dispatch.src) == "x_rows");
  CHECK(slotName(d, dispatch.dispatched) == "expert_x");
  CHECK(slotNames(d, dispatch.boundSlots()).empty());
  CHECK(slotNames(d, dispatch.layoutSlots()) ==
        std::vector<std::string>{"size_d", "src_offset", "target_offset"});
  CHECK(slotName(c, combine.toReturn) == "expert_y");
  CHECK(slotName(c, combine.returned) == "returned_rows");
  CHECK(slotNames(c, combine.boundSlots()) == std::vector<std::string>{"expert_y"});
  CHECK(slotNames(c, combine.layoutSlots()) ==
        std::vector<std::string>{"size_c", "src_offset_c", "target_offset_c"});

  CHECK(checkExchangeMatch(dispatch, combine).ok());
  CHECK(checkExchangeMatch(combine, dispatch).message() ==
        "the dispatch program is not a dispatch alone (a graph of one dispatch op)");
  CHECK(checkExchangeMatch(dispatch, analyzeOk(tiny("moe_ffn_fwd.json"))).message() ==
        "the combine program is not a combine alone (a graph of one combine op)");
  const LayerPlan wider =
      analyzeOk(compiled("moe_combine.json", tinyConfig("h32-combine", "", 32)));
  CHECK(checkExchangeMatch(dispatch, wider).message() ==
        "the dispatch and combine programs are for different layers: hidden size 64 and 32");

  // The rows to send must be [rows, H].
  TaskProgram flat = d;
  flat.slots[slotNamed(flat, "x_rows")].rank = 1;
  CHECK(analyzeError(flat) == "slot 'x_rows' has rank 1; expected [rows, H]");
}

//===----------------------------------------------------------------------===//
// What analyzeLayer refuses
//===----------------------------------------------------------------------===//

TEST_CASE("the layer record: required, checked against the ops, and read", "[layer][record]") {
  const TaskProgram &fwd = tiny("moe_ffn_fwd.json");
  const LayerPlan plan = analyzeOk(fwd);
  REQUIRE(fwd.layer);
  CHECK(plan.record == *fwd.layer);
  CHECK(plan.shape.capacityFactor == fwd.layer->capacityFactor);
  CHECK(plan.shape.receiveCapacity == fwd.layer->receiveCapacity);
  TaskProgram p = fwd;

  SECTION("none") {
    p.layer.reset();
    CHECK(analyzeError(p) == "the binary has no layer record: only a program compiled from a "
                             "config (moec compile) runs as a layer");
  }
  SECTION("a hidden size the ops do not have") {
    p.layer->hidden = 128;
    CHECK(analyzeError(p) == "the binary's layer record says hidden size 128, but its ops have 64");
  }
  SECTION("another top_k") {
    p.layer->topK = 1;
    CHECK(analyzeError(p) == "the binary's layer record says top_k 1, but its ops have 2");
  }
  SECTION("another intermediate size") {
    p.layer->intermediate = 64;
    CHECK(analyzeError(p) == "the binary's layer record says an intermediate size of 64 (64 a "
                             "TP rank), but its ops have 32");
  }
  SECTION("FP8 dispatch the ops do not do") {
    p.layer->dispatchDtype = DType::F8E4M3;
    CHECK(analyzeError(p) == "the binary's layer record says the dispatched rows travel as "
                             "f8e4m3, but its ops send them as they are");
  }
  SECTION("main_grad the weight gradients do not do") {
    TaskProgram bwd = tiny("moe_ffn_bwd.json");
    REQUIRE(analyzeOk(bwd).record == *bwd.layer);
    bwd.layer->flags |= moec::format::kLayerMainGrad;
    CHECK(analyzeError(bwd) == "the binary's layer record says main_grad is true, but its "
                               "weight-gradient GMMs write into dw1 and dw2");
  }
  SECTION("another dtype") {
    p.layer->dtype = DType::BF16;
    p.layer->dispatchDtype = DType::BF16;
    CHECK(analyzeError(p) == "the binary's layer record says activations of bf16, but its ops "
                             "have f32");
  }
}

TEST_CASE("shape checks name the slot, its role and both shapes", "[layer][errors]") {
  const TaskProgram &fwd = tiny("moe_ffn_fwd.json");
  TaskProgram p = fwd;

  SECTION("w2 of the wrong shape") {
    p.slots[slotNamed(p, "down_proj_weight")].dims[1] = 31;
    CHECK(analyzeError(p) ==
          "slot 'down_proj_weight' (w2) has shape [2, 31, 64]; expected [2, 32, 64]");
  }
  SECTION("sizes past what a config may ask for, before any product of them") {
    // w1's 2I of 2^63 - 8 would overflow the weights' dims (2 * I); UBSan
    // reports a signed overflow where the check is missing.
    p.slots[slotNamed(p, "up_proj_weight")].dims[2] = uint64_t(INT64_MAX) - 7;
    CHECK(analyzeError(p) ==
          "the layer's sizes (hidden 64, intermediate 4611686018427387900, 2 local experts, 256 "
          "rows to send, 512 dispatched rows) are not what a config may ask for (at most "
          "1048576, 1048576, 65536, 1099511627776, 1099511627776)");
    p = fwd;
    p.slots[slotNamed(p, "src")].dims[1] = uint64_t(1) << 63;
    CHECK_THAT(analyzeError(p),
               Catch::StartsWith("the layer's sizes (hidden -9223372036854775808, "));
  }
  SECTION("w1 whose last dim is odd") {
    p.slots[slotNamed(p, "up_proj_weight")].dims[2] = 63;
    CHECK(analyzeError(p) == "slot 'up_proj_weight' (w1) must be [L, H, 2I]");
  }
  SECTION("w1 of another dtype") {
    p.slots[slotNamed(p, "up_proj_weight")].dtype = DType::BF16;
    CHECK(analyzeError(p) == "slot 'up_proj_weight' (w1) is bf16; expected f32");
  }
  SECTION("a layout tensor of a float dtype") {
    p.slots[slotNamed(p, "size_d")].dtype = DType::F32;
    CHECK(analyzeError(p) == "slot 'size_d' (dispatch sizes) is f32 [4]; expected i32 or i64 [4]");
  }
  SECTION("a group list of the wrong length") {
    p.slots[slotNamed(p, "glist")].dims[0] = 3;
    CHECK(analyzeError(p) == "slot 'glist' (group list) is i64 [3]; expected i32 or i64 [2]");
  }
  SECTION("activations that are not f32 or bf16") {
    p.slots[slotNamed(p, "src")].dtype = DType::I32;
    CHECK(analyzeError(p) == "slot 'src' is i32; activations must be f32 or bf16");
  }
  SECTION("no local experts") {
    p.localExperts = 0;
    CHECK(analyzeError(p) == "the binary has 0 local experts");
  }
}

TEST_CASE("tiling checks name the op and the field", "[layer][errors]") {
  TaskProgram p = tiny("moe_ffn_fwd.json");

  SECTION("a GMM's lda that is not its input's width") {
    format::TilingRecord &t = tilingOf(p, "up_proj");
    t.lda = 63;
    CHECK(analyzeError(p) == "op 'up_proj' (gmm): tiling lda is 63; expected 64");
  }
  SECTION("a put's row width") {
    tilingOf(p, "dispatch").cols = 32;
    CHECK(analyzeError(p) == "op 'dispatch' (dispatch): tiling cols is 32; expected 64");
  }
  SECTION("a grid over other experts") {
    tilingOf(p, "swiglu").experts = 4;
    CHECK(analyzeError(p) ==
          "op 'swiglu' (swiglu): a grid over 4 experts; the binary has 2 local experts");
  }
  SECTION("flags an op does not support") {
    tilingOf(p, "swiglu").flags = format::kTilingAccumulate;
    CHECK(analyzeError(p) == "op 'swiglu' (swiglu): tiling flags 0x4 are not supported here");
  }
  SECTION("peer groups: at most the EP ranks, of activation tiles that share out rows") {
    format::TilingRecord &t = tilingOf(p, "swiglu");
    t.peers = 3; // of 2 EP ranks
    CHECK(analyzeError(p) == "op 'swiglu' (swiglu): 3 peer groups need shared-out rows of an "
                             "activation op and at most the 2 EP ranks");
    t.peers = 2;
    t.flags = 0;
    CHECK(analyzeError(p) == "op 'swiglu' (swiglu): 2 peer groups need shared-out rows of an "
                             "activation op and at most the 2 EP ranks");
    TaskProgram b = tiny("moe_ffn_bwd.json");
    tilingOf(b, "w1_grad").peers = 2; // a weight gradient reduces over all rows
    CHECK(analyzeError(b) == "op 'w1_grad' (gmm): 2 peer groups need shared-out rows of an "
                             "activation op and at most the 2 EP ranks");
  }
  SECTION("a combine that does not reduce over TP ranks") {
    p.tpRanks = 2;
    CHECK(analyzeError(p) ==
          "op 'combine' (combine): the binary runs on 2 TP ranks, whose rows it returns are "
          "partial sums, but it does not reduce over them");
  }
  SECTION("a combine that reduces over one TP rank") {
    tilingOf(p, "combine").flags |= format::kTilingReduceTp;
    CHECK(analyzeError(p) ==
          "op 'combine' (combine) reduces over TP, but the binary has 1 TP rank");
  }
}

TEST_CASE("a binary that is not a MoE-FFN layer says why", "[layer][errors]") {
  TaskProgram p = tiny("moe_ffn_fwd.json");

  SECTION("two dispatches and no combine") {
    p.ops[opNamed(p, "combine")].kind = OpKind::Dispatch;
    CHECK(analyzeError(p) ==
          "not a MoE-FFN forward layer the runtime can run: expected 1 dispatch, 1 swiglu and 1 "
          "combine op with the gmm ops; the binary has 2 dispatch, 1 swiglu, 0 swiglu_grad and 0 "
          "combine");
  }
  SECTION("a GMM that reads another group list") {
    tilingOf(p, "down_proj").inputSlots[2] = slotNamed(p, "size_d");
    CHECK(analyzeError(p) == "not a MoE-FFN forward layer the runtime can run: op 'down_proj' "
                             "(gmm) reads group list 'size_d', the others 'glist'");
  }
  SECTION("a down projection that does not read the SwiGLU's output") {
    tilingOf(p, "down_proj").inputSlots[0] = slotNamed(p, "up_proj_y");
    CHECK(analyzeError(p) == "not a MoE-FFN forward layer the runtime can run: the down "
                             "projection op 'down_proj' (gmm) reads 'up_proj_y'; expected "
                             "'swiglu_out'");
  }
}
