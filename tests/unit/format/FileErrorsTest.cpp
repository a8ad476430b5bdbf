//===- FileErrorsTest.cpp - The reader's refusals of a damaged file -------===//
//
// What the reader refuses before it looks at the records' content: the
// header (magic, version, checksum, size, fields, target), truncation, the
// section table (alignment, overlaps, placement, counts); a failed read leaves
// its output alone, and every single-byte change is caught.
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
  CHECK(readError(bytes) == "format version 7 is not supported (this reader reads version 4)");
  fixHeader(bytes);
  CHECK(readError(bytes) == "format version 7 is not supported (this reader reads version 4)");
  put<uint32_t>(bytes, offsetof(FileHeader, version), 1);
  CHECK(readError(bytes) == "format version 1 is not supported (this reader reads version 4); "
                            "compile the graph again with this moec (version 2 added the layer "
                            "record, version 3 a GMM's low-rank product, version 4 lead "
                            "products)");
  put<uint32_t>(bytes, offsetof(FileHeader, version), 0);
  CHECK(readError(bytes) == "format version 0 is not supported (this reader reads version 4)");
}

TEST_CASE("a second layer record", "[task-binary][errors][layer]") {
  // The layer section is the last: a copy of its record appended, and the
  // section's count made 2, gives a file whose every extent is sound.
  std::vector<uint8_t> bytes = writeTaskBinary(smallProgram());
  const size_t index = entryIndexOf(bytes, SectionKind::Layer);
  const SectionEntry layer = sectionTableOf(bytes)[index];
  REQUIRE(layer.count == 1);
  REQUIRE(layer.offset + sizeof(LayerRecord) == bytes.size());
  std::vector<uint8_t> record(bytes.begin() + layer.offset, bytes.end());
  bytes.insert(bytes.end(), record.begin(), record.end());
  put<uint64_t>(bytes, entryOffset(bytes, index) + offsetof(SectionEntry, count), 2);
  fixHeader(bytes);
  CHECK(readError(bytes) == "section 'layer' has 2 records; a program has at most one");
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
  put<uint32_t>(reserved, offsetof(FileHeader, reserved), 1);
  fixHeader(reserved);
  CHECK(readError(reserved) == "header: reserved bytes are not zero");

  std::vector<uint8_t> count = bytes;
  put<uint32_t>(count, offsetof(FileHeader, sectionCount), 9);
  fixHeader(count);
  CHECK(readError(count) == "header: the section table has 9 entries; version 4 has 11");

  std::vector<uint8_t> lastReserved = bytes;
  put<uint32_t>(lastReserved, offsetof(FileHeader, reserved), 0x100);
  fixHeader(lastReserved);
  CHECK(readError(lastReserved) == "header: reserved bytes are not zero");

  // Notes: named only with their flag, and at a name of the string table.
  std::vector<uint8_t> notes = bytes;
  put<uint32_t>(notes, offsetof(FileHeader, notes), 1);
  fixHeader(notes);
  CHECK(readError(notes) == "header: notes are named without the notes flag");
  TaskProgram noted = smallProgram();
  noted.flags |= kFlagNotes;
  noted.notes = uint32_t(noted.strings.size() + 5);
  CHECK(readError(writeTaskBinary(noted)).find("header: notes: name offset") == 0);
  noted.notes = 0;
  noted.notes = noted.addString("automatic splits: one candidate");
  TaskProgram back;
  const std::vector<uint8_t> notedBytes = writeTaskBinary(noted);
  REQUIRE(readTaskBinary(notedBytes.data(), notedBytes.size(), &back).ok());
  CHECK(back.name(back.notes) == "automatic splits: one candidate");

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
        "truncated: the section table (offset 64, 264 bytes) ends past the end of the " +
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
          "the section table (offset 64, 264 bytes) overlaps section 'ops' (offset 256, 48 bytes)");
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
          "the section table (offset 8, 264 bytes) starts inside the 64-byte header");
    put<uint64_t>(b, offsetof(FileHeader, sectionTableOffset), 68);
    fixHeader(b);
    CHECK(readError(b) == "the section table: offset 68 is not 8-byte aligned");
  }
  SECTION("an unknown kind, a duplicate kind, a wrong record size") {
    std::vector<uint8_t> b = bytes;
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, kind), 42);
    fixHeader(b);
    CHECK(readError(b) == "section table entry " + std::to_string(ops) +
                              ": kind 42 is not a section kind of version 4");
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, kind),
                  uint32_t(SectionKind::Slots));
    fixHeader(b);
    CHECK(readError(b) == "section table entry " + std::to_string(ops) +
                              ": a second 'slots' section (the first is entry " +
                              std::to_string(slots) + ")");
    b = bytes;
    put<uint32_t>(b, entryOffset(b, ops) + offsetof(SectionEntry, recordSize), 16);
    fixHeader(b);
    CHECK(readError(b) == "section 'ops': record size 16, but version 4 ops records are 24 bytes");
    b = bytes;
    size_t tilings = entryIndexOf(b, SectionKind::Tilings);
    put<uint32_t>(b, entryOffset(b, tilings) + offsetof(SectionEntry, recordSize), 88);
    fixHeader(b);
    CHECK(readError(b) ==
          "section 'tilings': record size 88, but version 4 tilings records are 104 bytes");
    b = bytes;
    size_t tasks = entryIndexOf(b, SectionKind::Tasks);
    put<uint32_t>(b, entryOffset(b, tasks) + offsetof(SectionEntry, recordSize), 28);
    fixHeader(b);
    CHECK(readError(b) ==
          "section 'tasks': record size 28, but version 4 tasks records are 24 bytes");
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
  CHECK(readError(b) == "truncated: the section table (offset 18446744073709551608, 264 bytes) "
                        "ends past the end of the " +
                            std::to_string(b.size()) + "-byte file");
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

} // namespace
