//===- RoundTripTest.cpp - Write, read, and the same program --------------===//
//
// A program survives the writer and the reader unchanged (in memory and
// through files), shared wait and signal ranges, and the file's size as a
// function of its content.
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
// Round trip
//===----------------------------------------------------------------------===//

TEST_CASE("a program survives a write and a read unchanged", "[task-binary]") {
  TaskProgram program = smallProgram();
  {
    Status status = validateTaskProgram(program);
    INFO(status.message());
    REQUIRE(status.ok());
  }
  std::vector<uint8_t> bytes = writeTaskBinary(program);

  FileHeader header = headerOf(bytes);
  CHECK(std::memcmp(header.magic, "MOECBIN\0", 8) == 0);
  CHECK(header.version == 4);
  CHECK(header.flags == kFlagBf16);
  CHECK(header.fileSize == bytes.size());
  CHECK(header.crc32 == taskBinaryChecksum(bytes.data(), bytes.size()));
  CHECK(header.epRanks == 2);
  CHECK(header.localExperts == 2);
  CHECK(header.sectionCount == kSectionKindCount);
  CHECK(header.sectionTableOffset == 64);
  CHECK(header.target == program.target);
  CHECK(header.notes == 0);
  CHECK(header.reserved == 0);
  CHECK(bytes.size() % kSectionAlignment == 0);

  // The writer lays the sections out in kind order, aligned, back to back.
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  REQUIRE(table.size() == kSectionKindCount);
  const uint32_t recordSizes[kSectionKindCount] = {1, 56, 24, 104, 16, 24, 8, 16, 16, 4, 88};
  uint64_t end = 64 + kSectionKindCount * sizeof(SectionEntry);
  for (size_t i = 0; i < table.size(); ++i) {
    CHECK(table[i].kind == i + 1);
    CHECK(table[i].recordSize == recordSizes[i]);
    CHECK(table[i].offset % 8 == 0);
    CHECK(table[i].offset >= end);
    CHECK(table[i].offset < end + 8);
    end = table[i].offset + table[i].count * table[i].recordSize;
  }
  CHECK(bytes.size() == (end + 7) / 8 * 8);

  TaskProgram read = readOk(bytes);
  CHECK(read == program);

  // Field by field, so that a failure says which.
  CHECK(read.flags == program.flags);
  CHECK(read.epRanks == 2);
  CHECK(read.localExperts == 2);
  CHECK(read.target == program.target);
  CHECK(read.name(read.target) == "ascend-910b");
  CHECK(read.strings == program.strings);
  REQUIRE(read.slots.size() == 4);
  for (size_t i = 0; i < read.slots.size(); ++i) {
    const SlotRecord &a = read.slots[i], &b = program.slots[i];
    CHECK(read.name(a.name) == program.name(b.name));
    CHECK(a.param == b.param);
    CHECK(a.dtype == b.dtype);
    CHECK(a.flags == b.flags);
    CHECK(a.rank == b.rank);
    for (unsigned d = 0; d < kMaxTensorRank; ++d)
      CHECK(a.dims[d] == b.dims[d]);
    CHECK(a.capacityRows == b.capacityRows);
  }
  CHECK(read.name(read.slots[1].name) == "dispatched_x");
  REQUIRE(read.ops.size() == 2);
  for (size_t i = 0; i < read.ops.size(); ++i) {
    CHECK(read.name(read.ops[i].name) == program.name(program.ops[i].name));
    CHECK(read.ops[i].kind == program.ops[i].kind);
    CHECK(read.ops[i].firstTask == program.ops[i].firstTask);
    CHECK(read.ops[i].taskCount == program.ops[i].taskCount);
    CHECK(read.ops[i].tiling == program.ops[i].tiling);
    CHECK(read.ops[i].reserved2 == 0);
  }
  CHECK(read.name(read.ops[1].name) == "up_proj");
  CHECK(read.ops[1].tiling == 1);
  REQUIRE(read.tilings.size() == 2);
  for (size_t i = 0; i < read.tilings.size(); ++i) {
    const TilingRecord &a = read.tilings[i], &b = program.tilings[i];
    CHECK(a.opKind == b.opKind);
    CHECK(a.dtype == b.dtype);
    CHECK(a.flags == b.flags);
    CHECK(a.inputCount == b.inputCount);
    CHECK(a.experts == b.experts);
    CHECK(a.peers == b.peers);
    CHECK(a.rowTiles == b.rowTiles);
    CHECK(a.colTiles == b.colTiles);
    CHECK(a.outputSlot == b.outputSlot);
    CHECK(a.rows == b.rows);
    CHECK(a.cols == b.cols);
    CHECK(a.depth == b.depth);
    CHECK(a.tileM == b.tileM);
    CHECK(a.tileN == b.tileN);
    CHECK(a.tileK == b.tileK);
    CHECK(a.lda == b.lda);
    CHECK(a.ldb == b.ldb);
    CHECK(a.ldc == b.ldc);
    for (unsigned k = 0; k < kMaxTilingInputs; ++k)
      CHECK(a.inputSlots[k] == b.inputSlots[k]);
    CHECK(a.balancedRows == b.balancedRows);
    CHECK(a.scale == b.scale);
    CHECK(a.lowRankSlots[0] == b.lowRankSlots[0]);
    CHECK(a.lowRankSlots[1] == b.lowRankSlots[1]);
  }
  CHECK(read.tilings[0].tileCount() == 4);
  CHECK(read.tilings[0].peers == 2);
  CHECK(read.tilings[1].colTiles == 2);
  CHECK(read.tilings[1].depth == 128);
  CHECK(read.tilings[0].inputSlots[1] == kNone);
  REQUIRE(read.events.size() == 2);
  for (size_t i = 0; i < read.events.size(); ++i) {
    CHECK(read.name(read.events[i].name) == program.name(program.events[i].name));
    CHECK(read.events[i].kind == program.events[i].kind);
    CHECK(read.events[i].op == program.events[i].op);
    CHECK(read.events[i].threshold == program.events[i].threshold);
  }
  REQUIRE(read.tasks.size() == 8);
  for (size_t i = 0; i < read.tasks.size(); ++i) {
    const TaskRecord &a = read.tasks[i], &b = program.tasks[i];
    CHECK(a.op == b.op);
    CHECK(a.firstWait == b.firstWait);
    CHECK(a.waitCount == b.waitCount);
    CHECK(a.firstSignal == b.firstSignal);
    CHECK(a.signalCount == b.signalCount);
    CHECK(a.coreKind == b.coreKind);
  }
  REQUIRE(read.waits.size() == 4);
  for (size_t i = 0; i < read.waits.size(); ++i) {
    CHECK(read.waits[i].event == program.waits[i].event);
    CHECK(read.waits[i].threshold == program.waits[i].threshold);
  }
  REQUIRE(read.signals.size() == 8);
  for (size_t i = 0; i < read.signals.size(); ++i) {
    CHECK(read.signals[i].event == program.signals[i].event);
    CHECK(read.signals[i].increment == program.signals[i].increment);
    CHECK(read.signals[i].peerOffset == program.signals[i].peerOffset);
  }
  REQUIRE(read.queues.size() == 3);
  for (size_t i = 0; i < read.queues.size(); ++i) {
    CHECK(read.queues[i].coreKind == program.queues[i].coreKind);
    CHECK(read.queues[i].coreIndex == program.queues[i].coreIndex);
    CHECK(read.queues[i].firstEntry == program.queues[i].firstEntry);
    CHECK(read.queues[i].entryCount == program.queues[i].entryCount);
  }
  CHECK(read.queueEntries == program.queueEntries);

  // The same program always gives the same bytes.
  CHECK(writeTaskBinary(read) == bytes);

  // The target is part of the program.
  TaskProgram other = program;
  other.target = program.name(program.target).size() + 1; // the name "x"
  REQUIRE(validateTaskProgram(other).ok());
  CHECK(other != program);
  CHECK(readOk(writeTaskBinary(other)).target == other.target);
}

TEST_CASE("an empty program round-trips", "[task-binary]") {
  // Nothing but the target's name, which every binary has.
  TaskProgram program;
  program.target = program.addString("cpu");
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  CHECK(bytes.size() == 64 + kSectionKindCount * sizeof(SectionEntry) + 8);
  CHECK(readOk(bytes) == program);

  // Without a name, the target's offset 0 names nothing.
  TaskProgram nameless;
  CHECK(contentError(nameless) ==
        "header: target: name offset 0 is past the end of the 0-byte string table");
}
TEST_CASE("files: write, load, and the errors that name the path", "[task-binary]") {
  TaskProgram program = smallProgram();
  std::string path = tempPath("small.moebin");
  Status written = writeTaskBinaryFile(program, path);
  INFO(written.message());
  REQUIRE(written.ok());
  TaskProgram loaded;
  Status loadedStatus = loadTaskBinaryFile(path, &loaded);
  INFO(loadedStatus.message());
  REQUIRE(loadedStatus.ok());
  CHECK(loaded == program);

  std::string missing = tempPath("missing.moebin");
  Status status = loadTaskBinaryFile(missing, &loaded);
  REQUIRE_FALSE(status.ok());
  CHECK(status.message() == missing + ": cannot open: No such file or directory");

  // A damaged file: the message starts with the path.
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  bytes[0] = 'X';
  std::string damaged = tempPath("damaged.moebin");
  std::FILE *file = std::fopen(damaged.c_str(), "wb");
  REQUIRE(file);
  REQUIRE(std::fwrite(bytes.data(), 1, bytes.size(), file) == bytes.size());
  std::fclose(file);
  status = loadTaskBinaryFile(damaged, &loaded);
  REQUIRE_FALSE(status.ok());
  CHECK(status.message() == damaged + ": not a moec task binary (bad magic)");

  // An invalid program is not written.
  TaskProgram invalid = program;
  invalid.waits[0].event = 900;
  std::string refused = tempPath("refused.moebin");
  status = writeTaskBinaryFile(invalid, refused);
  REQUIRE_FALSE(status.ok());
  CHECK(status.message() ==
        refused + ": task 4: wait 0 names event 900, but the binary has 2 events");
  CHECK(std::fopen(refused.c_str(), "rb") == nullptr);
}

TEST_CASE("tasks may share wait and signal ranges", "[task-binary]") {
  TaskProgram p = smallProgram();
  // Dispatch tasks of the same peer share one signal; the gmm tasks of an
  // expert share one wait, and all of them one signal.
  p.signals = {{0, 1, 0, 0}, {0, 1, 1, 0}, {1, 1, 0, 0}};
  p.waits = {{0, 2}, {0, 4}};
  for (uint32_t t = 0; t < 4; ++t)
    p.tasks[t].firstSignal = t % 2;
  for (uint32_t k = 0; k < 4; ++k) {
    p.tasks[4 + k].firstWait = k / 2;
    p.tasks[4 + k].firstSignal = 2;
  }
  // Each signal counts once per task that carries it: the thresholds are
  // still 4 and 4, not the 2 and 1 of the records.
  REQUIRE(p.events[0].threshold == 4);
  REQUIRE(p.events[1].threshold == 4);
  {
    Status status = validateTaskProgram(p);
    INFO(status.message());
    REQUIRE(status.ok());
  }
  std::vector<uint8_t> bytes = writeTaskBinary(p);
  CHECK(readOk(bytes) == p);
  CHECK(bytes.size() < writeTaskBinary(smallProgram()).size());

  TaskProgram q = p;
  q.events[1].threshold = 1;
  CHECK(contentError(q) == "event 1 'done': its signals add up to 4, but its threshold is 1");

  // Overlapping ranges: tasks 4..7 carry signals [1, 3), so each also
  // carries a peer signal to event 0, which then receives 4 + 4.
  q = p;
  for (uint32_t k = 0; k < 4; ++k) {
    q.tasks[4 + k].firstSignal = 1;
    q.tasks[4 + k].signalCount = 2;
  }
  CHECK(contentError(q) ==
        "event 0 'dispatch.rows_in': its signals add up to 8, but its threshold is 4");
  q.events[0].threshold = 8;
  CHECK(validateTaskProgram(q).ok());

  // A signal no task carries counts for nothing.
  q = p;
  q.signals.push_back({1, 5, 0, 0});
  CHECK(validateTaskProgram(q).ok());
}

//===----------------------------------------------------------------------===//
// Size
//===----------------------------------------------------------------------===//

/// A program of `taskCount` tasks (a multiple of 16) shaped like a real one,
/// for 8 ranks of 4 local experts, with one tiling per op:
///
/// - a dispatch op of half the tasks, a grid of 8 peers x half/8 row tiles,
///   on 48 vector queues; each task puts to its tile's peer and signals one
///   of 1000 cross-rank events there;
/// - a gmm op of the other half, a grid of 4 experts x half/8 row tiles x 2
///   column tiles, on 24 cube queues; each task waits for one of those
///   events and signals the terminate event.
///
/// Every task has its own signal, and every gmm task its own wait.
TaskProgram largeProgram(uint32_t taskCount) {
  REQUIRE(taskCount % 16 == 0);
  TaskProgram p;
  p.epRanks = 8;
  p.localExperts = 4;
  p.target = p.addString("ascend-910b");
  uint32_t half = taskCount / 2;
  const uint32_t eventCount = 1000;
  SlotRecord slot;
  slot.name = p.addString("x");
  slot.rank = 1;
  slot.dims[0] = 1;
  p.slots.push_back(slot);
  p.ops.push_back({p.addString("dispatch"), OpKind::Dispatch, {}, 0, half, 0, 0});
  p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, half, half, 1, 0});

  TilingRecord dispatchGrid;
  dispatchGrid.opKind = OpKind::Dispatch;
  dispatchGrid.inputCount = 1;
  dispatchGrid.inputSlots[0] = 0;
  dispatchGrid.outputSlot = 0;
  dispatchGrid.experts = 1;
  dispatchGrid.peers = p.epRanks;
  dispatchGrid.rowTiles = half / 8;
  dispatchGrid.rows = 16 * uint64_t(half / 8);
  dispatchGrid.cols = 7168;
  dispatchGrid.balancedRows = uint32_t(dispatchGrid.rows / 2);
  TilingRecord gmmGrid = dispatchGrid;
  gmmGrid.opKind = OpKind::Gmm;
  gmmGrid.experts = p.localExperts;
  gmmGrid.peers = 1;
  gmmGrid.colTiles = 2;
  gmmGrid.cols = 2048;
  gmmGrid.depth = 7168;
  p.tilings = {dispatchGrid, gmmGrid};

  for (uint32_t e = 0; e < eventCount; ++e)
    p.events.push_back(
        {p.addString("dispatch.rows_in." + std::to_string(e)), EventKind::CrossRank, {}, 0, 0});
  p.events.push_back({p.addString("done"), EventKind::Terminate, {}, 1, half});
  for (uint32_t t = 0; t < 2 * half; ++t) {
    bool isDispatch = t < half;
    TaskRecord task;
    task.op = isDispatch ? 0 : 1;
    task.coreKind = isDispatch ? CoreKind::Vector : CoreKind::Cube;
    task.firstSignal = uint32_t(p.signals.size());
    task.signalCount = 1;
    if (isDispatch) {
      uint32_t event = t % eventCount;
      p.signals.push_back({event, 1, tileCoord(dispatchGrid, t).peer, 0});
      p.events[event].threshold += 1;
    } else {
      task.firstWait = uint32_t(p.waits.size());
      task.waitCount = 1;
      p.waits.push_back({(t - half) % eventCount, 1});
      p.signals.push_back({eventCount, 1, 0, 0});
    }
    p.tasks.push_back(task);
  }
  const uint32_t vectorCores = 48, cubeCores = 24;
  auto addQueues = [&](CoreKind kind, uint32_t cores, uint32_t first) {
    for (uint32_t c = 0; c < cores; ++c) {
      QueueRecord queue;
      queue.coreKind = kind;
      queue.coreIndex = c;
      queue.firstEntry = uint32_t(p.queueEntries.size());
      for (uint32_t t = first + c; t < first + half; t += cores)
        p.queueEntries.push_back(t);
      queue.entryCount = uint32_t(p.queueEntries.size()) - queue.firstEntry;
      p.queues.push_back(queue);
    }
  };
  addQueues(CoreKind::Vector, vectorCores, 0);
  addQueues(CoreKind::Cube, cubeCores, half);
  return p;
}

TEST_CASE("the binary is sized by its content", "[task-binary][size]") {
  TaskProgram small = largeProgram(2000);
  TaskProgram large = largeProgram(100000);
  {
    Status status = validateTaskProgram(large);
    INFO(status.message());
    REQUIRE(status.ok());
  }
  std::vector<uint8_t> smallBytes = writeTaskBinary(small);
  std::vector<uint8_t> largeBytes = writeTaskBinary(large);

  // Per task: a task (24), a signal (16) and a queue entry (4), and half the
  // tasks a wait (8): 48 bytes on average. The two tilings (88 each), the
  // events, the strings and the header come besides.
  const size_t perTask = 24 + 16 + 4;
  const size_t perTaskAverage = perTask + 8 / 2;
  INFO("10^5 tasks: " << largeBytes.size() << " bytes");
  CHECK(large.tilings.size() == 2);
  CHECK(largeBytes.size() >= 100000 * perTaskAverage);
  CHECK(largeBytes.size() <= 100000 * perTaskAverage + 64 * 1024);
  // Fifty times the tasks, about fifty times the bytes (the tilings,
  // events, strings and queues do not grow with the tasks).
  size_t fixed = smallBytes.size() - 2000 * perTaskAverage;
  CHECK(largeBytes.size() - fixed <= 50 * (smallBytes.size() - fixed) + 1024);
  CHECK(largeBytes.size() - fixed + 1024 >= 50 * (smallBytes.size() - fixed));
  // About 4.8 MB at 10^5 tasks: under a third of the seed's fixed 15 MB
  // runtime struct.
  CHECK(largeBytes.size() < 5u * 1000 * 1000);
  CHECK(largeBytes.size() < 15u * 1024 * 1024 / 3);

  TaskProgram read = readOk(largeBytes);
  CHECK(read == large);

  // Sharing signal records (one per peer for the dispatch tasks, all on
  // event 0, and one for all gmm tasks) leaves per task a task, a queue
  // entry and half a wait.
  TaskProgram shared = large;
  const uint32_t half = 50000;
  shared.signals.clear();
  for (uint32_t k = 0; k < 8; ++k)
    shared.signals.push_back({0, 1, k, 0});
  shared.signals.push_back({1000, 1, 0, 0});
  for (EventRecord &event : shared.events)
    if (event.kind == EventKind::CrossRank)
      event.threshold = 0;
  shared.events[0].threshold = half;
  for (WaitRecord &wait : shared.waits)
    wait.event = 0;
  for (uint32_t t = 0; t < 2 * half; ++t)
    shared.tasks[t].firstSignal = t < half ? tileCoord(shared.tilings[0], t).peer : 8;
  {
    Status status = validateTaskProgram(shared);
    INFO(status.message());
    REQUIRE(status.ok());
  }
  std::vector<uint8_t> sharedBytes = writeTaskBinary(shared);
  INFO("10^5 tasks, shared signals: " << sharedBytes.size() << " bytes");
  CHECK(sharedBytes.size() <= 100000 * (24 + 4 + 8 / 2) + 64 * 1024);
  CHECK(readOk(sharedBytes) == shared);
}

} // namespace
