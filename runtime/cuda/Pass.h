//===- Pass.h - One pass of a layer binary on an NVIDIA GPU -----*- C++ -*-===//
//
// The CUDA backend (runtime/backend/Pass.h). Every rank of the EP group
// lives on the one GPU, as in-process ranks do on the CPU: each has its own
// copy of every slot in device memory, and a put from one rank to another is
// a copy between their regions, signalled by an atomic add on the peer's
// event counter. The task program runs as one persistent kernel
// (runtime/cuda/Device.h): logical cube and vector cores are thread blocks'
// queues, events are counters in device memory, a stuck event ends in the
// device watchdog's error naming the rank, core, task and event.
//
// Memory. Tensors bound as device memory are used in place (the activations
// the forward pass saves for backward, a framework's CUDA tensors). Tensors
// bound as host memory are staged: copied to the GPU before the task
// program, and the ones the program writes (weight gradients) copied back
// after it. x, dy, y, dx and dtopk_weights may be host or device memory too.
//
// Quantized weights (FP8 blocks, int8, int4) are decoded whole before the
// task program, into memory of the activations' type that the pass owns
// (a weight's values at 2 bytes each in bf16), and the tiles read them as
// dense weights: the decode once a pass, not once a tile that reads them.
// With the packed-weight store (PassOptions::packWeights) the decoded
// values are kept from pass to pass in a store the context's forward and
// backward passes share: each weight decoded by the first pass that reads
// it, and again only after weightChanged() or when another tensor is bound.
// MOEC_CUDA_DECODE=tiles decodes them in the tiles instead (no such memory).
//
// Limits: every rank must run in this process (no MPI fabric); no task
// trace and no op-by-op schedule (the CPU backend has both).
//
// Without the CUDA toolkit at build time the backend is still built, and
// create() says so.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_CUDA_PASS_H
#define MOEC_RUNTIME_CUDA_PASS_H

#include "runtime/backend/Pass.h"
#include "runtime/cuda/Device.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace moec::cuda {

/// The GPU the backend would run on: "NVIDIA H100 80GB HBM3, 132 SMs,
/// compute 9.0, driver 13.0", or the reason there is none.
Status describeDevice(std::string *out);

class Pass final : public backend::Pass {
public:
  /// Creates the pass of `program` (whose roles are `plan`; both must outlive
  /// the pass) and uploads its tables to the GPU.
  static Status create(const format::TaskProgram &program, const rt::LayerPlan &plan,
                       const backend::PassOptions &options, std::unique_ptr<Pass> *out);
  ~Pass() override;

  backend::Kind kind() const override { return backend::Kind::Cuda; }
  const format::TaskProgram &tasks() const override { return *program; }
  const rt::LayerPlan &plan() const override { return *layer; }
  Status allocate() override;
  void borrowFrom(const backend::Pass &forward) override;
  size_t workspaceBytes() const override { return ownedBytes; }
  uint64_t workspaceNeeded() const override;
  void *slot(uint32_t rank, uint32_t slot) const override { return data[rank][slot]; }
  void bindSlot(uint32_t rank, uint32_t slot, void *memory) override;
  Status findBadScales(std::vector<backend::ScaleCheck> &checks) const override;
  void weightChanged(uint32_t slot) override;
  size_t packedWeightBytes() const override;
  Status fillLayout(const std::vector<backend::RankRoute> &routes) override;
  Status gatherSendRows(const std::vector<backend::RankRoute> &routes,
                        const std::vector<const void *> &source, bool weighted) override;
  Status runTasks() override;
  double tasksShare() const override { return 0.0; }
  Status combine(const std::vector<backend::RankRoute> &routes, const std::vector<void *> &out,
                 bool weighted) override;
  Status topkWeightGrad(const backend::Pass &forward,
                        const std::vector<backend::RankRoute> &routes,
                        const std::vector<const void *> &dy,
                        const std::vector<float *> &out) override;
  double tasksSeconds() const override { return taskTime; }
  const trace::Trace &tasksTrace() const override { return noTrace; }
  std::chrono::steady_clock::time_point tasksStarted() const override { return tasksStart; }

private:
  Pass() = default;
  /// Device memory that is freed with the pass.
  struct Buffer {
    void *memory = nullptr;
    size_t bytes = 0;
  };
  /// A caller's host tensor bound to a slot, and its copy on the GPU.
  struct Staged {
    const void *host = nullptr;
    Buffer device;
    size_t bytes = 0;
    bool output = false; ///< the program writes it: copied back after the tasks
  };
  static Status grow(Buffer *buffer, size_t bytes);
  /// `memory` on the GPU: itself when it is device memory, else a copy of
  /// its `bytes` in `staging`.
  Status onDevice(const void *memory, size_t bytes, Buffer *staging, const void **out);
  /// Has `write` write `bytes` into `out` when it is device memory, else
  /// into `staging`, which is then copied to `out`.
  Status writeOut(void *out, size_t bytes, Buffer *staging,
                  const std::function<std::string(void *)> &write);

  const format::TaskProgram *program = nullptr;
  const rt::LayerPlan *layer = nullptr;
  backend::PassOptions options;
  std::vector<Buffer> owned;                ///< everything freed with the pass
  mutable Buffer scaleCheck;                ///< findBadScales' 8 bytes a check
  std::vector<std::vector<void *>> data;    ///< [rank][slot], device pointers
  std::vector<std::vector<Staged>> staged;  ///< [rank][slot]
  std::vector<bool> isOutput;               ///< per slot: an op writes it
  /// A quantized weight decoded whole before the tasks (the tiles read the
  /// decoded values as a dense weight): its slots, its form, and the
  /// decoded values of each rank, which follow the slots in the kernel's
  /// data table.
  struct Decode {
    uint32_t weight = 0, scales = 0;
    device::DecodeSpec spec;
    std::vector<Buffer> out; ///< per rank
  };
  std::vector<Decode> decodes;
  /// Makes GMM `d`, which reads quantized weight `w`, read its values
  /// decoded whole (one Decode a weight, shared by the GMMs that read it).
  void decodeWhole(const moec::LayerShape &shape, const format::SlotRecord &w, device::Op *d);
  /// The decoded values of `d` on rank `r` into *values: decoded now into
  /// the pass's memory, or with the packed-weight store, the store's copy,
  /// decoded again only when it is stale.
  Status decoded(Decode &d, uint32_t r, void **values);
  /// The caller's memory bound to slot `slot` of rank `r` (a host tensor's
  /// own address, not its staged copy).
  const void *boundTo(uint32_t r, uint32_t slot) const;
  /// The packed-weight store (PassOptions::packWeights): quantized weights
  /// decoded, by weight name, rank and form, with the tensors they were
  /// decoded from. A context's backward pass shares its forward pass's
  /// (borrowFrom). Frees its memory when the last pass holding it goes.
  struct Kept {
    std::string name; ///< the weight slot's
    uint32_t rank = 0;
    device::DecodeSpec spec;
    const void *codes = nullptr, *scales = nullptr; ///< decoded from
    Buffer out;
    bool fresh = false;
  };
  struct Store {
    std::vector<Kept> kept;
    size_t bytes = 0;
    ~Store();
    /// The entry of (name, rank, spec), made when there is none.
    Kept &at(const std::string &name, uint32_t rank, const device::DecodeSpec &spec);
    const Kept *find(const std::string &name, uint32_t rank, const device::DecodeSpec &spec) const;
  };
  std::shared_ptr<Store> store; ///< null without packWeights
  bool storeShared = false;     ///< borrowed from the forward pass (its bytes counted there)
  std::vector<std::vector<std::vector<uint8_t>>> layoutHost; ///< [rank][slot] layout tensors
  /// The routing on the GPU, per rank (grow-only): the sorted rows' order,
  /// their positions and the top-k weights.
  struct Routing {
    std::vector<Buffer> order, position, weights;
  };
  Routing ownRouting; ///< uploaded by fillLayout
  /// ownRouting, or a backward pass's forward pass's (borrowFrom): the same
  /// routing, uploaded once a step.
  const Routing *routing = &ownRouting;
  std::vector<Buffer> rows, results; ///< per rank, grow-only
  size_t ownedBytes = 0;
  bool allocated = false;
  double taskTime = 0;
  std::chrono::steady_clock::time_point tasksStart;
  trace::Trace noTrace;
  struct Tables;
  std::unique_ptr<Tables> device; ///< the device::Program the kernel reads
};

} // namespace moec::cuda

#endif // MOEC_RUNTIME_CUDA_PASS_H
