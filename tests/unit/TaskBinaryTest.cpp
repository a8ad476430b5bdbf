//===- TaskBinaryTest.cpp - Tests for the task binary writer and reader ---===//

#include "runtime/format/TaskBinary.h"
#include "runtime/format/Crc32.h"

#include <catch2/catch.hpp>

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

/// A small forward program for an EP group of 2 ranks with 2 local experts:
/// a dispatch op (2 vector tasks, each putting to itself and to its peer)
/// and a gmm op (2 cube tasks, one per local expert, each waiting for the
/// dispatch rows it needs and signalling the terminate event). Every section
/// is non-empty.
TaskProgram smallProgram() {
  TaskProgram p;
  p.flags = kFlagBf16;
  p.epRanks = 2;
  p.localExperts = 2;

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
  dispatch.taskCount = 2;
  OpRecord gmm;
  gmm.name = p.addString("up_proj");
  gmm.kind = OpKind::Gmm;
  gmm.firstTask = 2;
  gmm.taskCount = 2;
  p.ops = {dispatch, gmm};

  TilingRecord dispatchTile;
  dispatchTile.opKind = OpKind::Dispatch;
  dispatchTile.dtype = DType::BF16;
  dispatchTile.inputCount = 1;
  dispatchTile.inputSlots[0] = 0;
  dispatchTile.outputSlot = 1;
  dispatchTile.rowCount = 32;
  dispatchTile.colCount = 128;
  dispatchTile.tileM = 32;
  dispatchTile.lda = 128;
  dispatchTile.ldc = 128;
  TilingRecord gmmTile;
  gmmTile.opKind = OpKind::Gmm;
  gmmTile.dtype = DType::BF16;
  gmmTile.flags = kTilingTransposeB;
  gmmTile.inputCount = 2;
  gmmTile.inputSlots[0] = 1;
  gmmTile.inputSlots[1] = 2;
  gmmTile.outputSlot = 3;
  gmmTile.expert = 0;
  gmmTile.rowOffset = 0;
  gmmTile.rowCount = 128;
  gmmTile.colOffset = 0;
  gmmTile.colCount = 512;
  gmmTile.tileM = 128;
  gmmTile.tileN = 256;
  gmmTile.tileK = 64;
  gmmTile.lda = 128;
  gmmTile.ldb = 128;
  gmmTile.ldc = 512;
  TilingRecord gmmTile1 = gmmTile;
  gmmTile1.expert = 1;
  p.tilings = {dispatchTile, gmmTile, gmmTile1};

  EventRecord rowsIn;
  rowsIn.name = p.addString("dispatch.rows_in");
  rowsIn.kind = EventKind::CrossRank;
  rowsIn.op = 0;
  rowsIn.threshold = 4;
  EventRecord done;
  done.name = p.addString("done");
  done.kind = EventKind::Terminate;
  done.op = 1;
  done.threshold = 2;
  p.events = {rowsIn, done};

  // Signals: each dispatch task puts to itself and to the peer.
  p.signals = {{0, 1, 0, 0}, {0, 1, 1, 0}, {0, 1, 0, 0}, {0, 1, 1, 0}, {1, 1, 0, 0}, {1, 1, 0, 0}};
  p.waits = {{0, 2}, {0, 4}};

  TaskRecord t0;
  t0.op = 0;
  t0.tiling = 0;
  t0.firstSignal = 0;
  t0.signalCount = 2;
  t0.coreKind = CoreKind::Vector;
  TaskRecord t1 = t0;
  t1.firstSignal = 2;
  TaskRecord t2;
  t2.op = 1;
  t2.tiling = 1;
  t2.firstWait = 0;
  t2.waitCount = 1;
  t2.firstSignal = 4;
  t2.signalCount = 1;
  t2.coreKind = CoreKind::Cube;
  TaskRecord t3 = t2;
  t3.tiling = 2;
  t3.firstWait = 1;
  t3.firstSignal = 5;
  p.tasks = {t0, t1, t2, t3};

  QueueRecord vectorQueue;
  vectorQueue.coreKind = CoreKind::Vector;
  vectorQueue.coreIndex = 0;
  vectorQueue.firstEntry = 0;
  vectorQueue.entryCount = 2;
  QueueRecord cubeQueue;
  cubeQueue.coreKind = CoreKind::Cube;
  cubeQueue.coreIndex = 0;
  cubeQueue.firstEntry = 2;
  cubeQueue.entryCount = 2;
  p.queues = {vectorQueue, cubeQueue};
  p.queueEntries = {0, 1, 2, 3};
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
// Round trip
//===----------------------------------------------------------------------===//

TEST_CASE("a program survives a write and a read unchanged", "[task-binary]") {
  TaskProgram program = smallProgram();
  REQUIRE(validateTaskProgram(program).ok());
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
  CHECK(bytes.size() % kSectionAlignment == 0);

  // The writer lays the sections out in kind order, aligned, back to back.
  std::vector<SectionEntry> table = sectionTableOf(bytes);
  REQUIRE(table.size() == kSectionKindCount);
  uint64_t end = 64 + kSectionKindCount * sizeof(SectionEntry);
  for (size_t i = 0; i < table.size(); ++i) {
    CHECK(table[i].kind == i + 1);
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
  }
  CHECK(read.name(read.ops[1].name) == "up_proj");
  REQUIRE(read.tilings.size() == 3);
  for (size_t i = 0; i < read.tilings.size(); ++i) {
    const TilingRecord &a = read.tilings[i], &b = program.tilings[i];
    CHECK(a.opKind == b.opKind);
    CHECK(a.dtype == b.dtype);
    CHECK(a.flags == b.flags);
    CHECK(a.inputCount == b.inputCount);
    CHECK(a.expert == b.expert);
    CHECK(a.rowOffset == b.rowOffset);
    CHECK(a.rowCount == b.rowCount);
    CHECK(a.colOffset == b.colOffset);
    CHECK(a.colCount == b.colCount);
    CHECK(a.tileM == b.tileM);
    CHECK(a.tileN == b.tileN);
    CHECK(a.tileK == b.tileK);
    CHECK(a.outputSlot == b.outputSlot);
    CHECK(a.lda == b.lda);
    CHECK(a.ldb == b.ldb);
    CHECK(a.ldc == b.ldc);
    for (unsigned k = 0; k < kMaxTilingInputs; ++k)
      CHECK(a.inputSlots[k] == b.inputSlots[k]);
  }
  CHECK(read.tilings[0].expert == kNone);
  CHECK(read.tilings[2].expert == 1);
  REQUIRE(read.events.size() == 2);
  for (size_t i = 0; i < read.events.size(); ++i) {
    CHECK(read.name(read.events[i].name) == program.name(program.events[i].name));
    CHECK(read.events[i].kind == program.events[i].kind);
    CHECK(read.events[i].op == program.events[i].op);
    CHECK(read.events[i].threshold == program.events[i].threshold);
  }
  REQUIRE(read.tasks.size() == 4);
  for (size_t i = 0; i < read.tasks.size(); ++i) {
    const TaskRecord &a = read.tasks[i], &b = program.tasks[i];
    CHECK(a.op == b.op);
    CHECK(a.tiling == b.tiling);
    CHECK(a.firstWait == b.firstWait);
    CHECK(a.waitCount == b.waitCount);
    CHECK(a.firstSignal == b.firstSignal);
    CHECK(a.signalCount == b.signalCount);
    CHECK(a.coreKind == b.coreKind);
  }
  REQUIRE(read.waits.size() == 2);
  for (size_t i = 0; i < read.waits.size(); ++i) {
    CHECK(read.waits[i].event == program.waits[i].event);
    CHECK(read.waits[i].threshold == program.waits[i].threshold);
  }
  REQUIRE(read.signals.size() == 6);
  for (size_t i = 0; i < read.signals.size(); ++i) {
    CHECK(read.signals[i].event == program.signals[i].event);
    CHECK(read.signals[i].increment == program.signals[i].increment);
    CHECK(read.signals[i].peerOffset == program.signals[i].peerOffset);
  }
  REQUIRE(read.queues.size() == 2);
  for (size_t i = 0; i < read.queues.size(); ++i) {
    CHECK(read.queues[i].coreKind == program.queues[i].coreKind);
    CHECK(read.queues[i].coreIndex == program.queues[i].coreIndex);
    CHECK(read.queues[i].firstEntry == program.queues[i].firstEntry);
    CHECK(read.queues[i].entryCount == program.queues[i].entryCount);
  }
  CHECK(read.queueEntries == program.queueEntries);

  // The same program always gives the same bytes.
  CHECK(writeTaskBinary(read) == bytes);
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
  TaskProgram program;
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  CHECK(bytes.size() == 64 + kSectionKindCount * sizeof(SectionEntry));
  CHECK(readOk(bytes) == program);
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
        refused + ": task 2: wait 0 names event 900, but the binary has 2 events");
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

  TaskProgram program = smallProgram();
  program.flags = 0x10 | kFlagBackward;
  CHECK(contentError(program) == "header: unknown flag bits 0x10");
  program = smallProgram();
  program.epRanks = 0;
  CHECK(contentError(program) == "header: the EP group has 0 ranks");
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
                              std::to_string(table[slots].offset + 8) + ", 32 bytes)");
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
          "the section table (offset 64, 240 bytes) overlaps section 'ops' (offset 256, 32 bytes)");
  }
  SECTION("inside the header") {
    std::vector<uint8_t> b = bytes;
    put<uint64_t>(b, opsOffsetField, 16);
    fixHeader(b);
    CHECK(readError(b) == "section 'ops' (offset 16, 32 bytes) starts inside the 64-byte header");
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
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, recordSize), 20);
    fixHeader(b);
    CHECK(readError(b) == "section 'ops': record size 20, but version 1 ops records are 16 bytes");
  }
  SECTION("empty sections may sit anywhere past the header") {
    TaskProgram program = smallProgram();
    program.tilings.clear();
    for (TaskRecord &task : program.tasks)
      task.tiling = kNone;
    std::vector<uint8_t> b = writeTaskBinary(program);
    size_t tilings = entryIndexOf(b, SectionKind::Tilings);
    put<uint64_t>(b, entryOffset(b, tilings) + offsetof(SectionEntry, offset),
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
        "section 'tasks': 4611686018427387904 records of 28 bytes overflow a 64-bit size");
  put<uint64_t>(b, countField, ~uint64_t(0));
  fixHeader(b);
  CHECK(readError(b) ==
        "section 'tasks': 18446744073709551615 records of 28 bytes overflow a 64-bit size");

  put<uint64_t>(b, countField, uint64_t(1) << 33);
  fixHeader(b);
  CHECK(readError(b) == "section 'tasks' has 8589934592 records; indices are 32-bit, so a section "
                        "holds at most 4294967295");

  put<uint64_t>(b, countField, 1000000);
  fixHeader(b);
  CHECK(readError(b) == "truncated: section 'tasks' (offset " + std::to_string(tasksOffset) +
                            ", 28000000 bytes) ends past the end of the " +
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
    CHECK(contentError(p) == "task 2: wait 0 names event 900, but the binary has 2 events");
  }
  SECTION("event in a signal") {
    p.signals[3].event = 2;
    CHECK(contentError(p) == "task 1: signal 1 names event 2, but the binary has 2 events");
  }
  SECTION("event in a wait no task uses") {
    p.waits.push_back({7, 0});
    CHECK(contentError(p) == "wait 2 names event 7, but the binary has 2 events");
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
  }
  SECTION("task in a queue") {
    p.queueEntries[3] = 17;
    CHECK(contentError(p) ==
          "queue 1 (cube core 0): entry 1 names task 17, but the binary has 4 tasks");
  }
  SECTION("task in a queue entry no queue uses") {
    p.queueEntries.push_back(4);
    CHECK(contentError(p) == "queue entry 4 names task 4, but the binary has 4 tasks");
  }
  SECTION("tiling in a task") {
    p.tasks[3].tiling = 3;
    CHECK(contentError(p) == "task 3: names tiling 3, but the binary has 3 tilings");
  }
  SECTION("op in a task") {
    p.tasks[0].op = 2;
    CHECK(contentError(p) ==
          "op 0 'dispatch': its task range [0, 2) holds task 0, which names op 2");
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
    p.tasks[3].firstWait = 1;
    p.tasks[3].waitCount = 2;
    CHECK(contentError(p) == "task 3: waits [1, 3) run past the 2 waits of the binary");
  }
  SECTION("a task's signal range, without overflowing") {
    p.tasks[0].firstSignal = 0xFFFFFFFFu;
    p.tasks[0].signalCount = 2;
    CHECK(contentError(p) ==
          "task 0: signals [4294967295, 4294967297) run past the 6 signals of the binary");
  }
  SECTION("an op's task range") {
    p.ops[1].taskCount = 3;
    CHECK(contentError(p) == "op 1 'up_proj': tasks [2, 5) run past the 4 tasks of the binary");
  }
  SECTION("a queue's entry range") {
    p.queues[1].entryCount = 5;
    CHECK(contentError(p) ==
          "queue 1 (cube core 0): entries [2, 7) run past the 4 queue entries of the binary");
  }
  SECTION("an expert") {
    p.tilings[2].expert = 2;
    CHECK(contentError(p) == "tiling 2: expert 2 is not below the 2 local experts");
  }
  SECTION("a peer offset") {
    p.signals[1].peerOffset = 2;
    CHECK(contentError(p) ==
          "task 0: signal 1 goes to peer offset 2, but the EP group has 2 ranks");
  }
}

TEST_CASE("enum values and reserved bytes", "[task-binary][errors]") {
  TaskProgram p = smallProgram();
  SECTION("op kind") {
    p.ops[0].kind = OpKind(9);
    CHECK(contentError(p) == "op 0 'dispatch': kind 9 is not an op kind (1..5)");
  }
  SECTION("dtype") {
    p.slots[0].dtype = DType(0);
    CHECK(contentError(p) ==
          "slot 0 'x': dtype 0 is not one of f32 (1), bf16 (2), i32 (3), i64 (4)");
  }
  SECTION("tiling dtype and op kind") {
    p.tilings[1].dtype = DType(5);
    CHECK(contentError(p) == "tiling 1: dtype 5 is not one of f32 (1), bf16 (2), i32 (3), i64 (4)");
    p = smallProgram();
    p.tilings[1].opKind = OpKind(0);
    CHECK(contentError(p) == "tiling 1: op kind 0 is not an op kind (1..5)");
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
    p.tilings[0].flags = 0x8;
    CHECK(contentError(p) == "tiling 0: unknown flag bits 0x8");
  }
  SECTION("reserved bytes") {
    p.tasks[2].reserved[1] = 1;
    CHECK(contentError(p) == "task 2: reserved bytes are not zero");
    p = smallProgram();
    p.signals[5].reserved = 3;
    CHECK(contentError(p) == "task 3: signal 0: reserved bytes are not zero");
    p = smallProgram();
    p.slots[3].reserved1 = 3;
    CHECK(contentError(p) == "slot 3 'y': reserved bytes are not zero");
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
  SECTION("a tiling for another op kind") {
    p.tasks[0].tiling = 1;
    CHECK(contentError(p) ==
          "task 0: tiling 1 is for a gmm op, but the task's op 0 'dispatch' is a dispatch op");
  }
  SECTION("a task in a queue of the other core kind") {
    p.tasks[1].coreKind = CoreKind::Cube;
    CHECK(contentError(p) == "queue 0 (vector core 0): entry 1 is task 1, a cube task");
  }
  SECTION("a task in two queues") {
    p.queueEntries = {0, 1, 2, 3, 1};
    p.queues.push_back({CoreKind::Vector, {}, 1, 4, 1});
    CHECK(contentError(p) ==
          "task 1 is in queue 0 (vector core 0) and again in queue 2 (vector core 1)");
  }
  SECTION("a task in no queue") {
    p.queues[1].entryCount = 1;
    CHECK(contentError(p) == "task 3 is in no queue");
  }
  SECTION("two queues for one core") {
    p.queues.push_back({CoreKind::Cube, {}, 0, 4, 0});
    CHECK(contentError(p) == "queue 2 (cube core 0): the same core as queue 1");
  }
  SECTION("a peer signal on a local event") {
    p.events[0].kind = EventKind::Local;
    CHECK(contentError(p) == "task 0: signal 1 goes to peer offset 1, but event 0 "
                             "'dispatch.rows_in' is a local event, not cross-rank");
  }
  SECTION("a wait beyond the event's final value") {
    p.waits[1].threshold = 5;
    CHECK(
        contentError(p) ==
        "task 3: wait 0 waits for event 0 'dispatch.rows_in' to reach 5, but its final value is 4");
  }
  SECTION("a threshold that the signals do not add up to") {
    p.events[1].threshold = 3;
    CHECK(contentError(p) == "event 1 'done': its signals add up to 2, but its threshold is 3");
  }
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

/// A program of `taskCount` tasks shaped like a real one: half dispatch
/// tasks on 48 vector queues, each signalling one of 1000 cross-rank events;
/// half gmm tasks on 24 cube queues, each waiting for one of those events
/// and signalling the terminate event. Every task has its own tiling.
TaskProgram largeProgram(uint32_t taskCount) {
  TaskProgram p;
  p.epRanks = 8;
  p.localExperts = 4;
  uint32_t half = taskCount / 2;
  const uint32_t eventCount = 1000;
  SlotRecord slot;
  slot.name = p.addString("x");
  slot.rank = 1;
  slot.dims[0] = 1;
  p.slots.push_back(slot);
  p.ops.push_back({p.addString("dispatch"), OpKind::Dispatch, {}, 0, half});
  p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, half, half});
  for (uint32_t e = 0; e < eventCount; ++e)
    p.events.push_back(
        {p.addString("dispatch.rows_in." + std::to_string(e)), EventKind::CrossRank, {}, 0, 0});
  p.events.push_back({p.addString("done"), EventKind::Terminate, {}, 1, half});
  for (uint32_t t = 0; t < 2 * half; ++t) {
    bool isDispatch = t < half;
    TilingRecord tiling;
    tiling.opKind = isDispatch ? OpKind::Dispatch : OpKind::Gmm;
    tiling.inputCount = 1;
    tiling.inputSlots[0] = 0;
    tiling.outputSlot = 0;
    tiling.rowOffset = t;
    tiling.rowCount = 1;
    p.tilings.push_back(tiling);
    TaskRecord task;
    task.op = isDispatch ? 0 : 1;
    task.tiling = t;
    task.coreKind = isDispatch ? CoreKind::Vector : CoreKind::Cube;
    task.firstSignal = uint32_t(p.signals.size());
    task.signalCount = 1;
    if (isDispatch) {
      uint32_t event = t % eventCount;
      p.signals.push_back({event, 1, t % p.epRanks, 0});
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

  // Per task: a task (28), a tiling (96), a wait or none (8), a signal (16)
  // and a queue entry (4); a little for the events and the header besides.
  const size_t perTask = 28 + 96 + 8 + 16 + 4;
  INFO("10^5 tasks: " << largeBytes.size() << " bytes");
  CHECK(largeBytes.size() <= 100000 * perTask + 64 * 1024);
  CHECK(largeBytes.size() >= 100000 * (28 + 96 + 16 + 4));
  // Fifty times the tasks, about fifty times the bytes (the events, strings
  // and queues do not grow with the tasks).
  size_t fixed = smallBytes.size() - 2000 * (28 + 96 + 16 + 4 + 4);
  CHECK(largeBytes.size() - fixed <= 50 * (smallBytes.size() - fixed) + 1024);
  CHECK(largeBytes.size() - fixed + 1024 >= 50 * (smallBytes.size() - fixed));
  // Smaller than the seed's fixed 15 MB runtime struct, at 10^5 tasks.
  CHECK(largeBytes.size() < 15u * 1024 * 1024);

  TaskProgram read = readOk(largeBytes);
  CHECK(read == large);
}

} // namespace
