//===- Swiglu.h - SwiGLU forward and backward kernels -----------*- C++ -*-===//
//
// SwiGLU on the output Y [M, 2I] of the first matmul, whose columns 0..I-1
// are the gate and I..2I-1 the up projection:
//
//   forward   A[m, i]        = silu(g) * u             g = Y[m, i], u = Y[m, I + i]
//   backward  dY[m, i]       = dA[m, i] * u * silu'(g)
//             dY[m, I + i]   = dA[m, i] * silu(g)
//
// with silu(x) = x * sigmoid(x) and silu'(x) = sigmoid(x) * (1 + x * (1 -
// sigmoid(x))). Each call handles a tile: a row range of the buffers and a
// range of the I gate/up column pairs. Rows are absolute rows of the views
// (a per-expert caller adds its segment's offset). Storage is fp32 or bf16
// per view; the math is fp32. Results do not depend on the tiling: each
// element is computed on its own.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_SWIGLU_H
#define MOEC_RUNTIME_CPU_SWIGLU_H

#include "runtime/cpu/Element.h"

#include <cstdint>

namespace moec::cpu {

/// Returns silu(x) = x * sigmoid(x), in fp32.
float silu(float x);

/// Returns silu'(x) = sigmoid(x) * (1 + x * (1 - sigmoid(x))), in fp32.
float siluGrad(float x);

/// SwiGLU forward on rows `rows` and gate columns `cols` (a sub-range of
/// [0, inter)): A[m, i] = silu(Y[m, i]) * Y[m, inter + i]. `y` is [M, 2 *
/// inter], `a` is [M, inter]; rows index both.
void swigluForward(ConstMatrix y, Matrix a, int64_t inter, Range rows, Range cols);

/// SwiGLU backward on rows `rows` and gate columns `cols` (a sub-range of
/// [0, inter)): writes dY[m, i] = dA[m, i] * Y[m, inter + i] * silu'(Y[m, i])
/// and dY[m, inter + i] = dA[m, i] * silu(Y[m, i]). `y` and `dy` are [M, 2 *
/// inter], `da` is [M, inter]; rows index all three.
void swigluBackward(ConstMatrix y, ConstMatrix da, Matrix dy, int64_t inter, Range rows,
                    Range cols);

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_SWIGLU_H
