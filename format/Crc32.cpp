//===- Crc32.cpp - CRC-32 (IEEE 802.3) ------------------------------------===//
//
// Slicing-by-4 over four 256-entry tables built at compile time.
//
//===----------------------------------------------------------------------===//

#include "format/Crc32.h"

#include <array>

namespace moec::format {
namespace {

constexpr uint32_t kPolynomial = 0xEDB88320u;

using Tables = std::array<std::array<uint32_t, 256>, 4>;

/// Builds the tables: tables[0] is the classic byte-at-a-time table, and
/// tables[k][b] is the CRC of byte b followed by k zero bytes.
constexpr Tables makeTables() {
  Tables tables{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit)
      crc = (crc & 1) ? (crc >> 1) ^ kPolynomial : crc >> 1;
    tables[0][byte] = crc;
  }
  for (uint32_t byte = 0; byte < 256; ++byte)
    for (int k = 1; k < 4; ++k)
      tables[k][byte] = (tables[k - 1][byte] >> 8) ^ tables[0][tables[k - 1][byte] & 0xFF];
  return tables;
}

constexpr Tables kTables = makeTables();

} // namespace

uint32_t crc32(const uint8_t *data, size_t size, uint32_t crc) {
  crc = ~crc;
  while (size >= 4) {
    crc ^= uint32_t(data[0]) | uint32_t(data[1]) << 8 | uint32_t(data[2]) << 16 |
           uint32_t(data[3]) << 24;
    crc = kTables[3][crc & 0xFF] ^ kTables[2][(crc >> 8) & 0xFF] ^ kTables[1][(crc >> 16) & 0xFF] ^
          kTables[0][crc >> 24];
    data += 4;
    size -= 4;
  }
  for (; size > 0; --size, ++data)
    crc = (crc >> 8) ^ kTables[0][(crc ^ *data) & 0xFF];
  return ~crc;
}

uint32_t crc32Zeros(size_t size, uint32_t crc) {
  static constexpr uint8_t kZeros[64] = {};
  while (size > 0) {
    size_t chunk = size < sizeof(kZeros) ? size : sizeof(kZeros);
    crc = crc32(kZeros, chunk, crc);
    size -= chunk;
  }
  return crc;
}

} // namespace moec::format
