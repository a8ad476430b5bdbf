//===- GemmSm80.cuh - GMM tiles on mma.sync, wmma and FMA ----------------===//
//
// The tile paths every GPU of compute capability 8.0 or later runs:
// mma.sync m16n8k16 fed by cp.async (three stages, 64 deep) and ldmatrix
// for wide tiles of 16-byte-aligned bf16 operands, wmma for the others
// (and for a quantized weight, decoded as it is loaded), fp32 FMA for other
// operand types. 256 threads, blocks of 128 x 128 (or
// narrower) of the tile's output at a time. Every sum has a fixed order.
// Every path is inlined (__forceinline__, as is gemm() and the task
// runner): on Hopper a function call anywhere in the persistent kernel
// makes ptxas serialize every wgmma in it (warning C7510).
//
//===----------------------------------------------------------------------===//
#ifndef MOEC_RUNTIME_CUDA_GEMMSM80_CUH
#define MOEC_RUNTIME_CUDA_GEMMSM80_CUH

#include "runtime/cuda/Tile.cuh"

#include <mma.h>

namespace moec::cuda::device {
namespace {

constexpr int kTcBK = 64; ///< the tensor-core path's depth per shared-memory step

struct SmemTc {
  __nv_bfloat16 a[kBM][kTcBK + 8];
  __nv_bfloat16 b[kTcBK][kBN + 8];
  float stage[kThreads / 32][16 * 16];
};
struct SmemF32 {
  float a[kBK][kBM + 4]; ///< transposed: [p][i]
  float b[kBK][kBN + 4];
};
/// The mma.sync path: kStages stages of A and B, each operand 128 x kMmaBK
/// (or kMmaBK x 128) bf16 with its rows padded by 8 elements.
constexpr int kMmaBK = 64, kStages = 3;
constexpr int kOperandElems = 128 * (kMmaBK + 8); // >= kMmaBK * (128 + 8)
struct SmemMma {
  uint16_t operand[kStages][2][kOperandElems]; ///< [stage][A, B]
};

/// Loads a kRows x kCols block of op(M) at (r0, c0) into shared bf16,
/// zero outside [0, rows) x [0, cols).
template <int kRows, int kCols, int kLd>
__device__ __forceinline__ void loadBf16(const Mat &x, int64_t r0, int64_t c0, int64_t rows,
                                         int64_t cols, __nv_bfloat16 (*s)[kLd]) {
  const uint16_t *p = static_cast<const uint16_t *>(x.p);
  const int tid = threadIdx.x;
  if (x.quant != kDense) {
    // A quantized weight: decoded a value at a time (narrow or unaligned
    // tiles; the wgmma path decodes 8 at a time).
    for (int e = tid; e < kRows * kCols; e += kThreads) {
      const int r = x.trans ? e % kRows : e / kCols;
      const int c = x.trans ? e / kRows : e % kCols;
      const int64_t gr = r0 + r, gc = c0 + c;
      s[r][c] = __float2bfloat16_rn(gr < rows && gc < cols ? quantValue(x, gr, gc) : 0.0f);
    }
    return;
  }
  const bool vector = !x.trans && (x.ld % 8) == 0 && (reinterpret_cast<uintptr_t>(p) % 16) == 0;
  if (vector) {
    constexpr int kVecPerRow = kCols / 8;
    for (int v = tid; v < kRows * kVecPerRow; v += kThreads) {
      const int r = v / kVecPerRow, c = (v % kVecPerRow) * 8;
      const int64_t gr = r0 + r, gc = c0 + c;
      uint4 value = make_uint4(0, 0, 0, 0);
      if (gr < rows && gc + 8 <= cols) {
        value = *reinterpret_cast<const uint4 *>(p + gr * x.ld + gc);
      } else if (gr < rows && gc < cols) {
        uint16_t tmp[8] = {};
        for (int e = 0; e < 8 && gc + e < cols; ++e)
          tmp[e] = p[gr * x.ld + gc + e];
        value = *reinterpret_cast<uint4 *>(tmp);
      }
      *reinterpret_cast<uint4 *>(&s[r][c]) = value;
    }
    return;
  }
  if (x.trans && (x.ld % 8) == 0 && (reinterpret_cast<uintptr_t>(p) % 16) == 0) {
    // Stored transposed: 8 consecutive rows of op(M) are contiguous; load
    // them as one vector and store them down a column of the block.
    constexpr int kVecPerCol = kRows / 8;
    for (int v = tid; v < kCols * kVecPerCol; v += kThreads) {
      const int c = v / kVecPerCol, r = (v % kVecPerCol) * 8;
      const int64_t gr = r0 + r, gc = c0 + c;
      uint16_t tmp[8] = {};
      if (gc < cols && gr + 8 <= rows) {
        *reinterpret_cast<uint4 *>(tmp) = *reinterpret_cast<const uint4 *>(p + gc * x.ld + gr);
      } else if (gc < cols) {
        for (int e = 0; e < 8 && gr + e < rows; ++e)
          tmp[e] = p[gc * x.ld + gr + e];
      }
      for (int e = 0; e < 8; ++e)
        reinterpret_cast<uint16_t *>(&s[r + e][0])[c] = tmp[e];
    }
    return;
  }
  // Unaligned: consecutive threads walk the stored rows.
  for (int e = tid; e < kRows * kCols; e += kThreads) {
    const int r = x.trans ? e % kRows : e / kCols;
    const int c = x.trans ? e / kRows : e % kCols;
    const int64_t gr = r0 + r, gc = c0 + c;
    uint16_t v = 0;
    if (gr < rows && gc < cols)
      v = p[x.at(gr, gc)];
    reinterpret_cast<uint16_t *>(&s[r][0])[c] = v;
  }
}

/// Blocks of 128 x kN of C: 8 warps as (8 / (kN / 32)) x (kN / 32), each
/// warp 16 x 16 fragments over its (128 / warpsM) x 32 part.
template <int kN> __device__ __forceinline__ void gemmTensorCores(const Gemm &g, SmemTc &s) {
  using namespace nvcuda;
  constexpr int kWarpsN = kN / 32, kWarpsM = 8 / kWarpsN, kFragsM = kBM / kWarpsM / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  for (int64_t i0 = 0; i0 < g.m; i0 += kBM)
    for (int64_t j0 = 0; j0 < g.n; j0 += kN) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kFragsM][2];
      for (int x = 0; x < kFragsM; ++x)
        for (int y = 0; y < 2; ++y)
          wmma::fill_fragment(acc[x][y], 0.0f);
      for (int64_t p0 = 0; p0 < g.k; p0 += kTcBK) {
        __syncthreads();
        loadBf16<kBM, kTcBK, kTcBK + 8>(g.a, i0, p0, g.m, g.k, s.a);
        loadBf16<kTcBK, kN, kBN + 8>(g.b, p0, j0, g.k, g.n, s.b);
        __syncthreads();
        for (int kk = 0; kk < kTcBK; kk += 16) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[kFragsM];
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
          for (int x = 0; x < kFragsM; ++x)
            wmma::load_matrix_sync(fa[x], &s.a[wm * (kBM / kWarpsM) + x * 16][kk], kTcBK + 8);
          for (int y = 0; y < 2; ++y)
            wmma::load_matrix_sync(fb[y], &s.b[kk][wn * 32 + y * 16], kBN + 8);
          for (int x = 0; x < kFragsM; ++x)
            for (int y = 0; y < 2; ++y)
              wmma::mma_sync(acc[x][y], fa[x], fb[y], acc[x][y]);
        }
      }
      float *stage = s.stage[warp];
      for (int x = 0; x < kFragsM; ++x)
        for (int y = 0; y < 2; ++y) {
          wmma::store_matrix_sync(stage, acc[x][y], 16, wmma::mem_row_major);
          __syncwarp();
          const int64_t bi = i0 + wm * (kBM / kWarpsM) + x * 16, bj = j0 + wn * 32 + y * 16;
          for (int e = lane; e < 256; e += 32) {
            const int64_t i = bi + e / 16, j = bj + e % 16;
            if (i < g.m && j < g.n)
              epilogue(g, i, j, stage[e]);
          }
          __syncwarp();
        }
    }
  __syncthreads();
}

__device__ __forceinline__ void gemmFp32(const Gemm &g, SmemF32 &s) {
  const int tid = threadIdx.x;
  const int ty = tid / 16, tx = tid % 16; // 16 x 16 threads of 8 x 8
  for (int64_t i0 = 0; i0 < g.m; i0 += kBM)
    for (int64_t j0 = 0; j0 < g.n; j0 += kBN) {
      float acc[8][8] = {};
      for (int64_t p0 = 0; p0 < g.k; p0 += kBK) {
        __syncthreads();
        for (int e = tid; e < kBM * kBK; e += kThreads) {
          const int i = g.a.trans ? e % kBM : e / kBK, p = g.a.trans ? e / kBM : e % kBK;
          const int64_t gi = i0 + i, gp = p0 + p;
          s.a[p][i] = gi < g.m && gp < g.k ? opValue(g.a, gi, gp) : 0.0f;
        }
        for (int e = tid; e < kBK * kBN; e += kThreads) {
          const int p = g.b.trans ? e % kBK : e / kBN, j = g.b.trans ? e / kBK : e % kBN;
          const int64_t gp = p0 + p, gj = j0 + j;
          s.b[p][j] = gp < g.k && gj < g.n ? opValue(g.b, gp, gj) : 0.0f;
        }
        __syncthreads();
        for (int p = 0; p < kBK; ++p) {
          float av[8], bv[8];
          for (int x = 0; x < 8; ++x)
            av[x] = s.a[p][ty * 8 + x];
          for (int y = 0; y < 8; ++y)
            bv[y] = s.b[p][tx * 8 + y];
          for (int x = 0; x < 8; ++x)
            for (int y = 0; y < 8; ++y)
              acc[x][y] = fmaf(av[x], bv[y], acc[x][y]);
        }
      }
      for (int x = 0; x < 8; ++x)
        for (int y = 0; y < 8; ++y) {
          const int64_t i = i0 + ty * 8 + x, j = j0 + tx * 8 + y;
          if (i < g.m && j < g.n)
            epilogue(g, i, j, acc[x][y]);
        }
    }
  __syncthreads();
}

//===----------------------------------------------------------------------===//
// The mma.sync path: cp.async double buffering, ldmatrix, m16n8k16
//===----------------------------------------------------------------------===//

/// Starts the copy of the kOpRows x kOpCols block of op(x) at (r0, c0)
/// into `dst`, laid out [non-contiguous][contiguous] with rows padded by 8
/// (a row-major operand: [row][col]; a transposed one: [col][row]). Vectors
/// outside rows x cols are zero-filled.
template <int kOpRows, int kOpCols>
__device__ __forceinline__ void copyStage(const Mat &x, int64_t r0, int64_t c0, int64_t rows,
                                          int64_t cols, uint16_t *dst) {
  const uint16_t *base = static_cast<const uint16_t *>(x.p);
  const int contig = x.trans ? kOpRows : kOpCols, nonContig = x.trans ? kOpCols : kOpRows;
  const int vectors = contig / 8, ld = contig + 8;
  for (int v = threadIdx.x; v < nonContig * vectors; v += kThreads) {
    const int nc = v / vectors, c = (v % vectors) * 8;
    // Global (op row, op col) of the vector's first element.
    const int64_t gr = x.trans ? r0 + c : r0 + nc, gc = x.trans ? c0 + nc : c0 + c;
    const bool in = gr < rows && gc < cols;
    const uint16_t *src = in ? base + x.at(gr, gc) : base;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     sharedAddress(dst + nc * ld + c)),
                 "l"(src), "r"(in ? 16 : 0));
  }
}

__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], const uint16_t *p, bool trans) {
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sharedAddress(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sharedAddress(p)));
}

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// C in blocks of 128 x kN, kMmaBK deep, with kStages - 1 stages in flight:
/// 8 warps as (8 / (kN / 32)) x (kN / 32), each (128 / warpsM) x 32 of C as
/// mma tiles of 16 x 8.
template <int kN> __device__ __forceinline__ void gemmMma(const Gemm &g, SmemMma &s) {
  constexpr int kWarpsN = kN / 32, kWarpsM = 8 / kWarpsN, kFragsM = kBM / kWarpsM / 16;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int q = lane / 8, r = lane % 8;
  // Row strides (elements) of the stage layouts.
  const int aLd = g.a.trans ? kBM + 8 : kMmaBK + 8;
  const int bLd = g.b.trans ? kMmaBK + 8 : kN + 8;
  const int64_t steps = (g.k + kMmaBK - 1) / kMmaBK;
  for (int64_t i0 = 0; i0 < g.m; i0 += kBM)
    for (int64_t j0 = 0; j0 < g.n; j0 += kN) {
      float acc[kFragsM][4][4] = {};
      __syncthreads();
      for (int st = 0; st < kStages - 1; ++st) {
        if (st < steps) {
          copyStage<kBM, kMmaBK>(g.a, i0, st * kMmaBK, g.m, g.k, s.operand[st][0]);
          copyStage<kMmaBK, kN>(g.b, st * kMmaBK, j0, g.k, g.n, s.operand[st][1]);
        }
        asm volatile("cp.async.commit_group;\n" ::);
      }
      for (int64_t step = 0; step < steps; ++step) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
        __syncthreads();
        // The stage computed last step is free: load kStages - 1 ahead.
        if (const int64_t next = step + kStages - 1; next < steps) {
          const int slot = int(next % kStages);
          copyStage<kBM, kMmaBK>(g.a, i0, next * kMmaBK, g.m, g.k, s.operand[slot][0]);
          copyStage<kMmaBK, kN>(g.b, next * kMmaBK, j0, g.k, g.n, s.operand[slot][1]);
        }
        asm volatile("cp.async.commit_group;\n" ::);
        const int stage = int(step % kStages);
        const uint16_t *sa = s.operand[stage][0], *sb = s.operand[stage][1];
        for (int kk = 0; kk < kMmaBK; kk += 16) {
          uint32_t af[kFragsM][4], bf[2][4];
          for (int mf = 0; mf < kFragsM; ++mf) {
            const int i = wm * (kBM / kWarpsM) + mf * 16;
            // Matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7,
            // k 8-15), (rows 8-15, k 8-15).
            if (g.a.trans)
              ldmatrix4(af[mf], sa + (kk + r + (q / 2) * 8) * aLd + i + (q % 2) * 8, true);
            else
              ldmatrix4(af[mf], sa + (i + r + (q % 2) * 8) * aLd + kk + (q / 2) * 8, false);
          }
          for (int nf = 0; nf < 2; ++nf) {
            const int j = wn * 32 + nf * 16;
            // Matrices: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15),
            // (k 8-15, n 8-15): two n8 fragments of two registers each.
            if (g.b.trans)
              ldmatrix4(bf[nf], sb + (j + r + (q / 2) * 8) * bLd + kk + (q % 2) * 8, false);
            else
              ldmatrix4(bf[nf], sb + (kk + r + (q % 2) * 8) * bLd + j + (q / 2) * 8, true);
          }
          for (int mf = 0; mf < kFragsM; ++mf)
            for (int nf = 0; nf < 4; ++nf)
              mma16816(acc[mf][nf], af[mf], bf[nf / 2][(nf % 2) * 2], bf[nf / 2][(nf % 2) * 2 + 1]);
        }
      }
      asm volatile("cp.async.wait_group 0;\n" ::);
      for (int mf = 0; mf < kFragsM; ++mf)
        for (int nf = 0; nf < 4; ++nf)
          for (int h = 0; h < 4; ++h) {
            const int64_t i = i0 + wm * (kBM / kWarpsM) + mf * 16 + lane / 4 + (h / 2) * 8;
            const int64_t j = j0 + wn * 32 + nf * 8 + (lane % 4) * 2 + h % 2;
            if (i < g.m && j < g.n)
              epilogue(g, i, j, acc[mf][nf][h]);
          }
    }
  __syncthreads();
}

} // namespace
} // namespace moec::cuda::device

#endif // MOEC_RUNTIME_CUDA_GEMMSM80_CUH
