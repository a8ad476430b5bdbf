//===- TaskBinaryTest.cpp - Tests for the task binary writer and reader ---===//

#include "runtime/format/TaskBinary.h"
#include "runtime/format/Crc32.h"

#include <limits>
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using namespace moec::format;
using moec::Status;

namespace {

//===----------------------------------------------------------------------===//
// Helpers
//===----------------------------------------------------------------------===//

/// A small forward program for an EP group of 2 ranks with 2 local experts,
/// compiled for the "ascend-910b" target:
///
/// - op 0, dispatch: a grid of 2 experts x 2 peers, so 4 vector tasks (0..3);
///   task (expert e, peer k) puts expert e's rows to peer k and signals the
///   cross-rank event 0 there (peer offset k).
/// - op 1, gmm: a grid of 2 experts x 2 column tiles, so 4 cube tasks
///   (4..7); each waits for the dispatched rows it needs and signals the
///   terminate event 1.
///
/// Every section is non-empty, and every task has its own waits and signals.
/// Queues: vector core 0 runs tasks 0..3, cube core 0 tasks 4 and 6, cube
/// core 1 tasks 5 and 7.
TaskProgram smallProgram() {
  TaskProgram p;
  p.flags = kFlagBf16;
  p.epRanks = 2;
  p.localExperts = 2;
  p.target = p.addString("ascend-910b");

  SlotRecord x;
  x.name = p.addString("x");
  x.param = 0;
  x.dtype = DType::BF16;
  x.rank = 2;
  x.dims[0] = 64;
  x.dims[1] = 128;
  SlotRecord xd;
  xd.name = p.addString("dispatched_x");
  xd.param = 3;
  xd.dtype = DType::BF16;
  xd.flags = kSlotDynamic;
  xd.rank = 2;
  xd.dims[0] = 256;
  xd.dims[1] = 128;
  xd.capacityRows = 256;
  SlotRecord w1;
  w1.name = p.addString("w1");
  w1.param = 1;
  w1.dtype = DType::BF16;
  w1.flags = kSlotList;
  w1.rank = 3;
  w1.dims[0] = 2;
  w1.dims[1] = 128;
  w1.dims[2] = 512;
  SlotRecord y;
  y.name = p.addString("y");
  y.param = 7;
  y.dtype = DType::F32;
  y.flags = kSlotDynamic;
  y.rank = 2;
  y.dims[0] = 256;
  y.dims[1] = 512;
  y.capacityRows = 256;
  p.slots = {x, xd, w1, y};

  OpRecord dispatch;
  dispatch.name = p.addString("dispatch");
  dispatch.kind = OpKind::Dispatch;
  dispatch.firstTask = 0;
  dispatch.taskCount = 4;
  dispatch.tiling = 0;
  OpRecord gmm;
  gmm.name = p.addString("up_proj");
  gmm.kind = OpKind::Gmm;
  gmm.firstTask = 4;
  gmm.taskCount = 4;
  gmm.tiling = 1;
  p.ops = {dispatch, gmm};

  // Dispatch: per (local expert, peer), the segment of up to 32 rows of x
  // that goes to that peer; 16 under balanced routing.
  TilingRecord dispatchGrid;
  dispatchGrid.opKind = OpKind::Dispatch;
  dispatchGrid.dtype = DType::BF16;
  dispatchGrid.inputCount = 1;
  dispatchGrid.inputSlots[0] = 0;
  dispatchGrid.outputSlot = 1;
  dispatchGrid.experts = 2;
  dispatchGrid.peers = 2;
  dispatchGrid.rowTiles = 1;
  dispatchGrid.colTiles = 1;
  dispatchGrid.rows = 32;
  dispatchGrid.cols = 128;
  dispatchGrid.depth = 0;
  dispatchGrid.tileM = 32;
  dispatchGrid.tileN = 128;
  dispatchGrid.lda = 128;
  dispatchGrid.ldc = 128;
  dispatchGrid.balancedRows = 16;
  // Gmm: per local expert, its segment of up to 128 rows times w1[expert]
  // (K = 128), cut into two column tiles of 256.
  TilingRecord gmmGrid;
  gmmGrid.opKind = OpKind::Gmm;
  gmmGrid.dtype = DType::BF16;
  gmmGrid.flags = kTilingTransposeB;
  gmmGrid.inputCount = 2;
  gmmGrid.inputSlots[0] = 1;
  gmmGrid.inputSlots[1] = 2;
  gmmGrid.outputSlot = 3;
  gmmGrid.experts = 2;
  gmmGrid.peers = 1;
  gmmGrid.rowTiles = 1;
  gmmGrid.colTiles = 2;
  gmmGrid.rows = 128;
  gmmGrid.cols = 512;
  gmmGrid.depth = 128;
  gmmGrid.tileM = 128;
  gmmGrid.tileN = 256;
  gmmGrid.tileK = 64;
  gmmGrid.lda = 128;
  gmmGrid.ldb = 128;
  gmmGrid.ldc = 512;
  gmmGrid.balancedRows = 64;
  p.tilings = {dispatchGrid, gmmGrid};

  EventRecord rowsIn;
  rowsIn.name = p.addString("dispatch.rows_in");
  rowsIn.kind = EventKind::CrossRank;
  rowsIn.op = 0;
  rowsIn.threshold = 4;
  EventRecord done;
  done.name = p.addString("done");
  done.kind = EventKind::Terminate;
  done.op = 1;
  done.threshold = 4;
  p.events = {rowsIn, done};

  // Signals 0..3: dispatch task t signals event 0 on peer offset t % 2 (its
  // tile's peer). Signals 4..7: gmm task 4 + k signals the terminate event.
  p.signals = {{0, 1, 0, 0}, {0, 1, 1, 0}, {0, 1, 0, 0}, {0, 1, 1, 0},
               {1, 1, 0, 0}, {1, 1, 0, 0}, {1, 1, 0, 0}, {1, 1, 0, 0}};
  // Waits 0..3: gmm task 4 + k waits for event 0 to reach 2 (expert 0's
  // tiles) or 4 (expert 1's).
  p.waits = {{0, 2}, {0, 2}, {0, 4}, {0, 4}};

  for (uint32_t t = 0; t < 4; ++t) {
    TaskRecord task;
    task.op = 0;
    task.firstSignal = t;
    task.signalCount = 1;
    task.coreKind = CoreKind::Vector;
    p.tasks.push_back(task);
  }
  for (uint32_t k = 0; k < 4; ++k) {
    TaskRecord task;
    task.op = 1;
    task.firstWait = k;
    task.waitCount = 1;
    task.firstSignal = 4 + k;
    task.signalCount = 1;
    task.coreKind = CoreKind::Cube;
    p.tasks.push_back(task);
  }

  QueueRecord vectorQueue;
  vectorQueue.coreKind = CoreKind::Vector;
  vectorQueue.coreIndex = 0;
  vectorQueue.firstEntry = 0;
  vectorQueue.entryCount = 4;
  QueueRecord cubeQueue0;
  cubeQueue0.coreKind = CoreKind::Cube;
  cubeQueue0.coreIndex = 0;
  cubeQueue0.firstEntry = 4;
  cubeQueue0.entryCount = 2;
  QueueRecord cubeQueue1 = cubeQueue0;
  cubeQueue1.coreIndex = 1;
  cubeQueue1.firstEntry = 6;
  p.queues = {vectorQueue, cubeQueue0, cubeQueue1};
  p.queueEntries = {0, 1, 2, 3, 4, 6, 5, 7};
  return p;
}

/// A valid program for an EP group of `epRanks` ranks of `localExperts`
/// experts with one slot and nothing else (no ops, tilings or tasks); tests
/// add to it.
TaskProgram bareProgram(uint32_t epRanks, uint32_t localExperts) {
  TaskProgram p;
  p.epRanks = epRanks;
  p.localExperts = localExperts;
  p.target = p.addString("cpu");
  SlotRecord slot;
  slot.name = p.addString("x");
  slot.rank = 1;
  slot.dims[0] = 1;
  p.slots.push_back(slot);
  return p;
}

/// Returns the header of a file.
FileHeader headerOf(const std::vector<uint8_t> &bytes) {
  FileHeader header;
  REQUIRE(bytes.size() >= sizeof(header));
  std::memcpy(&header, bytes.data(), sizeof(header));
  return header;
}

/// Returns the section table of a file the writer produced.
std::vector<SectionEntry> sectionTableOf(const std::vector<uint8_t> &bytes) {
  FileHeader header = headerOf(bytes);
  std::vector<SectionEntry> table(header.sectionCount);
  std::memcpy(table.data(), bytes.data() + header.sectionTableOffset,
              table.size() * sizeof(SectionEntry));
  return table;
}

/// Returns the file offset of section table entry `index`.
size_t entryOffset(const std::vector<uint8_t> &bytes, size_t index) {
  return size_t(headerOf(bytes).sectionTableOffset) + index * sizeof(SectionEntry);
}

/// Returns the index in the section table of the section of `kind`.
size_t entryIndexOf(const std::vector<uint8_t> &bytes, SectionKind kind) {
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  for (size_t i = 0; i < table.size(); ++i)
    if (table[i].kind == uint32_t(kind))
      return i;
  FAIL("no such section");
  return 0;
}

/// Overwrites the value at `offset` with `value`.
template <typename T> void put(std::vector<uint8_t> &bytes, size_t offset, T value) {
  REQUIRE(offset + sizeof(T) <= bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

/// Sets the header's size field to the file's size and recomputes its CRC.
void fixHeader(std::vector<uint8_t> &bytes) {
  put<uint64_t>(bytes, offsetof(FileHeader, fileSize), bytes.size());
  put<uint32_t>(bytes, offsetof(FileHeader, crc32), taskBinaryChecksum(bytes.data(), bytes.size()));
}

/// Reads `bytes`, requiring success.
TaskProgram readOk(const std::vector<uint8_t> &bytes) {
  TaskProgram program;
  Status status = readTaskBinary(bytes.data(), bytes.size(), &program);
  INFO(status.message());
  REQUIRE(status.ok());
  return program;
}

/// Reads `bytes`, requiring an error, and returns its message.
std::string readError(const std::vector<uint8_t> &bytes) {
  TaskProgram program;
  Status status = readTaskBinary(bytes.data(), bytes.size(), &program);
  REQUIRE_FALSE(status.ok());
  REQUIRE_FALSE(status.message().empty());
  return status.message();
}

/// Writes `program` (which the writer does not check), reads it back and
/// returns the reader's error; also requires validateTaskProgram to give the
/// same one.
std::string contentError(const TaskProgram &program) {
  std::string message = readError(writeTaskBinary(program));
  Status status = validateTaskProgram(program);
  REQUIRE_FALSE(status.ok());
  CHECK(status.message() == message);
  return message;
}

/// Returns a path for a scratch file in the test's temporary folder.
std::string tempPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

//===----------------------------------------------------------------------===//
// CRC-32
//===----------------------------------------------------------------------===//

TEST_CASE("crc32 is the IEEE CRC-32", "[crc32]") {
  const std::string check = "123456789";
  const auto *data = reinterpret_cast<const uint8_t *>(check.data());
  CHECK(crc32(data, check.size()) == 0xCBF43926u);
  CHECK(crc32(nullptr, 0) == 0u);
  const std::string fox = "The quick brown fox jumps over the lazy dog";
  CHECK(crc32(reinterpret_cast<const uint8_t *>(fox.data()), fox.size()) == 0x414FA339u);

  // Any split gives the CRC of the whole.
  for (size_t cut = 0; cut <= check.size(); ++cut)
    CHECK(crc32(data + cut, check.size() - cut, crc32(data, cut)) == 0xCBF43926u);

  std::vector<uint8_t> zeros(1000, 0);
  uint32_t prefix = crc32(data, 5);
  CHECK(crc32Zeros(zeros.size(), prefix) == crc32(zeros.data(), zeros.size(), prefix));
}

//===----------------------------------------------------------------------===//
// Record layouts
//===----------------------------------------------------------------------===//

TEST_CASE("records have the documented sizes and field offsets", "[task-binary][layout]") {
  CHECK(sizeof(FileHeader) == 64);
  CHECK(offsetof(FileHeader, magic) == 0);
  CHECK(offsetof(FileHeader, version) == 8);
  CHECK(offsetof(FileHeader, flags) == 12);
  CHECK(offsetof(FileHeader, fileSize) == 16);
  CHECK(offsetof(FileHeader, crc32) == 24);
  CHECK(offsetof(FileHeader, epRanks) == 28);
  CHECK(offsetof(FileHeader, localExperts) == 32);
  CHECK(offsetof(FileHeader, sectionCount) == 36);
  CHECK(offsetof(FileHeader, sectionTableOffset) == 40);
  CHECK(offsetof(FileHeader, target) == 48);
  CHECK(offsetof(FileHeader, tpRanks) == 52);
  CHECK(offsetof(FileHeader, reserved) == 56);

  CHECK(sizeof(SectionEntry) == 24);
  CHECK(offsetof(SectionEntry, kind) == 0);
  CHECK(offsetof(SectionEntry, recordSize) == 4);
  CHECK(offsetof(SectionEntry, offset) == 8);
  CHECK(offsetof(SectionEntry, count) == 16);

  CHECK(sizeof(SlotRecord) == 56);
  CHECK(offsetof(SlotRecord, name) == 0);
  CHECK(offsetof(SlotRecord, param) == 4);
  CHECK(offsetof(SlotRecord, dtype) == 8);
  CHECK(offsetof(SlotRecord, flags) == 9);
  CHECK(offsetof(SlotRecord, rank) == 10);
  CHECK(offsetof(SlotRecord, reserved0) == 11);
  CHECK(offsetof(SlotRecord, reserved1) == 12);
  CHECK(offsetof(SlotRecord, dims) == 16);
  CHECK(offsetof(SlotRecord, capacityRows) == 48);

  CHECK(sizeof(OpRecord) == 24);
  CHECK(offsetof(OpRecord, name) == 0);
  CHECK(offsetof(OpRecord, kind) == 4);
  CHECK(offsetof(OpRecord, reserved) == 5);
  CHECK(offsetof(OpRecord, firstTask) == 8);
  CHECK(offsetof(OpRecord, taskCount) == 12);
  CHECK(offsetof(OpRecord, tiling) == 16);
  CHECK(offsetof(OpRecord, reserved2) == 20);

  CHECK(sizeof(TilingRecord) == 96);
  CHECK(offsetof(TilingRecord, opKind) == 0);
  CHECK(offsetof(TilingRecord, dtype) == 1);
  CHECK(offsetof(TilingRecord, flags) == 2);
  CHECK(offsetof(TilingRecord, inputCount) == 3);
  CHECK(offsetof(TilingRecord, experts) == 4);
  CHECK(offsetof(TilingRecord, peers) == 8);
  CHECK(offsetof(TilingRecord, rowTiles) == 12);
  CHECK(offsetof(TilingRecord, colTiles) == 16);
  CHECK(offsetof(TilingRecord, outputSlot) == 20);
  CHECK(offsetof(TilingRecord, rows) == 24);
  CHECK(offsetof(TilingRecord, cols) == 32);
  CHECK(offsetof(TilingRecord, depth) == 40);
  CHECK(offsetof(TilingRecord, tileM) == 48);
  CHECK(offsetof(TilingRecord, tileN) == 52);
  CHECK(offsetof(TilingRecord, tileK) == 56);
  CHECK(offsetof(TilingRecord, lda) == 60);
  CHECK(offsetof(TilingRecord, ldb) == 64);
  CHECK(offsetof(TilingRecord, ldc) == 68);
  CHECK(offsetof(TilingRecord, inputSlots) == 72);
  CHECK(offsetof(TilingRecord, balancedRows) == 88);
  CHECK(offsetof(TilingRecord, scale) == 92);

  CHECK(sizeof(EventRecord) == 16);
  CHECK(offsetof(EventRecord, name) == 0);
  CHECK(offsetof(EventRecord, kind) == 4);
  CHECK(offsetof(EventRecord, reserved) == 5);
  CHECK(offsetof(EventRecord, op) == 8);
  CHECK(offsetof(EventRecord, threshold) == 12);

  CHECK(sizeof(TaskRecord) == 24);
  CHECK(offsetof(TaskRecord, op) == 0);
  CHECK(offsetof(TaskRecord, firstWait) == 4);
  CHECK(offsetof(TaskRecord, waitCount) == 8);
  CHECK(offsetof(TaskRecord, firstSignal) == 12);
  CHECK(offsetof(TaskRecord, signalCount) == 16);
  CHECK(offsetof(TaskRecord, coreKind) == 20);
  CHECK(offsetof(TaskRecord, reserved) == 21);

  CHECK(sizeof(WaitRecord) == 8);
  CHECK(offsetof(WaitRecord, event) == 0);
  CHECK(offsetof(WaitRecord, threshold) == 4);

  CHECK(sizeof(SignalRecord) == 16);
  CHECK(offsetof(SignalRecord, event) == 0);
  CHECK(offsetof(SignalRecord, increment) == 4);
  CHECK(offsetof(SignalRecord, peerOffset) == 8);
  CHECK(offsetof(SignalRecord, reserved) == 12);

  CHECK(sizeof(QueueRecord) == 16);
  CHECK(offsetof(QueueRecord, coreKind) == 0);
  CHECK(offsetof(QueueRecord, reserved) == 1);
  CHECK(offsetof(QueueRecord, coreIndex) == 4);
  CHECK(offsetof(QueueRecord, firstEntry) == 8);
  CHECK(offsetof(QueueRecord, entryCount) == 12);
}

TEST_CASE("the writer puts each field at its documented offset", "[task-binary][layout]") {
  const TaskProgram program = smallProgram();
  const std::vector<uint8_t> bytes = writeTaskBinary(program);
  auto u32At = [&](uint64_t offset) {
    uint32_t value;
    REQUIRE(offset + 4 <= bytes.size());
    std::memcpy(&value, bytes.data() + offset, 4);
    return value;
  };
  auto u64At = [&](uint64_t offset) {
    uint64_t value;
    REQUIRE(offset + 8 <= bytes.size());
    std::memcpy(&value, bytes.data() + offset, 8);
    return value;
  };
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  auto sectionOffset = [&](SectionKind kind) { return table[entryIndexOf(bytes, kind)].offset; };

  CHECK(u32At(48) == program.target);
  CHECK(u32At(52) == program.tpRanks);
  CHECK(u64At(56) == 0);

  uint64_t ops = sectionOffset(SectionKind::Ops);
  CHECK(table[entryIndexOf(bytes, SectionKind::Ops)].recordSize == 24);
  CHECK(bytes[ops + 24 + 4] == uint8_t(OpKind::Gmm));
  CHECK(u32At(ops + 24 + 8) == 4);  // firstTask
  CHECK(u32At(ops + 24 + 12) == 4); // taskCount
  CHECK(u32At(ops + 24 + 16) == 1); // tiling
  CHECK(u32At(ops + 24 + 20) == 0); // reserved2

  uint64_t tilings = sectionOffset(SectionKind::Tilings);
  CHECK(table[entryIndexOf(bytes, SectionKind::Tilings)].recordSize == 96);
  uint64_t gmm = tilings + 96;
  CHECK(bytes[gmm + 0] == uint8_t(OpKind::Gmm));
  CHECK(bytes[gmm + 1] == uint8_t(DType::BF16));
  CHECK(bytes[gmm + 2] == kTilingTransposeB);
  CHECK(bytes[gmm + 3] == 2);
  CHECK(u32At(gmm + 4) == 2);  // experts
  CHECK(u32At(gmm + 8) == 1);  // peers
  CHECK(u32At(gmm + 12) == 1); // rowTiles
  CHECK(u32At(gmm + 16) == 2); // colTiles
  CHECK(u32At(gmm + 20) == 3); // outputSlot
  CHECK(u64At(gmm + 24) == 128);
  CHECK(u64At(gmm + 32) == 512);
  CHECK(u64At(gmm + 40) == 128);
  CHECK(u32At(gmm + 48) == 128);
  CHECK(u32At(gmm + 52) == 256);
  CHECK(u32At(gmm + 56) == 64);
  CHECK(u32At(gmm + 60) == 128);
  CHECK(u32At(gmm + 64) == 128);
  CHECK(u32At(gmm + 68) == 512);
  CHECK(u32At(gmm + 72) == 1);
  CHECK(u32At(gmm + 76) == 2);
  CHECK(u32At(gmm + 80) == kNone);
  CHECK(u32At(gmm + 84) == kNone);
  CHECK(u32At(gmm + 88) == 64); // balancedRows
  CHECK(u32At(gmm + 92) == 0);  // reserved

  uint64_t tasks = sectionOffset(SectionKind::Tasks);
  CHECK(table[entryIndexOf(bytes, SectionKind::Tasks)].recordSize == 24);
  uint64_t task5 = tasks + 5 * 24;
  CHECK(u32At(task5 + 0) == 1);  // op
  CHECK(u32At(task5 + 4) == 1);  // firstWait
  CHECK(u32At(task5 + 8) == 1);  // waitCount
  CHECK(u32At(task5 + 12) == 5); // firstSignal
  CHECK(u32At(task5 + 16) == 1); // signalCount
  CHECK(bytes[task5 + 20] == uint8_t(CoreKind::Cube));
  CHECK(table[entryIndexOf(bytes, SectionKind::Tasks)].count == 8);
}

//===----------------------------------------------------------------------===//
// Tile grids
//===----------------------------------------------------------------------===//

TEST_CASE("tileCoord decodes a task's place in its op", "[task-binary][tiles]") {
  // 2 experts x 3 peers x 4 row tiles x 5 column tiles over 10 rows and 7
  // columns: rows split [0, 2) [2, 5) [5, 7) [7, 10), columns [0, 1) [1, 2)
  // [2, 4) [4, 5) [5, 7).
  TilingRecord tiling;
  tiling.experts = 2;
  tiling.peers = 3;
  tiling.rowTiles = 4;
  tiling.colTiles = 5;
  tiling.rows = 10;
  tiling.cols = 7;
  REQUIRE(tiling.tileCount() == 120);

  TileCoord first = tileCoord(tiling, 0);
  CHECK(first.expert == 0);
  CHECK(first.peer == 0);
  CHECK(first.rowTile == 0);
  CHECK(first.colTile == 0);
  CHECK(first.rowBegin == 0);
  CHECK(first.rowEnd == 2);
  CHECK(first.colBegin == 0);
  CHECK(first.colEnd == 1);

  // The column tile varies fastest, then the row tile, the peer, the expert.
  TileCoord c = tileCoord(tiling, 1);
  CHECK((c.expert == 0 && c.peer == 0 && c.rowTile == 0 && c.colTile == 1));
  CHECK((c.colBegin == 1 && c.colEnd == 2));
  c = tileCoord(tiling, 5);
  CHECK((c.expert == 0 && c.peer == 0 && c.rowTile == 1 && c.colTile == 0));
  CHECK((c.rowBegin == 2 && c.rowEnd == 5));
  c = tileCoord(tiling, 20);
  CHECK((c.expert == 0 && c.peer == 1 && c.rowTile == 0 && c.colTile == 0));
  c = tileCoord(tiling, 60);
  CHECK((c.expert == 1 && c.peer == 0 && c.rowTile == 0 && c.colTile == 0));
  c = tileCoord(tiling, 1 * 60 + 2 * 20 + 2 * 5 + 3);
  CHECK((c.expert == 1 && c.peer == 2 && c.rowTile == 2 && c.colTile == 3));
  CHECK((c.rowBegin == 5 && c.rowEnd == 7 && c.colBegin == 4 && c.colEnd == 5));

  // The last tile ends at the extents.
  TileCoord last = tileCoord(tiling, 119);
  CHECK(last.expert == 1);
  CHECK(last.peer == 2);
  CHECK(last.rowTile == 3);
  CHECK(last.colTile == 4);
  CHECK(last.rowBegin == 7);
  CHECK(last.rowEnd == 10);
  CHECK(last.colBegin == 5);
  CHECK(last.colEnd == 7);

  // Every index: the formulas of the format, and tiles that cover the
  // extents without gaps or overlaps.
  for (uint64_t i = 0; i < tiling.tileCount(); ++i) {
    INFO("tile " << i);
    TileCoord t = tileCoord(tiling, i);
    CHECK(t.colTile == i % 5);
    CHECK(t.rowTile == (i / 5) % 4);
    CHECK(t.peer == (i / 20) % 3);
    CHECK(t.expert == i / 60);
    CHECK(t.rowBegin == t.rowTile * 10 / 4);
    CHECK(t.rowEnd == (t.rowTile + 1) * 10 / 4);
    CHECK(t.colBegin == t.colTile * 7 / 5);
    CHECK(t.colEnd == (t.colTile + 1) * 7 / 5);
    CHECK(t.rowBegin < t.rowEnd);
    CHECK(t.colBegin < t.colEnd);
    if (t.rowTile + 1 < tiling.rowTiles)
      CHECK(tileCoord(tiling, i + 5).rowBegin == t.rowEnd);
    if (t.colTile + 1 < tiling.colTiles)
      CHECK(tileCoord(tiling, i + 1).colBegin == t.colEnd);
  }

  // tileBegin directly: i * extent / tiles.
  CHECK(tileBegin(0, 10, 4) == 0);
  CHECK(tileBegin(1, 10, 4) == 2);
  CHECK(tileBegin(3, 10, 4) == 7);
  CHECK(tileBegin(4, 10, 4) == 10);
  CHECK(tileBegin(3, 3, 3) == 3);

  // A single tile is the whole extent.
  TilingRecord one;
  one.rows = 1000;
  one.cols = 3;
  TileCoord whole = tileCoord(one, 0);
  CHECK((whole.expert == 0 && whole.peer == 0 && whole.rowTile == 0 && whole.colTile == 0));
  CHECK((whole.rowBegin == 0 && whole.rowEnd == 1000 && whole.colBegin == 0 && whole.colEnd == 3));

  // Large extents: the last of 3 row tiles of 2^40 rows ends at 2^40.
  TilingRecord large;
  large.rowTiles = 3;
  large.rows = uint64_t(1) << 40;
  CHECK(tileCoord(large, 2).rowEnd == uint64_t(1) << 40);
  CHECK(tileCoord(large, 1).rowBegin == (uint64_t(1) << 40) / 3);
}

TEST_CASE("each task is the tile of its place in its op", "[task-binary][tiles]") {
  const TaskProgram p = smallProgram();
  REQUIRE(validateTaskProgram(p).ok());
  for (uint32_t o = 0; o < p.ops.size(); ++o) {
    const OpRecord &op = p.ops[o];
    const TilingRecord &tiling = p.tilings[op.tiling];
    REQUIRE(tiling.tileCount() == op.taskCount);
    for (uint32_t k = 0; k < op.taskCount; ++k) {
      const TaskRecord &task = p.tasks[op.firstTask + k];
      CHECK(task.op == o);
      TileCoord tile = tileCoord(tiling, k);
      if (op.kind == OpKind::Dispatch) {
        // A put to the tile's peer signals the event on that peer.
        CHECK(tile.expert == k / 2);
        CHECK(tile.peer == k % 2);
        CHECK(p.signals[task.firstSignal].peerOffset == tile.peer);
        CHECK((tile.rowBegin == 0 && tile.rowEnd == 32 && tile.colEnd == 128));
      } else {
        CHECK(tile.expert == k / 2);
        CHECK(tile.peer == 0);
        CHECK(tile.colBegin == 256 * (k % 2));
        CHECK(tile.colEnd == 256 * (k % 2) + 256);
        CHECK((tile.rowBegin == 0 && tile.rowEnd == 128));
      }
    }
  }
}

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
  CHECK(header.version == 1);
  CHECK(header.flags == kFlagBf16);
  CHECK(header.fileSize == bytes.size());
  CHECK(header.crc32 == taskBinaryChecksum(bytes.data(), bytes.size()));
  CHECK(header.epRanks == 2);
  CHECK(header.localExperts == 2);
  CHECK(header.sectionCount == kSectionKindCount);
  CHECK(header.sectionTableOffset == 64);
  CHECK(header.target == program.target);
  for (uint32_t word : header.reserved)
    CHECK(word == 0);
  CHECK(bytes.size() % kSectionAlignment == 0);

  // The writer lays the sections out in kind order, aligned, back to back.
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  REQUIRE(table.size() == kSectionKindCount);
  const uint32_t recordSizes[kSectionKindCount] = {1, 56, 24, 96, 16, 24, 8, 16, 16, 4};
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

TEST_CASE("peers and experts are resolved relative to the loading rank", "[task-binary]") {
  TaskProgram program = smallProgram();
  program.epRanks = 4;
  CHECK(program.peerRank(0, 1) == 1);
  CHECK(program.peerRank(3, 1) == 0);
  CHECK(program.peerRank(2, 3) == 1);
  CHECK(program.globalExpert(3, 1) == 7);
  CHECK_FALSE(program.isBackward());
  program.flags |= kFlagBackward;
  CHECK(program.isBackward());
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

//===----------------------------------------------------------------------===//
// Header errors
//===----------------------------------------------------------------------===//

TEST_CASE("bad magic", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  bytes[3] = 'X';
  CHECK(readError(bytes) == "not a moec task binary (bad magic)");
  CHECK(readError({'P', 'K', 3, 4}) == "not a moec task binary (bad magic)");
  CHECK(readError(std::vector<uint8_t>(100, 0)) == "not a moec task binary (bad magic)");
}

TEST_CASE("a file shorter than the header", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  for (size_t cut : {size_t(0), size_t(4), size_t(8), size_t(63)}) {
    std::vector<uint8_t> part(bytes.begin(), bytes.begin() + cut);
    CHECK(readError(part) == "truncated: the file has " + std::to_string(cut) +
                                 " bytes, less than the 64-byte header");
  }
  TaskProgram program;
  CHECK_FALSE(readTaskBinary(nullptr, 0, &program).ok());
}

TEST_CASE("wrong version", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  put<uint32_t>(bytes, offsetof(FileHeader, version), 7);
  CHECK(readError(bytes) == "format version 7 is not supported (this reader reads version 1)");
  fixHeader(bytes);
  CHECK(readError(bytes) == "format version 7 is not supported (this reader reads version 1)");
  put<uint32_t>(bytes, offsetof(FileHeader, version), 0);
  CHECK(readError(bytes) == "format version 0 is not supported (this reader reads version 1)");
}

TEST_CASE("bad checksum", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  FileHeader header = headerOf(bytes);
  SectionEntry tasks = sectionTableOf(bytes)[entryIndexOf(bytes, SectionKind::Tasks)];
  bytes[tasks.offset + 1] ^= 0x40;
  uint32_t content = taskBinaryChecksum(bytes.data(), bytes.size());
  CHECK(content != header.crc32);
  char expected[100];
  std::snprintf(expected, sizeof(expected),
                "bad checksum: header says 0x%08x, content gives 0x%08x", header.crc32, content);
  CHECK(readError(bytes) == expected);

  // A wrong CRC field alone is a bad checksum too.
  bytes = writeTaskBinary(smallProgram());
  put<uint32_t>(bytes, offsetof(FileHeader, crc32), 0x1234abcd);
  std::snprintf(expected, sizeof(expected),
                "bad checksum: header says 0x1234abcd, content gives 0x%08x", header.crc32);
  CHECK(readError(bytes) == expected);

  // Damage in padding is caught: the CRC covers the whole file.
  bytes = writeTaskBinary(smallProgram());
  SectionEntry strings = sectionTableOf(bytes)[entryIndexOf(bytes, SectionKind::Strings)];
  REQUIRE(strings.count % 8 != 0);
  bytes[strings.offset + strings.count] = 1;
  CHECK(readError(bytes).rfind("bad checksum: ", 0) == 0);

  // With the check off, the same file reads.
  TaskProgram program;
  ReadOptions options;
  options.verifyChecksum = false;
  CHECK(readTaskBinary(bytes.data(), bytes.size(), &program, options).ok());
}

TEST_CASE("the size field must match the file", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  size_t size = bytes.size();

  std::vector<uint8_t> longer = bytes;
  longer.resize(size + 8, 0);
  CHECK(readError(longer) == "file size mismatch: the header says " + std::to_string(size) +
                                 " bytes, but the file has " + std::to_string(size + 8));

  std::vector<uint8_t> claimsMore = bytes;
  put<uint64_t>(claimsMore, offsetof(FileHeader, fileSize), size + 8);
  put<uint32_t>(claimsMore, offsetof(FileHeader, crc32),
                taskBinaryChecksum(claimsMore.data(), claimsMore.size()));
  CHECK(readError(claimsMore) == "truncated: the file has " + std::to_string(size) +
                                     " bytes, but the header says it has " +
                                     std::to_string(size + 8));

  std::vector<uint8_t> claimsLess = bytes;
  put<uint64_t>(claimsLess, offsetof(FileHeader, fileSize), size - 8);
  put<uint32_t>(claimsLess, offsetof(FileHeader, crc32),
                taskBinaryChecksum(claimsLess.data(), claimsLess.size()));
  CHECK(readError(claimsLess) == "file size mismatch: the header says " + std::to_string(size - 8) +
                                     " bytes, but the file has " + std::to_string(size));
}

TEST_CASE("header fields", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  std::vector<uint8_t> reserved = bytes;
  put<uint32_t>(reserved, offsetof(FileHeader, reserved) + 4, 1);
  fixHeader(reserved);
  CHECK(readError(reserved) == "header: reserved bytes are not zero");

  std::vector<uint8_t> count = bytes;
  put<uint32_t>(count, offsetof(FileHeader, sectionCount), 9);
  fixHeader(count);
  CHECK(readError(count) == "header: the section table has 9 entries; version 1 has 10");

  std::vector<uint8_t> lastReserved = bytes;
  put<uint32_t>(lastReserved, offsetof(FileHeader, reserved) + 4, 0x100);
  fixHeader(lastReserved);
  CHECK(readError(lastReserved) == "header: reserved bytes are not zero");

  TaskProgram program = smallProgram();
  program.flags = 0x10 | kFlagBackward;
  CHECK(contentError(program) == "header: unknown flag bits 0x10");
  program = smallProgram();
  program.epRanks = 0;
  CHECK(contentError(program) == "header: the EP group has 0 ranks");
}

TEST_CASE("the header's target names a string", "[task-binary][errors]") {
  TaskProgram program = smallProgram();
  const std::string tableSize = std::to_string(program.strings.size());

  SECTION("an offset past the string table, in the program") {
    program.target = uint32_t(program.strings.size());
    CHECK(contentError(program) == "header: target: name offset " + tableSize +
                                       " is past the end of the " + tableSize +
                                       "-byte string table");
  }
  SECTION("an offset past the string table, in the file") {
    std::vector<uint8_t> bytes = writeTaskBinary(program);
    put<uint32_t>(bytes, offsetof(FileHeader, target), 5000);
    CHECK(readError(bytes).rfind("bad checksum: ", 0) == 0);
    fixHeader(bytes);
    CHECK(readError(bytes) == "header: target: name offset 5000 is past the end of the " +
                                  tableSize + "-byte string table");
    put<uint32_t>(bytes, offsetof(FileHeader, target), kNone);
    fixHeader(bytes);
    CHECK(readError(bytes) == "header: target: name offset 4294967295 is past the end of the " +
                                  tableSize + "-byte string table");
  }
  SECTION("a name that is not terminated") {
    TaskProgram bare;
    bare.strings = "cpu";
    CHECK(contentError(bare) == "header: target: the name at offset 0 is not NUL-terminated");
  }
  SECTION("any name in the table will do; names may be shared") {
    program.target = program.slots[0].name;
    TaskProgram read = readOk(writeTaskBinary(program));
    CHECK(read.name(read.target) == "x");
    // An offset inside a name names its tail.
    program.target = 3;
    CHECK(readOk(writeTaskBinary(program)).name(3) == "end-910b");
  }
}

//===----------------------------------------------------------------------===//
// Truncation and the section table
//===----------------------------------------------------------------------===//

TEST_CASE("truncation at every section boundary", "[task-binary][errors]") {
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  size_t checked = 0;
  for (const SectionEntry &entry : table) {
    uint64_t sectionBytes = entry.count * entry.recordSize;
    REQUIRE(sectionBytes > 0);
    for (uint64_t cut : {entry.offset, entry.offset + sectionBytes - 1}) {
      INFO("section " << sectionKindName(SectionKind(entry.kind)) << ", cut at " << cut);
      std::vector<uint8_t> part(bytes.begin(), bytes.begin() + cut);
      std::string where = "truncated: section '" +
                          std::string(sectionKindName(SectionKind(entry.kind))) + "' (offset " +
                          std::to_string(entry.offset) + ", " + std::to_string(sectionBytes) +
                          " bytes) ends past the end of the " + std::to_string(cut) + "-byte file";

      // As cut: the header's size names the cut section.
      CHECK(readError(part) ==
            where + " (the header says the file has " + std::to_string(bytes.size()) + " bytes)");

      // With the header's size and CRC made to match: the section table
      // check names it.
      fixHeader(part);
      CHECK(readError(part) == where);
      ++checked;
    }
  }
  CHECK(checked == 2 * kSectionKindCount);
  // Each section ends where the next begins, up to padding; so these are the
  // cuts at every section boundary.
  for (size_t i = 0; i + 1 < table.size(); ++i)
    CHECK(table[i + 1].offset - (table[i].offset + table[i].count * table[i].recordSize) < 8);

  // Cuts inside the section table.
  for (uint64_t cut : {uint64_t(64), uint64_t(64 + 24 * 3 + 5)}) {
    std::vector<uint8_t> part(bytes.begin(), bytes.begin() + cut);
    std::string where =
        "truncated: the section table (offset 64, 240 bytes) ends past the end of the " +
        std::to_string(cut) + "-byte file";
    CHECK(readError(part) ==
          where + " (the header says the file has " + std::to_string(bytes.size()) + " bytes)");
    fixHeader(part);
    CHECK(readError(part) == where);
  }
}

TEST_CASE("misaligned, overlapping and misplaced sections", "[task-binary][errors]") {
  const std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  const std::vector<SectionEntry> table = sectionTableOf(bytes);
  size_t ops = entryIndexOf(bytes, SectionKind::Ops);
  size_t slots = entryIndexOf(bytes, SectionKind::Slots);
  size_t opsOffsetField = entryOffset(bytes, ops) + offsetof(SectionEntry, offset);

  SECTION("misaligned") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, opsOffsetField, table[ops].offset + 4);
    fixHeader(b);
    CHECK(readError(b) == "section 'ops': offset " + std::to_string(table[ops].offset + 4) +
                              " is not 8-byte aligned");
  }
  SECTION("overlapping another section") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, opsOffsetField, table[slots].offset + 8);
    fixHeader(b);
    CHECK(readError(b) == "section 'slots' (offset " + std::to_string(table[slots].offset) +
                              ", 224 bytes) " + "overlaps section 'ops' (offset " +
                              std::to_string(table[slots].offset + 8) + ", 48 bytes)");
  }
  SECTION("the same offset as another section") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, opsOffsetField, table[slots].offset);
    fixHeader(b);
    CHECK(readError(b).find("overlaps section 'ops'") != std::string::npos);
  }
  SECTION("overlapping the section table") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, opsOffsetField, 64 + 8 * 24);
    fixHeader(b);
    CHECK(readError(b) ==
          "the section table (offset 64, 240 bytes) overlaps section 'ops' (offset 256, 48 bytes)");
  }
  SECTION("inside the header") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, opsOffsetField, 16);
    fixHeader(b);
    CHECK(readError(b) == "section 'ops' (offset 16, 48 bytes) starts inside the 64-byte header");
  }
  SECTION("the section table inside the header or misaligned") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, offsetof(FileHeader, sectionTableOffset), 8);
    fixHeader(b);
    CHECK(readError(b) ==
          "the section table (offset 8, 240 bytes) starts inside the 64-byte header");
    put<uint64_t>(b, offsetof(FileHeader, sectionTableOffset), 68);
    fixHeader(b);
    CHECK(readError(b) == "the section table: offset 68 is not 8-byte aligned");
  }
  SECTION("an unknown kind, a duplicate kind, a wrong record size") {
    std::vector<uint8_t> b = bytes;
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, kind), 42);
    fixHeader(b);
    CHECK(readError(b) == "section table entry " + std::to_string(ops) +
                              ": kind 42 is not a section kind of version 1");
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, kind),
                  uint32_t(SectionKind::Slots));
    fixHeader(b);
    CHECK(readError(b) == "section table entry " + std::to_string(ops) +
                              ": a second 'slots' section (the first is entry " +
                              std::to_string(slots) + ")");
    b = bytes;
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, recordSize), 16);
    fixHeader(b);
    CHECK(readError(b) == "section 'ops': record size 16, but version 1 ops records are 24 bytes");
    b = bytes;
    size_t tilings = entryIndexOf(b, SectionKind::Tilings);
    put<uint32_t>(b, entryOffset(b, tilings) + offsetof(SectionEntry, recordSize), 88);
    fixHeader(b);
    CHECK(readError(b) ==
          "section 'tilings': record size 88, but version 1 tilings records are 96 bytes");
    b = bytes;
    size_t tasks = entryIndexOf(b, SectionKind::Tasks);
    put<uint32_t>(b, entryOffset(b, tasks) + offsetof(SectionEntry, recordSize), 28);
    fixHeader(b);
    CHECK(readError(b) ==
          "section 'tasks': record size 28, but version 1 tasks records are 24 bytes");
  }
  SECTION("empty sections may sit anywhere past the header") {
    TaskProgram program = smallProgram();
    program.waits.clear();
    for (TaskRecord &task : program.tasks)
      task.firstWait = task.waitCount = 0;
    std::vector<uint8_t> b = writeTaskBinary(program);
    size_t waits = entryIndexOf(b, SectionKind::Waits);
    put<uint64_t>(b, entryOffset(b, waits) + offsetof(SectionEntry, offset),
                  sectionTableOf(b)[slots].offset + 8);
    fixHeader(b);
    CHECK(readOk(b) == program);
  }
}

TEST_CASE("record counts that overflow or exceed 32-bit indices", "[task-binary][errors]") {
  const std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  size_t tasks = entryIndexOf(bytes, SectionKind::Tasks);
  size_t countField = entryOffset(bytes, tasks) + offsetof(SectionEntry, count);
  uint64_t tasksOffset = sectionTableOf(bytes)[tasks].offset;

  std::vector<uint8_t> b = bytes;
  put<uint64_t>(b, countField, uint64_t(1) << 62);
  fixHeader(b);
  CHECK(readError(b) ==
        "section 'tasks': 4611686018427387904 records of 24 bytes overflow a 64-bit size");
  put<uint64_t>(b, countField, ~uint64_t(0));
  fixHeader(b);
  CHECK(readError(b) ==
        "section 'tasks': 18446744073709551615 records of 24 bytes overflow a 64-bit size");

  put<uint64_t>(b, countField, uint64_t(1) << 33);
  fixHeader(b);
  CHECK(readError(b) == "section 'tasks' has 8589934592 records; indices are 32-bit, so a section "
                        "holds at most 4294967295");

  put<uint64_t>(b, countField, 1000000);
  fixHeader(b);
  CHECK(readError(b) == "truncated: section 'tasks' (offset " + std::to_string(tasksOffset) +
                            ", 24000000 bytes) ends past the end of the " +
                            std::to_string(b.size()) + "-byte file");

  // An absurd section table offset.
  b = bytes;
  put<uint64_t>(b, offsetof(FileHeader, sectionTableOffset), ~uint64_t(0) - 7);
  fixHeader(b);
  CHECK(readError(b) == "truncated: the section table (offset 18446744073709551608, 240 bytes) "
                        "ends past the end of the " +
                            std::to_string(b.size()) + "-byte file");
}

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

TEST_CASE("enum values and reserved bytes", "[task-binary][errors]") {
  TaskProgram p = smallProgram();
  SECTION("op kind") {
    p.ops[0].kind = OpKind(9);
    CHECK(contentError(p) == "op 0 'dispatch': kind 9 is not an op kind (1..7)");
  }
  SECTION("dtype") {
    p.slots[0].dtype = DType(0);
    CHECK(contentError(p) ==
          "slot 0 'x': dtype 0 is not one of f32 (1), bf16 (2), i32 (3), i64 (4), f8e4m3 (5)");
  }
  SECTION("tiling dtype and op kind") {
    p.tilings[1].dtype = DType(6);
    CHECK(contentError(p) ==
          "tiling 1: dtype 6 is not one of f32 (1), bf16 (2), i32 (3), i64 (4), f8e4m3 (5)");
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
  SECTION("flags") {
    p.slots[1].flags |= 0x80;
    CHECK(contentError(p) == "slot 1 'dispatched_x': unknown flag bits 0x80");
    p = smallProgram();
    p.tilings[0].flags = 0x20;
    CHECK(contentError(p) == "tiling 0: unknown flag bits 0x20");
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

TEST_CASE("ops and their tile grids", "[task-binary][errors][tiles]") {
  TaskProgram p = smallProgram();

  SECTION("a tiling for another op kind") {
    p.ops[0].tiling = 1;
    CHECK(contentError(p) ==
          "op 0 'dispatch': tiling 1 is for a gmm op, but the op is a dispatch op");
  }
  SECTION("ops of one kind may share a tiling") {
    // A second gmm op over the same grid (tasks 8..11, on a third cube core).
    OpRecord second = p.ops[1];
    second.name = p.addString("gate_proj");
    second.firstTask = 8;
    p.ops.push_back(second);
    for (uint32_t k = 0; k < 4; ++k) {
      TaskRecord task = p.tasks[4 + k];
      task.op = 2;
      task.firstSignal = 8;
      p.tasks.push_back(task);
      p.queueEntries.push_back(8 + k);
    }
    p.signals.push_back({1, 1, 0, 0});
    p.events[1].threshold = 8;
    p.queues.push_back({CoreKind::Cube, {}, 2, 8, 4});
    Status status = validateTaskProgram(p);
    INFO(status.message());
    CHECK(status.ok());
    CHECK(readOk(writeTaskBinary(p)) == p);
  }
  SECTION("a task count other than the grid's") {
    p.tilings[1].colTiles = 3;
    CHECK(contentError(p) ==
          "op 1 'up_proj': has 4 tasks, but its tiling 1 is a grid of 6 tiles (2 x 1 x 1 x 3)");
    p = smallProgram();
    p.ops[0].taskCount = 3;
    CHECK(contentError(p) ==
          "op 0 'dispatch': has 3 tasks, but its tiling 0 is a grid of 4 tiles (2 x 2 x 1 x 1)");
  }
  SECTION("experts: 1 or L") {
    p.tilings[1].experts = 3;
    CHECK(contentError(p) == "tiling 1: a grid of 3 experts; it must be 1 or the 2 local experts");
    p.tilings[1].experts = 0;
    CHECK(contentError(p) == "tiling 1: a grid of 0 experts; it must be 1 or the 2 local experts");
    // One expert: the op's 4 tasks are 1 x 1 x 1 x 4 tiles.
    p.tilings[1].experts = 1;
    p.tilings[1].colTiles = 4;
    CHECK(validateTaskProgram(p).ok());
    // With L = 1, only a grid of 1 expert will do.
    p = smallProgram();
    p.localExperts = 1;
    CHECK(contentError(p) == "tiling 0: a grid of 2 experts; it must be 1 or the 1 local experts");
  }
  SECTION("peers: 1 or R") {
    p.tilings[0].peers = 3;
    CHECK(contentError(p) == "tiling 0: a grid of 3 peers; it must be 1 or the 2 EP ranks");
    p.tilings[0].peers = 0;
    CHECK(contentError(p) == "tiling 0: a grid of 0 peers; it must be 1 or the 2 EP ranks");
    // One peer: the 4 dispatch tasks as 2 experts x 2 row tiles.
    p.tilings[0].peers = 1;
    p.tilings[0].rowTiles = 2;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("an empty grid") {
    p.tilings[1].rowTiles = 0;
    CHECK(contentError(p) == "tiling 1: a grid of 0 x 2 tiles is empty");
    p = smallProgram();
    p.tilings[0].colTiles = 0;
    CHECK(contentError(p) == "tiling 0: a grid of 1 x 0 tiles is empty");
  }
  SECTION("fewer rows or columns than tiles") {
    p.tilings[1].rows = 0;
    CHECK(contentError(p) == "tiling 1: 1 row tiles of 0 rows and 2 column tiles of 512 columns "
                             "leave a tile empty");
    p = smallProgram();
    p.tilings[1].cols = 1;
    CHECK(contentError(p) == "tiling 1: 1 row tiles of 128 rows and 2 column tiles of 1 columns "
                             "leave a tile empty");
    // As many as tiles: every tile has one.
    p = smallProgram();
    p.tilings[1].cols = 2;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("balanced rows are an estimate, not a bound") {
    // A weight-gradient GMM (depth 0) reduces over balancedRows rows, which
    // may be more than the rows (of the weight) it tiles.
    p.tilings[1].depth = 0;
    p.tilings[1].balancedRows = 4096;
    CHECK(validateTaskProgram(p).ok());
    p.tilings[0].balancedRows = 0;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("a tiling's scale") {
    p.tilings[1].scale = 2.0f;
    CHECK(contentError(p) == "tiling 1: scale is set without the scale flag");
    p.tilings[1].flags |= kTilingScale;
    CHECK(validateTaskProgram(p).ok());
    p.tilings[1].scale = 0.0f;
    CHECK(contentError(p) == "tiling 1: scale 0 is not a finite nonzero number");
    p.tilings[1].scale = std::numeric_limits<float>::infinity();
    CHECK(contentError(p) == "tiling 1: scale inf is not a finite nonzero number");
  }
  SECTION("tile bounds that overflow 64 bits") {
    // tileBegin(2, rows, 2) = 2 * rows / 2 must not wrap.
    p.tilings[1].rowTiles = 2;
    p.tilings[1].colTiles = 1;
    p.tilings[1].rows = uint64_t(1) << 63;
    CHECK(contentError(p) == "tiling 1: 2 row tiles of 9223372036854775808 rows and 1 column tiles "
                             "of 512 columns overflow the 64-bit tile bounds");
    p.tilings[1].rows = (uint64_t(1) << 63) - 1;
    REQUIRE(validateTaskProgram(p).ok());
    CHECK(tileCoord(p.tilings[1], 1).rowEnd == p.tilings[1].rows);
    CHECK(tileCoord(p.tilings[1], 1).rowBegin < p.tilings[1].rows);
  }
  SECTION("a tiling no op uses is checked too") {
    TilingRecord unused = p.tilings[1];
    unused.rowTiles = 0;
    p.tilings.push_back(unused);
    CHECK(contentError(p) == "tiling 2: a grid of 0 x 2 tiles is empty");
    p.tilings.back() = p.tilings[1];
    p.tilings.back().opKind = OpKind(8);
    CHECK(contentError(p) == "tiling 2: op kind 8 is not an op kind (1..7)");
  }
}

TEST_CASE("a grid holds at most 2^32 - 1 tiles", "[task-binary][errors][tiles]") {
  SECTION("2^32 tiles") {
    TaskProgram p = bareProgram(1u << 16, 1u << 16);
    TilingRecord tiling;
    tiling.experts = 1u << 16;
    tiling.peers = 1u << 16;
    p.tilings.push_back(tiling);
    CHECK(contentError(p) == "tiling 0: a grid of 4294967296 tiles is above the 4294967295 a "
                             "binary holds");
    // One fewer expert: 2^32 - 2^16 tiles fit, and the op that uses them
    // must have as many tasks.
    p.localExperts = tiling.experts = p.tilings[0].experts = (1u << 16) - 1;
    p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, 0, 0, 0, 0});
    CHECK(contentError(p) ==
          "op 0 'gmm': has 0 tasks, but its tiling 0 is a grid of 4294901760 tiles (65535 x "
          "65536 x 1 x 1)");
  }
  SECTION("a grid whose count wraps 64 bits to 0") {
    // 2^16 experts x 2^16 peers x 2^16 x 2^16 tiles: 2^64, which tileCount()
    // wraps to 0; an op of no tasks must not pass for it.
    TaskProgram p = bareProgram(1u << 16, 1u << 16);
    TilingRecord tiling;
    tiling.experts = tiling.peers = tiling.rowTiles = tiling.colTiles = 1u << 16;
    tiling.rows = tiling.cols = 1u << 16;
    p.tilings.push_back(tiling);
    p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, 0, 0, 0, 0});
    REQUIRE(tiling.tileCount() == 0);
    CHECK(contentError(p) == "tiling 0: a grid of 65536 x 65536 x 65536 x 65536 tiles is above "
                             "the 4294967295 a binary holds");
  }
  SECTION("a grid whose count wraps 64 bits to 1") {
    // 3935371 x 409891 x 7623851 x 3 = 2^65 + 1, which tileCount() wraps
    // to 1: an op of one task must not pass for it.
    const uint32_t experts = 3935371, peers = 409891, rowTiles = 7623851;
    TaskProgram p = bareProgram(peers, experts);
    TilingRecord tiling;
    tiling.experts = experts;
    tiling.peers = peers;
    tiling.rowTiles = rowTiles;
    tiling.colTiles = 3;
    tiling.rows = rowTiles;
    tiling.cols = 3;
    p.tilings.push_back(tiling);
    p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, 0, 1, 0, 0});
    TaskRecord task;
    task.coreKind = CoreKind::Cube;
    p.tasks.push_back(task);
    p.queues.push_back({CoreKind::Cube, {}, 0, 0, 1});
    p.queueEntries.push_back(0);
    REQUIRE(tiling.tileCount() == 1);
    CHECK(contentError(p) == "tiling 0: a grid of 3935371 x 409891 x 7623851 x 3 tiles is above "
                             "the 4294967295 a binary holds");
    // The same program with a grid of one tile is valid.
    p.tilings[0].experts = p.tilings[0].peers = p.tilings[0].rowTiles = p.tilings[0].colTiles = 1;
    Status status = validateTaskProgram(p);
    INFO(status.message());
    CHECK(status.ok());
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

TEST_CASE("a failed read leaves the output unchanged", "[task-binary][errors]") {
  TaskProgram before = smallProgram();
  before.epRanks = 8;
  TaskProgram out = before;
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  bytes.pop_back();
  CHECK_FALSE(readTaskBinary(bytes.data(), bytes.size(), &out).ok());
  CHECK(out == before);
}

TEST_CASE("every single-byte change is caught", "[task-binary][errors]") {
  // Without the checksum, a changed byte is either caught by a structural or
  // content check, or reads as a valid program that differs from the
  // original (or lies in padding); it never crashes the reader.
  const TaskProgram program = smallProgram();
  const std::vector<uint8_t> bytes = writeTaskBinary(program);
  ReadOptions options;
  options.verifyChecksum = false;
  size_t caught = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (i >= offsetof(FileHeader, crc32) && i < offsetof(FileHeader, crc32) + 4)
      continue;
    std::vector<uint8_t> b = bytes;
    b[i] ^= 0x5A;
    TaskProgram out;
    if (!readTaskBinary(b.data(), b.size(), &out, options).ok())
      ++caught;
    CHECK_FALSE(readTaskBinary(b.data(), b.size(), &out).ok());
  }
  CHECK(caught > bytes.size() / 2);
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
