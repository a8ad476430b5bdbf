//===- MoeOps.cpp - The MoE-FFN layer as PyTorch custom ops -----*- C++ -*-===//
//
// Registers, with TORCH_LIBRARY, a custom class torch.classes.moec.Layer that
// owns a runtime context (moec::rt) for a forward and a backward task binary
// of one MoE-FFN layer on an EP group of R ranks, and two ops over it. The
// ranks are threads of this process (fabric "inproc"), or one rank per
// process under mpirun (fabric "mpi"); the ops take the tensors of the ranks
// this process runs, P of them (R in process, 1 under MPI):
//
//   moec::forward(Layer layer, Tensor x, Tensor topk_ids, Tensor topk_weights,
//                 Tensor w1, Tensor w2) -> (Tensor y, int step)
//   moec::backward(Layer layer, int step, Tensor x, Tensor topk_ids,
//                  Tensor topk_weights, Tensor w1, Tensor w2, Tensor dy,
//                  Tensor? main_grad1, Tensor? main_grad2)
//       -> (Tensor dx, Tensor dtopk_weights, Tensor? dw1, Tensor? dw2)
//
// dw1 and dw2 are None for a frozen layer (a backward binary without the
// weight-gradient GMMs), and for a main-grad layer (a backward binary that
// accumulates its weight gradients), which adds them to main_grad1 and
// main_grad2 (fp32, shaped like w1 and w2, kept by the caller across
// micro-batches) instead.
//
// Shapes carry this process's ranks first: x, y, dy, dx [P, S, H]; topk_ids
// and topk_weights [P, S, K]; w1 [P*L, H, 2I]; w2 [P*L, I, H], or w1
// [P*L, 2I, H] and w2 [P*L, H, I] for binaries with transposed weights (in process,
// P*L = E, the global tensors of `moec run`). Rank r's slices are views into
// them (rank r owns experts r*L .. r*L+L-1), so nothing is copied on the way
// in. The runtime keeps what backward needs from the last forward
// pass; `step` names that pass, and a backward whose step is no longer the
// last one reruns forward on its saved inputs first (e.g. two forward calls
// of one module before one backward).
//
// Every check of the runtime (dtypes, shapes, expert ids, capacities) fails
// with its message as a c10::Error, which Python sees as a RuntimeError.
//
// And the safetensors header checker for moec_torch.safetensors:
//
//   moec::safetensors_read_header(int fd, int file_bytes) -> str
//   moec::safetensors_parse_header(Tensor header, int data_bytes) -> str
//
// return a header, checked, as normalized JSON (tensors in offset order,
// metadata), or fail with the checker's message. And the FP8 block
// quantizer of frozen weights (runtime/cpu/Fp8.h) for moec_torch.quant:
//
//   moec::quantize_fp8_blocks(Tensor w) -> (Tensor codes, Tensor scales)
//
// w float32 [N, R, C] -> codes uint8 [N, R, C], scales float32
// [N, ceil(R / 128), ceil(C / 128)].
//
//===----------------------------------------------------------------------===//

#include "base/Time.h"
#include "ops/torch/GroupFabric.h"
#include "format/Capacity.h"
#include "format/TaskBinary.h"
#include "runtime/api/Runtime.h"
#include "runtime/comm/Hooks.h"
#include "runtime/comm/Mpi.h"
#include "runtime/cpu/Fp8.h"
#include "runtime/tooling/Profile.h"
#include "runtime/tooling/Safetensors.h"
#include "runtime/tooling/Workspace.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <optional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <unistd.h>

namespace {

using moec::DType;

/// Throws a c10::Error carrying a failed status's message.
/// An over-capacity error starts with "moec over capacity: ", so that the
/// Python side can grow the layer's capacity and run the step again.
void check(const moec::Status &status, const char *what) {
  TORCH_CHECK(status.code() != moec::StatusCode::OverCapacity, "moec over capacity: ",
              status.message());
  TORCH_CHECK(status.ok(), "moec ", what, ": ", status.message());
}

/// torch's scalar types in the runtime's words ("f32", "i64"), which its
/// messages use, and the runtime dtype each is bound as (the codes of
/// quantized weights are bound as bytes, never through this table).
struct TorchType {
  at::ScalarType type;
  const char *name;
  std::optional<DType> dtype;
};
const TorchType kTorchTypes[] = {
    {at::kFloat, "f32", DType::F32},  {at::kBFloat16, "bf16", DType::BF16},
    {at::kInt, "i32", DType::I32},    {at::kLong, "i64", DType::I64},
    {at::kDouble, "f64", std::nullopt}, {at::kHalf, "f16", std::nullopt},
    {at::kShort, "i16", std::nullopt}, {at::kChar, "i8", std::nullopt},
    {at::kByte, "u8", std::nullopt},  {at::kBool, "bool", std::nullopt},
};

at::ScalarType torchType(DType dtype) {
  for (const TorchType &t : kTorchTypes)
    if (t.dtype == dtype)
      return t.type;
  TORCH_CHECK(false, "moec: no torch type for dtype ", dtypeName(dtype));
  return at::kFloat;
}

/// A torch dtype in the runtime's words; torch's name for one without a
/// short name.
std::string dtypeName(at::ScalarType type) {
  for (const TorchType &t : kTorchTypes)
    if (t.type == type)
      return t.name;
  return c10::toString(type);
}

/// The dtypes a tensor named `name` may have, for a message.
const char *acceptedDTypes(const std::string &name) {
  if (name == "topk_ids")
    return "i32 or i64";
  if (name == "topk_weights" || name == "dtopk_weights")
    return "f32";
  return "f32 or bf16";
}

DType moecType(const at::Tensor &t, const char *name) {
  for (const TorchType &k : kTorchTypes)
    if (k.type == t.scalar_type() && k.dtype)
      return *k.dtype;
  TORCH_CHECK(false, "moec: '", name, "' is ", dtypeName(t.scalar_type()), "; expected ",
              acceptedDTypes(name));
  return DType::F32;
}

/// The routing's dtypes, checked before anything else looks at them, in the
/// words of the runtime's own routing checks.
void expectRoutingDTypes(const at::Tensor &ids, const at::Tensor &weights) {
  TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
              "moec: topk_ids is ", dtypeName(ids.scalar_type()), "; expected i32 or i64");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "moec: topk_weights is ",
              dtypeName(weights.scalar_type()), "; expected f32");
}

/// The routing against x [P, S, H]: one row of expert ids and of weights
/// per token of x, and as many weights as ids; the tensor that disagrees is
/// the one named.
void expectRoutingFor(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights) {
  for (const auto &[t, name] : {std::pair{&ids, "topk_ids"}, std::pair{&weights, "topk_weights"}})
    TORCH_CHECK(t->size(1) == x.size(1), "moec: '", name, "' has shape ", t->sizes(), ", but x ",
                x.sizes(), " has ", x.size(1), " tokens a rank: ", name,
                " needs one row per token of x");
  TORCH_CHECK(weights.size(2) == ids.size(2), "moec: 'topk_weights' has shape ", weights.sizes(),
              ", but topk_ids ", ids.sizes(), " routes each token to ", ids.size(2),
              " experts: topk_weights needs one weight per expert id");
}

/// Checks that `t` (x, a weight, an adapter, expert rows) has the layer's
/// dtype `want`.
void expectLayerDType(const at::Tensor &t, const char *name, DType want) {
  TORCH_CHECK(t.scalar_type() == torchType(want), "moec: '", name, "' is ",
              dtypeName(t.scalar_type()), "; expected ", dtypeName(torchType(want)),
              ", the layer's dtype");
}

/// Rank r's part of `t` (the r-th of `parts` equal slices along dim 0) as a
/// runtime tensor of the remaining dims (dim 0 divided by `parts` when
/// `keepDim0`).
/// `codes` is the dtype of the layer's quantized weights (w1, w2), whose
/// codes are int8 or uint8 tensors.
moec::rt::Tensor slice(const at::Tensor &t, const char *name, int64_t parts, int64_t r,
                       bool keepDim0, DType codes = DType::F8E4M3) {
  moec::rt::Tensor out{};
  // uint8 holds FP8 e4m3 codes (torch 1.13 has no float8 type) or 4-bit
  // codes two a byte; int8 holds int8 codes.
  const bool bytes = t.scalar_type() == (codes == DType::I8 ? at::kChar : at::kByte);
  out.dtype = moec_dtype(bytes ? codes : moecType(t, name));
  const int64_t per = t.size(0) / parts;
  if (keepDim0) {
    out.ndim = int32_t(t.dim());
    out.dims[0] = per;
    for (int64_t i = 1; i < t.dim(); ++i)
      out.dims[i] = t.size(i);
  } else {
    out.ndim = int32_t(t.dim() - 1);
    for (int64_t i = 1; i < t.dim(); ++i)
      out.dims[i - 1] = t.size(i);
  }
  const int64_t rowElements = t.numel() / std::max<int64_t>(1, t.size(0));
  out.data = static_cast<char *>(t.data_ptr()) + r * per * rowElements * t.element_size();
  return out;
}

/// Checks what the runtime cannot see from a raw pointer: CPU, a contiguous
/// layout (made so by the caller), and the leading dim split over ranks.
void expectInput(const at::Tensor &t, const char *name, int64_t dims, int64_t leading,
                 const char *leadingName) {
  TORCH_CHECK(t.defined(), "moec: '", name, "' is undefined");
  TORCH_CHECK(t.device().is_cpu(), "moec: '", name, "' is on ", t.device(),
              "; the moec runtime runs on the CPU");
  TORCH_CHECK(t.dim() == dims, "moec: '", name, "' has shape ", t.sizes(), "; expected ", dims,
              " dims");
  TORCH_CHECK(t.size(0) == leading, "moec: '", name, "' has shape ", t.sizes(),
              "; expected dim 0 to be ", leadingName, " = ", leading);
}

/// A layer's runtime context and the lock that makes its passes one at a
/// time. Under MPI the registry below holds it too: freeing a context frees
/// MPI windows, which is collective, so it happens in finalize_mpi, in
/// creation order on every rank, and never when Python's garbage collector
/// happens to drop a Layer.
struct Slot;

/// The memory of the tensors a layer returns (y, dx, dtopk_weights, dw1,
/// dw2), recycled: when such a tensor dies (the optimizer's
/// zero_grad(set_to_none=True), or autograd adding it into an existing
/// .grad), its buffer comes back here, and a later step takes it with its
/// pages already touched instead of fresh pages from the OS. For
/// qwen3-30b-a3b on 2 ranks the weight gradients are 2.4 GB: first-touch
/// page faults on them cost about 0.6 s a step. A returned tensor is a
/// plain tensor that only its holders reference, so autograd takes it as
/// .grad without a copy.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
public:
  ~BufferPool() {
    for (const auto &[bytes, buffer] : idle)
      std::free(buffer);
  }

  /// A tensor of `sizes` and `options` (CPU, contiguous) over a recycled
  /// buffer of the same size when one is idle, else a new one.
  at::Tensor take(at::IntArrayRef sizes, const at::TensorOptions &options) {
    size_t bytes = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
    for (int64_t d : sizes)
      bytes *= size_t(d);
    bytes = std::max<size_t>(bytes, 1);
    void *buffer = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (auto it = idle.find(bytes); it != idle.end()) {
        buffer = it->second;
        idle.erase(it);
        ++recycled;
      }
    }
    if (!buffer) {
      buffer = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      TORCH_CHECK(buffer, "moec: cannot allocate ", bytes, " bytes for an output");
    }
    std::shared_ptr<BufferPool> self = shared_from_this();
    return at::from_blob(
        buffer, sizes, [self, bytes](void *data) { self->giveBack(data, bytes); }, options);
  }

  /// Outputs served from an idle buffer so far.
  int64_t recycledCount() {
    std::lock_guard<std::mutex> lock(mutex);
    return recycled;
  }

private:
  /// At most this many idle buffers are kept; more go back to the system.
  static constexpr size_t kMaxIdle = 16;

  void giveBack(void *buffer, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    if (idle.size() >= kMaxIdle) {
      std::free(buffer);
      return;
    }
    idle.emplace(bytes, buffer);
  }

  std::mutex mutex;
  std::multimap<size_t, void *> idle; ///< bytes -> buffer
  int64_t recycled = 0;
};

struct Slot {
  std::mutex mutex;
  std::unique_ptr<moec::rt::Context> context;
  std::unique_ptr<moec::rt::Exchange> exchange;
  std::shared_ptr<BufferPool> outputs = std::make_shared<BufferPool>();
  /// The process that made it: its worker threads, its watchdog and any
  /// pass in flight live there only. A child of fork() has a copy of the
  /// memory and none of the threads (a lock held then stays held for ever).
  const pid_t creator = ::getpid();

  /// Refuses a call from a child of fork(), before any lock.
  void sameProcess(const char *what) const {
    const pid_t me = ::getpid();
    TORCH_CHECK(me == creator, "moec: this ", what, " was created in process ", creator,
                "; this is process ", me, ", a child of fork(), which has none of its "
                "threads. Build a new ", what, " in this process (one made after fork() works), "
                "or start workers with the 'spawn' or 'forkserver' start method");
  }

  ~Slot() {
    // In a child of fork(), freeing the runtime would join threads that do
    // not exist here: the copy is left to the process's end.
    if (::getpid() != creator) {
      (void)context.release();
      (void)exchange.release();
    }
  }
};

std::mutex mpiSlotsMutex;
std::vector<std::shared_ptr<Slot>> mpiSlots;

/// The most worker threads a layer starts.
constexpr int64_t kMaxWorkers = 1024;

/// The sizes a layer and an exchange report to the Python side.
c10::Dict<std::string, int64_t> shapeInfo(const moec::rt::LayerShape &s, uint32_t firstRank,
                                          uint32_t localRanks) {
  c10::Dict<std::string, int64_t> d;
  d.insert("ranks", s.ranks);
  d.insert("tp", s.tp);
  d.insert("first_rank", firstRank);
  d.insert("local_ranks", localRanks);
  d.insert("local_experts", s.localExperts);
  d.insert("experts", s.experts());
  d.insert("hidden", s.hidden);
  d.insert("tokens", s.tokens);
  d.insert("top_k", s.topK);
  d.insert("receive_capacity", s.receiveCapacity);
  d.insert("bf16", s.activations == DType::BF16);
  return d;
}

/// The fabric of a context or an exchange and what it runs over: "inproc",
/// "mpi", or "group" with a torch.distributed group's c10d::ProcessGroup
/// (`group`, from moec_process_group, a reference this takes over) and
/// that group's timeout.
struct FabricChoice {
  std::string name;
  int64_t group = 0;
  double groupTimeoutSeconds = 0;
};

/// The options of a context or an exchange, checked, with its fabric.
moec::rt::ContextOptions contextOptions(int64_t workers, double timeoutSeconds,
                                        const FabricChoice &fabric) {
  // Taken over first, so that no check below leaks the reference.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  if (fabric.group != 0)
    group = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim(
        reinterpret_cast<c10d::ProcessGroup *>(fabric.group));
  TORCH_CHECK(workers >= 0 && workers <= kMaxWorkers, "moec: workers must be 0 (the hardware "
              "threads) to ", kMaxWorkers, ", got ", workers);
  TORCH_CHECK(moec::timeoutInRange(timeoutSeconds), "moec: timeout_seconds must be from ",
              moec::kTimeoutMinSeconds, " to ", moec::kTimeoutMaxSeconds, " seconds, got ",
              timeoutSeconds);
  TORCH_CHECK(fabric.name == "inproc" || fabric.name == "mpi" || fabric.name == "group",
              "moec: fabric must be 'inproc', 'mpi' or 'group', got '", fabric.name, "'");
  TORCH_CHECK((fabric.name == "group") == bool(group),
              "moec: the fabric 'group' takes a process group, and only it");
  moec::rt::ContextOptions options;
  options.workers = uint32_t(workers);
  options.timeoutSeconds = timeoutSeconds;
  if (fabric.name == "mpi") {
    moec::comm::MpiOptions mpi;
    mpi.timeoutSeconds = timeoutSeconds;
    mpi.localPuts = moec::comm::localPutsRequested(); // a measurement mode
    check(moec::comm::createMpiFabric(&options.fabric, mpi), "MPI fabric");
  } else if (fabric.name == "group") {
    TORCH_CHECK(std::isfinite(fabric.groupTimeoutSeconds) && fabric.groupTimeoutSeconds > 0,
                "moec: the process group's timeout must be positive, got ",
                fabric.groupTimeoutSeconds);
    check(moec::torchop::groupFabric(group, timeoutSeconds, fabric.groupTimeoutSeconds,
                                     &options.fabric),
          "process-group fabric");
  }
  return options;
}

class Layer : public torch::CustomClassHolder {
public:
  Layer(std::string forwardPath, std::string backwardPath, int64_t workers,
        double timeoutSeconds, std::string fabric, bool trace, bool packWeights, int64_t group,
        double groupTimeoutSeconds) {
    moec::rt::ContextOptions options =
        contextOptions(workers, timeoutSeconds, {fabric, group, groupTimeoutSeconds});
    std::shared_ptr<const moec::rt::Program> fwd, bwd;
    check(moec::rt::Program::load(forwardPath, &fwd), "forward binary");
    if (!backwardPath.empty())
      check(moec::rt::Program::load(backwardPath, &bwd), "backward binary");
    options.trace = trace;
    options.packWeights = packWeights;
    this->packWeights = packWeights;
    check(moec::rt::Context::create(fwd, bwd, options, &slot->context), "context");
    if (fabric == "mpi") {
      std::lock_guard<std::mutex> lock(mpiSlotsMutex);
      mpiSlots.push_back(slot);
    }
    reportSeconds = std::min(timeoutSeconds, 10.0);
    agreeSeconds = timeoutSeconds;
  }

  /// The most bytes of text a process brings to agree().
  static constexpr size_t kAgreeBytes = 4096;

  /// Every process's `text` (at most kAgreeBytes bytes), in rank order: one
  /// bounded exchange over the layer's fabric (timeout_seconds; the error
  /// names the ranks that did not come), through which the Python side
  /// agrees on what the binaries do not say (capacity_policy, whether to
  /// grow the layer after an over-capacity error). Collective under MPI, in
  /// the order of the passes; in one process (every rank here) it returns
  /// {text}.
  std::vector<std::string> agree(const std::string &text) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    TORCH_CHECK(text.size() <= kAgreeBytes, "moec: agree() takes at most ", kAgreeBytes,
                " bytes, got ", text.size());
    moec::comm::Fabric &fabric = slot->context->fabric();
    if (fabric.allLocal())
      return {text};
    TORCH_CHECK(fabric.localRanks() == 1, "moec: agree() under a fabric of several processes "
                "with several ranks each");
    const size_t block = 8 + kAgreeBytes;
    std::vector<char> mine(block, 0), all(block * fabric.ranks(), 0);
    const uint64_t bytes = text.size();
    std::memcpy(mine.data(), &bytes, 8);
    std::memcpy(mine.data() + 8, text.data(), text.size());
    check(fabric.exchange(mine.data(), block, all.data(), agreeSeconds),
          "agreement between the ranks");
    std::vector<std::string> out;
    for (uint32_t r = 0; r < fabric.ranks(); ++r) {
      uint64_t theirs = 0;
      std::memcpy(&theirs, all.data() + r * block, 8);
      out.emplace_back(all.data() + r * block + 8, std::min<uint64_t>(theirs, kAgreeBytes));
    }
    return out;
  }

  /// The layer's sizes, for the Python side.
  c10::Dict<std::string, int64_t> info() const {
    live();
    const moec::rt::LayerShape &s = slot->context->shape();
    c10::Dict<std::string, int64_t> d =
        shapeInfo(s, slot->context->firstLocalRank(), slot->context->localRanks());
    d.insert("inter", s.inter);
    const moec::rt::LayerShape *bs = slot->context->backwardShape();
    d.insert("backward", bs != nullptr);
    d.insert("frozen", bs && bs->frozen);
    d.insert("main_grad", bs && bs->accumulateWeightGrads);
    d.insert("lora_targets", s.loraTargets);
    d.insert("lora_rank", s.loraRank);
    d.insert("fp8_dispatch", s.fp8Dispatch);
    d.insert("weights_transposed", s.weightsTransposed);
    // 0 dense, 1 fp8_block128, 2 int8, 3 int4 (of weight_group values, with
    // zero points or not)
    d.insert("weight_format", int64_t(s.weightFormat));
    d.insert("weight_group", s.weightGroup);
    d.insert("weight_zero_points", s.weightZeroPoints);
    // Bytes of rows the last passes' puts moved between ranks (all ranks).
    const moec::rt::PassTimes &f = slot->context->forwardTimes(),
                              &b = slot->context->backwardTimes();
    d.insert("forward_dispatch_bytes", int64_t(f.dispatchBytes));
    d.insert("forward_combine_bytes", int64_t(f.combineBytes));
    d.insert("backward_dispatch_bytes", int64_t(b.dispatchBytes));
    d.insert("backward_combine_bytes", int64_t(b.combineBytes));
    d.insert("workers", slot->context->workers());
    d.insert("outputs_recycled", slot->outputs->recycledCount());
    const moec::tooling::WorkspaceTotals ws = moec::tooling::workspaceTotals(*slot->context);
    d.insert("workspace_bytes", int64_t(ws.allocated));
    d.insert("workspace_resident", int64_t(ws.resident));
    d.insert("scratch_bytes", int64_t(ws.scratch));
    return d;
  }

  std::tuple<at::Tensor, int64_t> forward(const at::Tensor &x, const at::Tensor &ids,
                                          const at::Tensor &weights, const at::Tensor &w1,
                                          const at::Tensor &w2,
                                          const std::vector<at::Tensor> &adapters) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    const auto start = std::chrono::steady_clock::now();
    const Inputs in = inputs(x, ids, weights, w1, w2, adapters);
    at::Tensor y = slot->outputs->take(in.x.sizes(), in.x.options());
    runForward(in, y);
    forwardCall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return {y, step};
  }

  using Gradients = std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>,
                               c10::optional<at::Tensor>, std::vector<at::Tensor>>;

  Gradients backward(int64_t forwardStep, const at::Tensor &x, const at::Tensor &ids,
           const at::Tensor &weights, const at::Tensor &w1, const at::Tensor &w2,
           const at::Tensor &dyIn, const c10::optional<at::Tensor> &mainGrad1,
           const c10::optional<at::Tensor> &mainGrad2, const std::vector<at::Tensor> &adapters) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    // The op call's time, set on every return (an error's too).
    struct Timer {
      std::chrono::steady_clock::time_point start;
      double *out;
      ~Timer() {
        *out = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }
    } timer{std::chrono::steady_clock::now(), &backwardCall};
    const moec::rt::LayerShape *bs = slot->context->backwardShape();
    TORCH_CHECK(bs, "moec: this layer was built without a backward binary");
    const Inputs in = inputs(x, ids, weights, w1, w2, adapters);
    // The runtime's saved state belongs to its last forward pass; a backward
    // of an older one recomputes it.
    if (forwardStep != step) {
      at::Tensor y = at::empty_like(in.x);
      runForward(in, y);
    }
    const int64_t P = slot->context->localRanks(), first = slot->context->firstLocalRank();
    expectInput(dyIn, "dy", 3, P, "this process's ranks");
    TORCH_CHECK(dyIn.sizes() == in.x.sizes(), "moec: 'dy' has shape ", dyIn.sizes(),
                "; expected ", in.x.sizes(), " like x");
    TORCH_CHECK(dyIn.scalar_type() == in.x.scalar_type(), "moec: 'dy' is ", dyIn.scalar_type(),
                "; expected ", in.x.scalar_type(), " like x");
    const at::Tensor dy = dyIn.contiguous();
    BufferPool &pool = *slot->outputs;
    at::Tensor dx = pool.take(in.x.sizes(), in.x.options());
    at::Tensor dtopk = pool.take(in.weights.sizes(), in.weights.options().dtype(at::kFloat));
    const bool intoMainGrad = mainGrad1.has_value() || mainGrad2.has_value();
    TORCH_CHECK(!intoMainGrad || (mainGrad1.has_value() && mainGrad2.has_value()),
                "moec: pass both main-grad buffers or neither");
    TORCH_CHECK(!intoMainGrad || bs->accumulateWeightGrads,
                "moec: main-grad buffers need a backward binary that accumulates its weight "
                "gradients (compiled with the config's \"main_grad\": true)");
    at::Tensor dw1, dw2;
    if (intoMainGrad) {
      dw1 = mainGradBuffer(*mainGrad1, in.w1, "main_grad of w1");
      dw2 = mainGradBuffer(*mainGrad2, in.w2, "main_grad of w2");
    } else if (!bs->frozen) {
      const auto gradOptions = in.w1.options().dtype(torchType(bs->weightGrads));
      dw1 = pool.take(in.w1.sizes(), gradOptions);
      dw2 = pool.take(in.w2.sizes(), gradOptions);
      // Without main-grad buffers, weight gradients the binary accumulates
      // start from zero here.
      if (bs->accumulateWeightGrads) {
        dw1.zero_();
        dw2.zero_();
      }
    }
    // The adapters' gradients, in the order of their adapters.
    std::vector<at::Tensor> adapterGrads;
    for (size_t i = 0; i < loraCount(); ++i)
      adapterGrads.push_back(pool.take(in.adapters[i].sizes(),
                                       in.adapters[i].options().dtype(torchType(bs->weightGrads))));
    bindInputs(in);
    for (int64_t p = 0; p < P; ++p) {
      const uint32_t r = uint32_t(first + p);
      for (size_t i = 0; i < adapterGrads.size(); ++i) {
        const std::string name = "d" + adapterNames()[i];
        check(slot->context->bind(r, name, slice(adapterGrads[i], name.c_str(), P, p, true)),
              "bind adapter gradient");
      }
      check(slot->context->bind(r, "dy", slice(dy, "dy", P, p, false)), "bind dy");
      check(slot->context->bind(r, "dx", slice(dx, "dx", P, p, false)), "bind dx");
      check(slot->context->bind(r, "dtopk_weights", slice(dtopk, "dtopk_weights", P, p, false)),
            "bind dtopk_weights");
      if (bs->frozen)
        continue;
      check(slot->context->bind(r, "dw1", slice(dw1, "dw1", P, p, true)), "bind dw1");
      check(slot->context->bind(r, "dw2", slice(dw2, "dw2", P, p, true)), "bind dw2");
    }
    checkPass(slot->context->backward(), "backward");
    // Gradients take their parameter's dtype (fp32 weight gradients of a
    // bf16 layer are rounded once, here).
    for (size_t i = 0; i < adapterGrads.size(); ++i)
      if (adapterGrads[i].scalar_type() != in.adapters[i].scalar_type())
        adapterGrads[i] = adapterGrads[i].to(in.adapters[i].scalar_type());
    if (intoMainGrad || bs->frozen)
      return {dx, dtopk, c10::nullopt, c10::nullopt, adapterGrads};
    if (dw1.scalar_type() != in.w1.scalar_type()) {
      dw1 = dw1.to(in.w1.scalar_type());
      dw2 = dw2.to(in.w2.scalar_type());
    }
    return {dx, dtopk, dw1, dw2, adapterGrads};
  }

  /// The asynchronous calls: submit_forward and submit_backward run the
  /// pass on a thread of their own and return a ticket at once; the wait
  /// calls give its result (or raise its error) once, and the ticket is
  /// spent. Passes of one layer still run one at a time, in the order
  /// they take the layer. discard waits for a pass and drops its result
  /// (a handle that was never waited).
  int64_t submitForward(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights,
                        const at::Tensor &w1, const at::Tensor &w2,
                        const std::vector<at::Tensor> &adapters) {
    return submit(pendingForwards, [=] { return forward(x, ids, weights, w1, w2, adapters); });
  }

  int64_t submitBackward(int64_t forwardStep, const at::Tensor &x, const at::Tensor &ids,
                         const at::Tensor &weights, const at::Tensor &w1, const at::Tensor &w2,
                         const at::Tensor &dy, const c10::optional<at::Tensor> &mainGrad1,
                         const c10::optional<at::Tensor> &mainGrad2,
                         const std::vector<at::Tensor> &adapters) {
    return submit(pendingBackwards, [=] {
      return backward(forwardStep, x, ids, weights, w1, w2, dy, mainGrad1, mainGrad2, adapters);
    });
  }

  std::tuple<at::Tensor, int64_t> waitForward(int64_t ticket) {
    return takePending(pendingForwards, ticket, "forward").get();
  }

  Gradients waitBackward(int64_t ticket) {
    return takePending(pendingBackwards, ticket, "backward").get();
  }

  /// Waits for a submitted pass and drops its result and error; false when
  /// the ticket was already waited.
  bool discard(int64_t ticket) {
    slot->sameProcess("layer");
    std::unique_lock<std::mutex> lock(pendingMutex);
    const bool forward = pendingForwards.count(ticket) != 0;
    if (!forward && !pendingBackwards.count(ticket))
      return false;
    lock.unlock();
    try {
      if (forward)
        waitForward(ticket);
      else
        waitBackward(ticket);
    } catch (const std::exception &) {
      // Its error goes with it.
    }
    return true;
  }

  /// True when the submitted pass `ticket` has ended (its wait will not
  /// block), and for a ticket already waited.
  bool ready(int64_t ticket) {
    slot->sameProcess("layer");
    std::lock_guard<std::mutex> lock(pendingMutex);
    const auto ended = [](const auto &future) {
      return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    };
    if (auto it = pendingForwards.find(ticket); it != pendingForwards.end())
      return ended(it->second);
    if (auto it = pendingBackwards.find(ticket); it != pendingBackwards.end())
      return ended(it->second);
    return true;
  }

  /// Submitted passes not yet waited.
  int64_t pending() {
    slot->sameProcess("layer");
    std::lock_guard<std::mutex> lock(pendingMutex);
    return int64_t(pendingForwards.size() + pendingBackwards.size());
  }

  ~Layer() override {
    // A child of fork() has none of the threads its submitted passes ran
    // on: their futures would wait for ever; left to the process's end.
    if (::getpid() != slot->creator) {
      (void)new decltype(pendingForwards)(std::move(pendingForwards));
      (void)new decltype(pendingBackwards)(std::move(pendingBackwards));
      return;
    }
    // A pass still running uses this object: wait for it.
    for (auto &p : pendingForwards)
      p.second.wait();
    for (auto &p : pendingBackwards)
      p.second.wait();
  }

  /// The binaries' layer record: the config they were compiled from, as
  /// JSON in the config's keys (format/TaskBinary.h, layerRecordJson).
  std::string layerRecord() const {
    live();
    return moec::format::layerRecordJson(slot->context->layerRecord());
  }

  /// What the config of the binaries must change to hold a routing of
  /// `rowsPerRank` routed and `receivePerRank` received rows (format/
  /// Capacity.h, from the layer record): (seq_size, capacity_factor,
  /// row_capacity, receive_capacity, fits).
  std::tuple<int64_t, double, int64_t, int64_t, bool>
  capacityAdvice(int64_t rowsPerRank, int64_t receivePerRank, bool headroom) const {
    live();
    const moec::format::CapacityAdvice a = moec::format::adviseCapacity(
        slot->context->shape().capacityInputs(), rowsPerRank, receivePerRank, headroom);
    return {a.seqSize, a.capacityFactor, a.rowCapacity, a.receiveCapacity, a.fits};
  }

  /// What the last forward pass's routing needed (every rank), and the
  /// binary's capacities: for growing the layer after an over-capacity error.
  c10::Dict<std::string, int64_t> capacityNeed() const {
    live();
    const moec::rt::CapacityNeed &n = slot->context->capacityNeed();
    const moec::rt::LayerShape &s = slot->context->shape();
    c10::Dict<std::string, int64_t> d;
    d.insert("rows_per_rank", n.rowsPerRank);
    d.insert("receive_per_rank", n.receivePerRank);
    d.insert("rows_per_expert", n.rowsPerExpert);
    d.insert("put_rows", n.putRows);
    d.insert("row_capacity", s.rowCapacity);
    d.insert("receive_capacity", s.receiveCapacity);
    d.insert("expert_capacity", s.expertCapacity);
    d.insert("put_capacity", s.putCapacity);
    return d;
  }

  /// Seconds of the last forward and backward pass: prepare, tasks, finish.
  /// Writes the trace of the last forward, backward or either pass (which:
  /// "forward", "backward", "last") as Chrome/Perfetto JSON.
  void writeTrace(const std::string &path, const std::string &which) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    TORCH_CHECK(which == "forward" || which == "backward" || which == "last",
                "moec: the pass to trace must be 'forward', 'backward' or 'last', got '", which,
                "'");
    const moec::rt::TracedPass pass = which == "forward"    ? moec::rt::TracedPass::Forward
                                      : which == "backward" ? moec::rt::TracedPass::Backward
                                                            : moec::rt::TracedPass::Last;
    check(slot->context->writeTrace(path, pass), "trace");
  }

  /// The workspace table (runtime/tooling/Workspace.h).
  /// The layer's weights were written where PyTorch does not count it
  /// (through .data): every packed weight is packed again.
  void weightsChanged() {
    TORCH_CHECK(pending() == 0, "moec: weights_changed() while a submitted pass has not been "
                "waited for: wait for it first (the pass reads the weights)");
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    for (auto &[name, last] : seen)
      check(slot->context->weightChanged(name), "weights changed");
  }

  std::string workspace() const {
    live();
    return moec::tooling::workspaceText(*slot->context);
  }

  /// The profile (runtime/tooling/Profile.h) of the last "forward" or
  /// "backward" pass (trace=True), and the op call's time around it.
  std::string profile(const std::string &which) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    TORCH_CHECK(which == "forward" || which == "backward",
                "moec: the pass to profile must be 'forward' or 'backward', got '", which, "'");
    const bool backward = which == "backward";
    // One core's peaks, measured once per process, when first asked for.
    static const moec::tooling::Peaks peaks = moec::tooling::measurePeaks(0.3);
    std::string text;
    check(moec::tooling::profileText(*slot->context,
                                     backward ? moec::rt::TracedPass::Backward
                                              : moec::rt::TracedPass::Forward,
                                     peaks, &text),
          "profile");
    const moec::rt::PassTimes &t =
        backward ? slot->context->backwardTimes() : slot->context->forwardTimes();
    const double call = backward ? backwardCall : forwardCall;
    text += fmt::format("the op call: {:.3f} ms, the runtime's pass {:.3f} ms of it; the rest, "
                        "{:.3f} ms, is the op's own (checks, views, outputs{})\n",
                        call * 1e3, t.total() * 1e3, (call - t.total()) * 1e3,
                        backward ? ", gradient dtypes, a forward recomputed for an older step"
                                 : "");
    return text;
  }

  std::vector<double> times() const {
    live();
    const moec::rt::PassTimes &f = slot->context->forwardTimes(), &b = slot->context->backwardTimes();
    return {f.prepare, f.tasks, f.finish, b.prepare, b.tasks, b.finish};
  }

private:
  void live() const {
    slot->sameProcess("layer");
    TORCH_CHECK(slot->context, "moec: this layer was released (moec_torch.finalize_mpi)");
  }

  /// Starts `pass` on a thread of its own (no autograd there: the tensors
  /// are the op's inputs) and files its future under a new ticket.
  template <class Result, class PassFn>
  int64_t submit(std::map<int64_t, std::future<Result>> &pending, PassFn pass) {
    live();
    std::lock_guard<std::mutex> lock(pendingMutex);
    const int64_t ticket = ++tickets;
    pending.emplace(ticket, std::async(std::launch::async, [pass] {
                      at::NoGradGuard noGrad;
                      return pass();
                    }));
    return ticket;
  }

  template <class Result>
  std::future<Result> takePending(std::map<int64_t, std::future<Result>> &pending,
                                  int64_t ticket, const char *what) {
    slot->sameProcess("layer");
    std::lock_guard<std::mutex> lock(pendingMutex);
    auto it = pending.find(ticket);
    TORCH_CHECK(it != pending.end(), "moec: the ", what, " handle ", ticket,
                " was already waited (a handle gives its result once)");
    std::future<Result> future = std::move(it->second);
    pending.erase(it);
    return future;
  }

  struct Inputs {
    at::Tensor x, ids, weights, w1, w2;
    /// named adapterNames(): the LoRA adapters, then the block scales of
    /// FP8 weights
    std::vector<at::Tensor> adapters;
  };

  /// How many of adapterNames() are LoRA adapters (the rest are scales).
  size_t loraCount() const {
    const uint8_t targets = slot->context->shape().loraTargets;
    return 2 * size_t((targets & 1) + (targets >> 1 & 1));
  }

  /// The runtime's names of the layer's further tensors, in the order the
  /// op takes them: the LoRA adapters (A and B on w1, then on w2, for the
  /// projections that have them), then w1_scale and w2_scale for quantized
  /// weights.
  std::vector<std::string> adapterNames() const {
    std::vector<std::string> names;
    const uint8_t targets = slot->context->shape().loraTargets;
    for (int t = 0; t < 2; ++t)
      if (targets >> t & 1)
        for (const char *m : {"a", "b"})
          names.push_back(fmt::format("lora_{}{}", m, t + 1));
    if (slot->context->shape().weightFormat != moec::WeightFormat::Dense)
      names.insert(names.end(), {"w1_scale", "w2_scale"});
    return names;
  }

  /// Checks the inputs against the layer and makes them contiguous.
  Inputs inputs(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights,
                const at::Tensor &w1, const at::Tensor &w2,
                const std::vector<at::Tensor> &adapters) const {
    const moec::rt::LayerShape &s = slot->context->shape();
    const int64_t P = slot->context->localRanks(), E = P * s.localExperts;
    const char *ranks = P == s.ranks ? "ranks" : "this process's ranks";
    const char *experts = P == s.ranks ? "experts" : "this process's experts";
    expectInput(x, "x", 3, P, ranks);
    expectInput(ids, "topk_ids", 3, P, ranks);
    expectInput(weights, "topk_weights", 3, P, ranks);
    expectRoutingFor(x, ids, weights);
    expectInput(w1, "w1", 3, E, experts);
    expectInput(w2, "w2", 3, E, experts);
    const std::vector<std::string> names = adapterNames();
    TORCH_CHECK(adapters.size() == names.size(), "moec: this layer takes ", names.size(),
                names.size() == loraCount() ? " LoRA adapter tensors ("
                                            : " LoRA adapter and weight-scale tensors (",
                fmt::format("{}", fmt::join(names, ", ")), "); got ", adapters.size());
    expectRoutingDTypes(ids, weights);
    expectLayerDType(x, "x", s.activations);
    if (s.weightFormat != moec::WeightFormat::Dense) {
      const bool int8 = s.weightFormat == moec::WeightFormat::Int8Channel;
      const char *codes = s.weightFormat == moec::WeightFormat::Fp8Block128 ? "FP8 e4m3 codes"
                          : int8                                           ? "int8 codes"
                                 : "4-bit codes, two a byte,";
      for (const auto &[w, name] : {std::pair{&w1, "w1"}, std::pair{&w2, "w2"}})
        TORCH_CHECK(w->scalar_type() == (int8 ? at::kChar : at::kByte), "moec: '", name, "' is ",
                    dtypeName(w->scalar_type()), "; expected ", int8 ? "int8" : "uint8", ", the ",
                    codes, " of the layer's ", s.weightFormatName(), " weights");
    } else {
      expectLayerDType(w1, "w1", s.activations);
      expectLayerDType(w2, "w2", s.activations);
    }
    std::vector<at::Tensor> contiguous;
    for (size_t i = 0; i < adapters.size(); ++i) {
      // Adapters are [E, K, r] or [E, r, N]; the runtime checks the scales'
      // shape, whose rank is the format's.
      expectInput(adapters[i], names[i].c_str(),
                  i < loraCount() ? 3 : int64_t(s.scaleDims(s.w1Dims()).size()), E, experts);
      expectLayerDType(adapters[i], names[i].c_str(),
                       i < loraCount() ? s.activations : DType::F32);
      contiguous.push_back(adapters[i].contiguous());
    }
    return {x.contiguous(), ids.contiguous(), weights.contiguous(), w1.contiguous(),
            w2.contiguous(), contiguous};
  }

  /// A caller's main-grad buffer: fp32, CPU, contiguous, shaped like its
  /// weight; the runtime adds the weight gradient into it in place.
  static at::Tensor mainGradBuffer(const at::Tensor &t, const at::Tensor &weight,
                                   const char *name) {
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "moec: '", name,
                "' must be a CPU tensor");
    TORCH_CHECK(t.scalar_type() == at::kFloat, "moec: '", name, "' is ", t.scalar_type(),
                "; expected float32");
    TORCH_CHECK(t.sizes() == weight.sizes(), "moec: '", name, "' has shape ", t.sizes(),
                "; expected ", weight.sizes(), " like its weight");
    TORCH_CHECK(t.is_contiguous(), "moec: '", name, "' must be contiguous (the runtime adds "
                "into it in place)");
    return t;
  }

  /// What the packed-weight store (ContextOptions::packWeights) knows of a
  /// weight tensor: the tensor, its memory and its version counter (which
  /// PyTorch bumps at every in-place write, an optimizer's among them).
  struct Seen {
    const void *impl = nullptr, *data = nullptr;
    int64_t version = -1;
  };

  /// Tells the runtime which weights changed since the last pass: a weight
  /// whose tensor or version is not the one last seen is packed again.
  void noteWeights(const Inputs &in) {
    if (!packWeights)
      return; // nothing is packed to go stale
    std::vector<std::pair<std::string, const at::Tensor *>> weights{{"w1", &in.w1},
                                                                    {"w2", &in.w2}};
    const std::vector<std::string> names = adapterNames();
    for (size_t i = 0; i < loraCount(); ++i)
      weights.emplace_back(names[i], &in.adapters[i]);
    for (const auto &[name, t] : weights) {
      const Seen now{t->unsafeGetTensorImpl(), t->data_ptr(), int64_t(t->_version())};
      Seen &last = seen[name];
      if (last.version >= 0 &&
          (now.impl != last.impl || now.data != last.data || now.version != last.version))
        check(slot->context->weightChanged(name), "weight changed");
      last = now;
    }
  }

  void bindInputs(const Inputs &in) {
    const int64_t P = slot->context->localRanks(), first = slot->context->firstLocalRank();
    noteWeights(in);
    for (int64_t p = 0; p < P; ++p) {
      const uint32_t r = uint32_t(first + p);
      check(slot->context->setRouting(r, slice(in.ids, "topk_ids", P, p, false),
                                slice(in.weights, "topk_weights", P, p, false)),
            "routing");
      check(slot->context->bind(r, "x", slice(in.x, "x", P, p, false)), "bind x");
      const DType codes = slot->context->shape().weightDType();
      check(slot->context->bind(r, "w1", slice(in.w1, "w1", P, p, true, codes)), "bind w1");
      check(slot->context->bind(r, "w2", slice(in.w2, "w2", P, p, true, codes)), "bind w2");
      const std::vector<std::string> names = adapterNames();
      for (size_t i = 0; i < names.size(); ++i)
        check(slot->context->bind(r, names[i], slice(in.adapters[i], names[i].c_str(), P, p, true)),
              "bind adapter");
    }
  }

  /// check() for a pass. Under MPI, a pass whose error left the ranks out
  /// of step (the watchdog, a peer that stopped, a lost link) stops the
  /// job: its peers' waits fail, and on rank 0 the error carries the report
  /// of every rank (Fabric::stopJob). Errors every rank agrees on (bad
  /// routing, over capacity) leave the layer usable and stop nothing.
  void checkPass(const moec::Status &status, const char *what) {
    moec::rt::Context &context = *slot->context;
    if (status.ok() || !context.outOfStep() || context.fabric().allLocal())
      return check(status, what);
    const std::string report = context.fabric().stopJob(status.message(), reportSeconds);
    TORCH_CHECK(false, "moec ", what, ": [rank ", context.firstLocalRank(), "] ",
                status.message(), report.empty() ? "" : "\n", report);
  }

  void runForward(const Inputs &in, at::Tensor &y) {
    const int64_t P = slot->context->localRanks(), first = slot->context->firstLocalRank();
    bindInputs(in);
    for (int64_t p = 0; p < P; ++p)
      check(slot->context->bind(uint32_t(first + p), "y", slice(y, "y", P, p, false)), "bind y");
    // A failed pass leaves no valid saved state.
    step = -1;
    checkPass(slot->context->forward(), "forward");
    step = ++passes;
  }

  std::shared_ptr<Slot> slot = std::make_shared<Slot>();
  bool packWeights = false;          ///< ContextOptions::packWeights
  std::map<std::string, Seen> seen; ///< per weight: as the last pass bound it
  int64_t passes = 0;  ///< forward passes run
  int64_t step = -1;   ///< the pass whose state the runtime holds; -1: none
  double reportSeconds = 10; ///< how long rank 0 waits for the peers' reports
  double agreeSeconds = 60;  ///< how long agree() waits for the peers
  double forwardCall = 0, backwardCall = 0; ///< seconds of the last op calls
  // Submitted passes by ticket, until waited (declared last: the destructor
  // waits for them while the rest is still whole).
  std::mutex pendingMutex;
  int64_t tickets = 0;
  std::map<int64_t, std::future<std::tuple<at::Tensor, int64_t>>> pendingForwards;
  std::map<int64_t, std::future<Gradients>> pendingBackwards;
};

/// Dispatch and combine as ops of their own (moec::rt::Exchange), over a
/// dispatch binary and a combine binary. The tensors carry this process's
/// P ranks first, as the layer's: x, y, dy [P, S, H]; topk_ids,
/// topk_weights [P, S, K]. The expert rows of the P ranks are one tensor
/// [rows, H], rank by rank, each rank's grouped by its local experts, with
/// tokens_per_expert [P*L] (int64) their counts. `route` names the routing
/// a dispatch laid out; a later call with another route lays that one out
/// again from its topk_ids (the handle of the Python side keeps them).
class Exchange : public torch::CustomClassHolder {
public:
  Exchange(std::string dispatchPath, std::string combinePath, int64_t workers,
           double timeoutSeconds, std::string fabric, int64_t group, double groupTimeoutSeconds) {
    moec::rt::ContextOptions options =
        contextOptions(workers, timeoutSeconds, {fabric, group, groupTimeoutSeconds});
    std::shared_ptr<const moec::rt::Program> dispatch, combine;
    check(moec::rt::Program::load(dispatchPath, &dispatch), "dispatch binary");
    check(moec::rt::Program::load(combinePath, &combine), "combine binary");
    check(moec::rt::Exchange::create(dispatch, combine, options, &slot->exchange), "exchange");
    if (fabric == "mpi") {
      std::lock_guard<std::mutex> lock(mpiSlotsMutex);
      mpiSlots.push_back(slot);
    }
  }

  c10::Dict<std::string, int64_t> info() const {
    live();
    return shapeInfo(ex().shape(), ex().firstLocalRank(), ex().localRanks());
  }

  /// -> (expert_x [rows, H], tokens_per_expert [P*L], route)
  std::tuple<at::Tensor, at::Tensor, int64_t> dispatch(const at::Tensor &x, const at::Tensor &ids,
                                                       const at::Tensor &weights) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    const at::Tensor xc = tokens(x, "x");
    expectInput(ids, "topk_ids", 3, ex().localRanks(), "this process's ranks");
    expectInput(weights, "topk_weights", 3, ex().localRanks(), "this process's ranks");
    expectRoutingFor(xc, ids, weights);
    setRoute(++routes, ids, weights);
    const int64_t P = ex().localRanks(), L = ex().shape().localExperts;
    at::Tensor counts = at::empty({P * L}, at::kLong);
    for (int64_t p = 0; p < P; ++p) {
      const std::vector<int64_t> &rows = ex().expertRows(uint32_t(ex().firstLocalRank() + p));
      std::copy(rows.begin(), rows.end(), counts.data_ptr<int64_t>() + p * L);
    }
    at::Tensor expertX = at::empty({totalRows(), ex().shape().hidden}, xc.options());
    check(ex().dispatch(perRank(xc, "x"), expertRowsOf(expertX, "expert_x"), false), "dispatch");
    return {expertX, counts, current};
  }

  /// -> (y [P, S, H], combine step)
  std::tuple<at::Tensor, int64_t> combine(int64_t route, const at::Tensor &ids,
                                          const at::Tensor &weights, const at::Tensor &expertY) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    setRoute(route, ids, weights);
    const at::Tensor rows = expertRowsIn(expertY, "expert_y");
    at::Tensor y = at::empty({ex().localRanks(), ids.size(1), ex().shape().hidden}, rows.options());
    runCombine(rows, y);
    return {y, combineStep};
  }

  /// A dispatch's backward: dx [P, S, H] = the unweighted combine of the
  /// gradient of the expert rows.
  at::Tensor dispatchBackward(int64_t route, const at::Tensor &ids, const at::Tensor &weights,
                              const at::Tensor &dExpertX) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    setRoute(route, ids, weights);
    const at::Tensor rows = expertRowsIn(dExpertX, "the gradient of expert_x");
    at::Tensor dx = at::empty({ex().localRanks(), ids.size(1), ex().shape().hidden}, rows.options());
    check(ex().combine(expertRowsOf(rows, "the gradient of expert_x"), perRank(dx, "dx"), false),
          "dispatch backward");
    // The combine pass's rows are no longer a weighted combine's.
    combineStep = -1;
    return dx;
  }

  /// A combine's backward: (d expert_y [rows, H] = the dispatch of
  /// topk_weight * dy, d topk_weights [P, S, K] = <dy[t], row(t, k)>).
  std::tuple<at::Tensor, at::Tensor> combineBackward(int64_t route, int64_t step,
                                                     const at::Tensor &ids,
                                                     const at::Tensor &weights,
                                                     const at::Tensor &expertY,
                                                     const at::Tensor &dyIn) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    setRoute(route, ids, weights);
    const at::Tensor rows = expertRowsIn(expertY, "expert_y");
    // The returned rows of this combine: run it again when the runtime no
    // longer holds them.
    if (step != combineStep) {
      at::Tensor y = at::empty({ex().localRanks(), ids.size(1), ex().shape().hidden},
                               rows.options());
      runCombine(rows, y);
    }
    const at::Tensor dy = tokens(dyIn, "dy");
    at::Tensor dtopk = at::empty(ids.sizes(), at::kFloat);
    check(ex().topkWeightGrad(perRank(dy, "dy"), perRank(dtopk, "dtopk_weights")),
          "combine backward");
    at::Tensor dExpertY = at::empty_like(rows);
    check(ex().dispatch(perRank(dy, "dy"), expertRowsOf(dExpertY, "the gradient of expert_y"),
                        true),
          "combine backward");
    return {dExpertY, dtopk};
  }

  /// Seconds of the last dispatch and combine task programs.
  std::vector<double> times() const {
    live();
    return {ex().dispatchSeconds(), ex().combineSeconds()};
  }

private:
  moec::rt::Exchange &ex() const { return *slot->exchange; }

  void live() const {
    slot->sameProcess("exchange");
    TORCH_CHECK(slot->exchange, "moec: this exchange was released (moec_torch.finalize_mpi)");
  }

  /// x or dy: [P, S, H] in the activations' dtype, contiguous.
  at::Tensor tokens(const at::Tensor &t, const char *name) const {
    expectInput(t, name, 3, ex().localRanks(), "this process's ranks");
    TORCH_CHECK(t.size(2) == ex().shape().hidden, "moec: '", name, "' has shape ", t.sizes(),
                "; expected the hidden size ", ex().shape().hidden, " last");
    expectLayerDType(t, name, ex().shape().activations);
    return t.contiguous();
  }

  /// Expert rows handed in: [rows of this process's ranks, H], contiguous.
  at::Tensor expertRowsIn(const at::Tensor &t, const char *name) const {
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "moec: '", name, "' must be a CPU tensor");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == totalRows() && t.size(1) == ex().shape().hidden,
                "moec: '", name, "' has shape ", t.sizes(), "; expected [", totalRows(), ", ",
                ex().shape().hidden, "] (the rows the dispatch gave, by rank and expert)");
    expectLayerDType(t, name, ex().shape().activations);
    return t.contiguous();
  }

  int64_t totalRows() const {
    int64_t n = 0;
    for (uint32_t p = 0; p < ex().localRanks(); ++p)
      n += ex().receivedRows(ex().firstLocalRank() + p);
    return n;
  }

  /// The runtime tensors of each local rank's part of `t` ([P, ...]).
  std::vector<moec::rt::Tensor> perRank(const at::Tensor &t, const char *name) const {
    const int64_t P = ex().localRanks();
    std::vector<moec::rt::Tensor> out;
    for (int64_t p = 0; p < P; ++p)
      out.push_back(slice(t, name, P, p, false));
    return out;
  }

  /// The runtime tensors of each local rank's rows of `t` ([rows, H]).
  std::vector<moec::rt::Tensor> expertRowsOf(const at::Tensor &t, const char *name) const {
    std::vector<moec::rt::Tensor> out;
    int64_t first = 0;
    for (uint32_t p = 0; p < ex().localRanks(); ++p) {
      const int64_t n = ex().receivedRows(ex().firstLocalRank() + p);
      moec::rt::Tensor part{};
      part.dtype = moec_dtype(moecType(t, name));
      part.ndim = 2;
      part.dims[0] = n;
      part.dims[1] = t.size(1);
      part.data = static_cast<char *>(t.data_ptr()) + first * t.size(1) * t.element_size();
      out.push_back(part);
      first += n;
    }
    return out;
  }

  /// Lays out routing `route` (topk_ids and topk_weights [P, S, K]) unless
  /// it is the current one.
  void setRoute(int64_t route, const at::Tensor &idsIn, const at::Tensor &weightsIn) {
    if (route == current)
      return;
    const int64_t P = ex().localRanks();
    expectInput(idsIn, "topk_ids", 3, P, "this process's ranks");
    expectInput(weightsIn, "topk_weights", 3, P, "this process's ranks");
    expectRoutingDTypes(idsIn, weightsIn);
    ids = idsIn.contiguous();
    weights = weightsIn.contiguous();
    current = -1;
    combineStep = -1;
    for (int64_t p = 0; p < P; ++p)
      check(ex().setRouting(uint32_t(ex().firstLocalRank() + p), slice(ids, "topk_ids", P, p, false),
                            slice(weights, "topk_weights", P, p, false)),
            "routing");
    check(ex().route(), "routing");
    current = route;
  }

  void runCombine(const at::Tensor &rows, at::Tensor &y) {
    combineStep = -1;
    check(ex().combine(expertRowsOf(rows, "expert_y"), perRank(y, "y"), true), "combine");
    combineStep = ++combines;
  }

  std::shared_ptr<Slot> slot = std::make_shared<Slot>();
  at::Tensor ids, weights;  ///< the routing laid out now (kept alive while in use)
  int64_t routes = 0;       ///< dispatches so far (route ids)
  int64_t current = -1;     ///< the route laid out now; -1: none
  int64_t combines = 0;     ///< weighted combines so far
  int64_t combineStep = -1; ///< the weighted combine whose rows the runtime holds
};

std::tuple<at::Tensor, int64_t> forwardOp(const c10::intrusive_ptr<Layer> &layer,
                                          const at::Tensor &x, const at::Tensor &ids,
                                          const at::Tensor &weights, const at::Tensor &w1,
                                          const at::Tensor &w2,
                                          const std::vector<at::Tensor> &adapters) {
  return layer->forward(x, ids, weights, w1, w2, adapters);
}

Layer::Gradients
backwardOp(const c10::intrusive_ptr<Layer> &layer, int64_t step, const at::Tensor &x,
           const at::Tensor &ids, const at::Tensor &weights, const at::Tensor &w1,
           const at::Tensor &w2, const at::Tensor &dy, const c10::optional<at::Tensor> &mainGrad1,
           const c10::optional<at::Tensor> &mainGrad2, const std::vector<at::Tensor> &adapters) {
  return layer->backward(step, x, ids, weights, w1, w2, dy, mainGrad1, mainGrad2, adapters);
}

/// Frees every MPI layer's context in creation order, then finalizes MPI if
/// moec initialized it. Collective under MPI: every rank calls it once, at
/// the end.
void finalizeMpiOp() {
  {
    std::lock_guard<std::mutex> lock(mpiSlotsMutex);
    for (const std::shared_ptr<Slot> &slot : mpiSlots) {
      slot->sameProcess("layer");
      std::lock_guard<std::mutex> passLock(slot->mutex);
      slot->context.reset();
      slot->exchange.reset();
    }
    mpiSlots.clear();
  }
  moec::comm::finalizeMpi();
}

/// Ends the process-group fabrics (moec::torchop::closeGroupFabrics).
/// Collective over each group: every rank calls it once, at the end.
void closeGroupsOp(double seconds) { moec::torchop::closeGroupFabrics(seconds); }

/// The header of the open safetensors file `fd` of `file_bytes` bytes,
/// checked (moec::safetensors::readHeader), as normalized JSON for
/// moec_torch.safetensors, which maps the data area itself; the checker's
/// message as a RuntimeError.
std::string safetensorsReadHeaderOp(int64_t fd, int64_t fileBytes) {
  TORCH_CHECK(fd >= 0 && fd <= std::numeric_limits<int>::max() && fileBytes >= 0,
              "moec: safetensors_read_header takes an open file and its size");
  moec::safetensors::Header header;
  uint64_t dataStart = 0;
  moec::Status status =
      moec::safetensors::readHeader(int(fd), uint64_t(fileBytes), &header, &dataStart);
  TORCH_CHECK(status.ok(), status.message());
  return moec::safetensors::headerToJson(header);
}

/// FP8 codes and 128 x 128 block scales of each matrix of `w` [N, R, C].
std::tuple<at::Tensor, at::Tensor> quantizeFp8BlocksOp(const at::Tensor &w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 3,
              "moec: quantize_fp8_blocks takes a float32 CPU tensor [N, R, C]");
  const at::Tensor in = w.contiguous();
  const int64_t n = in.size(0), rows = in.size(1), cols = in.size(2);
  const int64_t B = moec::cpu::kFp8WeightBlock, rb = (rows + B - 1) / B, cb = (cols + B - 1) / B;
  at::Tensor codes = at::empty({n, rows, cols}, in.options().dtype(at::kByte));
  at::Tensor scales = at::empty({n, rb, cb}, in.options());
  for (int64_t i = 0; i < n; ++i)
    moec::cpu::quantizeBlocks(in.data_ptr<float>() + i * rows * cols, cols, rows, cols,
                              codes.data_ptr<uint8_t>() + i * rows * cols,
                              scales.data_ptr<float>() + i * rb * cb);
  return {codes, scales};
}

/// The header bytes `header` (uint8) checked against a data area of
/// `data_bytes`, as safetensorsReadHeaderOp returns them.
std::string safetensorsParseHeaderOp(const at::Tensor &header, int64_t dataBytes) {
  TORCH_CHECK(header.device().is_cpu() && header.scalar_type() == at::kByte && header.dim() == 1 &&
                  header.is_contiguous() && dataBytes >= 0,
              "moec: safetensors_parse_header takes the header as a 1-d uint8 CPU tensor and "
              "the size of the data area");
  moec::safetensors::Header out;
  moec::Status status = moec::safetensors::parseHeader(
      std::string_view(reinterpret_cast<const char *>(header.data_ptr<uint8_t>()),
                       size_t(header.numel())),
      uint64_t(dataBytes), &out);
  TORCH_CHECK(status.ok(), status.message());
  return moec::safetensors::headerToJson(out);
}

} // namespace

TORCH_LIBRARY(moec, m) {
  m.class_<Layer>("Layer")
      .def(torch::init<std::string, std::string, int64_t, double, std::string, bool, bool, int64_t,
                       double>())
      .def("info", &Layer::info)
      .def("weights_changed", &Layer::weightsChanged)
      .def("write_trace", &Layer::writeTrace)
      .def("capacity_need", &Layer::capacityNeed)
      .def("layer_record", &Layer::layerRecord)
      .def("capacity_advice", &Layer::capacityAdvice)
      .def("agree", &Layer::agree)
      .def("times", &Layer::times)
      .def("profile", &Layer::profile)
      .def("workspace", &Layer::workspace)
      .def("submit_forward", &Layer::submitForward)
      .def("submit_backward", &Layer::submitBackward)
      .def("wait_forward", &Layer::waitForward)
      .def("wait_backward", &Layer::waitBackward)
      .def("discard", &Layer::discard)
      .def("ready", &Layer::ready)
      .def("pending", &Layer::pending);
  m.class_<Exchange>("Exchange")
      .def(torch::init<std::string, std::string, int64_t, double, std::string, int64_t, double>())
      .def("info", &Exchange::info)
      .def("dispatch", &Exchange::dispatch)
      .def("combine", &Exchange::combine)
      .def("dispatch_backward", &Exchange::dispatchBackward)
      .def("combine_backward", &Exchange::combineBackward)
      .def("times", &Exchange::times);
  m.def("forward(__torch__.torch.classes.moec.Layer layer, Tensor x, Tensor topk_ids, "
        "Tensor topk_weights, Tensor w1, Tensor w2, Tensor[] adapters) -> (Tensor, int)",
        forwardOp);
  m.def("backward(__torch__.torch.classes.moec.Layer layer, int step, Tensor x, "
        "Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2, Tensor dy, "
        "Tensor? main_grad1, Tensor? main_grad2, Tensor[] adapters) -> "
        "(Tensor, Tensor, Tensor?, Tensor?, Tensor[])",
        backwardOp);
  m.def("finalize_mpi() -> ()", finalizeMpiOp);
  m.def("close_groups(float seconds) -> ()", closeGroupsOp);
  m.def("safetensors_read_header(int fd, int file_bytes) -> str", safetensorsReadHeaderOp);
  m.def("safetensors_parse_header(Tensor header, int data_bytes) -> str", safetensorsParseHeaderOp);
  m.def("quantize_fp8_blocks(Tensor w) -> (Tensor, Tensor)", quantizeFp8BlocksOp);
}
