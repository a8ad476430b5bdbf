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

#include <cstdint>

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

/// Returns "f32", "bf16", "i32", "i64", "f8e4m3", "i8" or "i4", or "unknown".
inline const char *dtypeName(DType dtype) {
  switch (dtype) {
  case DType::F32:
    return "f32";
  case DType::BF16:
    return "bf16";
  case DType::I32:
    return "i32";
  case DType::I64:
    return "i64";
  case DType::F8E4M3:
    return "f8e4m3";
  case DType::I8:
    return "i8";
  case DType::I4:
    return "i4";
  }
  return "unknown";
}

/// Returns the size in bytes of one element of `dtype` (0 for an unknown one).
inline constexpr uint32_t dtypeSize(DType dtype) {
  switch (dtype) {
  case DType::F32:
  case DType::I32:
    return 4;
  case DType::BF16:
    return 2;
  case DType::I64:
    return 8;
  case DType::F8E4M3:
  case DType::I8:
    return 1;
  case DType::I4: // two a byte: see int4Bytes
    return 0;
  }
  return 0;
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
