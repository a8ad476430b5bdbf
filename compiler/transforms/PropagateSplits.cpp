//===- PropagateSplits.cpp - task counts, tile grids, tile-range maps ------===//
//
// Every compute op becomes a grid of tile tasks, experts x peers x row tiles x
// column tiles, numbered in that order (the task binary's TilingRecord):
//
//   dispatch, combine  L x R x (tasks / (L*R)) x 1: the rows the loading rank
//                      puts to local expert e of peer (rank + p) % R
//                      (dispatch), or returns from its expert e to the source
//                      rank (rank + p) % R (combine), cut into row tiles
//   swiglu(_grad),     L x 1 x (tasks / L) x 1: row tiles of each expert's
//   dequantize         segment (per_expert_seq rows at most)
//   quantize           1 x 1 x tasks x 1: row tiles of the rank's rows to
//                      send (not grouped by local expert)
//   gmm, activation    L x 1 x mt x nt, mt*nt = tasks / L: mt row tiles of
//                      each expert's segment (at least split_value rows of a
//                      segment of balanced size each), nt column tiles
//   gmm, weight grad   L x 1 x mt x nt over each expert's [K, N] result, as
//                      square as the counts allow
//
// With automatic splits and peer groups (G > 1), the activation GMM,
// SwiGLU(-grad) and dequantize grids are L x G x mt x nt: group g holds the
// rows of the expert's segment that came from the ranks p behind, for
// g*R/G <= p < (g+1)*R/G (format::peerGroupRows).
//
// A tile map then says, for each consumer tile, which producer tiles (a
// contiguous range in the producer's task order) it needs.
//
//===----------------------------------------------------------------------===//

#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"
#include "format/TaskBinary.h"

#include "llvm/ADT/DenseMap.h"

#include <cmath>

namespace moec::moe {
#define GEN_PASS_DEF_PROPAGATESPLITS
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec;
using namespace moec::moe;

namespace {

int64_t extentOf(Value v, int64_t dim) {
  return *v.getType().cast<MoeTensorType>().getDimValue(dim);
}

/// An op's tile grid and the extents it cuts.
struct Grid {
  int64_t experts = 1, peers = 1, rowTiles = 1, colTiles = 1;
  int64_t rows = 1, cols = 1;
  bool perExpert = false; ///< rows are rows of an expert's token segment
  bool reducesRows = false; ///< reads all of its expert's rows (weight gradient, put)
  bool shareRows = false;   ///< row tiles share out the rows present (kTilingShareRows)
  bool dispatch = false, combine = false; ///< a put: tile p goes to peer offset p

  bool put() const { return dispatch || combine; }
  /// Peer groups: tiles of the rows from a range of source ranks.
  bool grouped() const { return peers > 1 && !put(); }

  int64_t perExpertTiles() const { return peers * rowTiles * colTiles; }
  int64_t tiles() const { return experts * perExpertTiles(); }
  int64_t rowBegin(int64_t i) const { return i * rows / rowTiles; }
  /// The row tile holding row r.
  int64_t rowTileOf(int64_t r) const { return ((r + 1) * rowTiles - 1) / rows; }
};

/// How far tiles of rows/mt x cols/nt are from square (0: square).
double squareSkew(int64_t rows, int64_t cols, int64_t mt, int64_t nt) {
  return std::abs(std::log(double(rows) / double(mt)) - std::log(double(cols) / double(nt)));
}

/// The divisors of n, ascending.
SmallVector<int64_t> divisors(int64_t n) {
  SmallVector<int64_t> d;
  for (int64_t k = 1; k * k <= n; ++k)
    if (n % k == 0) {
      d.push_back(k);
      if (k != n / k)
        d.push_back(n / k);
    }
  llvm::sort(d);
  return d;
}

/// Tasks are records of the binary and queue entries of the runtime: at
/// most this many per op.
constexpr int64_t kMaxTasksPerOp = int64_t(1) << 20;

/// The largest power of two at most max(n, 1).
int64_t powerOfTwoAtMost(int64_t n) {
  int64_t p = 1;
  while (p * 2 <= n)
    p *= 2;
  return p;
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct PropagateSplitsPass : moec::moe::impl::PropagateSplitsBase<PropagateSplitsPass> {
  using PropagateSplitsBase::PropagateSplitsBase;

  void runOnOperation() override {
    for (GraphOp graph : getOperation().getOps<GraphOp>())
      if (failed(propagate(graph)))
        return signalPassFailure();
  }

  LogicalResult propagate(GraphOp graph) {
    DictionaryAttr bound = graph.getBindingsAttr();
    if (!bound)
      return graph.emitError() << "graph '" << graph.getSymName()
                               << "' has unresolved shapes: run moe-resolve-shapes first";
    Bindings bindings;
    for (NamedAttribute a : bound)
      bindings[a.getName().str()] = a.getValue().cast<IntegerAttr>().getInt();
    for (Operation &op : graph.getBlock()) {
      auto def = cast<TensorDefOpInterface>(&op);
      if (!def.getTensor().getType().isResolved())
        return op.emitError() << "tensor '" << def.getResultName()
                              << "' has unresolved dims or dtype: run moe-resolve-shapes first";
    }
    for (const char *symbol :
         {"single_rank_expert_num", "ep", "per_expert_seq", "per_expert_seq_to_other",
          "per_rank_seq"})
      if (!bindings.count(symbol))
        return graph.emitError() << "graph '" << graph.getSymName() << "' has no binding for '"
                                 << symbol << "': run moe-resolve-shapes first";

    SmallVector<TaskOpInterface> order;
    if (failed(topologicalOrder(graph, order)))
      return failure();

    llvm::DenseMap<Operation *, Grid> grids;
    Builder b(graph.getContext());
    for (TaskOpInterface op : order) {
      if (op.isAutoSplit()) {
        std::optional<Grid> grid = autoGrid(op, bindings);
        if (!grid)
          return failure();
        record(op, *grid, grids, b);
        continue;
      }
      std::optional<int64_t> tasks = taskCount(op, bindings);
      if (!tasks)
        return failure();
      // The tasks of one tile each of every local expert (and, for a put,
      // of every peer).
      const int64_t unit =
          isa<QuantizeOp>(op.getOperation())
              ? 1
              : bindings.at("single_rank_expert_num") *
                    (isa<DispatchOp, CombineOp>(op.getOperation()) ? bindings.at("ep") : 1);
      // A count the split value derives (no task_num) is rounded up to what
      // the op's grid needs: every local expert (and, for a put, every peer)
      // gets the same number of tiles. It changes only counts that did not
      // fit before; an explicit task_num is taken as written.
      if (!op.getSplit().getTaskNum())
        *tasks = (*tasks + unit - 1) / unit * unit;
      // A count past kMaxTasksPerOp is a split value far too small for the
      // shape.
      if (*tasks > kMaxTasksPerOp) {
        op->emitError() << "'" << op.getOpName() << "': " << *tasks << " tasks; at most "
                        << kMaxTasksPerOp << " per op are supported (raise its split value)";
        return failure();
      }
      std::optional<Grid> grid;
      if (taskNumFromCores(op)) {
        // A count from the target's core count (a task per core) is capped
        // at the tiles the op has: a small layer on a many-core target
        // leaves cores idle instead of failing to compile.
        ScopedDiagnosticHandler quiet(op.getContext(), [](Diagnostic &) { return success(); });
        for (int64_t n = *tasks / unit * unit; n >= unit && !grid; n -= unit)
          if ((grid = gridOf(op, n, bindings)))
            *tasks = n;
      }
      if (!grid)
        grid = gridOf(op, *tasks, bindings);
      if (!grid)
        return failure();
      record(op, *grid, grids, b);
    }
    return success();
  }

  /// Sets the op's task count, grid and tile maps.
  void record(TaskOpInterface op, Grid grid, llvm::DenseMap<Operation *, Grid> &grids,
              Builder &b) {
    const int64_t tasks = grid.tiles();
    grid.dispatch = isa<DispatchOp>(op.getOperation());
    grid.combine = isa<CombineOp>(op.getOperation());
    grids[op] = grid;
    op.setTasksValue(tasks);
    op.setGridValue(
        {grid.experts, grid.peers, grid.rowTiles, grid.colTiles, grid.rows, grid.cols});
    numTasks += tasks;

    SmallVector<Attribute> maps;
    for (OpOperand &use : op->getOpOperands()) {
      TaskOpInterface producer = producerOf(use.get());
      if (!producer)
        continue;
      SmallVector<int64_t> first, last;
      tileMap(grids[producer], grid, first, last);
      maps.push_back(TileMapAttr::get(op.getContext(), use.getOperandNumber(),
                                      b.getStringAttr(producer.getOpName()), first, last));
    }
    for (TaskOpInterface producer : orderingPredecessors(op)) {
      if (llvm::any_of(op->getOperands(), [&](Value v) { return producerOf(v) == producer; }))
        continue; // the data edge's map already orders them
      SmallVector<int64_t> first(tasks, 0), last(tasks, grids[producer].tiles() - 1);
      maps.push_back(TileMapAttr::get(op.getContext(), /*operand=*/-1,
                                      b.getStringAttr(producer.getOpName()), first, last));
    }
    op.setDepsValue(b.getArrayAttr(maps));
  }

  /// The grid of an op with an automatic split (see Passes.td), from the
  /// shapes, the core counts and the pass options; nullopt with an error
  /// when the bindings lack what it needs.
  std::optional<Grid> autoGrid(TaskOpInterface op, const Bindings &bindings) {
    for (const char *symbol : {"num_cube_cores", "num_vector_cores"})
      if (!bindings.count(symbol) || bindings.at(symbol) <= 0) {
        op->emitError() << "'" << op.getOpName() << "': an automatic split needs the core "
                        << "count '" << symbol << "' (from the config or the target)";
        return std::nullopt;
      }
    if (cubeTasksPerCore <= 0 || vectorTasksPerCore <= 0 || putRows <= 0 || gmmRows <= 0 ||
        peerGroups <= 0 || padM <= 0 || padN <= 0 || weightGradTasksPerCore < 0) {
      op->emitError() << "'" << op.getOpName() << "': the automatic split's options must be "
                      << "positive (weight-grad-tasks-per-core may be 0)";
      return std::nullopt;
    }
    Operation *raw = op;
    const int64_t L = bindings.at("single_rank_expert_num"), R = bindings.at("ep");
    const int64_t cube = bindings.at("num_cube_cores");
    const int64_t vector = bindings.at("num_vector_cores");
    // Rows an expert's segment holds under balanced routing, and the peer
    // groups it is cut into (at most one a rank), each of balanced / G rows.
    const int64_t groups = std::min(peerGroups.getValue(), R);
    const int64_t segment = std::max<int64_t>(1, bindings.at("per_rank_seq") / L);
    const int64_t balanced = std::max<int64_t>(1, segment / groups);
    Value result = raw->getResult(0);
    Grid g;
    g.experts = L;
    g.peers = groups;
    g.perExpert = true;
    g.shareRows = true;
    if (isa<DispatchOp, CombineOp>(raw)) {
      // Rows a rank sends one expert when balanced: S * K / E.
      const int64_t sent = std::max<int64_t>(1, segment / R);
      g.peers = R;
      g.rows = bindings.at("per_expert_seq_to_other");
      g.cols = extentOf(result, 1);
      g.reducesRows = true;
      g.rowTiles = std::min(powerOfTwoAtMost(sent / putRows), powerOfTwoAtMost(g.rows));
    } else if (isa<SwigluOp, SwigluGradOp, DequantizeOp>(raw)) {
      g.rows = bindings.at("per_expert_seq");
      g.cols = extentOf(result, 1);
      // At least 16 rows a tile when balanced.
      g.rowTiles = std::min(powerOfTwoAtMost(ceilDiv(vectorTasksPerCore * vector, L * groups)),
                            powerOfTwoAtMost(balanced / 16));
    } else if (auto gmm = dyn_cast<GmmOp>(raw)) {
      if (gmm.isWeightGradient()) {
        // Of the grids of at most the tiles asked for, none empty, the one
        // the cube cores finish soonest when it runs alone: its tiles' work,
        // padded to the kernel's blocks, shared over the cores, plus one
        // tile (a list schedule's bound); on a tie, the most square tiles
        // (the least operand traffic).
        std::optional<Grid> w = gridOf(op, L, bindings);
        if (!w)
          return std::nullopt;
        const int64_t perCore = std::min<int64_t>(
            weightGradTasksPerCore > 0 ? weightGradTasksPerCore.getValue() : cubeTasksPerCore,
            kMaxTasksPerOp);
        const int64_t perExpert = std::min(ceilDiv(perCore * cube, L), kMaxTasksPerOp / L);
        const Grid one = *w;
        double bestTime = INFINITY, bestSkew = 0;
        for (int64_t mt = 1; mt <= std::min(one.rows, perExpert); ++mt)
          for (int64_t nt = 1; nt <= std::min(one.cols, perExpert / mt); ++nt) {
            Grid c = one;
            c.rowTiles = mt;
            c.colTiles = nt;
            const double area = paddedTile(c);
            const double time = double(L * mt * nt) * area / double(cube) + area;
            const double skew = squareSkew(c.rows, c.cols, mt, nt);
            if (time < bestTime || (time == bestTime && skew < bestSkew)) {
              *w = c;
              bestTime = time;
              bestSkew = skew;
            }
          }
        return w;
      }
      // Tiles of one peer group of an expert.
      const int64_t perExpert = ceilDiv(cubeTasksPerCore * cube, L * groups);
      g.rows = bindings.at("per_expert_seq");
      g.cols = extentOf(result, 1);
      // Rows first, at least gmmRows a tile when balanced; then columns,
      // at least 128 a tile: up to the tiles asked for, the count whose
      // tiles, padded to the kernel's blocks, fill the cube cores' waves
      // best (the fewest waves of padded columns; on a tie, the most tiles).
      g.rowTiles = std::min(powerOfTwoAtMost(perExpert), powerOfTwoAtMost(balanced / gmmRows));
      const int64_t maxCols =
          std::max<int64_t>(1, std::min(ceilDiv(perExpert, g.rowTiles), g.cols / 128));
      const int64_t rowTiles = L * groups * g.rowTiles; // of all experts
      auto waves = [&](int64_t c) {
        return double(ceilDiv(rowTiles * c, cube)) *
               target::paddedTo(double(ceilDiv(g.cols, c)), uint32_t(padN));
      };
      g.colTiles = 1;
      for (int64_t c = 2; c <= maxCols; ++c)
        if (waves(c) <= waves(g.colTiles))
          g.colTiles = c;
    } else {
      op->emitError() << "'" << op.getOpName() << "': a " << raw->getName()
                      << " cannot have an automatic split";
      return std::nullopt;
    }
    g.rowTiles = std::max<int64_t>(1, std::min(g.rowTiles, g.rows));
    if (g.tiles() > kMaxTasksPerOp) {
      op->emitError() << "'" << op.getOpName() << "': " << g.tiles() << " tasks; at most "
                      << kMaxTasksPerOp << " per op are supported";
      return std::nullopt;
    }
    return g;
  }

  /// The elements of a grid's largest tile, its rows and columns padded to
  /// the GMM kernel's blocks (pad-m x pad-n).
  double paddedTile(const Grid &g) const {
    return target::paddedTo(double(ceilDiv(g.rows, g.rowTiles)), uint32_t(padM)) *
           target::paddedTo(double(ceilDiv(g.cols, g.colTiles)), uint32_t(padN));
  }

  /// True when the op's task_num counts the target's cores.
  static bool taskNumFromCores(TaskOpInterface op) {
    StringAttr expr = op.getSplit().getTaskNum();
    return expr && (expr.getValue().contains("num_cube_cores") ||
                    expr.getValue().contains("num_vector_cores"));
  }

  /// For each consumer tile, the range of producer tiles it needs.
  static void tileMap(const Grid &prod, const Grid &cons, SmallVectorImpl<int64_t> &first,
                      SmallVectorImpl<int64_t> &last) {
    bool sameExperts = prod.perExpert && cons.perExpert && prod.experts == cons.experts;
    // Row-wise: both cut the same expert segments (and peer groups) into row
    // tiles, and the consumer reads whole rows of the producer's result.
    bool rowWise = sameExperts && !prod.reducesRows && !cons.reducesRows && !prod.put() &&
                   !cons.put() && prod.peers == cons.peers && prod.rows == cons.rows;
    // Shared-out rows move with the segment's size: tile to tile only when
    // both share and one row tile count divides the other.
    if (prod.shareRows || cons.shareRows)
      rowWise = rowWise && prod.shareRows && cons.shareRows &&
                (prod.rowTiles % cons.rowTiles == 0 || cons.rowTiles % prod.rowTiles == 0);
    // A peer group's rows are put by the dispatch tiles of its peer offsets;
    // a combine tile returns the rows of one peer group.
    const bool groupFromDispatch = sameExperts && cons.grouped() && prod.dispatch;
    const bool combineFromGroup = sameExperts && prod.grouped() && cons.combine;
    const int64_t prodCell = prod.rowTiles * prod.colTiles; // tiles of one (expert, peer)
    const int64_t consCell = cons.rowTiles * cons.colTiles;
    const int64_t R = prod.put() ? prod.peers : cons.peers; // the EP degree, with a put
    for (int64_t t = 0; t < cons.tiles(); ++t) {
      if (!sameExperts) { // nothing finer to follow: every producer tile
        first.push_back(0);
        last.push_back(prod.tiles() - 1);
        continue;
      }
      int64_t expert = t / cons.perExpertTiles();
      int64_t peer = (t % cons.perExpertTiles()) / consCell;
      int64_t base = expert * prod.perExpertTiles();
      if (groupFromDispatch) { // group g: peer offsets [g*R/G, (g+1)*R/G)
        first.push_back(base + format::tileBegin(peer, R, cons.peers) * prodCell);
        last.push_back(base + format::tileBegin(peer + 1, R, cons.peers) * prodCell - 1);
        continue;
      }
      if (combineFromGroup) { // rows to rank p ahead came from the rank R - p behind
        int64_t group =
            format::peerGroupOf(uint32_t((R - peer) % R), uint32_t(R), uint32_t(prod.peers));
        first.push_back(base + group * prodCell);
        last.push_back(base + (group + 1) * prodCell - 1);
        continue;
      }
      if (!rowWise) { // the whole of the expert's tiles (puts arrive from every peer)
        first.push_back(base);
        last.push_back(base + prod.perExpertTiles() - 1);
        continue;
      }
      base += peer * prodCell;
      int64_t rowTile = (t % consCell) / cons.colTiles;
      if (cons.shareRows) {
        // Row tile c of ct covers [c*n/ct, (c+1)*n/ct) of the n rows
        // present: inside producer tile c / (ct/pt), or exactly producer
        // tiles [c*q, (c+1)*q) with q = pt/ct.
        int64_t lo, hi;
        if (cons.rowTiles >= prod.rowTiles) {
          lo = hi = rowTile / (cons.rowTiles / prod.rowTiles);
        } else {
          const int64_t q = prod.rowTiles / cons.rowTiles;
          lo = rowTile * q;
          hi = (rowTile + 1) * q - 1;
        }
        first.push_back(base + lo * prod.colTiles);
        last.push_back(base + (hi + 1) * prod.colTiles - 1);
        continue;
      }
      int64_t lo = cons.rowBegin(rowTile), hi = cons.rowBegin(rowTile + 1);
      first.push_back(base + prod.rowTileOf(lo) * prod.colTiles);
      last.push_back(base + (prod.rowTileOf(hi - 1) + 1) * prod.colTiles - 1);
    }
  }

  /// The grid of an op with `tasks` tasks; emits an error and returns
  /// std::nullopt when the count does not fit the op's grid.
  std::optional<Grid> gridOf(TaskOpInterface op, int64_t tasks, const Bindings &bindings) {
    int64_t experts = bindings.at("single_rank_expert_num");
    int64_t ranks = bindings.at("ep");
    int64_t segment = bindings.at("per_expert_seq");
    Grid g;
    g.experts = experts;
    g.perExpert = true;
    auto notMultiple = [&](int64_t of, const char *what) {
      op->emitError() << "'" << op.getOpName() << "': " << tasks
                      << " tasks do not divide evenly over " << what << " (" << of
                      << "); the task count must be a multiple of it";
      return std::nullopt;
    };
    Operation *raw = op;
    Value result = raw->getResult(0);
    if (isa<DispatchOp, CombineOp>(raw)) {
      if (tasks % (experts * ranks) != 0)
        return notMultiple(experts * ranks, "local experts x ranks");
      g.peers = ranks;
      g.rowTiles = tasks / (experts * ranks);
      // A rank sends an expert at most one row per token.
      g.rows = bindings.at("per_expert_seq_to_other");
      g.cols = extentOf(result, 1);
      g.reducesRows = true;
    } else if (isa<QuantizeOp>(raw)) {
      g.experts = 1;
      g.perExpert = false;
      g.rowTiles = tasks;
      g.rows = extentOf(raw->getOperand(0), 0);
      g.cols = extentOf(raw->getOperand(0), 1);
    } else if (isa<SwigluOp, SwigluGradOp, DequantizeOp>(raw)) {
      if (tasks % experts != 0)
        return notMultiple(experts, "local experts");
      g.rowTiles = tasks / experts;
      g.rows = segment;
      g.cols = extentOf(result, 1);
    } else {
      auto gmm = cast<GmmOp>(raw);
      if (tasks % experts != 0)
        return notMultiple(experts, "local experts");
      int64_t perExpert = tasks / experts;
      SmallVector<int64_t> ds = divisors(perExpert);
      if (gmm.isWeightGradient()) {
        g.reducesRows = true;
        g.rows = extentOf(result, 1);
        g.cols = extentOf(result, 2);
        // The most square tiles that leave none empty.
        double best = INFINITY;
        for (int64_t mt : ds) {
          int64_t nt = perExpert / mt;
          if (mt > g.rows || nt > g.cols)
            continue;
          double skew = squareSkew(g.rows, g.cols, mt, nt);
          if (skew < best) {
            best = skew;
            g.rowTiles = mt;
            g.colTiles = nt;
          }
        }
        if (best == INFINITY) {
          op->emitError() << "'" << op.getOpName() << "': " << perExpert
                          << " tasks per expert cannot tile its " << g.rows << " x " << g.cols
                          << " result without empty tiles; lower its task_num";
          return std::nullopt;
        }
      } else {
        g.rows = segment;
        g.cols = extentOf(result, 1);
        // As many row tiles as divide the count and leave split_value rows
        // each of a segment of balanced size (per_rank_seq / L), the rest of
        // the tasks over columns: routing decides how full a segment is, and
        // column tiles keep every core busy whatever it decides.
        int64_t split = int64_t(op.getSplitValue());
        int64_t balanced = std::max<int64_t>(1, bindings.at("per_rank_seq") / experts);
        int64_t maxRowTiles = std::max<int64_t>(1, balanced / std::max<int64_t>(1, split));
        g.rowTiles = 0;
        for (int64_t mt : llvm::reverse(ds))
          if (mt <= maxRowTiles && perExpert / mt <= g.cols) {
            g.rowTiles = mt;
            break;
          }
        if (g.rowTiles == 0) {
          op->emitError() << "'" << op.getOpName() << "': " << perExpert
                          << " tasks per expert cannot tile its " << g.cols
                          << " result columns without empty tiles; lower its task_num";
          return std::nullopt;
        }
        g.colTiles = perExpert / g.rowTiles;
      }
    }
    if (g.rows < g.rowTiles) {
      op->emitError() << "'" << op.getOpName() << "': " << g.rowTiles << " row tiles over "
                      << g.rows << " rows leave tiles empty; use fewer tasks";
      return std::nullopt;
    }
    return g;
  }

  /// The seed's rule: a task_num expression if given, else extent / split
  /// value; a division in either counts tiles, so it rounds up (an extent
  /// that is no multiple of the split value gets one more, smaller, tile,
  /// and the tiles of a dimension are balanced: see tileBegin()).
  std::optional<int64_t> taskCount(TaskOpInterface op, const Bindings &graphBindings) {
    int64_t splitValue = op.getSplitValue();
    SplitAttr split = op.getSplit();
    std::string error;
    Value cut;
    int64_t dim;
    if (split.isSource()) {
      cut = op->getResult(0);
      dim = split.getOutputDims().front();
    } else {
      cut = op->getOperand(split.getSplitOperand(0));
      dim = split.getSplitDim(0);
    }
    int64_t extent = extentOf(cut, dim);
    if (StringAttr expr = split.getTaskNum()) {
      Bindings bindings = graphBindings;
      bindings["split_value"] = splitValue;
      // A division in a task count counts tiles: it rounds up, so an extent
      // that is no multiple of the split value gets one more (smaller) tile.
      std::optional<int64_t> n =
          Expr::parse(expr.getValue().str(), &error)->evaluateRoundingUp(bindings, &error);
      if (!n) {
        op->emitError() << "'" << op.getOpName() << "': task_num: " << error;
        return std::nullopt;
      }
      if (*n <= 0) {
        op->emitError() << "'" << op.getOpName() << "': task_num '" << expr.getValue()
                        << "' is " << *n << "; it must be positive";
        return std::nullopt;
      }
      return n;
    }
    if (splitValue <= 0) {
      op->emitError() << "'" << op.getOpName() << "': split value " << splitValue
                      << " must be positive";
      return std::nullopt;
    }
    return (extent + splitValue - 1) / splitValue;
  }
};

} // namespace
