//===- Gmm.h - Grouped matmul tile kernels ----------------------*- C++ -*-===//
//
// The grouped matmuls of the MoE-FFN layer, one output tile of one expert at
// a time. The activations of all local experts share one buffer, grouped by
// expert (expert-major): expert e owns the rows [offset, offset + rows) of
// it, its Segment. A tile is a row range x column range of the expert's
// output, as a TilingRecord cuts it (format/TaskBinary.h).
//
//   kernel           computes (m: segment rows, K: depth)        weight B
//   gmmForwardTile   C[m, n]  = sum_k A[m, k] * B[k, n]          [K, N]
//   gmmDgradTile     C[m, n]  = sum_k A[m, k] * B[n, k]          [N, K] (C = A Bt)
//   gmmWgradTile     C[k, n] (+)= sum_m A[m, k] * B[m, n]        (B is an activation)
//
// Layer mapping: forward Y = X w1[e] and Z = A w2[e] (gmmForwardTile); the
// activation gradients dA = dZ w2[e]^T and dX = dY w1[e]^T (gmmDgradTile,
// w stored [N, K]); the weight gradients dw2 = A^T dZ and dw1 = X^T dY
// (gmmWgradTile, reducing over the expert's rows).
//
// Storage: every operand is fp32 or bf16, independently; products accumulate
// in fp32 and C is rounded once, when it is stored.
//
// Speed: bf16 x bf16 tiles on a CPU with avx512_bf16 run on moec's own tile
// (runtime/cpu/Tile.h; see gemmKernel below), which writes C (fp32 or bf16)
// itself. The rest run on oneDNN's GEMM (Debian libdnnl-dev), one thread
// per call: the runtime runs many tiles at once on its own workers, so each
// call sets OpenMP (oneDNN's threading) to one thread on its calling thread
// and puts the count back after, leaving a host's own threads alone.
//  - A and B both fp32 (dnnl_sgemm) or both bf16 on a CPU with bf16
//    dot-product instructions (dnnl_gemm_bf16bf16f32), C fp32: one call on
//    the caller's buffers in place, no copies (beta = 1 when accumulating).
//  - C bf16: the same per 256 x 512 block of C, into an fp32 scratch block
//    that is rounded to bf16 once at the end.
//  - A and B of different types, or both bf16 on a CPU without bf16 dot
//    products (AVX2, AVX-512 before avx512_bf16, where oneDNN's bf16 GEMM is
//    absent or a quarter of sgemm's speed): the bf16 operands are widened to
//    fp32 in scratch once per call, then multiplied as above. The choice is
//    made at run time (nativeBf16Gemm). Widened copies get a row stride
//    that is not a multiple of 1 KiB.
//  - A forward tile whose weight rows are a multiple of 1 KiB apart (the
//    layer's w1 and w2 rows are 6 and 8 KiB) copies the weight's k x n panel
//    to a stride that is not, first: rows that far apart fall into a few
//    cache sets, and the GEMM's packing of them keeps evicting itself.
//  - An fp32 dgrad tile (C = A B^T, B stored n x k) whose weight rows are a
//    multiple of 4 KiB apart (w2's rows of H = 2048 fp32), where oneDNN runs
//    AVX-512 kernels: computed as its transpose, C^T = B A^T with A
//    transposed into scratch 128 rows at a time, then C^T written to C
//    transposed; oneDNN's packing of B^T from such rows ran the qwen3 act_grad
//    tile at 74% of the fp32 peak, this form at 84-90%.
//  - Any other fp32 dgrad tile (C = A B^T or C + A B^T, B stored n x k, no
//    scale) on oneDNN's matmul primitive where oneDNN runs brgemm kernels
//    for its shape (A, B and C stored densely: oneDNN 2.6 on AVX-512), else
//    on sgemm's N-T form. A thread keeps the primitives it made, by shape
//    (a layer meets about a hundred row counts an op; making one generates
//    its kernels, ~0.2 ms). Its brgemm kernels ran the qwen3 gate_grad tile
//    (128 x 2048 x 1536, w1's rows 6 KiB apart) at 102-103 GFLOP/s a
//    thread on Zen 4 against sgemm's 94-96; the forward's products and the
//    weight gradients stay on sgemm (brgemm measured slower or level there),
//    and so does the transposed form above (level).
//
// Determinism: the reduction order of a call depends only on its shapes,
// strides and storage types (fixed slice order, single-threaded GEMM, no
// atomics), so repeating a call gives the same bits. Different tilings of the
// same matmul may differ in the last bits, and so may different CPUs
// (oneDNN picks its kernels for the CPU it runs on).
//
// Preconditions (unchecked in the hot path; the runtime validates tilings
// when it loads a binary): pointers address the full extents used; leading
// strides are at least the row length of the stored matrix; tile ranges lie
// inside the output; every extent and stride is below 2^31. Output tiles of
// concurrent calls must not overlap, and C must not alias A or B.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_GMM_H
#define MOEC_RUNTIME_CPU_GMM_H

#include "base/Memory.h"
#include "runtime/cpu/Element.h"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace moec::cpu {

namespace tile {
struct DecodedB;
struct LowRank;
} // namespace tile

/// The rows of one expert in an expert-major activation buffer:
/// [offset, offset + rows). `rows` may be 0.
struct Segment {
  int64_t offset = 0;
  int64_t rows = 0;
};

/// Grow-only fp32 scratch memory for the bf16 path of the matmul kernels.
/// One Scratch must not be used by two threads at once. Kernels given no
/// Scratch use one per calling thread.
class Scratch {
public:
  Scratch() = default;
  Scratch(const Scratch &) = delete;
  Scratch &operator=(const Scratch &) = delete;

  /// Returns at least `count` floats, page-aligned, valid until the next
  /// call. Contents are unspecified. Never shrinks. Throws std::bad_alloc
  /// when the memory cannot be had.
  float *floats(size_t count);

  ~Scratch();

  /// The number of floats held now.
  size_t capacity() const { return size; }

  /// Bytes held by every Scratch of the process now (the workers' and the
  /// ones kernels keep per calling thread).
  static size_t heldBytes();

private:
  ZeroedPages buffer;
  size_t size = 0;
};

/// The GEMM that runs the tiles, from MOEC_GEMM in the environment (read
/// once):
///  - auto (the default): moec's own tile (runtime/cpu/Tile.h) for bf16
///    operands on a CPU with avx512_bf16, oneDNN for the rest. On the
///    qwen3 tile shapes (gmm_bench --layer) moec's bf16 tile is ahead of
///    oneDNN's on the weight gradients and level elsewhere; its fp32 tile
///    is behind oneDNN's sgemm, but for the fp32 weight gradients on an
///    Intel CPU (streamedTile).
///  - moec: moec's tile for fp32 and bf16 wherever the CPU has AVX-512.
///  - onednn: oneDNN for every tile.
enum class GemmKernel { Auto, Moec, OneDnn };
GemmKernel gemmKernel();

/// Whether a tile of fp32 (or, with `bf16`, bf16) operands runs on moec's
/// own tile.
bool moecTile(bool bf16);

/// Describes the GEMM library (oneDNN's version and the CPU ISA it runs
/// on), for benchmark reports.
const char *gemmConfig();

/// Whether bf16 x bf16 products run on the CPU's bf16 dot-product
/// instructions (oneDNN's effective ISA has avx512_core_bf16, also under
/// DNNL_MAX_CPU_ISA); without them, bf16 operands are widened to fp32 in
/// blocks and multiplied with the fp32 GEMM. Chosen at run time.
bool nativeBf16Gemm();

/// The general tile matmul every kernel below runs on:
///
///   C[i, j] (+)= alpha * sum_p opA(i, p) * opB(p, j)   for i < m, j < n, p < k
///
/// where opA(i, p) = a(i, p), or a(p, i) when `transA` (A stored k x m), and
/// opB(p, j) = b(p, j), or b(j, p) when `transB` (B stored n x k). C is
/// m x n at c. With `accumulate`, the product is added to C, else C is
/// overwritten (also when k is 0: C becomes zero). `scratch` may be null.
/// `streamC` says that nobody reads C soon (a weight gradient): moec's tile
/// then writes it past the caches (tile::gemm's `stream`); the same bits.
///
/// `packedB`, when not null, is op(B) packed whole by tile::packB for these
/// n and k: honoured only where packedTile(a.elt, b.elt) (moec's tile runs
/// the product; the same bits), ignored elsewhere.
///
/// `decodedB`, when not null, gives B through a decoder (tile::DecodedB: a
/// quantized weight), and `b`'s data is not read. Only where
/// packedTile(a.elt, b.elt) with both bf16: the caller checks.
///
/// `addend`, when its data is not null, is an m x n matrix of C's type (it
/// may be C itself): C = addend + alpha * the sum instead (`accumulate` is
/// then not read). On moec's tile: with alpha 1 and an fp32 C, the sum
/// starts from the addend; else (bf16 C, or alpha not 1) the sum is made
/// from zero, scaled, then added, in fp32, and rounded once into C. On
/// oneDNN's GEMM, the addend is copied into C and the product added to it.
void gemmTile(int64_t m, int64_t n, int64_t k, ConstMatrix a, bool transA, ConstMatrix b,
              bool transB, Matrix c, bool accumulate, Scratch *scratch = nullptr,
              float alpha = 1.0f, bool streamC = false, const void *packedB = nullptr,
              const tile::DecodedB *decodedB = nullptr, ConstMatrix addend = {},
              const tile::LowRank *lowRank = nullptr);

/// Whether gemmTile runs a product of these operand types on moec's tile,
/// which reads a B packed beforehand (`packedB`).
bool packedTile(Elt a, Elt b);

/// Whether gemmTile runs an m x n product of these operand types whose C it
/// writes past the caches (`streamC`, not accumulating: a weight gradient)
/// on moec's tile: where packedTile does, and under MOEC_GEMM=auto also an
/// fp32 one on an Intel CPU with AVX-512, both m and n over 16 (a base
/// weight's gradient, not a rank-r adapter's). oneDNN's sgemm writes that
/// C through the caches, reading each line before it writes it; on the
/// 2-core Xeon with AMX (regular stores to memory 9.5 GB/s a core, streamed
/// ones 24) the qwen3 step's fp32 weight gradients ran at 52-54% of a core
/// on sgemm and 64% on moec's tile, whose forward and dX products stay
/// behind sgemm's there (docs/performance-log.md, 2026-11-29). On Zen 4
/// sgemm ran them at 84-92%: unchanged.
bool streamedTile(Elt a, Elt b, int64_t m, int64_t n);

/// What an activation-form tile (gmmForwardTile, gmmDgradTile) makes of its
/// product P: C = addend + scale * P, where addend (when its data is not
/// null) is a matrix of C's shape and type, read at the rows and columns the
/// tile writes (it may be C itself). A LoRA adapter adds its product onto
/// the base projection's output this way, and scales its rank-r product.
///
/// With `lowV`'s data not null, a second product is added (a LoRA adapter's
/// rank-r product fused into its base's tile; TilingRecord::lowRankSlots):
/// C = P + U op(V), U the whole expert-major [rows, lowDepth] buffer (rows as
/// A's), V the expert's [lowDepth, N] weight (or [N, lowDepth] with
/// `lowTransV`); no addend and scale 1 then. Where moec's tile runs the
/// product without AMX, in one call (tile::LowRank: one rounding); elsewhere
/// as a second product added onto C.
///
/// With `leadB`'s data not null too, the tile writes its rows of U first (a
/// lead product, format::leadOp): U = leadScale * A op(leadB) over the same
/// rows and depth (`leadU`: U's buffer, lowU's; `leadB` the expert's [depth,
/// lowDepth] weight, or [lowDepth, depth] with `leadTransB`; `leadPackedB`
/// its packed copy or null): the bits of the tile that op's own task would
/// run, computed from the tiles of A the product makes on AMX (A read once
/// for both), else by that tile's call first. `uFirstRow`: the row of A
/// (of the whole buffer) that row 0 of lowU's and leadU's buffer holds: 0
/// for the U tensor, a tile's first row for a copy of the tile's own.
struct Epilogue {
  float scale = 1.0f;
  ConstMatrix addend;
  ConstMatrix lowU, lowV;
  int64_t lowDepth = 0;
  bool lowTransV = false;
  Matrix leadU;
  ConstMatrix leadB;
  bool leadTransB = false;
  float leadScale = 1.0f;
  const void *leadPackedB = nullptr;
  int64_t uFirstRow = 0;
};

/// Forward tile of one expert: C[m, n] = sum_{k < depth} A[m, k] * B[k, n] for
/// m in `rows` and n in `cols`.
///
/// `a` and `c` are the whole expert-major buffers (A: rows x depth, C: rows x
/// N); `segment` says which of their rows are the expert's, and `rows` counts
/// rows of the segment (0 is its first). `rows` is clipped to the segment, so
/// a tile past the expert's last row writes nothing: the runtime can pass the
/// tile of a capacity-sized grid as it is. `b` is the expert's weight
/// [depth, N]; `cols` is a column range of it (not clipped). `epilogue`
/// scales the product and adds a matrix to it. `packedB`, when not null, is
/// the weight's columns `cols` packed whole (gemmTile's `packedB`);
/// `decodedB`, the whole weight through a decoder (gemmTile's `decodedB`).
void gmmForwardTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                    Range rows, Range cols, Scratch *scratch = nullptr,
                    const Epilogue &epilogue = {}, const void *packedB = nullptr,
                    const tile::DecodedB *decodedB = nullptr);

/// Data-gradient tile of one expert: C[m, n] = sum_{k < depth} A[m, k] *
/// B[n, k], i.e. C = A B^T with the weight stored [N, depth] (w1[e] is
/// [H, 2I] and gives dX from dY; w2[e] is [I, H] and gives dA from dZ).
/// Rows, segment, columns, epilogue, packedB and decodedB as for
/// gmmForwardTile.
void gmmDgradTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                  Range rows, Range cols, Scratch *scratch = nullptr,
                  const Epilogue &epilogue = {}, const void *packedB = nullptr,
                  const tile::DecodedB *decodedB = nullptr);

/// Weight-gradient tile of one expert: for k in `rows` and n in `cols`,
///
///   C[k, n] = sum_{m < segment.rows} A[segment.offset + m, k] *
///                                    B[segment.offset + m, n]
///
/// (C = A^T B over the expert's rows; A is an activation stored [M, K], B one
/// stored [M, N]), or C[k, n] += that sum with `accumulate` (e.g. into an
/// fp32 main-grad buffer). `c` is the expert's [K, N] gradient; the tile is a
/// (k-range x n-range) tile of it, not clipped. The reduction over m runs in
/// a fixed order. An empty segment gives zeros (nothing changes when
/// accumulating).
void gmmWgradTile(ConstMatrix a, ConstMatrix b, Matrix c, Segment segment, Range rows, Range cols,
                  bool accumulate, Scratch *scratch = nullptr);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_GMM_H
