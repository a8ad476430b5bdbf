//===- SafetensorsFuzz.cpp - libFuzzer target for safetensors headers -----===//
//
// Feeds arbitrary bytes to the safetensors header checker as a whole file:
// the 8-byte length field (checkHeaderLength against the input's size), the
// header (parseHeader over the data area that follows it). It must return an
// error with a message, or tensors that tile the data area exactly, each as
// long as its shape says, in offset order, whose normalized JSON parses
// back; and never crash, hang or read out of bounds.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/Safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <string_view>

using namespace moec::safetensors;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint64_t length = 0;
  for (size_t i = 0; i < kLengthBytes && i < size; ++i)
    length |= uint64_t(data[i]) << (8 * i);
  moec::Status status = checkHeaderLength(length, size);
  if (!status) {
    if (status.message().empty())
      std::abort();
    return 0;
  }
  const uint64_t dataBytes = size - kLengthBytes - length;
  Header header;
  status = parseHeader(
      std::string_view(reinterpret_cast<const char *>(data) + kLengthBytes, size_t(length)),
      dataBytes, &header);
  if (!status) {
    if (status.message().empty() || !header.tensors.empty())
      std::abort();
    return 0;
  }
  uint64_t at = 0;
  for (const TensorEntry &t : header.tensors) {
    if (t.begin != at || t.end < t.begin)
      std::abort();
    uint64_t bytes = dtypeSize(t.dtype);
    for (int64_t extent : t.shape) {
      if (extent < 0)
        std::abort();
      bytes *= uint64_t(extent); // checked not to overflow unless an extent is 0
    }
    if (bytes != t.end - t.begin)
      std::abort();
    at = t.end;
  }
  if (at != dataBytes)
    std::abort();
  const nlohmann::json normalized = nlohmann::json::parse(headerToJson(header));
  if (normalized["tensors"].size() != header.tensors.size())
    std::abort();
  return 0;
}
