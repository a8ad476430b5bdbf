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

#include <stdexcept>

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

namespace moec {

/// The deepest nesting of arrays and objects a JSON input may have: graphs
/// and configs need a handful, and deeper input is refused while it is
/// parsed, before it can cost a deep recursion anywhere after.
inline constexpr int kMaxJsonDepth = 64;

/// Thrown by parseJsonLimited for nesting deeper than kMaxJsonDepth.
struct JsonTooDeep : std::runtime_error {
  JsonTooDeep()
      : std::runtime_error("nested deeper than " + std::to_string(kMaxJsonDepth) + " levels") {}
};

/// nlohmann's parse of `text` into a `Json` (json or ordered_json), throwing
/// JsonTooDeep for nesting deeper than kMaxJsonDepth; its own exceptions
/// (parse_error, out_of_range for a number past double's range) as nlohmann
/// throws them.
template <typename Json> Json parseJsonLimited(std::string_view text) {
  return Json::parse(text.begin(), text.end(),
                     [](int depth, typename Json::parse_event_t event, Json &) {
                       if (depth > kMaxJsonDepth &&
                           (event == Json::parse_event_t::object_start ||
                            event == Json::parse_event_t::array_start))
                         throw JsonTooDeep();
                       return true;
                     });
}

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
