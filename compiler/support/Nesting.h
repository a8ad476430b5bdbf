//===- Nesting.h - A bound on the bracket depth of input text ---*- C++ -*-===//
//
// MLIR's parser recurses once per level of nested brackets, regions and
// attributes, so deeply nested text would overflow the stack before it
// could be reported. Text is scanned for its bracket depth before it is
// parsed; string literals and '//' comments are skipped.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_SUPPORT_NESTING_H
#define MOEC_COMPILER_SUPPORT_NESTING_H

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace moec {

/// The deepest nesting of '(', '[', '{' and '<' that MLIR input may have: a
/// graph needs about ten levels.
inline constexpr int kMaxTextNesting = 64;

/// Where text nests too deep, and what to say of it.
struct DeepNesting {
  size_t line;   // 1-based
  size_t column; // 1-based
  std::string message; // "brackets nested deeper than N levels"
};

/// Returns the first bracket of `text` past `maxDepth` levels, or nothing
/// when there is none. "->" is an arrow, not a closing '>'.
std::optional<DeepNesting> findDeepNesting(std::string_view text,
                                           int maxDepth = kMaxTextNesting);

} // namespace moec

#endif // MOEC_COMPILER_SUPPORT_NESTING_H
