//===- GemmBench.cu - The GMM tile function, timed and checked ------------===//
//
// See benchGemm in Device.h: random operands, C poisoned with NaN, one
// launch checked (every element written; sampled elements against an fp32
// reference computed on the GPU), then timed launches.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/CudaError.cuh"
#include "runtime/cuda/Device.h"
#include "runtime/cuda/Gemm.cuh"

#include <algorithm>
#include <vector>

namespace moec::cuda::device {

namespace {

constexpr int kSamples = 1 << 14;

__device__ __forceinline__ uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

__global__ void fillRandom(void *p, uint32_t type, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x)
    storeElt(p, i, type, float(mix(seed * 0x9E3779B97F4A7C15ull + uint64_t(i)) >> 8) / 8388608.0f -
                             1.0f);
}

__global__ void fillNan(void *p, uint32_t type, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x)
    storeElt(p, i, type, __int_as_float(0x7fc00000));
}

__global__ void countNan(const void *p, uint32_t type, int64_t count, unsigned long long *out) {
  unsigned long long n = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x)
    n += isnan(loadElt(p, i, type)) ? 1 : 0;
  if (n)
    atomicAdd(out, n);
}

/// Random codes of a quantized B (`bytes` of them): FP8 without its NaN
/// codes; int8 and int4 any.
__global__ void fillCodes(uint8_t *p, uint32_t quant, int64_t bytes, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < bytes;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t code = mix(seed * 0x9E3779B97F4A7C15ull + uint64_t(i)) & 0xFFu;
    if (quant == kFp8Block128 && (code & 0x7Fu) == 0x7Fu)
      code ^= 1u;
    p[i] = uint8_t(code);
  }
}

/// Scales of a quantized B: in [0.5, 1) / scaleOver, and zero points 4..11
/// (every odd float with zero points).
__global__ void fillScales(float *p, int64_t count, float scaleOver, bool zeroPoints,
                           uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = mix(seed * 0x9E3779B97F4A7C15ull + uint64_t(i));
    p[i] = zeroPoints && i % 2 == 1 ? float(4 + h % 8)
                                    : (0.5f + float(h >> 8) / 33554432.0f) / scaleOver;
  }
}

/// Group g's product: its operands' and output's offsets in elements (a
/// quantized B: bytes of codes, and floats of scales).
struct Groups {
  int64_t a, b, c, scales;
};

/// Group grp's B.
__device__ __forceinline__ Mat groupB(const Mat &b, const Groups &stride, int64_t grp) {
  Mat x = b;
  if (b.quant != kDense) {
    x.p = static_cast<const char *>(b.p) + grp * stride.b;
    x.scales = b.scales + grp * stride.scales;
  } else {
    x.p = offsetBytes(b.p, grp * stride.b, b.type);
  }
  return x;
}

/// sample s: |C - ref| and |ref| at a pseudo-random element (the first
/// samples are the corners of the first and last group).
__global__ void checkSamples(Gemm g, Groups stride, int64_t groups, float *err, float *ref) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= kSamples)
    return;
  const uint32_t h = mix(uint64_t(s) * 7919u + 17u);
  int64_t grp = h % groups, i = mix(h) % g.m, j = mix(h + 1) % g.n;
  if (s < 8) {
    grp = s < 4 ? 0 : groups - 1;
    i = (s & 1) ? g.m - 1 : 0;
    j = (s & 2) ? g.n - 1 : 0;
  }
  Mat a = g.a;
  a.p = offsetBytes(a.p, grp * stride.a, a.type);
  const Mat b = groupB(g.b, stride, grp);
  float sum = 0.0f;
  for (int64_t p = 0; p < g.k; ++p) {
    float bv = opValue(b, p, j);
    if (b.type == kBF16) // the tile reads B's values rounded to bf16
      bv = __bfloat162float(__float2bfloat16_rn(bv));
    sum += loadElt(a.p, a.at(i, p), a.type) * bv;
  }
  const float c = loadElt(offsetBytes(g.c, grp * stride.c, g.cType), i * g.ldc + j, g.cType);
  err[s] = isnan(c) ? INFINITY : fabsf(c - sum);
  ref[s] = fabsf(sum);
}

__global__ void __launch_bounds__(kThreads)
    benchKernel(Gemm g, Groups stride, int64_t tileM, int64_t tileN, int64_t tilesM,
                int64_t tilesN) {
  extern __shared__ __align__(16) unsigned char dynamicSmem[];
  Smem &smem = *reinterpret_cast<Smem *>(dynamicSmem);
  const int64_t perGroup = tilesM * tilesN, grp = blockIdx.x / perGroup,
                tile = blockIdx.x % perGroup;
  const int64_t i0 = (tile / tilesN) * tileM, j0 = (tile % tilesN) * tileN;
  Gemm t = g;
  t.a.p = offsetBytes(g.a.p, grp * stride.a + g.a.at(i0, 0), g.a.type);
  t.b = groupB(g.b, stride, grp);
  if (t.b.quant != kDense)
    (t.b.trans ? t.b.row0 : t.b.col0) = j0;
  else
    t.b.p = offsetBytes(t.b.p, g.b.at(0, j0), g.b.type);
  t.c = const_cast<char *>(offsetBytes(g.c, grp * stride.c + i0 * g.ldc + j0, g.cType));
  t.m = min(tileM, g.m - i0);
  t.n = min(tileN, g.n - j0);
  gemm(t, smem);
}

/// Device memory released on every path out.
struct Buffers {
  std::vector<void *> held;
  ~Buffers() {
    for (void *p : held)
      release(p);
  }
  Error get(size_t bytes, void **out) {
    if (Error e = allocate(bytes, out); !e.empty())
      return e;
    held.push_back(*out);
    return {};
  }
};

/// Value e (0..7) of a decoded vector, as a float.
__device__ __forceinline__ float decodedAt(const uint4 &v, int e) {
  const uint32_t w = (&v.x)[e / 2];
  return __uint_as_float((e % 2 ? w >> 16 : w & 0xFFFFu) << 16);
}

__device__ __forceinline__ bool sameBits(float a, float b) {
  return (a != a && b != b) || __float_as_uint(a) == __float_as_uint(b);
}

/// checkDecodeBits: thread `code` (0..255) decodes vectors of that code
/// (and of code ^ 0x5A in the second word, so that every place sees every
/// code) in each format, scale and zero point.
__global__ void decodeBitsKernel(unsigned long long *mismatches) {
  const float scales[6] = {1.0f, 0.01f, 3.7e-5f, 1e30f, 1e-30f, 448.0f};
  const float zeros[4] = {0.0f, 8.0f, 15.0f, 7.5f};
  const uint32_t code = threadIdx.x;
  const auto bf16 = [](float v) { return __bfloat162float(__float2bfloat16_rn(v)); };
  for (float s : scales) {
    const uint2 codes = make_uint2(code * 0x01010101u, (code ^ 0x5Au) * 0x01010101u);
    const uint4 fp8 = quantDecode8(kFp8Block128, Quant8{codes, make_float2(s, 0.0f)});
    const uint4 int8 = quantDecode8(kInt8Channel, Quant8{codes, make_float2(s, 0.0f)});
    for (int e = 0; e < 8; ++e) {
      const uint32_t c = ((e < 4 ? codes.x : codes.y) >> (8 * (e % 4))) & 0xFFu;
      if (!sameBits(decodedAt(fp8, e), bf16(e4m3Value(c) * s)))
        atomicAdd(&mismatches[0], 1ull);
      if (!sameBits(decodedAt(int8, e), bf16(float(int8_t(c)) * s)))
        atomicAdd(&mismatches[1], 1ull);
    }
    for (float z : zeros) {
      const uint4 int4 = quantDecode8(kInt4Group, Quant8{codes, make_float2(s, z)});
      for (int e = 0; e < 8; ++e)
        if (!sameBits(decodedAt(int4, e), bf16((float((codes.x >> (4 * e)) & 15u) - z) * s)))
          atomicAdd(&mismatches[2], 1ull);
    }
  }
}

constexpr int kDecodeRounds = 4096, kDecodeBlocksAnSm = 8;

/// benchDecode: the vectors' codes change each round with what was
/// decoded, so that nothing is hoisted out of the loop.
__global__ void decodeRateKernel(uint32_t quant, unsigned *sink) {
  uint32_t acc = 0;
  uint2 codes = make_uint2(threadIdx.x * 0x9E3779B9u, blockIdx.x * 0x85EBCA6Bu);
  const float2 scale = make_float2(0.01f, 7.0f);
  for (int i = 0; i < kDecodeRounds; ++i) {
    const uint4 v = quantDecode8(quant, Quant8{codes, scale});
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
    codes.x += 0x01010101u + acc;
    codes.y ^= codes.x;
  }
  if (acc == 0x12345678u) // never, as far as the compiler knows
    *sink = acc;
}

} // namespace

Error checkDecodeBits(int64_t mismatches[3]) {
  Buffers held;
  void *counts = nullptr;
  if (Error e = held.get(3 * sizeof(unsigned long long), &counts); !e.empty())
    return e;
  auto *c = static_cast<unsigned long long *>(counts);
  decodeBitsKernel<<<1, 256>>>(c);
  MOEC_CUDA("the decode check", cudaGetLastError());
  unsigned long long host[3];
  MOEC_CUDA("the decode check", cudaMemcpy(host, c, sizeof(host), cudaMemcpyDeviceToHost));
  for (int f = 0; f < 3; ++f)
    mismatches[f] = int64_t(host[f]);
  return {};
}

Error benchDecode(double valuesPerClock[3]) {
  int sms = 0, kHz = 0;
  MOEC_CUDA("the decode bench", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  MOEC_CUDA("the decode bench", cudaDeviceGetAttribute(&kHz, cudaDevAttrClockRate, 0));
  Buffers held;
  void *sink = nullptr;
  if (Error e = held.get(sizeof(unsigned), &sink); !e.empty())
    return e;
  cudaEvent_t start, stop;
  MOEC_CUDA("the decode bench", cudaEventCreate(&start));
  MOEC_CUDA("the decode bench", cudaEventCreate(&stop));
  const int blocks = sms * kDecodeBlocksAnSm, threads = 256;
  const uint32_t formats[3] = {kFp8Block128, kInt8Channel, kInt4Group};
  Error failed;
  for (int f = 0; f < 3 && failed.empty(); ++f) {
    float ms = 0;
    for (int launch = 0; launch < 2; ++launch) { // a warm-up, then the timed one
      cudaEventRecord(start);
      decodeRateKernel<<<blocks, threads>>>(formats[f], static_cast<unsigned *>(sink));
      cudaEventRecord(stop);
      if (cudaError_t e = cudaEventSynchronize(stop); e != cudaSuccess)
        failed = std::string("the decode bench: ") + cudaGetErrorString(e);
      cudaEventElapsedTime(&ms, start, stop);
    }
    const double values = double(blocks) * threads * kDecodeRounds * 8;
    valuesPerClock[f] = values / (double(ms) * 1e-3) / (double(kHz) * 1e3) / sms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (failed.empty())
    MOEC_CUDA("the decode bench", cudaGetLastError());
  return failed;
}

Error benchGemm(const GemmBenchCase &spec, GemmBenchResult *out) {
  *out = GemmBenchResult();
  const int64_t G = spec.groups, m = spec.m, n = spec.n, k = spec.k;
  if (G < 1 || m < 1 || n < 1 || k < 1 || spec.tileM < 1 || spec.tileN < 1)
    return "benchGemm: groups, m, n, k and the tile must be positive";
  const size_t elt = spec.type == kBF16 ? 2 : 4, celt = spec.cType == kBF16 ? 2 : 4;
  // A quantized B as stored: [n, k] when transB, else [k, n], and its
  // scales (LayerShape::scaleDims of that matrix).
  const bool quantized = spec.quant != kDense;
  const int64_t rows = spec.transB ? n : k, cols = spec.transB ? k : n;
  if (Error e = gemmBenchCaseError(spec); !e.empty())
    return "benchGemm: " + e;
  const int64_t codeBytes = spec.quant == kInt4Group ? rows * cols / 2 : rows * cols;
  int64_t scaleLd = 1, scaleCount = rows;
  if (spec.quant == kFp8Block128) {
    scaleLd = (cols + 127) / 128;
    scaleCount = (rows + 127) / 128 * scaleLd;
  } else if (spec.quant == kInt4Group) {
    scaleLd = cols / spec.group;
    scaleCount = rows * scaleLd * (spec.zeroPoints ? 2 : 1);
  }
  Buffers buffers;
  void *a = nullptr, *b = nullptr, *c = nullptr, *scratch = nullptr, *scales = nullptr;
  if (Error e = buffers.get(size_t(G * m * k) * elt, &a); !e.empty())
    return e;
  if (Error e = buffers.get(quantized ? size_t(G * codeBytes) : size_t(G * k * n) * elt, &b);
      !e.empty())
    return e;
  if (quantized)
    if (Error e = buffers.get(size_t(G * scaleCount) * sizeof(float), &scales); !e.empty())
      return e;
  if (Error e = buffers.get(size_t(G * m * n) * celt, &c); !e.empty())
    return e;
  if (Error e = buffers.get(2 * kSamples * sizeof(float) + 16, &scratch); !e.empty())
    return e;
  Gemm g;
  g.a = Mat{a, spec.type, spec.transA ? m : k, spec.transA};
  g.b = Mat{b, spec.type, spec.transB ? k : n, spec.transB};
  if (quantized) {
    g.b.quant = spec.quant;
    g.b.scales = static_cast<const float *>(scales);
    g.b.scaleLd = scaleLd;
    while (spec.group > (int64_t(1) << g.b.groupShift))
      ++g.b.groupShift;
    g.b.zeroPoints = spec.quant == kInt4Group && spec.zeroPoints;
  }
  g.c = c;
  g.cType = spec.cType;
  g.ldc = n;
  g.d = nullptr;
  g.dType = kF32;
  g.ldd = 0;
  g.m = m;
  g.n = n;
  g.k = k;
  g.scale = 1.0f;
  g.accumulate = false;
  const Groups stride{m * k, quantized ? codeBytes : k * n, m * n, scaleCount};
  fillRandom<<<1024, 256>>>(a, spec.type, G * m * k, 1);
  if (quantized) {
    // Values about [-1, 1): FP8 codes reach 448, int8 127, int4 8.
    const float over = spec.quant == kFp8Block128   ? 448.0f
                       : spec.quant == kInt8Channel ? 127.0f
                                                    : 8.0f;
    fillCodes<<<1024, 256>>>(static_cast<uint8_t *>(b), spec.quant, G * codeBytes, 2);
    fillScales<<<1024, 256>>>(static_cast<float *>(scales), G * scaleCount, over, g.b.zeroPoints,
                              3);
  } else {
    fillRandom<<<1024, 256>>>(b, spec.type, G * k * n, 2);
  }
  fillNan<<<1024, 256>>>(c, spec.cType, G * m * n);
  MOEC_CUDA("filling the operands", cudaGetLastError());

  const int64_t tilesM = (m + spec.tileM - 1) / spec.tileM,
                tilesN = (n + spec.tileN - 1) / spec.tileN, blocks = G * tilesM * tilesN;
  if (blocks > int64_t(INT32_MAX))
    return "benchGemm: too many tiles for one launch";
  const size_t smem = smemBytes();
  MOEC_CUDA("cudaFuncSetAttribute", allowSmem(benchKernel, smem));
  const auto launch = [&] {
    benchKernel<<<unsigned(blocks), kThreads, smem>>>(g, stride, spec.tileM, spec.tileN, tilesM,
                                                      tilesN);
  };
  launch();
  MOEC_CUDA("the tile benchmark", cudaGetLastError());
  MOEC_CUDA("the tile benchmark", cudaDeviceSynchronize());

  // The check.
  float *err = static_cast<float *>(scratch), *ref = err + kSamples;
  auto *nan = reinterpret_cast<unsigned long long *>(ref + kSamples);
  MOEC_CUDA("cudaMemset", cudaMemset(nan, 0, sizeof(unsigned long long)));
  countNan<<<1024, 256>>>(c, spec.cType, G * m * n, nan);
  checkSamples<<<kSamples / 128, 128>>>(g, stride, G, err, ref);
  MOEC_CUDA("the check", cudaGetLastError());
  std::vector<float> hostErr(kSamples), hostRef(kSamples);
  unsigned long long unwritten = 0;
  MOEC_CUDA("reading the check", cudaMemcpy(hostErr.data(), err, kSamples * sizeof(float),
                                            cudaMemcpyDeviceToHost));
  MOEC_CUDA("reading the check", cudaMemcpy(hostRef.data(), ref, kSamples * sizeof(float),
                                            cudaMemcpyDeviceToHost));
  MOEC_CUDA("reading the check",
            cudaMemcpy(&unwritten, nan, sizeof(unwritten), cudaMemcpyDeviceToHost));
  const float maxRef = *std::max_element(hostRef.begin(), hostRef.end());
  const float maxErr = *std::max_element(hostErr.begin(), hostErr.end());
  out->error = maxRef > 0 ? double(maxErr) / maxRef : double(maxErr);
  out->unwritten = int64_t(unwritten);

  // The timing: one event pair per launch, the median.
  std::vector<cudaEvent_t> events(2 * size_t(std::max(1, spec.repeats)));
  for (cudaEvent_t &e : events)
    MOEC_CUDA("cudaEventCreate", cudaEventCreate(&e));
  for (size_t r = 0; r < events.size() / 2; ++r) {
    cudaEventRecord(events[2 * r]);
    launch();
    cudaEventRecord(events[2 * r + 1]);
  }
  const cudaError_t done = cudaEventSynchronize(events.back());
  std::vector<float> ms(events.size() / 2);
  for (size_t r = 0; r < ms.size(); ++r)
    cudaEventElapsedTime(&ms[r], events[2 * r], events[2 * r + 1]);
  for (cudaEvent_t &e : events)
    cudaEventDestroy(e);
  MOEC_CUDA("the tile benchmark", done == cudaSuccess ? cudaGetLastError() : done);
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  out->seconds = ms[ms.size() / 2] / 1e3;
  return {};
}

} // namespace moec::cuda::device
