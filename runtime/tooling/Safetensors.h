//===- Safetensors.h - The header of a safetensors file --------*- C++ -*-===//
//
// Hugging Face checkpoints are safetensors files: an 8-byte little-endian
// header length N, N bytes of UTF-8 JSON, then the data area, the tensors'
// bytes row-major and little-endian. The header is an object
//
//   {"NAME": {"dtype": "F32", "shape": [2, 3], "data_offsets": [BEGIN, END]},
//    ...,
//    "__metadata__": {"format": "pt"}}
//
// whose offsets count from the first byte after the header. `__metadata__`
// is optional and maps strings to strings; the header may end in spaces.
// The tensors' byte ranges, in offset order, must tile the data area:
// the first begins at 0, each begins where the one before it ends, the last
// ends at the end of the data area, and each holds prod(shape) * itemsize
// bytes.
//
// This is the checker of that header, for the torch op library (which maps
// the data area itself) and any later reader: it takes the header's bytes
// and the size of the data area, and returns the tensors in offset order
// and the metadata, or an error that says what is wrong and, where one
// tensor is at fault, names it. Refused: a header over 100 MB; text that is
// not UTF-8 or not JSON (a key twice in one object included, which JSON
// parsers would otherwise settle by keeping one); anything but an object; a
// tensor entry with a missing, unknown or ill-typed field; an unknown
// dtype; a shape that is not a list of sizes, or whose byte count overflows;
// offsets that are not two sizes, end before they begin, run past the data
// area, overlap, or leave a gap (before the first tensor, between two, or
// after the last); bytes that disagree with shape * itemsize; metadata
// values that are not strings.
//
// Nothing here throws or exits; every call returns a Status whose message
// names no file (the caller prefixes the path).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TOOLING_SAFETENSORS_H
#define MOEC_RUNTIME_TOOLING_SAFETENSORS_H

#include "base/Status.h"

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace moec::safetensors {

/// The element types a safetensors file may hold here, by their names in
/// the file. F8_E4M3 is the e4m3fn float8 (bias 7, no infinities).
enum class Dtype : uint8_t { F64, F32, F16, BF16, F8_E4M3, I64, I32, I16, I8, U8, BOOL };

/// Returns the file's name of `dtype`: "F64", "BF16", "F8_E4M3", ...
const char *dtypeName(Dtype dtype);

/// Returns the size in bytes of one element of `dtype` (8, 4, 2 or 1).
size_t dtypeSize(Dtype dtype);

/// Sets *out to the Dtype named `name` ("F32") and returns true; false for
/// a name that is not one of them.
bool dtypeFromName(std::string_view name, Dtype *out);

/// The bytes of the length field that starts a file.
constexpr uint64_t kLengthBytes = 8;

/// The longest header read: the safetensors package's limit.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

/// One tensor of a header.
struct TensorEntry {
  /// Its name, the header's key.
  std::string name;
  /// Its element type.
  Dtype dtype = Dtype::F32;
  /// The extent of each dimension, outermost first (empty for a 0-d tensor).
  std::vector<int64_t> shape;
  /// Where its bytes begin and end in the data area; end - begin is
  /// prod(shape) * dtypeSize(dtype).
  uint64_t begin = 0;
  uint64_t end = 0;
};

/// A checked header.
struct Header {
  /// The tensors in offset order (ties, which only empty tensors can have,
  /// in name order).
  std::vector<TensorEntry> tensors;
  /// Whether the header has `__metadata__` (an absent one and a null one
  /// read the same).
  bool hasMetadata = false;
  /// Its entries.
  std::map<std::string, std::string> metadata;
};

/// Checks the length field of a file of `fileBytes` bytes, which says the
/// header is `headerBytes` long: the file holds the field and the header,
/// and the header is at most kMaxHeaderBytes. Errors: "N bytes, shorter
/// than the 8-byte header length", "a header of N bytes, over the
/// 100000000-byte limit", "a header of N bytes in a file of M (truncated, or
/// not safetensors)". `fileBytes` under 8 ignores `headerBytes`.
Status checkHeaderLength(uint64_t headerBytes, uint64_t fileBytes);

/// Checks the header text `header` against a data area of `dataBytes` bytes
/// and sets *out (left as it was on an error). Errors say what is wrong,
/// naming the tensor at fault: "tensor 'w': unknown dtype 'C64' (known: ...)",
/// "tensor 'w': data_offsets [0, 400] run past the data area of 100 bytes
/// (a truncated file?)".
Status parseHeader(std::string_view header, uint64_t dataBytes, Header *out);

/// Reads the length field and the header of the open file `fd`, which holds
/// `fileBytes` bytes, with pread (the file offset is not moved), and checks
/// both (checkHeaderLength, parseHeader). Sets *dataStart to the offset of
/// the data area in the file (8 + N).
Status readHeader(int fd, uint64_t fileBytes, Header *out, uint64_t *dataStart);

/// Returns `header` as normalized JSON, compact:
/// {"tensors": [{"name", "dtype", "shape", "begin", "end"}, ...] in offset
/// order, "metadata": {...} or null}.
std::string headerToJson(const Header &header);

} // namespace moec::safetensors

#endif // MOEC_RUNTIME_TOOLING_SAFETENSORS_H
