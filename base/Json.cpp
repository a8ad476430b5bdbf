//===- Json.cpp - Parsing JSON text with located errors -------------------===//

#include "base/Json.h"

#include <cerrno>
#include <cstring>
#include <cstdio>

namespace moec {

std::string jsonParseMessage(const nlohmann::json::parse_error &e) {
  std::string what = e.what();
  size_t at = what.find("parse error");
  if (at == std::string::npos)
    return what;
  size_t colon = what.find(": ", at);
  if (colon == std::string::npos)
    return what;
  return what.substr(colon + 2);
}

std::pair<size_t, size_t> lineAndColumn(std::string_view text, size_t byte) {
  size_t index = byte == 0 ? 0 : byte - 1;
  if (index > text.size())
    index = text.size();
  size_t line = 1;
  size_t lineStart = 0;
  for (size_t i = 0; i < index; ++i) {
    if (text[i] == '\n') {
      ++line;
      lineStart = i + 1;
    }
  }
  return {line, index - lineStart + 1};
}

bool parseJson(std::string_view text, const std::string &source, nlohmann::json *out,
               std::string *error) {
  try {
    *out = parseJsonLimited<nlohmann::json>(text);
  } catch (const nlohmann::json::parse_error &e) {
    auto [line, column] = lineAndColumn(text, e.byte);
    if (error)
      *error = source + ":" + std::to_string(line) + ":" + std::to_string(column) + ": " +
               jsonParseMessage(e);
    return false;
  } catch (const nlohmann::json::exception &e) {
    // A number past double's range, and the like: no byte offset given.
    if (error)
      *error = source + ": malformed JSON: " + std::string(e.what());
    return false;
  } catch (const JsonRefused &e) {
    auto [line, column] = lineAndColumn(text, e.byte + 1);
    if (error)
      *error = source + ":" + std::to_string(line) + ":" + std::to_string(column) +
               ": malformed JSON: " + std::string(e.what());
    return false;
  }
  return true;
}

} // namespace moec
