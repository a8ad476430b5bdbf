//===- Text.h - Checks of text read from files ------------------*- C++ -*-===//
//
// Whether bytes a file gives as text are UTF-8 (the names in a graph and a
// task binary, a safetensors header: JSON writers refuse anything else, and
// a terminal shows it as garbage), and whether a name is printable.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_TEXT_H
#define MOEC_BASE_TEXT_H

#include <cstddef>
#include <string_view>

namespace moec {

/// Returns the offset of the first byte of `text` that is not part of a
/// well-formed UTF-8 sequence (no overlong forms, no surrogates, nothing past
/// U+10FFFF), or npos when all of it is.
size_t firstNonUtf8(std::string_view text);

/// Returns the offset of the first control character of `text` (below 0x20,
/// or 0x7f), or npos: names go onto terminals and into binaries, where such
/// bytes would act rather than show.
size_t firstControlCharacter(std::string_view text);

} // namespace moec

#endif // MOEC_BASE_TEXT_H
