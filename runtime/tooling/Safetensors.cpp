//===- Safetensors.cpp - The header of a safetensors file ----------------===//
//
// The header is checked in three steps: the text (UTF-8, then JSON through
// the compiler's bounded parser, which refuses a key twice in one object
// and deep nesting), each entry on its own (fields, dtype, shape, offsets,
// bytes), then the entries together, sorted by offset, against the data
// area (no overlap, no gap, nothing left over). Messages quote what the
// file says, so that a person can find it in the header.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/Safetensors.h"

#include "base/Json.h"
#include "base/Text.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <tuple>

#include <unistd.h>

namespace moec::safetensors {

namespace {

using nlohmann::json;

struct DtypeInfo {
  Dtype dtype;
  const char *name;
  size_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {Dtype::F64, "F64", 8},   {Dtype::F32, "F32", 4},         {Dtype::F16, "F16", 2},
    {Dtype::BF16, "BF16", 2}, {Dtype::F8_E4M3, "F8_E4M3", 1}, {Dtype::I64, "I64", 8},
    {Dtype::I32, "I32", 4},   {Dtype::I16, "I16", 2},         {Dtype::I8, "I8", 1},
    {Dtype::U8, "U8", 1},     {Dtype::BOOL, "BOOL", 1},
};

/// The key of the metadata object.
constexpr std::string_view kMetadataKey = "__metadata__";

/// How much of a bad value an error message quotes.
constexpr size_t kQuoteLimit = 80;

/// Returns a JSON value as the header writes it, cut short when long.
std::string quote(const json &value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > kQuoteLimit)
    text = text.substr(0, kQuoteLimit) + "...";
  return text;
}

/// Returns the kind of a JSON value for a message: "an array", "a number".
const char *kindOf(const json &value) {
  switch (value.type()) {
  case json::value_t::object:
    return "an object";
  case json::value_t::array:
    return "an array";
  case json::value_t::string:
    return "a string";
  case json::value_t::boolean:
    return "a boolean";
  case json::value_t::null:
    return "null";
  default:
    return "a number";
  }
}

/// Returns a shape as a list: "[2, 3]", "[]".
std::string formatShape(const std::vector<int64_t> &shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

/// Sets *out to `value` when it is a JSON integer from 0 to `max` (not a
/// boolean, not a float such as 2.0).
bool asSize(const json &value, uint64_t max, uint64_t *out) {
  if (!value.is_number_unsigned())
    return false; // nlohmann stores every non-negative integer as unsigned
  const uint64_t v = value.get<uint64_t>();
  if (v > max)
    return false;
  *out = v;
  return true;
}

/// Checks the entry `spec` of the tensor `name` on its own, against a data
/// area of `dataBytes`, into *out.
Status parseEntry(const std::string &name, const json &spec, uint64_t dataBytes, TensorEntry *out) {
  const std::string where = fmt::format("tensor '{}'", name);
  if (!spec.is_object())
    return Status::error(fmt::format("{}: its entry is {}, not an object", where, kindOf(spec)));
  for (const char *key : {"dtype", "shape", "data_offsets"})
    if (!spec.contains(key))
      return Status::error(fmt::format("{}: no '{}'", where, key));
  for (const auto &item : spec.items())
    if (item.key() != "dtype" && item.key() != "shape" && item.key() != "data_offsets")
      return Status::error(
          fmt::format("{}: unknown key '{}' (an entry holds dtype, shape and data_offsets)", where,
                      item.key()));

  const json &dtype = spec["dtype"];
  if (!dtype.is_string() || !dtypeFromName(dtype.get_ref<const std::string &>(), &out->dtype)) {
    std::vector<const char *> known;
    for (const DtypeInfo &info : kDtypes)
      known.push_back(info.name);
    return Status::error(
        fmt::format("{}: unknown dtype {} (known: {})", where,
                    dtype.is_string() ? "'" + dtype.get<std::string>() + "'" : quote(dtype),
                    fmt::join(known, ", ")));
  }

  const json &shape = spec["shape"];
  out->shape.clear();
  bool shapeOk = shape.is_array();
  if (shapeOk)
    for (const json &extent : shape) {
      uint64_t v;
      if (!asSize(extent, uint64_t(std::numeric_limits<int64_t>::max()), &v)) {
        shapeOk = false;
        break;
      }
      out->shape.push_back(int64_t(v));
    }
  if (!shapeOk)
    return Status::error(
        fmt::format("{}: shape {} is not a list of sizes >= 0", where, quote(shape)));

  const json &offsets = spec["data_offsets"];
  uint64_t begin, end;
  if (!offsets.is_array() || offsets.size() != 2 ||
      !asSize(offsets[0], std::numeric_limits<uint64_t>::max(), &begin) ||
      !asSize(offsets[1], std::numeric_limits<uint64_t>::max(), &end))
    return Status::error(
        fmt::format("{}: data_offsets {} is not [begin, end], two sizes", where, quote(offsets)));
  if (begin > end)
    return Status::error(
        fmt::format("{}: data_offsets [{}, {}] end before they begin", where, begin, end));
  if (end > dataBytes)
    return Status::error(fmt::format("{}: data_offsets [{}, {}] run past the data area of {} "
                                     "bytes (a truncated file?)",
                                     where, begin, end, dataBytes));

  // The bytes the shape needs: 0 when an extent is, else the product, which
  // must not overflow.
  const char *dtypeText = dtypeName(out->dtype);
  uint64_t bytes = dtypeSize(out->dtype);
  if (std::find(out->shape.begin(), out->shape.end(), 0) != out->shape.end())
    bytes = 0;
  else
    for (int64_t extent : out->shape)
      if (__builtin_mul_overflow(bytes, uint64_t(extent), &bytes))
        return Status::error(fmt::format("{}: shape {} of {} has too many elements", where,
                                         formatShape(out->shape), dtypeText));
  if (bytes != end - begin)
    return Status::error(fmt::format("{}: shape {} of {} is {} bytes; its data_offsets [{}, {}] "
                                     "hold {}",
                                     where, formatShape(out->shape), dtypeText, bytes, begin, end,
                                     end - begin));
  out->name = name;
  out->begin = begin;
  out->end = end;
  return Status::success();
}

/// Reads `size` bytes at `offset` of `fd` into `data`; false with errno set
/// (0 when the file ends first).
bool preadAll(int fd, void *data, size_t size, uint64_t offset) {
  auto *at = static_cast<char *>(data);
  while (size > 0) {
    const ssize_t n = ::pread(fd, at, size, off_t(offset));
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      if (n == 0)
        errno = 0;
      return false;
    }
    at += n;
    size -= size_t(n);
    offset += uint64_t(n);
  }
  return true;
}

} // namespace

const char *dtypeName(Dtype dtype) {
  for (const DtypeInfo &info : kDtypes)
    if (info.dtype == dtype)
      return info.name;
  return "?";
}

size_t dtypeSize(Dtype dtype) {
  for (const DtypeInfo &info : kDtypes)
    if (info.dtype == dtype)
      return info.size;
  return 0;
}

bool dtypeFromName(std::string_view name, Dtype *out) {
  for (const DtypeInfo &info : kDtypes)
    if (name == info.name) {
      *out = info.dtype;
      return true;
    }
  return false;
}

Status checkHeaderLength(uint64_t headerBytes, uint64_t fileBytes) {
  if (fileBytes < kLengthBytes)
    return Status::error(
        fmt::format("{} bytes, shorter than the {}-byte header length", fileBytes, kLengthBytes));
  if (headerBytes > kMaxHeaderBytes)
    return Status::error(
        fmt::format("a header of {} bytes, over the {}-byte limit", headerBytes, kMaxHeaderBytes));
  if (headerBytes > fileBytes - kLengthBytes)
    return Status::error(
        fmt::format("a header of {} bytes in a file of {} (truncated, or not safetensors)",
                    headerBytes, fileBytes));
  return Status::success();
}

Status parseHeader(std::string_view header, uint64_t dataBytes, Header *out) {
  if (header.size() > kMaxHeaderBytes)
    return Status::error(fmt::format("a header of {} bytes, over the {}-byte limit", header.size(),
                                     kMaxHeaderBytes));
  if (size_t bad = firstNonUtf8(header); bad != std::string_view::npos)
    return Status::error(fmt::format("the header is not UTF-8 text (byte 0x{:02x} at offset {})",
                                     unsigned(uint8_t(header[bad])), bad));
  // nlohmann takes a NUL byte for the end of the input and would ignore
  // what follows it; JSON text holds none.
  if (size_t nul = header.find('\0'); nul != std::string_view::npos)
    return Status::error(fmt::format("the header is not JSON: a NUL byte at offset {}", nul));
  json doc;
  try {
    doc = parseJsonLimited<json>(header);
  } catch (const json::parse_error &e) {
    return Status::error(fmt::format("the header is not JSON: at offset {}: {}",
                                     e.byte ? e.byte - 1 : 0, jsonParseMessage(e)));
  } catch (const JsonRefused &e) {
    return Status::error(fmt::format("the header: {} (at offset {})", e.what(), e.byte));
  } catch (const json::exception &e) {
    // A number past double's range: nlohmann gives no offset.
    std::string what = e.what();
    if (size_t at = what.find("] "); at != std::string::npos)
      what = what.substr(at + 2);
    return Status::error("the header is not JSON: " + what);
  }
  if (!doc.is_object())
    return Status::error(fmt::format("the header is {}, not an object", kindOf(doc)));

  Header result;
  for (const auto &item : doc.items()) {
    if (item.key() == kMetadataKey) {
      const json &metadata = item.value();
      if (metadata.is_null())
        continue;
      if (!metadata.is_object())
        return Status::error(
            fmt::format("{} is {}, not an object of strings", kMetadataKey, kindOf(metadata)));
      for (const auto &entry : metadata.items()) {
        if (!entry.value().is_string())
          return Status::error(fmt::format("{}: the value of '{}' is {} ({}), not a string",
                                           kMetadataKey, entry.key(), kindOf(entry.value()),
                                           quote(entry.value())));
        result.metadata.emplace(entry.key(), entry.value().get<std::string>());
      }
      result.hasMetadata = true;
      continue;
    }
    TensorEntry entry;
    if (Status s = parseEntry(item.key(), item.value(), dataBytes, &entry); !s)
      return s;
    result.tensors.push_back(std::move(entry));
  }

  std::sort(result.tensors.begin(), result.tensors.end(),
            [](const TensorEntry &a, const TensorEntry &b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  uint64_t at = 0;
  const TensorEntry *before = nullptr;
  for (const TensorEntry &e : result.tensors) {
    if (e.begin < at)
      return Status::error(
          fmt::format("tensor '{}': data_offsets [{}, {}] overlap those of tensor '{}', [{}, {}]",
                      e.name, e.begin, e.end, before->name, before->begin, before->end));
    if (e.begin > at)
      return Status::error(
          fmt::format("tensor '{}': data_offsets [{}, {}] leave a gap of {} bytes {}", e.name,
                      e.begin, e.end, e.begin - at,
                      before ? fmt::format("after tensor '{}', which ends at {}", before->name, at)
                             : std::string("at the start of the data area")));
    at = e.end;
    before = &e;
  }
  if (at != dataBytes)
    return Status::error(
        before ? fmt::format("the tensors end at byte {} of a data area of {} bytes: the {} "
                             "bytes after tensor '{}' belong to none (trailing bytes, or a "
                             "damaged header)",
                             at, dataBytes, dataBytes - at, before->name)
               : fmt::format("no tensors, but a data area of {} bytes", dataBytes));
  *out = std::move(result);
  return Status::success();
}

Status readHeader(int fd, uint64_t fileBytes, Header *out, uint64_t *dataStart) {
  if (Status s = checkHeaderLength(0, fileBytes); !s)
    return s;
  uint8_t field[kLengthBytes];
  if (!preadAll(fd, field, kLengthBytes, 0))
    return Status::error(fmt::format("cannot read the header length: {}",
                                     errno ? std::strerror(errno) : "the file ends"));
  uint64_t length = 0;
  for (size_t i = 0; i < kLengthBytes; ++i)
    length |= uint64_t(field[i]) << (8 * i);
  if (Status s = checkHeaderLength(length, fileBytes); !s)
    return s;
  std::string text(size_t(length), '\0');
  if (!preadAll(fd, text.data(), text.size(), kLengthBytes))
    return Status::error(
        fmt::format("cannot read the header of {} bytes: {}", length,
                    errno ? std::strerror(errno) : "the file ends early (was it truncated?)"));
  if (Status s = parseHeader(text, fileBytes - kLengthBytes - length, out); !s)
    return s;
  *dataStart = kLengthBytes + length;
  return Status::success();
}

std::string headerToJson(const Header &header) {
  json tensors = json::array();
  for (const TensorEntry &e : header.tensors)
    tensors.push_back({{"name", e.name},
                       {"dtype", dtypeName(e.dtype)},
                       {"shape", e.shape},
                       {"begin", e.begin},
                       {"end", e.end}});
  json doc = {{"tensors", std::move(tensors)}, {"metadata", nullptr}};
  if (header.hasMetadata)
    doc["metadata"] = header.metadata;
  return doc.dump();
}

} // namespace moec::safetensors
