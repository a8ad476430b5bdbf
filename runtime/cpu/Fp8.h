//===- Fp8.h - FP8 e4m3 values and rows quantized in blocks -----*- C++ -*-===//
//
// FP8 e4m3 as OCP's "E4M3FN" (and torch.float8_e4m3fn, DeepEP's dispatch):
// sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111
// is NaN; the largest finite value is 448 (0.1111.110); subnormals down to
// 2^-9. fp32 -> e4m3 rounds to nearest, ties to even, and saturates: a
// finite value past 448 and an infinity give +-448 (as PTX's
// cvt.rn.satfinite); a NaN gives NaN with its sign. e4m3 -> fp32 is exact.
//
// A quantized row of H values holds, in this order,
//   H bytes        the e4m3 codes of value / scale
//   B fp32 scales  one per block of 128 values (B = ceil(H / 128), the last
//                  block may be shorter), scale = amax(block) / 448
// so it is fp8RowBytes(H) = H + 4 * B bytes long (base/DType.h) and one put
// moves it whole.
// A block of zeros has scale 1 (and codes 0). A block that holds a NaN or an
// infinity gets a NaN scale: it dequantizes to NaN, never to a finite value.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_FP8_H
#define MOEC_RUNTIME_CPU_FP8_H

#include "base/DType.h"

#include <cstddef>
#include <cstdint>

namespace moec::cpu {

/// The largest finite e4m3 value.
constexpr float kFp8Max = 448.0f;

/// The e4m3 code nearest to `value` (ties to even), saturating at +-448.
uint8_t floatToE4m3(float value);

/// The fp32 value of e4m3 code `code` (exact; NaN for S.1111.111).
float e4m3ToFloat(uint8_t code);

/// Quantizes rows [rowBegin, rowEnd) of `src` (`cols` values a row of type
/// `elt`, F32 or BF16, rows `srcLd` elements apart) into rows of `dst`,
/// fp8RowBytes(cols) bytes each, `dstLd` bytes apart.
void quantizeRows(const void *src, DType elt, int64_t srcLd, uint8_t *dst, int64_t dstLd,
                  int64_t rowBegin, int64_t rowEnd, int64_t cols);

/// The inverse: rows [rowBegin, rowEnd) of quantized `src` (`srcLd` bytes
/// apart) as values of type `elt` in `dst` (rows `dstLd` elements apart):
/// code value times its block's scale, rounded once to `elt`.
void dequantizeRows(const uint8_t *src, int64_t srcLd, void *dst, DType elt, int64_t dstLd,
                    int64_t rowBegin, int64_t rowEnd, int64_t cols);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_FP8_H
