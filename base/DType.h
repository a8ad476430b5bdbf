//===- DType.h - The element types of the whole project ---------*- C++ -*-===//
//
// One enum for every tensor's element type: the task binary stores it (one
// byte, these values), the runtime's C API mirrors it (moec_dtype, checked
// equal at compile time), the kernels switch on it, and the config's "fp32" /
// "bf16" parse into it. F8E4M3 is the dtype of quantized dispatch rows and of FP8 weights, I8 and I4
// those of quantized weights. bf16 is the upper half of an IEEE-754 binary32, kept
// as uint16_t bits; arithmetic on it is always fp32.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_DTYPE_H
#define MOEC_BASE_DTYPE_H

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string_view>

namespace moec {

/// Element type of a tensor. The values are the task binary's.
enum class DType : uint8_t {
  F32 = 1,  ///< IEEE-754 binary32
  BF16 = 2, ///< bfloat16, the uint16_t upper half of a binary32
  I32 = 3,
  I64 = 4,
  F8E4M3 = 5, ///< fp8 e4m3 codes (runtime/cpu/Fp8.h): rows quantized in
              ///< blocks, each row followed by its fp32 block scales
  I8 = 6,     ///< int8 codes of a quantized weight (runtime/cpu/Quant.h)
  /// 4-bit codes of a quantized weight, two a byte: a tensor's dims count
  /// codes, its bytes are half as many along its last dim (int4Bytes).
  I4 = 7,
};

/// Each element type's facts, in one table: its name in messages, dumps
/// and binaries ("f32"), its name in a model config ("fp32"; null for the
/// types a config cannot name) and its size in bytes (0 for I4: two a byte,
/// see int4Bytes).
struct DTypeInfo {
  DType dtype;
  const char *name;
  const char *configName;
  uint32_t size;
};

inline constexpr DTypeInfo kDTypes[] = {
    {DType::F32, "f32", "fp32", 4},      {DType::BF16, "bf16", "bf16", 2},
    {DType::I32, "i32", nullptr, 4},     {DType::I64, "i64", nullptr, 8},
    {DType::F8E4M3, "f8e4m3", "fp8_e4m3", 1}, {DType::I8, "i8", nullptr, 1},
    {DType::I4, "i4", nullptr, 0},
};

/// The table's entry of `dtype`, or null for a value outside the enum. The
/// table lies in the enum's order from 1, so the entry is found by its
/// value: kernels call this for every address they form (Matrix::address),
/// where a search of the table cost a loop per call.
inline constexpr const DTypeInfo *dtypeInfo(DType dtype) {
  const auto index = size_t(dtype) - 1;
  return index < std::size(kDTypes) ? &kDTypes[index] : nullptr;
}

constexpr bool dtypesInEnumOrder() {
  for (size_t i = 0; i < std::size(kDTypes); ++i)
    if (size_t(kDTypes[i].dtype) != i + 1)
      return false;
  return true;
}
static_assert(dtypesInEnumOrder(), "kDTypes lists the types in the enum's order, from 1");

/// Returns "f32", "bf16", "i32", "i64", "f8e4m3", "i8" or "i4", or "unknown".
inline constexpr const char *dtypeName(DType dtype) {
  const DTypeInfo *info = dtypeInfo(dtype);
  return info ? info->name : "unknown";
}

/// Returns the size in bytes of one element of `dtype` (0 for I4 and for an
/// unknown one).
inline constexpr uint32_t dtypeSize(DType dtype) {
  const DTypeInfo *info = dtypeInfo(dtype);
  return info ? info->size : 0;
}

/// The config's name of a dtype: "fp32" or "bf16" (a compute dtype, "dtype"),
/// or "fp8_e4m3" (the rows of a quantized dispatch, "dispatch_dtype");
/// "unknown" for a type a config cannot name.
inline constexpr const char *configDTypeName(DType dtype) {
  const DTypeInfo *info = dtypeInfo(dtype);
  return info && info->configName ? info->configName : "unknown";
}

/// Parses a config's name of a dtype ("fp32", "bf16", "fp8_e4m3"); nothing
/// for any other.
inline constexpr std::optional<DType> parseDType(std::string_view name) {
  for (const DTypeInfo &info : kDTypes)
    if (info.configName && name == info.configName)
      return info.dtype;
  return std::nullopt;
}

/// Bytes of a row of `cols` I4 codes: two a byte, the last byte's high half
/// unused when `cols` is odd.
inline constexpr int64_t int4Bytes(int64_t cols) { return (cols + 1) / 2; }

/// Values per fp32 scale of a row of F8E4M3 codes.
inline constexpr int64_t kFp8Block = 128;

/// Bytes of one F8E4M3 row of `cols` values: the codes, then one fp32 scale
/// per block of kFp8Block values (runtime/cpu/Fp8.h).
inline constexpr int64_t fp8RowBytes(int64_t cols) {
  return cols + 4 * ((cols + kFp8Block - 1) / kFp8Block);
}

} // namespace moec

#endif // MOEC_BASE_DTYPE_H
