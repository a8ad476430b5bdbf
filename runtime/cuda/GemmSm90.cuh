//===- GemmSm90.cuh - GMM tiles on Hopper's warpgroup matrix instructions ===//
//
// The tile path of compute capability 9.0 (built for sm_90a: wgmma exists
// nowhere else; Gemm.cuh takes it only where __CUDA_ARCH_FEAT_SM90_ALL is
// defined). A block of 128 x kN of the tile's output is two warpgroups of
// 64 x kN, each a chain of wgmma.mma_async m64nNk16 with both operands in
// shared memory and its accumulators in registers (kN / 2 floats a thread:
// no operand fragments in registers, so the persistent kernel keeps room).
//
// Operands reach shared memory by cp.async, 16 bytes a thread, in the
// layouts wgmma reads with 128-byte swizzling: 64 deep a stage, each
// operand either K-major (rows of 64 k, 128 bytes, the 16-byte chunks of
// row r at chunk ^ (r % 8)) or MN-major (for every 64 of M or N, 64 rows
// of k, the same swizzle by k % 8), whichever its storage gives, so every
// copy is a contiguous 16-byte vector and zero-filled outside the tile.
// Each thread's vectors keep one swizzle phase, so its addresses are set
// once a block (WgCopy) and a step adds one stride.
// WgShape::kStages stages (4 at 256 wide, 6 narrower), kStages - 2 copies
// ahead: the stage a step fills was read by the wgmma two steps back, which
// each warpgroup has waited for (wgmma.wait_group 1) before the barrier
// that opens the step.
//
// Everything here is inlined into its kernel: a function call anywhere in
// a kernel that issues wgmma makes ptxas serialize all of them (C7510).
//
// The sums run in a fixed order (k ascending), so a run's bits do not
// change from pass to pass.
//
//===----------------------------------------------------------------------===//
#ifndef MOEC_RUNTIME_CUDA_GEMMSM90_CUH
#define MOEC_RUNTIME_CUDA_GEMMSM90_CUH

#include "runtime/cuda/Tile.cuh"

namespace moec::cuda::device {
namespace {

constexpr int kWgBK = 64;      ///< k per stage: one 128-byte swizzle row of bf16
constexpr int kWgMaxN = 256;   ///< the widest block
/// Shared memory of the path: stages of A (128 x 64) and B (64 x kN), and
/// 1 KiB to align the stages to the swizzle's 1024-byte atoms.
constexpr int kWgSmemBytes = 4 * (kBM + kWgMaxN) * kWgBK * 2 + 1024;

template <int kN> struct WgShape {
  static constexpr int kABytes = kBM * kWgBK * 2, kBBytes = kN * kWgBK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kFit = (kWgSmemBytes - 1024) / kStageBytes;
  static constexpr int kStages = kFit > 6 ? 6 : kFit;
};

/// A shared-memory matrix descriptor with 128-byte swizzling: the start
/// address, the leading and the stride byte offsets (16-byte units).
__device__ __forceinline__ uint64_t wgDescriptor(uint32_t address, uint32_t leading,
                                                 uint32_t stride) {
  return uint64_t((address & 0x3FFFF) >> 4) | uint64_t((leading >> 4) & 0x3FFF) << 16 |
         uint64_t((stride >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

__device__ __forceinline__ void cpAsync16(uint32_t dst, const void *src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(in ? 16 : 0));
}

/// One thread's share of an operand's stage copies for a block of the tile:
/// kVectors 16-byte vectors, `srcVector` elements and `dstVector` bytes
/// apart; a step moves the source by `srcStep` elements. Vector i at step s
/// reads k = kAt + 64 s + i kVector, and is inside when i < live and k < kEnd
/// (outside: zero-filled).
template <int kVectors> struct WgCopy {
  const uint16_t *base, *src;
  int64_t srcVector, srcStep, kAt, kEnd;
  uint32_t dst, dstVector;
  int live, kVector;

  __device__ __forceinline__ void issue(int64_t step, uint32_t stage) const {
    const uint16_t *from = src + step * srcStep;
    const int64_t k = kAt + step * kWgBK;
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      const bool in = i < live && k + i * kVector < kEnd;
      cpAsync16(stage + dst + i * dstVector, in ? from + i * srcVector : base, in);
    }
  }
};

/// A K-major operand (stored [mn][k], `ld` apart): kRows rows of M (or N)
/// from mn0, each 64 of k a step, 128 bytes a row, chunk c of row r at
/// c ^ (r % 8). A thread copies chunk tid % 8 of rows tid / 8 + 32 i.
template <int kRows>
__device__ __forceinline__ WgCopy<kRows / 32> wgCopyK(const Mat &x, int64_t mn0, int64_t mnEnd,
                                                      int64_t kEnd) {
  WgCopy<kRows / 32> w;
  const int c = threadIdx.x & 7, r = threadIdx.x >> 3;
  w.base = static_cast<const uint16_t *>(x.p);
  w.src = w.base + (mn0 + r) * x.ld + c * 8;
  w.srcVector = 32 * x.ld;
  w.srcStep = kWgBK;
  w.dst = uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
  w.dstVector = 32 * 128;
  const int64_t rowsLeft = mnEnd - mn0 - r; // rows from this thread's first
  w.live = rowsLeft <= 0 ? 0 : rowsLeft >= kRows ? kRows / 32 : int((rowsLeft + 31) / 32);
  w.kAt = c * 8;
  w.kVector = 0;
  w.kEnd = kEnd;
  return w;
}

/// An MN-major operand (stored [k][mn], `ld` apart): for each 64 of the
/// kCols of M (or N) from mn0, 64 rows of k a step, 128 bytes a row,
/// swizzled by k. A thread copies chunk tid % (kCols / 8) of k rows
/// tid / (kCols / 8) + (256 / (kCols / 8)) i.
template <int kCols>
__device__ __forceinline__ WgCopy<kCols / 32> wgCopyMN(const Mat &x, int64_t mn0, int64_t mnEnd,
                                                       int64_t kEnd) {
  constexpr int kChunks = kCols / 8, kRowsPerPass = kThreads / kChunks;
  WgCopy<kCols / 32> w;
  const int cc = threadIdx.x % kChunks, r = threadIdx.x / kChunks, c = cc & 7;
  w.base = static_cast<const uint16_t *>(x.p);
  w.src = w.base + r * x.ld + mn0 + cc * 8;
  w.srcVector = kRowsPerPass * x.ld;
  w.srcStep = kWgBK * x.ld;
  w.dst = uint32_t((cc >> 3) * kWgBK * 128 + r * 128 + ((c ^ (r & 7)) << 4));
  w.dstVector = kRowsPerPass * 128;
  w.live = mn0 + cc * 8 < mnEnd ? kCols / 32 : 0;
  w.kAt = r;
  w.kVector = kRowsPerPass;
  w.kEnd = kEnd;
  return w;
}

/// One thread's share of a quantized B's stage: the vectors WgCopy would
/// copy of a bf16 B (wgCopyK's when K-major, wgCopyMN's when MN-major),
/// each 8 values along a stored row. load() reads a step's codes and scales
/// into registers; store() decodes them (quantDecode8) into a stage, zero
/// outside the tile. gemmWgmmaT loads a step's codes one step before it
/// stores them, so the reads from memory run beside a step's wgmma.
///
/// The addresses are set once a block, as WgCopy's are: vector i's codes at
/// step s are `codes` + i `vectorBytes` + s `stepBytes`, and its scale's
/// index (quantScale's) is (r >> rShift) rowLd + (c >> cShift) for its
/// stored (r, c), counted in 32 bits from a corner (R, C) whose bits below
/// the shifts are zero, so the shifts give quantScale's blocks, rows and
/// groups. (A tile's stored extent and one weight's scales are far below
/// 2^31; the corner itself is 64-bit.)
template <int kN, bool kMN> struct WgDecode {
  static constexpr int kChunks = kMN ? kN / 8 : 8;
  static constexpr int kRowsPerPass = kThreads / kChunks;
  static constexpr int kVectors = kN / 32;
  const uint8_t *codes; ///< vector 0's codes at step 0
  const float *scales;  ///< the scale (or pair) of stored (R, C)
  uint32_t quant;
  int32_t vectorBytes, stepBytes;
  int32_t r, c;                  ///< vector 0's stored (r, c) at step 0, less (R, C)
  int32_t rShift, cShift, rowLd; ///< the scale index's form
  int32_t k, kEnd;               ///< vector 0's k at step 0; the tile's depth
  int32_t live;                  ///< vectors inside the tile's n
  float zero;                    ///< the zero point without stored ones
  bool pairs;
  uint32_t dst;
  Quant8 held[kVectors];

  __device__ __forceinline__ WgDecode(const Mat &b, int64_t j0, int64_t n, int64_t depth)
      : quant(b.quant), kEnd(int32_t(depth)), pairs(b.zeroPoints) {
    const int cc = threadIdx.x % kChunks, row = threadIdx.x / kChunks, ch = cc & 7;
    int64_t mn;
    if constexpr (kMN) {
      mn = j0 + cc * 8;
      k = row;
      dst = uint32_t((cc >> 3) * kWgBK * 128 + row * 128 + ((ch ^ (row & 7)) << 4));
      live = mn < n ? kVectors : 0;
    } else {
      mn = j0 + row;
      k = cc * 8;
      dst = uint32_t(row * 128 + ((ch ^ (row & 7)) << 4));
      live = mn < n ? int32_t((n - mn + 31) / 32) : 0;
      live = live > kVectors ? kVectors : live;
    }
    int64_t r0, c0;
    storedAt(b, k, mn, &r0, &c0);
    const int64_t rowBytes = b.quant == kInt4Group ? b.ld / 2 : b.ld;
    codes =
        static_cast<const uint8_t *>(b.p) + r0 * rowBytes + (b.quant == kInt4Group ? c0 / 2 : c0);
    // Vectors are 32 of n apart (K-major: rows) or kRowsPerPass of k
    // (MN-major: rows); a step is 64 of k (K-major: columns; MN-major: rows).
    vectorBytes = int32_t((kMN ? kRowsPerPass : 32) * rowBytes);
    stepBytes = int32_t(kMN ? kWgBK * rowBytes : (b.quant == kInt4Group ? kWgBK / 2 : kWgBK));
    switch (b.quant) {
    case kFp8Block128:
      rShift = 7, cShift = 7, rowLd = int32_t(b.scaleLd), zero = 0.0f;
      break;
    case kInt8Channel:
      rShift = 0, cShift = 31, rowLd = 1, zero = 0.0f;
      break;
    default:
      rShift = 0, cShift = b.groupShift, rowLd = int32_t(b.scaleLd), zero = 8.0f;
      break;
    }
    const int64_t R = r0 & ~((int64_t(1) << rShift) - 1), C = c0 & ~((int64_t(1) << cShift) - 1);
    scales = b.scales + ((R >> rShift) * rowLd + (C >> cShift)) * (pairs ? 2 : 1);
    r = int32_t(r0 - R);
    c = int32_t(c0 - C);
  }

  __device__ __forceinline__ void load(int32_t step) {
    const int32_t dk = step * kWgBK;
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      held[i] = Quant8{make_uint2(0, 0), make_float2(0.0f, 0.0f)};
      if (i < live && k + dk + (kMN ? kRowsPerPass * i : 0) < kEnd) {
        const uint8_t *at = codes + (i * vectorBytes + step * stepBytes);
        held[i].codes = quant == kInt4Group ? make_uint2(*reinterpret_cast<const uint32_t *>(at), 0)
                                            : *reinterpret_cast<const uint2 *>(at);
        const int32_t vr = r + (kMN ? dk + kRowsPerPass * i : 32 * i), vc = c + (kMN ? 0 : dk);
        const int32_t s = (vr >> rShift) * rowLd + (vc >> cShift);
        held[i].scale = pairs ? *reinterpret_cast<const float2 *>(scales + 2 * s)
                              : make_float2(scales[s], zero);
      }
    }
  }

  __device__ __forceinline__ void store(uint32_t stage) const {
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      const uint4 v = quantDecode8(quant, held[i]);
      const uint32_t to = stage + dst + uint32_t(i) * (kMN ? kRowsPerPass * 128 : 32 * 128);
      asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(to), "r"(v.x), "r"(v.y),
                   "r"(v.z), "r"(v.w)
                   : "memory");
    }
  }
};

__device__ __forceinline__ void wgFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void wgWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

/// D += A B over k 16, m 64, n 64 / 128 / 256: A and B by descriptor, D in
/// the warpgroup's registers (N / 2 a thread). One function a shape: the
/// asm statement names every accumulator register, so the three differ
/// only in that count; kTA / kTB are the transpose bits (MN-major).
template <int kTA, int kTB>
__device__ __forceinline__ void wgmma64(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %34, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
               "}, %32, %33, p, 1, 1, %35, %36;\n"
               "}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                 "+f"(d[30]), "+f"(d[31])
               : "l"(a), "l"(b), "r"(1), "n"(kTA), "n"(kTB));
}

template <int kTA, int kTB>
__device__ __forceinline__ void wgmma128(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
               "}, %64, %65, p, 1, 1, %67, %68;\n"
               "}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                 "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                 "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                 "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "l"(a), "l"(b), "r"(1), "n"(kTA), "n"(kTB));
}

template <int kTA, int kTB>
__device__ __forceinline__ void wgmma256(float (&d)[128], uint64_t a, uint64_t b) {
  asm volatile("{\n"
               ".reg .pred p;\n"
               "setp.ne.b32 p, %130, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
               "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
               "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
               "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
               "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
               "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
               "}, %128, %129, p, 1, 1, %131, %132;\n"
               "}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                 "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                 "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                 "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                 "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                 "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                 "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                 "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                 "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                 "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                 "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
                 "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                 "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
                 "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
                 "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
                 "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                 "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
                 "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
                 "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
                 "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                 "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
                 "+f"(d[126]), "+f"(d[127])
               : "l"(a), "l"(b), "r"(1), "n"(kTA), "n"(kTB));
}

template <int kN, int kTA, int kTB>
__device__ __forceinline__ void wgmmaN(float (&d)[kN / 2], uint64_t a, uint64_t b) {
  if constexpr (kN == 64)
    wgmma64<kTA, kTB>(d, a, b);
  else if constexpr (kN == 128)
    wgmma128<kTA, kTB>(d, a, b);
  else
    wgmma256<kTA, kTB>(d, a, b);
}

/// Two values of C at (i, j) and (i, j + 1), j + 1 < n: one 4-byte store
/// where C is bf16 and written plainly, else one at a time.
__device__ __forceinline__ void epiloguePair(const Gemm &g, int64_t i, int64_t j, float v0,
                                             float v1) {
  if (!g.accumulate && !g.d && g.cType == kBF16 && g.scale == 1.0f) {
    const int64_t at = i * g.ldc + j;
    __nv_bfloat16 *c = static_cast<__nv_bfloat16 *>(g.c) + at;
    if ((reinterpret_cast<uintptr_t>(c) & 3) == 0) {
      *reinterpret_cast<__nv_bfloat162 *>(c) = __floats2bfloat162_rn(v0, v1);
      return;
    }
  }
  epilogue(g, i, j, v0);
  epilogue(g, i, j + 1, v1);
}

/// C in blocks of 128 x kN: warpgroup w computes rows 64w .. 64w + 63.
/// kTA / kTB: A / B is MN-major in shared memory (wgmma's transpose bit).
/// kQB: B is a quantized weight, decoded into its stages (WgDecode).
template <int kN, int kTA, int kTB, bool kQB>
__device__ __forceinline__ void gemmWgmmaT(const Gemm &g, unsigned char *smem) {
  using Shape = WgShape<kN>;
  constexpr int kS = Shape::kStages;
  const uint32_t base = (sharedAddress(smem) + 1023u) & ~1023u;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int64_t steps = (g.k + kWgBK - 1) / kWgBK;
  for (int64_t i0 = 0; i0 < g.m; i0 += kBM)
    for (int64_t j0 = 0; j0 < g.n; j0 += kN) {
      const auto copyA = [&] {
        if constexpr (kTA != 0)
          return wgCopyMN<kBM>(g.a, i0, g.m, g.k);
        else
          return wgCopyK<kBM>(g.a, i0, g.m, g.k);
      }();
      const auto copyB = [&] {
        if constexpr (kTB != 0)
          return wgCopyMN<kN>(g.b, j0, g.n, g.k);
        else
          return wgCopyK<kN>(g.b, j0, g.n, g.k);
      }();
      WgDecode<kN, kTB != 0> decodeB(g.b, j0, g.n, g.k);
      const auto load = [&](int64_t step) {
        const uint32_t a = base + uint32_t(step % kS) * Shape::kStageBytes;
        copyA.issue(step, a);
        if constexpr (!kQB)
          copyB.issue(step, a + Shape::kABytes);
      };
      // A quantized B: step `step`'s codes, loaded before, into its stage.
      const auto decode = [&](int64_t step) {
        if constexpr (kQB)
          decodeB.store(base + uint32_t(step % kS) * Shape::kStageBytes + Shape::kABytes);
      };
      float acc[kN / 2];
#pragma unroll
      for (int e = 0; e < kN / 2; ++e)
        acc[e] = 0.0f;
      __syncthreads();
      for (int st = 0; st < kS - 2; ++st) {
        if (st < steps) {
          load(st);
          if constexpr (kQB) {
            decodeB.load(st);
            decode(st);
          }
        }
        asm volatile("cp.async.commit_group;\n" ::);
      }
      if constexpr (kQB)
        if (kS - 2 < steps)
          decodeB.load(kS - 2);
      for (int64_t step = 0; step < steps; ++step) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kS - 3));
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (step + kS - 2 < steps)
          load(step + kS - 2);
        asm volatile("cp.async.commit_group;\n" ::);
        const uint32_t a = base + uint32_t(step % kS) * Shape::kStageBytes;
        const uint32_t b = a + Shape::kABytes;
        wgFence();
#pragma unroll
        for (int kk = 0; kk < kWgBK / 16; ++kk) {
          // K-major: 16 of k are 32 bytes along a swizzled row; MN-major:
          // two 8-row groups of k (1024 bytes each).
          const uint64_t da =
              kTA ? wgDescriptor(a + wg * kWgBK * 128 + kk * 2048, kWgBK * 128, 1024)
                  : wgDescriptor(a + wg * 64 * 128 + kk * 32, 16, 1024);
          const uint64_t db = kTB ? wgDescriptor(b + kk * 2048, kWgBK * 128, 1024)
                                  : wgDescriptor(b + kk * 32, 16, 1024);
          wgmmaN<kN, kTA, kTB>(acc, da, db);
        }
        wgCommit();
        // A quantized B's stage kS - 2 ahead is decoded while these run
        // (its last reader, two steps back, has finished: the barrier above
        // follows every warpgroup's wait for it), and the next step's codes
        // are read.
        if constexpr (kQB) {
          if (step + kS - 2 < steps)
            decode(step + kS - 2);
          if (step + kS - 1 < steps)
            decodeB.load(step + kS - 1);
        }
        wgWait<1>();
      }
      wgWait<0>();
      asm volatile("cp.async.wait_group 0;\n" ::);
      // Accumulator e of a thread: n8 block e / 4; rows +8 for e % 4 >= 2,
      // columns +1 for odd e.
      const int64_t row = i0 + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int e = 0; e < kN / 2; e += 2) {
        const int64_t i = row + ((e % 4) >= 2 ? 8 : 0);
        const int64_t j = j0 + (e / 4) * 8 + (lane % 4) * 2;
        if (i < g.m && j + 1 < g.n)
          epiloguePair(g, i, j, acc[e], acc[e + 1]);
        else if (i < g.m && j < g.n)
          epilogue(g, i, j, acc[e]);
      }
    }
  __syncthreads();
}

/// The wgmma path for aligned bf16 operands (vectorizable in Tile.cuh), B
/// perhaps a quantized weight (quantVectors).
template <int kN> __device__ __forceinline__ void gemmWgmma(const Gemm &g, unsigned char *smem) {
  // A row-major A and a transposed B are K-major; the others MN-major. A
  // quantized B is an activation form's weight: A row-major.
  if (g.b.quant != kDense) {
    // At most 128 columns at a time (gemm()): decoding beside 256 columns'
    // accumulators would spill registers.
    if constexpr (kN <= 128) {
      if (g.b.trans)
        gemmWgmmaT<kN, 0, 0, true>(g, smem);
      else
        gemmWgmmaT<kN, 0, 1, true>(g, smem);
    }
    return;
  }
  if (g.a.trans) {
    if (g.b.trans)
      gemmWgmmaT<kN, 1, 0, false>(g, smem);
    else
      gemmWgmmaT<kN, 1, 1, false>(g, smem);
  } else {
    if (g.b.trans)
      gemmWgmmaT<kN, 0, 0, false>(g, smem);
    else
      gemmWgmmaT<kN, 0, 1, false>(g, smem);
  }
}

} // namespace
} // namespace moec::cuda::device

#endif // MOEC_RUNTIME_CUDA_GEMMSM90_CUH
