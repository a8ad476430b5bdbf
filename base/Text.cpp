//===- Text.cpp - Checks of text read from files --------------------------===//

#include "base/Text.h"

namespace moec {

size_t firstNonUtf8(std::string_view text) {
  const auto *s = reinterpret_cast<const unsigned char *>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t length;
    unsigned char lo = 0x80, hi = 0xBF; // the range of the second byte
    if (c >= 0xC2 && c <= 0xDF)
      length = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0)
        lo = 0xA0; // overlong
      else if (c == 0xED)
        hi = 0x9F; // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0)
        lo = 0x90; // overlong
      else if (c == 0xF4)
        hi = 0x8F; // past U+10FFFF
    } else
      return i;
    if (i + length > n || s[i + 1] < lo || s[i + 1] > hi)
      return i;
    for (size_t k = 2; k < length; ++k)
      if (s[i + k] < 0x80 || s[i + k] > 0xBF)
        return i;
    i += length;
  }
  return std::string_view::npos;
}

size_t firstControlCharacter(std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i)
    if (static_cast<unsigned char>(text[i]) < 0x20 || text[i] == 0x7f)
      return i;
  return std::string_view::npos;
}

} // namespace moec
