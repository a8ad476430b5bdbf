//===- ReadTaskBinaryFuzz.cpp - libFuzzer target for readTaskBinary -------===//
//
// Feeds arbitrary bytes to the task binary reader. The reader must return an
// error or a program that passes validation, and never crash, hang, read out
// of bounds or allocate more than the input justifies. Random bytes almost
// never carry a matching CRC-32, so each input is also read with the
// checksum check off, which lets the fuzzer reach the section table and
// content checks. A program the reader accepts must come back unchanged
// from a write and a read (compared as programs: an accepted file may lay
// its sections out differently from the writer).
//
//   clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I. \
//     tests/fuzz/ReadTaskBinaryFuzz.cpp format/TaskBinary.cpp \
//     format/Crc32.cpp -lfmt -o read_task_binary_fuzz
//
//===----------------------------------------------------------------------===//

#include "format/TaskBinary.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

using moec::Status;
using moec::format::ReadOptions;
using moec::format::TaskProgram;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  TaskProgram program;
  Status status = moec::format::readTaskBinary(data, size, &program);
  if (status.ok()) {
    if (!moec::format::validateTaskProgram(program).ok())
      std::abort();
    std::vector<uint8_t> again = moec::format::writeTaskBinary(program);
    TaskProgram reread;
    if (!moec::format::readTaskBinary(again.data(), again.size(), &reread).ok() ||
        reread != program)
      std::abort();
  } else if (status.message().empty()) {
    std::abort();
  }

  ReadOptions options;
  options.verifyChecksum = false;
  TaskProgram unchecked;
  Status uncheckedStatus = moec::format::readTaskBinary(data, size, &unchecked, options);
  if (uncheckedStatus.ok()) {
    std::vector<uint8_t> again = moec::format::writeTaskBinary(unchecked);
    TaskProgram reread;
    if (!moec::format::readTaskBinary(again.data(), again.size(), &reread).ok() ||
        reread != unchecked)
      std::abort();
  }
  return 0;
}
