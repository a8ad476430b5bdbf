//===- TilePack.h - The tile's panels, shared by its micro-kernels -*- C++ -*-===//
//
// Internal to runtime/cpu's tile (Tile.cpp, TileAmx.cpp): the packed panels
// of op(B) that both micro-kernels read (Tile.h says their layout), the
// functions that make them, and the AMX form of gemm. Not part of the
// kernels' interface.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_TILEPACK_H
#define MOEC_RUNTIME_CPU_TILEPACK_H

#include "runtime/cpu/Tile.h"

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace moec::cpu::tile::detail {

/// Columns of a packed panel (three 16-lane vectors).
constexpr int kPanel = kPanelColumns;
/// Depth units per block: the panel, 128 x 48 units, is 24 KiB.
constexpr int64_t kBlockUnits = 128;
/// Depth units per block of the AVX-512 form where B was packed beforehand
/// (tile::packB; its panels are read in place) or a decoder writes the
/// panels straight (DecodedB::panel: quantized codes packed beforehand).
constexpr int64_t kPackedBlockUnits = 512;
/// Columns of C a pass over the whole depth covers (4 panels): its fp32
/// sums (128 rows: 96 KiB) and the block's panels (96 KiB) stay in L2.
constexpr int64_t kGroup = 4 * kPanel;

/// Depth elements per 32-bit unit.
inline int64_t perUnit(bool bf16) { return bf16 ? 2 : 1; }

inline int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// The row stride, in bf16 values, of one panel's part of a decoded B per
/// depth block: a transposed B's kPanel rows of a block's depth, padded off
/// a multiple of 512 bytes (whose rows would share a few L1 sets as the
/// transposes read them); else a block's depth rows of kPanel columns.
inline int64_t decodedLd(bool transB) { return transB ? 2 * kBlockUnits + 32 : kPanel; }

/// Bytes of one panel's part of a decoded B, rounded to cache lines.
inline size_t decodedBytes(bool transB) {
  const int64_t rows = transB ? kPanel : 2 * kBlockUnits;
  return size_t(ceilDiv(rows * decodedLd(transB) * 2, 64) * 64);
}

/// Units [0, units) of the rows [p0, p1) of a row-major matrix `src` (stride
/// `ld` elements), columns [0, cols): unit (t, column j) goes to
/// dst[(j / panelCols) * panelStride + t * dstLd + j % panelCols], and the
/// lanes of the last vector past `cols` are zero. A bf16 unit is the pair of
/// rows p0 + 2t (low half) and p0 + 2t + 1 (high half; zero past p1). Rows
/// are read whole, one after the other. (AVX-512: callers check available.)
void packRows(const void *src, int64_t ld, int64_t p0, int64_t p1, int64_t cols, bool bf16,
              uint32_t *dst, int64_t dstLd, int64_t panelCols, int64_t panelStride);

/// Packs the depth block [p0, p1) of op(B) = B^T (B stored n x k) into
/// panels `panelStride` units apart: 16 x 16 blocks of units by transposes,
/// the edges too (masked loads: units past n zero, and a bf16 pair's high
/// half past p1).
void packTransposed(const void *b, int64_t ldb, int64_t n, int64_t p0, int64_t p1, bool bf16,
                    uint32_t *dst, int64_t panelStride);

/// Writes op(B)'s columns [c0, c0 + cols) (one panel's: c0 a multiple of
/// kPanel, cols at most kPanel) over the depth [p0, p1) from decoder `d` as
/// that panel's units, unit p0 / 2 at `to`: straight, where the decoder
/// writes panels (DecodedB::panel), else decoded into `decoded`
/// (decodedBytes(transB) of memory, in L1) and packed from there. Both forms
/// of gemm read a decoded B through it.
void decodePanel(const DecodedB &d, bool transB, int64_t c0, int64_t cols, int64_t p0, int64_t p1,
                 uint32_t *to, uint16_t *decoded);

#if defined(__x86_64__) || defined(__i386__)
/// Transposes the 16 x 16 block of 32-bit values in r (row s of the result
/// is column s of the input). (AVX-512.)
void transpose16(__m512i (&r)[16]);

/// AddScaled's formula on 16 sums: alpha * sums, then, with `addend`, +
/// its 16 values, each rounded: the explicitly rounded forms, which the
/// compiler does not contract into a fused multiply-add.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512
scaleAdd(__m512 sums, float alpha, const __m512 *addend) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 v = _mm512_mul_round_ps(_mm512_set1_ps(alpha), sums, kNearest);
  return addend ? _mm512_add_round_ps(*addend, v, kNearest) : v;
}

/// AddScaled's step on 16 sums as they leave the registers: scaleAdd with,
/// where `addend` is not null, the 16 values there (bf16 or fp32 as `bf16`
/// says; the lanes of `mask`). Every form of the tile finishes a LoRA
/// product with scaleAdd.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512
scaleAdd16(__m512 sums, float alpha, const char *addend, bool bf16, __mmask16 mask) {
  if (!addend)
    return scaleAdd(sums, alpha, nullptr);
  const __m512 add = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                    mask, reinterpret_cast<const uint16_t *>(addend))),
                                16))
                          : _mm512_maskz_loadu_ps(mask, reinterpret_cast<const float *>(addend));
  return scaleAdd(sums, alpha, &add);
}

/// Loads the AMX tile configuration both AMX users run with (palette 1,
/// eight registers of 16 rows of 64 bytes) on the calling thread: the tile
/// and the peak probe. Requires tile::amx(). (TileAmx.cpp.)
void configureAmxTiles();
#endif

/// packBytes of the AMX form (bf16 A and B), with a LowRank of depth lowK.
size_t amxPackBytes(int64_t m, int64_t n, int64_t k, bool decodedB, int64_t lowK = 0);

/// Whether gemmAmx computes a LowRank's lead product (LowRank::Lead) from
/// what it makes of op(A) for the product (its tiles, or in the swapped
/// form its panels): where it sums the low-rank steps in the registers (a
/// depth of whole tile steps, A not transposed); else tile::gemm computes
/// U by a call of its own first.
bool leadInTile(int64_t k, bool transA);

/// gemm on AMX tiles, bf16 A and B only: the arguments and results of
/// tile::gemm, with the order of the sums of Tile.h's AMX paragraph.
void gemmAmx(int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, bool transA,
             const void *b, int64_t ldb, bool transB, void *c, int64_t ldc, bool cBf16, bool load,
             void *pack, bool stream, const void *packedB, const DecodedB *decodedB,
             const AddScaled *addScaled, const LowRank *lowRank);

} // namespace moec::cpu::tile::detail

#endif // MOEC_RUNTIME_CPU_TILEPACK_H
