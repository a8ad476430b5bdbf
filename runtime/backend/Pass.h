//===- Pass.h - The backend seam: one pass of a layer binary ----*- C++ -*-===//
//
// The runtime API (runtime/api) checks bindings and routing, then drives one
// pass (forward or backward) of a layer binary through this interface, in
// this order:
//
//   allocate        the workspace at the pass's first run; reused after
//   bindSlot        points the weight, gradient and saved-activation slots
//                   at the caller's tensors (or the forward pass's slots)
//   fillLayout      the routing layout tensors, from every rank's counts
//   gatherSendRows  each local rank's rows to send (x, or topk_weight * dy)
//   runTasks        the task program: every rank's queues, events and puts
//   combine         the returned rows reduced into y (or dx)
//   topkWeightGrad  dtopk_weights (backward)
//
// Two backends implement it: the CPU (runtime/cpu/Pass.h; the golden model
// of the schedule, ranks as threads or as processes under a fabric) and
// CUDA (runtime/cuda/Pass.h; every rank of the group on one GPU, the task
// program as one persistent kernel). Tensors the caller binds are host
// memory for the CPU backend; the CUDA backend takes host or device memory
// (runtime/cuda/Pass.h says how).
//
// The routing layout (counts, offsets, the sorted order) is computed on the
// host for every backend (runtime/layer/Routing.h); what a backend does with
// it is its own.
//
// No MLIR/LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_BACKEND_PASS_H
#define MOEC_RUNTIME_BACKEND_PASS_H

#include "base/Status.h"
#include "base/Time.h"
#include "format/TaskBinary.h"
#include "runtime/backend/Kind.h"
#include "runtime/backend/ScaleRule.h"
#include "runtime/comm/Fabric.h"
#include "runtime/layer/Layer.h"
#include "runtime/layer/Routing.h"
#include "runtime/trace/Trace.h"

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace moec::backend {

/// A rank's routing, checked and laid out. For a rank another process runs,
/// only tokens, topK, layout.counts and layout.offsets are known.
struct RankRoute {
  int64_t tokens = 0, topK = 0;
  rt::RoutingLayout layout;
  std::vector<float> weights; ///< topk_weights [S, K], a copy (local ranks)
};

/// The memory behind one workspace slot of a pass, over the local ranks.
struct SlotMemory {
  uint32_t slot = 0;
  uint64_t bytes = 0;    ///< allocated (at the slot's capacity)
  uint64_t resident = 0; ///< of those, in memory now (0 when borrowed: the lender's pages)
  bool window = false;   ///< peers put into it
  bool borrowed = false; ///< lives in another pass's dead slot (borrowFrom)
  /// Written over this slot's memory (sumsOverAddends), none of its own; 0
  /// bytes of its own.
  uint32_t over = rt::kNoSlot;
  bool layout = false;   ///< a routing layout tensor
};

/// How a pass runs.
struct PassOptions {
  uint32_t workers = 1;       ///< worker threads (CPU)
  double timeoutSeconds = kDefaultTimeoutSeconds; ///< watchdog; <= 0 turns it off
  bool trace = false;         ///< record every task run (CPU)
  bool opByOp = false;        ///< one op at a time, a barrier between ops (CPU)
  /// Keep the weights the GMMs read (w1, w2, the LoRA adapters) packed in
  /// the tile's layout, each packed by the first tile that reads it and
  /// again only after weightChanged() or when another tensor is bound
  /// (the same bits; on the cuda backend, quantized weights kept decoded).
  bool packWeights = false;
  std::shared_ptr<comm::Fabric> fabric; ///< the EP group (required)
};

/// A quantized weight's scales to check (Pass::findBadScales): `count`
/// floats at `scales`, (scale, zero point) pairs with `pairs`. The answer:
/// the index of the first bad one in `index` (-1 where none) and the float
/// in `value`.
struct ScaleCheck {
  const float *scales = nullptr;
  int64_t count = 0;
  bool pairs = false;
  int64_t index = -1;
  float value = 0;
};

/// One pass of a layer binary for the ranks of this process, on one backend.
class Pass {
public:
  virtual ~Pass() = default;

  virtual Kind kind() const = 0;
  virtual const format::TaskProgram &tasks() const = 0;
  virtual const rt::LayerPlan &plan() const = 0;

  /// Allocates the workspace if this is the pass's first run. Collective
  /// under a fabric of several processes.
  virtual Status allocate() = 0;
  /// Bytes of workspace allocated (what it borrows not counted).
  virtual size_t workspaceBytes() const = 0;
  /// Its workspace slot by slot, once allocated; empty where the backend
  /// does not itemize it.
  virtual std::vector<SlotMemory> workspace() const { return {}; }
  /// Before this (backward) pass's first allocate(): it may place its own
  /// workspace slots in the memory of `forward` (a pass of the same backend
  /// that is allocated, and never runs while this one does) that no later
  /// pass reads (LayerPlan::readByBackward). A backend may ignore it.
  virtual void borrowFrom(const Pass &forward) { (void)forward; }
  /// The bytes the pass takes at its first run: allocate()'s (0 once it
  /// has) and what its first run allocates (the cuda backend's decoded
  /// weights).
  virtual uint64_t workspaceNeeded() const = 0;
  /// The host changed the weight bound to slot `slot` in place
  /// (PassOptions::packWeights): what was packed of it is stale, and the
  /// next run packs it again.
  virtual void weightChanged(uint32_t slot) { (void)slot; }
  /// Bytes held by the packed copies of the weights (PassOptions::packWeights).
  virtual size_t packedWeightBytes() const { return 0; }
  /// For each check, where its quantized weight's scales first hold a
  /// scale that is not a finite positive number or a zero point outside
  /// 0..15 (goodScale). Read in host memory here; a backend whose tensors
  /// can live elsewhere reads them there, all checks in one go.
  virtual Status findBadScales(std::vector<ScaleCheck> &checks) const;

  /// The memory of slot `slot` of local rank `rank` (null before allocate(),
  /// or for a slot the caller binds). The backend's own memory: a backward
  /// pass of the same backend binds it (the activations it saves).
  virtual void *slot(uint32_t rank, uint32_t slot) const = 0;
  /// Points slot `slot` of local rank `rank` at `memory`: a caller's tensor,
  /// or a slot of the forward pass of the same backend.
  virtual void bindSlot(uint32_t rank, uint32_t slot, void *memory) = 0;

  /// Fills the layout tensors of the local ranks from `routes` (all ranks).
  virtual Status fillLayout(const std::vector<RankRoute> &routes) = 0;
  /// Gathers each local rank's rows to send, in expert-major order, from
  /// `source[rank]` ([S, H] activations): x, or with `weighted` dy times the
  /// rank's top-k weights.
  virtual Status gatherSendRows(const std::vector<RankRoute> &routes,
                                const std::vector<const void *> &source, bool weighted) = 0;
  /// Runs the task program on the local ranks.
  virtual Status runTasks() = 0;
  /// The share of the task runs of runTasks() done (0..1), from any thread.
  virtual double tasksShare() const = 0;
  /// Reduces each local rank's returned rows into `out[rank]` ([S, H]),
  /// weighted by the top-k weights when `weighted` (forward: y; backward:
  /// dx).
  virtual Status combine(const std::vector<RankRoute> &routes, const std::vector<void *> &out,
                         bool weighted) = 0;
  /// dtopk_weights[t, k] = <dy[t], Z row of (t, k)> for each local rank, with
  /// Z the rows `forward` (the forward pass, same backend) returned.
  virtual Status topkWeightGrad(const Pass &forward, const std::vector<RankRoute> &routes,
                                const std::vector<const void *> &dy,
                                const std::vector<float *> &out) = 0;

  /// Wall time of the last runTasks(), in seconds.
  virtual double tasksSeconds() const = 0;
  /// With PassOptions::trace: the tasks and waits of the last runTasks(), in
  /// nanoseconds from tasksStarted(). Empty where the backend records none.
  virtual const trace::Trace &tasksTrace() const = 0;
  /// When the last runTasks() started.
  virtual std::chrono::steady_clock::time_point tasksStarted() const = 0;
};

/// Elements of a slot at its capacity (a dynamic slot at capacityRows).
uint64_t slotElements(const format::SlotRecord &slot);

/// Rows of dim 0 of a slot at its capacity.
int64_t slotRows(const format::SlotRecord &slot);

/// The copies of slot `slot` a rank holds: T for the returned rows of a
/// combine that reduces over TP (one block of partial sums per TP rank,
/// slotRows() rows apart), else 1.
uint32_t slotCopies(const format::TaskProgram &program, uint32_t slot);

/// Fills `check`'s answer reading its scales in host memory (goodScale).
void findBadScaleOnHost(ScaleCheck &check);

/// The addend of an activation-form GMM (its fourth input, unless B is
/// quantized: then that is B's scales), or rt::kNoSlot for any other op.
uint32_t addendSlot(const format::TaskProgram &program, const format::OpRecord &op);

/// The scales of an activation-form GMM's quantized B (its fourth input),
/// or rt::kNoSlot for any other op.
uint32_t weightScalesSlot(const format::TaskProgram &program, const format::OpRecord &op);

/// Per slot of `program`: the slot whose memory it takes, or rt::kNoSlot.
/// The output of an activation-form product, C = addend + scale * A op(B)
/// (a LoRA adapter's second product, onto the base's output), is written
/// over its addend, in place, where the addend is a workspace slot that no
/// other op reads and no later pass needs (not bound by the caller, not a
/// routing layout tensor, not a put's window, not read by a backward) and
/// the output is a workspace slot of the same bytes: the sums go onto the
/// base's output where it lies, and the pass holds one tensor, not two.
std::vector<uint32_t> sumsOverAddends(const format::TaskProgram &program, const rt::LayerPlan &plan,
                                      size_t (*bytes)(const format::SlotRecord &));

/// The workspace of `ranks` ranks: `bytes` of every slot the caller does
/// not bind (LayerPlan::boundSlots), times its slotCopies(), per rank; with
/// `sharing` (sumsOverAddends), not those that take another's memory.
uint64_t workspaceBytes(const format::TaskProgram &program, const rt::LayerPlan &plan,
                        uint32_t ranks, size_t (*bytes)(const format::SlotRecord &),
                        const std::vector<uint32_t> *sharing = nullptr);

/// Writes the routing layout tensors (runtime/layer/Layer.h: size_d,
/// src_offset, target_offset, their combine twins, glist) of ranks
/// [firstRank, endRank) from every rank's routing, into the host memory
/// `memory(rank, slot)` returns. A slot the program lacks is skipped.
void fillLayoutTensors(const format::TaskProgram &program, const rt::LayerPlan &plan,
                       const std::vector<RankRoute> &routes, uint32_t firstRank, uint32_t endRank,
                       const std::function<void *(uint32_t rank, uint32_t slot)> &memory);

/// Where each source EP rank's rows start in each local expert's segment on
/// EP rank `epRank`, from every rank's routing: entry e * (R + 1) + q for
/// q = 0..R (entry R: the segment's size). Tiles with peer groups take
/// their rows from these (format::peerGroupRows()).
std::vector<int64_t> segmentSourceStarts(const format::TaskProgram &program,
                                         const rt::LayerPlan &plan,
                                         const std::vector<RankRoute> &routes, uint32_t epRank);

/// The bytes of rows every rank's puts (the program's dispatch and combine
/// ops) write into the windows of rank `rank` in one pass of `program`,
/// from the routing of every rank: [peer] (the entry of `rank` itself is its
/// own local copy). For reports of a pass that did not end.
std::vector<uint64_t> expectedPutBytes(const format::TaskProgram &program,
                                       const rt::LayerPlan &plan,
                                       const std::vector<RankRoute> &routes, uint32_t rank);

/// The bytes of rows a pass's puts move between different ranks, over the
/// whole group: by the dispatch and by the combine (a rank's rows for its
/// own experts stay in its memory and are not counted). FP8 dispatch rows
/// count at their quantized width, codes and scales.
struct PutBytes {
  uint64_t dispatch = 0, combine = 0;
};
PutBytes groupPutBytes(const format::TaskProgram &program, const rt::LayerPlan &plan,
                       const std::vector<RankRoute> &routes);

} // namespace moec::backend

#endif // MOEC_RUNTIME_BACKEND_PASS_H
