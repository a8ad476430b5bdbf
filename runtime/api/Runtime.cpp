//===- Runtime.cpp - The moec runtime: programs, contexts, the C API ------===//
//
// A pass of a context:
//
//   prepare  check the routing of every rank and the bound tensors, build the
//            routing layouts, check capacities (nothing is written before
//            all checks pass), fill the layout tensors of every rank, gather
//            the rows each rank sends (x rows, or topk_weight * dy rows)
//   tasks    the executor runs the task program for all ranks; runTile() maps
//            each tile to an ops/cpu kernel
//   finish   reduce the returned rows into y (or dx), and dtopk_weights
//
// Prepare and finish run on the calling thread plus short-lived helpers, cut
// by rank and token range; every reduction in them has a fixed order, so
// results do not depend on the number of threads.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Runtime.h"

#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Layout.h"
#include "runtime/cpu/Rows.h"
#include "runtime/cpu/Swiglu.h"
#include "runtime/api/Layer.h"
#include "runtime/exec/Executor.h"
#include "runtime/exec/OpByOp.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

namespace moec::rt {

using format::DType;
using format::OpKind;
using format::TaskProgram;
using format::TilingRecord;

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

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

cpu::Elt eltOf(DType dtype) { return dtype == DType::BF16 ? cpu::Elt::BF16 : cpu::Elt::F32; }

int64_t loadIndex(const void *data, DType dtype, int64_t i) {
  return dtype == DType::I32 ? static_cast<const int32_t *>(data)[i]
                             : static_cast<const int64_t *>(data)[i];
}

void storeIndex(void *data, DType dtype, int64_t i, int64_t value) {
  if (dtype == DType::I32)
    static_cast<int32_t *>(data)[i] = int32_t(value);
  else
    static_cast<int64_t *>(data)[i] = value;
}

/// Runs fn(i) for i in [0, count) on up to `threads` threads (the caller is
/// one of them). Items must be independent.
template <typename Fn> void parallelFor(uint32_t threads, size_t count, const Fn &fn) {
  const size_t n = std::min<size_t>(std::max(threads, 1u), count);
  if (n <= 1) {
    for (size_t i = 0; i < count; ++i)
      fn(i);
    return;
  }
  std::vector<std::thread> helpers;
  helpers.reserve(n - 1);
  for (size_t t = 1; t < n; ++t)
    helpers.emplace_back([&, t] {
      for (size_t i = t; i < count; i += n)
        fn(i);
    });
  for (size_t i = 0; i < count; i += n)
    fn(i);
  for (std::thread &h : helpers)
    h.join();
}

/// The tensors a caller binds, by name.
enum Binding : uint32_t { kX, kW1, kW2, kY, kDy, kDx, kDtopk, kDw1, kDw2, kBindingCount };
constexpr const char *kBindingNames[kBindingCount] = {
    "x", "w1", "w2", "y", "dy", "dx", "dtopk_weights", "dw1", "dw2"};

struct AlignedFree {
  void operator()(uint8_t *p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, AlignedFree>;

/// Bytes of a slot at its capacity.
size_t slotBytes(const format::SlotRecord &slot) {
  uint64_t count = 1;
  for (uint32_t i = 0; i < slot.rank; ++i)
    count *= (i == 0 && (slot.flags & format::kSlotDynamic)) ? slot.capacityRows : slot.dims[i];
  return size_t(count) * format::dtypeSize(slot.dtype);
}

/// What a pass needs of an op at every tile, precomputed.
struct OpInfo {
  OpKind kind = OpKind::Gmm;
  const TilingRecord *tiling = nullptr;
  bool wgrad = false, transposeB = false, accumulate = false;
  int64_t expertStride = 0; ///< elements per expert of the weight (or dW) tensor
};

/// A routing checked and laid out, kept for backward.
struct RankRoute {
  int64_t tokens = 0, topK = 0;
  cpu::RoutingLayout layout;
  std::vector<float> weights; ///< topk_weights [S, K], a copy
};

} // namespace

//===----------------------------------------------------------------------===//
// Program
//===----------------------------------------------------------------------===//

struct Program::Impl {
  TaskProgram program;
  LayerPlan plan;
};

Program::Program(std::unique_ptr<Impl> impl) : body(std::move(impl)) {}
Program::~Program() = default;
const TaskProgram &Program::tasks() const { return body->program; }
const LayerShape &Program::shape() const { return body->plan.shape; }

Status Program::create(TaskProgram program, std::shared_ptr<const Program> *out) {
  if (Status s = format::validateTaskProgram(program); !s)
    return s;
  auto impl = std::make_unique<Impl>();
  if (Status s = analyzeLayer(program, &impl->plan); !s)
    return s;
  impl->program = std::move(program);
  *out = std::shared_ptr<const Program>(new Program(std::move(impl)));
  return Status::success();
}

Status Program::load(const std::string &path, std::shared_ptr<const Program> *out) {
  TaskProgram program;
  if (Status s = format::loadTaskBinaryFile(path, &program); !s)
    return s;
  return create(std::move(program), out).withPrefix(path + ": ");
}

//===----------------------------------------------------------------------===//
// Context
//===----------------------------------------------------------------------===//

namespace {

/// One pass (forward or backward) of a context.
struct Pass {
  std::shared_ptr<const Program> program;
  const LayerPlan *plan = nullptr;
  std::vector<OpInfo> ops;
  std::vector<std::vector<void *>> data; ///< [rank][slot]: the tensor of the slot
  std::vector<Buffer> owned;             ///< workspace buffers
  size_t ownedBytes = 0;
  bool allocated = false;
  std::vector<std::unique_ptr<exec::Executor>> executors; ///< one, or one per op
  PassTimes times;

  const TaskProgram &tasks() const { return program->tasks(); }
  DType dtype(uint32_t slot) const { return tasks().slots[slot].dtype; }
  int64_t width(uint32_t slot) const { return int64_t(tasks().slots[slot].dims[1]); }
  cpu::ConstMatrix in(uint32_t rank, uint32_t slot) const {
    return {data[rank][slot], eltOf(dtype(slot)), width(slot)};
  }
  cpu::Matrix out(uint32_t rank, uint32_t slot) const {
    return {data[rank][slot], eltOf(dtype(slot)), width(slot)};
  }
  int64_t index(uint32_t rank, uint32_t slot, int64_t i) const {
    return loadIndex(data[rank][slot], dtype(slot), i);
  }
};

} // namespace

struct Context::Impl {
  ContextOptions options;
  uint32_t workerCount = 1;
  Pass fwd, bwd;
  std::vector<Tensor> ids, weights; ///< per rank; data null until set
  std::vector<std::array<Tensor, kBindingCount>> bound;
  std::vector<RankRoute> routes; ///< what the last forward pass used
  bool haveForward = false;
  std::vector<cpu::Scratch> scratch; ///< per worker
  const exec::Executor *lastExecutor = nullptr;

  std::thread submitted;
  bool inFlight = false;
  Status submittedResult;

  uint32_t ranks() const { return fwd.plan->shape.ranks; }
  const LayerShape &shape() const { return fwd.plan->shape; }

  Status setUpPass(Pass &pass, std::shared_ptr<const Program> program);
  Status runTile(Pass &pass, uint32_t rank, uint32_t task, uint32_t worker);
  Status runPut(Pass &pass, const OpInfo &op, uint32_t rank, const format::TileCoord &tile,
                bool combine);

  Status checkBinding(uint32_t rank, Binding b, std::vector<int64_t> dims) const;
  Status checkRoutes(std::vector<RankRoute> *out) const;
  void allocate(Pass &pass);
  void fillLayout(Pass &pass) const;
  /// Gathers every rank's send rows from the bound tensor `source` (x, or dy
  /// times the top-k weights when `weighted`) into the pass's src slot.
  void gatherSendRows(Pass &pass, uint32_t source, bool weighted);
  Status runTasks(Pass &pass);
  Status forward();
  Status backward();
  Status idle() const {
    if (inFlight)
      return Status::error("a submitted pass is still running; call wait() first");
    return Status::success();
  }
};

Status Context::Impl::setUpPass(Pass &pass, std::shared_ptr<const Program> program) {
  pass.program = std::move(program);
  pass.plan = &pass.program->impl().plan;
  const TaskProgram &tasks = pass.tasks();
  for (const format::OpRecord &op : tasks.ops) {
    OpInfo info;
    info.kind = op.kind;
    info.tiling = &tasks.tilings[op.tiling];
    info.wgrad = op.kind == OpKind::Gmm && info.tiling->depth == 0;
    info.transposeB = info.tiling->flags & format::kTilingTransposeB;
    info.accumulate = info.tiling->flags & format::kTilingAccumulate;
    const format::SlotRecord &w =
        tasks.slots[info.wgrad ? info.tiling->outputSlot : info.tiling->inputSlots[1]];
    if (op.kind == OpKind::Gmm)
      info.expertStride = int64_t(w.dims[1] * w.dims[2]);
    pass.ops.push_back(info);
  }
  pass.data.assign(ranks(), std::vector<void *>(tasks.slots.size(), nullptr));

  exec::ExecutorOptions eo;
  eo.workers = workerCount;
  eo.timeout = std::chrono::nanoseconds(
      options.timeoutSeconds > 0 ? int64_t(options.timeoutSeconds * 1e9) : 0);
  eo.trace = options.trace;
  Pass *p = &pass;
  if (options.schedule == Schedule::Fused) {
    std::unique_ptr<exec::Executor> executor;
    if (Status s = exec::Executor::create(
            tasks,
            [this, p](uint32_t rank, uint32_t task, uint32_t worker) {
              return runTile(*p, rank, task, worker);
            },
            eo, &executor);
        !s)
      return s;
    pass.executors.push_back(std::move(executor));
    return Status::success();
  }
  for (uint32_t op = 0; op < tasks.ops.size(); ++op) {
    const uint32_t first = tasks.ops[op].firstTask;
    std::unique_ptr<exec::Executor> executor;
    if (Status s = exec::Executor::create(
            exec::singleOpProgram(tasks, op),
            [this, p, first](uint32_t rank, uint32_t task, uint32_t worker) {
              return runTile(*p, rank, first + task, worker);
            },
            eo, &executor);
        !s)
      return s;
    pass.executors.push_back(std::move(executor));
  }
  return Status::success();
}

Status Context::Impl::runPut(Pass &pass, const OpInfo &op, uint32_t rank,
                             const format::TileCoord &tile, bool combine) {
  const LayerPlan &plan = *pass.plan;
  const uint32_t peer = pass.tasks().peerRank(rank, tile.peer);
  const int64_t i = int64_t(peer) * plan.shape.localExperts + tile.expert;
  const uint32_t sizeSlot = combine ? plan.cSize : plan.dSize;
  const uint32_t srcOffsetSlot = combine ? plan.cSrcOffset : plan.dSrcOffset;
  const uint32_t targetOffsetSlot = combine ? plan.cTargetOffset : plan.dTargetOffset;
  const int64_t count = pass.index(rank, sizeSlot, i);
  const int64_t begin = int64_t(tile.rowBegin);
  const int64_t end = std::min<int64_t>(int64_t(tile.rowEnd), count);
  if (end <= begin)
    return Status::success();
  const uint32_t from = op.tiling->inputSlots[1], to = op.tiling->outputSlot;
  const cpu::ConstMatrix src = pass.in(rank, from);
  const cpu::Matrix dst = pass.out(peer, to);
  const int64_t srcRow = pass.index(rank, srcOffsetSlot, i) + begin;
  const int64_t dstRow = pass.index(rank, targetOffsetSlot, i) + begin;
  const int64_t col = int64_t(tile.colBegin);
  cpu::copyRows(cpu::ConstMatrix{src.address(srcRow, col), src.elt, src.ld},
                cpu::Matrix{dst.address(dstRow, col), dst.elt, dst.ld}, end - begin,
                int64_t(tile.colEnd) - col);
  return Status::success();
}

Status Context::Impl::runTile(Pass &pass, uint32_t rank, uint32_t task, uint32_t worker) {
  const TaskProgram &tasks = pass.tasks();
  const uint32_t opIndex = tasks.tasks[task].op;
  const OpInfo &op = pass.ops[opIndex];
  const TilingRecord &t = *op.tiling;
  const format::TileCoord tile = format::tileCoord(t, task - tasks.ops[opIndex].firstTask);
  if (op.kind == OpKind::Dispatch || op.kind == OpKind::Combine)
    return runPut(pass, op, rank, tile, op.kind == OpKind::Combine);

  // Per-expert ops: the expert's segment from the group list.
  const uint32_t glist = pass.plan->glist;
  const int64_t segEnd = pass.index(rank, glist, tile.expert);
  const int64_t segBegin = tile.expert == 0 ? 0 : pass.index(rank, glist, tile.expert - 1);
  const cpu::Segment segment{segBegin, segEnd - segBegin};
  const cpu::Range rows{int64_t(tile.rowBegin), int64_t(tile.rowEnd)};
  const cpu::Range cols{int64_t(tile.colBegin), int64_t(tile.colEnd)};
  const uint32_t a = t.inputSlots[0], b = t.inputSlots[1], c = t.outputSlot;
  cpu::Scratch *scratch = &this->scratch[worker];

  switch (op.kind) {
  case OpKind::Gmm: {
    cpu::ConstMatrix bm{static_cast<const char *>(pass.data[rank][b]), eltOf(pass.dtype(b)),
                        int64_t(t.ldb)};
    if (op.wgrad) {
      cpu::Matrix cm{static_cast<char *>(pass.data[rank][c]) +
                         op.expertStride * tile.expert * format::dtypeSize(pass.dtype(c)),
                     eltOf(pass.dtype(c)), int64_t(t.ldc)};
      cpu::gmmWgradTile(pass.in(rank, a), pass.in(rank, b), cm, segment, rows, cols,
                        op.accumulate, scratch);
      return Status::success();
    }
    bm.data = static_cast<const char *>(bm.data) +
              op.expertStride * tile.expert * format::dtypeSize(pass.dtype(b));
    if (op.transposeB)
      cpu::gmmDgradTile(pass.in(rank, a), bm, pass.out(rank, c), int64_t(t.depth), segment, rows,
                        cols, scratch);
    else
      cpu::gmmForwardTile(pass.in(rank, a), bm, pass.out(rank, c), int64_t(t.depth), segment,
                          rows, cols, scratch);
    return Status::success();
  }
  case OpKind::Swiglu:
  case OpKind::SwigluGrad: {
    const int64_t end = std::min(rows.end, segment.rows);
    if (end <= rows.begin)
      return Status::success();
    const cpu::Range absolute{segBegin + rows.begin, segBegin + end};
    const int64_t inter = pass.plan->shape.inter;
    if (op.kind == OpKind::Swiglu) {
      cpu::swigluForward(pass.in(rank, a), pass.out(rank, c), inter, absolute, cols);
    } else {
      // Output columns [c0, c1) of dY [., 2I] map to gate/up pairs.
      const int64_t width = int64_t(t.cols);
      const cpu::Range pairs{cols.begin * inter / width, cols.end * inter / width};
      cpu::swigluBackward(pass.in(rank, b), pass.in(rank, a), pass.out(rank, c), inter, absolute,
                          pairs);
    }
    return Status::success();
  }
  default:
    return Status::error(fmt::format("op kind {} has no CPU kernel", int(op.kind)));
  }
}


//===----------------------------------------------------------------------===//
// Prepare, run, finish
//===----------------------------------------------------------------------===//

namespace {

/// The dtype a binding must have.
DType bindingDType(Binding b, const LayerShape &fwd, const LayerShape *bwd) {
  if (b == kDtopk)
    return DType::F32;
  if (b == kDw1 || b == kDw2)
    return bwd ? bwd->weightGrads : DType::F32;
  return fwd.activations;
}

int64_t elementCount(const Tensor &t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t.ndim; ++i)
    n *= t.dims[i];
  return n;
}

} // namespace

Status Context::Impl::checkBinding(uint32_t rank, Binding b, std::vector<int64_t> dims) const {
  const Tensor &t = bound[rank][b];
  if (t.ndim == 0 && t.data == nullptr)
    return Status::error(
        fmt::format("rank {}: tensor '{}' is not bound (bind it first)", rank, kBindingNames[b]));
  const std::vector<int64_t> have(t.dims, t.dims + t.ndim);
  if (have != dims)
    return Status::error(fmt::format("rank {}: tensor '{}' has shape {}; expected [{}]", rank,
                                     kBindingNames[b], shapeString(t), fmt::join(dims, ", ")));
  return Status::success();
}

Status Context::Impl::checkRoutes(std::vector<RankRoute> *out) const {
  const LayerShape &s = shape();
  const uint32_t R = s.ranks, L = s.localExperts, E = s.experts();
  std::vector<RankRoute> routes(R);
  for (uint32_t r = 0; r < R; ++r) {
    const Tensor &idsT = ids[r];
    if (idsT.ndim != 2)
      return Status::error(fmt::format("rank {}: no routing set (setRouting)", r));
    RankRoute &route = routes[r];
    route.tokens = idsT.dims[0];
    route.topK = idsT.dims[1];
    if (route.tokens * route.topK > s.rowCapacity)
      return Status::error(fmt::format(
          "rank {}: routing over capacity: {} tokens x top-{} = {} rows; the binary serves at "
          "most {} rows per rank",
          r, route.tokens, route.topK, route.tokens * route.topK, s.rowCapacity));
    const Status built =
        idsT.dtype == MOEC_I32
            ? cpu::buildRoutingLayout(static_cast<const int32_t *>(idsT.data), route.tokens,
                                      route.topK, E, &route.layout)
            : cpu::buildRoutingLayout(static_cast<const int64_t *>(idsT.data), route.tokens,
                                      route.topK, E, &route.layout);
    if (!built)
      return built.withPrefix(fmt::format("rank {}: ", r));
    const float *w = static_cast<const float *>(weights[r].data);
    route.weights.assign(w, w + route.tokens * route.topK);
  }
  for (uint32_t r = 0; r < R; ++r) {
    int64_t received = 0;
    for (uint32_t e = 0; e < L; ++e) {
      const uint32_t g = r * L + e;
      int64_t rows = 0;
      for (uint32_t q = 0; q < R; ++q) {
        const int64_t n = routes[q].layout.counts[g];
        if (n > s.putCapacity)
          return Status::error(fmt::format(
              "routing over capacity: rank {} sends {} rows to expert {}; the binary's puts "
              "carry at most {} rows from one rank to one expert",
              q, n, g, s.putCapacity));
        rows += n;
      }
      if (rows > s.expertCapacity)
        return Status::error(fmt::format(
            "routing over capacity: expert {} (local expert {} of rank {}) receives {} rows; "
            "the binary serves at most {} rows per expert",
            g, e, r, rows, s.expertCapacity));
      received += rows;
    }
    if (received > s.receiveCapacity)
      return Status::error(fmt::format(
          "routing over capacity: the experts of rank {} receive {} rows; the binary serves "
          "at most {} rows per rank",
          r, received, s.receiveCapacity));
  }
  *out = std::move(routes);
  return Status::success();
}

void Context::Impl::allocate(Pass &pass) {
  if (pass.allocated)
    return;
  const LayerPlan &plan = *pass.plan;
  std::vector<uint32_t> caller = {plan.w1, plan.w2};
  if (plan.shape.backward)
    caller.insert(caller.end(),
                  {plan.dw1, plan.dw2, plan.dispatched, plan.upOut, plan.swigluOut});
  const TaskProgram &tasks = pass.tasks();
  for (uint32_t r = 0; r < ranks(); ++r)
    for (uint32_t slot = 0; slot < tasks.slots.size(); ++slot) {
      if (std::find(caller.begin(), caller.end(), slot) != caller.end())
        continue;
      const size_t bytes = std::max<size_t>(slotBytes(tasks.slots[slot]), 64);
      const size_t rounded = (bytes + 63) / 64 * 64;
      Buffer buffer(static_cast<uint8_t *>(std::aligned_alloc(64, rounded)));
      if (!buffer)
        throw std::bad_alloc();
      std::memset(buffer.get(), 0, rounded);
      pass.data[r][slot] = buffer.get();
      pass.ownedBytes += rounded;
      pass.owned.push_back(std::move(buffer));
    }
  pass.allocated = true;
}

void Context::Impl::fillLayout(Pass &pass) const {
  const LayerPlan &plan = *pass.plan;
  const uint32_t R = ranks(), L = plan.shape.localExperts, E = R * L;
  // rows[r][e]: rows local expert e of rank r receives; start[r][e]: its
  // segment's first row; before[q][g]: rows ranks < q send expert g.
  std::vector<std::vector<int64_t>> rows(R, std::vector<int64_t>(L)), start = rows;
  std::vector<std::vector<int64_t>> before(R, std::vector<int64_t>(E, 0));
  for (uint32_t g = 0; g < E; ++g)
    for (uint32_t q = 0; q < R; ++q) {
      if (q + 1 < R)
        before[q + 1][g] = before[q][g] + routes[q].layout.counts[g];
      rows[g / L][g % L] += routes[q].layout.counts[g];
    }
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t e = 1; e < L; ++e)
      start[r][e] = start[r][e - 1] + rows[r][e - 1];
  const auto targetOffset = [&](uint32_t q, uint32_t g) {
    return start[g / L][g % L] + before[q][g];
  };
  const auto put = [&](uint32_t r, uint32_t slot, int64_t i, int64_t value) {
    storeIndex(pass.data[r][slot], pass.dtype(slot), i, value);
  };
  for (uint32_t r = 0; r < R; ++r) {
    const cpu::RoutingLayout &own = routes[r].layout;
    for (uint32_t g = 0; g < E; ++g) {
      put(r, plan.dSize, g, own.counts[g]);
      put(r, plan.dSrcOffset, g, own.offsets[g]);
      put(r, plan.dTargetOffset, g, targetOffset(r, g));
    }
    for (uint32_t q = 0; q < R; ++q)
      for (uint32_t e = 0; e < L; ++e) {
        const uint32_t g = r * L + e, i = q * L + e;
        put(r, plan.cSize, i, routes[q].layout.counts[g]);
        put(r, plan.cSrcOffset, i, targetOffset(q, g));
        put(r, plan.cTargetOffset, i, routes[q].layout.offsets[g]);
      }
    for (uint32_t e = 0; e < L; ++e)
      put(r, plan.glist, e, start[r][e] + rows[r][e]);
  }
}

Status Context::Impl::runTasks(Pass &pass) {
  const Clock::time_point t0 = Clock::now();
  for (const std::unique_ptr<exec::Executor> &executor : pass.executors) {
    lastExecutor = executor.get();
    if (Status s = executor->run(); !s)
      return s;
  }
  pass.times.tasks = secondsSince(t0);
  return Status::success();
}

namespace {

/// Work items of a per-rank row loop: (rank, piece) with `pieces` pieces per
/// rank, so all threads have work even with one rank.
struct Pieces {
  uint32_t pieces;
  size_t count(uint32_t ranks) const { return size_t(ranks) * pieces; }
  uint32_t rank(size_t item) const { return uint32_t(item / pieces); }
  cpu::Range range(size_t item, int64_t extent) const {
    const int64_t p = int64_t(item % pieces);
    return {p * extent / pieces, (p + 1) * extent / pieces};
  }
};

} // namespace

void Context::Impl::gatherSendRows(Pass &pass, uint32_t source, bool weighted) {
  const cpu::Elt act = eltOf(shape().activations);
  const int64_t H = shape().hidden;
  const Pieces pieces{workerCount};
  parallelFor(workerCount, pieces.count(ranks()), [&](size_t item) {
    const uint32_t r = pieces.rank(item);
    const RankRoute &route = routes[r];
    const cpu::Range part = pieces.range(item, route.tokens * route.topK);
    const cpu::Matrix src = pass.out(r, pass.plan->src);
    cpu::gatherTokenRows(cpu::ConstMatrix{bound[r][source].data, act, H},
                         route.layout.order.data() + part.begin, route.topK,
                         weighted ? route.weights.data() : nullptr,
                         cpu::Matrix{src.address(part.begin, 0), src.elt, src.ld}, part.size(), H);
  });
}

Status Context::Impl::forward() {
  const Clock::time_point t0 = Clock::now();
  const LayerShape &s = shape();
  const int64_t H = s.hidden, I = s.inter, L = s.localExperts;
  std::vector<RankRoute> staged;
  if (Status st = checkRoutes(&staged); !st)
    return st;
  for (uint32_t r = 0; r < ranks(); ++r) {
    const int64_t S = staged[r].tokens;
    for (const auto &[b, dims] : {std::pair<Binding, std::vector<int64_t>>{kX, {S, H}},
                                  {kY, {S, H}},
                                  {kW1, {L, H, 2 * I}},
                                  {kW2, {L, I, H}}})
      if (Status st = checkBinding(r, b, dims); !st)
        return st;
  }

  // Every check passed: from here on, state and outputs change.
  routes = std::move(staged);
  haveForward = false;
  allocate(fwd);
  const LayerPlan &plan = *fwd.plan;
  for (uint32_t r = 0; r < ranks(); ++r) {
    fwd.data[r][plan.w1] = bound[r][kW1].data;
    fwd.data[r][plan.w2] = bound[r][kW2].data;
  }
  fillLayout(fwd);
  const cpu::Elt act = eltOf(s.activations);
  const Pieces pieces{workerCount};
  gatherSendRows(fwd, kX, false);
  fwd.times.prepare = secondsSince(t0);

  if (Status st = runTasks(fwd); !st)
    return st;

  const Clock::time_point t1 = Clock::now();
  parallelFor(workerCount, pieces.count(ranks()), [&](size_t item) {
    const uint32_t r = pieces.rank(item);
    const RankRoute &route = routes[r];
    cpu::combineRows(fwd.in(r, plan.returned), route.layout.position.data(),
                     route.weights.data(), route.topK, cpu::Matrix{bound[r][kY].data, act, H},
                     pieces.range(item, route.tokens), cpu::Range{0, H});
  });
  fwd.times.finish = secondsSince(t1);
  haveForward = true;
  return Status::success();
}

Status Context::Impl::backward() {
  if (!bwd.program)
    return Status::error("this context has no backward program");
  if (!haveForward)
    return Status::error("backward needs a forward pass first: it uses the routing and "
                         "activations the last forward pass saved");
  const Clock::time_point t0 = Clock::now();
  const LayerShape &s = shape();
  const int64_t H = s.hidden, I = s.inter, L = s.localExperts;
  for (uint32_t r = 0; r < ranks(); ++r) {
    const int64_t S = routes[r].tokens, K = routes[r].topK;
    for (const auto &[b, dims] : {std::pair<Binding, std::vector<int64_t>>{kDy, {S, H}},
                                  {kDx, {S, H}},
                                  {kDtopk, {S, K}},
                                  {kW1, {L, H, 2 * I}},
                                  {kW2, {L, I, H}},
                                  {kDw1, {L, H, 2 * I}},
                                  {kDw2, {L, I, H}}})
      if (Status st = checkBinding(r, b, dims); !st)
        return st;
  }

  allocate(bwd);
  const LayerPlan &plan = *bwd.plan;
  const LayerPlan &saved = *fwd.plan;
  for (uint32_t r = 0; r < ranks(); ++r) {
    std::vector<void *> &data = bwd.data[r];
    data[plan.w1] = bound[r][kW1].data;
    data[plan.w2] = bound[r][kW2].data;
    data[plan.dw1] = bound[r][kDw1].data;
    data[plan.dw2] = bound[r][kDw2].data;
    data[plan.dispatched] = fwd.data[r][saved.dispatched];
    data[plan.upOut] = fwd.data[r][saved.upOut];
    data[plan.swigluOut] = fwd.data[r][saved.swigluOut];
  }
  fillLayout(bwd);
  const cpu::Elt act = eltOf(s.activations);
  const Pieces pieces{workerCount};
  gatherSendRows(bwd, kDy, true);
  bwd.times.prepare = secondsSince(t0);

  if (Status st = runTasks(bwd); !st)
    return st;

  const Clock::time_point t1 = Clock::now();
  parallelFor(workerCount, pieces.count(ranks()), [&](size_t item) {
    const uint32_t r = pieces.rank(item);
    const RankRoute &route = routes[r];
    const cpu::Range tokens = pieces.range(item, route.tokens);
    const cpu::ConstMatrix dy{bound[r][kDy].data, act, H};
    cpu::combineRows(bwd.in(r, plan.returned), route.layout.position.data(), nullptr,
                     route.topK, cpu::Matrix{bound[r][kDx].data, act, H}, tokens,
                     cpu::Range{0, H});
    cpu::combineWeightGrad(dy, fwd.in(r, saved.returned), route.layout.position.data(),
                           route.topK, tokens, H, static_cast<float *>(bound[r][kDtopk].data));
  });
  bwd.times.finish = secondsSince(t1);
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
  if (forward->shape().backward)
    return Status::error("the forward program is a backward pass");
  if (backward)
    if (Status s = checkPassesMatch(forward->impl().plan, backward->impl().plan); !s)
      return s;
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->workerCount =
      options.workers ? options.workers : std::max(1u, std::thread::hardware_concurrency());
  impl->scratch = std::vector<cpu::Scratch>(impl->workerCount);
  const uint32_t R = forward->shape().ranks;
  impl->ids.assign(R, Tensor{});
  impl->weights.assign(R, Tensor{});
  impl->bound.assign(R, std::array<Tensor, kBindingCount>{});
  Impl *raw = impl.get();
  if (Status s = raw->setUpPass(raw->fwd, std::move(forward)); !s)
    return s;
  if (backward)
    if (Status s = raw->setUpPass(raw->bwd, std::move(backward)); !s)
      return s;
  out->reset(new Context(std::move(impl)));
  return Status::success();
}

const LayerShape &Context::shape() const { return body->shape(); }
const LayerShape *Context::backwardShape() const {
  return body->bwd.program ? &body->bwd.plan->shape : nullptr;
}
uint32_t Context::ranks() const { return body->ranks(); }
uint32_t Context::workers() const { return body->workerCount; }
const PassTimes &Context::forwardTimes() const { return body->fwd.times; }
const PassTimes &Context::backwardTimes() const { return body->bwd.times; }
size_t Context::workspaceBytes() const { return body->fwd.ownedBytes + body->bwd.ownedBytes; }

Status Context::setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights) {
  if (Status s = body->idle(); !s)
    return s;
  if (rank >= ranks())
    return Status::error(
        fmt::format("rank {} is out of range: the EP group has {} ranks", rank, ranks()));
  const std::string where = fmt::format("rank {}: ", rank);
  if (topkIds.ndim != 2 || topkIds.dims[0] < 0 || topkIds.dims[1] < 1)
    return Status::error(where + fmt::format("topk_ids has shape {}; expected [S, K] with K >= 1",
                                             shapeString(topkIds)));
  if (topkIds.dtype != MOEC_I32 && topkIds.dtype != MOEC_I64)
    return Status::error(where + fmt::format("topk_ids is {}; expected i32 or i64",
                                             format::dtypeName(DType(topkIds.dtype))));
  if (topkWeights.ndim != 2 || topkWeights.dims[0] != topkIds.dims[0] ||
      topkWeights.dims[1] != topkIds.dims[1])
    return Status::error(where + fmt::format("topk_weights has shape {}; expected {} like "
                                             "topk_ids",
                                             shapeString(topkWeights), shapeString(topkIds)));
  if (topkWeights.dtype != MOEC_F32)
    return Status::error(where + fmt::format("topk_weights is {}; expected f32",
                                             format::dtypeName(DType(topkWeights.dtype))));
  if (elementCount(topkIds) > 0 && (!topkIds.data || !topkWeights.data))
    return Status::error(where + "topk_ids or topk_weights has no data");
  body->ids[rank] = topkIds;
  body->weights[rank] = topkWeights;
  return Status::success();
}

Status Context::bind(uint32_t rank, std::string_view name, const Tensor &tensor) {
  if (Status s = body->idle(); !s)
    return s;
  if (rank >= ranks())
    return Status::error(
        fmt::format("rank {} is out of range: the EP group has {} ranks", rank, ranks()));
  const auto *found = std::find(std::begin(kBindingNames), std::end(kBindingNames), name);
  if (found == std::end(kBindingNames))
    return Status::error(fmt::format("rank {}: no tensor is named '{}'; expected one of {}", rank,
                                     name, fmt::join(kBindingNames, ", ")));
  const Binding b = Binding(found - std::begin(kBindingNames));
  const bool backwardOnly = b == kDy || b == kDx || b == kDtopk || b == kDw1 || b == kDw2;
  if (backwardOnly && !body->bwd.program)
    return Status::error(fmt::format("rank {}: '{}' is a backward tensor, and this context has "
                                     "no backward program",
                                     rank, name));
  if (tensor.ndim < 1 || tensor.ndim > MOEC_MAX_DIMS)
    return Status::error(fmt::format("rank {}: '{}' has {} dims", rank, name, tensor.ndim));
  for (int32_t i = 0; i < tensor.ndim; ++i)
    if (tensor.dims[i] < 0)
      return Status::error(
          fmt::format("rank {}: '{}' has a negative dim: {}", rank, name, shapeString(tensor)));
  const DType want = bindingDType(b, shape(), body->bwd.program ? &body->bwd.plan->shape : nullptr);
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
  return body->forward();
}

Status Context::backward() {
  if (Status s = body->idle(); !s)
    return s;
  return body->backward();
}

Status Context::submitForward() {
  if (Status s = body->idle(); !s)
    return s;
  body->inFlight = true;
  body->submitted = std::thread([impl = body.get()] { impl->submittedResult = impl->forward(); });
  return Status::success();
}

Status Context::submitBackward() {
  if (Status s = body->idle(); !s)
    return s;
  body->inFlight = true;
  body->submitted = std::thread([impl = body.get()] { impl->submittedResult = impl->backward(); });
  return Status::success();
}

Status Context::wait() {
  if (!body->inFlight)
    return Status::error("no pass was submitted");
  body->submitted.join();
  body->inFlight = false;
  return body->submittedResult;
}

Status Context::writeTrace(const std::string &path) const {
  if (Status s = body->idle(); !s)
    return s;
  if (!body->options.trace)
    return Status::error("tracing is off (ContextOptions::trace)");
  if (!body->lastExecutor)
    return Status::error("no pass has run yet");
  return body->lastExecutor->writeTrace(path);
}

} // namespace moec::rt

//===----------------------------------------------------------------------===//
// C API
//===----------------------------------------------------------------------===//

struct moec_program {
  std::shared_ptr<const moec::rt::Program> program;
};

struct moec_context {
  std::unique_ptr<moec::rt::Context> context;
};

namespace {

thread_local std::string lastError;

int report(const moec::Status &status) {
  if (status.ok())
    return 0;
  lastError = status.message();
  return 1;
}

/// Runs `fn` (which returns a Status), turning exceptions into errors.
template <typename Fn> int guarded(const Fn &fn) {
  try {
    return report(fn());
  } catch (const std::exception &e) {
    return report(moec::Status::error(std::string("internal error: ") + e.what()));
  }
}

} // namespace

extern "C" {

const char *moec_last_error(void) { return lastError.c_str(); }

int moec_program_load(const char *path, moec_program **out) {
  if (!path || !out)
    return report(moec::Status::error("moec_program_load: null argument"));
  return guarded([&] {
    auto program = std::make_unique<moec_program>();
    if (moec::Status s = moec::rt::Program::load(path, &program->program); !s)
      return s;
    *out = program.release();
    return moec::Status::success();
  });
}

void moec_program_free(moec_program *program) { delete program; }

int moec_context_create(const moec_program *forward, const moec_program *backward,
                        uint32_t workers, double timeout_seconds, moec_context **out) {
  if (!forward || !out)
    return report(moec::Status::error("moec_context_create: null argument"));
  return guarded([&] {
    moec::rt::ContextOptions options;
    options.workers = workers;
    options.timeoutSeconds = timeout_seconds > 0 ? timeout_seconds : 60;
    auto context = std::make_unique<moec_context>();
    if (moec::Status s = moec::rt::Context::create(
            forward->program, backward ? backward->program : nullptr, options, &context->context);
        !s)
      return s;
    *out = context.release();
    return moec::Status::success();
  });
}

void moec_context_free(moec_context *context) { delete context; }

uint32_t moec_context_ranks(const moec_context *context) {
  return context ? context->context->ranks() : 0;
}

int moec_set_routing(moec_context *context, uint32_t rank, const moec_tensor *topk_ids,
                     const moec_tensor *topk_weights) {
  if (!context || !topk_ids || !topk_weights)
    return report(moec::Status::error("moec_set_routing: null argument"));
  return guarded([&] { return context->context->setRouting(rank, *topk_ids, *topk_weights); });
}

int moec_bind(moec_context *context, uint32_t rank, const char *name, const moec_tensor *tensor) {
  if (!context || !name || !tensor)
    return report(moec::Status::error("moec_bind: null argument"));
  return guarded([&] { return context->context->bind(rank, name, *tensor); });
}

#define MOEC_CONTEXT_CALL(fn, method)                                                           \
  int fn(moec_context *context) {                                                               \
    if (!context)                                                                               \
      return report(moec::Status::error(#fn ": null context"));                                 \
    return guarded([&] { return context->context->method(); });                                 \
  }

MOEC_CONTEXT_CALL(moec_forward, forward)
MOEC_CONTEXT_CALL(moec_backward, backward)
MOEC_CONTEXT_CALL(moec_submit_forward, submitForward)
MOEC_CONTEXT_CALL(moec_submit_backward, submitBackward)
MOEC_CONTEXT_CALL(moec_wait, wait)

#undef MOEC_CONTEXT_CALL

} // extern "C"
