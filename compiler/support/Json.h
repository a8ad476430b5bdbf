//===- Json.h - Parsing JSON text with located errors ----------*- C++ -*-===//
//
// The compiler reads several JSON inputs (graphs, configs, target profiles);
// this is how each of them turns nlohmann's parse errors into messages that
// name the file, line and column.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_SUPPORT_JSON_H
#define MOEC_COMPILER_SUPPORT_JSON_H

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

namespace moec {

/// Returns the message of a nlohmann parse error without its
/// "[json.exception.parse_error.101] parse error at line L, column C: " prefix.
std::string jsonParseMessage(const nlohmann::json::parse_error &e);

/// Converts a 1-based byte offset (nlohmann's parse_error::byte, the offset
/// of the last character read) into a 1-based line and column of `text`.
std::pair<size_t, size_t> lineAndColumn(std::string_view text, size_t byte);

/// Parses `text` into *out. On malformed JSON returns false and sets *error
/// to "SOURCE:LINE:COL: message".
bool parseJson(std::string_view text, const std::string &source, nlohmann::json *out,
               std::string *error);

/// Reads the whole file `path` into *out; on failure sets *error to
/// "cannot read 'PATH': <reason>".
bool readTextFile(const std::string &path, std::string *out, std::string *error);

} // namespace moec

#endif // MOEC_COMPILER_SUPPORT_JSON_H
