//===- NpyFuzz.cpp - libFuzzer target for the .npy reader -------------------===//
//
// Feeds arbitrary bytes to parseNpy. It must return an error with a message
// or an array whose element count matches its shape and its bytes, and never
// crash, hang, read out of bounds or allocate more than the input justifies.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/Npy.h"

#include <cstdint>
#include <cstdlib>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  std::vector<uint8_t> bytes(data, data + size);
  moec::npy::NpyArray array;
  moec::Status status = moec::npy::parseNpy(bytes, &array);
  if (!status) {
    if (status.message().empty())
      std::abort();
    return 0;
  }
  for (int64_t d : array.shape)
    if (d < 0)
      std::abort();
  if (size_t(array.elements()) * array.elementSize() != array.data.size())
    std::abort();
  return 0;
}
