//===- Gmm.h - Grouped matmul tile kernels ----------------------*- C++ -*-===//
//
// The grouped matmuls of the MoE-FFN layer, one output tile of one expert at
// a time. The activations of all local experts share one buffer, grouped by
// expert (expert-major): expert e owns the rows [offset, offset + rows) of
// it, its Segment. A tile is a row range x column range of the expert's
// output, as a TilingRecord cuts it (runtime/format/TaskBinary.h).
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
// Speed: every kernel runs on OpenBLAS sgemm, on one thread (the first call
// sets OpenBLAS to one thread for the whole process: the runtime runs many
// tiles on its own worker threads, and BLAS must not spawn more inside each).
//  - All operands fp32: one cblas_sgemm on the caller's buffers in place, no
//    copies (with beta = 1 when accumulating).
//  - Any bf16 operand: the tile is cut into 256 x 512 blocks of C and 512-deep
//    slices of the reduction; each bf16 panel of A or B is widened to fp32 in
//    scratch, sgemm accumulates into C directly when C is fp32, else into an
//    fp32 scratch block that is rounded to bf16 once at the end.
// The extra cost of the bf16 path is the widening, O(1/256) of the flops.
//
// Determinism: the reduction order of a call depends only on its shapes,
// strides and storage types (fixed slice order, single-threaded BLAS, no
// atomics), so repeating a call gives the same bits. Different tilings of the
// same matmul may differ in the last bits, and so may different CPUs
// (OpenBLAS picks its kernels for the CPU it runs on).
//
// Preconditions (unchecked in the hot path; the runtime validates tilings
// when it loads a binary): pointers address the full extents used; leading
// strides are at least the row length of the stored matrix; tile ranges lie
// inside the output; every extent and stride is below 2^31. Output tiles of
// concurrent calls must not overlap, and C must not alias A or B.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_OPS_CPU_GMM_H
#define MOEC_OPS_CPU_GMM_H

#include "ops/cpu/Element.h"

#include <cstddef>
#include <cstdint>
#include <memory>

namespace moec::ops {

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

  /// Returns at least `count` floats, 64-byte aligned, valid until the next
  /// call. Contents are unspecified. Never shrinks.
  float *floats(size_t count);

  /// The number of floats held now.
  size_t capacity() const { return size; }

private:
  struct Free {
    void operator()(float *p) const;
  };
  std::unique_ptr<float, Free> buffer;
  size_t size = 0;
};

/// While one of these exists, in any thread, OpenBLAS runs each call on its
/// calling thread alone: whoever runs many kernels at once on its own threads
/// (the runtime's workers, the per-core benchmarks) holds one. The first to
/// be made sets OpenBLAS to one thread; the last to go sets back the count it
/// found, so a host program's own BLAS calls (PyTorch's matmuls, say) keep
/// their threads outside the runtime's passes. Kernels called with none held
/// run with whatever threads OpenBLAS has.
class BlasSingleThread {
public:
  BlasSingleThread();
  ~BlasSingleThread();
  BlasSingleThread(const BlasSingleThread &) = delete;
  BlasSingleThread &operator=(const BlasSingleThread &) = delete;
};

/// Returns OpenBLAS's description of itself (build options and the CPU
/// kernel it chose), for benchmark reports.
const char *blasConfig();

/// The general tile matmul every kernel below runs on:
///
///   C[i, j] (+)= sum_p opA(i, p) * opB(p, j)   for i < m, j < n, p < k
///
/// where opA(i, p) = a(i, p), or a(p, i) when `transA` (A stored k x m), and
/// opB(p, j) = b(p, j), or b(j, p) when `transB` (B stored n x k). C is
/// m x n at c. With `accumulate`, the product is added to C, else C is
/// overwritten (also when k is 0: C becomes zero). `scratch` may be null.
void gemmTile(int64_t m, int64_t n, int64_t k, ConstMatrix a, bool transA, ConstMatrix b,
              bool transB, Matrix c, bool accumulate, Scratch *scratch = nullptr);

/// Forward tile of one expert: C[m, n] = sum_{k < depth} A[m, k] * B[k, n] for
/// m in `rows` and n in `cols`.
///
/// `a` and `c` are the whole expert-major buffers (A: rows x depth, C: rows x
/// N); `segment` says which of their rows are the expert's, and `rows` counts
/// rows of the segment (0 is its first). `rows` is clipped to the segment, so
/// a tile past the expert's last row writes nothing: the runtime can pass the
/// tile of a capacity-sized grid as it is. `b` is the expert's weight
/// [depth, N]; `cols` is a column range of it (not clipped).
void gmmForwardTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                    Range rows, Range cols, Scratch *scratch = nullptr);

/// Data-gradient tile of one expert: C[m, n] = sum_{k < depth} A[m, k] *
/// B[n, k], i.e. C = A B^T with the weight stored [N, depth] (w1[e] is
/// [H, 2I] and gives dX from dY; w2[e] is [I, H] and gives dA from dZ).
/// Rows, segment and columns as for gmmForwardTile.
void gmmDgradTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                  Range rows, Range cols, Scratch *scratch = nullptr);

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

} // namespace moec::ops

#endif // MOEC_OPS_CPU_GMM_H
