//===- Pass.cpp - One pass of a layer binary on the CPU ---------------------===//
//
// See Pass.h. Prepare and finish run on the calling thread plus short-lived
// helpers, cut by rank and token range; every reduction in them has a fixed
// order.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Pass.h"
#include "base/Env.h"
#include "base/Memory.h"
#include "base/Time.h"

#include "runtime/cpu/Fp8.h"
#include "runtime/cpu/Quant.h"
#include "runtime/cpu/Rows.h"
#include "runtime/cpu/Swiglu.h"
#include "runtime/cpu/Tile.h"
#include "runtime/exec/OpByOp.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>


namespace moec::cpu {

using format::OpKind;
using format::TaskProgram;
using format::TilingRecord;

namespace {

int64_t loadIndex(const void *data, DType dtype, int64_t i) {
  return dtype == DType::I32 ? static_cast<const int32_t *>(data)[i]
                             : static_cast<const int64_t *>(data)[i];
}

/// Work items of a per-rank row loop over the local ranks: (rank, piece)
/// with `pieces` pieces per rank, so all threads have work even with one
/// rank.
struct Pieces {
  uint32_t firstRank, pieces;
  size_t count(uint32_t ranks) const { return size_t(ranks) * pieces; }
  uint32_t rank(size_t item) const { return firstRank + uint32_t(item / pieces); }
  Range range(size_t item, int64_t extent) const {
    const int64_t p = int64_t(item % pieces);
    return {p * extent / pieces, (p + 1) * extent / pieces};
  }
};

/// Bytes of a slot's buffer: the slot at its capacity, at least 64, rounded
/// up to a multiple of 64 (each buffer starts on a cache line).
size_t slotBytes(const format::SlotRecord &slot) {
  const size_t bytes =
      std::max<size_t>(size_t(backend::slotElements(slot)) * dtypeSize(slot.dtype), 64);
  return (bytes + 63) / 64 * 64;
}

} // namespace

/// The columns of a quantized weight dequantized at a time: a
/// multiple of the bf16 tile's 48-column panels, and small enough that the
/// part (192 x K values: 768 KiB of bf16 at K 2048) stays in a core's L2
/// while the GEMM reads it. (48 and 192 ran the qwen3 forward alike; 96 no
/// faster.)
constexpr int64_t kWeightColumnChunk = 192;

/// What a pass needs of an op at every tile, precomputed.
struct Pass::OpInfo {
  OpKind kind = OpKind::Gmm;
  const TilingRecord *tiling = nullptr;
  bool wgrad = false, transposeB = false, accumulate = false;
  float scale = 1.0f;                ///< the product's factor (activation form)
  uint32_t addend = format::kNone;   ///< the slot added to an activation-form product
  /// The scales of a quantized weight B (kTilingQuantizedB), or kNone.
  uint32_t weightScales = format::kNone;
  int64_t expertStride = 0; ///< elements per expert of the weight (or dW) tensor
  /// A second, low-rank product (TilingRecord::lowRankSlots): U's and V's
  /// slots, or kNone; V stored transposed; its depth r; elements per
  /// expert of V.
  uint32_t lowU = format::kNone, lowV = format::kNone;
  bool lowTransV = false;
  int64_t lowDepth = 0, lowStride = 0;
  /// Its B is a weight kept packed (PassOptions::packWeights).
  bool packable = false;
  /// The lead product its tiles compute (format::leadOp), or kNone.
  uint32_t lead = format::kNone;
};

struct Pass::PackedWeight {
  std::atomic<int> state{0}; ///< kUnpacked, kPacking or kPacked
  ZeroedPages pages;
};

namespace {
constexpr int kUnpacked = 0, kPacking = 1, kPacked = 2;

/// The row stride of a quantized weight's dequantized part of n columns: K for
/// a transposed B ([n, K]), else n; padded off a multiple of 1 KiB, whose
/// rows would fall into a few cache sets as the GEMM packs them.
int64_t dequantizedStride(bool transposeB, int64_t depth, int64_t n) {
  const int64_t row = transposeB ? depth : n;
  return row % 512 == 0 ? row + 32 : row;
}

/// The packed-weight store's bytes in this process (every pass's), and its
/// limit: MOEC_PACKED_MIB (MiB; unset: none), read once.
std::atomic<size_t> processPackedBytes{0};

size_t packedLimit() {
  static const size_t limit = [] {
    const char *value = envValue("MOEC_PACKED_MIB");
    if (!value)
      return SIZE_MAX;
    char *end = nullptr;
    errno = 0;
    const unsigned long long mib = std::strtoull(value, &end, 10);
    if (*end || errno || value[0] == '-' || mib > (SIZE_MAX >> 20)) {
      std::fprintf(stderr, "moec: %s is not a number of MiB; the packed weights have no limit\n",
                   envShown("MOEC_PACKED_MIB", value).c_str());
      return SIZE_MAX;
    }
    return size_t(mib) << 20;
  }();
  return limit;
}

/// Takes `more` bytes more of the process's packed-weight store (false, and
/// nothing taken, where that would pass its limit), or gives `-more` back.
bool takePacked(ptrdiff_t more) {
  if (more <= 0) {
    processPackedBytes -= size_t(-more);
    return true;
  }
  size_t now = processPackedBytes.load(std::memory_order_relaxed);
  do {
    if (now + size_t(more) > packedLimit())
      return false;
  } while (!processPackedBytes.compare_exchange_weak(now, now + size_t(more)));
  return true;
}
} // namespace

Pass::~Pass() { takePacked(-ptrdiff_t(packedBytes.load())); }

Status Pass::create(const TaskProgram &program, const rt::LayerPlan &plan,
                    const PassOptions &options, std::vector<Scratch> *scratch,
                    std::unique_ptr<Pass> *out) {
  if (!options.fabric)
    return Status::error("a CPU pass needs a fabric");
  std::unique_ptr<Pass> pass(new Pass());
  pass->program = &program;
  pass->layer = &plan;
  pass->options = options;
  pass->scratch = scratch;
  pass->weightScratch = std::make_unique<Scratch[]>(scratch->size());
  pass->leadScratch = std::make_unique<Scratch[]>(scratch->size());
  // The process's team: the executor's workers are its helpers, the loops
  // outside the task queues run on the caller and options.workers - 1 of
  // them. Every layer of the process with this many workers shares it.
  pass->team = exec::ThreadTeam::shared(options.workers + 1);
  for (const format::OpRecord &op : program.ops) {
    OpInfo info;
    info.kind = op.kind;
    info.tiling = &program.tilings[op.tiling];
    info.wgrad = op.kind == OpKind::Gmm && info.tiling->depth == 0;
    info.transposeB = info.tiling->flags & format::kTilingTransposeB;
    info.accumulate = info.tiling->flags & format::kTilingAccumulate;
    if (info.tiling->flags & format::kTilingScale)
      info.scale = info.tiling->scale;
    info.addend = backend::addendSlot(program, op);
    info.weightScales = backend::weightScalesSlot(program, op);
    const format::SlotRecord &w =
        program.slots[info.wgrad ? info.tiling->outputSlot : info.tiling->inputSlots[1]];
    if (op.kind == OpKind::Gmm)
      info.expertStride = int64_t(w.dims[1] * w.dims[2]);
    if (info.tiling->lowRank()) {
      info.lowU = info.tiling->lowRankSlots[0];
      info.lowV = info.tiling->lowRankSlots[1];
      info.lowTransV = info.tiling->flags & format::kTilingLowRankTransposeB;
      info.lowDepth = int64_t(format::lowRankDepth(program, *info.tiling));
      const format::SlotRecord &v = program.slots[info.lowV];
      info.lowStride = int64_t(v.dims[1] * v.dims[2]);
      info.lead = format::leadOp(program, uint32_t(pass->ops.size()));
    }
    if (options.packWeights && op.kind == OpKind::Gmm && !info.wgrad) {
      const uint32_t b = info.tiling->inputSlots[1];
      bool weight = b == plan.w1 || b == plan.w2;
      for (const rt::LoraSlots &l : plan.lora)
        weight = weight || b == l.a || b == l.b;
      // A quantized weight is kept as codes packed for the bf16 tile
      // (packCodes), which decodes them as it reads them. Neither is packed
      // where the tile reads the weight's rows as they lie (tile::dotForm:
      // a weight stored n x k on the AVX-512 micro-kernel; a quantized one
      // there is dequantized a few columns at a time).
      const DType a = program.slots[info.tiling->inputSlots[0]].dtype;
      info.packable = weight &&
                      (info.weightScales == format::kNone ? packedTile(a, program.slots[b].dtype)
                                                          : a == DType::BF16 && packedTile(a, a)) &&
                      !tile::dotForm(false, info.transposeB, a == DType::BF16);
    }
    pass->ops.push_back(info);
  }
  pass->data.assign(program.ranks(), std::vector<void *>(program.slots.size(), nullptr));
  pass->packed.resize(program.ops.size());
  pass->slotGeneration.assign(program.slots.size(), 0);
  pass->sendRows.assign(program.ranks(), 0);
  pass->windowOf.assign(program.slots.size(), nullptr);
  pass->sharesWith = backend::sumsOverAddends(program, plan, slotBytes);

  exec::ExecutorOptions eo;
  eo.workers = options.workers;
  eo.team = pass->team;
  eo.timeout = std::chrono::nanoseconds(
      options.timeoutSeconds > 0
          ? int64_t(std::min(options.timeoutSeconds, kTimeoutMaxSeconds) * 1e9)
          : 0);
  eo.trace = options.trace;
  eo.fabric = options.fabric;
  Pass *p = pass.get();
  if (!options.opByOp) {
    std::unique_ptr<exec::Executor> executor;
    if (Status s = exec::Executor::create(
            program,
            [p](uint32_t rank, uint32_t task, uint32_t worker) {
              return p->runTile(rank, task, worker);
            },
            eo, &executor);
        !s)
      return s;
    pass->executors.push_back(std::move(executor));
  } else {
    for (uint32_t op = 0; op < program.ops.size(); ++op) {
      const uint32_t first = program.ops[op].firstTask;
      std::unique_ptr<exec::Executor> executor;
      if (Status s = exec::Executor::create(
              exec::singleOpProgram(program, op),
              [p, first](uint32_t rank, uint32_t task, uint32_t worker) {
                return p->runTile(rank, first + task, worker);
              },
              eo, &executor);
          !s)
        return s;
      pass->executors.push_back(std::move(executor));
    }
  }
  *out = std::move(pass);
  return Status::success();
}

uint64_t Pass::workspaceNeeded() const {
  return allocated ? 0
                   : backend::workspaceBytes(*program, *layer, options.fabric->localRanks(),
                                             slotBytes, &sharesWith);
}

double Pass::tasksShare() const {
  uint64_t done = 0, total = 0;
  const size_t current = step.load(std::memory_order_relaxed);
  for (size_t k = 0; k < executors.size(); ++k) {
    const uint64_t n = executors[k]->tasksPerPass();
    total += n;
    done += k < current ? n : k == current ? executors[k]->tasksDone() : 0;
  }
  return total ? double(done) / double(total) : 1.0;
}

void Pass::borrowFrom(const backend::Pass &forward) {
  if (!allocated && forward.kind() == backend::Kind::Cpu && &forward != this)
    lender = static_cast<const Pass *>(&forward);
}

namespace {

/// A dead workspace buffer of another pass: a slot of one local rank.
struct Loan {
  uint32_t rank;
  void *memory;
  size_t bytes;
};

} // namespace

Status Pass::allocate() {
  if (allocated)
    return Status::success();
  const rt::LayerPlan &plan = *layer;
  const TaskProgram &tasks = *program;
  comm::Fabric &fabric = *options.fabric;
  // The slots the caller binds (or the forward pass's, for backward): no
  // workspace of their own.
  const std::vector<uint32_t> caller = plan.boundSlots();
  // What it all takes, checked against the machine before any allocation.
  const uint64_t needed = workspaceNeeded();
  const MemoryLimit memory = memoryLimit();
  if (!memory.error.empty())
    return Status::error(memory.error);
  if (memory.bytes > 0 && needed > memory.bytes)
    return Status::error(fmt::format("the {} pass's workspace needs {} in this process; {} {}",
                                     plan.shape.backward ? "backward" : "forward",
                                     memoryText(double(needed)), memory.source,
                                     memoryText(double(memory.bytes))));
  // The slots peers put into: the outputs of the puts.
  std::vector<bool> isWindow(tasks.slots.size(), false);
  for (const OpInfo &op : ops)
    if (format::isPut(op.kind))
      isWindow[op.tiling->outputSlot] = true;
  // The lender's plain slots that are dead between its passes: not bound,
  // not a window, not read by a backward, not layout.
  std::vector<Loan> loans;
  if (lender && lender->allocated) {
    const rt::LayerPlan &theirs = *lender->layer;
    std::vector<uint32_t> live = theirs.boundSlots();
    for (const std::vector<uint32_t> &more : {theirs.readByBackward(), theirs.layoutSlots()})
      live.insert(live.end(), more.begin(), more.end());
    for (uint32_t slot = 0; slot < lender->program->slots.size(); ++slot) {
      // (A slot whose memory a live one was written over is live too; one
      // written over another's has no memory of its own to lend.)
      if (lender->windowOf[slot] || std::find(live.begin(), live.end(), slot) != live.end() ||
          lender->sharesWith[slot] != rt::kNoSlot ||
          std::any_of(live.begin(), live.end(),
                      [&](uint32_t s) { return lender->sharesWith[s] == slot; }))
        continue;
      for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r)
        if (lender->data[r][slot])
          loans.push_back(Loan{r, lender->data[r][slot], slotBytes(lender->program->slots[slot])});
    }
  }
  // The lender's smallest dead buffer of rank r that holds `bytes`, taken.
  const auto borrow = [&](uint32_t r, size_t bytes) -> void * {
    auto best = loans.end();
    for (auto it = loans.begin(); it != loans.end(); ++it)
      if (it->rank == r && it->bytes >= bytes && (best == loans.end() || it->bytes < best->bytes))
        best = it;
    if (best == loans.end())
      return nullptr;
    void *memory = best->memory;
    loans.erase(best);
    return memory;
  };
  std::vector<bool> isLayout(tasks.slots.size(), false);
  for (uint32_t slot : plan.layoutSlots())
    isLayout[slot] = true;
  // Largest slots first, so that they take the largest dead buffers (the
  // same order on every rank: window creation is collective).
  std::vector<uint32_t> order(tasks.slots.size());
  for (uint32_t slot = 0; slot < order.size(); ++slot)
    order[slot] = slot;
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return slotBytes(tasks.slots[a]) > slotBytes(tasks.slots[b]);
  });
  for (uint32_t slot : order) {
    // (A product's sums written over its addend take the addend's memory.)
    if (std::find(caller.begin(), caller.end(), slot) != caller.end() ||
        sharesWith[slot] != rt::kNoSlot)
      continue;
    const size_t bytes = slotBytes(tasks.slots[slot]) * backend::slotCopies(tasks, slot);
    if (isWindow[slot]) {
      std::unique_ptr<comm::Window> window;
      if (Status s = fabric.createWindow(bytes, &window); !s)
        return s.withPrefix(fmt::format("slot '{}': ", tasks.name(tasks.slots[slot].name)));
      for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r)
        data[r][slot] = window->local(r);
      windowOf[slot] = window.get();
      windows.push_back(std::move(window));
      ownedBytes += bytes * fabric.localRanks();
      slotMemory.push_back({slot, bytes * fabric.localRanks(), 0, true, false});
      continue;
    }
    backend::SlotMemory &memory = slotMemory.emplace_back();
    memory.slot = slot;
    memory.layout = isLayout[slot];
    for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r) {
      // A dead buffer of the lender that holds the slot, when there is one.
      memory.bytes += bytes;
      if (void *lent = isLayout[slot] ? nullptr : borrow(r, bytes)) {
        data[r][slot] = lent;
        memory.borrowed = true;
        continue;
      }
      // Zeroed pages, mapped when first written: a slot sized for its
      // capacity holds only the rows a pass fills.
      ZeroedPages pages(bytes);
      if (!pages.data())
        return Status::error(fmt::format("out of memory for slot '{}' ({} bytes)",
                                         tasks.name(tasks.slots[slot].name), bytes));
      data[r][slot] = pages.data();
      owned.push_back(std::move(pages));
      ownedBytes += bytes;
    }
  }
  for (uint32_t slot = 0; slot < sharesWith.size(); ++slot)
    if (sharesWith[slot] != rt::kNoSlot) {
      for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r)
        data[r][slot] = data[r][sharesWith[slot]];
      backend::SlotMemory &memory = slotMemory.emplace_back();
      memory.slot = slot;
      memory.over = sharesWith[slot];
    }
  std::sort(slotMemory.begin(), slotMemory.end(),
            [](const backend::SlotMemory &a, const backend::SlotMemory &b) {
              return a.slot < b.slot;
            });
  allocated = true;
  return Status::success();
}

std::vector<backend::SlotMemory> Pass::workspace() const {
  std::vector<backend::SlotMemory> out = slotMemory;
  const comm::Fabric &fabric = *options.fabric;
  for (backend::SlotMemory &m : out) {
    if (m.borrowed || m.over != rt::kNoSlot)
      continue; // the lender's pages, or the addend's, counted there
    const size_t bytes = slotBytes(program->slots[m.slot]);
    for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r)
      m.resident += residentBytes(data[r][m.slot], bytes);
  }
  return out;
}

Status Pass::fillLayout(const std::vector<RankRoute> &routes) {
  const comm::Fabric &fabric = *options.fabric;
  backend::fillLayoutTensors(*program, *layer, routes, fabric.firstLocal(),
                             fabric.firstLocal() + fabric.localRanks(),
                             [&](uint32_t rank, uint32_t slot) { return data[rank][slot]; });
  sourceStarts.resize(data.size());
  for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r)
    sourceStarts[r] = backend::segmentSourceStarts(*program, *layer, routes, program->epOf(r));
  return Status::success();
}

Status Pass::gatherSendRows(const std::vector<RankRoute> &routes,
                            const std::vector<const void *> &source, bool weighted) {
  const rt::LayerPlan &plan = *layer;
  const Elt act = plan.shape.activations;
  const int64_t H = plan.shape.hidden;
  const comm::Fabric &fabric = *options.fabric;
  const Pieces pieces{fabric.firstLocal(), options.workers};
  const Elt srcElt = program->slots[plan.src].dtype;
  const int64_t srcLd = int64_t(program->slots[plan.src].dims[1]);
  for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r)
    sendRows[r] = routes[r].tokens * routes[r].topK;
  team->run(pieces.count(fabric.localRanks()), [&](size_t item) {
    const uint32_t r = pieces.rank(item);
    const RankRoute &route = routes[r];
    const Range part = pieces.range(item, route.tokens * route.topK);
    const Matrix src{data[r][plan.src], srcElt, srcLd};
    gatherTokenRows(ConstMatrix{source[r], act, H}, route.layout.order.data() + part.begin,
                    route.topK, weighted ? route.weights.data() : nullptr,
                    Matrix{src.address(part.begin, 0), src.elt, src.ld}, part.size(), H);
  }, options.workers);
  return Status::success();
}

Status Pass::runTasks() {
  const Clock::time_point t0 = Clock::now();
  tasksStart = t0;
  taskSpans = trace::Trace();
  comm::Fabric &fabric = *options.fabric;
  preparePackedWeights();
  for (size_t step = 0; step < executors.size(); ++step) {
    const std::unique_ptr<exec::Executor> &executor = executors[step];
    this->step.store(step, std::memory_order_relaxed);
    last = executor.get();
    Status status = executor->run();
    if (options.trace) {
      trace::Trace part = executor->trace();
      part.shift((executor->lastPassStart() - t0).count());
      // Op by op, step k runs op k alone, its tasks numbered from 0 (and
      // has no events, so no waits): number them as the whole program does.
      if (options.opByOp)
        for (trace::TaskSpan &span : part.tasks)
          span.task += program->ops[step].firstTask;
      taskSpans.append(part);
    }
    if (!status)
      return status;
    // Op by op across processes: every put of the op is complete on every
    // rank before the next op starts.
    if (options.opByOp && !fabric.allLocal())
      if (Status s = fabric.barrier(options.timeoutSeconds); !s)
        return s;
  }
  taskTime = secondsSince(t0);
  return Status::success();
}

Status Pass::combine(const std::vector<RankRoute> &routes, const std::vector<void *> &out,
                     bool weighted) {
  const rt::LayerPlan &plan = *layer;
  const Elt act = plan.shape.activations;
  const int64_t H = plan.shape.hidden;
  const comm::Fabric &fabric = *options.fabric;
  const Pieces pieces{fabric.firstLocal(), options.workers};
  const format::SlotRecord &returned = program->slots[plan.returned];
  const int64_t parts = backend::slotCopies(*program, plan.returned);
  team->run(pieces.count(fabric.localRanks()), [&](size_t item) {
    const uint32_t r = pieces.rank(item);
    const RankRoute &route = routes[r];
    combineRows(ConstMatrix{data[r][plan.returned], returned.dtype, int64_t(returned.dims[1])},
                route.layout.position.data(), weighted ? route.weights.data() : nullptr,
                route.topK, Matrix{out[r], act, H}, pieces.range(item, route.tokens),
                Range{0, H}, parts, backend::slotRows(returned));
  }, options.workers);
  return Status::success();
}

Status Pass::topkWeightGrad(const backend::Pass &forward, const std::vector<RankRoute> &routes,
                            const std::vector<const void *> &dy,
                            const std::vector<float *> &out) {
  const rt::LayerPlan &saved = forward.plan();
  const Elt act = layer->shape.activations;
  const int64_t H = layer->shape.hidden;
  const comm::Fabric &fabric = *options.fabric;
  const Pieces pieces{fabric.firstLocal(), options.workers};
  const format::SlotRecord &returned = forward.tasks().slots[saved.returned];
  const int64_t parts = backend::slotCopies(forward.tasks(), saved.returned);
  team->run(pieces.count(fabric.localRanks()), [&](size_t item) {
    const uint32_t r = pieces.rank(item);
    const RankRoute &route = routes[r];
    combineWeightGrad(ConstMatrix{dy[r], act, H},
                      ConstMatrix{forward.slot(r, saved.returned), returned.dtype,
                                  int64_t(returned.dims[1])},
                      route.layout.position.data(), route.topK, pieces.range(item, route.tokens),
                      H, out[r], parts, backend::slotRows(returned));
  }, options.workers);
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Tiles to kernels
//===----------------------------------------------------------------------===//

Status Pass::runPut(const OpInfo &op, uint32_t opIndex, uint32_t rank,
                    const format::TileCoord &tile,
                    bool combine) {
  const rt::LayerPlan &plan = *layer;
  const TaskProgram &tasks = *program;
  const format::TaskProgram::RankRange to = tasks.signalRanks(opIndex, rank, tile.peer);
  const uint32_t peer = tasks.peerRank(rank, tile.peer);
  const int64_t i = int64_t(tasks.epOf(peer)) * plan.shape.localExperts + tile.expert;
  const uint32_t sizeSlot = combine ? plan.cSize : plan.dSize;
  const uint32_t srcOffsetSlot = combine ? plan.cSrcOffset : plan.dSrcOffset;
  const uint32_t targetOffsetSlot = combine ? plan.cTargetOffset : plan.dTargetOffset;
  const auto index = [&](uint32_t slot, int64_t at) {
    return loadIndex(data[rank][slot], tasks.slots[slot].dtype, at);
  };
  const format::TileRows share =
      format::tileRows(*op.tiling, tile, uint64_t(std::max<int64_t>(index(sizeSlot, i), 0)));
  const int64_t begin = int64_t(share.begin), end = int64_t(share.end);
  if (end <= begin)
    return Status::success();
  const uint32_t from = op.tiling->inputSlots[1], output = op.tiling->outputSlot;
  const format::SlotRecord &src = tasks.slots[from], &dst = tasks.slots[output];
  if (src.dtype != dst.dtype)
    return Status::error(fmt::format("a put from {} rows to {} rows", dtypeName(src.dtype),
                                     dtypeName(dst.dtype)));
  const size_t elt = dtypeSize(src.dtype);
  const size_t srcLd = size_t(src.dims[1]) * elt, dstLd = size_t(dst.dims[1]) * elt;
  const int64_t srcRow = index(srcOffsetSlot, i) + begin;
  const int64_t dstRow = index(targetOffsetSlot, i) + begin;
  const size_t col = size_t(tile.colBegin) * elt;
  const char *rows = static_cast<const char *>(data[rank][from]) + size_t(srcRow) * srcLd + col;
  const size_t rowBytes = size_t(tile.colEnd - tile.colBegin) * elt;
  // The rows go where the tile's signals do: to the peer, or for partial
  // sums over TP to each TP rank of the peer, into the block of this rank's
  // TP coordinate.
  const size_t block =
      to.count > 1 ? size_t(backend::slotRows(dst)) * dstLd * tasks.tpOf(rank) : 0;
  for (uint32_t k = 0; k < to.count; ++k)
    if (Status s = options.fabric->put(*windowOf[output], to.first + k,
                                       block + size_t(dstRow) * dstLd + col, dstLd, rows, srcLd,
                                       size_t(end - begin), rowBytes);
        !s)
      return s;
  return Status::success();
}

void Pass::preparePackedWeights() {
  const comm::Fabric &fabric = *options.fabric;
  for (size_t o = 0; o < ops.size(); ++o) {
    if (!ops[o].packable)
      continue;
    const TilingRecord &t = *ops[o].tiling;
    PackedOp &op = packed[o];
    const uint64_t generation = slotGeneration[t.inputSlots[1]];
    const bool stale = op.generation != generation;
    op.generation = generation;
    // Several tiles of a run read each cell (row tiles, peer groups).
    const bool shared = uint64_t(t.rowTiles) * t.peers > 1;
    const size_t cells = size_t(t.experts) * t.colTiles;
    op.ranks.resize(data.size());
    for (uint32_t r = fabric.firstLocal(); r < fabric.firstLocal() + fabric.localRanks(); ++r) {
      PackedRank &rank = op.ranks[r];
      const void *from = data[r][t.inputSlots[1]];
      // A quantized weight's cells hold its scales too (packCodes).
      const void *scales =
          ops[o].weightScales != format::kNone ? data[r][ops[o].weightScales] : nullptr;
      const bool changed = !rank.cells || from != rank.from || scales != rank.fromScales || stale;
      // A weight new to this pass, or changed since its last run, that one
      // tile of the run reads is read as it is: packing it would cost a
      // pass over it that no other tile pays back, and a trained weight
      // changes every step. One unchanged since the last run (a frozen
      // one) is packed.
      rank.now = !changed || shared;
      if (!changed)
        continue;
      if (!rank.cells) {
        rank.cells = std::make_unique<PackedWeight[]>(cells);
      } else {
        for (size_t c = 0; c < cells; ++c)
          rank.cells[c].state.store(kUnpacked, std::memory_order_relaxed);
      }
      rank.from = from;
      rank.fromScales = scales;
    }
  }
}

const void *Pass::packedWeight(uint32_t opIndex, uint32_t rank, const format::TileCoord &tile,
                               ConstMatrix b, int64_t depth) {
  const OpInfo &op = ops[opIndex];
  if (!op.packable || !packed[opIndex].ranks[rank].now)
    return nullptr;
  PackedWeight &cell =
      packed[opIndex].ranks[rank].cells[size_t(tile.expert) * op.tiling->colTiles + tile.colTile];
  int state = cell.state.load(std::memory_order_acquire);
  if (state == kPacked)
    return cell.pages.data();
  if (state != kUnpacked ||
      !cell.state.compare_exchange_strong(state, kPacking, std::memory_order_acq_rel))
    return nullptr;
  const int64_t n = int64_t(tile.colEnd - tile.colBegin);
  const bool bf16 = b.elt == Elt::BF16;
  const bool codes = op.weightScales != format::kNone;
  const QuantizedMatrix m = codes ? quantizedWeight(opIndex, rank, tile.expert) : QuantizedMatrix{};
  const size_t bytes =
      codes ? packedCodesBytes(m, op.transposeB, n) : tile::packedBBytes(n, depth, bf16);
  if (cell.pages.bytes() < bytes) {
    // Past MOEC_PACKED_MIB, or no memory now: this tile and the next read B
    // as it is (and try again).
    const size_t had = cell.pages.bytes();
    if (!takePacked(ptrdiff_t(bytes) - ptrdiff_t(had))) {
      cell.state.store(kUnpacked, std::memory_order_release);
      return nullptr;
    }
    packedBytes -= had;
    cell.pages = ZeroedPages(bytes);
    if (!cell.pages.data()) {
      takePacked(-ptrdiff_t(bytes));
      cell.state.store(kUnpacked, std::memory_order_release);
      return nullptr;
    }
    packedBytes += bytes;
  }
  const int64_t c0 = int64_t(tile.colBegin);
  if (codes)
    packCodes(m, op.transposeB, c0, n, cell.pages.data());
  else
    tile::packB(n, depth, op.transposeB ? b.address(c0, 0) : b.address(0, c0), b.ld, op.transposeB,
                bf16, cell.pages.data());
  cell.state.store(kPacked, std::memory_order_release);
  return cell.pages.data();
}

QuantizedMatrix Pass::quantizedWeight(uint32_t opIndex, uint32_t rank, uint32_t expert) const {
  const TaskProgram &tasks = *program;
  const OpInfo &op = ops[opIndex];
  const LayerShape &shape = layer->shape;
  const uint32_t b = op.tiling->inputSlots[1];
  QuantizedMatrix m;
  m.format = shape.weightFormat;
  m.rows = int64_t(tasks.slots[b].dims[1]);
  m.cols = int64_t(tasks.slots[b].dims[2]);
  m.group = shape.weightGroup;
  m.zeroPoints = shape.weightZeroPoints;
  const std::array<int64_t, 3> dims{1, m.rows, m.cols};
  const std::vector<int64_t> stored = shape.storedDims(dims), scaleDims = shape.scaleDims(dims);
  int64_t scalesPerExpert = 1;
  for (int64_t d : scaleDims)
    scalesPerExpert *= d;
  m.codes = static_cast<const char *>(data[rank][b]) + stored[1] * stored[2] * int64_t(expert);
  m.scales = static_cast<const float *>(data[rank][op.weightScales]) + scalesPerExpert * expert;
  return m;
}

const void *Pass::dequantizeWeightTile(uint32_t opIndex, uint32_t rank, uint32_t expert,
                                       Range cols, DType elt, uint32_t worker) {
  const OpInfo &op = ops[opIndex];
  const QuantizedMatrix m = quantizedWeight(opIndex, rank, expert);
  const int64_t n = cols.end - cols.begin, ld = dequantizedStride(op.transposeB, int64_t(op.tiling->depth), n);
  // Transposed B is stored [N, K]: the tile's rows of it, all of K; else
  // [K, N]: all of K, the tile's columns.
  const size_t values = size_t((op.transposeB ? n : m.rows) * ld);
  void *buffer = weightScratch[worker].floats((values * dtypeSize(elt) + 3) / 4);
  if (op.transposeB)
    dequantize(m, cols.begin, cols.end, 0, m.cols, buffer, elt, ld);
  else
    dequantize(m, 0, m.rows, cols.begin, cols.end, buffer, elt, ld);
  return buffer;
}

Status Pass::runTile(uint32_t rank, uint32_t task, uint32_t worker) {
  const TaskProgram &tasks = *program;
  const uint32_t opIndex = tasks.tasks[task].op;
  const OpInfo &op = ops[opIndex];
  const TilingRecord &t = *op.tiling;
  const format::TileCoord tile = format::tileCoord(t, task - tasks.ops[opIndex].firstTask);
  if (format::isPut(op.kind))
    return runPut(op, opIndex, rank, tile, op.kind == OpKind::Combine);
  if (op.kind == OpKind::Quantize) {
    // Row tiles of the rows to send, up to this pass's count.
    const uint32_t in = t.inputSlots[0], out = t.outputSlot;
    const format::TileRows share =
        format::tileRows(t, tile, uint64_t(std::max<int64_t>(sendRows[rank], 0)));
    if (share.size() > 0)
      quantizeRows(data[rank][in], tasks.slots[in].dtype, int64_t(tasks.slots[in].dims[1]),
                   static_cast<uint8_t *>(data[rank][out]), int64_t(tasks.slots[out].dims[1]),
                   int64_t(share.begin), int64_t(share.end), int64_t(t.cols));
    return Status::success();
  }

  const auto dtype = [&](uint32_t slot) { return tasks.slots[slot].dtype; };
  const auto in = [&](uint32_t slot) {
    return ConstMatrix{data[rank][slot], dtype(slot), int64_t(tasks.slots[slot].dims[1])};
  };
  const auto out = [&](uint32_t slot) {
    return Matrix{data[rank][slot], dtype(slot), int64_t(tasks.slots[slot].dims[1])};
  };

  // Per-expert ops: the expert's segment from the group list.
  const uint32_t glist = layer->glist;
  const int64_t segEnd = loadIndex(data[rank][glist], dtype(glist), tile.expert);
  const int64_t segBegin =
      tile.expert == 0 ? 0 : loadIndex(data[rank][glist], dtype(glist), tile.expert - 1);
  const Segment segment{segBegin, segEnd - segBegin};
  const Range cols{int64_t(tile.colBegin), int64_t(tile.colEnd)};
  const uint32_t a = t.inputSlots[0], b = t.inputSlots[1], c = t.outputSlot;
  Scratch *tileScratch = &(*scratch)[worker];

  if (op.wgrad) { // rows of its result, reduced over the whole segment
    Matrix cm{static_cast<char *>(data[rank][c]) +
                  op.expertStride * tile.expert * dtypeSize(dtype(c)),
              dtype(c), int64_t(t.ldc)};
    gmmWgradTile(in(a), in(b), cm, segment, Range{int64_t(tile.rowBegin), int64_t(tile.rowEnd)},
                 cols, op.accumulate, tileScratch);
    return Status::success();
  }
  // Other ops' rows are rows of the segment, clipped to it or shared out over
  // it (or over the rows of the tile's peer group): up to two runs.
  const uint32_t R = tasks.epRanks;
  const format::TileRowRuns runs = format::peerGroupRows(
      t, tile, tasks.epOf(rank), R, &sourceStarts[rank][size_t(tile.expert) * (R + 1)]);
  for (uint32_t k = 0; k < runs.count; ++k) {
    const Range rows{int64_t(runs.runs[k].begin), int64_t(runs.runs[k].end)};
    const Range absolute{segBegin + rows.begin, segBegin + rows.end};
    switch (op.kind) {
    case OpKind::Gmm: {
      const ConstMatrix bm{static_cast<const char *>(data[rank][b]) +
                               op.expertStride * tile.expert * dtypeSize(dtype(b)),
                           dtype(b), int64_t(t.ldb)};
      Epilogue epilogue;
      epilogue.scale = op.scale;
      if (op.addend != format::kNone)
        epilogue.addend = in(op.addend);
      if (op.lowU != format::kNone) {
        epilogue.lowU = in(op.lowU);
        epilogue.lowV = ConstMatrix{static_cast<const char *>(data[rank][op.lowV]) +
                                        op.lowStride * tile.expert * dtypeSize(dtype(op.lowV)),
                                    dtype(op.lowV), int64_t(tasks.slots[op.lowV].dims[2])};
        epilogue.lowDepth = op.lowDepth;
        epilogue.lowTransV = op.lowTransV;
      }
      // The rows of the segment this run has (none: a tile past the expert's
      // last row, which leaves the packing to one that has them).
      const Range clipped{std::max<int64_t>(rows.begin, 0), std::min(rows.end, segment.rows)};
      const bool work = clipped.end > clipped.begin;
      if (op.lead != format::kNone) {
        // The lead product's tile: this one's rows (validated: the lead's
        // grid is this one's rows in one column tile). The first column
        // tile writes U; the others compute a copy of their own.
        const OpInfo &lead = ops[op.lead];
        const uint32_t lb = lead.tiling->inputSlots[1];
        const format::TileCoord leadTile =
            format::tileCoord(*lead.tiling, (task - tasks.ops[opIndex].firstTask) / t.colTiles);
        epilogue.leadU = out(op.lowU);
        if (tile.colTile != 0) {
          const int64_t ld = op.lowDepth, count = std::max<int64_t>(clipped.end - clipped.begin, 1);
          epilogue.leadU = Matrix{
              leadScratch[worker].floats(size_t(count * ld * dtypeSize(dtype(op.lowU)) + 3) / 4),
              dtype(op.lowU), ld};
          epilogue.lowU = ConstMatrix{epilogue.leadU.data, epilogue.leadU.elt, ld};
          epilogue.uFirstRow = segBegin + clipped.begin;
        }
        epilogue.leadB = ConstMatrix{static_cast<const char *>(data[rank][lb]) +
                                         lead.expertStride * tile.expert * dtypeSize(dtype(lb)),
                                     dtype(lb), int64_t(lead.tiling->ldb)};
        epilogue.leadTransB = lead.transposeB;
        epilogue.leadScale = lead.scale;
        epilogue.leadPackedB = work ? packedWeight(op.lead, rank, leadTile, epilogue.leadB,
                                                   int64_t(lead.tiling->depth))
                                    : nullptr;
      }
      const auto gemm = [&](ConstMatrix weight, Matrix result, Range resultCols,
                            const void *packedB, const tile::DecodedB *decodedB = nullptr) {
        if (op.transposeB)
          gmmDgradTile(in(a), weight, result, int64_t(t.depth), segment, rows, resultCols,
                       tileScratch, epilogue, packedB, decodedB);
        else
          gmmForwardTile(in(a), weight, result, int64_t(t.depth), segment, rows, resultCols,
                         tileScratch, epilogue, packedB, decodedB);
      };
      const void *packedB =
          work ? packedWeight(opIndex, rank, tile, bm, int64_t(t.depth)) : nullptr;
      if (op.weightScales == format::kNone) {
        gemm(bm, out(c), cols, packedB);
        break;
      }
      // Quantized codes packed for the tile (the packed-weight store): it
      // decodes each depth block's panel straight from them.
      if (packedB) {
        const tile::DecodedB decoded = packedCodesB(packedB);
        gemm(ConstMatrix{nullptr, DType::BF16, 0}, out(c), cols, nullptr, &decoded);
        break;
      }
      // Quantized codes with their scales on moec's bf16 tile, B as stored
      // (the backward's dX and dA), or on AMX tiles either way: the tile
      // decodes each depth block's panel of B as it goes; B transposed (the
      // forward's) on the AVX-512 micro-kernel where the swapped form takes
      // it, which decodes 16 rows of B a depth block at a time as its
      // micro-kernel's rows (1.06-1.18x the copy below: `gmm_bench
      // --quantized`, the log, 2026-11-30; through panels that way it ran
      // 2-5% slower than the copy; on AMX 15-30% faster).
      const bool swapsDecoded = op.transposeB && op.scale == 1.0f && op.addend == format::kNone &&
                                tile::swappedForm(cols.size(), int64_t(t.depth), false, true, true);
      if ((!op.transposeB || tile::amx() || swapsDecoded) && dtype(a) == DType::BF16 &&
          packedTile(DType::BF16, DType::BF16)) {
        const QuantizedMatrix codes = quantizedWeight(opIndex, rank, tile.expert);
        const tile::DecodedB decoded = decodedB(codes);
        gemm(ConstMatrix{codes.codes, DType::BF16, 0}, out(c), cols, nullptr, &decoded);
        break;
      }
      // Else a few columns at a time, the
      // part of the expert's B they read dequantized to the activations' dtype (it
      // stays in cache while the GEMM reads it), then multiplied as a dense
      // B of their own; C is addressed from their first column. Each
      // column's sums are those of one call over all the columns. (A
      // low-rank V is addressed from the chunk's first column too.)
      const ConstMatrix lowV = epilogue.lowV;
      for (int64_t c0 = cols.begin; c0 < cols.end; c0 += kWeightColumnChunk) {
        const Range chunk{c0, std::min(cols.end, c0 + kWeightColumnChunk)};
        const int64_t n = chunk.end - chunk.begin;
        Matrix cm = out(c);
        cm.data = static_cast<char *>(cm.data) + size_t(chunk.begin) * dtypeSize(dtype(c));
        if (lowV.data)
          epilogue.lowV.data =
              lowV.address(op.lowTransV ? chunk.begin : 0, op.lowTransV ? 0 : chunk.begin);
        gemm(ConstMatrix{dequantizeWeightTile(opIndex, rank, tile.expert, chunk, dtype(a), worker),
                         dtype(a), dequantizedStride(op.transposeB, int64_t(t.depth), n)},
             cm, Range{0, n}, nullptr);
        epilogue.leadB = ConstMatrix{}; // a lead product's U: written by the first chunk
      }
      break;
    }
    case OpKind::Dequantize:
      dequantizeRows(static_cast<const uint8_t *>(data[rank][a]), int64_t(tasks.slots[a].dims[1]),
                     data[rank][c], dtype(c), int64_t(tasks.slots[c].dims[1]), absolute.begin,
                     absolute.end, int64_t(t.cols));
      break;
    case OpKind::Swiglu:
      swigluForward(in(a), out(c), layer->shape.inter, absolute, cols);
      break;
    case OpKind::SwigluGrad: {
      // Output columns [c0, c1) of dY [., 2I] map to gate/up pairs.
      const int64_t inter = layer->shape.inter, width = int64_t(t.cols);
      const Range pairs{cols.begin * inter / width, cols.end * inter / width};
      swigluBackward(in(b), in(a), out(c), inter, absolute, pairs);
      break;
    }
    default:
      return Status::error(fmt::format("op kind {} has no CPU kernel", int(op.kind)));
    }
  }
  return Status::success();
}

} // namespace moec::cpu
