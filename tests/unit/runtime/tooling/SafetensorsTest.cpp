//===- SafetensorsTest.cpp - Tests for the safetensors header checker -----===//

#include "runtime/tooling/Safetensors.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

using moec::Status;
using namespace moec::safetensors;
using Catch::Matchers::Contains;
using namespace std::string_literals;

namespace {

/// The text of one tensor entry.
std::string entry(const std::string &dtype, const std::string &shape, uint64_t begin,
                  uint64_t end) {
  return "{\"dtype\": \"" + dtype + "\", \"shape\": " + shape + ", \"data_offsets\": [" +
         std::to_string(begin) + ", " + std::to_string(end) + "]}";
}

/// The text of a header of one tensor, 'x'.
std::string onlyX(const std::string &dtype, const std::string &shape, uint64_t begin,
                  uint64_t end) {
  return "{\"x\": " + entry(dtype, shape, begin, end) + "}";
}

/// parseHeader's error message for `header` over `dataBytes`; fails the test
/// when it accepts the header.
std::string refusal(const std::string &header, uint64_t dataBytes) {
  Header out;
  Status s = parseHeader(header, dataBytes, &out);
  INFO("header: " << header);
  REQUIRE_FALSE(s.ok());
  REQUIRE_FALSE(s.message().empty());
  return s.message();
}

/// parseHeader's result for `header` over `dataBytes`; fails the test when it
/// refuses the header.
Header accepted(const std::string &header, uint64_t dataBytes) {
  Header out;
  Status s = parseHeader(header, dataBytes, &out);
  INFO("header: " << header << "\nerror: " << s.message());
  REQUIRE(s.ok());
  return out;
}

/// The bytes of a safetensors file: the length field, `header`, `dataBytes`
/// zero bytes.
std::string fileBytes(const std::string &header, size_t dataBytes, uint64_t length = ~0ull) {
  if (length == ~0ull)
    length = header.size();
  std::string bytes;
  for (int i = 0; i < 8; ++i)
    bytes += char((length >> (8 * i)) & 0xff);
  return bytes + header + std::string(dataBytes, '\0');
}

/// A scratch file holding `bytes`, opened for reading; closed and removed
/// with the object.
struct ScratchFile {
  std::string path;
  int fd = -1;
  explicit ScratchFile(const std::string &bytes) {
    const char *dir = std::getenv("TEST_TMPDIR");
    path = std::string(dir ? dir : "/tmp") + "/safetensors-test-XXXXXX";
    fd = ::mkstemp(path.data());
    REQUIRE(fd >= 0);
    REQUIRE(::write(fd, bytes.data(), bytes.size()) == ssize_t(bytes.size()));
  }
  ~ScratchFile() {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

/// readHeader's error message for a file of `bytes` said to be `size` bytes
/// long; fails the test when it accepts the file.
std::string readRefusal(const std::string &bytes, uint64_t size) {
  ScratchFile f(bytes);
  Header h;
  uint64_t start = 0;
  Status s = readHeader(f.fd, size, &h, &start);
  REQUIRE_FALSE(s.ok());
  return s.message();
}

} // namespace

TEST_CASE("dtypes: names and sizes", "[safetensors]") {
  const std::vector<std::pair<std::string, size_t>> all = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"I64", 8},
      {"I32", 4}, {"I16", 2}, {"I8", 1},  {"U8", 1},   {"BOOL", 1}};
  for (const auto &[name, size] : all) {
    Dtype d;
    REQUIRE(dtypeFromName(name, &d));
    CHECK(dtypeName(d) == name);
    CHECK(dtypeSize(d) == size);
  }
  Dtype d;
  CHECK_FALSE(dtypeFromName("C64", &d));
  CHECK_FALSE(dtypeFromName("f32", &d));
  CHECK_FALSE(dtypeFromName("", &d));
}

TEST_CASE("a header of every dtype, in any key order, comes back in offset order",
          "[safetensors]") {
  // 8 + 4 + 2 + 2 + 1 + 8 + 4 + 2 + 1 + 1 + 1 bytes, named so that name order
  // is not offset order.
  const std::string header =
      "{\"k\": " + entry("BOOL", "[1]", 33, 34) + ", \"a\": " + entry("F64", "[1]", 0, 8) +
      ", \"j\": " + entry("U8", "[1]", 32, 33) + ", \"b\": " + entry("F32", "[1]", 8, 12) +
      ", \"c\": " + entry("F16", "[1]", 12, 14) + ", \"d\": " + entry("BF16", "[1]", 14, 16) +
      ", \"e\": " + entry("F8_E4M3", "[1]", 16, 17) + ", \"f\": " + entry("I64", "[1]", 17, 25) +
      ", \"g\": " + entry("I32", "[1]", 25, 29) + ", \"h\": " + entry("I16", "[1]", 29, 31) +
      ", \"i\": " + entry("I8", "[1]", 31, 32) + "}";
  Header h = accepted(header, 34);
  REQUIRE(h.tensors.size() == 11);
  std::string names;
  uint64_t at = 0;
  for (const TensorEntry &t : h.tensors) {
    names += t.name;
    CHECK(t.begin == at);
    CHECK(t.end - t.begin == dtypeSize(t.dtype));
    at = t.end;
  }
  CHECK(names == "abcdefghijk");
  CHECK(h.tensors[4].dtype == Dtype::F8_E4M3);
  CHECK_FALSE(h.hasMetadata);
  CHECK(h.metadata.empty());
}

TEST_CASE("good headers: shapes, metadata, padding, empty tensors", "[safetensors]") {
  SECTION("a 0-d tensor holds one element") {
    Header h = accepted("{\"s\": " + entry("F32", "[]", 0, 4) + "}", 4);
    REQUIRE(h.tensors.size() == 1);
    CHECK(h.tensors[0].shape.empty());
  }
  SECTION("a shape") {
    Header h = accepted("{\"w\": " + entry("BF16", "[2, 3, 4]", 0, 48) + "}", 48);
    CHECK(h.tensors[0].shape == std::vector<int64_t>{2, 3, 4});
  }
  SECTION("metadata, and spaces after the object") {
    Header h = accepted("{\"__metadata__\": {\"format\": \"pt\", \"note\": \"\xc3\xa9\"}, \"x\": " +
                            entry("U8", "[2]", 0, 2) + "}      ",
                        2);
    CHECK(h.hasMetadata);
    CHECK(h.metadata == std::map<std::string, std::string>{{"format", "pt"}, {"note", "\xc3\xa9"}});
  }
  SECTION("null metadata reads as none") {
    Header h = accepted("{\"__metadata__\": null}", 0);
    CHECK_FALSE(h.hasMetadata);
  }
  SECTION("empty metadata is metadata") {
    Header h = accepted("{\"__metadata__\": {}}", 0);
    CHECK(h.hasMetadata);
  }
  SECTION("no tensors, no data") { CHECK(accepted("{}", 0).tensors.empty()); }
  SECTION("empty tensors anywhere, a zero extent beside a huge one") {
    Header h = accepted("{\"b\": " + entry("F32", "[2]", 0, 8) +
                            ", \"a\": " + entry("F32", "[0, 4]", 0, 0) +
                            ", \"c\": " + entry("I64", "[9223372036854775807, 0]", 8, 8) + "}",
                        8);
    REQUIRE(h.tensors.size() == 3);
    CHECK(h.tensors[0].name == "a");
    CHECK(h.tensors[1].name == "b");
    CHECK(h.tensors[2].name == "c");
  }
}

TEST_CASE("headerToJson: the normalized header", "[safetensors]") {
  Header h =
      accepted("{\"__metadata__\": {\"format\": \"pt\"}, \"y\": " + entry("I8", "[3]", 8, 11) +
                   ", \"x\": " + entry("F32", "[2]", 0, 8) + "}",
               11);
  nlohmann::json doc = nlohmann::json::parse(headerToJson(h));
  REQUIRE(doc["tensors"].size() == 2);
  CHECK(
      doc["tensors"][0] ==
      nlohmann::json({{"name", "x"}, {"dtype", "F32"}, {"shape", {2}}, {"begin", 0}, {"end", 8}}));
  CHECK(doc["tensors"][1]["name"] == "y");
  CHECK(doc["metadata"] == nlohmann::json({{"format", "pt"}}));
  CHECK(nlohmann::json::parse(headerToJson(accepted("{}", 0)))["metadata"].is_null());
  CHECK(nlohmann::json::parse(headerToJson(accepted("{}", 0)))["tensors"].empty());
}

TEST_CASE("the length field", "[safetensors]") {
  CHECK(checkHeaderLength(2, 10).ok());
  CHECK(checkHeaderLength(0, 8).ok());
  CHECK_THAT(checkHeaderLength(0, 3).message(),
             Contains("3 bytes, shorter than the 8-byte header length"));
  CHECK_THAT(checkHeaderLength(200'000'000, 1ull << 40).message(),
             Contains("a header of 200000000 bytes, over the 100000000-byte limit"));
  CHECK_THAT(checkHeaderLength(4096, 10).message(),
             Contains("a header of 4096 bytes in a file of 10 (truncated, or not safetensors)"));
  CHECK_THAT(checkHeaderLength(~0ull, 10).message(), Contains("over the 100000000-byte limit"));
  CHECK_THAT(checkHeaderLength(3, 10).message(), Contains("a header of 3 bytes in a file of 10"));
}

TEST_CASE("the text of the header", "[safetensors]") {
  SECTION("over 100 MB") {
    std::string big = "{}" + std::string(kMaxHeaderBytes - 1, ' ');
    CHECK_THAT(refusal(big, 0), Contains("over the 100000000-byte limit"));
  }
  SECTION("not UTF-8") {
    for (const std::string &bad : {"{\"\xff\": 1}"s, "{\"\xc0\xaf\": 1}"s, "{\"\xed\xa0\x80\": 1}"s,
                                   "{\"\xf4\x90\x80\x80\": 1}"s, "{\"\xe2\x82\": 1}"s, "{} \xc3"s})
      CHECK_THAT(refusal(bad, 0), Contains("the header is not UTF-8 text"));
    CHECK_THAT(refusal("{\"\xff\": 1}", 0), Contains("byte 0xff at offset 2"));
  }
  SECTION("not JSON") {
    for (const std::string &bad : {"{\"x\": "s, "{\"x\": NaN}"s, "{} x"s, ""s, "{\"x\": 1e999}"s,
                                   "{\"x\": Infinity}"s, "{} \0"s})
      CHECK_THAT(refusal(bad, 0), Contains("the header is not JSON"));
    CHECK_THAT(refusal("{\"x\": ", 0), Contains("at offset"));
    // nlohmann alone would stop at the NUL and take the object before it
    CHECK_THAT(refusal("{}\0{\"x\": 1}"s, 0), Contains("a NUL byte at offset 2"));
  }
  SECTION("not an object") {
    CHECK_THAT(refusal("[1, 2]", 0), Contains("the header is an array, not an object"));
    CHECK_THAT(refusal("\"x\"", 0), Contains("the header is a string, not an object"));
    CHECK_THAT(refusal("null", 0), Contains("the header is null, not an object"));
    CHECK_THAT(refusal("7", 0), Contains("the header is a number, not an object"));
  }
  SECTION("nested too deeply") {
    std::string deep = "{\"__metadata__\": " + std::string(100, '[') + std::string(100, ']') + "}";
    CHECK_THAT(refusal(deep, 0), Contains("nested deeper than"));
  }
  SECTION("a tensor named twice: the last would win in a plain parser") {
    const std::string e = entry("U8", "[1]", 0, 1);
    CHECK_THAT(refusal("{\"a\": " + e + ", \"a\": " + e + "}", 1),
               Contains("the header: key 'a' appears twice in one object"));
  }
  SECTION("a metadata key twice") {
    CHECK_THAT(refusal("{\"__metadata__\": {\"k\": \"1\", \"k\": \"2\"}}", 0),
               Contains("key 'k' appears twice"));
  }
}

TEST_CASE("one entry's fields", "[safetensors]") {
  SECTION("not an object") {
    CHECK_THAT(refusal("{\"x\": [1]}", 0), Contains("tensor 'x': its entry is an array, not an "
                                                    "object"));
  }
  SECTION("a field missing") {
    CHECK_THAT(refusal("{\"x\": {\"shape\": [1], \"data_offsets\": [0, 1]}}", 1),
               Contains("tensor 'x': no 'dtype'"));
    CHECK_THAT(refusal("{\"x\": {\"dtype\": \"U8\", \"data_offsets\": [0, 1]}}", 1),
               Contains("tensor 'x': no 'shape'"));
    CHECK_THAT(refusal("{\"x\": {\"dtype\": \"U8\", \"shape\": [1]}}", 1),
               Contains("tensor 'x': no 'data_offsets'"));
  }
  SECTION("an unknown field") {
    CHECK_THAT(refusal("{\"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1], "
                       "\"scale\": 2}}",
                       1),
               Contains("tensor 'x': unknown key 'scale'"));
  }
  SECTION("dtypes") {
    CHECK_THAT(refusal(onlyX("C64", "[1]", 0, 8), 8),
               Contains("tensor 'x': unknown dtype 'C64' (known: F64, F32, F16, BF16, F8_E4M3, "
                        "I64, I32, I16, I8, U8, BOOL)"));
    CHECK_THAT(refusal("{\"x\": {\"dtype\": 4, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4),
               Contains("tensor 'x': unknown dtype 4"));
  }
  SECTION("shapes") {
    for (const char *shape : {"[-2]", "[2.0]", "[true]", "2", "null", "[[2]]", "[\"2\"]",
                              "[9223372036854775808]", "[18446744073709551616]"})
      CHECK_THAT(refusal(onlyX("U8", shape, 0, 2), 2),
                 Contains("tensor 'x': shape") && Contains("is not a list of sizes >= 0"));
    CHECK_THAT(refusal(onlyX("U8", "[-2]", 0, 2), 2),
               Contains("tensor 'x': shape [-2] is not a list"));
  }
  SECTION("a shape whose byte count overflows") {
    CHECK_THAT(refusal(onlyX("F32", "[4611686018427387904, 4]", 0, 0), 0),
               Contains("tensor 'x': shape [4611686018427387904, 4] of F32 has too many elements"));
    CHECK_THAT(refusal(onlyX("F64", "[2305843009213693952]", 0, 0), 0),
               Contains("has too many elements"));
  }
  SECTION("offsets that are not two sizes") {
    for (const char *offsets : {"[0]", "[0, 1, 2]", "[-1, 1]", "[0, 1.0]", "[0, true]", "\"0-1\"",
                                "[0, 18446744073709551616]"})
      CHECK_THAT(refusal("{\"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": " +
                             std::string(offsets) + "}}",
                         1),
                 Contains("tensor 'x': data_offsets") && Contains("is not [begin, end]"));
  }
  SECTION("offsets that end before they begin") {
    CHECK_THAT(refusal(onlyX("U8", "[0]", 4, 0), 4),
               Contains("tensor 'x': data_offsets [4, 0] end before they begin"));
  }
  SECTION("offsets past the data area") {
    CHECK_THAT(refusal(onlyX("F32", "[4]", 0, 16), 10),
               Contains("tensor 'x': data_offsets [0, 16] run past the data area of 10 bytes "
                        "(a truncated file?)"));
    CHECK_THAT(refusal(onlyX("U8", "[1]", 18446744073709551614ull, 18446744073709551615ull), 1),
               Contains("run past the data area"));
  }
  SECTION("bytes that disagree with the shape") {
    CHECK_THAT(
        refusal(onlyX("F32", "[3]", 0, 8), 8),
        Contains("tensor 'x': shape [3] of F32 is 12 bytes; its data_offsets [0, 8] hold 8"));
    CHECK_THAT(refusal(onlyX("BF16", "[]", 0, 4), 4),
               Contains("tensor 'x': shape [] of BF16 is 2 bytes"));
  }
}

TEST_CASE("the entries together tile the data area", "[safetensors]") {
  SECTION("an overlap names both tensors") {
    CHECK_THAT(refusal("{\"x\": " + entry("F32", "[2]", 0, 8) +
                           ", \"y\": " + entry("F32", "[1]", 4, 8) + "}",
                       8),
               Contains("tensor 'y': data_offsets [4, 8] overlap those of tensor 'x', [0, 8]"));
  }
  SECTION("the same range twice") {
    CHECK_THAT(refusal("{\"x\": " + entry("F32", "[1]", 0, 4) +
                           ", \"y\": " + entry("F32", "[1]", 0, 4) + "}",
                       8),
               Contains("tensor 'y': data_offsets [0, 4] overlap those of tensor 'x'"));
  }
  SECTION("an empty tensor inside another") {
    CHECK_THAT(refusal("{\"x\": " + entry("F32", "[2]", 0, 8) +
                           ", \"e\": " + entry("F32", "[0]", 4, 4) + "}",
                       8),
               Contains("tensor 'e'") && Contains("overlap those of tensor 'x'"));
  }
  SECTION("a gap between two") {
    CHECK_THAT(refusal("{\"x\": " + entry("F32", "[1]", 0, 4) +
                           ", \"y\": " + entry("F32", "[1]", 8, 12) + "}",
                       12),
               Contains("tensor 'y': data_offsets [8, 12] leave a gap of 4 bytes after tensor "
                        "'x', which ends at 4"));
  }
  SECTION("a gap at the start") {
    CHECK_THAT(refusal(onlyX("F32", "[1]", 4, 8), 8),
               Contains("tensor 'x': data_offsets [4, 8] leave a gap of 4 bytes at the start of "
                        "the data area"));
  }
  SECTION("bytes after the last") {
    CHECK_THAT(refusal(onlyX("F32", "[2]", 0, 8), 12),
               Contains("the tensors end at byte 8 of a data area of 12 bytes: the 4 bytes after "
                        "tensor 'x' belong to none"));
  }
  SECTION("data and no tensors") {
    CHECK_THAT(refusal("{}", 3), Contains("no tensors, but a data area of 3 bytes"));
    CHECK_THAT(refusal("{\"__metadata__\": {}}", 3), Contains("no tensors"));
  }
}

TEST_CASE("metadata", "[safetensors]") {
  CHECK_THAT(refusal("{\"__metadata__\": {\"a\": 1}}", 0),
             Contains("__metadata__: the value of 'a' is a number (1), not a string"));
  CHECK_THAT(refusal("{\"__metadata__\": {\"a\": [\"x\"]}}", 0),
             Contains("the value of 'a' is an array"));
  CHECK_THAT(refusal("{\"__metadata__\": {\"a\": null}}", 0), Contains("the value of 'a' is null"));
  CHECK_THAT(refusal("{\"__metadata__\": [\"a\"]}", 0),
             Contains("__metadata__ is an array, not an object of strings"));
  CHECK_THAT(refusal("{\"__metadata__\": \"pt\"}", 0), Contains("__metadata__ is a string"));
}

TEST_CASE("an error leaves the output as it was", "[safetensors]") {
  Header h = accepted(onlyX("U8", "[1]", 0, 1), 1);
  CHECK_FALSE(parseHeader("{\"y\": " + entry("U8", "[2]", 0, 2) + "}", 1, &h).ok());
  REQUIRE(h.tensors.size() == 1);
  CHECK(h.tensors[0].name == "x");
}

TEST_CASE("readHeader: a file's length field and header", "[safetensors]") {
  SECTION("a good file") {
    const std::string header = "{\"x\": " + entry("F32", "[2]", 0, 8) + "}  ";
    ScratchFile f(fileBytes(header, 8));
    Header h;
    uint64_t start = 0;
    REQUIRE(readHeader(f.fd, 8 + header.size() + 8, &h, &start).ok());
    CHECK(start == 8 + header.size());
    REQUIRE(h.tensors.size() == 1);
    CHECK(h.tensors[0].shape == std::vector<int64_t>{2});
  }
  SECTION("a file shorter than its length field") {
    CHECK_THAT(readRefusal("\1\2\3", 3),
               Contains("3 bytes, shorter than the 8-byte header length"));
  }
  SECTION("a header longer than the file") {
    CHECK_THAT(readRefusal(fileBytes("{}", 0, 4096), 10),
               Contains("a header of 4096 bytes in a file of 10"));
  }
  SECTION("a header over the limit") {
    CHECK_THAT(readRefusal(fileBytes("{}", 0, 200'000'000), 1ull << 40),
               Contains("over the 100000000-byte limit"));
  }
  SECTION("a truncated data area") {
    const std::string header = onlyX("F32", "[100]", 0, 400);
    CHECK_THAT(readRefusal(fileBytes(header, 100), 8 + header.size() + 100),
               Contains("tensor 'x': data_offsets [0, 400] run past the data area of 100 bytes"));
  }
  SECTION("a file that is shorter than it was said to be") {
    CHECK_THAT(readRefusal(fileBytes("{}", 0, 64), 100),
               Contains("cannot read the header of 64 bytes: the file ends early"));
  }
}
