//===- Swiglu.cpp - SwiGLU forward and backward kernels -------------------===//
//
// The exponential is a polynomial (Cephes' expf: range reduction by ln 2, a
// degree-7 polynomial, the power of two put into the exponent bits), within
// about 2 ulp of expf, in three forms that give the same bits: sixteen
// lanes at a time with AVX-512, eight with AVX2 and FMA (chosen at run
// time), and one element at a time
// with std::fma (correctly rounded, like the vector FMA) for tails and
// other CPUs. So an element's result does not depend on the tiling, nor on
// whether it fell into a vector or a tail.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Swiglu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define MOEC_SWIGLU_AVX2 1
// GCC 12 reports the undefined vectors its own AVX-512 headers start some
// intrinsics from (_mm512_undefined_*) as uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace moec::cpu {

namespace {

/// Columns handled per chunk: rows are widened to fp32 a chunk at a time.
constexpr int64_t kChunk = 256;

// Cephes expf.
constexpr float kExpHi = 88.3762626647949f, kExpLo = -87.3365447504f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

/// exp(x) = mantissa * scale, the two factors apart: sigmoid adds 1 to
/// their product in one fma, so that no form leaves the compiler a
/// multiply-add to contract on its own (which would change the bits of one
/// form and not the other).
struct ExpParts {
  float mantissa, scale;
};

ExpParts expScalar(float x) {
  x = std::min(std::max(x, kExpLo), kExpHi);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  p = std::fma(p, r * r, r + 1.0f);
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return {p, scale};
}

/// 1 / (1 + exp(-x)).
float sigmoidScalar(float x) {
  const ExpParts e = expScalar(-x);
  return 1.0f / std::fma(e.mantissa, e.scale, 1.0f);
}

/// out[i] = silu(g[i]) * u[i].
__attribute__((noinline)) void siluTimesScalar(const float *g, const float *u, float *out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = g[i] * sigmoidScalar(g[i]) * u[i];
}

/// dGate[i] = d[i] * u[i] * silu'(g[i]), dUp[i] = d[i] * silu(g[i]).
__attribute__((noinline)) void siluBackScalar(const float *g, const float *u, const float *d, float *dGate, float *dUp,
                    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoidScalar(g[i]);
    dGate[i] = d[i] * u[i] * (s * std::fma(g[i], 1.0f - s, 1.0f));
    dUp[i] = d[i] * (g[i] * s);
  }
}

#ifdef MOEC_SWIGLU_AVX2
/// 1 / (1 + exp(-x)), eight lanes: expScalar and sigmoidScalar's steps.
__attribute__((target("avx2,fma"))) __m256 sigmoid8(__m256 x) {
  x = _mm256_sub_ps(_mm256_setzero_ps(), x);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLo)), _mm256_set1_ps(kExpHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  const __m256 one = _mm256_set1_ps(1.0f);
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_div_ps(one, _mm256_fmadd_ps(p, _mm256_castsi256_ps(bits), one));
}

__attribute__((target("avx2,fma"))) void siluTimesAvx2(const float *g, const float *u, float *out,
                                                       int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    // (g * s) * u, in the scalar form's order.
    const __m256 gs = _mm256_mul_ps(gv, sigmoid8(gv));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(gs, _mm256_loadu_ps(u + i)));
  }
  siluTimesScalar(g + i, u + i, out + i, n - i);
}

__attribute__((target("avx2,fma"))) void siluBackAvx2(const float *g, const float *u,
                                                      const float *d, float *dGate, float *dUp,
                                                      int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), dv = _mm256_loadu_ps(d + i);
    const __m256 s = sigmoid8(gv);
    // s * (1 + g * (1 - s)), as the scalar form computes it.
    const __m256 grad = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
    _mm256_storeu_ps(dGate + i, _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_loadu_ps(u + i)), grad));
    _mm256_storeu_ps(dUp + i, _mm256_mul_ps(dv, _mm256_mul_ps(gv, s)));
  }
  siluBackScalar(g + i, u + i, d + i, dGate + i, dUp + i, n - i);
}

// The same operations as sigmoid8 and its callers, sixteen lanes at a
// time: the same bits, twice the work per instruction where the CPU has
// 512-bit vectors.
#define MOEC_SWIGLU_AVX512 __attribute__((target("avx512f")))

MOEC_SWIGLU_AVX512 __attribute__((always_inline)) inline __m512 sigmoid16(__m512 x) {
  x = _mm512_sub_ps(_mm512_setzero_ps(), x);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLo)), _mm512_set1_ps(kExpHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  const __m512 one = _mm512_set1_ps(1.0f);
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, one));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_div_ps(one, _mm512_fmadd_ps(p, _mm512_castsi512_ps(bits), one));
}

/// silu(g) * u, sixteen lanes: (g * s) * u, in the scalar form's order.
MOEC_SWIGLU_AVX512 __attribute__((always_inline)) inline __m512 siluTimes16(__m512 gv, __m512 uv) {
  return _mm512_mul_ps(_mm512_mul_ps(gv, sigmoid16(gv)), uv);
}

/// siluBackScalar's two results, sixteen lanes.
MOEC_SWIGLU_AVX512 __attribute__((always_inline)) inline void
siluBack16(__m512 gv, __m512 uv, __m512 dv, __m512 &dGate, __m512 &dUp) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 s = sigmoid16(gv);
  // s * (1 + g * (1 - s)), as the scalar form computes it.
  const __m512 grad = _mm512_mul_ps(s, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one));
  dGate = _mm512_mul_ps(_mm512_mul_ps(dv, uv), grad);
  dUp = _mm512_mul_ps(dv, _mm512_mul_ps(gv, s));
}

MOEC_SWIGLU_AVX512 void siluTimesAvx512(const float *g, const float *u, float *out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, siluTimes16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
  siluTimesAvx2(g + i, u + i, out + i, n - i);
}

MOEC_SWIGLU_AVX512 void siluBackAvx512(const float *g, const float *u, const float *d, float *dGate,
                                       float *dUp, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 gate, up;
    siluBack16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), _mm512_loadu_ps(d + i), gate, up);
    _mm512_storeu_ps(dGate + i, gate);
    _mm512_storeu_ps(dUp + i, up);
  }
  siluBackAvx2(g + i, u + i, d + i, dGate + i, dUp + i, n - i);
}

// Whole rows' 16-column vectors read and written in place, bf16 or fp32,
// without passing through the chunk buffers: loadFloats' values and
// storeFloats' rounding (floatToBf16), so the bits of the chunk loops.
#define MOEC_SWIGLU_AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))

/// swigluForward's row m over columns [c, c + 16 * vectors).
MOEC_SWIGLU_AVX512BW void forwardRow16(ConstMatrix y, Matrix a, int64_t inter, int64_t m, int64_t c,
                                       int64_t vectors) {
  for (int64_t v = 0; v < vectors; ++v, c += 16)
    storeFloats16(a.address(m, c), a.elt,
                  siluTimes16(loadFloats16(y.address(m, c), y.elt),
                              loadFloats16(y.address(m, inter + c), y.elt)));
}

/// swigluBackward's row m over columns [c, c + 16 * vectors).
MOEC_SWIGLU_AVX512BW void backwardRow16(ConstMatrix y, ConstMatrix da, Matrix dy, int64_t inter,
                                        int64_t m, int64_t c, int64_t vectors) {
  for (int64_t v = 0; v < vectors; ++v, c += 16) {
    __m512 gate, up;
    siluBack16(loadFloats16(y.address(m, c), y.elt), loadFloats16(y.address(m, inter + c), y.elt),
               loadFloats16(da.address(m, c), da.elt), gate, up);
    storeFloats16(dy.address(m, c), dy.elt, gate);
    storeFloats16(dy.address(m, inter + c), dy.elt, up);
  }
}

bool haveAvx512() {
  static const bool have = __builtin_cpu_supports("avx512f");
  return have;
}

bool haveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return have;
}
#endif

void siluTimes(const float *g, const float *u, float *out, int64_t n) {
#ifdef MOEC_SWIGLU_AVX2
  if (haveAvx512())
    return siluTimesAvx512(g, u, out, n);
  if (haveAvx2())
    return siluTimesAvx2(g, u, out, n);
#endif
  siluTimesScalar(g, u, out, n);
}

void siluBack(const float *g, const float *u, const float *d, float *dGate, float *dUp,
              int64_t n) {
#ifdef MOEC_SWIGLU_AVX2
  if (haveAvx512())
    return siluBackAvx512(g, u, d, dGate, dUp, n);
  if (haveAvx2())
    return siluBackAvx2(g, u, d, dGate, dUp, n);
#endif
  siluBackScalar(g, u, d, dGate, dUp, n);
}

} // namespace

float silu(float x) { return x * sigmoidScalar(x); }

float siluGrad(float x) {
  const float s = sigmoidScalar(x);
  return s * std::fma(x, 1.0f - s, 1.0f);
}

namespace {
/// Whether the swiglu kernels read and write whole 16-column vectors in
/// place (forwardRow16, backwardRow16): AVX-512, every operand bf16 or fp32.
bool inPlace16(Elt a, Elt b, Elt c) {
#ifdef MOEC_SWIGLU_AVX2
  const auto ok = [](Elt e) { return e == Elt::BF16 || e == Elt::F32; };
  return cpuHasAvx512() && ok(a) && ok(b) && ok(c);
#else
  (void)a, (void)b, (void)c;
  return false;
#endif
}
} // namespace

void swigluForward(ConstMatrix y, Matrix a, int64_t inter, Range rows, Range cols) {
  float gate[kChunk], up[kChunk], out[kChunk];
  const int64_t bytes = cols.size() * int64_t(dtypeSize(y.elt));
  // Whole 16-column vectors of every row in place, the rest in chunks.
  const int64_t whole = inPlace16(y.elt, a.elt, a.elt) ? cols.size() / 16 : 0;
  for (int64_t m = rows.begin; m < rows.end; ++m) {
    // The next row's gate and up columns, while this row is computed: a
    // tile's rows were written moments before, often by another core, and
    // each row's loads waited for them (the forward's SwiGLU tasks took 9.4
    // ms of the qwen3 step's busy time, 5.8 with the prefetch).
    if (m + 1 < rows.end) {
      prefetchBytes(y.address(m + 1, cols.begin), bytes);
      prefetchBytes(y.address(m + 1, inter + cols.begin), bytes);
    }
#ifdef MOEC_SWIGLU_AVX2
    if (whole)
      forwardRow16(y, a, inter, m, cols.begin, whole);
#endif
    for (int64_t c0 = cols.begin + 16 * whole; c0 < cols.end; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols.end - c0);
      loadFloats(y.address(m, c0), y.elt, gate, size_t(n));
      loadFloats(y.address(m, inter + c0), y.elt, up, size_t(n));
      siluTimes(gate, up, out, n);
      storeFloats(out, a.address(m, c0), a.elt, size_t(n));
    }
  }
}

void swigluBackward(ConstMatrix y, ConstMatrix da, Matrix dy, int64_t inter, Range rows,
                    Range cols) {
  float gate[kChunk], up[kChunk], grad[kChunk], dGate[kChunk], dUp[kChunk];
  const int64_t bytes = cols.size() * int64_t(dtypeSize(y.elt));
  const int64_t gradBytes = cols.size() * int64_t(dtypeSize(da.elt));
  // Whole 16-column vectors of every row in place, the rest in chunks.
  const int64_t whole = inPlace16(y.elt, da.elt, dy.elt) ? cols.size() / 16 : 0;
  for (int64_t m = rows.begin; m < rows.end; ++m) {
    if (m + 1 < rows.end) { // as in swigluForward
      prefetchBytes(y.address(m + 1, cols.begin), bytes);
      prefetchBytes(y.address(m + 1, inter + cols.begin), bytes);
      prefetchBytes(da.address(m + 1, cols.begin), gradBytes);
    }
#ifdef MOEC_SWIGLU_AVX2
    if (whole)
      backwardRow16(y, da, dy, inter, m, cols.begin, whole);
#endif
    for (int64_t c0 = cols.begin + 16 * whole; c0 < cols.end; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols.end - c0);
      loadFloats(y.address(m, c0), y.elt, gate, size_t(n));
      loadFloats(y.address(m, inter + c0), y.elt, up, size_t(n));
      loadFloats(da.address(m, c0), da.elt, grad, size_t(n));
      siluBack(gate, up, grad, dGate, dUp, n);
      storeFloats(dGate, dy.address(m, c0), dy.elt, size_t(n));
      storeFloats(dUp, dy.address(m, inter + c0), dy.elt, size_t(n));
    }
  }
}

} // namespace moec::cpu
