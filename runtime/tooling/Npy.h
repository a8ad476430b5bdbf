//===- Npy.h - Reading and writing NumPy .npy files ------------*- C++ -*-===//
//
// The tensors that `moec run` reads and writes are NumPy .npy files, so that
// they come from and go back to Python with np.load and np.save. Only what the
// runtime computes with is supported: C-order arrays of little-endian
// float32, float64, int32 or int64, of any rank (0-d included) and any shape
// (zero-sized dimensions included).
//
// A .npy file is the magic "\x93NUMPY", a major and a minor version byte, the
// header length (2 bytes little-endian in version 1.0, 4 bytes in 2.0 and
// 3.0), the header -- the text of a Python dict such as
// `{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }`, padded with
// spaces and ending with '\n' -- and then the raw bytes of the elements.
//
// The reader takes versions 1.0, 2.0 and 3.0 and parses the dict as a Python
// literal, so the keys may come in any order, with any whitespace and with or
// without a trailing comma. It reads the whole file and checks that the data
// is exactly as long as the header says; anything it does not support
// (another dtype, a big-endian one, Fortran order) is an error that names
// the file and says what was found. The writer writes what np.save writes:
// version 1.0 (2.0 when the header needs more than 65535 bytes), the data
// starting at a multiple of 64 bytes. It writes a temporary file next to the
// target and renames it, so a failed write never leaves a partial file under
// the target's name.
//
// Nothing here throws or exits: every call returns a Status whose message
// starts with the path, and on an error the output is left unchanged.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TOOLING_NPY_H
#define MOEC_RUNTIME_TOOLING_NPY_H

#include "base/Status.h"

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace moec::npy {

/// The element types a .npy file may hold here; in the file they are the
/// descr strings '<f4', '<f8', '<i4' and '<i8'.
enum class NpyType : uint8_t { F32, F64, I32, I64 };

/// Returns the NumPy name of `type`: "float32", "float64", "int32", "int64".
const char *npyTypeName(NpyType type);

/// Returns the size in bytes of one element of `type` (4 or 8).
size_t npyTypeSize(NpyType type);

/// The NpyType of the C++ type T, for T one of float, double, int32_t and
/// int64_t.
template <class T> constexpr NpyType npyTypeOf() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> ||
                    std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>,
                "a .npy element is float, double, int32_t or int64_t");
  if constexpr (std::is_same_v<T, float>)
    return NpyType::F32;
  else if constexpr (std::is_same_v<T, double>)
    return NpyType::F64;
  else if constexpr (std::is_same_v<T, int32_t>)
    return NpyType::I32;
  else
    return NpyType::I64;
}

/// An array as a .npy file holds it: an element type, a shape (empty for a
/// 0-d array, which has one element), and the elements in C order as raw
/// little-endian bytes.
struct NpyArray {
  /// The element type.
  NpyType type = NpyType::F32;
  /// The extent of each dimension, outermost first; every extent is >= 0.
  std::vector<int64_t> shape;
  /// The elements, C order, `elements() * elementSize()` bytes.
  std::vector<uint8_t> data;

  /// Returns the number of elements: the product of the extents, 1 for a 0-d
  /// array.
  int64_t elements() const;

  /// Returns the size in bytes of one element.
  size_t elementSize() const { return npyTypeSize(type); }

  /// Returns the elements as T, which must be the C++ type of `type` (see
  /// npyTypeOf). The bytes come from operator new, so they are aligned for
  /// every element type.
  template <class T> const T *as() const {
    assert(type == npyTypeOf<T>() && "NpyArray::as<T>() with the wrong T");
    return reinterpret_cast<const T *>(data.data());
  }

  /// Returns the elements as T, which must be the C++ type of `type`.
  template <class T> T *as() {
    assert(type == npyTypeOf<T>() && "NpyArray::as<T>() with the wrong T");
    return reinterpret_cast<T *>(data.data());
  }
};

/// Returns a shape as Python writes a tuple: "()", "(3,)", "(2, 3, 4)".
std::string formatShape(const std::vector<int64_t> &shape);

/// Parses the bytes of a whole .npy file; on success moves the elements out
/// of `bytes` into `*out`. Errors name no path (readNpy adds it).
Status parseNpy(std::vector<uint8_t> &bytes, NpyArray *out);

/// Reads the .npy file at `path` (version 1.0, 2.0 or 3.0) into `*out`. On an
/// error `*out` is unchanged and the message starts with "PATH: ", e.g.
/// "x.npy: cannot open: No such file or directory" or
/// "x.npy: unsupported dtype '<c8': expected float32, float64, int32 or int64".
Status readNpy(const std::string &path, NpyArray *out);

/// Writes `array` to `path` as np.save would. It is an error when the data's
/// size does not match the shape or a dimension is negative; nothing is
/// written then. The file appears under `path` only once it is complete.
Status writeNpy(const std::string &path, const NpyArray &array);

/// Writes the array of `type` and `shape` whose elements (C order,
/// little-endian) start at `data` to `path`, like the overload above. `data`
/// may be null only when the shape has no elements.
Status writeNpy(const std::string &path, NpyType type, const std::vector<int64_t> &shape,
                const void *data);

} // namespace moec::npy

#endif // MOEC_RUNTIME_TOOLING_NPY_H
