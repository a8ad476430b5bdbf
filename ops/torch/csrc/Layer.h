//===- Layer.h - torch.classes.moec.Layer ------------------------*- C++ -*-===//
//
// The custom class that owns a layer's runtime context: its forward and
// backward passes (sync and async), capacities, checkpoints' records,
// traces and times. MoeOps.cpp registers it.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_OPS_TORCH_CSRC_LAYER_H
#define MOEC_OPS_TORCH_CSRC_LAYER_H

#include "format/Capacity.h"
#include "format/TaskBinary.h"
#include "ops/torch/csrc/Slot.h"
#include "runtime/comm/Hooks.h"
#include "runtime/tooling/Profile.h"
#include "runtime/tooling/Workspace.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <optional>
#include <string_view>
#include <tuple>

namespace moec::torchop {

class Layer : public torch::CustomClassHolder {
public:
  Layer(std::string forwardPath, std::string backwardPath, int64_t workers, double timeoutSeconds,
        std::string fabric, bool trace, std::string packWeights, int64_t group,
        double groupTimeoutSeconds) {
    // "none", "forward" (the forward pass's weights only) or "all".
    TORCH_CHECK(packWeights == "none" || packWeights == "forward" || packWeights == "all",
                "moec: pack_weights must be \"none\", \"forward\" or \"all\", not \"", packWeights,
                "\"");
    moec::rt::ContextOptions options =
        contextOptions(workers, timeoutSeconds, {fabric, group, groupTimeoutSeconds});
    std::shared_ptr<const moec::rt::Program> fwd, bwd;
    check(moec::rt::Program::load(forwardPath, &fwd), "forward binary");
    if (!backwardPath.empty())
      check(moec::rt::Program::load(backwardPath, &bwd), "backward binary");
    options.trace = trace;
    options.packWeights = packWeights != "none";
    options.packBackward = packWeights == "all";
    this->packWeights = options.packWeights;
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

  /// Every process's `bytes` bytes at `data` (at most `capacity`; the
  /// same capacity on every rank), in rank order: one bounded exchange over
  /// the layer's fabric (timeout_seconds; the error, `what`, names the
  /// ranks that did not come) of blocks that lead with their byte count.
  /// Collective under MPI, in the order of the passes; in one process
  /// (every rank here), {these bytes}. The caller holds slot->mutex.
  std::vector<std::string> exchangeBlocks(const void *data, size_t bytes, size_t capacity,
                                          const char *what) {
    moec::comm::Fabric &fabric = slot->context->fabric();
    if (fabric.allLocal())
      return {std::string(static_cast<const char *>(data), bytes)};
    TORCH_CHECK(fabric.localRanks() == 1, "moec: ", what,
                " under a fabric of several processes with several ranks each");
    const size_t block = 8 + capacity;
    std::vector<char> mine(block, 0), all(block * fabric.ranks(), 0);
    const uint64_t count = bytes;
    std::memcpy(mine.data(), &count, 8);
    std::memcpy(mine.data() + 8, data, bytes);
    check(fabric.exchange(mine.data(), block, all.data(), agreeSeconds), what);
    std::vector<std::string> out;
    for (uint32_t r = 0; r < fabric.ranks(); ++r) {
      uint64_t theirs = 0;
      std::memcpy(&theirs, all.data() + r * block, 8);
      TORCH_CHECK(theirs <= capacity, "moec: ", what, ": rank ", r, " brought ", theirs,
                  " bytes, more than the ", capacity, " this rank takes");
      out.emplace_back(all.data() + r * block + 8, theirs);
    }
    return out;
  }

  /// Every process's `text` (at most kAgreeBytes bytes), in rank order
  /// (exchangeBlocks), through which the Python side agrees on what the
  /// binaries do not say (capacity_policy, whether to grow the layer after
  /// an over-capacity error).
  std::vector<std::string> agree(const std::string &text) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    TORCH_CHECK(text.size() <= kAgreeBytes, "moec: agree() takes at most ", kAgreeBytes,
                " bytes, got ", text.size());
    return exchangeBlocks(text.data(), text.size(), kAgreeBytes, "agreement between the ranks");
  }

  /// Every process's `t` (its one rank's; the same shape and dtype on
  /// every rank), stacked in rank order: [ranks, *t.shape] (exchangeBlocks;
  /// a rank that brings other bytes is named).
  at::Tensor allGather(const at::Tensor &t) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    const at::Tensor mine = t.contiguous();
    const size_t bytes = size_t(mine.numel()) * mine.element_size();
    const std::vector<std::string> blocks =
        exchangeBlocks(mine.data_ptr(), bytes, bytes, "gathering a tensor of every rank");
    std::vector<int64_t> dims = {int64_t(blocks.size())};
    dims.insert(dims.end(), mine.sizes().begin(), mine.sizes().end());
    at::Tensor out = at::empty(dims, mine.options());
    for (size_t r = 0; r < blocks.size(); ++r) {
      TORCH_CHECK(blocks[r].size() == bytes, "moec: all_gather(): rank ", r, " brought ",
                  blocks[r].size(), " bytes, this rank ", bytes);
      std::memcpy(static_cast<char *>(out.data_ptr()) + r * bytes, blocks[r].data(), bytes);
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
    d.insert("packed_weight_bytes", int64_t(ws.packed));
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
                     const c10::optional<at::Tensor> &mainGrad2,
                     const std::vector<at::Tensor> &adapters) {
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
    TORCH_CHECK(dyIn.sizes() == in.x.sizes(), "moec: 'dy' has shape ", dyIn.sizes(), "; expected ",
                in.x.sizes(), " like x");
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
      check(slot->context->weightChanged(weightOf(name)), "weights changed");
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
    text +=
        fmt::format("the op call: {:.3f} ms, the runtime's pass {:.3f} ms of it; the rest, "
                    "{:.3f} ms, is the op's own (checks, views, outputs{})\n",
                    call * 1e3, t.total() * 1e3, (call - t.total()) * 1e3,
                    backward ? ", gradient dtypes, a forward recomputed for an older step" : "");
    return text;
  }

  std::vector<double> times() const {
    live();
    const moec::rt::PassTimes &f = slot->context->forwardTimes(),
                              &b = slot->context->backwardTimes();
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
  std::future<Result> takePending(std::map<int64_t, std::future<Result>> &pending, int64_t ticket,
                                  const char *what) {
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
                          : int8                                            ? "int8 codes"
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
      expectLayerDType(adapters[i], names[i].c_str(), i < loraCount() ? s.activations : DType::F32);
      contiguous.push_back(adapters[i].contiguous());
    }
    return {x.contiguous(),  ids.contiguous(), weights.contiguous(),
            w1.contiguous(), w2.contiguous(),  contiguous};
  }

  /// A caller's main-grad buffer: fp32, CPU, contiguous, shaped like its
  /// weight; the runtime adds the weight gradient into it in place.
  static at::Tensor mainGradBuffer(const at::Tensor &t, const at::Tensor &weight,
                                   const char *name) {
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "moec: '", name, "' must be a CPU tensor");
    TORCH_CHECK(t.scalar_type() == at::kFloat, "moec: '", name, "' is ", t.scalar_type(),
                "; expected float32");
    TORCH_CHECK(t.sizes() == weight.sizes(), "moec: '", name, "' has shape ", t.sizes(),
                "; expected ", weight.sizes(), " like its weight");
    TORCH_CHECK(t.is_contiguous(), "moec: '", name,
                "' must be contiguous (the runtime adds "
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

  /// The runtime's weight of a tensor noteWeights watches: a quantized
  /// weight's scales ("w1_scale") are their weight's ("w1").
  static std::string weightOf(const std::string &name) {
    const std::string suffix = "_scale";
    return name.size() > suffix.size() &&
                   name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0
               ? name.substr(0, name.size() - suffix.size())
               : name;
  }

  /// Tells the runtime which weights changed since the last pass: a weight
  /// whose tensor or version is not the one last seen is packed again.
  void noteWeights(const Inputs &in) {
    if (!packWeights)
      return; // nothing is packed to go stale
    std::vector<std::pair<std::string, const at::Tensor *>> weights{{"w1", &in.w1}, {"w2", &in.w2}};
    // The adapters, and a quantized weight's scales (packed with its codes).
    const std::vector<std::string> names = adapterNames();
    for (size_t i = 0; i < names.size(); ++i)
      weights.emplace_back(names[i], &in.adapters[i]);
    for (const auto &[name, t] : weights) {
      const Seen now{t->unsafeGetTensorImpl(), t->data_ptr(), int64_t(t->_version())};
      Seen &last = seen[name];
      if (last.version >= 0 &&
          (now.impl != last.impl || now.data != last.data || now.version != last.version))
        check(slot->context->weightChanged(weightOf(name)), "weight changed");
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
    TORCH_CHECK(false, "moec ", what, ": [rank ", context.firstLocalRank(), "] ", status.message(),
                report.empty() ? "" : "\n", report);
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
  bool packWeights = false;                 ///< ContextOptions::packWeights
  std::map<std::string, Seen> seen;         ///< per weight: as the last pass bound it
  int64_t passes = 0;                       ///< forward passes run
  int64_t step = -1;                        ///< the pass whose state the runtime holds; -1: none
  double reportSeconds = 10;                ///< how long rank 0 waits for the peers' reports
  double agreeSeconds = 60;                 ///< how long agree() waits for the peers
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

} // namespace moec::torchop

#endif // MOEC_OPS_TORCH_CSRC_LAYER_H
