//===- Quant.h - Quantized weights: int8 rows, int4 groups ------*- C++ -*-===//
//
// The storage of a frozen weight matrix [rows, cols] in the formats other
// than FP8 blocks (runtime/cpu/Fp8.h), and one reader for all of them
// (LayerShape's WeightFormat). A weight stored as Hugging Face's linear
// weights ([out, in]) has a row per output channel and its groups along
// the input dimension.
//
//  - int8 rows (WeightFormat::Int8Channel): int8 codes [rows, cols] and one
//    fp32 scale per row; value = code x scale. quantizeInt8Rows takes
//    scale = amax / 127 and code = the nearest integer to value / scale
//    (ties to even), so codes lie in -127..127.
//  - int4 groups (WeightFormat::Int4Group): 4-bit codes 0..15, two a byte,
//    [rows, ceil(cols / 2)] bytes: value j of a row is the low half of byte
//    j / 2 when j is even, the high half when odd (GPTQ's order within its
//    int32 words, which hold values 8j..8j+7 from the low bits up on a
//    little-endian CPU; the matrix is stored [out, in], not GPTQ's [in, out]).
//    A group is g consecutive values of a row (g = 32, 64 or 128, dividing
//    cols); its scale, and with zero points its zero point, are fp32:
//    scales [rows, cols / g], or (scale, zero) pairs [rows, cols / g, 2].
//    value = (code - zero) x scale, zero 8 without zero points.
//    quantizeInt4Groups: without zero points scale = amax / 7 and code =
//    8 + round(value / scale) clamped to 0..15; with them the group's range
//    with 0 in it, [lo, hi], gives scale = (hi - lo) / 15, zero =
//    round(-lo / scale) (AWQ's min-max rounding) and code = round(value /
//    scale) + zero clamped to 0..15.
// A group (or row) of zeros has scale 1. Values are computed in fp32
// (float(code - zero) x scale) and rounded once to the output type.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_QUANT_H
#define MOEC_RUNTIME_CPU_QUANT_H

#include "base/DType.h"
#include "format/LayerShape.h"
#include "runtime/cpu/Tile.h"

#include <cstddef>
#include <cstdint>

namespace moec::cpu {

/// One expert's quantized weight matrix as stored.
struct QuantizedMatrix {
  WeightFormat format = WeightFormat::Dense;
  const void *codes = nullptr;   ///< [rows, cols] codes (bytes; int4: two a byte)
  const float *scales = nullptr; ///< as the format says
  int64_t rows = 0, cols = 0;
  int64_t group = 0;       ///< Int4Group: values per group
  bool zeroPoints = false; ///< Int4Group: scales are (scale, zero) pairs
};

/// Quantizes the fp32 matrix `src` [rows, cols] (row stride srcLd) into
/// int8 `codes` [rows, cols] and `scales` [rows].
void quantizeInt8Rows(const float *src, int64_t srcLd, int64_t rows, int64_t cols, int8_t *codes,
                      float *scales);

/// Quantizes the fp32 matrix `src` [rows, cols] into 4-bit `codes`
/// [rows, ceil(cols / 2)] bytes and `scales` [rows, cols / group] (or
/// pairs [rows, cols / group, 2] with `zeroPoints`). `group` divides cols.
void quantizeInt4Groups(const float *src, int64_t srcLd, int64_t rows, int64_t cols,
                        int64_t group, bool zeroPoints, uint8_t *codes, float *scales);

/// Quantizes the fp32 matrix `src` [m.rows, m.cols] (row stride srcLd) into
/// `codes` and `scales`, of m's format (m.codes and m.scales are ignored):
/// the three functions above by format.
void quantize(const QuantizedMatrix &m, const float *src, int64_t srcLd, void *codes,
              float *scales);

/// Rows [rowBegin, rowEnd) and columns [colBegin, colEnd) of `m` as values
/// of type `elt` (F32 or BF16) into `dst`, row i, column j at (i - rowBegin)
/// * dstLd + (j - colBegin). Every format, FP8 blocks included.
void dequantize(const QuantizedMatrix &m, int64_t rowBegin, int64_t rowEnd, int64_t colBegin,
                int64_t colEnd, void *dst, DType elt, int64_t dstLd);

/// The columns [c0, c0 + n) of op(B) for a quantized weight `m`, packed
/// for moec's bf16 tile (the packed-weight store, PassOptions::packWeights):
/// op(B) is m^T with `transposed` (m stored [columns, depth]: the forward's
/// read of a weight stored [out, in]), else m (the backward's dX). The
/// codes go in the order of the tile's panels (Tile.h: 48 columns, units of
/// two depth values; 8-bit codes as two rows of 48 bytes a unit, 4-bit ones
/// as 48 bytes, depth 2t in the low half), the scales (and zero points) as
/// the decoder reads them: a row per column per group of depth values (FP8
/// blocks; int8 and int4 read transposed), or a row per depth value with
/// each column's index into it (int8 and int4 as stored). The tile then
/// decodes a panel's depth block straight into its bf16 panel: no
/// transposes, no copy in the stored order; the values are dequantize()'s,
/// bit for bit. packedCodesBytes says how much memory it takes (64-byte
/// aligned); its codes are the weight's (a byte, or half of one, a value),
/// its scales a float a column per group.
size_t packedCodesBytes(const QuantizedMatrix &m, bool transposed, int64_t n);
void packCodes(const QuantizedMatrix &m, bool transposed, int64_t c0, int64_t n, void *dst);

/// The tile's decoder of codes packCodes packed at `packed`
/// (tile::DecodedB::panel; AVX-512, where moec's bf16 tile runs).
tile::DecodedB packedCodesB(const void *packed);

/// `m` as a bf16 B that moec's tile decodes as it goes (tile::DecodedB:
/// dequantize() into bf16, its codes prefetched; where moec's bf16 tile
/// runs, also DecodedB::pairs, dequantize()'s values written straight as
/// the panels' units of m read as stored). It refers to `m`, which must
/// outlive its use.
tile::DecodedB decodedB(const QuantizedMatrix &m);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_QUANT_H
