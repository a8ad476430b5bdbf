//===- Rows.h - Row movement: put, dispatch gather, combine ----*- C++ -*-===//
//
// The data movement of dispatch and combine, on row ranges:
//
//   gatherTokenRows   dispatch: row i of the output is the token row of the
//                     (token, k) row id rowIds[i], optionally scaled by that
//                     row's top-k weight (the backward pass dispatches
//                     dZ = w[t, k] * dy[t] this way)
//   combineRows       combine-reduce: y[t] = sum_k w[t, k] * Z[position(t, k)]
//   combineWeightGrad dtopk_weights[t, k] = <dy[t], Z[position(t, k)]>
//
// A (token, k) row id is t * K + k, as in RoutingLayout; `position` maps a
// row id to its row in the expert-major buffer Z (RoutingLayout::position
// when the returned rows keep the sorted order). Storage is fp32 or bf16 per
// view, math fp32. Sums run in a fixed order (k ascending; columns ascending
// for dot products), so results are deterministic and, for combineRows, do not
// depend on how tokens and columns are tiled.
//
// Under tensor parallelism the returned rows are `parts` partial sums, one
// block of rows per TP rank, `partStride` rows apart: a row of Z is then the
// fp32 sum of its parts in block order, taken before anything else.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_ROWS_H
#define MOEC_RUNTIME_CPU_ROWS_H

#include "runtime/cpu/Element.h"

#include <cstdint>

namespace moec::cpu {

/// Gathers `rows` rows of `cols` elements: dst row i = src row
/// (rowIds[i] / topK), times weights[rowIds[i]] when `weights` is not null.
/// With topK = 1, rowIds are plain row indices. Where dst has src's type and
/// its rows are whole 64-byte lines apart from a line-aligned start (the
/// rows a rank sends, which a put reads next), they are written past the
/// caches (non-temporal stores, on AVX-512), so that their lines are not
/// read from memory first; the values are the same.
void gatherTokenRows(ConstMatrix src, const int64_t *rowIds, int64_t topK, const float *weights,
                     Matrix dst, int64_t rows, int64_t cols);

/// Combine-reduce on tokens `tokens` and columns `cols`:
///
///   y[t, h] = sum_{k = 0 .. topK-1} w[t, k] * z[position[t * topK + k], h]
///
/// summed in fp32 in ascending k, with w[t, k] = weights[t * topK + k], or 1
/// when `weights` is null (the backward combine dx[t] = sum_k dX row).
void combineRows(ConstMatrix z, const int64_t *position, const float *weights, int64_t topK,
                 Matrix y, Range tokens, Range cols, int64_t parts = 1, int64_t partStride = 0);

/// The gradient of combineRows with respect to its weights, on tokens
/// `tokens`: dweights[t * topK + k] = sum_{h < cols} dy[t, h] *
/// z[position[t * topK + k], h], summed in fp32 in a fixed order: column h
/// into partial sum h % 16 in ascending h, then the 16 partial sums pairwise
/// (lane l + 8 into l, then l + 4, l + 2, l + 1).
void combineWeightGrad(ConstMatrix dy, ConstMatrix z, const int64_t *position, int64_t topK,
                       Range tokens, int64_t cols, float *dweights, int64_t parts = 1,
                       int64_t partStride = 0);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_ROWS_H
