//===- Nesting.cpp - A bound on the bracket depth of input text ----------===//

#include "compiler/support/Nesting.h"

#include <cstddef>

std::optional<moec::DeepNesting> moec::findDeepNesting(std::string_view text, int maxDepth) {
  int depth = 0;
  size_t line = 1, column = 1;
  for (size_t i = 0; i < text.size(); ++i, ++column) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
      column = 0;
    } else if (c == '"') { // a string literal, with backslash escapes
      for (++i, ++column; i < text.size() && text[i] != '"' && text[i] != '\n'; ++i, ++column)
        if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] != '\n')
          ++i, ++column;
      if (i < text.size() && text[i] == '\n')
        ++line, column = 0;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i + 1 < text.size() && text[i + 1] != '\n')
        ++i;
    } else if (c == '(' || c == '[' || c == '{' || c == '<') {
      if (++depth > maxDepth)
        return DeepNesting{line, column,
                           "brackets nested deeper than " + std::to_string(maxDepth) + " levels"};
    } else if ((c == ')' || c == ']' || c == '}' || (c == '>' && (i == 0 || text[i - 1] != '-'))) &&
               depth > 0) {
      --depth;
    }
  }
  return std::nullopt;
}
