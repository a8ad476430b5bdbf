//===- Json.h - Parsing JSON text with located errors ----------*- C++ -*-===//
//
// The compiler reads several JSON inputs (graphs, configs, target profiles)
// and the runtime's tooling one (safetensors headers); this is how each of
// them is parsed within bounds and turns nlohmann's parse errors into
// messages that name the file, line and column.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_JSON_H
#define MOEC_BASE_JSON_H

#include <nlohmann/json.hpp>

#include <cstddef>
#include <iterator>
#include <set>
#include <stdexcept>
#include <vector>

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>

namespace moec {

/// The deepest nesting of arrays and objects a JSON input may have: graphs
/// and configs need a handful, and deeper input is refused while it is
/// parsed, before it can cost a deep recursion anywhere after.
inline constexpr int kMaxJsonDepth = 64;

/// Thrown by parseJsonLimited for input it refuses although JSON allows it:
/// nesting deeper than kMaxJsonDepth, or a key twice in one object (whose
/// last value would silently win).
struct JsonRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
  /// The 0-based offset of about where the parser was (the key, or the
  /// bracket past the bound); set by parseJsonLimited.
  size_t byte = 0;
};

/// An input iterator over text that records the furthest byte the parser
/// has read, so that a refusal from the parse callback (which is given no
/// position) can say where it happened.
class TrackingIterator {
public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char *;
  using reference = const char &;

  TrackingIterator(const char *at, const char **furthest) : at(at), furthest(furthest) {}
  reference operator*() const { return *at; }
  TrackingIterator &operator++() {
    if (++at > *furthest)
      *furthest = at;
    return *this;
  }
  bool operator==(const TrackingIterator &other) const { return at == other.at; }
  bool operator!=(const TrackingIterator &other) const { return at != other.at; }

private:
  const char *at;
  const char **furthest;
};

/// nlohmann's parse of `text` into a `Json` (json or ordered_json), throwing
/// JsonRefused for nesting deeper than kMaxJsonDepth or a duplicate key; its
/// own exceptions (parse_error, out_of_range for a number past double's
/// range) as nlohmann throws them.
template <typename Json> Json parseJsonLimited(std::string_view text) {
  std::vector<std::set<std::string>> keys; // of the objects being parsed
  const char *furthest = text.data();
  try {
    return Json::parse(TrackingIterator(text.data(), &furthest),
                       TrackingIterator(text.data() + text.size(), &furthest),
                       [&keys](int depth, typename Json::parse_event_t event, Json &parsed) {
                         using Event = typename Json::parse_event_t;
                         if (depth > kMaxJsonDepth &&
                             (event == Event::object_start || event == Event::array_start))
                           throw JsonRefused("nested deeper than " + std::to_string(kMaxJsonDepth) +
                                             " levels");
                         if (event == Event::object_start)
                           keys.emplace_back();
                         else if (event == Event::object_end && !keys.empty())
                           keys.pop_back();
                         else if (event == Event::key && !keys.empty() && parsed.is_string() &&
                                  !keys.back().insert(parsed.template get<std::string>()).second)
                           throw JsonRefused("key '" + parsed.template get<std::string>() +
                                             "' appears twice in one object");
                         return true;
                       });
  } catch (JsonRefused &e) {
    // The lexer has just read the bracket past the bound, or the closing
    // quote of the key that appears twice: point at it, or at its opening
    // quote.
    e.byte = furthest > text.data() ? size_t(furthest - text.data()) - 1 : 0;
    if (text.size() > e.byte && text[e.byte] == '"' && e.byte > 0)
      e.byte = text.rfind('"', e.byte - 1) == std::string_view::npos ? e.byte
                                                                     : text.rfind('"', e.byte - 1);
    throw;
  }
}

/// Returns the message of a nlohmann parse error without its
/// "[json.exception.parse_error.101] parse error at line L, column C: " prefix.
std::string jsonParseMessage(const nlohmann::json::parse_error &e);

/// Converts a 1-based byte offset (nlohmann's parse_error::byte, the offset
/// of the last character read) into a 1-based line and column of `text`.
std::pair<size_t, size_t> lineAndColumn(std::string_view text, size_t byte);

/// Parses `text` into *out. On malformed JSON, or JSON it refuses (see
/// parseJsonLimited), returns false and sets *error to "SOURCE:LINE:COL:
/// message" (or "SOURCE: message" where no position is known).
bool parseJson(std::string_view text, const std::string &source, nlohmann::json *out,
               std::string *error);

} // namespace moec

#endif // MOEC_BASE_JSON_H
