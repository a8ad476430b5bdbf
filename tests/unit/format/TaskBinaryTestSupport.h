//===- TaskBinaryTestSupport.h - Shared by the format tests -*- C++ -*-===//
//
// What the tests of the task binary format share: a small valid program
// with every section filled, a bare one to add to, and helpers that read
// and patch a written file's bytes (header, section table) and read it back.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TESTS_UNIT_FORMAT_TASKBINARYTESTSUPPORT_H
#define MOEC_TESTS_UNIT_FORMAT_TASKBINARYTESTSUPPORT_H

#include "format/Crc32.h"
#include "format/TaskBinary.h"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace moec::test {

using namespace moec::format;
using moec::Status;

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
/// A layer record that agrees with smallProgram's header (2 EP ranks of 2
/// experts, bf16).
inline LayerRecord smallLayer() {
  LayerRecord l;
  l.hidden = 128;
  l.intermediate = 32;
  l.seqSize = 32;
  l.topK = 2;
  l.experts = 4;
  l.capacityFactor = 2;
  l.rowCapacity = 64;
  l.receiveCapacity = 128; // 2 x 64, the worst case 32 x 2 x min(2, 2)
  l.dtype = DType::BF16;
  l.dispatchDtype = DType::BF16;
  return l;
}

inline TaskProgram smallProgram() {
  TaskProgram p;
  p.flags = kFlagBf16;
  p.epRanks = 2;
  p.localExperts = 2;
  p.target = p.addString("ascend-910b");
  p.layer = smallLayer();

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
inline TaskProgram bareProgram(uint32_t epRanks, uint32_t localExperts) {
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
inline FileHeader headerOf(const std::vector<uint8_t> &bytes) {
  FileHeader header;
  REQUIRE(bytes.size() >= sizeof(header));
  std::memcpy(&header, bytes.data(), sizeof(header));
  return header;
}

/// Returns the section table of a file the writer produced.
inline std::vector<SectionEntry> sectionTableOf(const std::vector<uint8_t> &bytes) {
  FileHeader header = headerOf(bytes);
  std::vector<SectionEntry> table(header.sectionCount);
  std::memcpy(table.data(), bytes.data() + header.sectionTableOffset,
              table.size() * sizeof(SectionEntry));
  return table;
}

/// Returns the file offset of section table entry `index`.
inline size_t entryOffset(const std::vector<uint8_t> &bytes, size_t index) {
  return size_t(headerOf(bytes).sectionTableOffset) + index * sizeof(SectionEntry);
}

/// Returns the index in the section table of the section of `kind`.
inline size_t entryIndexOf(const std::vector<uint8_t> &bytes, SectionKind kind) {
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  for (size_t i = 0; i < table.size(); ++i)
    if (table[i].kind == uint32_t(kind))
      return i;
  FAIL("no such section");
  return 0;
}

/// Overwrites the value at `offset` with `value`.
template <typename T> inline void put(std::vector<uint8_t> &bytes, size_t offset, T value) {
  REQUIRE(offset + sizeof(T) <= bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

/// Sets the header's size field to the file's size and recomputes its CRC.
inline void fixHeader(std::vector<uint8_t> &bytes) {
  put<uint64_t>(bytes, offsetof(FileHeader, fileSize), bytes.size());
  put<uint32_t>(bytes, offsetof(FileHeader, crc32), taskBinaryChecksum(bytes.data(), bytes.size()));
}

/// Reads `bytes`, requiring success.
inline TaskProgram readOk(const std::vector<uint8_t> &bytes) {
  TaskProgram program;
  Status status = readTaskBinary(bytes.data(), bytes.size(), &program);
  INFO(status.message());
  REQUIRE(status.ok());
  return program;
}

/// Reads `bytes`, requiring an error, and returns its message.
inline std::string readError(const std::vector<uint8_t> &bytes) {
  TaskProgram program;
  Status status = readTaskBinary(bytes.data(), bytes.size(), &program);
  REQUIRE_FALSE(status.ok());
  REQUIRE_FALSE(status.message().empty());
  return status.message();
}

/// Writes `program` (which the writer does not check), reads it back and
/// returns the reader's error; also requires validateTaskProgram to give the
/// same one.
inline std::string contentError(const TaskProgram &program) {
  std::string message = readError(writeTaskBinary(program));
  Status status = validateTaskProgram(program);
  REQUIRE_FALSE(status.ok());
  CHECK(status.message() == message);
  return message;
}

/// Returns a path for a scratch file in the test's temporary folder.
inline std::string tempPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

} // namespace moec::test

#endif // MOEC_TESTS_UNIT_FORMAT_TASKBINARYTESTSUPPORT_H
