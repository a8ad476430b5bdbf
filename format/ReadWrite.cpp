//===- ReadWrite.cpp - The task binary's bytes: writer and reader ---------===//
//
// The records in TaskBinary.h are the file's bytes, so writing a section is
// one memcpy and reading it another, after the reader has checked the
// header, the section table and every section's extent (and before it
// validates the content, Validate.cpp). That needs a little-endian host,
// which every supported one is (TaskBinary.cpp checks).
//
//===----------------------------------------------------------------------===//

#include "format/TaskBinary.h"

#include "base/File.h"
#include "base/Names.h"

#include "format/Crc32.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

namespace moec::format {

//===----------------------------------------------------------------------===//
// Section layout shared by the writer and the reader
//===----------------------------------------------------------------------===//

namespace {

/// Returns the record size of a section kind, or 0 for an unknown kind.
uint32_t recordSizeOf(SectionKind kind) {
  switch (kind) {
  case SectionKind::Strings:
    return 1;
  case SectionKind::Slots:
    return sizeof(SlotRecord);
  case SectionKind::Ops:
    return sizeof(OpRecord);
  case SectionKind::Tilings:
    return sizeof(TilingRecord);
  case SectionKind::Events:
    return sizeof(EventRecord);
  case SectionKind::Tasks:
    return sizeof(TaskRecord);
  case SectionKind::Waits:
    return sizeof(WaitRecord);
  case SectionKind::Signals:
    return sizeof(SignalRecord);
  case SectionKind::Queues:
    return sizeof(QueueRecord);
  case SectionKind::QueueEntries:
    return sizeof(uint32_t);
  case SectionKind::Layer:
    return sizeof(LayerRecord);
  }
  return 0;
}

/// A section's bytes in memory, for the writer.
struct SectionData {
  SectionKind kind;
  const void *data;
  uint64_t count;
};

/// Returns the sections of `program` in SectionKind order.
std::vector<SectionData> sectionsOf(const TaskProgram &program) {
  return {{SectionKind::Strings, program.strings.data(), program.strings.size()},
          {SectionKind::Slots, program.slots.data(), program.slots.size()},
          {SectionKind::Ops, program.ops.data(), program.ops.size()},
          {SectionKind::Tilings, program.tilings.data(), program.tilings.size()},
          {SectionKind::Events, program.events.data(), program.events.size()},
          {SectionKind::Tasks, program.tasks.data(), program.tasks.size()},
          {SectionKind::Waits, program.waits.data(), program.waits.size()},
          {SectionKind::Signals, program.signals.data(), program.signals.size()},
          {SectionKind::Queues, program.queues.data(), program.queues.size()},
          {SectionKind::QueueEntries, program.queueEntries.data(), program.queueEntries.size()},
          {SectionKind::Layer, program.layer ? &*program.layer : nullptr,
           program.layer ? 1u : 0u}};
}

/// Rounds `value` up to a multiple of kSectionAlignment.
uint64_t alignUp(uint64_t value) {
  return (value + kSectionAlignment - 1) / kSectionAlignment * kSectionAlignment;
}

constexpr size_t kCrcOffset = offsetof(FileHeader, crc32);

} // namespace

uint32_t taskBinaryChecksum(const uint8_t *data, size_t size) {
  if (size < sizeof(FileHeader))
    return crc32(data, size);
  uint32_t crc = crc32(data, kCrcOffset);
  crc = crc32Zeros(sizeof(uint32_t), crc);
  size_t rest = kCrcOffset + sizeof(uint32_t);
  return crc32(data + rest, size - rest, crc);
}

//===----------------------------------------------------------------------===//
// Writer
//===----------------------------------------------------------------------===//

std::vector<uint8_t> writeTaskBinary(const TaskProgram &program) {
  std::vector<SectionData> sections = sectionsOf(program);
  std::vector<SectionEntry> table(sections.size());

  uint64_t tableOffset = alignUp(sizeof(FileHeader));
  uint64_t offset = alignUp(tableOffset + table.size() * sizeof(SectionEntry));
  for (size_t i = 0; i < sections.size(); ++i) {
    SectionEntry &entry = table[i];
    entry.kind = uint32_t(sections[i].kind);
    entry.recordSize = recordSizeOf(sections[i].kind);
    entry.offset = offset;
    entry.count = sections[i].count;
    offset = alignUp(offset + entry.count * entry.recordSize);
  }

  std::vector<uint8_t> file(offset, 0);
  FileHeader header;
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.version = kFormatVersion;
  header.flags = program.flags;
  header.fileSize = file.size();
  header.epRanks = program.epRanks;
  header.tpRanks = program.tpRanks;
  header.localExperts = program.localExperts;
  header.target = program.target;
  header.notes = program.notes;
  header.sectionCount = uint32_t(table.size());
  header.sectionTableOffset = tableOffset;
  std::memcpy(file.data(), &header, sizeof(header));
  std::memcpy(file.data() + tableOffset, table.data(), table.size() * sizeof(SectionEntry));
  for (size_t i = 0; i < sections.size(); ++i)
    if (table[i].count != 0)
      std::memcpy(file.data() + table[i].offset, sections[i].data,
                  table[i].count * table[i].recordSize);

  uint32_t crc = taskBinaryChecksum(file.data(), file.size());
  std::memcpy(file.data() + kCrcOffset, &crc, sizeof(crc));
  return file;
}

Status writeTaskBinaryFile(const TaskProgram &program, const std::string &path) {
  if (Status status = validateTaskProgram(program); !status)
    return status.withPrefix(path + ": ");
  std::vector<uint8_t> bytes = writeTaskBinary(program);
  return writeFileAtomically(path, {{bytes.data(), bytes.size()}});
}

//===----------------------------------------------------------------------===//
// Reader
//===----------------------------------------------------------------------===//

namespace {

/// Returns "section 'tasks' (offset 4096, 24000 bytes)".
std::string describeSection(SectionKind kind, uint64_t offset, uint64_t bytes) {
  return fmt::format("section '{}' (offset {}, {} bytes)", sectionKindName(kind), offset, bytes);
}

/// Returns "the section table (offset 64, 240 bytes)".
std::string describeTable(uint64_t offset, uint64_t bytes) {
  return fmt::format("the section table (offset {}, {} bytes)", offset, bytes);
}

/// Computes count * recordSize into *bytes; returns false on overflow.
bool sectionBytes(const SectionEntry &entry, uint64_t *bytes) {
  return !__builtin_mul_overflow(entry.count, uint64_t(entry.recordSize), bytes);
}

/// Returns true when [offset, offset + bytes) ends past `size`.
bool endsPast(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset > size || bytes > size - offset;
}

/// The message for a file shorter than its header says. Names the first
/// section (by offset) that the cut leaves incomplete when the section
/// table is there to say so.
std::string truncationMessage(const uint8_t *data, size_t size, const FileHeader &header) {
  std::string said = fmt::format("(the header says the file has {} bytes)", header.fileSize);
  uint64_t tableBytes = uint64_t(header.sectionCount) * sizeof(SectionEntry);
  uint64_t tableOffset = header.sectionTableOffset;
  if (tableOffset >= sizeof(FileHeader) && tableOffset % kSectionAlignment == 0 &&
      !endsPast(tableOffset, tableBytes, header.fileSize)) {
    if (endsPast(tableOffset, tableBytes, size))
      return fmt::format("truncated: {} ends past the end of the {}-byte file {}",
                         describeTable(tableOffset, tableBytes), size, said);
    bool found = false;
    SectionEntry cut;
    uint64_t cutBytes = 0;
    for (uint32_t i = 0; i < header.sectionCount; ++i) {
      SectionEntry entry;
      std::memcpy(&entry, data + tableOffset + i * sizeof(SectionEntry), sizeof(entry));
      uint64_t bytes;
      if (recordSizeOf(SectionKind(entry.kind)) == 0 || !sectionBytes(entry, &bytes) ||
          bytes == 0 || !endsPast(entry.offset, bytes, size))
        continue;
      if (!found || entry.offset < cut.offset) {
        found = true;
        cut = entry;
        cutBytes = bytes;
      }
    }
    if (found)
      return fmt::format("truncated: {} ends past the end of the {}-byte file {}",
                         describeSection(SectionKind(cut.kind), cut.offset, cutBytes), size, said);
  }
  return fmt::format("truncated: the file has {} bytes, but the header says it has {}", size,
                     header.fileSize);
}

/// A section found in the table, for the overlap check.
struct Extent {
  uint64_t offset;
  uint64_t bytes;
  std::string what;
};

/// Checks the section table of a file whose header passed its checks, and
/// fills entries[kind - 1] with each section's entry.
Status checkSectionTable(const uint8_t *data, size_t size, const FileHeader &header,
                         SectionEntry entries[kSectionKindCount]) {
  uint64_t tableOffset = header.sectionTableOffset;
  uint64_t tableBytes = uint64_t(header.sectionCount) * sizeof(SectionEntry);
  if (tableOffset % kSectionAlignment != 0)
    return Status::error(fmt::format("the section table: offset {} is not {}-byte aligned",
                                     tableOffset, kSectionAlignment));
  if (tableOffset < sizeof(FileHeader))
    return Status::error(fmt::format("{} starts inside the {}-byte header",
                                     describeTable(tableOffset, tableBytes), sizeof(FileHeader)));
  if (endsPast(tableOffset, tableBytes, size))
    return Status::error(fmt::format("truncated: {} ends past the end of the {}-byte file",
                                     describeTable(tableOffset, tableBytes), size));

  std::vector<Extent> extents;
  extents.push_back({tableOffset, tableBytes, describeTable(tableOffset, tableBytes)});
  int firstEntryOf[kSectionKindCount];
  std::fill(firstEntryOf, firstEntryOf + kSectionKindCount, -1);
  for (uint32_t i = 0; i < header.sectionCount; ++i) {
    SectionEntry entry;
    std::memcpy(&entry, data + tableOffset + i * sizeof(SectionEntry), sizeof(entry));
    SectionKind kind = SectionKind(entry.kind);
    uint32_t expectedSize = recordSizeOf(kind);
    if (expectedSize == 0)
      return Status::error(
          fmt::format("section table entry {}: kind {} is not a section kind of version {}", i,
                      entry.kind, kFormatVersion));
    const char *name = sectionKindName(kind);
    if (firstEntryOf[entry.kind - 1] >= 0)
      return Status::error(
          fmt::format("section table entry {}: a second '{}' section (the first is entry {})", i,
                      name, firstEntryOf[entry.kind - 1]));
    firstEntryOf[entry.kind - 1] = int(i);
    if (entry.recordSize != expectedSize)
      return Status::error(
          fmt::format("section '{}': record size {}, but version {} {} records are {} bytes", name,
                      entry.recordSize, kFormatVersion, name, expectedSize));
    uint64_t bytes;
    if (!sectionBytes(entry, &bytes))
      return Status::error(
          fmt::format("section '{}': {} records of {} bytes overflow a 64-bit size", name,
                      entry.count, entry.recordSize));
    if (entry.count > kMaxRecords)
      return Status::error(fmt::format(
          "section '{}' has {} records; indices are 32-bit, so a section holds at most {}", name,
          entry.count, kMaxRecords));
    if (entry.offset % kSectionAlignment != 0)
      return Status::error(fmt::format("section '{}': offset {} is not {}-byte aligned", name,
                                       entry.offset, kSectionAlignment));
    if (entry.offset < sizeof(FileHeader))
      return Status::error(fmt::format("{} starts inside the {}-byte header",
                                       describeSection(kind, entry.offset, bytes),
                                       sizeof(FileHeader)));
    if (endsPast(entry.offset, bytes, size))
      return Status::error(fmt::format("truncated: {} ends past the end of the {}-byte file",
                                       describeSection(kind, entry.offset, bytes), size));
    if (bytes != 0)
      extents.push_back({entry.offset, bytes, describeSection(kind, entry.offset, bytes)});
    entries[entry.kind - 1] = entry;
  }
  for (uint32_t k = 0; k < kSectionKindCount; ++k)
    if (firstEntryOf[k] < 0)
      return Status::error(fmt::format("the section table has no '{}' section",
                                       sectionKindName(SectionKind(k + 1))));

  std::sort(extents.begin(), extents.end(),
            [](const Extent &a, const Extent &b) { return a.offset < b.offset; });
  for (size_t i = 1; i < extents.size(); ++i)
    if (extents[i].offset < extents[i - 1].offset + extents[i - 1].bytes)
      return Status::error(fmt::format("{} overlaps {}", extents[i - 1].what, extents[i].what));
  return Status::success();
}

/// Copies the records of one section into `records`.
template <typename T>
void copySection(const uint8_t *data, const SectionEntry &entry, std::vector<T> *records) {
  records->resize(size_t(entry.count));
  if (entry.count != 0)
    std::memcpy(records->data(), data + entry.offset, size_t(entry.count) * sizeof(T));
}

} // namespace

Status readTaskBinary(const uint8_t *data, size_t size, TaskProgram *out) {
  return readTaskBinary(data, size, out, ReadOptions());
}

Status readTaskBinary(const uint8_t *data, size_t size, TaskProgram *out,
                      const ReadOptions &options) {
  if (size != 0 && !data)
    return Status::error("no data (a null pointer)");
  if (std::memcmp(data ? data : reinterpret_cast<const uint8_t *>(""), kMagic,
                  std::min(size, sizeof(kMagic))) != 0)
    return Status::error("not a moec task binary (bad magic)");
  if (size < sizeof(FileHeader))
    return Status::error(
        fmt::format("truncated: the file has {} bytes, less than the {}-byte header", size,
                    sizeof(FileHeader)));
  FileHeader header;
  std::memcpy(&header, data, sizeof(header));
  if (header.version != kFormatVersion)
    return Status::error(
        fmt::format("format version {} is not supported (this reader reads version {}){}",
                    header.version, kFormatVersion,
                    header.version >= 1 && header.version < kFormatVersion
                        ? "; compile the graph again with this moec (version 2 added the layer "
                          "record, version 3 a GMM's low-rank product, version 4 lead products)"
                        : ""));
  if (header.fileSize > size)
    return Status::error(truncationMessage(data, size, header));
  if (header.fileSize < size)
    return Status::error(
        fmt::format("file size mismatch: the header says {} bytes, but the file has {}",
                    header.fileSize, size));
  if (options.verifyChecksum) {
    uint32_t crc = taskBinaryChecksum(data, size);
    if (crc != header.crc32)
      return Status::error(fmt::format("bad checksum: header says {:#010x}, content gives {:#010x}",
                                       header.crc32, crc));
  }
  if (header.reserved != 0)
    return Status::error("header: reserved bytes are not zero");
  if (header.sectionCount != kSectionKindCount)
    return Status::error(fmt::format("header: the section table has {} entries; version {} has {}",
                                     header.sectionCount, kFormatVersion, kSectionKindCount));

  SectionEntry entries[kSectionKindCount];
  if (Status status = checkSectionTable(data, size, header, entries); !status)
    return status;

  auto entryOf = [&](SectionKind kind) -> const SectionEntry & {
    return entries[uint32_t(kind) - 1];
  };
  TaskProgram program;
  program.flags = header.flags;
  program.epRanks = header.epRanks;
  program.tpRanks = header.tpRanks == 0 ? 1 : header.tpRanks;
  program.localExperts = header.localExperts;
  program.target = header.target;
  program.notes = header.notes;
  const SectionEntry &strings = entryOf(SectionKind::Strings);
  program.strings.assign(reinterpret_cast<const char *>(data + strings.offset),
                         size_t(strings.count));
  copySection(data, entryOf(SectionKind::Slots), &program.slots);
  copySection(data, entryOf(SectionKind::Ops), &program.ops);
  copySection(data, entryOf(SectionKind::Tilings), &program.tilings);
  copySection(data, entryOf(SectionKind::Events), &program.events);
  copySection(data, entryOf(SectionKind::Tasks), &program.tasks);
  copySection(data, entryOf(SectionKind::Waits), &program.waits);
  copySection(data, entryOf(SectionKind::Signals), &program.signals);
  copySection(data, entryOf(SectionKind::Queues), &program.queues);
  copySection(data, entryOf(SectionKind::QueueEntries), &program.queueEntries);
  const SectionEntry &layer = entryOf(SectionKind::Layer);
  if (layer.count > 1)
    return Status::error(fmt::format("section 'layer' has {} records; a program has at most one",
                                     layer.count));
  if (layer.count == 1) {
    program.layer.emplace();
    std::memcpy(&*program.layer, data + layer.offset, sizeof(LayerRecord));
  }

  if (Status status = validateTaskProgram(program); !status)
    return status;
  *out = std::move(program);
  return Status::success();
}

Status loadTaskBinaryFile(const std::string &path, TaskProgram *out) {
  if (path == "-")
    return Status::error("-: a task binary is read from a file, not from standard input");
  // The header first: a file longer than it says (bytes appended, a sparse
  // tail of gigabytes) is refused before the rest is read.
  std::vector<uint8_t> bytes;
  uint64_t fileSize = 0;
  if (Status s = readFileHead(path, sizeof(FileHeader), &bytes, &fileSize); !s)
    return s;
  if (bytes.size() == sizeof(FileHeader) && std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) == 0) {
    FileHeader header;
    std::memcpy(&header, bytes.data(), sizeof(header));
    if (header.version == kFormatVersion && header.fileSize < fileSize)
      return Status::error(
          fmt::format("{}: file size mismatch: the header says {} bytes, but the file has {}",
                      path, header.fileSize, fileSize));
  }
  if (Status s = readWholeFile(path, &bytes, std::max<uint64_t>(fileSize, sizeof(FileHeader))); !s)
    return s;
  return readTaskBinary(bytes.data(), bytes.size(), out).withPrefix(path + ": ");
}

} // namespace moec::format
