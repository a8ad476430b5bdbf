//===- Crc32.h - CRC-32 (IEEE 802.3) ---------------------------*- C++ -*-===//
//
// The checksum of the task binary: CRC-32 with the IEEE polynomial
// (reflected 0xEDB88320, initial value and final xor 0xFFFFFFFF), the one of
// zlib, PNG and Ethernet. crc32("123456789") == 0xCBF43926.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_FORMAT_CRC32_H
#define MOEC_FORMAT_CRC32_H

#include <cstddef>
#include <cstdint>

namespace moec::format {

/// Returns the CRC-32 of `size` bytes at `data`, continuing from `crc`, the
/// CRC-32 of the bytes before them (0 for none). Feeding a buffer in pieces
/// gives the CRC-32 of the whole: crc32(b, n2, crc32(a, n1)) is the CRC-32
/// of a followed by b. `data` may be null when `size` is 0.
uint32_t crc32(const uint8_t *data, size_t size, uint32_t crc = 0);

/// Returns the CRC-32 of `size` zero bytes appended to the bytes whose CRC-32
/// is `crc`.
uint32_t crc32Zeros(size_t size, uint32_t crc);

} // namespace moec::format

#endif // MOEC_FORMAT_CRC32_H
