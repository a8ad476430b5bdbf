//===- RecordLayoutTest.cpp - The bytes of a task binary ------------------===//
//
// The CRC-32, the records' sizes and field offsets, and the writer putting
// each field where binary-format.md says.
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
  CHECK(offsetof(FileHeader, notes) == 56);
  CHECK(offsetof(FileHeader, reserved) == 60);

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

  CHECK(sizeof(TilingRecord) == 104);
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
  CHECK(offsetof(TilingRecord, lowRankSlots) == 96);

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
  CHECK(table[entryIndexOf(bytes, SectionKind::Tilings)].recordSize == 104);
  uint64_t gmm = tilings + 104;
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
  CHECK(u32At(gmm + 92) == 0);  // scale
  CHECK(u32At(gmm + 96) == kNone); // lowRankSlots
  CHECK(u32At(gmm + 100) == kNone);

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

} // namespace
