//===- Pass.h - One pass of a layer binary on the CPU -----------*- C++ -*-===//
//
// The CPU backend's half of a pass (forward or backward), below the runtime
// API (runtime/api), which checks bindings and routing and calls these in
// order:
//
//   allocate      the workspace at the pass's first run: the slots peers put
//                 into are windows of the fabric (collective), the rest plain
//                 memory; reused after, never shrunk
//   fillLayout    the routing layout tensors of the local ranks, from the
//                 per-expert counts of every rank (exchanged by the API)
//   gatherSendRows  each local rank's rows to send (x, or topk_weight * dy)
//   runTasks      the executor runs the task program; runTile() maps each
//                 tile to a kernel of this folder, and a put's rows go to
//                 the peer through the fabric
//   combine       reduce the returned rows into y (or dx), and dtopk_weights
//
// Every loop that reduces has a fixed order, so results do not depend on the
// number of threads, nor on whether the ranks are threads or processes.
//
// No MLIR/LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CPU_PASS_H
#define MOEC_RUNTIME_CPU_PASS_H

#include "base/Memory.h"
#include "base/Status.h"
#include "runtime/backend/Pass.h"
#include "runtime/comm/Fabric.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Quant.h"
#include "runtime/layer/Routing.h"
#include "runtime/exec/Executor.h"
#include "runtime/exec/ThreadTeam.h"
#include "runtime/layer/Layer.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <vector>

namespace moec::cpu {

using backend::PassOptions;
using backend::RankRoute;

/// One pass of a layer binary for the ranks of this process.
class Pass final : public backend::Pass {
public:
  /// Creates the pass of `program` (whose roles are `plan`; both must outlive
  /// the pass) with its executors. `scratch` holds one Scratch per worker and
  /// is shared with the context's other pass (they never run at once).
  /// Collective under a fabric of several processes (each executor's inbox).
  static Status create(const format::TaskProgram &program, const rt::LayerPlan &plan,
                       const PassOptions &options, std::vector<Scratch> *scratch,
                       std::unique_ptr<Pass> *out);
  ~Pass() override;

  backend::Kind kind() const override { return backend::Kind::Cpu; }

  const format::TaskProgram &tasks() const override { return *program; }
  const rt::LayerPlan &plan() const override { return *layer; }

  /// Allocates the workspace if this is the pass's first run. Collective.
  Status allocate() override;
  /// Bytes of workspace allocated (what it borrows not counted).
  size_t workspaceBytes() const override { return ownedBytes; }
  /// Lets this backward pass place its plain workspace slots in `forward`'s
  /// dead ones (the send rows, the down projection's output) where they fit.
  void borrowFrom(const backend::Pass &forward) override;
  /// Its workspace slot by slot (resident pages counted now).
  std::vector<backend::SlotMemory> workspace() const override;

  /// The memory of slot `slot` of local rank `rank` (null before allocate(),
  /// or for a slot the caller binds).
  void *slot(uint32_t rank, uint32_t slot) const override { return data[rank][slot]; }
  /// Points slot `slot` of local rank `rank` at the caller's memory.
  void bindSlot(uint32_t rank, uint32_t slot, void *memory) override { data[rank][slot] = memory; }

  /// Fills the layout tensors of the local ranks from `routes` (all ranks).
  Status fillLayout(const std::vector<RankRoute> &routes) override;

  /// Gathers each local rank's rows to send, in expert-major order, from
  /// `source[rank]` ([S, H] activations): x, or with `weighted` dy times the
  /// rank's top-k weights.
  Status gatherSendRows(const std::vector<RankRoute> &routes,
                        const std::vector<const void *> &source, bool weighted) override;

  /// Runs the task program on the local ranks.
  Status runTasks() override;
  /// The share of the task runs of runTasks() done (0..1): callable from any
  /// thread while it runs, for a progress display.
  double tasksShare() const override;
  /// The bytes allocate() takes (0 once it has).
  uint64_t workspaceNeeded() const override;
  void weightChanged(uint32_t slot) override {
    if (slot < slotGeneration.size())
      ++slotGeneration[slot];
  }
  size_t packedWeightBytes() const override {
    return packedBytes.load(std::memory_order_relaxed);
  }

  /// Reduces each local rank's returned rows into `out[rank]` ([S, H]),
  /// weighted by the top-k weights when `weighted` (forward: y; backward:
  /// dx).
  Status combine(const std::vector<RankRoute> &routes, const std::vector<void *> &out,
                 bool weighted) override;

  /// dtopk_weights[t, k] = <dy[t], Z row of (t, k)> for each local rank, with
  /// Z the rows `forward` (the forward pass) returned.
  Status topkWeightGrad(const backend::Pass &forward, const std::vector<RankRoute> &routes,
                        const std::vector<const void *> &dy,
                        const std::vector<float *> &out) override;

  /// Wall time of the last runTasks(), in seconds.
  double tasksSeconds() const override { return taskTime; }

  /// The executor of the last run, or null.
  const exec::Executor *lastExecutor() const { return last; }

  /// With PassOptions::trace: the tasks and waits of the last runTasks()
  /// (every executor's, op by op), in nanoseconds from tasksStarted().
  const trace::Trace &tasksTrace() const override { return taskSpans; }
  /// When the last runTasks() started.
  std::chrono::steady_clock::time_point tasksStarted() const override { return tasksStart; }

private:
  Pass() = default;
  struct OpInfo;
  Status runTile(uint32_t rank, uint32_t task, uint32_t worker);
  /// `expert`'s quantized weight B of op `opIndex` as stored (its codes and
  /// scales).
  QuantizedMatrix quantizedWeight(uint32_t opIndex, uint32_t rank, uint32_t expert) const;
  /// Dequantizes the part of `expert`'s quantized weight B that columns
  /// `cols` of its GMM read into weightScratch[worker], and returns it:
  /// [n, K] for a transposed B, else [K, n] (n the columns).
  const void *dequantizeWeightTile(uint32_t opIndex, uint32_t rank, uint32_t expert,
                                   Range cols, DType elt, uint32_t worker);
  /// The packed-weight store (PassOptions::packWeights): per GMM whose B is
  /// a weight and that runs on moec's tile, per local rank, expert and
  /// column tile, op(B)'s columns of the tile packed whole
  /// (tile::packB). The first tile that reads a cell packs it; tiles that
  /// find it being packed read B as it is (the same bits), so none waits.
  /// A run packs a weight that is unchanged since the pass's last run, or
  /// that several tiles read (preparePackedWeights says why).
  struct PackedWeight;
  /// Before a run: drops what was packed from memory no longer bound, or
  /// before weightChanged() of its slot.
  void preparePackedWeights();
  /// The packed op(B) of `tile` (B the expert's weight `b`, depth `depth`),
  /// packing it now if nobody has; null when the op keeps no packed copies,
  /// another tile is packing it, or the process's store has no room for it
  /// (MOEC_PACKED_MIB, or no memory).
  const void *packedWeight(uint32_t opIndex, uint32_t rank, const format::TileCoord &tile,
                           ConstMatrix b, int64_t depth);
  Status runPut(const OpInfo &op, uint32_t opIndex, uint32_t rank, const format::TileCoord &tile,
                bool combine);

  const format::TaskProgram *program = nullptr;
  const rt::LayerPlan *layer = nullptr;
  PassOptions options;
  std::vector<Scratch> *scratch = nullptr;
  /// Per worker: the dequantized part of an FP8 weight a tile reads.
  std::unique_ptr<Scratch[]> weightScratch;
  /// Per worker: the rows of U a lead product's host tile past its row's
  /// first column tile computes for itself (format::leadOp).
  std::unique_ptr<Scratch[]> leadScratch;
  std::shared_ptr<exec::ThreadTeam> team; ///< the process's: the workers and the other loops
  std::vector<OpInfo> ops;
  /// A local rank's cells of an op (expert-major, then column tile), the
  /// memory they were packed from, and whether this run packs and reads them.
  struct PackedRank {
    std::unique_ptr<PackedWeight[]> cells;
    const void *from = nullptr;
    const void *fromScales = nullptr; ///< a quantized weight's scales (its cells hold them)
    bool now = false;
  };
  /// An op's store: per rank, and the generation of its B slot it holds.
  struct PackedOp {
    std::vector<PackedRank> ranks;
    uint64_t generation = 0;
  };
  std::vector<PackedOp> packed;        ///< per op (empty unless packable)
  std::vector<uint64_t> slotGeneration; ///< per slot: its weightChanged calls
  std::atomic<size_t> packedBytes{0};
  std::vector<std::vector<void *>> data; ///< [rank][slot]
  /// Per rank: the rows to send this pass (tokens * top-k), set by
  /// gatherSendRows; a quantize tile clips its rows to them.
  std::vector<int64_t> sendRows;
  /// Per rank: where each source rank's rows start in each local expert's
  /// segment (backend::segmentSourceStarts), set by fillLayout.
  std::vector<std::vector<int64_t>> sourceStarts;
  std::vector<ZeroedPages> owned;
  std::vector<std::unique_ptr<comm::Window>> windows;
  std::vector<const comm::Window *> windowOf; ///< per slot: its window, or null
  size_t ownedBytes = 0;
  const Pass *lender = nullptr; ///< see borrowFrom
  std::vector<backend::SlotMemory> slotMemory; ///< per allocated slot (resident not set)
  /// Per slot: the slot whose memory it takes (backend::sumsOverAddends),
  /// or kNoSlot.
  std::vector<uint32_t> sharesWith;
  bool allocated = false;
  std::vector<std::unique_ptr<exec::Executor>> executors; ///< one, or one per op
  const exec::Executor *last = nullptr;
  std::atomic<size_t> step{0}; ///< the executor runTasks() runs now
  double taskTime = 0;
  trace::Trace taskSpans;
  std::chrono::steady_clock::time_point tasksStart;
};

} // namespace moec::cpu

#endif // MOEC_RUNTIME_CPU_PASS_H
