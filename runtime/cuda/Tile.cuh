//===- Tile.cuh - What every GMM tile path shares ------------------------===//
//
// Device code, included by Device.cu alone (through Gemm.cuh): element
// access, an operand as a product reads it (Mat), the product a tile
// computes (Gemm), its epilogue, and the shared-memory helpers of the
// pipelined paths.
//
//===----------------------------------------------------------------------===//
#ifndef MOEC_RUNTIME_CUDA_TILE_CUH
#define MOEC_RUNTIME_CUDA_TILE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace moec::cuda::device {
namespace {

constexpr uint32_t kF32 = 1, kBF16 = 2, kI32 = 3;
constexpr int kThreads = 256;
constexpr int kBM = 128, kBN = 128, kBK = 32;

__device__ __forceinline__ uint32_t eltSize(uint32_t t) { return t == kBF16 ? 2 : 4; }

__device__ __forceinline__ float loadElt(const void *p, int64_t i, uint32_t t) {
  return t == kBF16 ? __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i])
                    : static_cast<const float *>(p)[i];
}

__device__ __forceinline__ void storeElt(void *p, int64_t i, uint32_t t, float v) {
  if (t == kBF16)
    static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float *>(p)[i] = v;
}

__device__ __forceinline__ int64_t loadIndex(const void *p, uint32_t t, int64_t i) {
  return t == kI32 ? static_cast<const int32_t *>(p)[i] : static_cast<const int64_t *>(p)[i];
}

__device__ __forceinline__ const char *offsetBytes(const void *p, int64_t elements, uint32_t t) {
  return static_cast<const char *>(p) + elements * int64_t(eltSize(t));
}

/// The storage formats of a frozen weight (LayerShape's WeightFormat).
constexpr uint32_t kDense = 0, kFp8Block128 = 1, kInt8Channel = 2, kInt4Group = 3;

/// An operand as the product reads it: op(i, p) = trans ? p[p * ld + i] :
/// p[i * ld + p]. A quantized weight (quant != kDense) is one expert's
/// matrix of codes as stored, [rows, ld] values (int4: two a byte), whose
/// value at stored (r, c) is decoded in fp32 and read as `type` (the other
/// operand's): FP8 e4m3 code x scales[(r / 128) * scaleLd + c / 128], int8
/// code x scales[r], int4 (code - zero) x scale of group c >> groupShift of
/// row r (scales[r * scaleLd + group], or (scale, zero) pairs there with
/// zeroPoints; else zero 8). The product's op(0, 0) is stored (row0, col0).
struct Mat {
  const void *p;
  uint32_t type;
  int64_t ld;
  bool trans;
  uint32_t quant = kDense;
  const float *scales = nullptr;
  int64_t scaleLd = 0;
  int32_t groupShift = 0;
  bool zeroPoints = false;
  int64_t row0 = 0, col0 = 0;
  __device__ int64_t at(int64_t row, int64_t col) const {
    return trans ? col * ld + row : row * ld + col;
  }
};

/// C[m, n] (+)= D + scale * opA opB over k, at the tile's origin.
struct Gemm {
  Mat a, b;
  void *c;
  uint32_t cType;
  int64_t ldc;
  const void *d; ///< addend (activation form), or null
  uint32_t dType;
  int64_t ldd;
  int64_t m, n, k;
  float scale;
  bool accumulate;
};

__device__ __forceinline__ void epilogue(const Gemm &g, int64_t i, int64_t j, float v) {
  const int64_t at = i * g.ldc + j;
  if (g.accumulate) {
    storeElt(g.c, at, g.cType, loadElt(g.c, at, g.cType) + v);
    return;
  }
  v *= g.scale;
  if (g.d)
    v += loadElt(g.d, i * g.ldd + j, g.dType);
  storeElt(g.c, at, g.cType, v);
}

//===----------------------------------------------------------------------===//
// Quantized weights (Mat::quant), decoded as runtime/cpu/Quant.h and Fp8.h
// decode them: (code - zero) x scale in fp32, rounded once to the operand's
// type
//===----------------------------------------------------------------------===//

/// An FP8 e4m3 code's value: no infinities; S.1111.111 is NaN.
__device__ __forceinline__ float e4m3Value(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 24, e = (code >> 3) & 15u, m = code & 7u;
  if (e == 15 && m == 7)
    return __uint_as_float(sign | 0x7FC00000u);
  if (e == 0) // subnormal: m x 2^-9
    return __uint_as_float(sign | __float_as_uint(float(m) * 0.001953125f));
  return __uint_as_float(sign | (e + 120) << 23 | m << 20);
}

/// The values of the two e4m3 codes in the low 16 bits of `two` (the lower
/// byte first), exactly. From compute capability 8.9 one conversion makes
/// them fp16 (every e4m3 value is one, NaN stays NaN); before, e4m3Value.
__device__ __forceinline__ float2 e4m3Pair(uint32_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(static_cast<uint16_t>(two)));
  return __half22float2(*reinterpret_cast<const __half2 *>(&h));
#else
  return make_float2(e4m3Value(two & 0xFFu), e4m3Value((two >> 8) & 0xFFu));
#endif
}

/// An int8 code's value without the integer-to-float conversion, which
/// Hopper issues at an eighth of its fp32 rate: byte `e` (0 .. 3) of
/// `flipped` (codes with their top bit flipped, 0 .. 255) in the low
/// mantissa bits of a float whose exponent is 2^23's is 2^23 + 128 + code,
/// and one subtraction leaves the code exactly. (int4 codes go through the
/// conversion: this form measured slower for them, as did fp16's mantissa
/// two codes at a time for both; docs/performance-log.md.)
__device__ __forceinline__ float int8Value(uint32_t flipped, int e) {
  return __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7440u | uint32_t(e))) - 8388736.0f;
}

/// The scale and zero point of stored value (r, c) of a quantized weight.
__device__ __forceinline__ float2 quantScale(const Mat &x, int64_t r, int64_t c) {
  switch (x.quant) {
  case kFp8Block128:
    return make_float2(x.scales[(r >> 7) * x.scaleLd + (c >> 7)], 0.0f);
  case kInt8Channel:
    return make_float2(x.scales[r], 0.0f);
  default: {
    const int64_t at = r * x.scaleLd + (c >> x.groupShift);
    return x.zeroPoints ? make_float2(x.scales[2 * at], x.scales[2 * at + 1])
                        : make_float2(x.scales[at], 8.0f);
  }
  }
}

/// The code at stored (r, c), as a float (int4: 0..15).
__device__ __forceinline__ float quantCode(const Mat &x, int64_t r, int64_t c) {
  const uint8_t *codes = static_cast<const uint8_t *>(x.p);
  switch (x.quant) {
  case kFp8Block128:
    return e4m3Value(codes[r * x.ld + c]);
  case kInt8Channel:
    return float(int8_t(codes[r * x.ld + c]));
  default: {
    const uint8_t byte = codes[r * ((x.ld + 1) / 2) + c / 2];
    return float(c & 1 ? byte >> 4 : byte & 15);
  }
  }
}

/// The stored coordinates of op(row, col).
__device__ __forceinline__ void storedAt(const Mat &x, int64_t row, int64_t col, int64_t *r,
                                         int64_t *c) {
  *r = (x.trans ? col : row) + x.row0;
  *c = (x.trans ? row : col) + x.col0;
}

/// op(row, col) of a quantized weight, in fp32.
__device__ __forceinline__ float quantValue(const Mat &x, int64_t row, int64_t col) {
  int64_t r, c;
  storedAt(x, row, col, &r, &c);
  const float2 s = quantScale(x, r, c);
  return (quantCode(x, r, c) - s.y) * s.x;
}

/// op(row, col) of any operand, in fp32.
__device__ __forceinline__ float opValue(const Mat &x, int64_t row, int64_t col) {
  return x.quant != kDense ? quantValue(x, row, col) : loadElt(x.p, x.at(row, col), x.type);
}

/// Whether a quantized operand can be decoded 8 values (16 bytes of bf16) at
/// a time along its stored rows: bf16, `ld`, the origin's column and the
/// contiguous extent multiples of 8, the codes 8-byte aligned.
__device__ __forceinline__ bool quantVectors(const Mat &x, int64_t contiguousExtent) {
  return x.type == kBF16 && x.ld % 8 == 0 && x.col0 % 8 == 0 && contiguousExtent % 8 == 0 &&
         reinterpret_cast<uintptr_t>(x.p) % 8 == 0;
}

/// Stored values (r, c .. c + 7) of a quantized weight (c % 8 == 0, one
/// scale for all: a block, row or group holds them), as loaded: their codes
/// (int4: 4 bytes; else 8), scale and zero point.
struct Quant8 {
  uint2 codes;
  float2 scale;
};

/// A Quant8's values, decoded, as 8 bf16 (zeros for an all-zero Quant8).
/// Each value is (code - zero) x scale in fp32 (the code exact, each step
/// rounded as the CPU rounds it), then rounded once to bf16.
__device__ __forceinline__ uint4 quantDecode8(uint32_t quant, const Quant8 &q) {
  const float2 s = q.scale;
  float v[8];
  if (quant == kInt4Group) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
      v[e] = (float((q.codes.x >> (4 * e)) & 15u) - s.y) * s.x;
  } else if (quant == kFp8Block128) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 pair = e4m3Pair((e < 2 ? q.codes.x : q.codes.y) >> (16 * (e % 2)));
      v[2 * e] = pair.x * s.x;
      v[2 * e + 1] = pair.y * s.x;
    }
  } else {
    const uint32_t lo = q.codes.x ^ 0x80808080u, hi = q.codes.y ^ 0x80808080u;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      v[e] = int8Value(e < 4 ? lo : hi, e % 4) * s.x;
  }
  uint4 out;
  uint32_t *w = reinterpret_cast<uint32_t *>(&out);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * e], v[2 * e + 1]);
    w[e] = *reinterpret_cast<const uint32_t *>(&pair);
  }
  return out;
}

__device__ __forceinline__ uint32_t sharedAddress(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// Whether an operand can be copied 16 bytes at a time: bf16, its stride
/// and address 16-byte aligned, its contiguous extent a multiple of 8.
__device__ __forceinline__ bool vectorizable(const Mat &x, int64_t contiguousExtent) {
  return x.type == kBF16 && x.ld % 8 == 0 && reinterpret_cast<uintptr_t>(x.p) % 16 == 0 &&
         contiguousExtent % 8 == 0;
}

} // namespace
} // namespace moec::cuda::device

#endif // MOEC_RUNTIME_CUDA_TILE_CUH
