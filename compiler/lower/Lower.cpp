//===- Lower.cpp - A split-propagated graph to a task program -------------===//

#include "compiler/lower/Lower.h"

#include "compiler/ir/GraphUtils.h"

#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/SmallPtrSet.h"
#include "llvm/ADT/StringMap.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>

using namespace mlir;
using namespace moec::format;

namespace moec::lower {

std::optional<Granularity> parseGranularity(std::string_view text) {
  if (text == "per-expert")
    return Granularity::PerExpert;
  if (text == "per-tile-range")
    return Granularity::PerTileRange;
  return std::nullopt;
}

const char *granularityName(Granularity granularity) {
  return granularity == Granularity::PerExpert ? "per-expert" : "per-tile-range";
}

namespace {

using moe::GraphOp;
using moe::MoeTensorType;
using moe::TaskOpInterface;

/// What the lowering keeps of one op.
struct LoweredOp {
  std::string name;
  uint32_t index = 0;     ///< in program.ops
  uint32_t firstTask = 0; ///< in program.tasks
  uint32_t tasks = 0;
  uint32_t perExpertTiles = 0;
  bool isPut = false; ///< dispatch/combine: tile p goes to peer offset p
  /// A reduce_tp combine: each tile's signals reach the T TP ranks of its
  /// peer, so an event it signals counts each tile T times.
  uint32_t fanOut = 1;
};

class Lowering {
public:
  Lowering(GraphOp graph, const LowerOptions &options, TaskProgram &program)
      : graph(graph), options(options), p(program) {}

  LogicalResult run() {
    for (NamedAttribute a : graph.getBindingsAttr())
      bindings[a.getName().str()] = a.getValue().cast<IntegerAttr>().getInt();
    p.epRanks = uint32_t(bindings.at("ep"));
    p.tpRanks = uint32_t(bindings.at("tp"));
    p.localExperts = uint32_t(bindings.at("single_rank_expert_num"));
    p.target = p.addString(options.profile.name);
    p.layer = options.layer;
    if (bindings.at("dtype_size") == 2)
      p.flags |= kFlagBf16;

    if (failed(lowerSlots()))
      return failure();
    SmallVector<TaskOpInterface> order;
    if (failed(moe::topologicalOrder(graph, order)))
      return failure();
    if (options.leadProducts)
      findLeads(order);
    for (TaskOpInterface op : order)
      if (failed(lowerOp(op)))
        return failure();
    lowerEvents(order);
    lowerTerminate(order);
    packWaitsAndSignals();
    return success();
  }

private:
  //===--------------------------------------------------------------------===//
  // Slots
  //===--------------------------------------------------------------------===//

  static std::optional<DType> dtypeOf(Type type) {
    if (type.isF32())
      return DType::F32;
    if (type.isBF16())
      return DType::BF16;
    if (type.isInteger(32))
      return DType::I32;
    if (type.isInteger(64))
      return DType::I64;
    if (type.isa<Float8E4M3FNType>())
      return DType::F8E4M3;
    if (type.isInteger(8))
      return DType::I8;
    if (type.isInteger(4))
      return DType::I4;
    return std::nullopt;
  }

  static MoeTensorType typeOf(Value v) { return v.getType().cast<MoeTensorType>(); }

  static uint64_t dim(Value v, unsigned i) { return uint64_t(*typeOf(v).getDimValue(i)); }

  LogicalResult lowerSlots() {
    for (Operation &raw : graph.getBlock()) {
      auto def = cast<moe::TensorDefOpInterface>(&raw);
      MoeTensorType type = def.getTensor().getType();
      if (type.getRank() > kMaxTensorRank)
        return raw.emitError() << "tensor '" << def.getResultName() << "' has rank "
                               << type.getRank() << "; a task binary holds at most "
                               << kMaxTensorRank;
      std::optional<DType> dtype = dtypeOf(type.getElementType());
      if (!dtype)
        return raw.emitError() << "tensor '" << def.getResultName()
                               << "' has no bound element type: run moe-resolve-shapes first";
      SlotRecord slot;
      slot.name = p.addString(def.getResultName());
      slot.param = uint32_t(*def.getSlot());
      slot.dtype = *dtype;
      slot.rank = uint8_t(type.getRank());
      for (unsigned i = 0; i < type.getRank(); ++i)
        slot.dims[i] = uint64_t(*type.getDimValue(i));
      if (type.getIsList())
        slot.flags |= kSlotList;
      if (type.getIsDynamic()) {
        slot.flags |= kSlotDynamic;
        if (options.layer)
          slot.dims[0] = uint64_t(options.layer->receiveCapacity);
        slot.capacityRows = slot.dims[0];
      }
      slotOf[def.getTensor()] = uint32_t(p.slots.size());
      p.slots.push_back(slot);
    }
    return success();
  }

  //===--------------------------------------------------------------------===//
  // Ops, tilings, tasks
  //===--------------------------------------------------------------------===//

  static OpKind kindOf(Operation *op) {
    if (isa<moe::DispatchOp>(op))
      return OpKind::Dispatch;
    if (isa<moe::CombineOp>(op))
      return OpKind::Combine;
    if (isa<moe::GmmOp>(op))
      return OpKind::Gmm;
    if (isa<moe::SwigluOp>(op))
      return OpKind::Swiglu;
    if (isa<moe::QuantizeOp>(op))
      return OpKind::Quantize;
    if (isa<moe::DequantizeOp>(op))
      return OpKind::Dequantize;
    return OpKind::SwigluGrad;
  }

  /// Rows a segment of `parts` per rank holds under balanced routing:
  /// per_rank_seq / parts, rounded up.
  uint32_t balancedRows(int64_t parts) const {
    int64_t rows = bindings.at("per_rank_seq");
    return uint32_t(std::max<int64_t>(1, (rows + parts - 1) / parts));
  }

  //===--------------------------------------------------------------------===//
  // Lead products
  //===--------------------------------------------------------------------===//

  /// Whether `op` is reached from `from` by data flow (operands' producers).
  static bool feeds(Operation *from, Operation *op) {
    SmallVector<Operation *> stack = {op};
    llvm::SmallPtrSet<Operation *, 16> seen;
    while (!stack.empty()) {
      Operation *at = stack.pop_back_val();
      if (at == from)
        return true;
      if (!seen.insert(at).second)
        continue;
      for (Value v : at->getOperands())
        if (Operation *def = v.getDefiningOp())
          stack.push_back(def);
    }
    return false;
  }

  /// The GMMs lowered as lead products of their hosts (LowerOptions::
  /// leadProducts): a host with a low-rank product whose U a GMM writes
  /// from the host's own A and group list, with no addend, quantized
  /// weight, transposed A or low-rank product, on the host's row grid in
  /// one column tile, rows shared out alike, as wide as U, and whose
  /// other readers the host does not depend on (they wait for the host's
  /// tiles instead).
  void findLeads(ArrayRef<TaskOpInterface> order) {
    for (TaskOpInterface op : order) {
      auto host = dyn_cast<moe::GmmOp>(op.getOperation());
      if (!host || !host.hasLowRank())
        continue;
      auto lead = host.getLowLhs().getDefiningOp<moe::GmmOp>();
      if (!lead || lead.isWeightGradient() || lead.hasLowRank() || lead.getAddend() ||
          lead.getTransposeLhs() || lead.getAccumulate() || lead.getLhs() != host.getLhs() ||
          lead.getGroupList() != host.getGroupList() ||
          moe::isQuantizedWeightType(typeOf(lead.getRhs()).getElementType()))
        continue;
      auto leadOp = cast<TaskOpInterface>(lead.getOperation());
      auto g = leadOp.getGridAttr(), h = op.getGridAttr();
      if (!g || !h || g.size() != 6 || h.size() != 6 || g[0] != h[0] || g[1] != h[1] ||
          g[2] != h[2] || g[4] != h[4] || g[3] != 1 || leadOp.isAutoSplit() != op.isAutoSplit() ||
          uint64_t(g[5]) != dim(host.getLowLhs(), 1))
        continue;
      bool cycle = false;
      for (Operation *user : lead.getResult().getUsers())
        cycle = cycle || (user != host.getOperation() && feeds(user, host.getOperation()));
      if (cycle)
        continue;
      hostOf[leadOp.getOpName()] = op.getOpName().str();
    }
  }

  LogicalResult lowerOp(TaskOpInterface op) {
    Operation *raw = op;
    auto grid = op.getGridAttr();
    if (!grid || grid.size() != 6 || !op.getTasks())
      return raw->emitError() << "'" << op.getOpName()
                              << "' has no tile grid: run moe-propagate-splits first";
    ArrayRef<int64_t> g = grid.asArrayRef();
    if (*op.getTasks() > kNone - p.tasks.size())
      return raw->emitError() << "'" << op.getOpName() << "': " << *op.getTasks()
                              << " tasks overflow the 32-bit task indices of a task binary";
    // A gmm's low-rank pair (its last two operands) goes to lowRankSlots.
    auto asGmm = dyn_cast<moe::GmmOp>(raw);
    const bool lowRank = asGmm && asGmm.hasLowRank();
    const unsigned inputs = raw->getNumOperands() - (lowRank ? 2 : 0);
    if (inputs > kMaxTilingInputs)
      return raw->emitError() << "'" << op.getOpName() << "' has " << inputs
                              << " inputs; a tiling descriptor names at most " << kMaxTilingInputs;

    OpKind kind = kindOf(raw);
    Value result = raw->getResult(0);
    TilingRecord t;
    t.opKind = kind;
    t.experts = uint32_t(g[0]);
    t.peers = uint32_t(g[1]);
    t.rowTiles = uint32_t(g[2]);
    t.colTiles = uint32_t(g[3]);
    t.rows = uint64_t(g[4]);
    t.cols = uint64_t(g[5]);
    t.outputSlot = slotOf.lookup(result);
    t.inputCount = uint8_t(inputs);
    for (unsigned i = 0; i < inputs; ++i)
      t.inputSlots[i] = slotOf.lookup(raw->getOperand(i));
    if (lowRank) {
      t.lowRankSlots[0] = slotOf.lookup(asGmm.getLowLhs());
      t.lowRankSlots[1] = slotOf.lookup(asGmm.getLowRhs());
      if (asGmm.getTransposeLowRhs())
        t.flags |= kTilingLowRankTransposeB;
    }
    t.tileM = options.profile.tileM;
    t.tileN = options.profile.tileN;
    t.tileK = options.profile.tileK;
    t.ldc = uint32_t(dim(result, typeOf(result).getRank() - 1));
    t.dtype = *dtypeOf(typeOf(result).getElementType());
    t.balancedRows = balancedRows(int64_t(t.experts) * t.peers);
    auto last = [&](Value v) { return uint32_t(dim(v, typeOf(v).getRank() - 1)); };
    if (auto gmm = dyn_cast<moe::GmmOp>(raw)) {
      t.dtype = *dtypeOf(typeOf(gmm.getLhs()).getElementType());
      t.lda = last(gmm.getLhs());
      t.ldb = last(gmm.getRhs());
      if (gmm.getTransposeLhs())
        t.flags |= kTilingTransposeA;
      if (gmm.getTransposeRhs())
        t.flags |= kTilingTransposeB;
      if (gmm.getAccumulate())
        t.flags |= kTilingAccumulate;
      if (moe::isQuantizedWeightType(typeOf(gmm.getRhs()).getElementType()))
        t.flags |= kTilingQuantizedB;
      if (Attribute scale = gmm.getScaleAttr()) {
        auto number = scale.dyn_cast<FloatAttr>();
        if (!number)
          return raw->emitError() << "'" << op.getOpName() << "' has a symbolic scale ("
                                  << scale << "): run moe-resolve-shapes first";
        t.flags |= kTilingScale;
        t.scale = float(number.getValueAsDouble());
      }
      if (gmm.isWeightGradient()) {
        t.depth = 0; // the expert's rows, known at run time
        t.balancedRows = balancedRows(t.experts);
        p.flags |= kFlagBackward;
      } else {
        t.depth = dim(gmm.getRhs(), gmm.getTransposeRhs() ? 2 : 1);
      }
    } else if (auto grad = dyn_cast<moe::SwigluGradOp>(raw)) {
      t.lda = last(grad.getGrad());
      t.ldb = last(grad.getInput());
      p.flags |= kFlagBackward;
    } else if (kind == OpKind::Swiglu || kind == OpKind::Quantize ||
               kind == OpKind::Dequantize) {
      t.lda = last(raw->getOperand(0));
    } else { // a put: A is the source rows
      t.lda = last(raw->getOperand(1));
    }
    if (!(kind == OpKind::Gmm && t.depth == 0)) {
      t.balancedRows = uint32_t(std::min<uint64_t>(t.balancedRows, t.rows));
      // A split the compiler chose shares out the rows present.
      if (op.isAutoSplit())
        t.flags |= kTilingShareRows;
    }

    LoweredOp lowered;
    lowered.name = op.getOpName().str();
    lowered.index = uint32_t(p.ops.size());
    lowered.firstTask = uint32_t(p.tasks.size());
    const bool lead = hostOf.count(op.getOpName()) > 0;
    lowered.tasks = lead ? 0 : uint32_t(*op.getTasks());
    lowered.perExpertTiles = uint32_t(t.tileCount() / t.experts);
    lowered.isPut = isPut(kind);
    // With T = 1 a reduce_tp combine has no partial sums: a plain combine.
    if (auto combine = dyn_cast<moe::CombineOp>(raw);
        combine && combine.getReduceTp() && p.tpRanks > 1) {
      t.flags |= kTilingReduceTp;
      lowered.fanOut = p.tpRanks;
    }
    if (!lead && t.tileCount() != lowered.tasks)
      return raw->emitError() << "'" << op.getOpName() << "': its grid has " << t.tileCount()
                              << " tiles but it has " << lowered.tasks << " tasks";

    OpRecord record;
    record.name = p.addString(op.getOpName());
    record.kind = kind;
    record.firstTask = lowered.firstTask;
    record.taskCount = lowered.tasks;
    record.tiling = uint32_t(p.tilings.size());
    p.tilings.push_back(t);
    p.ops.push_back(record);
    TaskRecord task;
    task.op = lowered.index;
    task.coreKind = op.isCubeWork() ? CoreKind::Cube : CoreKind::Vector;
    p.tasks.insert(p.tasks.end(), lowered.tasks, task);
    byName[op.getOpName()] = lowered;
    return success();
  }

  //===--------------------------------------------------------------------===//
  // Events
  //===--------------------------------------------------------------------===//

  /// Returns the event that producer tiles [first, last] of `producer`
  /// signal, creating it (and the producer tiles' signals) on first use. Its
  /// name: "op[first..last]", or with `expert` (>= 0) "op.e<expert>".
  uint32_t rangeEvent(const LoweredOp &producer, uint32_t first, uint32_t last,
                      int64_t expert = -1) {
    auto key = std::make_tuple(producer.index, first, last);
    auto [it, inserted] = eventOf.try_emplace(key, uint32_t(p.events.size()));
    if (!inserted)
      return it->second;
    EventRecord event;
    event.name = p.addString(expert >= 0 ? fmt::format("{}.e{}", producer.name, expert)
                             : first == last
                                 ? fmt::format("{}[{}]", producer.name, first)
                                 : fmt::format("{}[{}..{}]", producer.name, first, last));
    event.kind = producer.isPut ? EventKind::CrossRank : EventKind::Local;
    event.op = producer.index;
    event.threshold = (last - first + 1) * producer.fanOut;
    p.events.push_back(event);
    const TilingRecord &tiling = p.tilings[p.ops[producer.index].tiling];
    for (uint32_t t = first; t <= last; ++t) {
      uint32_t peer = producer.isPut ? tileCoord(tiling, t).peer : 0;
      taskSignals.push_back({producer.firstTask + t, {it->second, 1, peer, 0}});
    }
    return it->second;
  }

  void lowerEvents(ArrayRef<TaskOpInterface> order) {
    for (TaskOpInterface op : order) {
      const LoweredOp &consumer = byName[op.getOpName()];
      for (Attribute a : op.getDepsAttr()) {
        auto map = a.cast<moe::TileMapAttr>();
        // A lead product's tiles are its host's (the same grid): its host
        // waits for nothing of it, its other readers for the host's tiles.
        // (lead tile i: host tile i * colTiles, the one that writes U's rows).
        StringRef producerName = map.getProducer().getValue();
        uint32_t stride = 1;
        if (auto host = hostOf.find(producerName); host != hostOf.end()) {
          if (host->second == op.getOpName())
            continue;
          producerName = host->second;
          stride = p.tilings[p.ops[byName[producerName].index].tiling].colTiles;
        }
        if (hostOf.count(op.getOpName()))
          continue; // a lead product waits in its host's tasks
        const LoweredOp &producer = byName[producerName];
        SmallVector<int64_t> firstTiles(map.getFirst()), lastTiles(map.getLast());
        for (size_t j = 0; j < firstTiles.size(); ++j)
          if (lastTiles[j] >= firstTiles[j]) {
            firstTiles[j] *= stride;
            lastTiles[j] *= stride;
          }
        ArrayRef<int64_t> first = firstTiles, last = lastTiles;
        for (uint32_t j = 0; j < consumer.tasks; ++j) {
          if (last[j] < first[j])
            continue; // needs nothing
          const uint32_t task = consumer.firstTask + j;
          auto wait = [&](uint32_t event) {
            taskWaits.push_back({task, {event, p.events[event].threshold}});
          };
          if (options.granularity == Granularity::PerTileRange) {
            wait(rangeEvent(producer, uint32_t(first[j]), uint32_t(last[j])));
            continue;
          }
          uint32_t per = producer.perExpertTiles;
          for (uint32_t e = uint32_t(first[j]) / per; e <= uint32_t(last[j]) / per; ++e)
            wait(rangeEvent(producer, e * per, (e + 1) * per - 1, e));
        }
      }
    }
  }

  /// The terminate event: every tile of an op whose result no op reads
  /// signals it, a put on the rank it returns rows to.
  void lowerTerminate(ArrayRef<TaskOpInterface> order) {
    EventRecord event;
    event.name = p.addString("terminate");
    event.kind = EventKind::Terminate;
    uint32_t index = uint32_t(p.events.size());
    for (TaskOpInterface op : order) {
      Operation *raw = op;
      bool read = llvm::any_of(raw->getResult(0).getUsers(),
                               [](Operation *user) { return isa<TaskOpInterface>(user); });
      if (read)
        continue;
      const LoweredOp &sink = byName[op.getOpName()];
      const TilingRecord &tiling = p.tilings[p.ops[sink.index].tiling];
      for (uint32_t t = 0; t < sink.tasks; ++t) {
        uint32_t peer = sink.isPut ? tileCoord(tiling, t).peer : 0;
        taskSignals.push_back({sink.firstTask + t, {index, 1, peer, 0}});
        event.threshold += sink.fanOut;
      }
    }
    p.events.push_back(event);
  }

  /// The records of `entries` grouped by task, each task's in the order
  /// they were added: task t's are [begin[t], begin[t + 1]).
  template <typename Record>
  void byTask(const std::vector<std::pair<uint32_t, Record>> &entries,
              std::vector<uint32_t> &begin, std::vector<Record> &records) const {
    begin.assign(p.tasks.size() + 1, 0);
    for (const auto &entry : entries)
      ++begin[entry.first + 1];
    for (size_t t = 0; t < p.tasks.size(); ++t)
      begin[t + 1] += begin[t];
    records.resize(entries.size());
    std::vector<uint32_t> fill(begin.begin(), begin.end() - 1);
    for (const auto &entry : entries)
      records[fill[entry.first]++] = entry.second;
  }

  /// Gives every task its waits and signals, the waits sorted and without
  /// repeats, the signals in the order they were added, and lets tasks with
  /// the same lists share one copy of them (a list's key is its records'
  /// bytes: the records have no padding).
  void packWaitsAndSignals() {
    std::vector<uint32_t> waitBegin, signalBegin;
    std::vector<WaitRecord> waitRecords;
    std::vector<SignalRecord> signalRecords;
    byTask(taskWaits, waitBegin, waitRecords);
    byTask(taskSignals, signalBegin, signalRecords);
    // The keys view the records in place: the two vectors are not resized
    // from here on.
    std::unordered_map<std::string_view, uint32_t> waitLists, signalLists;
    waitLists.reserve(p.tasks.size());
    signalLists.reserve(p.tasks.size());
    auto bytesOf = [](const auto *records, size_t count) {
      return std::string_view(reinterpret_cast<const char *>(records), count * sizeof(*records));
    };
    for (size_t t = 0; t < p.tasks.size(); ++t) {
      WaitRecord *waits = waitRecords.data() + waitBegin[t];
      WaitRecord *waitsEnd = waitRecords.data() + waitBegin[t + 1];
      std::sort(waits, waitsEnd, [](const WaitRecord &a, const WaitRecord &b) {
        return std::tie(a.event, a.threshold) < std::tie(b.event, b.threshold);
      });
      const size_t waitCount = size_t(std::unique(waits, waitsEnd) - waits);
      auto [it, inserted] =
          waitLists.try_emplace(bytesOf(waits, waitCount), uint32_t(p.waits.size()));
      if (inserted)
        p.waits.insert(p.waits.end(), waits, waits + waitCount);
      p.tasks[t].firstWait = waitCount == 0 ? 0 : it->second;
      p.tasks[t].waitCount = uint32_t(waitCount);

      const SignalRecord *signals = signalRecords.data() + signalBegin[t];
      const size_t signalCount = signalBegin[t + 1] - signalBegin[t];
      auto [sit, sinserted] =
          signalLists.try_emplace(bytesOf(signals, signalCount), uint32_t(p.signals.size()));
      if (sinserted)
        p.signals.insert(p.signals.end(), signals, signals + signalCount);
      p.tasks[t].firstSignal = signalCount == 0 ? 0 : sit->second;
      p.tasks[t].signalCount = uint32_t(signalCount);
    }
  }

  GraphOp graph;
  const LowerOptions &options;
  TaskProgram &p;
  Bindings bindings;
  llvm::DenseMap<Value, uint32_t> slotOf;
  llvm::StringMap<LoweredOp> byName;
  /// Lead products (findLeads): a lead's name to its host's.
  llvm::StringMap<std::string> hostOf;
  /// (producer op, first tile, last tile) to its event.
  struct RangeHash {
    size_t operator()(const std::tuple<uint32_t, uint32_t, uint32_t> &k) const {
      const uint64_t h = (uint64_t(std::get<0>(k)) * 0x9e3779b97f4a7c15ull) ^
                         (uint64_t(std::get<1>(k)) << 32 | std::get<2>(k));
      return std::hash<uint64_t>()(h * 0xff51afd7ed558ccdull);
    }
  };
  std::unordered_map<std::tuple<uint32_t, uint32_t, uint32_t>, uint32_t, RangeHash> eventOf;
  /// (task, wait) and (task, signal) in the order made.
  std::vector<std::pair<uint32_t, WaitRecord>> taskWaits;
  std::vector<std::pair<uint32_t, SignalRecord>> taskSignals;
};

} // namespace

LogicalResult lowerGraph(GraphOp graph, const LowerOptions &options, TaskProgram *out) {
  if (!graph.getBindingsAttr())
    return graph.emitError() << "graph '" << graph.getSymName()
                             << "' has unresolved shapes: run the graph pipeline first";
  TaskProgram program;
  Lowering lowering(graph, options, program);
  if (failed(lowering.run()))
    return failure();
  *out = std::move(program);
  return success();
}

} // namespace moec::lower
