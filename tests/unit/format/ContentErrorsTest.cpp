//===- ContentErrorsTest.cpp - The validator's refusals of a program ------===//
//
// What validateTaskProgram (and so the reader) refuses in a program's
// content: out-of-range indices, enum values and reserved bytes, and the
// consistency of tasks, queues and events. Each error is checked through the
// reader and the validator alike (contentError).
//
//===----------------------------------------------------------------------===//

#include "format/Crc32.h"
#include "format/TaskBinary.h"
#include "tests/unit/format/TaskBinaryTestSupport.h"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace moec::format;
using namespace moec::test;
using moec::Status;

namespace {

//===----------------------------------------------------------------------===//
// Content errors
//===----------------------------------------------------------------------===//

TEST_CASE("out-of-range indices", "[task-binary][errors]") {
  TaskProgram p = smallProgram();

  SECTION("event in a wait") {
    p.waits[0].event = 900;
    CHECK(contentError(p) == "task 4: wait 0 names event 900, but the binary has 2 events");
  }
  SECTION("event in a signal") {
    p.signals[3].event = 2;
    CHECK(contentError(p) == "task 3: signal 0 names event 2, but the binary has 2 events");
  }
  SECTION("event in a wait no task uses") {
    p.waits.push_back({7, 0});
    CHECK(contentError(p) == "wait 4 names event 7, but the binary has 2 events");
  }
  SECTION("event in a signal no task uses") {
    p.signals.push_back({9, 1, 0, 0});
    CHECK(contentError(p) == "signal 8 names event 9, but the binary has 2 events");
  }
  SECTION("slot in a tiling input") {
    p.tilings[1].inputSlots[1] = 40;
    CHECK(contentError(p) == "tiling 1: input 1 names slot 40, but the binary has 4 slots");
  }
  SECTION("slot in a tiling output") {
    p.tilings[0].outputSlot = 4;
    CHECK(contentError(p) == "tiling 0: output names slot 4, but the binary has 4 slots");
  }
  SECTION("a used input slot set to none") {
    p.tilings[0].inputSlots[0] = kNone;
    CHECK(contentError(p) == "tiling 0: input 0 names slot 4294967295, but the binary has 4 slots");
  }
  SECTION("an unused input slot that is not none") {
    p.tilings[0].inputSlots[2] = 1;
    CHECK(contentError(p) == "tiling 0: input 2 is past the input count 1 but names slot 1 (unused "
                             "inputs are 0xffffffff)");
    p = smallProgram();
    p.tilings[1].inputSlots[3] = 0;
    CHECK(contentError(p) == "tiling 1: input 3 is past the input count 2 but names slot 0 (unused "
                             "inputs are 0xffffffff)");
  }
  SECTION("all four inputs, and an input count above 4") {
    p.tilings[1].inputCount = 4;
    p.tilings[1].inputSlots[2] = 0;
    p.tilings[1].inputSlots[3] = 3;
    CHECK(validateTaskProgram(p).ok());
    p.tilings[1].inputCount = 5;
    CHECK(contentError(p) == "tiling 1: input count 5 is above 4");
  }
  SECTION("tiling in an op") {
    p.ops[1].tiling = 2;
    CHECK(contentError(p) == "op 1 'up_proj': names tiling 2, but the binary has 2 tilings");
    p.ops[1].tiling = kNone;
    CHECK(contentError(p) ==
          "op 1 'up_proj': names tiling 4294967295, but the binary has 2 tilings");
  }
  SECTION("task in a queue") {
    p.queueEntries[5] = 17;
    CHECK(contentError(p) ==
          "queue 1 (cube core 0): entry 1 names task 17, but the binary has 8 tasks");
  }
  SECTION("task in a queue entry no queue uses") {
    p.queueEntries.push_back(8);
    CHECK(contentError(p) == "queue entry 8 names task 8, but the binary has 8 tasks");
  }
  SECTION("op in a task") {
    p.tasks[0].op = 2;
    CHECK(contentError(p) ==
          "op 0 'dispatch': its task range [0, 4) holds task 0, which names op 2");
  }
  SECTION("op in an event") {
    p.events[1].op = 5;
    CHECK(contentError(p) == "event 1 'done': names op 5, but the binary has 2 ops");
  }
  SECTION("string offset past the end") {
    p.slots[2].name = 5000;
    CHECK(contentError(p) == "slot 2: name offset 5000 is past the end of the " +
                                 std::to_string(p.strings.size()) + "-byte string table");
  }
  SECTION("string offset of an op and an event") {
    p.ops[1].name = uint32_t(p.strings.size());
    CHECK(contentError(p) == "op 1: name offset " + std::to_string(p.strings.size()) +
                                 " is past the end of the " + std::to_string(p.strings.size()) +
                                 "-byte string table");
    p = smallProgram();
    p.events[0].name = 1u << 31;
    CHECK(contentError(p) == "event 0: name offset 2147483648 is past the end of the " +
                                 std::to_string(p.strings.size()) + "-byte string table");
  }
  SECTION("a name that is not terminated") {
    p.strings.back() = 'x';
    uint32_t doneOffset = p.events[1].name;
    CHECK(contentError(p) ==
          "event 1: the name at offset " + std::to_string(doneOffset) + " is not NUL-terminated");
  }
  SECTION("a name that is not UTF-8 text") {
    // A dump's JSON holds UTF-8 text only (its writer would throw), so the
    // reader refuses such a name, naming the byte. Well-formed UTF-8 passes.
    const uint32_t at = p.addString("gate\xc3\xa9");
    p.ops[1].name = at;
    CHECK(validateTaskProgram(p).ok());
    for (const char *bad :
         {"up\xff", "\xc3(", "\xed\xa0\x80", "\xe0\x80\xaf", "ab\xf4\x90\x80\x80"}) {
      p.ops[1].name = p.addString(bad);
      INFO(bad);
      CHECK_THAT(contentError(p),
                 Catch::StartsWith("op 1: the name at offset " + std::to_string(p.ops[1].name) +
                                   " is not UTF-8 text (byte 0x"));
    }
    p.ops[1].name = p.addString("up\xff");
    CHECK(contentError(p) == "op 1: the name at offset " + std::to_string(p.ops[1].name) +
                                 " is not UTF-8 text (byte 0xff at its offset 2)");
  }
  SECTION("a name with a control character") {
    // The compiler refuses such names (they would act on a terminal); the
    // notes run over lines.
    p.events[0].name = p.addString("up\x1b[2J");
    CHECK(contentError(p) == "event 0: the name at offset " + std::to_string(p.events[0].name) +
                                 " holds control character U+001B at its offset 2");
    p = smallProgram();
    p.flags |= kFlagNotes;
    p.notes = p.addString("first line\nsecond\tline");
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("a task's wait range") {
    p.tasks[7].firstWait = 3;
    p.tasks[7].waitCount = 2;
    CHECK(contentError(p) == "task 7: waits [3, 5) run past the 4 waits of the binary");
  }
  SECTION("a task's signal range, without overflowing") {
    p.tasks[0].firstSignal = 0xFFFFFFFFu;
    p.tasks[0].signalCount = 2;
    CHECK(contentError(p) ==
          "task 0: signals [4294967295, 4294967297) run past the 8 signals of the binary");
  }
  SECTION("an op's task range") {
    p.ops[1].firstTask = 5;
    CHECK(contentError(p) == "op 1 'up_proj': tasks [5, 9) run past the 8 tasks of the binary");
  }
  SECTION("a queue's entry range") {
    p.queues[2].entryCount = 3;
    CHECK(contentError(p) ==
          "queue 2 (cube core 1): entries [6, 9) run past the 8 queue entries of the binary");
  }
  SECTION("a peer offset") {
    p.signals[1].peerOffset = 2;
    CHECK(contentError(p) ==
          "task 1: signal 0 goes to peer offset 2, but the EP group has 2 ranks");
  }
}

TEST_CASE("the layer record", "[task-binary][errors][layer]") {
  TaskProgram p = smallProgram();
  const std::string bad = "the layer record: ";

  SECTION("none: a task program that is no layer's") {
    p.layer.reset();
    CHECK(validateTaskProgram(p).ok());
    TaskProgram read;
    const std::vector<uint8_t> bytes = writeTaskBinary(p);
    REQUIRE(readTaskBinary(bytes.data(), bytes.size(), &read).ok());
    CHECK_FALSE(read.layer);
  }
  SECTION("a size not positive") {
    p.layer->hidden = 0;
    CHECK(contentError(p) == bad + "hidden is 0; it must be positive");
  }
  SECTION("a size past the config's limits (format/Capacity.h)") {
    // The runtime multiplies them (a weight's experts x H x 2I): a file is
    // held to what a config may ask for.
    p.layer->intermediate = 6160924290242838560;
    CHECK(contentError(p) ==
          bad + "intermediate is 6160924290242838560; at most 1048576 is supported");
    p = smallProgram();
    p.layer->hidden = kMaxModelWidth + 1;
    CHECK(contentError(p) == bad + "hidden is 1048577; at most 1048576 is supported");
    p = smallProgram();
    p.layer->loraRank = uint32_t(kMaxCount) + 1;
    CHECK(contentError(p) == bad + "lora rank is 65537; at most 65536 is supported");
    p = smallProgram();
    p.layer->weightGroup = 1u << 31;
    CHECK(contentError(p) == bad + "weight group is 2147483648; at most 65536 is supported");
  }
  SECTION("experts the header's ranks do not hold") {
    p.layer->experts = 6;
    CHECK(contentError(p) == bad + "6 experts, but the header has 2 EP ranks of 2 experts");
  }
  SECTION("top_k past the experts") {
    p.layer->topK = 5;
    CHECK(contentError(p) == bad + "top_k 5 is more than the 4 experts");
  }
  SECTION("an intermediate size the TP ranks do not divide") {
    p.tpRanks = 3;
    p.layer->intermediate = 32;
    CHECK(contentError(p) == bad + "intermediate size 32 is not a multiple of the 3 TP ranks");
  }
  SECTION("a capacity factor out of range or not a number") {
    p.layer->capacityFactor = 0.5;
    CHECK(contentError(p) == bad + "capacity factor 0.5 is not between 1 and 1024");
    p.layer->capacityFactor = std::numeric_limits<double>::quiet_NaN();
    CHECK(contentError(p) == bad + "capacity factor nan is not between 1 and 1024");
  }
  SECTION("capacities that are not those of its values") {
    p.layer->rowCapacity = 65;
    CHECK(contentError(p) == bad + "row capacity 65, but seq_size x top_k is 64");
    p.layer->rowCapacity = 64;
    p.layer->receiveCapacity = 100;
    CHECK(contentError(p) == bad + "receive capacity 100, but capacity factor 2 gives 128");
  }
  SECTION("dtypes") {
    p.layer->dtype = DType::I8;
    CHECK(contentError(p) == bad + "activations of dtype 6; f32 or bf16");
    p.layer->dtype = DType::BF16;
    p.layer->dispatchDtype = DType::F32;
    CHECK(contentError(p) == bad + "dispatched rows of dtype 1; the activations' (bf16) or f8e4m3");
    p.layer->dispatchDtype = DType::F8E4M3;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("LoRA alpha without a rank") {
    p.layer->loraAlpha = 16;
    CHECK(contentError(p) == bad + "LoRA alpha 16 with rank 0");
  }
  SECTION("flags and reserved bytes") {
    p.layer->flags = 0x80;
    CHECK(contentError(p) == bad + "unknown flag bits 0x80");
    p.layer->flags = kLayerMainGrad;
    p.layer->reserved[4] = 1;
    CHECK(contentError(p) == bad + "reserved bytes are not zero");
  }
}

TEST_CASE("enum values and reserved bytes", "[task-binary][errors]") {
  TaskProgram p = smallProgram();
  SECTION("op kind") {
    p.ops[0].kind = OpKind(9);
    CHECK(contentError(p) == "op 0 'dispatch': kind 9 is not an op kind (1..7)");
  }
  SECTION("dtype") {
    p.slots[0].dtype = DType(0);
    CHECK(contentError(p) ==
          "slot 0 'x': dtype 0 is not one of f32 (1), bf16 (2), i32 (3), i64 (4), f8e4m3 (5), i8 (6), "
          "i4 (7)");
  }
  SECTION("tiling dtype and op kind") {
    p.tilings[1].dtype = DType(8);
    CHECK(contentError(p) == "tiling 1: dtype 8 is not one of f32 (1), bf16 (2), i32 (3), i64 (4), "
                             "f8e4m3 (5), i8 (6), i4 (7)");
    p = smallProgram();
    p.tilings[1].opKind = OpKind(0);
    CHECK(contentError(p) == "tiling 1: op kind 0 is not an op kind (1..7)");
  }
  SECTION("core kind of a task and a queue") {
    p.tasks[1].coreKind = CoreKind(3);
    CHECK(contentError(p) == "task 1: core kind 3 is not cube (1) or vector (2)");
    p = smallProgram();
    p.queues[0].coreKind = CoreKind(0);
    CHECK(contentError(p) == "queue 0: core kind 0 is not cube (1) or vector (2)");
  }
  SECTION("event kind") {
    p.events[0].kind = EventKind(7);
    CHECK(contentError(p) ==
          "event 0 'dispatch.rows_in': kind 7 is not local (1), cross-rank (2) or terminate (3)");
  }
  SECTION("a GMM's low-rank product") {
    // U [256, 16] with the GMM's rows, V [2 experts, 16, 512 columns].
    SlotRecord u = p.slots[1], v = p.slots[2];
    u.name = p.addString("lora_u");
    u.param = 8;
    u.dims[1] = 16;
    v.name = p.addString("lora_b");
    v.param = 9;
    v.dims[1] = 16;
    p.slots.push_back(u);
    p.slots.push_back(v);
    const uint32_t us = uint32_t(p.slots.size() - 2), vs = us + 1;
    TilingRecord &gmm = p.tilings[1];
    gmm.lowRankSlots[0] = us;
    gmm.lowRankSlots[1] = vs;
    const std::vector<uint8_t> bytes = writeTaskBinary(p);
    TaskProgram read;
    const Status valid = readTaskBinary(bytes.data(), bytes.size(), &read);
    INFO(valid.message());
    REQUIRE(valid.ok());
    CHECK(read.tilings[1].lowRankSlots[0] == us);
    CHECK(read.tilings[1].lowRankSlots[1] == vs);
    const TaskProgram good = p;
    gmm.flags |= kTilingLowRankTransposeB; // V would be [2, 512, 16]
    CHECK(contentError(p) ==
          "tiling 1: the low-rank U must be [256, r] (A's rows) and V [2, N, r] (r = U's "
          "columns, N = 512, the GMM's columns): U is [256, 16], V [2, 16, 512]");
    p = good;
    p.tilings[1].lowRankSlots[1] = kNone;
    CHECK(contentError(p) ==
          "tiling 1: a low-rank product names U but not V (both slots, or kNone for both)");
    p = good;
    p.tilings[1].lowRankSlots[0] = 99;
    CHECK(contentError(p).find("tiling 1: low-rank U") == 0);
    p = good;
    p.slots[us].dtype = DType::F32;
    CHECK(contentError(p) ==
          "tiling 1: the low-rank U (f32) and V (bf16) must have A's dtype bf16");
    p = good;
    p.tilings[1].flags |= kTilingScale;
    p.tilings[1].scale = 2;
    CHECK(contentError(p) == "tiling 1: a low-rank product needs an activation GMM without an "
                             "addend, a scale or accumulation");
    p = good;
    p.tilings[1].inputCount = 4;
    p.tilings[1].inputSlots[2] = 1;
    p.tilings[1].inputSlots[3] = 3;
    CHECK(contentError(p) == "tiling 1: a low-rank product needs an activation GMM without an "
                             "addend, a scale or accumulation");
    p = good;
    p.tilings[0].lowRankSlots[0] = us; // the dispatch's
    p.tilings[0].lowRankSlots[1] = vs;
    CHECK(contentError(p) == "tiling 0: a low-rank product needs an activation GMM without an "
                             "addend, a scale or accumulation");
  }
  SECTION("flags") {
    p.slots[1].flags |= 0x80;
    CHECK(contentError(p) == "slot 1 'dispatched_x': unknown flag bits 0x80");
    p = smallProgram();
    p.tilings[0].flags = 0x80;
    CHECK(contentError(p) ==
          "tiling 0: flag bit 7 (low-rank V transposed) is set without a low-rank product");
    // Quantized weights: on an activation GMM with the scales as input 3
    // only (tiling 0 is the dispatch's).
    p = smallProgram();
    p.tilings[0].flags = kTilingQuantizedB;
    CHECK(contentError(p) ==
          "tiling 0: quantized weights need an activation GMM with their scales as input 3");
    // Shared-out rows: on a put or an activation GMM; not on a weight
    // gradient, which tiles its result.
    p = smallProgram();
    p.tilings[0].flags = kTilingShareRows;
    p.tilings[1].flags |= kTilingShareRows;
    CHECK(validateTaskProgram(p).ok());
    p.tilings[1].depth = 0;
    CHECK(contentError(p) ==
          "tiling 1: a weight-gradient GMM tiles its result; it shares out no rows");
    p.tilings[0].flags = kTilingReduceTp;
    CHECK(contentError(p) == "tiling 0: a dispatch reduces over TP; only a combine can");
  }
  SECTION("reserved bytes") {
    p.tasks[2].reserved[1] = 1;
    CHECK(contentError(p) == "task 2: reserved bytes are not zero");
    p = smallProgram();
    p.signals[5].reserved = 3;
    CHECK(contentError(p) == "task 5: signal 0: reserved bytes are not zero");
    p = smallProgram();
    p.slots[3].reserved1 = 3;
    CHECK(contentError(p) == "slot 3 'y': reserved bytes are not zero");
    p = smallProgram();
    p.ops[1].reserved[2] = 1;
    CHECK(contentError(p) == "op 1 'up_proj': reserved bytes are not zero");
    p = smallProgram();
    p.ops[0].reserved2 = 0x10000;
    CHECK(contentError(p) == "op 0 'dispatch': reserved bytes are not zero");
    p = smallProgram();
    p.events[0].reserved[0] = 1;
    CHECK(contentError(p) == "event 0 'dispatch.rows_in': reserved bytes are not zero");
    p = smallProgram();
    p.queues[2].reserved[2] = 1;
    CHECK(contentError(p) == "queue 2 (cube core 1): reserved bytes are not zero");
  }
  SECTION("slot shapes") {
    p.slots[0].rank = 5;
    CHECK(contentError(p) == "slot 0 'x': rank 5 is above 4");
    p = smallProgram();
    p.slots[0].dims[3] = 2;
    CHECK(contentError(p) ==
          "slot 0 'x': dim 3 is 2, but the rank is 2 (dims past the rank must be 0)");
    p = smallProgram();
    p.slots[0].capacityRows = 64;
    CHECK(contentError(p) == "slot 0 'x': capacity rows 64 on a tensor that is not dynamic");
    p = smallProgram();
    p.slots[1].rank = 0;
    p.slots[1].dims[0] = p.slots[1].dims[1] = 0;
    CHECK(contentError(p) == "slot 1 'dispatched_x': a dynamic tensor needs a rank of at least 1");
    p = smallProgram();
    p.slots[3].param = 1;
    CHECK(contentError(p) == "slot 3 'y': parameter position 1 is also that of slot 2 'w1'");
  }
}

TEST_CASE("consistency of tasks, queues and events", "[task-binary][errors]") {
  TaskProgram p = smallProgram();
  SECTION("a task in a queue of the other core kind") {
    p.tasks[1].coreKind = CoreKind::Cube;
    CHECK(contentError(p) == "queue 0 (vector core 0): entry 1 is task 1, a cube task");
  }
  SECTION("a task in two queues") {
    p.queueEntries.push_back(1);
    p.queues.push_back({CoreKind::Vector, {}, 1, 8, 1});
    CHECK(contentError(p) ==
          "task 1 is in queue 0 (vector core 0) and again in queue 3 (vector core 1)");
  }
  SECTION("a task in no queue") {
    p.queues[2].entryCount = 1;
    CHECK(contentError(p) == "task 7 is in no queue");
  }
  SECTION("two queues for one core") {
    p.queues.push_back({CoreKind::Cube, {}, 1, 8, 0});
    CHECK(contentError(p) == "queue 3 (cube core 1): the same core as queue 2");
  }
  SECTION("a peer signal to a local event is refused") {
    p.events[0].kind = EventKind::Local;
    CHECK(contentError(p) == "task 1: signal 0 goes to peer offset 1, but event 0 "
                             "'dispatch.rows_in' is a local event, not cross-rank or terminate");
  }
  SECTION("a peer signal to a local event no task carries is refused") {
    p.signals.push_back({1, 1, 1, 0});
    p.events[1].kind = EventKind::Local;
    CHECK(contentError(p) == "signal 8 goes to peer offset 1, but event 1 'done' is a local "
                             "event, not cross-rank or terminate");
  }
  SECTION("a peer signal to a terminate event is accepted") {
    // The gmm tasks of the second column tile end the pass on the peer:
    // every rank still receives 4 increments of 'done'.
    p.signals[5].peerOffset = 1;
    p.signals[7].peerOffset = 1;
    Status status = validateTaskProgram(p);
    INFO(status.message());
    REQUIRE(status.ok());
    CHECK(readOk(writeTaskBinary(p)) == p);
    // A put's signals to a terminate event, from a combine-like op.
    p.events[0].kind = EventKind::Terminate;
    status = validateTaskProgram(p);
    INFO(status.message());
    CHECK(status.ok());
  }
  SECTION("a wait beyond the event's final value") {
    p.waits[3].threshold = 5;
    CHECK(
        contentError(p) ==
        "task 7: wait 0 waits for event 0 'dispatch.rows_in' to reach 5, but its final value is 4");
  }
  SECTION("a threshold that the signals do not add up to") {
    p.events[1].threshold = 3;
    CHECK(contentError(p) == "event 1 'done': its signals add up to 4, but its threshold is 3");
  }
}

} // namespace
