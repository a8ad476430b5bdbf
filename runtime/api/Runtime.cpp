//===- Runtime.cpp - The moec runtime: programs and contexts ---------------===//
//
// The API half of a pass: programs, contexts, bindings, the routing checks
// and the order of a pass; a backend (runtime/backend: the CPU's or the
// CUDA one) does the rest. The C API over it is CApi.cpp. A pass of a
// context:
//
//   prepare  check the routing and the bound tensors of every local rank,
//            then exchange through the fabric what each rank found (its
//            per-expert row counts, or its error), so that every rank of
//            the group knows every rank's counts, and every rank stops with
//            the same message when one rank's input is wrong; check the
//            capacities of all ranks (nothing is written before all checks
//            pass); fill the layout tensors; gather the rows to send
//   tasks    the CPU backend runs the task program on the local ranks
//   finish   reduce the returned rows into y (or dx), and dtopk_weights
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Runtime.h"

#include "base/Time.h"
#include "runtime/api/CApi.h"
#include "runtime/api/Group.h"
#include "format/Crc32.h"
#include "runtime/layer/Layer.h"
#include "runtime/trace/Trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <system_error>
#include <thread>

namespace moec::rt {

using detail::copyText;
using detail::elementCount;
using format::TaskProgram;

//===----------------------------------------------------------------------===//
// Tensors
//===----------------------------------------------------------------------===//

Tensor makeTensor(void *data, DType dtype, std::initializer_list<int64_t> dims) {
  Tensor t{};
  t.data = data;
  t.dtype = moec_dtype(dtype);
  for (int64_t d : dims)
    if (t.ndim < MOEC_MAX_DIMS)
      t.dims[t.ndim++] = d;
  return t;
}

std::string shapeString(const Tensor &tensor) {
  std::vector<int64_t> dims(tensor.dims, tensor.dims + std::clamp(tensor.ndim, 0, MOEC_MAX_DIMS));
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

namespace {

int64_t nanosOf(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

/// The trace `mine` of this process's rank (times from `origin`) and those
/// of every other rank, in one trace on rank 0's clock, into *all on rank 0
/// (collective; other ranks get nothing). The clocks: exchanges end on
/// every rank within about one message latency of each other, so each
/// rank's reading of its clock when an exchange ended, sent in the next one,
/// gives its offset from rank 0's clock (the median of a few; hosts with a
/// shared clock get about zero).
Status gatherTrace(comm::Fabric &fabric, const trace::Trace &mine, Clock::time_point origin,
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
  kX, kW1, kW2, kY, kDy, kDx, kDtopk, kDw1, kDw2,
  // LoRA adapters, per target t (0: w1, 1: w2): A, B, and their gradients.
  kLoraA1, kLoraB1, kLoraA2, kLoraB2, kDLoraA1, kDLoraB1, kDLoraA2, kDLoraB2,
  // The scales of quantized base weights (LayerShape::weightFormat).
  kW1Scale, kW2Scale,
  kBindingCount
};
constexpr const char *kBindingNames[kBindingCount] = {
    "x",       "w1",      "w2",      "y",        "dy",       "dx",       "dtopk_weights",
    "dw1",     "dw2",     "lora_a1", "lora_b1",  "lora_a2",  "lora_b2",  "dlora_a1",
    "dlora_b1", "dlora_a2", "dlora_b2", "w1_scale", "w2_scale"};

bool isAdapterGrad(Binding b) { return b >= kDLoraA1 && b <= kDLoraB2; }
bool isAdapter(Binding b) { return b >= kLoraA1 && b <= kDLoraB2; }
/// The projection an adapter binding belongs to: 0 (w1) or 1 (w2).
int adapterTarget(Binding b) { return ((b - kLoraA1) / 2) % 2; }

/// The dtype a binding must have.
DType bindingDType(Binding b, const LayerShape &fwd, const LayerShape *bwd) {
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
std::vector<AdapterBinding> adapterBindings(const LayerShape &s, const LayerPlan &plan,
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


} // namespace

//===----------------------------------------------------------------------===//
// Program
//===----------------------------------------------------------------------===//


Program::Program(std::unique_ptr<Impl> impl) : body(std::move(impl)) {}
Program::~Program() = default;
const TaskProgram &Program::tasks() const { return body->program; }
const LayerShape &Program::shape() const { return body->plan.shape; }
const std::string &Program::source() const { return body->source; }
uint32_t Program::checksum() const { return body->checksum; }

Status Program::create(TaskProgram program, std::shared_ptr<const Program> *out) {
  if (Status s = format::validateTaskProgram(program); !s)
    return s;
  auto impl = std::make_unique<Impl>();
  if (Status s = analyzeLayer(program, &impl->plan); !s)
    return s;
  const std::vector<uint8_t> bytes = format::writeTaskBinary(program);
  impl->checksum = format::crc32(bytes.data(), bytes.size());
  impl->source = "a program in memory";
  impl->program = std::move(program);
  *out = std::shared_ptr<const Program>(new Program(std::move(impl)));
  return Status::success();
}

Status Program::load(const std::string &path, std::shared_ptr<const Program> *out) {
  TaskProgram program;
  if (Status s = format::loadTaskBinaryFile(path, &program); !s)
    return s;
  std::shared_ptr<const Program> loaded;
  if (Status s = create(std::move(program), &loaded); !s)
    return s.withPrefix(path + ": ");
  const_cast<Impl &>(loaded->impl()).source = path;
  *out = std::move(loaded);
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Context
//===----------------------------------------------------------------------===//

namespace {

/// What one rank tells the others when a context is created: the layer it
/// runs.
struct RankFingerprint {
  uint32_t forwardChecksum = 0, backwardChecksum = 0;
  LayerShape shape; ///< the forward program's
  char forwardSource[200] = {};
  char backwardSource[200] = {};
};

std::string describe(const RankFingerprint &f) {
  std::string text = fmt::format("forward '{}' (crc32 {:08x})", f.forwardSource, f.forwardChecksum);
  if (f.backwardSource[0])
    text += fmt::format(", backward '{}' (crc32 {:08x})", f.backwardSource, f.backwardChecksum);
  else
    text += ", no backward";
  const LayerShape &s = f.shape;
  return text + fmt::format(" for R {} (TP {}), L {}, H {}, I {}, S {}, K {}, {}", s.ranks, s.tp, s.localExperts,
                            s.hidden, s.inter, s.tokens, s.topK, dtypeName(s.activations));
}

} // namespace

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
  std::atomic<uint64_t> passes{0}; ///< forward and backward passes ended
  trace::Trace fwdTrace, bwdTrace; ///< with ContextOptions::trace
  Clock::time_point fwdOrigin, bwdOrigin; ///< when those passes started
  bool lastWasBackward = false;

  std::thread submitted;
  bool inFlight = false;
  Status submittedResult;


  Status checkBinding(uint32_t rank, Binding b, std::vector<int64_t> dims) const;
  /// Refuses an output of a pass (in `outputs`) whose memory overlaps
  /// another tensor the pass reads or writes (`used`, and the routing), of
  /// rank `rank` or of a local rank before it (the ranks of one process
  /// share its memory); the error names both tensors and their ranks.
  Status checkOverlaps(uint32_t rank, const std::vector<Binding> &used,
                       const std::vector<Binding> &outputs) const;
  Status runTasks(backend::Pass &pass, PassTimes &times);
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

Status Context::Impl::checkOverlaps(uint32_t rank, const std::vector<Binding> &used,
                                    const std::vector<Binding> &outputs) const {
  struct Range {
    uint32_t rank;
    const char *name;
    bool output;
    uintptr_t begin, end;
  };
  std::vector<Range> ranges;
  const auto add = [&](uint32_t q, const char *name, bool output, const Tensor &t) {
    const int64_t n = elementCount(t);
    if (t.data && n > 0 && t.ndim >= 0) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data);
      ranges.push_back({q, name, output, begin,
                        begin + uintptr_t(n) * format::dtypeSize(DType(t.dtype))});
    }
  };
  size_t mine = 0; ///< ranges[mine..]: rank `rank`'s (added last)
  for (uint32_t q = firstLocal(); q <= rank; ++q) {
    mine = ranges.size();
    for (Binding b : used)
      add(q, kBindingNames[b],
          std::find(outputs.begin(), outputs.end(), b) != outputs.end(), bound[q][b]);
    add(q, "topk_ids", false, ids[q]);
    add(q, "topk_weights", false, weights[q]);
  }
  // Each pair with a range of this rank once (those of earlier ranks were
  // checked with theirs): a pass checks R x (its tensors) x (all tensors).
  for (size_t i = mine; i < ranges.size(); ++i)
    for (size_t j = 0; j < i; ++j) {
      const Range &a = ranges[i], &b = ranges[j];
      if (!(a.output || b.output) || a.begin >= b.end || b.begin >= a.end)
        continue;
      const Range &out = a.output ? a : b, &other = a.output ? b : a;
      return Status::error(fmt::format(
          "rank {}: output '{}' shares memory with {} '{}'{}: an output of a pass must have "
          "memory of its own (no output over an input or over another output)",
          out.rank, out.name, other.output ? "output" : "input", other.name,
          other.rank != out.rank ? fmt::format(" of rank {}", other.rank) : ""));
    }
  return Status::success();
}

Status Context::Impl::checkBinding(uint32_t rank, Binding b, std::vector<int64_t> dims) const {
  const Tensor &t = bound[rank][b];
  if (t.ndim == 0 && t.data == nullptr)
    return Status::error(
        fmt::format("rank {}: tensor '{}' is not bound (bind it first)", rank, kBindingNames[b]));
  const std::vector<int64_t> have(t.dims, t.dims + t.ndim);
  if (have != dims)
    return Status::error(fmt::format("rank {}: tensor '{}' has shape {}; expected [{}]", rank,
                                     kBindingNames[b], shapeString(t), fmt::join(dims, ", ")));
  if (b == kW1Scale || b == kW2Scale) {
    // A quantized weight's scales multiply its codes: each must be a finite
    // positive number (a NaN or zero scale would make every value it
    // scales NaN or zero without a word); a zero point is a code, 0 to 15.
    const LayerShape &s = shape();
    const float *scales = static_cast<const float *>(t.data);
    int64_t count = 1;
    for (int64_t d : dims)
      count *= d;
    const bool pairs = s.weightFormat == WeightFormat::Int4Group && s.weightZeroPoints;
    for (int64_t i = 0; i < count; ++i) {
      const bool zero = pairs && i % 2 == 1;
      const float v = scales[i];
      if (zero ? std::isfinite(v) && v >= 0 && v <= 15 : std::isfinite(v) && v > 0)
        continue;
      // Where: the local expert, then the block, row, or row and group.
      const int64_t at = pairs ? i / 2 : i, perExpert = count / dims[0] / (pairs ? 2 : 1);
      const int64_t e = at / perExpert, within = at % perExpert;
      std::string where;
      if (s.weightFormat == WeightFormat::Int8Channel)
        where = fmt::format("row {}", within);
      else
        where = fmt::format(s.weightFormat == WeightFormat::Fp8Block128 ? "block [{}, {}]"
                                                                         : "row {}, group {}",
                            within / dims[2], within % dims[2]);
      const std::string what = s.weightFormat == WeightFormat::Fp8Block128 ? "FP8 block scales"
                               : s.weightFormat == WeightFormat::Int8Channel
                                   ? "int8 row scales"
                               : zero ? "int4 zero points"
                                      : "int4 group scales";
      return Status::error(
          fmt::format("rank {}: tensor '{}' ({}) holds {} at local expert {}, {}; {}", rank,
                      kBindingNames[b], what, v, e, where,
                      zero ? "a zero point must be a finite number from 0 to 15"
                           : "a scale must be a finite positive number"));
    }
  }
  return Status::success();
}

void Context::Impl::countPuts(const backend::Pass &pass,
                              const std::vector<backend::RankRoute> &routes, PassTimes *times) {
  const backend::PutBytes bytes = backend::groupPutBytes(pass.tasks(), pass.plan(), routes);
  times->dispatchBytes = bytes.dispatch;
  times->combineBytes = bytes.combine;
}

Status Context::Impl::runTasks(backend::Pass &pass, PassTimes &times) {
  running.store(&pass);
  stage.store(1);
  const Status status = pass.runTasks();
  stage.store(2);
  times.tasks = pass.tasksSeconds();
  if (status) {
    // A backward pass has no exchange of its own: its rows are counted
    // from the end of the pass before it.
    markTraffic();
    return status;
  }
  return fatal(withTraffic(status, pass, routes));
}

/// The trace of a pass that started at t0 and began its finish at t1: the
/// task program's spans and the three host phases, from t0.
void Context::Impl::recordTrace(const backend::Pass &pass, Clock::time_point t0, Clock::time_point t1,
                                const PassTimes &times, trace::Trace *out) const {
  auto ns = [](Clock::duration d) { return int64_t(std::chrono::nanoseconds(d).count()); };
  *out = pass.tasksTrace();
  out->shift(ns(pass.tasksStarted() - t0));
  const uint32_t host = firstLocal();
  const int64_t tasksBegin = ns(pass.tasksStarted() - t0), finishBegin = ns(t1 - t0);
  out->phases.push_back({host, "prepare", 0, int64_t(times.prepare * 1e9)});
  out->phases.push_back({host, "tasks", tasksBegin, tasksBegin + int64_t(times.tasks * 1e9)});
  out->phases.push_back({host, "finish", finishBegin, finishBegin + int64_t(times.finish * 1e9)});
}

Status Context::Impl::forward() {
  if (Status st = usable(); !st)
    return st;
  const Clock::time_point t0 = Clock::now();
  const LayerShape &s = shape();
  const int64_t H = s.hidden;
  const std::array<int64_t, 3> w1 = s.w1Dims(), w2 = s.w2Dims();
  const auto bindings = [&](uint32_t r, const backend::RankRoute &route) {
    const int64_t S = route.tokens;
    for (const auto &[b, dims] : {std::pair<Binding, std::vector<int64_t>>{kX, {S, H}},
                                  {kY, {S, H}},
                                  {kW1, s.storedDims(w1)},
                                  {kW2, s.storedDims(w2)}})
      if (Status st = checkBinding(r, b, dims); !st)
        return st;
    for (const AdapterBinding &a : adapterBindings(s, fwd->plan(), false))
      if (Status st = checkBinding(r, a.binding, a.dims); !st)
        return st;
    if (s.weightFormat != WeightFormat::Dense)
      for (const auto &[b, dims] :
           {std::pair{kW1Scale, s.scaleDims(w1)}, std::pair{kW2Scale, s.scaleDims(w2)}})
        if (Status st = checkBinding(r, b, dims); !st)
          return st;
    std::vector<Binding> used = {kX, kY, kW1, kW2};
    for (const AdapterBinding &a : adapterBindings(s, fwd->plan(), false))
      used.push_back(a.binding);
    if (s.weightFormat != WeightFormat::Dense)
      used.insert(used.end(), {kW1Scale, kW2Scale});
    return checkOverlaps(r, used, {kY});
  };
  // Every check passes on every rank before state and outputs change.
  if (Status st = route(&routes, bindings); !st)
    return st;
  fwdTimes.checks = secondsSince(t0);
  haveForward = false;
  backend::Pass &pass = *fwd;
  if (Status st = pass.allocate(); !st)
    return fatal(st);
  const LayerPlan &plan = pass.plan();
  std::vector<const void *> x(ranks(), nullptr);
  std::vector<void *> y(ranks(), nullptr);
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
    pass.bindSlot(r, plan.w1, bound[r][kW1].data);
    pass.bindSlot(r, plan.w2, bound[r][kW2].data);
    if (plan.w1Scale != kNoSlot) {
      pass.bindSlot(r, plan.w1Scale, bound[r][kW1Scale].data);
      pass.bindSlot(r, plan.w2Scale, bound[r][kW2Scale].data);
    }
    for (const AdapterBinding &a : adapterBindings(s, plan, false))
      pass.bindSlot(r, a.slot, bound[r][a.binding].data);
    x[r] = bound[r][kX].data;
    y[r] = bound[r][kY].data;
  }
  if (Status st = pass.fillLayout(routes); !st)
    return fatal(st);
  if (Status st = pass.gatherSendRows(routes, x, false); !st)
    return fatal(st);
  fwdTimes.prepare = secondsSince(t0);
  countPuts(pass, routes, &fwdTimes);

  if (Status st = runTasks(pass, fwdTimes); !st)
    return st;

  const Clock::time_point t1 = Clock::now();
  if (Status st = pass.combine(routes, y, true); !st)
    return fatal(st);
  fwdTimes.finish = secondsSince(t1);
  haveForward = true;
  lastWasBackward = false;
  if (options.trace)
  {
    recordTrace(pass, t0, t1, fwdTimes, &fwdTrace);
    fwdOrigin = t0;
  }
  return Status::success();
}

Status Context::Impl::backward() {
  if (Status st = usable(); !st)
    return st;
  if (!bwd)
    return Status::error("this context has no backward program");
  if (!haveForward)
    return Status::error("backward needs a forward pass first: it uses the routing and "
                         "activations the last forward pass saved");
  const Clock::time_point t0 = Clock::now();
  const LayerShape &s = shape();
  const int64_t H = s.hidden, I = s.inter, L = s.localExperts;
  const std::array<int64_t, 3> w1 = s.w1Dims(), w2 = s.w2Dims();
  // A frozen layer's backward has no weight gradients to bind.
  const bool frozen = bwd->plan().shape.frozen;
  std::vector<Status> local;
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
    const int64_t S = routes[r].tokens, K = routes[r].topK;
    Status st;
    for (const auto &[b, dims] : {std::pair<Binding, std::vector<int64_t>>{kDy, {S, H}},
                                  {kDx, {S, H}},
                                  {kDtopk, {S, K}},
                                  {kW1, s.storedDims(w1)},
                                  {kW2, s.storedDims(w2)},
                                  {kDw1, {L, H, 2 * I}},
                                  {kDw2, {L, I, H}}}) {
      if (frozen && (b == kDw1 || b == kDw2))
        continue;
      if (st = checkBinding(r, b, dims); !st)
        break;
    }
    for (bool gradients : {false, true})
      for (const AdapterBinding &a : adapterBindings(s, bwd->plan(), gradients))
        if (st && !(st = checkBinding(r, a.binding, a.dims)))
          break;
    if (s.weightFormat != WeightFormat::Dense)
      for (const auto &[b, dims] :
           {std::pair{kW1Scale, s.scaleDims(w1)}, std::pair{kW2Scale, s.scaleDims(w2)}})
        if (st && !(st = checkBinding(r, b, dims)))
          break;
    if (st) {
      std::vector<Binding> used = {kDy, kDx, kDtopk, kW1, kW2}, outputs = {kDx, kDtopk};
      if (!frozen)
        for (Binding b : {kDw1, kDw2})
          used.push_back(b), outputs.push_back(b);
      for (bool gradients : {false, true})
        for (const AdapterBinding &a : adapterBindings(s, bwd->plan(), gradients)) {
          used.push_back(a.binding);
          if (gradients)
            outputs.push_back(a.binding);
        }
      if (s.weightFormat != WeightFormat::Dense)
        used.insert(used.end(), {kW1Scale, kW2Scale});
      st = checkOverlaps(r, used, outputs);
    }
    local.push_back(st);
  }
  if (Status st = agree(local, nullptr); !st)
    return st;
  bwdTimes.checks = secondsSince(t0);

  backend::Pass &pass = *bwd;
  pass.borrowFrom(*fwd);
  if (Status st = pass.allocate(); !st)
    return fatal(st);
  const LayerPlan &plan = pass.plan();
  const LayerPlan &saved = fwd->plan();
  std::vector<const void *> dy(ranks(), nullptr);
  std::vector<void *> dx(ranks(), nullptr);
  std::vector<float *> dtopk(ranks(), nullptr);
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
    pass.bindSlot(r, plan.w1, bound[r][kW1].data);
    pass.bindSlot(r, plan.w2, bound[r][kW2].data);
    if (plan.w1Scale != kNoSlot) {
      pass.bindSlot(r, plan.w1Scale, bound[r][kW1Scale].data);
      pass.bindSlot(r, plan.w2Scale, bound[r][kW2Scale].data);
    }
    pass.bindSlot(r, plan.upOut, fwd->slot(r, saved.upOut));
    if (!frozen) {
      pass.bindSlot(r, plan.dw1, bound[r][kDw1].data);
      pass.bindSlot(r, plan.dw2, bound[r][kDw2].data);
    }
    // The activations this backward reads from forward: X and A for the
    // weight gradients (dw or the adapters' dA), U for the adapters' dB.
    if (plan.dispatched != kNoSlot)
      pass.bindSlot(r, plan.dispatched, fwd->slot(r, saved.dispatched));
    if (plan.swigluOut != kNoSlot)
      pass.bindSlot(r, plan.swigluOut, fwd->slot(r, saved.swigluOut));
    for (int t = 0; t < 2; ++t)
      if (plan.lora[t].u != kNoSlot)
        pass.bindSlot(r, plan.lora[t].u, fwd->slot(r, saved.lora[t].u));
    for (bool gradients : {false, true})
      for (const AdapterBinding &a : adapterBindings(s, plan, gradients))
        pass.bindSlot(r, a.slot, bound[r][a.binding].data);
    dy[r] = bound[r][kDy].data;
    dx[r] = bound[r][kDx].data;
    dtopk[r] = static_cast<float *>(bound[r][kDtopk].data);
  }
  if (Status st = pass.fillLayout(routes); !st)
    return fatal(st);
  if (Status st = pass.gatherSendRows(routes, dy, true); !st)
    return fatal(st);
  bwdTimes.prepare = secondsSince(t0);
  countPuts(pass, routes, &bwdTimes);

  if (Status st = runTasks(pass, bwdTimes); !st)
    return st;

  const Clock::time_point t1 = Clock::now();
  if (Status st = pass.combine(routes, dx, false); !st)
    return fatal(st);
  if (Status st = pass.topkWeightGrad(*fwd, routes, dy, dtopk); !st)
    return fatal(st);
  bwdTimes.finish = secondsSince(t1);
  lastWasBackward = true;
  if (options.trace)
  {
    recordTrace(pass, t0, t1, bwdTimes, &bwdTrace);
    bwdOrigin = t0;
  }
  return Status::success();
}

/// Under a fabric of several processes: checks that every rank runs the
/// same binaries (by checksum) of the same layer.
Status Context::Impl::fingerprint() const {
  RankFingerprint mine;
  mine.forwardChecksum = fwdProgram->checksum();
  copyText(mine.forwardSource, sizeof mine.forwardSource, fwdProgram->source());
  if (bwdProgram) {
    mine.backwardChecksum = bwdProgram->checksum();
    copyText(mine.backwardSource, sizeof mine.backwardSource, bwdProgram->source());
  }
  mine.shape = fwdProgram->shape();
  std::vector<RankFingerprint> all(fabric->ranks());
  if (Status st = fabric->exchange(&mine, sizeof mine, all.data(), options.timeoutSeconds); !st)
    return st.withPrefix("creating the context: ");
  for (uint32_t r = 1; r < all.size(); ++r)
    if (all[r].forwardChecksum != all[0].forwardChecksum ||
        all[r].backwardChecksum != all[0].backwardChecksum)
      return Status::error(fmt::format(
          "ranks 0 and {} run different layers: rank 0 runs {}; rank {} runs {}", r,
          describe(all[0]), r, describe(all[r])));
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Context: the public face
//===----------------------------------------------------------------------===//

Context::Context(std::unique_ptr<Impl> impl) : body(std::move(impl)) {}

Context::~Context() {
  if (body && body->inFlight)
    body->submitted.join();
}

Status Context::create(std::shared_ptr<const Program> forward,
                       std::shared_ptr<const Program> backward, const ContextOptions &options,
                       std::unique_ptr<Context> *out) {
  if (!forward)
    return Status::error("a context needs a forward program");
  if (options.timeoutSeconds != 0 && !timeoutInRange(options.timeoutSeconds))
    return Status::error(fmt::format(
        "the timeout is {} s; it must be from {} to {} seconds (or 0: no watchdog)",
        options.timeoutSeconds, kTimeoutMinSeconds, kTimeoutMaxSeconds));
  for (const Program *p : {forward.get(), backward.get()})
    if (p && p->impl().plan.kind != PlanKind::Layer)
      return Status::error(fmt::format(
          "{}: the binary is the {} alone (a graph of one {} op), not a layer pass: run it "
          "with an Exchange (moec_torch.Exchange)",
          p->source(), p->impl().plan.kind == PlanKind::Dispatch ? "dispatch" : "combine",
          p->impl().plan.kind == PlanKind::Dispatch ? "dispatch" : "combine"));
  if (forward->shape().backward)
    return Status::error("the forward program is a backward pass");
  if (backward)
    if (Status s = checkPassesMatch(forward->impl().plan, backward->impl().plan); !s)
      return s;
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->initialize(forward->shape(), options, forward->source()); !s)
    return s;
  const uint32_t R = forward->shape().ranks;
  impl->bound.assign(R, std::array<Tensor, kBindingCount>{});
  impl->fwdProgram = std::move(forward);
  impl->bwdProgram = std::move(backward);
  if (!impl->fabric->allLocal())
    if (Status s = impl->fingerprint(); !s)
      return s;
  const backend::PassOptions po = impl->passOptions();
  const auto createPass = [&](const Program &program, std::unique_ptr<backend::Pass> *pass) {
    return impl->backend->createPass(program.tasks(), program.impl().plan, po, pass);
  };
  if (Status s = createPass(*impl->fwdProgram, &impl->fwd); !s)
    return s;
  if (impl->bwdProgram)
    if (Status s = createPass(*impl->bwdProgram, &impl->bwd); !s)
      return s;
  out->reset(new Context(std::move(impl)));
  return Status::success();
}

const LayerShape &Context::shape() const { return body->shape(); }
const format::LayerRecord &Context::layerRecord() const { return body->fwd->plan().record; }
const LayerShape *Context::backwardShape() const {
  return body->bwd ? &body->bwd->plan().shape : nullptr;
}
uint32_t Context::ranks() const { return body->ranks(); }
uint32_t Context::workers() const { return body->workerCount; }
uint32_t Context::firstLocalRank() const { return body->firstLocal(); }
uint32_t Context::localRanks() const { return body->fabric->localRanks(); }
bool Context::outOfStep() const { return !body->broken.empty(); }
comm::Fabric &Context::fabric() const { return *body->fabric; }
const CapacityNeed &Context::capacityNeed() const { return body->need; }
const PassTimes &Context::forwardTimes() const { return body->fwdTimes; }

std::shared_ptr<const Program> Context::program(TracedPass which) const {
  if (which == TracedPass::Last)
    which = body->lastWasBackward ? TracedPass::Backward : TracedPass::Forward;
  return which == TracedPass::Backward ? body->bwdProgram : body->fwdProgram;
}

const std::vector<int64_t> &Context::routedRows(uint32_t rank) const {
  static const std::vector<int64_t> none;
  return rank < body->routes.size() ? body->routes[rank].layout.counts : none;
}
const PassTimes &Context::backwardTimes() const { return body->bwdTimes; }
size_t Context::workspaceBytes() const {
  return body->fwd->workspaceBytes() + (body->bwd ? body->bwd->workspaceBytes() : 0);
}
std::vector<WorkspaceSlot> Context::workspace() const {
  std::vector<WorkspaceSlot> out;
  for (const backend::Pass *pass : {body->fwd.get(), body->bwd.get()}) {
    if (!pass)
      continue;
    for (const backend::SlotMemory &m : pass->workspace()) {
      WorkspaceSlot w;
      w.pass = pass->plan().shape.backward ? "backward" : "forward";
      w.name = std::string(pass->tasks().name(pass->tasks().slots[m.slot].name));
      w.bytes = m.bytes;
      w.resident = m.resident;
      w.window = m.window;
      w.borrowed = m.borrowed;
      w.layout = m.layout;
      out.push_back(std::move(w));
    }
  }
  return out;
}
size_t Context::scratchBytes() const { return body->backend->scratchBytes(); }
size_t Context::packedWeightBytes() const {
  return body->fwd->packedWeightBytes() + (body->bwd ? body->bwd->packedWeightBytes() : 0);
}
Status Context::weightChanged(std::string_view name) {
  static const std::array<Binding, 6> weights{kW1, kW2, kLoraA1, kLoraB1, kLoraA2, kLoraB2};
  const auto *found = std::find_if(weights.begin(), weights.end(),
                                   [&](Binding b) { return name == kBindingNames[b]; });
  if (found == weights.end())
    return Status::error(fmt::format("weightChanged: '{}' is not a weight; expected one of w1, "
                                     "w2, lora_a1, lora_b1, lora_a2, lora_b2",
                                     name));
  for (backend::Pass *pass : {body->fwd.get(), body->bwd.get()}) {
    if (!pass)
      continue;
    const LayerPlan &plan = pass->plan();
    const Binding b = *found;
    const uint32_t slot = b == kW1 ? plan.w1
                          : b == kW2 ? plan.w2
                          : b == kLoraA1 || b == kLoraA2 ? plan.lora[adapterTarget(b)].a
                                                         : plan.lora[adapterTarget(b)].b;
    if (slot != kNoSlot)
      pass->weightChanged(slot);
  }
  return Status::success();
}
size_t Context::workspaceToAllocate() const {
  return body->fwd->workspaceNeeded() + (body->bwd ? body->bwd->workspaceNeeded() : 0);
}
uint64_t Context::passesEnded() const { return body->passes.load(); }
double Context::passShare() const {
  const int stage = body->stage.load();
  const backend::Pass *pass = body->running.load();
  return stage == 0 ? 0.0 : stage == 1 && pass ? pass->tasksShare() : 1.0;
}

Status Context::setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights) {
  if (Status s = body->idle(); !s)
    return s;
  return body->setRouting(rank, topkIds, topkWeights);
}

Status Context::bind(uint32_t rank, std::string_view name, const Tensor &tensor) {
  if (Status s = body->idle(); !s)
    return s;
  if (Status s = body->localRank(rank); !s)
    return s;
  const auto *found = std::find(std::begin(kBindingNames), std::end(kBindingNames), name);
  if (found == std::end(kBindingNames))
    return Status::error(fmt::format("rank {}: no tensor is named '{}'; expected one of {}", rank,
                                     name, fmt::join(kBindingNames, ", ")));
  const Binding b = Binding(found - std::begin(kBindingNames));
  const bool backwardOnly =
      b == kDy || b == kDx || b == kDtopk || b == kDw1 || b == kDw2 || isAdapterGrad(b);
  if (isAdapter(b) && !(shape().loraTargets >> adapterTarget(b) & 1))
    return Status::error(fmt::format("rank {}: '{}' is a LoRA adapter on w{}, and this "
                                     "context's programs have none there",
                                     rank, name, adapterTarget(b) + 1));
  if (backwardOnly && !body->bwd)
    return Status::error(fmt::format("rank {}: '{}' is a backward tensor, and this context has "
                                     "no backward program",
                                     rank, name));
  if ((b == kW1Scale || b == kW2Scale) && shape().weightFormat == WeightFormat::Dense)
    return Status::error(fmt::format("rank {}: '{}' is the scales of quantized weights, and "
                                     "this context's weights are dense",
                                     rank, name));
  if ((b == kDw1 || b == kDw2) && body->bwd->plan().shape.frozen)
    return Status::error(fmt::format("rank {}: '{}' is a weight gradient, and this context's "
                                     "backward program has none (frozen weights)",
                                     rank, name));
  if (tensor.ndim < 1 || tensor.ndim > MOEC_MAX_DIMS)
    return Status::error(fmt::format("rank {}: '{}' has {} dims", rank, name, tensor.ndim));
  for (int32_t i = 0; i < tensor.ndim; ++i)
    if (tensor.dims[i] < 0)
      return Status::error(
          fmt::format("rank {}: '{}' has a negative dim: {}", rank, name, shapeString(tensor)));
  const DType want = bindingDType(b, shape(), body->bwd ? &body->bwd->plan().shape : nullptr);
  if (DType(tensor.dtype) != want)
    return Status::error(fmt::format("rank {}: '{}' is {}; expected {}", rank, name,
                                     format::dtypeName(DType(tensor.dtype)),
                                     format::dtypeName(want)));
  if (!tensor.data && elementCount(tensor) > 0)
    return Status::error(fmt::format("rank {}: '{}' has no data", rank, name));
  body->bound[rank][b] = tensor;
  return Status::success();
}

Status Context::forward() {
  if (Status s = body->idle(); !s)
    return s;
  return body->tracked(&Impl::forward);
}

Status Context::backward() {
  if (Status s = body->idle(); !s)
    return s;
  return body->tracked(&Impl::backward);
}

namespace {

/// Runs `pass` of `impl` on a thread of its own, for wait() to join.
template <typename Impl, typename Pass> Status submitPass(Impl *impl, Pass pass) {
  if (Status s = impl->idle(); !s)
    return s;
  try {
    impl->submitted =
        std::thread([impl, pass] { impl->submittedResult = impl->tracked(pass); });
  } catch (const std::system_error &error) {
    return Status::error(std::string("cannot start the thread of a submitted pass: ") +
                         error.what());
  }
  impl->inFlight = true;
  return Status::success();
}

} // namespace

Status Context::submitForward() { return submitPass(body.get(), &Impl::forward); }

Status Context::submitBackward() { return submitPass(body.get(), &Impl::backward); }

Status Context::wait() {
  if (!body->inFlight)
    return Status::error("no pass was submitted");
  body->submitted.join();
  body->inFlight = false;
  return body->submittedResult;
}

const trace::Trace &Context::trace(TracedPass which) const {
  if (which == TracedPass::Last)
    which = body->lastWasBackward ? TracedPass::Backward : TracedPass::Forward;
  return which == TracedPass::Backward ? body->bwdTrace : body->fwdTrace;
}

Status Context::writeTrace(const std::string &path, TracedPass which) const {
  if (Status s = body->idle(); !s)
    return s;
  if (!body->options.trace)
    return Status::error("tracing is off (ContextOptions::trace)");
  if (which == TracedPass::Last)
    which = body->lastWasBackward ? TracedPass::Backward : TracedPass::Forward;
  const bool backward = which == TracedPass::Backward;
  const trace::Trace &trace = backward ? body->bwdTrace : body->fwdTrace;
  if (trace.empty())
    return Status::error(fmt::format("no {} pass has run to the end yet",
                                     backward ? "backward" : "forward"));
  const Program &program = backward ? *body->bwdProgram : *body->fwdProgram;
  comm::Fabric &fabric = *body->fabric;
  if (fabric.allLocal())
    return trace::writeChromeTrace(program.impl().program, trace, path, program.source());
  trace::Trace all;
  if (Status s = gatherTrace(fabric, trace, backward ? body->bwdOrigin : body->fwdOrigin,
                             body->options.timeoutSeconds, &all);
      !s)
    return s.withPrefix("gathering the trace of every rank: ");
  if (fabric.firstLocal() != 0)
    return Status::success();
  return trace::writeChromeTrace(program.impl().program, all, path, program.source());
}

} // namespace moec::rt
