//===- Tile.h - moec's own GEMM tile (AVX-512, AMX) -------------*- C++ -*-===//
//
// One matmul tile on the calling thread, with moec's own AVX-512 micro-kernel
// (bf16 on AMX tiles where the CPU has them; the AMX paragraph below):
//
//   C[i, j] = (load ? C[i, j] : 0) + sum_p opA(i, p) * opB(p, j)
//
// for i < m, j < n, p < k, C fp32 or bf16 (m x n, row stride ldc; a bf16 C
// is rounded once, from the fp32 sums, and is never loaded), A and B both fp32
// or both bf16 (bf16 products on the bf16 dot-product instruction,
// avx512_bf16). opA(i, p) = a(i, p), or a(p, i) when `transA`; opB(p, j) =
// b(p, j), or b(j, p) when `transB` (strides in elements, as in gemmTile).
//
// How it runs (the shape of BLIS/GotoBLAS, on 32-bit units: one fp32 value,
// or a pair of bf16 values along the depth, which is what one lane of the
// bf16 dot product takes):
//  - the depth is cut into blocks of kBlockUnits units (128 fp32 values,
//    256 bf16 ones), or of 512 units where B was packed beforehand (below:
//    its panels are read where they lie, and a deeper block passes the
//    partial sums between blocks less often) or a decoder writes the
//    panels straight (DecodedB::panel);
//  - per block, op(B)'s rows are packed into panels 48 columns wide, units
//    interleaved (a bf16 pair of rows becomes one 32-bit unit per column),
//    columns past n zero: an op(B) stored k x n by the micro-kernel
//    calls of the block's first row block as they go, the others before
//    the block; op(A) is read in place when it is row-major, else
//    packed the same way into panels of 16 rows, once for the whole depth;
//  - the micro-kernel holds an 8 x 48 block of C in 24 zmm registers and, per
//    unit, loads three 16-lane vectors of the panel and broadcasts one unit
//    of each of the 8 rows of A: 24 dot products (or FMAs) per 11 loads, the
//    panel (24 KiB) in L1 while every row block of A passes over it.
//
// Order of the sums, hence the bits: C[i, j] is one fp32 accumulator, from
// zero (or C), that adds the units in depth order (a bf16 unit adds its two
// products in one instruction, as the CPU rounds them); between depth
// blocks it waits in fp32 memory, exactly, so the blocks' depth does not
// change it. Nothing depends on m, n, the depth blocks, the tile's place in
// C or the thread: every tiling of a matmul and every thread count gives
// the same bits on a CPU.
//
// The packing needs packBytes(...) bytes of memory, 64-byte aligned, from the
// caller (kernels keep it in their Scratch).
//
// A C at most 16 columns wide and over 16 rows whose A is stored transposed
// (a LoRA adapter's weight gradient, X^T dU, n the rank), with B neither
// transposed, packed beforehand nor decoded, and no AddScaled, is computed
// as its transpose C^T = B^T A into the working memory and written to C
// transposed: A (the wide operand) is then read along its rows as stored,
// not packed transposed. The same sums of the same products in the same
// order, so the same bits. (Such a C, at most 16 columns, is written with
// plain stores even with `stream`.)
//
// The dot form: bf16 operands on the AVX-512 micro-kernel with A row-major
// and B stored n x k (transB: the backward's dX = dY W^T on a weight stored
// as the forward reads it, the forward on a weight stored [out, in]) read
// both operands along the depth as they lie, where the form above must
// transpose B into panels (about a tenth of the tile's time, even from L2).
// C in blocks of 4 x 4, one accumulator an element, each of whose 16 lanes
// adds the dot products of its value pairs in depth order (a 64-byte step
// of each row at a time): A's rows staged step by step 4 rows at a time
// (128 rows at most, in L2), 4 rows of B read in place from L1 while every
// block of A's stage passes, the next 4 fetched meanwhile. Order of the
// sums there: C[i, j] is the sum of its accumulator's 16 lanes by a fixed
// tree (lane l with l + 8, then l + 4, l + 2, l + 1), then with `load` C's
// value plus that sum; a LowRank's units continue the lanes after the
// depth's. Again nothing depends on m, n or the tiling: every tiling of a
// matmul gives the same bits, which are not the other form's. (The qwen3
// backward's dX tiles on a Zen 4 core: 87-88% of its peak against 77-79%
// through the transposing panels, one thread, 16 experts in turn; its B
// needs no packed copy.) C is written with plain stores there, `stream` or
// not. It runs where dotForm says: by default on a core that runs a 512-bit
// operation as two 256-bit halves (AMD family 19h, Zen 4), where it was
// measured faster; elsewhere the panels (on a B packed beforehand) or the
// swapped form below, which a Zen 5 core's full-width units run faster
// (the same dX tiles through panels 1.2-1.3x as stored, 1.4-1.5x packed
// beforehand). `MOEC_DOT_FORM` (auto, on, off; docs/runtime.md) chooses
// per process.
//
// The swapped form: where the dot form does not run, such a product (bf16,
// A row-major, B stored n x k, C over 16 columns wide, 256 or more deep)
// with none of `packedB`, `addScaled` or `stream`, nor a `decodedB` that
// writes panels (DecodedB::panel), is computed as its transpose, C^T = B
// A^T (+ op(V)^T U^T with a `lowRank`), on the same micro-kernel: B's
// rows are the micro-kernel's rows of A, read where they lie (16 at a time,
// the next 16 fetched meanwhile), and A^T is packed into panels, a group of
// 192 of A's rows at a time over the whole depth (in L2), so the weight is
// never transposed; the sums of 16 rows of B wait in fp32 working memory
// between depth blocks of 512 units and leave for C by 16 x 16 transposes,
// rounded to a bf16 C as the micro-kernel rounds one. A decoded B's rows
// are decoded 16 at a time, a depth block at a time, into L1 and read
// there. A LowRank's op(V)^T rows follow B's in the last block's calls
// (read in place where V is stored n x k, `transV`: a LoRA adapter's dX
// product; else copied a row block at a time), over U^T's panels. A bf16
// dot product multiplies its two operands' values pairwise, so each element
// is the same sum of the same products in the same order as through panels:
// the same bits (tile_test compares it with the panels of B packed
// beforehand). (The qwen3 backward's dX tiles on a Zen 5 core, two threads
// at once: 1.05-1.37x the transposing panels' rate as stored, level with B
// packed beforehand; the forward's on a quantized weight 1.06-1.18x a
// dequantized copy's.)
// MOEC_SWAPPED_FORM=off (docs/runtime.md) keeps the panels.
//
// A weight that many calls read (the layer's packed-weight store,
// runtime/cpu/Pass.h) can be packed once, whole, by packB, and handed to
// gemm as `packedB`: the calls then pack nothing of B. The panels are
// those gemm would make block by block, so the bits are the same.
//
// On a CPU with AMX-BF16 (amx()), bf16 operands run on AMX tiles instead
// (TileAmx.cpp), on the same panels of op(B), packed whole once per call,
// or a column group at a time where B is stored transposed (or read where
// packB put them): C in blocks of 32 x 32, four tile
// registers, summed 16 units a step in depth chunks, the sums kept exactly
// between chunks. Order of the sums there: C[i, j] is the sum, from zero, of its steps
// in depth order, each one tile dot product of 16 units (as the CPU rounds
// it; units past the depth are zero); then, with `load`, C's value plus that
// sum. These bits are not those of the AVX-512 micro-kernel, but again
// depend on nothing but the operands, so every tiling and thread count of a
// matmul on one CPU gives the same bits. A B stored n x k (transB), neither
// packed beforehand nor decoded, with A row-major and C over 32 columns
// wide (the backward's dX on a weight stored as the forward reads it, the
// forward on one stored [out, in]) is computed there as its transpose,
// C^T = B A^T, where A's panels (an expert's rows) stay in L2: B's rows are
// the A tiles' rows, read where they lie, so the weight is not packed; the
// same products in the same order, so the same bits (the qwen3 dX tiles
// 1.12-1.22x faster than packing a column group of B transposed first).
// MOEC_AMX=off in the environment keeps the AVX-512 micro-kernel.
//
// A bf16 B held in another form (a quantized weight's codes and scales) is
// handed to gemm as `decodedB`: a function that writes any rectangle of B, as
// stored, as bf16 values; for a B stored k x n, optionally one that writes
// its rows straight as the panels' units (DecodedB::pairs); or (DecodedB::
// panel: codes packed beforehand in the panels' order, Quant.h's packCodes)
// one that writes a panel's units straight. Per depth block (512 units),
// gemm has a B stored k x n written into a column group's panels by pairs;
// a B stored n x k it decodes 16 rows at a time into L1 in the swapped form
// and reads them there; otherwise it decodes one panel's part at a time
// into its working memory (in L1) and packs the panel from there; panels
// written straight it reads as they come (on AMX, a column group's panels
// just before the group's products). So no
// dequantized copy of B is made beyond them. The panels are those of the
// decoded B, so the bits are those of gemm on that B.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_TILE_H
#define MOEC_RUNTIME_CPU_TILE_H

#include <cstddef>
#include <cstdint>

namespace moec::cpu::tile {

/// Columns of a packed panel of op(B) (the header's layout; DecodedB::panel
/// and packedBBytes count in them).
constexpr int kPanelColumns = 48;

/// A bf16 B given by a decoder (the header says how gemm reads it). B is
/// stored k x n, or n x k with `transB`, as for gemm's `b`; its element
/// (i, j) is the decoder's (rowOffset + i, colOffset + j).
struct DecodedB {
  /// Writes rows [r0, r1) and columns [c0, c1) of the decoder's matrix as
  /// bf16 bits into dst, row i, column j at (i - r0) * ld + (j - c0).
  void (*decode)(const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                 uint16_t *dst, int64_t ld) = nullptr;
  const void *context = nullptr;
  int64_t rowOffset = 0, colOffset = 0;
  /// Where the decoder reads the matrix, so that gemm prefetches the next
  /// depth block's part while a block computes: a byte a value (half a
  /// byte with `halfBytes`), rows `codesLd` bytes apart. Null: no prefetch.
  const uint8_t *codes = nullptr;
  int64_t codesLd = 0;
  bool halfBytes = false;
  /// Where B was packed for the tile beforehand (Quant.h's packCodes): writes
  /// the units [u0, u1) of panel `panel` (its columns 48 * panel on, of the
  /// packed columns) into dst as the bf16 panel's units (unit u0 at dst[0]),
  /// in place of decode and the packing; decode, rowOffset and colOffset are
  /// then not used. Its codes lie a panel `codesLd` bytes apart, a unit
  /// `unitBytes` bytes apart within it (what gemm prefetches).
  void (*panel)(const void *context, int64_t panel, int64_t u0, int64_t u1,
                uint32_t *dst) = nullptr;
  int64_t unitBytes = 0;

  /// Where B is stored k x n (not transB), optionally: writes rows [r0, r1)
  /// and columns [c0, c1) of the decoder's matrix straight as the bf16
  /// panels' units (rows r0 + 2t and r0 + 2t + 1 in unit t's low and high
  /// halves, a row past r1 zero; column c0 + j at dst[(j / kPanelColumns) *
  /// panelStride + t * kPanelColumns + j % kPanelColumns], lanes past c1 in
  /// its last 16 zero), in place of decode and the packing of its rows.
  void (*pairs)(const void *context, int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint32_t *dst,
                int64_t panelStride) = nullptr;

  /// decode() of B's rows [r0, r1) and columns [c0, c1), in B's own
  /// coordinates (the offsets added).
  void read(int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint16_t *dst, int64_t ld) const {
    decode(context, rowOffset + r0, rowOffset + r1, colOffset + c0, colOffset + c1, dst, ld);
  }
  /// pairs() of B's rows [r0, r1) and columns [c0, c1), in B's own
  /// coordinates.
  void readPairs(int64_t r0, int64_t r1, int64_t c0, int64_t c1, uint32_t *dst,
                 int64_t panelStride) const {
    pairs(context, rowOffset + r0, rowOffset + r1, colOffset + c0, colOffset + c1, dst,
          panelStride);
  }
};

/// What gemm makes of its sums S, when given one: C = addend + alpha * S, or
/// alpha * S with no addend, in fp32 (a multiply, then an add), rounded once
/// into C's type. The addend is an m x n matrix of C's storage type, row
/// stride `ld` elements; it may be C itself (each element is read before it
/// is written). This is the layer's LoRA epilogue (the adapter's product
/// onto the base's output, a scaled rank-r product) in the tile's last depth
/// block, where the sums are still in registers.
struct AddScaled {
  float alpha = 1.0f;
  const void *addend = nullptr;
  int64_t ld = 0;
};

/// A second product gemm adds to its first (a LoRA adapter's rank-r product
/// inside its base's tile): C = op(A) op(B) + U op(V), U m x k row-major
/// (row stride `ldu` elements), op(V) = V stored k x n, or n x k with
/// `transV` (stride `ldv`), both of A's and B's storage type. On the
/// AVX-512 micro-kernel its k units are summed after op(A) op(B)'s, in the
/// registers of the last depth block's calls, so C is rounded and stored
/// once and U op(V) costs those units alone. On AMX tiles likewise, as
/// further tile steps of each block after the depth's, where op(A)'s depth
/// is a whole number of steps (32 values); else a second product added onto
/// C (AddScaled, alpha 1, C the addend): its sums, and a bf16 C's rounding
/// between the two, are those of two gemm calls.
///
/// With `lead` set, gemm first writes U itself (at `lead->u`, U's address):
/// U = lead->scale * op(A) op(lead->b), op(lead->b) k x r (stored k x r, or r
/// x k with `transB`, stride `ldb`; `packedB` that B packed whole by packB,
/// or null), of A's storage type (a LoRA adapter's first product, U = s X
/// A, over the base's rows): the bits of gemm(m, r, k, a, lda, false,
/// lead->b, ...) with AddScaled{scale} (none where scale is 1), writing U.
/// On AMX tiles (leadInTile) from op(A)'s tiles (or, where C is computed
/// as its transpose, its panels), packed for the product anyway, so A is
/// read from memory once for both; elsewhere by that call first.
struct LowRank {
  const void *u = nullptr;
  int64_t ldu = 0;
  const void *v = nullptr;
  int64_t ldv = 0;
  bool transV = false;
  int64_t k = 0;
  struct Lead {
    void *u = nullptr;
    const void *b = nullptr;
    int64_t ldb = 0;
    bool transB = false;
    float scale = 1.0f;
    const void *packedB = nullptr;
    /// U's own call's AddScaled: `scale` in *storage, or none where it is 1.
    const AddScaled *scaled(AddScaled *storage) const {
      *storage = AddScaled{scale, nullptr, 0};
      return scale != 1.0f ? storage : nullptr;
    }
  };
  const Lead *lead = nullptr;
};

/// Whether this CPU runs the tile: AVX-512 (F, BW, VL, DQ) for fp32, and
/// bf16 dot products (avx512_bf16) too for bf16. Checked once.
bool available(bool bf16);

/// Whether gemm computes a product of these forms in its dot form (the
/// header's paragraph): bf16 operands on the AVX-512 micro-kernel (available,
/// not AMX), A row-major, B stored n x k (transB), where the form is chosen
/// (MOEC_DOT_FORM, or by the CPU; fixed at the first call). A B packed
/// beforehand is not read there, so the layer packs no such B.
bool dotForm(bool transA, bool transB, bool bf16);

/// Whether gemm computes a product of these forms in its swapped form (the
/// header's paragraph) where the call has none of `packedB`, `addScaled`
/// or `stream`, nor a `decodedB` that writes panels: bf16 operands on the
/// AVX-512 micro-kernel (available, not AMX), A row-major, B stored n x k (transB),
/// C over 16 columns wide (n), a depth k of 256 or more, where the dot form
/// does not run and MOEC_SWAPPED_FORM is not "off" (fixed at the first
/// call).
bool swappedForm(int64_t n, int64_t k, bool transA, bool transB, bool bf16);

/// Whether bf16 gemm runs on AMX tiles (TileAmx.cpp) rather than on the
/// AVX-512 micro-kernel: the CPU has AMX-BF16, the kernel lets this process
/// use its tile registers, and the environment's MOEC_AMX is not "off". Fixed
/// at the first call.
bool amx();

/// Bytes of working memory gemm() needs for these shapes (packed panels,
/// fp32 partial sums for a bf16 C, or any C with `addScaled`, deeper than
/// one block, with `decodedB` a panel's or a column group's part of B
/// decoded, and with a LowRank of depth `lowRankK` > 0 its V's panels). A call with `decodedB`
/// may need less than one without: on AMX a decoded B's panels are one
/// column group's, not the whole B's.
size_t packBytes(int64_t m, int64_t n, int64_t k, bool transA, bool bf16, bool cBf16,
                 bool decodedB = false, bool addScaled = false, int64_t lowRankK = 0);

/// Bytes of working memory a LowRank's lead product needs (LowRank::Lead):
/// packBytes of the gemm call that writes U, where it runs as one.
size_t leadPackBytes(int64_t m, int64_t r, int64_t k, bool bf16, float scale);

/// C = (load ? C : 0) + op(A) op(B), as the header says. `bf16` says the
/// storage of A and B (uint16_t bf16 bits, else float), `cBf16` that of C.
/// Requires available(bf16), m, n, k > 0, not both `cBf16` and `load`, and
/// `pack` of packBytes() bytes, 64-byte aligned. With `stream`, C is written
/// with non-temporal stores, whole rows of a column group at a time, past the
/// caches: for a C nobody reads soon (a weight gradient), whose lines would
/// otherwise be read from memory before they are written. The same bits.
/// With `decodedB` (bf16 only, not with `packedB`), B is read through it and
/// `b`, `ldb` are not read; `pack` then holds packBytes(..., true) bytes.
/// With `addScaled` (not with `load` or `stream`), C = addend + alpha * the
/// sums, as AddScaled says; `pack` then holds packBytes(..., addScaled =
/// true) bytes. With `lowRank` (not with `load`, `addScaled` or `transA`;
/// lowRank->k > 0), C = op(A) op(B) + U op(V) as LowRank says;
/// `pack` then holds packBytes(..., lowRankK = lowRank->k) bytes, and with
/// a lead product at least leadPackBytes(m, lowRank->k, k, ...) too.
void gemm(int64_t m, int64_t n, int64_t k, const void *a, int64_t lda, bool transA, const void *b,
          int64_t ldb, bool transB, bool bf16, void *c, int64_t ldc, bool cBf16, bool load,
          void *pack, bool stream = false, const void *packedB = nullptr,
          const DecodedB *decodedB = nullptr, const AddScaled *addScaled = nullptr,
          const LowRank *lowRank = nullptr);

/// Bytes of an op(B) of k x n packed whole by packB: n rounded up to whole
/// 48-column panels, times k in 32-bit units (an fp32 value, or a bf16 pair
/// along the depth).
size_t packedBBytes(int64_t n, int64_t k, bool bf16);

/// Packs op(B) (k x n: b(p, j), or b(j, p) when `transB`, stride `ldb`
/// elements) whole into `dst` (packedBBytes(n, k, bf16) bytes, 64-byte
/// aligned, zero): per 48-column panel, every unit of the depth in order,
/// 48 units a row, columns past n zero. gemm(..., packedB = dst) on any rows
/// of A then reads these panels for op(B) columns [0, n). Requires
/// available(bf16).
void packB(int64_t n, int64_t k, const void *b, int64_t ldb, bool transB, bool bf16, void *dst);

} // namespace moec::cpu::tile

#endif // MOEC_RUNTIME_CPU_TILE_H
