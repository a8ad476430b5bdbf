//===- NpyTest.cpp - Tests for the .npy reader and writer -----------------===//

#include "runtime/tooling/Npy.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <dirent.h>
#include <sys/stat.h>

using moec::Status;
using namespace moec::npy;

namespace {

/// Returns a path for a scratch file in the test's temporary folder.
std::string tempPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + name;
}

/// Returns the bytes of the file at `path`; fails the test when it cannot be
/// read.
std::string readBytes(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  INFO("path: " << path);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// Writes `bytes` to `path`, replacing it.
void writeBytes(const std::string &path, const std::string &bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  out.close();
  INFO("path: " << path);
  REQUIRE(out.good());
}

/// Returns the bytes of a .npy file of version `major`.0 whose header is
/// `header` exactly (no padding added) followed by `data`.
std::string npyFile(const std::string &header, const std::string &data = "", int major = 1) {
  std::string bytes = "\x93NUMPY";
  bytes += char(major);
  bytes += char(0);
  size_t lengthBytes = major == 1 ? 2 : 4;
  for (size_t i = 0; i < lengthBytes; ++i)
    bytes += char((header.size() >> (8 * i)) & 0xff);
  return bytes + header + data;
}

/// Returns `count` bytes of data.
std::string someData(size_t count) {
  std::string data(count, '\0');
  for (size_t i = 0; i < count; ++i)
    data[i] = char(i * 7 + 1);
  return data;
}

/// An array that a failed read must leave as it is.
NpyArray sentinel() {
  NpyArray array;
  array.type = NpyType::I64;
  array.shape = {7};
  array.data.assign(56, 0xab);
  return array;
}

/// Writes `bytes` to a scratch file named `name`, reads it, and returns the
/// error; fails the test when the read succeeds or changes the output.
std::string readError(const std::string &name, const std::string &bytes) {
  std::string path = tempPath(name);
  writeBytes(path, bytes);
  NpyArray array = sentinel();
  Status status = readNpy(path, &array);
  INFO("file: " << name);
  REQUIRE_FALSE(status.ok());
  NpyArray untouched = sentinel();
  CHECK(array.type == untouched.type);
  CHECK(array.shape == untouched.shape);
  CHECK(array.data == untouched.data);
  return status.message();
}

/// Reads `bytes` as a scratch file named `name`; fails the test on an error.
NpyArray readOk(const std::string &name, const std::string &bytes) {
  std::string path = tempPath(name);
  writeBytes(path, bytes);
  NpyArray array;
  Status status = readNpy(path, &array);
  INFO("file: " << name << " error: " << status.message());
  REQUIRE(status.ok());
  return array;
}

/// Returns an array of `type` and `shape` whose elements are distinct values
/// of that type, negative ones and extremes among them.
NpyArray makeArray(NpyType type, std::vector<int64_t> shape) {
  NpyArray array;
  array.type = type;
  array.shape = std::move(shape);
  int64_t count = array.elements();
  array.data.resize(size_t(count) * array.elementSize());
  for (int64_t i = 0; i < count; ++i) {
    double value = (double(i) - 3.0) * 1.25;
    switch (type) {
    case NpyType::F32:
      array.as<float>()[i] = i == 1 ? std::numeric_limits<float>::denorm_min() : float(value);
      break;
    case NpyType::F64:
      array.as<double>()[i] = i == 1 ? std::numeric_limits<double>::max() : value;
      break;
    case NpyType::I32:
      array.as<int32_t>()[i] = i == 1 ? std::numeric_limits<int32_t>::min() : int32_t(i * 37 - 50);
      break;
    case NpyType::I64:
      array.as<int64_t>()[i] =
          i == 1 ? std::numeric_limits<int64_t>::min() : int64_t(i) * 10000000000 - 7;
      break;
    }
  }
  return array;
}

/// Returns the names of the files in the folder `dir`.
std::vector<std::string> listFolder(const std::string &dir) {
  std::vector<std::string> names;
  if (DIR *handle = opendir(dir.c_str())) {
    while (dirent *entry = readdir(handle)) {
      std::string name = entry->d_name;
      if (name != "." && name != "..")
        names.push_back(name);
    }
    closedir(handle);
  }
  return names;
}

/// Makes a fresh empty folder `name` in the scratch folder; returns its path.
std::string makeFolder(const std::string &name) {
  std::string dir = tempPath(name);
  mkdir(dir.c_str(), 0777);
  for (const std::string &file : listFolder(dir))
    std::remove((dir + "/" + file).c_str());
  return dir;
}

} // namespace

//===----------------------------------------------------------------------===//
// Types and shapes
//===----------------------------------------------------------------------===//

TEST_CASE("type names, sizes and shapes", "[npy]") {
  CHECK(std::string(npyTypeName(NpyType::F32)) == "float32");
  CHECK(std::string(npyTypeName(NpyType::F64)) == "float64");
  CHECK(std::string(npyTypeName(NpyType::I32)) == "int32");
  CHECK(std::string(npyTypeName(NpyType::I64)) == "int64");
  CHECK(npyTypeSize(NpyType::F32) == 4);
  CHECK(npyTypeSize(NpyType::F64) == 8);
  CHECK(npyTypeSize(NpyType::I32) == 4);
  CHECK(npyTypeSize(NpyType::I64) == 8);
  CHECK(npyTypeOf<float>() == NpyType::F32);
  CHECK(npyTypeOf<int64_t>() == NpyType::I64);

  CHECK(formatShape({}) == "()");
  CHECK(formatShape({3}) == "(3,)");
  CHECK(formatShape({2, 3, 4}) == "(2, 3, 4)");

  NpyArray array;
  CHECK(array.elements() == 1); // 0-d
  array.shape = {2, 3, 4};
  CHECK(array.elements() == 24);
  array.shape = {5, 0, 2};
  CHECK(array.elements() == 0);
}

//===----------------------------------------------------------------------===//
// Round trips and the written bytes
//===----------------------------------------------------------------------===//

TEST_CASE("every type round-trips in every shape", "[npy]") {
  const std::vector<std::vector<int64_t>> shapes = {{},     {1},       {5},          {0},    {2, 3},
                                                    {3, 0}, {2, 0, 4}, {1, 2, 3, 4}, {17, 3}};
  for (NpyType type : {NpyType::F32, NpyType::F64, NpyType::I32, NpyType::I64}) {
    for (const auto &shape : shapes) {
      NpyArray array = makeArray(type, shape);
      std::string path = tempPath("roundtrip.npy");
      INFO("type: " << npyTypeName(type) << " shape: " << formatShape(shape));
      Status written = writeNpy(path, array);
      INFO("error: " << written.message());
      REQUIRE(written.ok());

      std::string bytes = readBytes(path);
      REQUIRE(bytes.size() >= 10);
      size_t offset = 10 + (uint8_t(bytes[8]) | uint8_t(bytes[9]) << 8);
      CHECK(offset % 64 == 0);
      CHECK(bytes.size() == offset + array.data.size());
      CHECK(bytes.compare(offset, std::string::npos,
                          std::string(array.data.begin(), array.data.end())) == 0);

      NpyArray back = sentinel();
      Status read = readNpy(path, &back);
      INFO("error: " << read.message());
      REQUIRE(read.ok());
      CHECK(back.type == type);
      CHECK(back.shape == shape);
      CHECK(back.data == array.data);
    }
  }
}

TEST_CASE("the pointer overload writes the same file", "[npy]") {
  std::vector<double> values = {1.5, -2.0, 3.25, 0.0, 1e300, -1e-300};
  std::string path = tempPath("pointer.npy");
  REQUIRE(writeNpy(path, NpyType::F64, {3, 2}, values.data()).ok());
  NpyArray back;
  REQUIRE(readNpy(path, &back).ok());
  CHECK(back.type == NpyType::F64);
  CHECK(back.shape == std::vector<int64_t>{3, 2});
  REQUIRE(back.elements() == 6);
  for (size_t i = 0; i < values.size(); ++i)
    CHECK(back.as<double>()[i] == values[i]);

  // No data is fine only when there are no elements.
  REQUIRE(writeNpy(path, NpyType::I32, {4, 0}, nullptr).ok());
  REQUIRE(readNpy(path, &back).ok());
  CHECK(back.shape == std::vector<int64_t>{4, 0});
  CHECK(back.data.empty());
  Status status = writeNpy(path, NpyType::I32, {2}, nullptr);
  CHECK(status.message() == path + ": no data for shape (2,) of int32");
}

TEST_CASE("the written header is np.save's, byte for byte", "[npy]") {
  std::string path = tempPath("header.npy");
  NpyArray array = makeArray(NpyType::F32, {2, 3});
  REQUIRE(writeNpy(path, array).ok());
  std::string bytes = readBytes(path);

  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  REQUIRE(dict.size() == 59);
  // 10 bytes of prefix + 59 of dict + 58 spaces + '\n' = 128.
  std::string expected = std::string("\x93NUMPY\x01\x00", 8) + std::string("\x76\x00", 2) + dict +
                         std::string(58, ' ') + "\n";
  REQUIRE(expected.size() == 128);
  CHECK(bytes.substr(0, 128) == expected);
  CHECK(bytes.size() == 128 + 24);

  // Other shapes and types, as Python writes their tuples; each header is
  // padded to 128 bytes.
  struct Case {
    NpyType type;
    std::vector<int64_t> shape;
    std::string dict;
    size_t dataBytes;
  };
  for (const Case &c : {
           Case{NpyType::I64, {}, "{'descr': '<i8', 'fortran_order': False, 'shape': (), }", 8},
           Case{NpyType::F64, {3}, "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", 24},
           Case{NpyType::I32,
                {2, 0, 4},
                "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 0, 4), }",
                0},
       }) {
    INFO("dict: " << c.dict);
    REQUIRE(writeNpy(path, makeArray(c.type, c.shape)).ok());
    bytes = readBytes(path);
    REQUIRE(bytes.size() == 128 + c.dataBytes);
    CHECK(bytes.substr(0, 10) == std::string("\x93NUMPY\x01\x00\x76\x00", 10));
    CHECK(bytes.substr(10, c.dict.size()) == c.dict);
    CHECK(bytes.substr(10 + c.dict.size(), 127 - 10 - c.dict.size()) ==
          std::string(127 - 10 - c.dict.size(), ' '));
    CHECK(bytes[127] == '\n');
  }
}

TEST_CASE("a header over 65535 bytes is written as version 2.0", "[npy]") {
  // 30000 dimensions of 1: "1, " each, about 90000 bytes of header.
  std::vector<int64_t> shape(30000, 1);
  std::string path = tempPath("version2.npy");
  NpyArray array = makeArray(NpyType::I32, shape);
  REQUIRE(writeNpy(path, array).ok());
  std::string bytes = readBytes(path);
  REQUIRE(bytes.size() > 12);
  CHECK(bytes[6] == 2);
  CHECK(bytes[7] == 0);
  size_t headerSize = size_t(uint8_t(bytes[8])) | size_t(uint8_t(bytes[9])) << 8 |
                      size_t(uint8_t(bytes[10])) << 16 | size_t(uint8_t(bytes[11])) << 24;
  CHECK(headerSize > 65535);
  CHECK((12 + headerSize) % 64 == 0);
  CHECK(bytes[12 + headerSize - 1] == '\n');
  CHECK(bytes.size() == 12 + headerSize + 4);

  NpyArray back;
  REQUIRE(readNpy(path, &back).ok());
  CHECK(back.shape == shape);
  CHECK(back.data == array.data);
}

//===----------------------------------------------------------------------===//
// Headers written by others
//===----------------------------------------------------------------------===//

TEST_CASE("headers with any key order and spacing are read", "[npy]") {
  std::string data = someData(24);

  NpyArray a = readOk("spacing.npy", npyFile("{ \"shape\" :( 2 ,3 ) ,\"descr\":\"<i4\","
                                             "\t'fortran_order' :\tFalse }\n",
                                             data));
  CHECK(a.type == NpyType::I32);
  CHECK(a.shape == std::vector<int64_t>{2, 3});
  CHECK(std::string(a.data.begin(), a.data.end()) == data);

  // No trailing comma, no padding, no newline, keys reversed.
  NpyArray b =
      readOk("order.npy", npyFile("{'shape':(3,),'fortran_order':False,'descr':'<f8'}", data));
  CHECK(b.type == NpyType::F64);
  CHECK(b.shape == std::vector<int64_t>{3});

  // Newlines inside the dict, a trailing comma in the shape, native order.
  NpyArray c = readOk("newlines.npy", npyFile("{\n  'descr': '=f4',\n  'fortran_order': False,\n"
                                              "  'shape': (1, 2, 3,),\n}   \n",
                                              data));
  CHECK(c.type == NpyType::F32);
  CHECK(c.shape == std::vector<int64_t>{1, 2, 3});

  // A 0-d array and an empty one.
  NpyArray d = readOk("scalar.npy", npyFile("{'descr': '<i8', 'fortran_order': False, "
                                            "'shape': ( ), }",
                                            someData(8)));
  CHECK(d.shape.empty());
  CHECK(d.data.size() == 8);
  NpyArray e =
      readOk("empty.npy", npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 5)}"));
  CHECK(e.shape == std::vector<int64_t>{0, 5});
  CHECK(e.data.empty());

  // Python 2's long integers.
  NpyArray f = readOk("long.npy", npyFile("{'descr': '<i4', 'fortran_order': False, "
                                          "'shape': (2L, 3L), }",
                                          data));
  CHECK(f.shape == std::vector<int64_t>{2, 3});
}

TEST_CASE("version 2.0 and 3.0 headers are read", "[npy]") {
  std::string header = "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }";
  std::string data = someData(16);
  for (int major : {2, 3}) {
    INFO("version " << major);
    NpyArray array = readOk("v" + std::to_string(major) + ".npy", npyFile(header, data, major));
    CHECK(array.type == NpyType::I64);
    CHECK(array.shape == std::vector<int64_t>{2});
    CHECK(std::string(array.data.begin(), array.data.end()) == data);
  }
}

//===----------------------------------------------------------------------===//
// Errors
//===----------------------------------------------------------------------===//

TEST_CASE("files that are not .npy files are refused", "[npy]") {
  std::string missing = tempPath("no-such-file.npy");
  NpyArray array = sentinel();
  Status status = readNpy(missing, &array);
  CHECK(status.message() == missing + ": cannot open: No such file or directory");
  CHECK(array.data == sentinel().data);

  std::string path = tempPath("bad-magic.npy");
  CHECK(readError("bad-magic.npy", "PK\x03\x04 a zip file") ==
        path + ": not a .npy file (bad magic)");
  CHECK(readError("bad-magic.npy", "") == path + ": not a .npy file (bad magic)");
  CHECK(readError("bad-magic.npy", "\x93NUM") == path + ": not a .npy file (bad magic)");

  path = tempPath("short.npy");
  CHECK(readError("short.npy", std::string("\x93NUMPY\x01\x00\x10", 9)) ==
        path + ": truncated: 9 bytes, too short for a .npy header");
  CHECK(readError("short.npy", std::string("\x93NUMPY\x01\x00\x40\x00{'descr'", 18)) ==
        path + ": truncated: header says 64 bytes of header, file has 8");

  path = tempPath("version.npy");
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (), }";
  CHECK(readError("version.npy", npyFile(header, someData(4), 4)) ==
        path + ": unsupported .npy version 4.0: expected 1.0, 2.0 or 3.0");
  std::string bytes = npyFile(header, someData(4));
  bytes[7] = 1;
  CHECK(readError("version.npy", bytes) ==
        path + ": unsupported .npy version 1.1: expected 1.0, 2.0 or 3.0");
}

TEST_CASE("unsupported dtypes and layouts are refused", "[npy]") {
  std::string path = tempPath("dtype.npy");
  auto withDescr = [](const std::string &descr) {
    return npyFile("{'descr': " + descr + ", 'fortran_order': False, 'shape': (2,), }",
                   someData(16));
  };
  CHECK(readError("dtype.npy", withDescr("'<c8'")) ==
        path + ": unsupported dtype '<c8': expected float32, float64, int32 or int64");
  CHECK(readError("dtype.npy", withDescr("'<f2'")) ==
        path + ": unsupported dtype '<f2': expected float32, float64, int32 or int64");
  CHECK(readError("dtype.npy", withDescr("'<u4'")) ==
        path + ": unsupported dtype '<u4': expected float32, float64, int32 or int64");
  CHECK(readError("dtype.npy", withDescr("'|f4'")) ==
        path + ": unsupported dtype '|f4': expected float32, float64, int32 or int64");
  CHECK(readError("dtype.npy", withDescr("'|b1'")) ==
        path + ": unsupported dtype '|b1': expected float32, float64, int32 or int64");
  CHECK(readError("dtype.npy", withDescr("[('x', '<f4'), ('y', '<f4')]")) ==
        path + ": unsupported dtype [('x', '<f4'), ('y', '<f4')]: expected float32, float64, "
               "int32 or int64");
  CHECK(readError("dtype.npy", withDescr("'>f4'")) ==
        path + ": big-endian dtype '>f4' is not supported; save with a.astype('<f4')");
  CHECK(readError("dtype.npy", withDescr("'>i8'")) ==
        path + ": big-endian dtype '>i8' is not supported; save with a.astype('<i8')");

  path = tempPath("fortran.npy");
  CHECK(
      readError("fortran.npy", npyFile("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                                       someData(24))) ==
      path + ": fortran_order arrays are not supported; save with np.ascontiguousarray");
  CHECK(readError("fortran.npy", npyFile("{'descr': '<f4', 'fortran_order': 0, 'shape': (2, 3), }",
                                         someData(24))) ==
        path + ": bad header: 'fortran_order' is not True or False: 0");
}

TEST_CASE("bad shapes are refused", "[npy]") {
  std::string path = tempPath("shape.npy");
  auto withShape = [](const std::string &shape, size_t dataBytes = 0) {
    return npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }",
                   someData(dataBytes));
  };
  CHECK(readError("shape.npy", withShape("(2, -3)")) ==
        path + ": bad header: negative dimension -3 in shape (2, -3)");
  CHECK(readError("shape.npy", withShape("(99999999999999999999,)")) ==
        path + ": dimension 99999999999999999999 in shape (99999999999999999999,) is too large");
  CHECK(readError("shape.npy", withShape("(4294967296, 4294967296)")) ==
        path + ": bad header: shape (4294967296, 4294967296) has too many elements");
  // Fits in int64_t as elements, not as bytes.
  CHECK(readError("shape.npy", withShape("(4611686018427387904,)")) ==
        path + ": bad header: shape (4611686018427387904,) has too many elements");
  CHECK(readError("shape.npy", withShape("[2, 3]")) ==
        path + ": bad header: 'shape' is not a tuple of integers: [2, 3]");
  CHECK(readError("shape.npy", withShape("(3)")) ==
        path + ": bad header: 'shape' is not a tuple of integers: (3)");
  CHECK(readError("shape.npy", withShape("(2, 'x')")) ==
        path + ": bad header: 'shape' is not a tuple of integers: (2, 'x')");
}

TEST_CASE("malformed header dicts are refused", "[npy]") {
  std::string path = tempPath("dict.npy");
  CHECK(readError("dict.npy", npyFile("{'descr': '<f4', 'shape': (), }", someData(4))) ==
        path + ": bad header: no 'fortran_order' key in \"{'descr': '<f4', 'shape': (), }\"");
  CHECK(readError("dict.npy", npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (), "
                                      "'extra': 1}",
                                      someData(4))) ==
        path + ": bad header: unexpected key 'extra'; expected 'descr', 'fortran_order' and "
               "'shape'");
  CHECK(readError("dict.npy", npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (), "
                                      "'descr': '<f4'}",
                                      someData(4))) ==
        path + ": bad header: duplicate key 'descr'");
  CHECK(readError("dict.npy", npyFile("{'descr': '<f4' 'fortran_order': False}", "")) ==
        path + ": bad header: expected ',' or '}' at offset 16 in \"{'descr': '<f4' "
               "'fortran_order': False}\"");
  CHECK(readError("dict.npy",
                  npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (),", someData(4))) ==
        path + ": bad header: expected '}' at offset 53 in \"{'descr': '<f4', "
               "'fortran_order': False, 'shape': (),\"");
  CHECK(readError("dict.npy", npyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (), }"
                                      " junk",
                                      someData(4))) ==
        path + ": bad header: unexpected text after the dict at offset 56 in \"{'descr': "
               "'<f4', 'fortran_order': False, 'shape': (), } junk\"");
  CHECK(readError("dict.npy", npyFile("['descr', '<f4']", someData(4))) ==
        path + ": bad header: not a dict: \"['descr', '<f4']\"");
  CHECK(readError("dict.npy", npyFile("{'descr: '<f4'}", someData(4))) ==
        path + ": bad header: expected ':' at offset 10 in \"{'descr: '<f4'}\"");
  CHECK(readError("dict.npy", npyFile(std::string(100, '('), "")) ==
        path + ": bad header: literal nested too deeply at offset 33 in \"" +
            std::string(100, '(') + "\"");
}

TEST_CASE("data shorter or longer than the shape is refused", "[npy]") {
  std::string path = tempPath("size.npy");
  std::string header = "{'descr': '<f8', 'fortran_order': False, 'shape': (16, 32), }";
  CHECK(readError("size.npy", npyFile(header, someData(100))) ==
        path + ": truncated: header says 4096 bytes of data, file has 100");
  CHECK(readError("size.npy", npyFile(header, "")) ==
        path + ": truncated: header says 4096 bytes of data, file has 0");
  CHECK(readError("size.npy", npyFile(header, someData(4104))) ==
        path + ": 8 bytes after the data: header says 4096 bytes of data, file has 4104");
  std::string empty = "{'descr': '<f8', 'fortran_order': False, 'shape': (0,), }";
  CHECK(readError("size.npy", npyFile(empty, "x")) ==
        path + ": 1 bytes after the data: header says 0 bytes of data, file has 1");
}

TEST_CASE("writing refuses bad arrays and leaves nothing behind", "[npy]") {
  std::string dir = makeFolder("write-errors");
  std::string path = dir + "/out.npy";

  NpyArray array = makeArray(NpyType::F32, {2, 3});
  array.data.resize(20);
  CHECK(writeNpy(path, array).message() ==
        path + ": data has 20 bytes, but shape (2, 3) of float32 needs 24");
  array = makeArray(NpyType::F32, {2, 3});
  array.shape = {2, -3};
  CHECK(writeNpy(path, array).message() == path + ": negative dimension -3 in shape (2, -3)");
  float value = 1.0f;
  CHECK(writeNpy(path, NpyType::F32, {int64_t(1) << 40, int64_t(1) << 40}, &value).message() ==
        path + ": shape (1099511627776, 1099511627776) has too many elements");
  CHECK(listFolder(dir).empty());

  // A folder that does not exist.
  std::string nowhere = dir + "/missing/out.npy";
  CHECK(writeNpy(nowhere, makeArray(NpyType::I32, {2})).message() ==
        nowhere + ": cannot open for writing: No such file or directory");

  // The target is a folder: refused, and no temporary file is left.
  std::string folder = dir + "/taken";
  REQUIRE(mkdir(folder.c_str(), 0777) == 0);
  Status status = writeNpy(folder, makeArray(NpyType::I32, {2}));
  CHECK(status.message() == folder + ": is a directory, not a file");
  CHECK(listFolder(dir) == std::vector<std::string>{"taken"});

  // A successful write leaves only the file, and replaces an old one.
  REQUIRE(writeNpy(path, makeArray(NpyType::I32, {2})).ok());
  REQUIRE(writeNpy(path, makeArray(NpyType::I64, {3})).ok());
  std::vector<std::string> names = listFolder(dir);
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"out.npy", "taken"});
  NpyArray back;
  REQUIRE(readNpy(path, &back).ok());
  CHECK(back.type == NpyType::I64);
  CHECK(back.shape == std::vector<int64_t>{3});
}
