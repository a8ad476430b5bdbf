//===- ContextImpl.h - A context's state, inside runtime/api -----*- C++ -*-===//
//
// Internal to the runtime API's files: Context::Impl (a context's programs,
// passes, bindings and routing, on detail::Group) and what its files share
// (the bindings' names and dtypes, the adapters' bindings, gathering a
// trace). Runtime.cpp is the public face, ContextPasses.cpp a pass (its
// checks, forward, backward) and the ranks' agreement on the layer.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_API_CONTEXTIMPL_H
#define MOEC_RUNTIME_API_CONTEXTIMPL_H

#include "runtime/api/Runtime.h"

#include "base/Time.h"
#include "format/Crc32.h"
#include "runtime/api/CApi.h"
#include "runtime/api/Group.h"
#include "runtime/layer/Layer.h"
#include "runtime/trace/Trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <system_error>
#include <thread>

namespace moec::rt {

using detail::copyText;
using detail::elementCount;
using format::TaskProgram;

namespace detail {

inline int64_t nanosOf(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

/// The trace `mine` of this process's rank (times from `origin`) and those
/// of every other rank, in one trace on rank 0's clock, into *all on rank 0
/// (collective; other ranks get nothing). The clocks: exchanges end on
/// every rank within about one message latency of each other, so each
/// rank's reading of its clock when an exchange ended, sent in the next one,
/// gives its offset from rank 0's clock (the median of a few; hosts with a
/// shared clock get about zero).
inline Status gatherTrace(comm::Fabric &fabric, const trace::Trace &mine, Clock::time_point origin,
                          double timeoutSeconds, trace::Trace *all) {
  const uint32_t R = fabric.ranks(), me = fabric.firstLocal();
  if (fabric.localRanks() != 1)
    return Status::error("a fabric of several processes with several ranks per process");
  constexpr int kRounds = 5;
  std::vector<std::vector<int64_t>> samples(R);
  int64_t ended = 0;
  std::vector<int64_t> readings(R);
  for (int round = 0; round <= kRounds; ++round) {
    if (Status s = fabric.exchange(&ended, sizeof ended, readings.data(), timeoutSeconds); !s)
      return s;
    ended = nanosOf(Clock::now());
    if (round > 0)
      for (uint32_t p = 0; p < R; ++p)
        samples[p].push_back(readings[p] - readings[0]);
  }
  const std::vector<char> packed = trace::packTrace(mine);
  struct Header {
    int64_t origin;
    uint64_t bytes;
  };
  const Header header{nanosOf(origin), packed.size()};
  std::vector<Header> headers(R);
  if (Status s = fabric.exchange(&header, sizeof header, headers.data(), timeoutSeconds); !s)
    return s;
  uint64_t most = 0;
  for (const Header &h : headers)
    most = std::max(most, h.bytes);
  std::vector<char> block(most, 0), blocks(me == 0 ? most * R : 0);
  std::copy(packed.begin(), packed.end(), block.begin());
  if (Status s = fabric.gather(block.data(), most, blocks.data()); !s)
    return s;
  if (me != 0)
    return Status::success();
  for (uint32_t p = 0; p < R; ++p) {
    std::vector<int64_t> &offsets = samples[p];
    std::nth_element(offsets.begin(), offsets.begin() + offsets.size() / 2, offsets.end());
    const int64_t offset = offsets[offsets.size() / 2];
    trace::Trace theirs;
    if (Status s = trace::unpackTrace(blocks.data() + most * p, headers[p].bytes, &theirs); !s)
      return s.withPrefix(fmt::format("rank {}: ", p));
    theirs.shift(headers[p].origin - offset - headers[0].origin);
    all->append(theirs);
  }
  all->sort();
  return Status::success();
}

/// The tensors a caller binds, by name.
enum Binding : uint32_t {
  kX,
  kW1,
  kW2,
  kY,
  kDy,
  kDx,
  kDtopk,
  kDw1,
  kDw2,
  // LoRA adapters, per target t (0: w1, 1: w2): A, B, and their gradients.
  kLoraA1,
  kLoraB1,
  kLoraA2,
  kLoraB2,
  kDLoraA1,
  kDLoraB1,
  kDLoraA2,
  kDLoraB2,
  // The scales of quantized base weights (LayerShape::weightFormat).
  kW1Scale,
  kW2Scale,
  kBindingCount
};
inline constexpr const char *kBindingNames[kBindingCount] = {
    "x",        "w1",       "w2",       "y",        "dy",      "dx",      "dtopk_weights",
    "dw1",      "dw2",      "lora_a1",  "lora_b1",  "lora_a2", "lora_b2", "dlora_a1",
    "dlora_b1", "dlora_a2", "dlora_b2", "w1_scale", "w2_scale"};

inline bool isAdapterGrad(Binding b) { return b >= kDLoraA1 && b <= kDLoraB2; }
inline bool isAdapter(Binding b) { return b >= kLoraA1 && b <= kDLoraB2; }
/// The projection an adapter binding belongs to: 0 (w1) or 1 (w2).
inline int adapterTarget(Binding b) { return ((b - kLoraA1) / 2) % 2; }

/// The dtype a binding must have.
inline DType bindingDType(Binding b, const LayerShape &fwd, const LayerShape *bwd) {
  if (b == kDtopk || b == kW1Scale || b == kW2Scale)
    return DType::F32;
  if (b == kW1 || b == kW2)
    return fwd.weightDType();
  if (b == kDw1 || b == kDw2 || isAdapterGrad(b))
    return bwd ? bwd->weightGrads : DType::F32;
  return fwd.activations;
}

/// The adapters' bindings and shapes (A [L, K, r], B [L, r, N] on a
/// projection [L, K, N]), and the slots they go to, for the targets `s` has.
struct AdapterBinding {
  Binding binding;
  std::vector<int64_t> dims;
  uint32_t slot;
};
inline std::vector<AdapterBinding> adapterBindings(const LayerShape &s, const LayerPlan &plan,
                                                   bool gradients) {
  std::vector<AdapterBinding> out;
  const int64_t L = s.localExperts, H = s.hidden, I = s.inter, r = s.loraRank;
  for (int t = 0; t < 2; ++t) {
    if (!(s.loraTargets >> t & 1))
      continue;
    const int64_t K = t == 0 ? H : I, N = t == 0 ? 2 * I : H;
    const LoraSlots &lora = plan.lora[t];
    const uint32_t base = gradients ? kDLoraA1 : kLoraA1;
    out.push_back({Binding(base + 2 * t), {L, K, r}, gradients ? lora.da : lora.a});
    out.push_back({Binding(base + 2 * t + 1), {L, r, N}, gradients ? lora.db : lora.b});
  }
  return out;
}

} // namespace detail

using namespace detail; // the runtime API's files only: this header is internal

struct Context::Impl : detail::Group {
  std::shared_ptr<const Program> fwdProgram, bwdProgram;
  std::unique_ptr<backend::Pass> fwd, bwd;
  PassTimes fwdTimes, bwdTimes;
  std::vector<std::array<Tensor, kBindingCount>> bound;
  std::vector<backend::RankRoute> routes; ///< what the last forward pass used
  bool haveForward = false;
  /// The pass in flight and its stage (0 prepare, 1 tasks, 2 finish or idle).
  std::atomic<const backend::Pass *> running{nullptr};
  std::atomic<int> stage{2};
  std::atomic<uint64_t> passes{0};        ///< forward and backward passes ended
  trace::Trace fwdTrace, bwdTrace;        ///< with ContextOptions::trace
  Clock::time_point fwdOrigin, bwdOrigin; ///< when those passes started
  bool lastWasBackward = false;

  std::thread submitted;
  bool inFlight = false;
  Status submittedResult;

  Status checkBinding(uint32_t rank, Binding b, std::vector<int64_t> dims) const;
  /// Checks the scales of every local rank's quantized weights bound with
  /// the shape the layer expects, in one go (Pass::findBadScales: on the
  /// GPU one launch and one copy back, not two of each a tensor), into
  /// scaleVerdicts ([rank][w1, w2]: the error naming the bad value and
  /// where, or success), which checkBinding returns after its shape check.
  /// With the packed-weight store (options.packWeights), scales found good
  /// are not read again while the same tensor stays bound and
  /// weightChanged() does not name its weight: as the packed copies made
  /// from them, they are taken as unchanged.
  void checkScales(const backend::Pass &pass);
  std::vector<std::array<Status, 2>> scaleVerdicts;
  /// [rank][w1, w2]: the scales last found good (options.packWeights).
  std::vector<std::array<const void *, 2>> scalesFoundGood;
  /// Refuses an output of a pass (in `outputs`) whose memory overlaps
  /// another tensor the pass reads or writes (`used`, and the routing), of
  /// rank `rank` or of a local rank before it (the ranks of one process
  /// share its memory); the error names both tensors and their ranks.
  Status checkOverlaps(uint32_t rank, const std::vector<Binding> &used,
                       const std::vector<Binding> &outputs) const;
  Status runTasks(backend::Pass &pass, PassTimes &times);
  /// Binds rank `r`'s base weights (w1, w2, and their scales when quantized)
  /// to `pass`.
  void bindBaseWeights(backend::Pass &pass, uint32_t r) const;
  /// The steps every pass takes after its checks and bindings: the layout,
  /// the rows each rank sends (`source`, weighted by the top-k weights or
  /// not), then the task program; `times` gets prepare (since `t0`), the
  /// bytes of the puts and tasks.
  Status layoutAndRun(backend::Pass &pass, const std::vector<const void *> &source, bool weighted,
                      Clock::time_point t0, PassTimes &times);
  static void countPuts(const backend::Pass &pass, const std::vector<backend::RankRoute> &routes,
                        PassTimes *times);
  void recordTrace(const backend::Pass &pass, Clock::time_point t0, Clock::time_point t1,
                   const PassTimes &times, trace::Trace *out) const;
  Status forward();
  Status backward();
  /// Runs `pass` (forward or backward) with the progress that passShare()
  /// and passesEnded() read kept up to date.
  Status tracked(Status (Impl::*pass)()) {
    stage.store(0);
    const Status status = (this->*pass)();
    stage.store(2);
    passes.fetch_add(1);
    return status;
  }
  Status fingerprint() const;
  Status idle() const {
    if (inFlight)
      return Status::error("a submitted pass is still running; call wait() first");
    return Status::success();
  }
};

} // namespace moec::rt

#endif // MOEC_RUNTIME_API_CONTEXTIMPL_H
