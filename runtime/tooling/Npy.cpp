//===- Npy.cpp - Reading and writing NumPy .npy files ---------------------===//
//
// The header dict is parsed as the small part of Python's literal syntax that
// np.save and other writers use -- strings, integers, True/False/None, tuples,
// lists and dicts -- into a tree of Values, which is then checked key by key.
// Parsing the literal in general, rather than matching np.save's exact text,
// is what lets the reader take any key order, spacing and trailing commas,
// and lets it name what it found (a structured dtype, a list for a shape)
// instead of just failing to match.
//
// The elements are copied as they are in memory, which needs a little-endian
// host, as does the rest of the runtime.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/Npy.h"

#include "base/File.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string_view>

#include <fcntl.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "elements are copied as they are in memory: a little-endian host is needed"
#endif

namespace moec::npy {

namespace {

/// The magic string every .npy file starts with.
constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicSize = 6;

/// np.save aligns the data to this many bytes.
constexpr size_t kAlignment = 64;

/// The longest header a version 1.0 file can have.
constexpr size_t kMaxVersion1Header = 65535;

/// How much of a bad header an error message quotes.
constexpr size_t kQuoteLimit = 200;

//===----------------------------------------------------------------------===//
// Shapes and sizes
//===----------------------------------------------------------------------===//

/// Multiplies the extents of `shape` into `*elements`, and the elements by
/// `elementSize` into `*bytes`. Returns an error (without a path) when an
/// extent is negative or a product does not fit in int64_t and size_t.
Status checkShape(const std::vector<int64_t> &shape, size_t elementSize, int64_t *elements,
                  size_t *bytes) {
  constexpr int64_t kLimit = std::numeric_limits<int64_t>::max();
  int64_t count = 1;
  for (int64_t extent : shape)
    if (extent < 0)
      return Status::error(
          fmt::format("negative dimension {} in shape {}", extent, formatShape(shape)));
  for (int64_t extent : shape) {
    if (extent != 0 && count > kLimit / extent) {
      // A later zero extent would make the product 0, but such a shape is
      // still not one any array could have been created with.
      return Status::error(fmt::format("shape {} has too many elements", formatShape(shape)));
    }
    count *= extent;
  }
  if (count > kLimit / int64_t(elementSize) ||
      uint64_t(count) * elementSize > std::numeric_limits<size_t>::max())
    return Status::error(fmt::format("shape {} has too many elements", formatShape(shape)));
  *elements = count;
  *bytes = size_t(count) * elementSize;
  return Status::success();
}

/// Returns true when `type` is one of the enumerators.
bool isKnownType(NpyType type) {
  return type == NpyType::F32 || type == NpyType::F64 || type == NpyType::I32 ||
         type == NpyType::I64;
}

/// Each type's NumPy name, the two characters of its descr after the byte
/// order ("<f4"), and its size.
struct NpyTypeInfo {
  NpyType type;
  const char *name;
  const char *code;
  size_t size;
};
constexpr NpyTypeInfo kNpyTypes[] = {{NpyType::F32, "float32", "f4", 4},
                                     {NpyType::F64, "float64", "f8", 8},
                                     {NpyType::I32, "int32", "i4", 4},
                                     {NpyType::I64, "int64", "i8", 8}};

const NpyTypeInfo &npyTypeInfo(NpyType type) {
  for (const NpyTypeInfo &info : kNpyTypes)
    if (info.type == type)
      return info;
  return kNpyTypes[0];
}

/// Returns the descr np.save writes for `type`: "<f4".
std::string descrOf(NpyType type) { return std::string("<") + npyTypeInfo(type).code; }

//===----------------------------------------------------------------------===//
// The header dict as a Python literal
//===----------------------------------------------------------------------===//

/// A parsed Python literal.
struct Value {
  enum class Kind { String, Int, Bool, None, Tuple, List, Dict };
  Kind kind = Kind::None;
  /// The literal as written in the header, for messages.
  std::string_view source;
  /// A String's contents.
  std::string text;
  /// An Int's value; valid only when `fits`.
  int64_t number = 0;
  /// Whether an Int fits in int64_t.
  bool fits = true;
  /// A Bool's value.
  bool truth = false;
  /// The items of a Tuple or List; the keys and values of a Dict, alternating.
  std::vector<Value> items;

  /// Returns the literal for a message: a String in single quotes, as Python
  /// prints it, anything else as written.
  std::string show() const { return kind == Kind::String ? "'" + text + "'" : std::string(source); }
};

/// A recursive-descent parser of one Python literal.
class LiteralParser {
public:
  explicit LiteralParser(std::string_view source) : text(source) {}

  /// Parses the whole text as one literal surrounded by whitespace into
  /// `*out`. On an error returns false and sets `*error`.
  bool parseAll(Value *out, std::string *error) {
    skipSpace();
    if (!parseValue(out, 0))
      return fail(error);
    skipSpace();
    if (pos != text.size()) {
      problem = "unexpected text after the dict";
      return fail(error);
    }
    return true;
  }

private:
  /// Nesting deeper than this is refused, so a hostile header cannot exhaust
  /// the stack.
  static constexpr int kMaxDepth = 32;

  std::string_view text;
  size_t pos = 0;
  std::string problem;

  bool fail(std::string *error) {
    *error = fmt::format("{} at offset {}", problem, pos);
    return false;
  }

  bool setProblem(std::string message) {
    problem = std::move(message);
    return false;
  }

  static bool isSpace(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  }
  static bool isDigit(char c) { return c >= '0' && c <= '9'; }
  static bool isIdentifier(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || isDigit(c) || c == '_';
  }

  void skipSpace() {
    while (pos < text.size() && isSpace(text[pos]))
      ++pos;
  }

  bool atEnd() const { return pos >= text.size(); }

  bool parseValue(Value *out, int depth) {
    if (depth > kMaxDepth)
      return setProblem("literal nested too deeply");
    if (atEnd())
      return setProblem("unexpected end of the header");
    size_t start = pos;
    char c = text[pos];
    bool ok;
    if (c == '\'' || c == '"')
      ok = parseString(out);
    else if (isDigit(c) || c == '-' || c == '+')
      ok = parseInt(out);
    else if (c == '(')
      ok = parseSequence(out, ')', depth);
    else if (c == '[')
      ok = parseSequence(out, ']', depth);
    else if (c == '{')
      ok = parseDict(out, depth);
    else if (isIdentifier(c))
      ok = parseName(out);
    else
      return setProblem(fmt::format("unexpected character '{}'", c));
    if (ok && out->source.empty())
      out->source = text.substr(start, pos - start);
    return ok;
  }

  bool parseString(Value *out) {
    char quote = text[pos++];
    std::string result;
    while (true) {
      if (atEnd() || text[pos] == '\n')
        return setProblem("unterminated string");
      char c = text[pos++];
      if (c == quote)
        break;
      if (c == '\\') {
        if (atEnd())
          return setProblem("unterminated string");
        char e = text[pos++];
        switch (e) {
        case 'n':
          result += '\n';
          break;
        case 't':
          result += '\t';
          break;
        case 'r':
          result += '\r';
          break;
        case '0':
          result += '\0';
          break;
        case '\\':
        case '\'':
        case '"':
          result += e;
          break;
        default: // Python keeps unknown escapes as they are.
          result += '\\';
          result += e;
          break;
        }
        continue;
      }
      result += c;
    }
    out->kind = Value::Kind::String;
    out->text = std::move(result);
    return true;
  }

  bool parseInt(Value *out) {
    bool negative = false;
    if (text[pos] == '-' || text[pos] == '+') {
      negative = text[pos] == '-';
      ++pos;
      skipSpace();
    }
    if (atEnd() || !isDigit(text[pos]))
      return setProblem("expected a digit");
    // Accumulate the magnitude as uint64_t so that INT64_MIN parses.
    uint64_t magnitude = 0;
    bool fits = true;
    while (!atEnd() && (isDigit(text[pos]) || text[pos] == '_')) {
      if (text[pos] != '_') {
        uint64_t digit = uint64_t(text[pos] - '0');
        if (magnitude > (std::numeric_limits<uint64_t>::max() - digit) / 10)
          fits = false;
        else
          magnitude = magnitude * 10 + digit;
      }
      ++pos;
    }
    // Python 2 wrote long integers with an 'L' suffix.
    if (!atEnd() && (text[pos] == 'L' || text[pos] == 'l'))
      ++pos;
    if (!atEnd() && isIdentifier(text[pos]))
      return setProblem("bad integer");
    constexpr uint64_t kMax = uint64_t(std::numeric_limits<int64_t>::max());
    if (magnitude > kMax + (negative ? 1 : 0))
      fits = false;
    out->kind = Value::Kind::Int;
    out->fits = fits;
    if (fits)
      out->number = negative ? int64_t(0 - magnitude) : int64_t(magnitude);
    return true;
  }

  bool parseName(Value *out) {
    size_t start = pos;
    while (!atEnd() && isIdentifier(text[pos]))
      ++pos;
    std::string_view name = text.substr(start, pos - start);
    if (name == "True" || name == "False") {
      out->kind = Value::Kind::Bool;
      out->truth = name == "True";
    } else if (name == "None") {
      out->kind = Value::Kind::None;
    } else {
      pos = start;
      return setProblem(fmt::format("unexpected name '{}'", name));
    }
    return true;
  }

  /// Parses a tuple or a list. `(x)` without a comma is `x`, as in Python.
  bool parseSequence(Value *out, char close, int depth) {
    bool tuple = close == ')';
    ++pos;
    std::vector<Value> items;
    bool sawComma = false;
    while (true) {
      skipSpace();
      if (atEnd())
        return setProblem(fmt::format("expected '{}'", close));
      if (text[pos] == close) {
        ++pos;
        break;
      }
      Value item;
      if (!parseValue(&item, depth + 1))
        return false;
      items.push_back(std::move(item));
      skipSpace();
      if (!atEnd() && text[pos] == ',') {
        ++pos;
        sawComma = true;
        continue;
      }
      if (!atEnd() && text[pos] == close) {
        ++pos;
        break;
      }
      return setProblem(fmt::format("expected ',' or '{}'", close));
    }
    if (tuple && items.size() == 1 && !sawComma) {
      // A parenthesized value; its source becomes the whole "(...)".
      Value inner = std::move(items.front());
      inner.source = {};
      *out = std::move(inner);
      return true;
    }
    out->kind = tuple ? Value::Kind::Tuple : Value::Kind::List;
    out->items = std::move(items);
    return true;
  }

  bool parseDict(Value *out, int depth) {
    ++pos;
    std::vector<Value> items;
    while (true) {
      skipSpace();
      if (atEnd())
        return setProblem("expected '}'");
      if (text[pos] == '}') {
        ++pos;
        break;
      }
      Value key;
      if (!parseValue(&key, depth + 1))
        return false;
      skipSpace();
      if (atEnd() || text[pos] != ':')
        return setProblem("expected ':'");
      ++pos;
      skipSpace();
      Value value;
      if (!parseValue(&value, depth + 1))
        return false;
      items.push_back(std::move(key));
      items.push_back(std::move(value));
      skipSpace();
      if (!atEnd() && text[pos] == ',') {
        ++pos;
        continue;
      }
      if (!atEnd() && text[pos] == '}') {
        ++pos;
        break;
      }
      return setProblem("expected ',' or '}'");
    }
    out->kind = Value::Kind::Dict;
    out->items = std::move(items);
    return true;
  }
};

/// Returns `header` for a message: without its padding, in double quotes,
/// cut short when long.
std::string quoteHeader(std::string_view header) {
  while (!header.empty() && (header.back() == ' ' || header.back() == '\n'))
    header.remove_suffix(1);
  std::string shown(header.substr(0, kQuoteLimit));
  for (char &c : shown)
    if (c == '\n' || c == '\r' || c == '\t')
      c = ' ';
  return "\"" + shown + (header.size() > kQuoteLimit ? "...\"" : "\"");
}

/// Reads the type from the 'descr' value.
Status parseDescr(const Value &value, NpyType *type) {
  static constexpr const char *kExpected = "expected float32, float64, int32 or int64";
  if (value.kind != Value::Kind::String)
    return Status::error(fmt::format("unsupported dtype {}: {}", value.show(), kExpected));
  const std::string &descr = value.text;
  if (descr.size() == 3 && (descr[0] == '<' || descr[0] == '=' || descr[0] == '>')) {
    std::string_view code(descr.data() + 1, 2);
    NpyType found = NpyType::F32;
    bool known = false;
    for (const NpyTypeInfo &info : kNpyTypes)
      if (code == info.code) {
        found = info.type;
        known = true;
      }
    if (known && descr[0] == '>')
      return Status::error(fmt::format(
          "big-endian dtype '{}' is not supported; save with a.astype('<{}')", descr, code));
    if (known) {
      *type = found;
      return Status::success();
    }
  }
  return Status::error(fmt::format("unsupported dtype {}: {}", value.show(), kExpected));
}

/// Reads the shape from the 'shape' value.
Status parseShapeValue(const Value &value, std::vector<int64_t> *shape) {
  if (value.kind != Value::Kind::Tuple)
    return Status::error(
        fmt::format("bad header: 'shape' is not a tuple of integers: {}", value.show()));
  std::vector<int64_t> result;
  for (const Value &item : value.items) {
    if (item.kind != Value::Kind::Int)
      return Status::error(
          fmt::format("bad header: 'shape' is not a tuple of integers: {}", value.show()));
    if (!item.fits)
      return Status::error(
          fmt::format("dimension {} in shape {} is too large", item.source, value.show()));
    result.push_back(item.number);
  }
  *shape = std::move(result);
  return Status::success();
}

/// Parses the header text into a type and shape. Errors have no path.
Status parseHeader(std::string_view header, NpyType *type, std::vector<int64_t> *shape) {
  Value dict;
  std::string error;
  if (!LiteralParser(header).parseAll(&dict, &error))
    return Status::error(fmt::format("bad header: {} in {}", error, quoteHeader(header)));
  if (dict.kind != Value::Kind::Dict)
    return Status::error(fmt::format("bad header: not a dict: {}", quoteHeader(header)));

  const Value *descr = nullptr, *fortran = nullptr, *shapeValue = nullptr;
  for (size_t i = 0; i < dict.items.size(); i += 2) {
    const Value &key = dict.items[i];
    const Value **slot = nullptr;
    if (key.kind == Value::Kind::String) {
      if (key.text == "descr")
        slot = &descr;
      else if (key.text == "fortran_order")
        slot = &fortran;
      else if (key.text == "shape")
        slot = &shapeValue;
    }
    if (!slot)
      return Status::error(fmt::format(
          "bad header: unexpected key {}; expected 'descr', 'fortran_order' and 'shape'",
          key.show()));
    if (*slot)
      return Status::error(fmt::format("bad header: duplicate key {}", key.show()));
    *slot = &dict.items[i + 1];
  }
  for (auto [value, name] : {std::pair{descr, "descr"}, std::pair{fortran, "fortran_order"},
                             std::pair{shapeValue, "shape"}})
    if (!value)
      return Status::error(fmt::format("bad header: no '{}' key in {}", name, quoteHeader(header)));

  NpyType parsedType = NpyType::F32;
  if (Status status = parseDescr(*descr, &parsedType); !status)
    return status;
  if (fortran->kind != Value::Kind::Bool)
    return Status::error(
        fmt::format("bad header: 'fortran_order' is not True or False: {}", fortran->show()));
  if (fortran->truth)
    return Status::error("fortran_order arrays are not supported; save with np.ascontiguousarray");
  std::vector<int64_t> parsedShape;
  if (Status status = parseShapeValue(*shapeValue, &parsedShape); !status)
    return status;
  *type = parsedType;
  *shape = std::move(parsedShape);
  return Status::success();
}

/// Returns the little-endian unsigned integer of `size` bytes at `bytes`.
uint64_t readLittleEndian(const uint8_t *bytes, size_t size) {
  uint64_t value = 0;
  for (size_t i = 0; i < size; ++i)
    value |= uint64_t(bytes[i]) << (8 * i);
  return value;
}

/// Parses a whole .npy file held in `bytes`. On success moves the elements
/// out of `bytes` into `*out`. Errors have no path.
/// The header of a .npy file of `fileSize` bytes whose first `have` bytes
/// are at `bytes` (at least the whole header, or all of a shorter file):
/// its type, shape and where the data starts, checked against the size.
Status parseNpyHead(const uint8_t *bytes, size_t have, uint64_t fileSize, NpyType *type,
                    std::vector<int64_t> *shape, size_t *offset) {
  if (have < kMagicSize || std::memcmp(bytes, kMagic, kMagicSize) != 0)
    return Status::error("not a .npy file (bad magic)");
  if (have < kMagicSize + 2)
    return Status::error(fmt::format("truncated: {} bytes, too short for a .npy header", fileSize));
  unsigned major = bytes[6], minor = bytes[7];
  if (minor != 0 || major < 1 || major > 3)
    return Status::error(
        fmt::format("unsupported .npy version {}.{}: expected 1.0, 2.0 or 3.0", major, minor));
  size_t lengthSize = major == 1 ? 2 : 4;
  size_t prefix = kMagicSize + 2 + lengthSize;
  if (have < prefix)
    return Status::error(fmt::format("truncated: {} bytes, too short for a .npy header", fileSize));
  uint64_t headerSize = readLittleEndian(bytes + kMagicSize + 2, lengthSize);
  if (headerSize > fileSize - prefix)
    return Status::error(fmt::format("truncated: header says {} bytes of header, file has {}",
                                     headerSize, fileSize - prefix));
  if (headerSize > have - prefix)
    return Status::error(fmt::format("a header of {} bytes; at most {} are read", headerSize,
                                     have - prefix));
  std::string_view header(reinterpret_cast<const char *>(bytes) + prefix, size_t(headerSize));
  if (Status status = parseHeader(header, type, shape); !status)
    return status;
  int64_t elements;
  size_t dataBytes;
  if (Status status = checkShape(*shape, npyTypeSize(*type), &elements, &dataBytes); !status)
    return status.withPrefix("bad header: ");
  *offset = prefix + size_t(headerSize);
  uint64_t available = fileSize - *offset;
  if (available < dataBytes)
    return Status::error(
        fmt::format("truncated: header says {} bytes of data, file has {}", dataBytes, available));
  if (available > dataBytes)
    return Status::error(
        fmt::format("{} bytes after the data: header says {} bytes of data, file has {}",
                    available - dataBytes, dataBytes, available));
  return Status::success();
}

Status parseNpyBytes(std::vector<uint8_t> &bytes, NpyArray *out) {
  NpyType type = NpyType::F32;
  std::vector<int64_t> shape;
  size_t offset = 0;
  if (Status s = parseNpyHead(bytes.data(), bytes.size(), bytes.size(), &type, &shape, &offset); !s)
    return s;
  bytes.erase(bytes.begin(), bytes.begin() + std::ptrdiff_t(offset));
  out->type = type;
  out->shape = std::move(shape);
  out->data = std::move(bytes);
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Writing
//===----------------------------------------------------------------------===//

/// Returns the header np.save writes for `type` and `shape`: the prefix
/// (magic, version, length) and the padded dict.
std::string makeHeader(NpyType type, const std::vector<int64_t> &shape) {
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}",
                                 descrOf(type), formatShape(shape));
  size_t lengthSize = 2;
  // The dict, at least one space of padding, and '\n', as np.save pads.
  auto paddedSize = [&](size_t lengthBytes) {
    size_t unpadded = kMagicSize + 2 + lengthBytes + dict.size() + 1;
    return dict.size() + 1 + (kAlignment - unpadded % kAlignment);
  };
  size_t headerSize = paddedSize(lengthSize);
  unsigned major = 1;
  if (headerSize > kMaxVersion1Header) {
    major = 2;
    lengthSize = 4;
    headerSize = paddedSize(lengthSize);
  }
  std::string out(kMagic, kMagicSize);
  out += char(major);
  out += char(0);
  for (size_t i = 0; i < lengthSize; ++i)
    out += char((headerSize >> (8 * i)) & 0xff);
  out += dict;
  out.append(headerSize - dict.size() - 1, ' ');
  out += '\n';
  return out;
}

} // namespace

//===----------------------------------------------------------------------===//
// Public functions
//===----------------------------------------------------------------------===//

const char *npyTypeName(NpyType type) { return npyTypeInfo(type).name; }

size_t npyTypeSize(NpyType type) { return npyTypeInfo(type).size; }

int64_t NpyArray::elements() const {
  int64_t count = 1;
  for (int64_t extent : shape)
    count *= extent;
  return count;
}

std::string formatShape(const std::vector<int64_t> &shape) {
  if (shape.size() == 1)
    return fmt::format("({},)", shape[0]);
  return fmt::format("({})", fmt::join(shape, ", "));
}

Status parseNpy(std::vector<uint8_t> &bytes, NpyArray *out) { return parseNpyBytes(bytes, out); }

Status readNpy(const std::string &path, NpyArray *out) {
  // The header first: its shape says how large the file is, and a file of
  // another size is refused before the rest is read.
  constexpr uint64_t kHeadBytes = uint64_t(1) << 20;
  std::vector<uint8_t> bytes;
  uint64_t fileSize = 0;
  if (Status s = readFileHead(path, kHeadBytes, &bytes, &fileSize); !s)
    return s;
  NpyType type = NpyType::F32;
  std::vector<int64_t> shape;
  size_t offset = 0;
  if (Status s = parseNpyHead(bytes.data(), bytes.size(), fileSize, &type, &shape, &offset); !s)
    return s.withPrefix(path + ": ");
  if (Status s = readWholeFile(path, &bytes, fileSize); !s)
    return s;
  return parseNpyBytes(bytes, out).withPrefix(path + ": ");
}

Status writeNpy(const std::string &path, NpyType type, const std::vector<int64_t> &shape,
                const void *data) {
  if (!isKnownType(type))
    return Status::error(fmt::format("{}: unknown element type {}", path, int(type)));
  int64_t elements;
  size_t dataBytes;
  if (Status status = checkShape(shape, npyTypeSize(type), &elements, &dataBytes); !status)
    return status.withPrefix(path + ": ");
  if (!data && dataBytes > 0)
    return Status::error(
        fmt::format("{}: no data for shape {} of {}", path, formatShape(shape), npyTypeName(type)));
  std::string header = makeHeader(type, shape);

  return writeFileAtomically(path, {{header.data(), header.size()}, {data, dataBytes}});
}

Status writeNpy(const std::string &path, const NpyArray &array) {
  if (!isKnownType(array.type))
    return Status::error(fmt::format("{}: unknown element type {}", path, int(array.type)));
  int64_t elements;
  size_t dataBytes;
  if (Status status = checkShape(array.shape, array.elementSize(), &elements, &dataBytes); !status)
    return status.withPrefix(path + ": ");
  if (array.data.size() != dataBytes)
    return Status::error(fmt::format("{}: data has {} bytes, but shape {} of {} needs {}", path,
                                     array.data.size(), formatShape(array.shape),
                                     npyTypeName(array.type), dataBytes));
  return writeNpy(path, array.type, array.shape, array.data.data());
}

} // namespace moec::npy
