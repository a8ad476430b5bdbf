/*===- Runtime.h - The moec runtime: C++ API, on the C one ------*- C++ -*-===//
 *
 * The runtime runs compiled task binaries of the MoE-FFN layer (forward and
 * backward) for an EP group of R ranks, on a backend (the CPU's, or one
 * NVIDIA GPU's: moec_context_create_on): all R ranks inside one
 * process (the in-process fabric, the default), or one rank per process
 * under MPI (ContextOptions::fabric; runtime/comm/Mpi.h). This
 * header has the C++ API (namespace moec::rt) and includes the C API
 * (moec_runtime.h: the moec_* functions, a thin layer over the C++ one),
 * which a C program includes alone.
 *
 * A user:
 *
 *   1. loads a forward binary, and a backward one for training (Program);
 *   2. creates a Context for both: it owns the worker threads, the workspace
 *      (allocated at a pass's first run, sized by the binaries' capacities,
 *      reused after; it never shrinks) and what backward needs from forward;
 *   3. per step, for every rank r of the group: sets the routing (topk_ids
 *      [S, K] int32 or int64, topk_weights [S, K] f32) and binds the layer's
 *      tensors by name:
 *
 *        name            shape       dtype                   pass
 *        x               [S, H]      activations             forward (input)
 *        w1              [L, H, 2I]  activations             both    (input)
 *        w2              [L, I, H]   activations             both    (input)
 *        y               [S, H]      activations             forward (output)
 *        dy              [S, H]      activations             backward (input)
 *        dx              [S, H]      activations             backward (output)
 *        dtopk_weights   [S, K]      f32                     backward (output)
 *        dw1             [L, H, 2I]  weight-gradient dtype   backward (output)
 *        dw2             [L, I, H]   weight-gradient dtype   backward (output)
 *
 *      and, for binaries with LoRA adapters on the experts (base weights
 *      frozen, so no dw1/dw2; r the adapters' rank):
 *
 *        lora_a1         [L, H, r]   activations             both    (input)
 *        lora_b1         [L, r, 2I]  activations             both    (input)
 *        lora_a2         [L, I, r]   activations             both    (input)
 *        lora_b2         [L, r, H]   activations             both    (input)
 *        dlora_a1 .. dlora_b2  the same shapes, weight-gradient dtype,
 *                                                            backward (output)
 *
 *      (only the adapters the binaries have: on w1, on w2 or on both);
 *
 *      (L local experts of rank r: global experts r*L .. r*L+L-1; H, I and
 *      the dtypes come from the binary; S may be anything up to the binary's
 *      capacity, the same on every rank);
 *   4. runs forward, then (optionally) backward, synchronously or with
 *      submit/wait.
 *
 * Tensors are dense, row-major, and owned by the caller; the context keeps
 * only pointers, which must stay valid until the pass that uses them returns
 * (for moec_submit_*, until moec_wait returns), and whose contents must not
 * change meanwhile: a pass reads its inputs while it runs, so a caller that
 * refills x or a weight before the pass returns gets a result of old and new
 * values mixed. An output (y; dx, dtopk_weights, dw1, dw2, the adapters'
 * gradients) must have memory of its own: a pass refuses, before it writes
 * anything, an output that overlaps an input or another output of any rank
 * this process runs, naming both tensors. There is no in-place form.
 *
 * Ownership: moec_program_load and moec_context_create* hand the caller a
 * handle that the caller frees exactly once, with moec_program_free or
 * moec_context_free (null is accepted and does nothing). A freed handle is
 * gone: freeing it again, or passing it to any call, is undefined (as for
 * free()); set the pointer to null after freeing. A context keeps its own
 * reference to its programs, so a program may be freed as soon as the
 * contexts that use it are created.
 *
 * A pass checks everything before it writes anything: bindings (shapes and
 * dtypes, named by rank and tensor), and the routing of all ranks (expert ids
 * in range, no expert twice in a token's top-k, and the capacities the
 * binary was compiled for). On such an error no output is touched. An error
 * inside a running pass (a watchdog timeout, a failing task) stops every
 * worker and is returned; outputs may then be partly written.
 *
 * Under MPI every rank checks its own routing and bindings, then the ranks
 * exchange what they found (and their per-expert row counts) before
 * anything is written, so a bad input on one rank stops every rank with that
 * rank's message. Every wait for a peer is bounded by the watchdog timeout.
 * After an error inside a running pass under MPI the context refuses further
 * passes (the peers' state is unknown); a tool ends the job (MPI_Abort).
 *
 * Errors: C++ calls return a moec::Status; C calls return a moec_status_t
 * (base/moec_status.h, the compiler library's too): MOEC_OK (NULL) on
 * success, else an error the caller frees with moec_status_free, whose
 * moec_status_code() is MOEC_OVER_CAPACITY for a routing over the binary's
 * capacity and MOEC_ERROR for anything else, and whose
 * moec_status_message() says what was wrong. After an over-capacity error,
 * Context::capacityNeed() (moec_capacity_need) says what the routing needs,
 * so a caller can compile a binary with more capacity and run the step again.
 *
 * No MLIR or LLVM dependency.
 *
 *===----------------------------------------------------------------------===*/

#ifndef MOEC_RUNTIME_API_RUNTIME_H
#define MOEC_RUNTIME_API_RUNTIME_H

#include "runtime/api/moec_runtime.h"

#ifdef __cplusplus

/*===----------------------------------------------------------------------===*
 * C++ API
 *===----------------------------------------------------------------------===*/

#include "base/DType.h"
#include "base/Status.h"
#include "base/Time.h"
#include "format/LayerShape.h"
#include "runtime/backend/Kind.h"

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

// What the API names but does not show: a program's tables (format/
// TaskBinary.h), the fabric (runtime/comm/Fabric.h), a pass's trace
// (runtime/trace/Trace.h). A caller that uses them includes those headers.
namespace moec::format {
using moec::DType; // as format/TaskBinary.h names it
struct TaskProgram;
struct LayerRecord;
} // namespace moec::format
namespace moec::comm {
class Fabric;
} // namespace moec::comm
namespace moec::trace {
struct Trace;
} // namespace moec::trace

namespace moec::rt {

/// A dense row-major tensor the caller owns (the C struct).
using Tensor = moec_tensor;

/// Returns a Tensor of `dtype` and `dims` over `data`.
Tensor makeTensor(void *data, format::DType dtype, std::initializer_list<int64_t> dims);
Tensor makeTensor(void *data, format::DType dtype, const std::vector<int64_t> &dims);

/// Returns "[2, 3, 4]".
std::string shapeString(const Tensor &tensor);

/// The sizes and capacities of a compiled layer (format/LayerShape.h).
using LayerShape = moec::LayerShape;

/// What a routing needs of a binary's capacities (LayerShape's rowCapacity,
/// receiveCapacity, expertCapacity, putCapacity), over every rank.
struct CapacityNeed {
  int64_t rowsPerRank = 0;    ///< most (token, k) rows one rank routes
  int64_t receivePerRank = 0; ///< most rows the experts of one rank receive
  int64_t rowsPerExpert = 0;  ///< most rows one expert receives
  int64_t putRows = 0;        ///< most rows one rank sends one expert
};

/// A loaded, validated task binary of a MoE-FFN forward or backward pass.
class Program {
public:
  /// Loads the binary at `path`, validates it, and checks that it is a
  /// forward or backward MoE-FFN layer the runtime can run (op structure,
  /// tensor shapes and tilings that fit them). Errors start with the path.
  static Status load(const std::string &path, std::shared_ptr<const Program> *out);

  /// As load(), for a program already in memory (e.g. fresh from the
  /// compiler).
  static Status create(format::TaskProgram program, std::shared_ptr<const Program> *out);

  /// The file it was loaded from, or "a program in memory".
  const std::string &source() const;
  /// The CRC-32 of the program as a task binary: ranks compare it to check
  /// that they run the same program.
  uint32_t checksum() const;

  ~Program();
  Program(const Program &) = delete;
  Program &operator=(const Program &) = delete;

  /// The task tables.
  const format::TaskProgram &tasks() const;
  /// Sizes and capacities.
  const LayerShape &shape() const;

  struct Impl;
  /// The runtime's view of the program (internal).
  const Impl &impl() const { return *body; }

private:
  explicit Program(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> body;
};

/// How a context runs its passes.
enum class Schedule {
  Fused,  ///< the binary's queues and events: tiles of different ops overlap
  OpByOp, ///< the same tasks on the same queues, one op at a time, with a
          ///< barrier over all ranks between ops (a baseline)
};

/// Options of a context.
struct ContextOptions {
  uint32_t workers = 0;         ///< worker threads; 0: the hardware threads
  double timeoutSeconds =
      kDefaultTimeoutSeconds;   ///< watchdog, 0.001 to 10^6 s (base/Time.h); 0: the default
  bool trace = false;           ///< record every task run (writeTrace)
  Schedule schedule = Schedule::Fused;
  /// Where the passes run: the CPU (the default), or one NVIDIA GPU
  /// (docs/runtime.md: every rank of the group in this process).
  backend::Kind backend = backend::Kind::Cpu;
  /// The EP group's fabric (runtime/comm): null runs all R ranks in this
  /// process (the in-process fabric); an MPI fabric (runtime/comm/Mpi.h)
  /// runs one rank per process. Under MPI, creating a context, forward()
  /// and backward() are collective: every rank calls them in the same order.
  std::shared_ptr<comm::Fabric> fabric;
  /// Keep the weights the passes' matmuls read (w1, w2 and the LoRA
  /// adapters, in the compute dtype) packed in the tile's layout, each packed
  /// by the first tile that reads it, and again only when another tensor is
  /// bound or after weightChanged(): the same bits as packing them in every
  /// tile, for the memory of a copy of each (CPU, where moec's tile runs the
  /// product; docs/runtime.md says which weights a run packs; on the cuda
  /// backend, quantized weights kept decoded, one copy for both passes).
  /// With it, a quantized weight's scales found good are not checked again
  /// until weightChanged() names their weight or another tensor is bound.
  /// A host that writes a bound weight in place must call weightChanged()
  /// before the next pass.
  bool packWeights = false;
  /// With packWeights: whether the backward pass keeps its weights packed
  /// too. Its dX products read each weight transposed, which on AMX tiles
  /// is a second packed form of it (about half of a packed layer's bytes);
  /// false keeps the forward's only, the backward's products reading the
  /// weights as stored (docs/runtime.md#packed-weights: what it costs).
  bool packBackward = true;
};

/// Which pass Context::writeTrace writes.
enum class TracedPass { Last, Forward, Backward };

/// Wall times of the last pass, in seconds.
struct PassTimes {
  double prepare = 0; ///< checks, routing layout, gathering rows to send
  double checks = 0;  ///< of prepare: the checks, the routing's layout and the ranks' agreement
  double tasks = 0;   ///< the task program on all ranks
  double finish = 0;  ///< combine-reduce (and dtopk_weights)
  /// Bytes of rows the pass's puts moved between different ranks, over the
  /// whole group (backend::groupPutBytes): by the dispatch, by the combine.
  uint64_t dispatchBytes = 0, combineBytes = 0;
  double total() const { return prepare + tasks + finish; }
};

/// One workspace slot of a pass, over the ranks of this process
/// (Context::workspace).
struct WorkspaceSlot {
  const char *pass = "";  ///< "forward" or "backward"
  std::string name;       ///< the slot's tensor
  uint64_t bytes = 0;     ///< allocated, at the slot's capacity
  uint64_t resident = 0;  ///< of those, in memory now (0 when borrowed)
  bool window = false;    ///< peers put into it
  bool borrowed = false;  ///< in a dead slot of the forward pass: no memory of its own
  /// The tensor whose memory it takes, written over it (a LoRA product's
  /// sums onto its addend, the base's output): no memory of its own; else
  /// empty.
  std::string over;
  bool layout = false;    ///< a routing layout tensor (sizes and offsets)
};

/// The runtime state of an EP group: bindings, routing, workspace, threads.
/// Not thread-safe: one caller at a time.
class Context {
public:
  /// Creates a context for `forward` (required) and `backward` (may be
  /// null); the two must describe the same layer (ranks, experts, sizes,
  /// dtypes, capacities).
  static Status create(std::shared_ptr<const Program> forward,
                       std::shared_ptr<const Program> backward, const ContextOptions &options,
                       std::unique_ptr<Context> *out);

  ~Context();
  Context(const Context &) = delete;
  Context &operator=(const Context &) = delete;

  /// The forward program's shape.
  const LayerShape &shape() const;
  /// The backward program's shape, or null without a backward program.
  const LayerShape *backwardShape() const;
  /// The forward program's layer record: the config it was compiled from
  /// (the backward's was checked to be the same layer).
  const format::LayerRecord &layerRecord() const;
  /// Ranks of the group.
  uint32_t ranks() const;
  /// Worker threads.
  uint32_t workers() const;
  /// The watchdog's timeout in seconds (the options' or, for 0, the default).
  double timeoutSeconds() const;
  /// The ranks this process runs (setRouting and bind take only these):
  /// firstLocalRank() .. firstLocalRank() + localRanks() - 1. All R ranks
  /// with the in-process fabric; one under MPI.
  uint32_t firstLocalRank() const;
  uint32_t localRanks() const;
  /// The fabric.
  comm::Fabric &fabric() const;
  /// True once an error left the ranks out of step (a fabric of several
  /// processes: a pass that stopped, an exchange that timed out): no
  /// further pass runs, and the job should stop (Fabric::stopJob).
  bool outOfStep() const;

  /// Sets `rank`'s routing (see the C API). Checks shapes and dtypes now;
  /// the ids are read, and checked, when a pass runs.
  Status setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights);

  /// Binds `rank`'s tensor `name` (x, w1, w2, y, dy, dx, dtopk_weights, dw1,
  /// dw2, and the LoRA adapters lora_a1 .. dlora_b2). Checks the dtype and
  /// the dims that do not depend on S now.
  Status bind(uint32_t rank, std::string_view name, const Tensor &tensor);

  /// Runs the forward pass on every rank: y = the layer of x.
  Status forward();
  /// Runs the backward pass on every rank, from dy and what the last
  /// forward pass saved: dx, dtopk_weights, dw1, dw2.
  Status backward();

  /// Starts forward() / backward() on a thread of the context; wait()
  /// returns its Status. Other calls that return a Status fail while a pass
  /// is in flight; the accessors below (times, workspace bytes) must not be
  /// called then.
  Status submitForward();
  Status submitBackward();
  Status wait();

  /// What the last forward pass's routing needed (all ranks), set once its
  /// routing was checked: after it ran, and after it was refused with
  /// StatusCode::OverCapacity, before anything was written.
  const CapacityNeed &capacityNeed() const;

  /// Times of the last forward / backward pass.
  const PassTimes &forwardTimes() const;
  const PassTimes &backwardTimes() const;

  /// Bytes of workspace allocated now.
  size_t workspaceBytes() const;
  /// The workspace allocated now, slot by slot (empty for a backend that
  /// does not itemize it).
  std::vector<WorkspaceSlot> workspace() const;
  /// Bytes the kernels' scratch holds now (fp32 blocks of bf16 matmuls).
  size_t scratchBytes() const;
  /// Bytes of the packed weights (ContextOptions::packWeights) now.
  size_t packedWeightBytes() const;
  /// Says that the bound weight `name` (w1, w2, lora_a1, lora_b1, lora_a2 or
  /// lora_b2; for a quantized w1 or w2, its codes or its scales), on every
  /// local rank, was written in place: the passes pack it again at their
  /// next run (ContextOptions::packWeights; nothing without it). Not while a
  /// pass is in flight.
  Status weightChanged(std::string_view name);
  /// Bytes of workspace the passes not run yet will allocate at their first
  /// run (so a caller can check the machine's memory before).
  size_t workspaceToAllocate() const;

  /// How far the pass in flight is: 0 before its task program starts, the
  /// share of its task runs done while it runs, 1 after. Callable from any
  /// thread (a progress display) while forward() or backward() runs; 1
  /// when none does.
  double passShare() const;
  /// Forward and backward passes that have ended (with or without an
  /// error) since the context was created; callable from any thread.
  uint64_t passesEnded() const;

  /// Writes the trace (ContextOptions::trace) of the last pass, or of the
  /// last forward or backward pass, as Chrome / Perfetto JSON: the timed
  /// pass itself, its tasks with their tiles, the waits of parked cores
  /// with the signal that ended each (a flow arrow), and the host phases
  /// prepare, tasks and finish (runtime/trace/Trace.h has the format).
  Status writeTrace(const std::string &path, TracedPass which = TracedPass::Last) const;

  /// The trace writeTrace writes (empty before such a pass, or with
  /// tracing off), in nanoseconds from the pass's start.
  const trace::Trace &trace(TracedPass which = TracedPass::Last) const;
  /// The program of the forward or backward pass (TracedPass::Last: the
  /// last pass run); null for a backward the context has none of.
  std::shared_ptr<const Program> program(TracedPass which = TracedPass::Last) const;
  /// The routing of the last forward pass: the rows rank `rank`'s tokens
  /// sent each expert ([E]; every rank's, under any fabric). Empty before a
  /// forward pass.
  const std::vector<int64_t> &routedRows(uint32_t rank) const;

  struct Impl;

private:
  explicit Context(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> body;
};

/// The communication half of the layer alone, for callers that bring their
/// own expert computation (Megatron's FusedDispatch / FusedCombine, DeepEP's
/// dispatch and combine): a dispatch program (a graph of one dispatch op,
/// graphs/moe_dispatch.json) and a combine program (graphs/moe_combine.json)
/// on the same runtime and fabric as the fused layer.
///
/// Per step: setRouting() on every local rank, route() (checks and lays out
/// the routing of every rank; collective), then
///
///   dispatch(x, expertX)        the (token, k) rows of x to the ranks of
///                               their experts: rank r's expertX holds
///                               receivedRows(r) rows grouped by local expert
///                               (expertRows(r)), as the fused layer's X
///   combine(expertY, y)         those rows back: y[t] = sum_k w[t,k] ·
///                               row(t,k) (unweighted: the sum)
///   topkWeightGrad(dy, dtopk)   dtopk[t,k] = <dy[t], row(t,k)> of the rows
///                               the last combine returned
///
/// A dispatch's backward is an unweighted combine of the gradient rows; a
/// combine's backward is a weighted dispatch of dy, and topkWeightGrad.
/// Every call takes one tensor per local rank (index 0 is firstLocalRank())
/// and checks every shape on every rank before anything is written.
class Exchange {
public:
  /// Creates the exchange of `dispatch` and `combine` (the two halves of
  /// one layer: same ranks, experts, H, dtype and capacities).
  static Status create(std::shared_ptr<const Program> dispatch,
                       std::shared_ptr<const Program> combine, const ContextOptions &options,
                       std::unique_ptr<Exchange> *out);
  ~Exchange();
  Exchange(const Exchange &) = delete;
  Exchange &operator=(const Exchange &) = delete;

  /// Sizes and capacities (inter is 0).
  const LayerShape &shape() const;
  uint32_t ranks() const;
  uint32_t firstLocalRank() const;
  uint32_t localRanks() const;
  /// Sets `rank`'s routing, as Context::setRouting.
  Status setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights);
  /// Checks the routing of every rank (ids, capacities; the same error on
  /// every rank) and lays it out for the calls below. Collective.
  Status route();
  /// After route(): the rows local rank `rank`'s experts receive, in all
  /// and per local expert.
  int64_t receivedRows(uint32_t rank) const;
  const std::vector<int64_t> &expertRows(uint32_t rank) const;
  /// What the last route() needed of the capacities (all ranks).
  const CapacityNeed &capacityNeed() const;
  /// x[i]: [S, H] of local rank firstLocalRank() + i; expertX[i]:
  /// [receivedRows, H]. With `weighted`, each row is times its top-k weight.
  Status dispatch(const std::vector<Tensor> &x, const std::vector<Tensor> &expertX,
                  bool weighted);
  /// expertY[i]: [receivedRows, H]; y[i]: [S, H].
  Status combine(const std::vector<Tensor> &expertY, const std::vector<Tensor> &y,
                 bool weighted);
  /// dy[i]: [S, H]; dtopk[i]: [S, K] f32; from the rows the last combine
  /// returned (after the same route()).
  Status topkWeightGrad(const std::vector<Tensor> &dy, const std::vector<Tensor> &dtopk);
  /// Seconds of the last dispatch and combine (the task programs alone).
  double dispatchSeconds() const;
  double combineSeconds() const;

  struct Impl;

private:
  explicit Exchange(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> body;
};

} // namespace moec::rt

#endif /* __cplusplus */

#endif /* MOEC_RUNTIME_API_RUNTIME_H */
