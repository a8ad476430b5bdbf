//===- Device.h - The CUDA backend's device side, as plain C++ --*- C++ -*-===//
//
// What runtime/cuda/Pass.cpp asks of the GPU, with no CUDA header in sight:
// memory, copies, the persistent kernel that runs a task program, and the
// row kernels around it (gather, combine, the top-k weight gradient).
//
// Two implementations, one of which is linked (BUILD.bazel, build_device.sh):
//   Device.cu        built by nvcc where the CUDA toolkit is installed
//                    (/usr/local/cuda), cudart linked statically;
//   DeviceStub.cpp   elsewhere: every call says the toolkit was missing.
//
// Every call returns an empty string on success, else the error. Tensor
// element types are moec::DType values (F32, BF16; index tensors I32, I64).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CUDA_DEVICE_H
#define MOEC_RUNTIME_CUDA_DEVICE_H

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moec::cuda::device {

using Error = std::string;

/// Whether this build has the device code (nvcc was found).
bool built();

/// The GPU this process runs on.
struct Info {
  std::string name;
  int multiprocessors = 0;
  int major = 0, minor = 0; ///< compute capability
  int driverVersion = 0, runtimeVersion = 0;
};
/// Finds device 0: "no CUDA device: ..." where there is none.
Error probe(Info *out);

/// Zeroed device memory.
Error allocate(size_t bytes, void **out);
void release(void *memory);
/// A copy in any direction (unified addressing tells which).
Error copy(void *dst, const void *src, size_t bytes);
/// A copy of pageable host memory `src` to device memory `dst`, queued
/// behind the work already launched (the kernels after it see it) without
/// waiting for that work: the driver copies `src` to a staging buffer
/// before it returns, so `src` may change as soon as this returns (CUDA's
/// "API synchronization behavior" for cudaMemcpyAsync from pageable memory).
/// Not for pinned (page-locked) memory, which the copy reads later.
Error upload(void *dst, const void *src, size_t bytes);
/// Whether `memory` is device memory (else host memory).
bool isDevice(const void *memory);

//===----------------------------------------------------------------------===//
// The task program, as the persistent kernel reads it (device memory)
//===----------------------------------------------------------------------===//

enum OpKind : uint32_t { kDispatch = 1, kCombine = 2, kGmm = 3, kSwiglu = 4, kSwigluGrad = 5 };

/// An op and its tiling, with what a tile needs precomputed.
struct Op {
  uint32_t kind = 0;
  uint32_t wgrad = 0, transposeB = 0, accumulate = 0;
  uint32_t shareRows = 0; ///< kTilingShareRows: row tiles share out the rows present
  uint32_t experts = 1, peers = 1, rowTiles = 1, colTiles = 1;
  uint64_t rows = 0, cols = 0, depth = 0;
  uint32_t a = 0, b = 0, c = 0;    ///< slots: inputs 0 and 1, the output
  uint32_t addend = 0xFFFFFFFFu;   ///< slot added to an activation-form product
  uint32_t firstTask = 0;
  float scale = 1.0f;
  int64_t expertStride = 0;        ///< elements per expert of the weight (or dW); bytes of codes
  int64_t ldb = 0, ldc = 0;        ///< the tiling's strides of B and C (weights)
  /// A quantized weight B (0: dense; else LayerShape's WeightFormat): its
  /// scales' slot and floats per expert, scales a stored row (FP8: blocks
  /// a row of blocks; int4: groups), log2 of int4's group, zero points.
  uint32_t quant = 0, scales = 0xFFFFFFFFu;
  int64_t scaleStride = 0, scaleLd = 0;
  int32_t groupShift = 0;
  uint32_t zeroPoints = 0;
  /// Puts: the layout slots (size, source offset, target offset).
  uint32_t sizeSlot = 0, srcOffsetSlot = 0, targetOffsetSlot = 0;
};

struct Task {
  uint32_t op, firstWait, waitCount, firstSignal, signalCount;
};
struct Wait {
  uint32_t event, threshold;
};
struct Signal {
  uint32_t event, increment, peerOffset;
};
struct Queue {
  uint32_t firstEntry, entryCount;
};
/// A slot's element type and row stride (dims[1]; elements).
struct Slot {
  uint32_t dtype;
  int64_t ld;
};

/// A program and its memory. Every pointer is device memory.
struct Program {
  uint32_t ranks = 1, localExperts = 1, slots = 0, events = 0, queues = 0;
  int64_t inter = 0;
  uint32_t glist = 0; ///< the slot of the segments' end rows
  const Op *ops = nullptr;
  const Task *tasks = nullptr;
  const Wait *waits = nullptr;
  const Signal *signals = nullptr;
  const Queue *queues_ = nullptr;
  const uint32_t *entries = nullptr;
  const Slot *slotInfo = nullptr;
  void *const *data = nullptr; ///< [rank * slots + slot]
  uint32_t *counters = nullptr; ///< [rank * events + event], zeroed by run
};

/// Where the watchdog found the program stuck: a queue's head task and the
/// first of its waits not met.
struct Stuck {
  uint32_t rank = 0, queue = 0, task = 0, event = 0, value = 0, threshold = 0;
};

/// The most stuck queues a watchdog report lists.
inline constexpr uint32_t kStuckReported = 8;

struct RunResult {
  bool watchdog = false; ///< the watchdog stopped the kernel; `stuck` says where
  std::vector<Stuck> stuck; ///< unfinished queues whose head waits, by rank and queue
  uint64_t tasksRun = 0;  ///< task runs completed
  uint32_t blocks = 0;    ///< thread blocks of the persistent kernel
  double seconds = 0;     ///< the kernel's time (CUDA events)
  /// Block-seconds spent running tasks, per op (ops past kOpsProfiled add to
  /// the last), and waiting for a ready queue.
  std::vector<double> opSeconds;
  double idleSeconds = 0;
};

/// The ops the kernel times one by one.
inline constexpr uint32_t kOpsProfiled = 16;

/// Runs every rank's queues of `program` as one persistent kernel: each
/// thread block runs the logical queues (rank, queue) it owns, each in
/// order, a head task once its waits are met; signals are atomic adds on
/// device counters (release), waits acquire loads. When no task completes
/// for `timeoutSeconds` (> 0) the kernel stops and `out->watchdog` is set.
Error run(const Program &program, double timeoutSeconds, RunResult *out);

//===----------------------------------------------------------------------===//
// Row kernels (device pointers; `weights` may be null)
//===----------------------------------------------------------------------===//

/// dst row i (ld dstLd) = src row order[i] / topK ([., cols], ld cols), times
/// weights[order[i]] when given; for i < rows.
Error gatherRows(const void *src, uint32_t srcType, const int64_t *order, int64_t topK,
                 const float *weights, void *dst, uint32_t dstType, int64_t dstLd, int64_t rows,
                 int64_t cols);

/// out[t] = sum over k ascending of w[t, k] * z[position[t * topK + k]]
/// (w = 1 without weights), fp32, rounded once; t < tokens.
Error combineRows(const void *z, uint32_t zType, int64_t zLd, const int64_t *position,
                  const float *weights, int64_t topK, void *out, uint32_t outType, int64_t tokens,
                  int64_t cols);

/// out[t * topK + k] = <dy[t], z[position[t * topK + k]]> (fp32).
Error combineWeightGrad(const void *dy, uint32_t dyType, const void *z, uint32_t zType,
                        int64_t zLd, const int64_t *position, int64_t topK, int64_t tokens,
                        int64_t cols, float *out);

/// Scales in device memory: `count` floats, (scale, zero point) pairs with
/// `pairs`.
struct ScaleSpan {
  const float *scales;
  int64_t count;
  bool pairs;
};
/// For each of `n` spans, the first float that is not a finite positive
/// scale, or a zero point outside 0..15: its index in index[i] (-1 where
/// none) and the float in value[i]. One launch for up to kScaleSpansALaunch
/// spans and one copy back for all; `scratch` is 8 x n bytes of device
/// memory.
constexpr int kScaleSpansALaunch = 64;
Error findBadScales(const ScaleSpan *spans, int n, void *scratch, int64_t *index, float *value);

/// A quantized weight of `experts` x [rows, cols] (as stored; int4 codes
/// two a byte, (cols + 1) / 2 bytes a row) and its scales (Op's fields), to
/// be decoded whole.
struct DecodeSpec {
  uint32_t quant = 0; ///< WeightFormat's value
  uint32_t type = 0;  ///< of the decoded values: F32 or BF16
  int64_t experts = 0, rows = 0, cols = 0;
  int64_t expertBytes = 0; ///< codes an expert
  int64_t scaleStride = 0, scaleLd = 0;
  int32_t groupShift = 0;
  bool zeroPoints = false;
};
/// out ([experts, rows, cols] of spec.type) = the weight at `codes` decoded
/// as the tiles decode it: (code - zero) x scale in fp32, rounded once to
/// the type (bf16: eight values at a time by quantDecode8 where the codes'
/// and the output's addresses and cols allow, else one at a time by
/// quantValue's formulas, which give the same bits).
Error decodeWeight(const DecodeSpec &spec, const void *codes, const float *scales, void *out);

/// The vector decode of a quantized weight (quantDecode8: eight values at a
/// time, as Hopper's tiles decode B) against the decode of one value at a
/// time (quantValue's formulas), both rounded to bf16, on every code: FP8
/// and int8 codes 0..255 in every place of a vector, int4 every pair of
/// nibbles; scales 1, 0.01, 3.7e-5, 1e30, 1e-30, 448; zero points 0, 8,
/// 15, 7.5. mismatches[0..2]: FP8, int8, int4 (a NaN matches a NaN).
Error checkDecodeBits(int64_t mismatches[3]);
/// The vector decode's rate: 8 blocks of 256 threads an SM, each thread
/// decoding eight values 4096 times (the codes changing each time), for
/// FP8, int8 and int4 (valuesPerClock[0..2], values a clock an SM at the
/// GPU's clock rate).
Error benchDecode(double valuesPerClock[3]);

/// A benchmark of the GMM tile function: `groups` products of m x n x k in
/// one launch, C_g = op(A_g) op(B_g), A_g stored k x m when transA (else
/// m x k), B_g stored n x k when transB (else k x n), of `type`, C of
/// `cType`, cut into tileM x tileN tiles, one thread block each. Operands
/// are random in [-1, 1); C is poisoned with NaN before the first launch.
struct GemmBenchCase {
  int64_t groups = 1, m = 0, n = 0, k = 0;
  bool transA = false, transB = false;
  uint32_t type = 0, cType = 0;
  int64_t tileM = 128, tileN = 256;
  int repeats = 20;
  /// B a quantized weight (kDense 0; else WeightFormat's value) of random
  /// codes and scales, read as `type`: int4 groups of `group`, with zero
  /// points when `zeroPoints`.
  uint32_t quant = 0;
  int64_t group = 128;
  bool zeroPoints = false;
};
/// Why `spec`'s B cannot be a quantized weight, or empty: a format past
/// int4 groups, or int4 groups of fewer than 32 values or that do not
/// divide B's stored rows (k values when transB, else n).
inline Error gemmBenchCaseError(const GemmBenchCase &spec) {
  if (spec.quant > 3)
    return "no weight format " + std::to_string(spec.quant);
  const int64_t cols = spec.transB ? spec.k : spec.n;
  if (spec.quant == 3 && (spec.group < 32 || cols % spec.group))
    return "int4 groups of " + std::to_string(spec.group) + " values do not divide B's stored " +
           "rows of " + std::to_string(cols) + " (" + (spec.transB ? "k" : "n") + ")";
  return {};
}
struct GemmBenchResult {
  double seconds = 0;   ///< median of `repeats` launches, after one warm-up
  double error = 0;     ///< max |C - ref| / max |ref| over sampled elements
  int64_t unwritten = 0; ///< elements of C still NaN after the first launch
};
Error benchGemm(const GemmBenchCase &spec, GemmBenchResult *out);

} // namespace moec::cuda::device

#endif // MOEC_RUNTIME_CUDA_DEVICE_H
