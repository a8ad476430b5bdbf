//===- Swiglu.cpp - SwiGLU forward and backward kernels -------------------===//

#include "runtime/cpu/Swiglu.h"

#include <algorithm>
#include <cmath>

namespace moec::cpu {

namespace {

/// Columns handled per chunk: rows are widened to fp32 a chunk at a time.
constexpr int64_t kChunk = 256;

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

} // namespace

float silu(float x) { return x * sigmoid(x); }

float siluGrad(float x) {
  const float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

void swigluForward(ConstMatrix y, Matrix a, int64_t inter, Range rows, Range cols) {
  float gate[kChunk], up[kChunk], out[kChunk];
  for (int64_t m = rows.begin; m < rows.end; ++m) {
    for (int64_t c0 = cols.begin; c0 < cols.end; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols.end - c0);
      loadFloats(y.address(m, c0), y.elt, gate, size_t(n));
      loadFloats(y.address(m, inter + c0), y.elt, up, size_t(n));
      for (int64_t i = 0; i < n; ++i)
        out[i] = silu(gate[i]) * up[i];
      storeFloats(out, a.address(m, c0), a.elt, size_t(n));
    }
  }
}

void swigluBackward(ConstMatrix y, ConstMatrix da, Matrix dy, int64_t inter, Range rows,
                    Range cols) {
  float gate[kChunk], up[kChunk], grad[kChunk], dGate[kChunk], dUp[kChunk];
  for (int64_t m = rows.begin; m < rows.end; ++m) {
    for (int64_t c0 = cols.begin; c0 < cols.end; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols.end - c0);
      loadFloats(y.address(m, c0), y.elt, gate, size_t(n));
      loadFloats(y.address(m, inter + c0), y.elt, up, size_t(n));
      loadFloats(da.address(m, c0), da.elt, grad, size_t(n));
      for (int64_t i = 0; i < n; ++i) {
        const float s = sigmoid(gate[i]);
        const float g = gate[i];
        dGate[i] = grad[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
        dUp[i] = grad[i] * (g * s);
      }
      storeFloats(dGate, dy.address(m, c0), dy.elt, size_t(n));
      storeFloats(dUp, dy.address(m, inter + c0), dy.elt, size_t(n));
    }
  }
}

} // namespace moec::cpu
