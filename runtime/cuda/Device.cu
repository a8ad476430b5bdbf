//===- Device.cu - The CUDA backend's kernels and persistent kernel ---------===//
//
// See Device.h. The persistent kernel: thread block b owns the logical
// queues (rank, queue) numbered b, b + G, b + 2G, ... (G blocks, at most as
// many as the GPU holds at once, so every block runs and no block waits for
// one that cannot start). Its thread 0 picks the first owned queue whose
// head task has all its waits met (acquire loads of the event counters),
// or, when none is, takes one of a few other blocks' queues whose head is
// ready while their block is busy; a lock per queue keeps each queue's
// tasks one at a time and in order. The block runs the task, and thread 0
// then sends its signals (a fence, then atomic adds: release). A block
// never waits inside a task, and every queue's owner keeps polling it, so
// a program the compiler proved deadlock-free on the CPU's in-order queues
// cannot deadlock here either.
//
// Tiles: gemm() (Gemm.cuh) on tensor cores when both operands are bf16
// (fp32 accumulate): wgmma on Hopper, mma.sync or wmma elsewhere; other
// operand types as fp32 FMA. 256 threads, blocks of 128 x 256 (or
// narrower) of the tile's output at a time. Every sum has a fixed order,
// so a run's bits do not change from pass to pass.
//
//===----------------------------------------------------------------------===//

#include "runtime/backend/ScaleRule.h"
#include "runtime/cuda/CudaError.cuh"
#include "runtime/cuda/Device.h"
#include "runtime/cuda/Gemm.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

namespace moec::cuda::device {

namespace {


//===----------------------------------------------------------------------===//
// Tiles of a task program
//===----------------------------------------------------------------------===//

struct Tile {
  uint32_t expert, peer, rowTile;
  int64_t rowBegin, rowEnd, colBegin, colEnd;
};

/// With kTilingShareRows, a row tile covers its share of the `present` rows
/// it cuts (format::tileRows); otherwise its fixed rows stay.
__device__ void shareOut(const Op &op, Tile &t, int64_t present) {
  if (!op.shareRows || present < 0)
    return;
  t.rowBegin = int64_t(uint64_t(t.rowTile) * uint64_t(present) / op.rowTiles);
  t.rowEnd = int64_t(uint64_t(t.rowTile + 1) * uint64_t(present) / op.rowTiles);
}

__device__ Tile tileOf(const Op &op, uint32_t index) {
  Tile t;
  const uint32_t colTile = index % op.colTiles;
  const uint32_t rowTile = (index / op.colTiles) % op.rowTiles;
  t.rowTile = rowTile;
  t.peer = (index / (op.colTiles * op.rowTiles)) % op.peers;
  t.expert = index / (op.colTiles * op.rowTiles * op.peers);
  t.rowBegin = int64_t(uint64_t(rowTile) * op.rows / op.rowTiles);
  t.rowEnd = int64_t(uint64_t(rowTile + 1) * op.rows / op.rowTiles);
  t.colBegin = int64_t(uint64_t(colTile) * op.cols / op.colTiles);
  t.colEnd = int64_t(uint64_t(colTile + 1) * op.cols / op.colTiles);
  return t;
}

/// Copies `rows` rows of `rowBytes` between strided buffers with the whole
/// block. 16-byte aligned rows (the puts of bf16 rows of a width that is a
/// multiple of 8) go 16 bytes a thread, indexed in 32 bits (a 64-bit
/// division a vector cost more than the copy); others element by element.
/// (More loads in flight a thread made the persistent kernel spill.)
__device__ __forceinline__ void copyRows(const char *src, int64_t srcLd, char *dst, int64_t dstLd,
                                         int64_t rows, int64_t rowBytes) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         uintptr_t(srcLd) | uintptr_t(dstLd) | uintptr_t(rowBytes);
  if (bits % 16 == 0 && rows * (rowBytes / 16) < int64_t(INT32_MAX) - kThreads) {
    const int per = int(rowBytes / 16), total = int(rows) * per;
    for (int e = int(threadIdx.x); e < total; e += kThreads) {
      const int r = e / per, c = e - r * per;
      reinterpret_cast<uint4 *>(dst + r * dstLd)[c] =
          reinterpret_cast<const uint4 *>(src + r * srcLd)[c];
    }
  } else if (bits % 4 == 0) {
    const int64_t per = rowBytes / 4;
    for (int64_t e = threadIdx.x; e < rows * per; e += kThreads) {
      const int64_t r = e / per, c = e % per;
      reinterpret_cast<uint32_t *>(dst + r * dstLd)[c] =
          reinterpret_cast<const uint32_t *>(src + r * srcLd)[c];
    }
  } else {
    const int64_t per = rowBytes / 2;
    for (int64_t e = threadIdx.x; e < rows * per; e += kThreads) {
      const int64_t r = e / per, c = e % per;
      reinterpret_cast<uint16_t *>(dst + r * dstLd)[c] =
          reinterpret_cast<const uint16_t *>(src + r * srcLd)[c];
    }
  }
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/// Whether rows of bf16 can be read 8 at a time: both pointers 16-byte
/// aligned, every column offset, width and stride (or-ed into `offsets`) a
/// multiple of 8, and the element count within an int. The persistent
/// kernel's element tasks and the row kernels' launches both ask.
__host__ __device__ __forceinline__ bool bf16Vectors(const void *p, const void *q,
                                                     int64_t offsets, int64_t elements) {
  return (reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(q)) % 16 == 0 &&
         offsets % 8 == 0 && elements / 8 < int64_t(INT32_MAX);
}

__device__ __forceinline__ void runTask(const Program &P, uint32_t rank, uint32_t taskIndex, Smem &s) {
  const Task task = P.tasks[taskIndex];
  const Op &op = P.ops[task.op];
  Tile tile = tileOf(op, taskIndex - op.firstTask);
  void *const *data = P.data + size_t(rank) * P.slots;
  const auto slotType = [&](uint32_t slot) { return P.slotInfo[slot].dtype; };
  const auto slotLd = [&](uint32_t slot) { return P.slotInfo[slot].ld; };
  const auto index = [&](uint32_t slot, int64_t i) {
    return loadIndex(data[slot], slotType(slot), i);
  };

  if (op.kind == kDispatch || op.kind == kCombine) {
    const uint32_t peer = uint32_t((uint64_t(rank) + tile.peer) % P.ranks);
    const int64_t i = int64_t(peer) * P.localExperts + tile.expert;
    const int64_t count = index(op.sizeSlot, i);
    shareOut(op, tile, count);
    const int64_t end = min(tile.rowEnd, count);
    if (end <= tile.rowBegin)
      return;
    const uint32_t from = op.b, to = op.c;
    const uint32_t elt = eltSize(slotType(from));
    const int64_t srcLd = slotLd(from) * elt, dstLd = slotLd(to) * elt;
    const int64_t srcRow = index(op.srcOffsetSlot, i) + tile.rowBegin;
    const int64_t dstRow = index(op.targetOffsetSlot, i) + tile.rowBegin;
    const char *src = static_cast<const char *>(data[from]) + srcRow * srcLd + tile.colBegin * elt;
    char *dst = static_cast<char *>(P.data[size_t(peer) * P.slots + to]) + dstRow * dstLd +
                tile.colBegin * elt;
    copyRows(src, srcLd, dst, dstLd, end - tile.rowBegin, (tile.colEnd - tile.colBegin) * elt);
    return;
  }

  const int64_t segEnd = index(P.glist, tile.expert);
  const int64_t segBegin = tile.expert == 0 ? 0 : index(P.glist, tile.expert - 1);
  const int64_t segRows = segEnd - segBegin;
  if (!op.wgrad)
    shareOut(op, tile, segRows);

  if (op.kind == kGmm) {
    Gemm g;
    g.scale = op.scale;
    g.d = nullptr;
    g.dType = kF32;
    g.ldd = 0;
    if (op.wgrad) {
      // C[k, n] (+)= sum over the segment's rows m of A[m, k] B[m, n].
      g.a = Mat{offsetBytes(data[op.a], segBegin * slotLd(op.a) + tile.rowBegin, slotType(op.a)),
                slotType(op.a), slotLd(op.a), true};
      g.b = Mat{offsetBytes(data[op.b], segBegin * slotLd(op.b) + tile.colBegin, slotType(op.b)),
                slotType(op.b), slotLd(op.b), false};
      g.cType = slotType(op.c);
      g.ldc = op.ldc;
      g.c = const_cast<char *>(offsetBytes(
          data[op.c], op.expertStride * tile.expert + tile.rowBegin * op.ldc + tile.colBegin,
          g.cType));
      g.m = tile.rowEnd - tile.rowBegin;
      g.n = tile.colEnd - tile.colBegin;
      g.k = segRows;
      g.accumulate = op.accumulate;
      g.scale = 1.0f;
      if (g.k == 0 && !g.accumulate) {
        // An empty segment gives zeros.
        for (int64_t e = threadIdx.x; e < g.m * g.n; e += kThreads)
          storeElt(g.c, (e / g.n) * g.ldc + e % g.n, g.cType, 0.0f);
        __syncthreads();
        return;
      }
      gemm(g, s);
      return;
    }
    const int64_t end = min(tile.rowEnd, segRows);
    if (end <= tile.rowBegin)
      return;
    const int64_t row0 = segBegin + tile.rowBegin;
    g.a = Mat{offsetBytes(data[op.a], row0 * slotLd(op.a), slotType(op.a)), slotType(op.a),
              slotLd(op.a), false};
    if (op.quant != kDense) {
      // The expert's codes, decoded to A's type; the tile's columns of
      // op(B) are stored rows (B stored [N, K]) or columns from colBegin.
      g.b = Mat{static_cast<const char *>(data[op.b]) + op.expertStride * tile.expert, g.a.type,
                op.ldb, op.transposeB != 0};
      g.b.quant = op.quant;
      g.b.scales = static_cast<const float *>(data[op.scales]) + op.scaleStride * tile.expert;
      g.b.scaleLd = op.scaleLd;
      g.b.groupShift = op.groupShift;
      g.b.zeroPoints = op.zeroPoints != 0;
      (op.transposeB ? g.b.row0 : g.b.col0) = tile.colBegin;
    } else {
      const char *weight = offsetBytes(data[op.b], op.expertStride * tile.expert, slotType(op.b));
      // Forward: B [K, N] at column colBegin; data gradient: B stored [N, K].
      g.b = op.transposeB ? Mat{offsetBytes(weight, tile.colBegin * op.ldb, slotType(op.b)),
                                slotType(op.b), op.ldb, true}
                          : Mat{offsetBytes(weight, tile.colBegin, slotType(op.b)), slotType(op.b),
                                op.ldb, false};
    }
    g.cType = slotType(op.c);
    g.ldc = slotLd(op.c);
    g.c = const_cast<char *>(
        offsetBytes(data[op.c], row0 * g.ldc + tile.colBegin, g.cType));
    if (op.addend != 0xFFFFFFFFu) {
      g.dType = slotType(op.addend);
      g.ldd = slotLd(op.addend);
      g.d = offsetBytes(data[op.addend], row0 * g.ldd + tile.colBegin, g.dType);
    }
    g.m = end - tile.rowBegin;
    g.n = tile.colEnd - tile.colBegin;
    g.k = int64_t(op.depth);
    g.accumulate = false;
    gemm(g, s);
    return;
  }

  // SwiGLU and its gradient: rows of the segment, clipped to it.
  const int64_t end = min(tile.rowEnd, segRows);
  if (end <= tile.rowBegin)
    return;
  const int64_t r0 = segBegin + tile.rowBegin, rows = end - tile.rowBegin;
  const int64_t I = P.inter;
  if (op.kind == kSwiglu) {
    const void *y = data[op.a];
    void *a = data[op.c];
    const uint32_t yt = slotType(op.a), at = slotType(op.c);
    const int64_t yld = slotLd(op.a), ald = slotLd(op.c);
    const int64_t cols = tile.colEnd - tile.colBegin;
    if (yt == kBF16 && at == kBF16 &&
        bf16Vectors(y, a, cols | tile.colBegin | I | yld | ald, rows * cols)) {
      // 8 columns a thread: 16-byte loads of gate and up, one store.
      const int vectors = int(cols / 8);
      const auto *yb = static_cast<const __nv_bfloat16 *>(y);
      auto *ab = static_cast<__nv_bfloat16 *>(a);
      for (int e = threadIdx.x; e < int(rows) * vectors; e += kThreads) {
        const int64_t m = r0 + e / vectors, c = tile.colBegin + (e % vectors) * 8;
        const uint4 gv = *reinterpret_cast<const uint4 *>(yb + m * yld + c);
        const uint4 uv = *reinterpret_cast<const uint4 *>(yb + m * yld + I + c);
        uint4 out;
        const auto *g2 = reinterpret_cast<const __nv_bfloat162 *>(&gv);
        const auto *u2 = reinterpret_cast<const __nv_bfloat162 *>(&uv);
        auto *o2 = reinterpret_cast<__nv_bfloat162 *>(&out);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 gate = __bfloat1622float2(g2[k]), up = __bfloat1622float2(u2[k]);
          o2[k] = __floats2bfloat162_rn(gate.x * sigmoidf(gate.x) * up.x,
                                        gate.y * sigmoidf(gate.y) * up.y);
        }
        *reinterpret_cast<uint4 *>(ab + m * ald + c) = out;
      }
      return;
    }
    for (int64_t e = threadIdx.x; e < rows * cols; e += kThreads) {
      const int64_t m = r0 + e / cols, c = tile.colBegin + e % cols;
      const float gate = loadElt(y, m * yld + c, yt), up = loadElt(y, m * yld + I + c, yt);
      storeElt(a, m * ald + c, at, gate * sigmoidf(gate) * up);
    }
    return;
  }
  // Output columns [c0, c1) of dY [., 2I] are the gate/up pairs below.
  const int64_t width = int64_t(op.cols);
  const int64_t p0 = tile.colBegin * I / width, p1 = tile.colEnd * I / width;
  const void *y = data[op.b], *da = data[op.a];
  void *dy = data[op.c];
  const uint32_t yt = slotType(op.b), dat = slotType(op.a), dyt = slotType(op.c);
  const int64_t yld = slotLd(op.b), dald = slotLd(op.a), dyld = slotLd(op.c);
  const int64_t cols = p1 - p0;
  if (yt == kBF16 && dat == kBF16 && dyt == kBF16 &&
      bf16Vectors(y, dy, cols | p0 | I | yld | dald | dyld, rows * cols) &&
      reinterpret_cast<uintptr_t>(da) % 16 == 0) {
    const int vectors = int(cols / 8);
    const auto *yb = static_cast<const __nv_bfloat16 *>(y);
    const auto *gb = static_cast<const __nv_bfloat16 *>(da);
    auto *db = static_cast<__nv_bfloat16 *>(dy);
    for (int e = threadIdx.x; e < int(rows) * vectors; e += kThreads) {
      const int64_t m = r0 + e / vectors, c = p0 + (e % vectors) * 8;
      const uint4 gv = *reinterpret_cast<const uint4 *>(yb + m * yld + c);
      const uint4 uv = *reinterpret_cast<const uint4 *>(yb + m * yld + I + c);
      const uint4 av = *reinterpret_cast<const uint4 *>(gb + m * dald + c);
      uint4 dGate, dUp;
      const auto *g2 = reinterpret_cast<const __nv_bfloat162 *>(&gv);
      const auto *u2 = reinterpret_cast<const __nv_bfloat162 *>(&uv);
      const auto *a2 = reinterpret_cast<const __nv_bfloat162 *>(&av);
      auto *dg2 = reinterpret_cast<__nv_bfloat162 *>(&dGate);
      auto *du2 = reinterpret_cast<__nv_bfloat162 *>(&dUp);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 gate = __bfloat1622float2(g2[k]), up = __bfloat1622float2(u2[k]),
                     grad = __bfloat1622float2(a2[k]);
        const float sx = sigmoidf(gate.x), sy = sigmoidf(gate.y);
        dg2[k] = __floats2bfloat162_rn(grad.x * up.x * (sx * (1.0f + gate.x * (1.0f - sx))),
                                       grad.y * up.y * (sy * (1.0f + gate.y * (1.0f - sy))));
        du2[k] = __floats2bfloat162_rn(grad.x * (gate.x * sx), grad.y * (gate.y * sy));
      }
      *reinterpret_cast<uint4 *>(db + m * dyld + c) = dGate;
      *reinterpret_cast<uint4 *>(db + m * dyld + I + c) = dUp;
    }
    return;
  }
  for (int64_t e = threadIdx.x; e < rows * cols; e += kThreads) {
    const int64_t m = r0 + e / cols, c = p0 + e % cols;
    const float gate = loadElt(y, m * yld + c, yt), up = loadElt(y, m * yld + I + c, yt);
    const float grad = loadElt(da, m * dald + c, dat);
    const float sg = sigmoidf(gate);
    storeElt(dy, m * dyld + c, dyt, grad * up * (sg * (1.0f + gate * (1.0f - sg))));
    storeElt(dy, m * dyld + I + c, dyt, grad * (gate * sg));
  }
}

//===----------------------------------------------------------------------===//
// The persistent kernel
//===----------------------------------------------------------------------===//

struct Control {
  unsigned long long done; ///< task runs completed
  uint32_t stop;           ///< set by the watchdog: every block leaves
  uint32_t stuckSet;
  uint32_t stuckCount;
  Stuck stuck[kStuckReported];
  unsigned long long opNs[kOpsProfiled]; ///< block-time running each op's tasks
  unsigned long long idleNs;             ///< block-time finding no ready queue
};

__device__ __forceinline__ uint64_t nowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t acquireLoad(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/// The first wait of `task` on `rank` not met, or -1.
__device__ int firstUnmet(const Program &P, uint32_t rank, const Task &task) {
  for (uint32_t w = 0; w < task.waitCount; ++w) {
    const Wait wait = P.waits[task.firstWait + w];
    if (acquireLoad(&P.counters[size_t(rank) * P.events + wait.event]) < wait.threshold)
      return int(w);
  }
  return -1;
}

__global__ void __launch_bounds__(kThreads)
    persistentKernel(Program P, uint32_t logical, uint32_t *heads, uint32_t *locks,
                     Control *control, unsigned long long total, uint64_t timeoutNs) {
  extern __shared__ __align__(16) unsigned char dynamicSmem[];
  Smem &smem = *reinterpret_cast<Smem *>(dynamicSmem);
  __shared__ int64_t action;     // logical queue to run the head of; -1: leave
  __shared__ uint32_t actionTask; // its head task
  uint32_t cursor = blockIdx.x, stealCursor = uint32_t((uint64_t(blockIdx.x) * 7919) % logical);
  unsigned long long seenDone = 0;
  uint64_t seenAt = 0;
  if (threadIdx.x == 0)
    seenAt = nowNs();
  // Thread 0: takes queue q when its head task is ready and no other block
  // runs q (its lock); returns the head task, or -1.
  const auto take = [&](uint32_t q) -> int64_t {
    const uint32_t rank = q / P.queues;
    const Queue qr = P.queues_[q % P.queues];
    uint32_t head = *reinterpret_cast<volatile uint32_t *>(&heads[q]);
    if (head >= qr.entryCount ||
        firstUnmet(P, rank, P.tasks[P.entries[qr.firstEntry + head]]) >= 0)
      return -1;
    if (atomicCAS(&locks[q], 0u, 1u) != 0u)
      return -1;
    __threadfence();
    head = *reinterpret_cast<volatile uint32_t *>(&heads[q]);
    if (head < qr.entryCount) {
      const uint32_t t = P.entries[qr.firstEntry + head];
      if (firstUnmet(P, rank, P.tasks[t]) < 0)
        return t;
    }
    __threadfence();
    atomicExch(&locks[q], 0u);
    return -1;
  };
  for (;;) {
    uint64_t began = 0;
    if (threadIdx.x == 0) {
      const uint64_t looking = nowNs();
      int64_t pick = -1, task = -1;
      for (;;) {
        if (*reinterpret_cast<volatile uint32_t *>(&control->stop))
          break;
        // The block's own queues first, from the one it ran last.
        uint32_t q = cursor;
        for (uint32_t n = 0; n < (logical + gridDim.x - 1) / gridDim.x && pick < 0; ++n) {
          if (q < logical && (task = take(q)) >= 0)
            pick = q;
          q += gridDim.x;
          if (q >= logical)
            q = blockIdx.x;
        }
        if (pick >= 0)
          break;
        // Then a few of other blocks' queues whose heads are ready while
        // their blocks are busy.
        for (uint32_t n = 0; n < 8 && pick < 0; ++n) {
          const uint32_t other = stealCursor;
          stealCursor = stealCursor + 1 == logical ? 0 : stealCursor + 1;
          if (other % gridDim.x != blockIdx.x && (task = take(other)) >= 0)
            pick = other;
        }
        if (pick >= 0)
          break;
        const unsigned long long done =
            *reinterpret_cast<volatile unsigned long long *>(&control->done);
        if (done >= total)
          break;
        // Nothing ready: the watchdog.
        const uint64_t now = nowNs();
        if (done != seenDone) {
          seenDone = done;
          seenAt = now;
        } else if (timeoutNs > 0 && now - seenAt > timeoutNs) {
          if (atomicCAS(&control->stuckSet, 0u, 1u) == 0u) {
            // Every unfinished queue whose head waits (other blocks' heads
            // read as they are now), by rank and queue.
            uint32_t count = 0;
            for (uint32_t q2 = 0; q2 < logical && count < kStuckReported; ++q2) {
              const uint32_t rank = q2 / P.queues, queue = q2 % P.queues;
              const Queue qr = P.queues_[queue];
              const uint32_t head = *reinterpret_cast<volatile uint32_t *>(&heads[q2]);
              if (head >= qr.entryCount)
                continue;
              const uint32_t t = P.entries[qr.firstEntry + head];
              const Task waiting = P.tasks[t];
              const int w = firstUnmet(P, rank, waiting);
              if (w < 0)
                continue;
              const Wait wait = P.waits[waiting.firstWait + w];
              control->stuck[count++] =
                  Stuck{rank, queue, t, wait.event,
                        acquireLoad(&P.counters[size_t(rank) * P.events + wait.event]),
                        wait.threshold};
            }
            control->stuckCount = count;
            __threadfence();
            atomicExch(&control->stop, 1u);
          }
          break;
        }
        __nanosleep(200);
      }
      action = pick;
      actionTask = uint32_t(task);
      if (pick >= 0 && uint32_t(pick) % gridDim.x == blockIdx.x)
        cursor = uint32_t(pick);
      began = nowNs();
      atomicAdd(&control->idleNs, (unsigned long long)(began - looking));
    }
    __syncthreads();
    const int64_t q = action;
    if (q < 0)
      return;
    const uint32_t rank = uint32_t(q) / P.queues, t = actionTask;
    runTask(P, rank, t, smem);
    __syncthreads();
    if (threadIdx.x == 0) {
      const Task task = P.tasks[t];
      __threadfence();
      for (uint32_t i = 0; i < task.signalCount; ++i) {
        const Signal sg = P.signals[task.firstSignal + i];
        const uint32_t to = uint32_t((uint64_t(rank) + sg.peerOffset) % P.ranks);
        atomicAdd(&P.counters[size_t(to) * P.events + sg.event], sg.increment);
      }
      volatile uint32_t *head = reinterpret_cast<volatile uint32_t *>(&heads[q]);
      *head = *head + 1;
      __threadfence();
      atomicExch(&locks[q], 0u);
      atomicAdd(&control->done, 1ull);
      atomicAdd(&control->opNs[min(task.op, kOpsProfiled - 1)],
                (unsigned long long)(nowNs() - began));
    }
  }
}

//===----------------------------------------------------------------------===//
// Row kernels
//===----------------------------------------------------------------------===//

/// Eight bf16 of a 16-byte vector as floats, and back.
__device__ __forceinline__ void unpack8(const uint4 &v, float (&f)[8]) {
  const auto *h = reinterpret_cast<const __nv_bfloat162 *>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 x = __bfloat1622float2(h[k]);
    f[2 * k] = x.x;
    f[2 * k + 1] = x.y;
  }
}
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  auto *h = reinterpret_cast<__nv_bfloat162 *>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    h[k] = __floats2bfloat162_rn(f[2 * k], f[2 * k + 1]);
  return v;
}

/// Row kernels read bf16 rows 8 at a time where the types, the widths, the
/// strides and the pointers allow (`vector`), else one element at a time.
__global__ void gatherKernel(const void *src, uint32_t srcType, const int64_t *order,
                             int64_t topK, const float *weights, void *dst, uint32_t dstType,
                             int64_t dstLd, int64_t rows, int64_t cols, bool vector) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int64_t id = order[i];
    const float w = weights ? weights[id] : 1.0f;
    const int64_t from = (id / topK) * cols;
    if (vector) {
      const auto *in = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(src) + from);
      auto *to = reinterpret_cast<uint4 *>(static_cast<uint16_t *>(dst) + i * dstLd);
      for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
        uint4 v = in[c];
        if (weights) {
          float f[8];
          unpack8(v, f);
#pragma unroll
          for (int k = 0; k < 8; ++k)
            f[k] *= w;
          v = pack8(f);
        }
        to[c] = v;
      }
      continue;
    }
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = loadElt(src, from + c, srcType);
      storeElt(dst, i * dstLd + c, dstType, weights ? v * w : v);
    }
  }
}

__global__ void combineKernel(const void *z, uint32_t zType, int64_t zLd, const int64_t *position,
                              const float *weights, int64_t topK, void *out, uint32_t outType,
                              int64_t tokens, int64_t cols, bool vector) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    if (vector) {
      for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
        float sum[8] = {};
        for (int64_t k = 0; k < topK; ++k) {
          const int64_t id = t * topK + k;
          const float w = weights ? weights[id] : 1.0f;
          float f[8];
          unpack8(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(z) +
                                                  position[id] * zLd)[c],
                  f);
#pragma unroll
          for (int e = 0; e < 8; ++e)
            sum[e] += w * f[e];
        }
        reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + t * cols)[c] = pack8(sum);
      }
      continue;
    }
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float sum = 0.0f;
      for (int64_t k = 0; k < topK; ++k) {
        const int64_t id = t * topK + k;
        const float w = weights ? weights[id] : 1.0f;
        sum += w * loadElt(z, position[id] * zLd + c, zType);
      }
      storeElt(out, t * cols + c, outType, sum);
    }
  }
}

/// One warp a (token, k): lanes sum strided columns (8 at a time where
/// `vector`), then a fixed shuffle tree.
__global__ void weightGradKernel(const void *dy, uint32_t dyType, const void *z, uint32_t zType,
                                 int64_t zLd, const int64_t *position, int64_t topK,
                                 int64_t tokens, int64_t cols, float *out, bool vector) {
  const int lane = threadIdx.x % 32, warps = kThreads / 32;
  for (int64_t id = int64_t(blockIdx.x) * warps + threadIdx.x / 32; id < tokens * topK;
       id += int64_t(gridDim.x) * warps) {
    const int64_t t = id / topK, row = position[id];
    float dot = 0.0f;
    if (vector) {
      const auto *a = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(dy) + t * cols);
      const auto *b = reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(z) + row * zLd);
      for (int64_t c = lane; c < cols / 8; c += 32) {
        float x[8], y[8];
        unpack8(a[c], x);
        unpack8(b[c], y);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          dot += x[e] * y[e];
      }
    } else {
      for (int64_t c = lane; c < cols; c += 32)
        dot += loadElt(dy, t * cols + c, dyType) * loadElt(z, row * zLd + c, zType);
    }
#pragma unroll
    for (int half = 16; half > 0; half /= 2)
      dot += __shfl_xor_sync(0xffffffffu, dot, half);
    if (lane == 0)
      out[id] = dot;
  }
}

/// Whether rows of bf16 at `p` and `q` (row strides in elements) can be
/// moved 8 at a time by the row kernels.
bool rowVectors(const void *p, uint32_t pType, int64_t pLd, const void *q, uint32_t qType,
                int64_t qLd, int64_t cols) {
  return pType == kBF16 && qType == kBF16 && bf16Vectors(p, q, cols | pLd | qLd, 0);
}

/// A launch's blocks for `items` blocks' worth of work (the kernels loop
/// over what a grid of 65535 leaves).
unsigned gridFor(int64_t items) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(items, 65535)));
}

} // namespace

bool built() { return true; }

Error probe(Info *out) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return cudaText("no CUDA device", e);
  if (count == 0)
    return "no CUDA device: the driver sees none";
  cudaDeviceProp prop;
  MOEC_CUDA("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, 0));
  out->name = prop.name;
  out->multiprocessors = prop.multiProcessorCount;
  out->major = prop.major;
  out->minor = prop.minor;
  cudaDriverGetVersion(&out->driverVersion);
  cudaRuntimeGetVersion(&out->runtimeVersion);
  if (prop.major < 8)
    return "the GPU " + out->name + " has compute capability " + std::to_string(prop.major) +
           "." + std::to_string(prop.minor) + "; the cuda backend needs 8.0 or newer (bf16 "
           "tensor cores)";
  return {};
}

Error allocate(size_t bytes, void **out) {
  void *p = nullptr;
  MOEC_CUDA("cudaMalloc of " + std::to_string(bytes) + " bytes", cudaMalloc(&p, std::max<size_t>(bytes, 64)));
  const cudaError_t e = cudaMemset(p, 0, std::max<size_t>(bytes, 64));
  if (e != cudaSuccess) {
    cudaFree(p);
    return cudaText("cudaMemset", e);
  }
  *out = p;
  return {};
}

void release(void *memory) {
  if (memory)
    cudaFree(memory);
}

Error copy(void *dst, const void *src, size_t bytes) {
  if (bytes == 0)
    return {};
  MOEC_CUDA("cudaMemcpy", cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  return {};
}

Error upload(void *dst, const void *src, size_t bytes) {
  if (bytes == 0)
    return {};
  MOEC_CUDA("cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, 0));
  return {};
}

bool isDevice(const void *memory) {
  cudaPointerAttributes attributes;
  if (cudaPointerGetAttributes(&attributes, memory) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

Error run(const Program &program, double timeoutSeconds, RunResult *out) {
  *out = RunResult();
  const uint32_t logical = program.ranks * program.queues;
  if (logical == 0)
    return {};
  int perSm = 0, device = 0, sms = 0;
  MOEC_CUDA("cudaGetDevice", cudaGetDevice(&device));
  MOEC_CUDA("cudaDeviceGetAttribute",
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const size_t smem = smemBytes();
  MOEC_CUDA("cudaFuncSetAttribute", allowSmem(persistentKernel, smem));
  MOEC_CUDA("cudaOccupancyMaxActiveBlocksPerMultiprocessor",
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, persistentKernel, kThreads,
                                                          smem));
  if (perSm < 1)
    return "the persistent kernel does not fit on a multiprocessor";
  const uint32_t blocks = std::min<uint32_t>(logical, uint32_t(perSm) * uint32_t(sms));
  // heads, then the control block, in one allocation.
  // heads and locks, one each per logical queue.
  const size_t headBytes = (2 * size_t(logical) * sizeof(uint32_t) + 15) / 16 * 16;
  void *scratch = nullptr;
  if (Error e = allocate(headBytes + sizeof(Control), &scratch); !e.empty())
    return e;
  uint32_t *heads = static_cast<uint32_t *>(scratch);
  Control *control = reinterpret_cast<Control *>(static_cast<char *>(scratch) + headBytes);
  const cudaError_t zeroed =
      cudaMemset(program.counters, 0, size_t(program.ranks) * program.events * sizeof(uint32_t));
  if (zeroed != cudaSuccess) {
    release(scratch);
    return cudaText("cudaMemset of the event counters", zeroed);
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start);
  const uint64_t timeoutNs = timeoutSeconds > 0 ? uint64_t(timeoutSeconds * 1e9) : 0;
  unsigned long long total = 0;
  {
    std::vector<Queue> queues(program.queues);
    const cudaError_t read = cudaMemcpy(queues.data(), program.queues_,
                                        queues.size() * sizeof(Queue), cudaMemcpyDeviceToHost);
    if (read != cudaSuccess) {
      release(scratch);
      return cudaText("reading the queues", read);
    }
    for (const Queue &q : queues)
      total += q.entryCount;
    total *= program.ranks;
  }
  persistentKernel<<<blocks, kThreads, smem>>>(program, logical, heads, heads + logical, control,
                                               total, timeoutNs);
  cudaError_t e = cudaGetLastError();
  cudaEventRecord(stop);
  // The device's watchdog ends the kernel; the host waits a little longer
  // before it calls the kernel lost.
  const auto begin = std::chrono::steady_clock::now();
  while (e == cudaSuccess) {
    e = cudaEventQuery(stop);
    if (e == cudaSuccess)
      break;
    if (e != cudaErrorNotReady)
      break;
    e = cudaSuccess;
    if (timeoutSeconds > 0 &&
        std::chrono::steady_clock::now() - begin >
            std::chrono::duration<double>(timeoutSeconds + 30)) {
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      return "the persistent kernel did not end " + std::to_string(int(timeoutSeconds + 30)) +
             " s after it started, although its watchdog should have stopped it";
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (e != cudaSuccess) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    release(scratch);
    return cudaText("the persistent kernel", e);
  }
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  Control host;
  const cudaError_t read = cudaMemcpy(&host, control, sizeof host, cudaMemcpyDeviceToHost);
  release(scratch);
  if (read != cudaSuccess)
    return cudaText("reading the kernel's control block", read);
  out->watchdog = host.stop != 0;
  out->stuck.assign(host.stuck, host.stuck + std::min(host.stuckCount, kStuckReported));
  out->tasksRun = host.done;
  out->blocks = blocks;
  for (uint32_t i = 0; i < kOpsProfiled; ++i)
    out->opSeconds.push_back(double(host.opNs[i]) * 1e-9);
  out->idleSeconds = double(host.idleNs) * 1e-9;
  out->seconds = ms / 1e3;
  return {};
}

Error gatherRows(const void *src, uint32_t srcType, const int64_t *order, int64_t topK,
                 const float *weights, void *dst, uint32_t dstType, int64_t dstLd, int64_t rows,
                 int64_t cols) {
  if (rows <= 0 || cols <= 0)
    return {};
  const bool vector = rowVectors(src, srcType, cols, dst, dstType, dstLd, cols);
  gatherKernel<<<gridFor(rows), kThreads>>>(src, srcType, order, topK, weights, dst, dstType,
                                            dstLd, rows, cols, vector);
  MOEC_CUDA("the gather kernel", cudaGetLastError());
  return {};
}

Error combineRows(const void *z, uint32_t zType, int64_t zLd, const int64_t *position,
                  const float *weights, int64_t topK, void *out, uint32_t outType, int64_t tokens,
                  int64_t cols) {
  if (tokens <= 0 || cols <= 0)
    return {};
  const bool vector = rowVectors(z, zType, zLd, out, outType, cols, cols);
  combineKernel<<<gridFor(tokens), kThreads>>>(z, zType, zLd, position, weights, topK, out,
                                               outType, tokens, cols, vector);
  MOEC_CUDA("the combine kernel", cudaGetLastError());
  return {};
}

namespace {
constexpr int64_t kScalesAThread = 16;
struct ScaleSpans {
  ScaleSpan span[kScaleSpansALaunch];
};
/// For span blockIdx.y, the index of the first scale that
/// backend::goodScale would refuse, by atomicMin into first[blockIdx.y]
/// (all ones where none).
__global__ void badScaleKernel(ScaleSpans spans, unsigned long long *first) {
  const ScaleSpan s = spans.span[blockIdx.y];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < s.count;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (!backend::goodScale(s.scales[i], s.pairs && (i & 1)))
      atomicMin(first + blockIdx.y, static_cast<unsigned long long>(i));
  }
}
} // namespace

Error findBadScales(const ScaleSpan *spans, int n, void *scratch, int64_t *index, float *value) {
  if (n <= 0)
    return {};
  auto *first = static_cast<unsigned long long *>(scratch);
  MOEC_CUDA("the scale check", cudaMemsetAsync(first, 0xFF, n * sizeof(*first)));
  for (int i0 = 0; i0 < n; i0 += kScaleSpansALaunch) {
    ScaleSpans batch{};
    int64_t longest = 1;
    const int count = std::min(n - i0, kScaleSpansALaunch);
    for (int i = 0; i < count; ++i) {
      batch.span[i] = spans[i0 + i];
      longest = std::max(longest, spans[i0 + i].count);
    }
    // About kScalesAThread scales a thread (a block for every scale, up to
    // 65535 a span, made a million blocks of a qwen3 layer's int4 scales:
    // 1.6 ms a step on an H200).
    const int64_t blocks = (longest + kThreads * kScalesAThread - 1) / (kThreads * kScalesAThread);
    badScaleKernel<<<dim3(gridFor(blocks), unsigned(count)), kThreads>>>(batch, first + i0);
    MOEC_CUDA("the scale check", cudaGetLastError());
  }
  std::vector<unsigned long long> found(n);
  MOEC_CUDA("the scale check",
            cudaMemcpy(found.data(), first, n * sizeof(*first), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) {
    index[i] = found[i] == ~0ull ? -1 : int64_t(found[i]);
    if (index[i] >= 0)
      MOEC_CUDA("the scale check", cudaMemcpy(value + i, spans[i].scales + found[i], sizeof(float),
                                              cudaMemcpyDeviceToHost));
  }
  return {};
}

namespace {
/// decodeWeight's kernel: expert blockIdx.y's values, the grid's threads
/// along them (eight values a thread when `vector`, else one), each row's
/// run after the one before it whatever the row's length.
__global__ void decodeKernel(DecodeSpec w, const void *codes, const float *scales, void *out,
                             bool vector) {
  for (int64_t e = blockIdx.y; e < w.experts; e += gridDim.y) {
    Mat x{static_cast<const char *>(codes) + e * w.expertBytes, w.type, w.cols, false};
    x.quant = w.quant;
    x.scales = scales + e * w.scaleStride;
    x.scaleLd = w.scaleLd;
    x.groupShift = w.groupShift;
    x.zeroPoints = w.zeroPoints;
    const int64_t each = vector ? w.cols / 8 : w.cols, items = w.rows * each;
    const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x,
                  stride = int64_t(gridDim.x) * blockDim.x;
    if (vector) {
      // The eight values of a vector share a scale: FP8 blocks, int8 rows
      // and int4 groups (of 32 or more) hold them.
      const uint8_t *from = static_cast<const uint8_t *>(x.p);
      uint4 *to = reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + e * w.rows * w.cols);
      for (int64_t i = first; i < items; i += stride) {
        const int64_t r = i / each, c = 8 * (i % each);
        Quant8 q;
        q.codes = w.quant == kInt4Group
                      ? make_uint2(
                            *reinterpret_cast<const uint32_t *>(from + r * (w.cols / 2) + c / 2), 0)
                      : *reinterpret_cast<const uint2 *>(from + r * w.cols + c);
        q.scale = quantScale(x, r, c);
        to[i] = quantDecode8(w.quant, q);
      }
      continue;
    }
    for (int64_t i = first; i < items; i += stride) {
      const int64_t r = i / each, c = i % each;
      const float2 s = quantScale(x, r, c);
      storeElt(out, e * w.rows * w.cols + i, w.type, (quantCode(x, r, c) - s.y) * s.x);
    }
  }
}
} // namespace

Error decodeWeight(const DecodeSpec &spec, const void *codes, const float *scales, void *out) {
  if (spec.experts * spec.rows == 0 || spec.cols == 0)
    return {};
  // Vectors: 8 bytes of FP8 or int8 codes (int4: 4), 16 bytes of bf16 out.
  const uintptr_t align = spec.quant == kInt4Group ? 4 : 8;
  const bool vector =
      spec.type == kBF16 && spec.cols % 8 == 0 && reinterpret_cast<uintptr_t>(codes) % align == 0 &&
      spec.expertBytes % int64_t(align) == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  // About 8 items a thread in each expert.
  const int64_t items = spec.rows * (vector ? spec.cols / 8 : spec.cols);
  const dim3 grid(gridFor((items + 8 * kThreads - 1) / (8 * kThreads)),
                  unsigned(std::min<int64_t>(spec.experts, 65535)));
  decodeKernel<<<grid, kThreads>>>(spec, codes, scales, out, vector);
  MOEC_CUDA("the weights' decode", cudaGetLastError());
  return {};
}

Error combineWeightGrad(const void *dy, uint32_t dyType, const void *z, uint32_t zType,
                        int64_t zLd, const int64_t *position, int64_t topK, int64_t tokens,
                        int64_t cols, float *out) {
  if (tokens <= 0)
    return {};
  const bool vector = rowVectors(dy, dyType, cols, z, zType, zLd, cols);
  const int64_t warps = kThreads / 32;
  weightGradKernel<<<gridFor((tokens * topK + warps - 1) / warps), kThreads>>>(
      dy, dyType, z, zType, zLd, position, topK, tokens, cols, out, vector);
  MOEC_CUDA("the top-k weight gradient kernel", cudaGetLastError());
  return {};
}

} // namespace moec::cuda::device
