//===- Cost.cpp - Estimated run time of a task ----------------------------===//

#include "compiler/target/Cost.h"

#include <algorithm>
#include <cmath>

namespace moec::target {

using namespace moec::format;

namespace {

/// The rows a tile holds when every segment has its balanced size.
double balancedTileRows(const TilingRecord &tiling, const TileCoord &tile) {
  return double(tileRows(tiling, tile, tiling.balancedRows).size());
}

/// The bytes a put task sends: its tile at balanced size.
double putBytes(const TaskProgram &program, uint32_t task, const TileCoord &tile) {
  const OpRecord &op = program.ops[program.tasks[task].op];
  const TilingRecord &tiling = program.tilings[op.tiling];
  return balancedTileRows(tiling, tile) * double(tile.colEnd - tile.colBegin) *
         dtypeSize(tiling.dtype);
}

} // namespace

double taskSeconds(const TaskProgram &program, uint32_t task, const TargetProfile &profile) {
  const OpRecord &op = program.ops[program.tasks[task].op];
  const TilingRecord &tiling = program.tilings[op.tiling];
  TileCoord tile = tileCoord(tiling, task - op.firstTask);
  double cols = double(tile.colEnd - tile.colBegin);
  double rows = balancedTileRows(tiling, tile);
  double element = dtypeSize(tiling.dtype);
  double work = 0;
  switch (op.kind) {
  case OpKind::Gmm: {
    double m, n = cols, k;
    if (tiling.depth > 0) { // activation GMM: rows x cols, reduced over K
      m = rows;
      k = double(tiling.depth);
      k += double(lowRankDepth(program, tiling)); // a low-rank product's too
      // A lead product's (format::leadOp): U's r columns over the depth.
      if (tiling.lowRank() && leadOp(program, program.tasks[task].op) != kNone)
        k += double(lowRankDepth(program, tiling)) * double(tiling.depth) / std::max(cols, 1.0);
    } else { // weight-gradient GMM: a weight tile, reduced over the expert's rows
      m = double(tile.rowEnd - tile.rowBegin);
      k = double(tiling.balancedRows);
    }
    if (m == 0 || k == 0)
      break;
    double rate = tiling.dtype == DType::BF16 ? profile.cubeFlopsBf16 : profile.cubeFlops;
    double flops = 2.0 * paddedTo(m, profile.padM) * paddedTo(n, profile.padN) *
                   paddedTo(k, profile.padK);
    // The A panel (m x k) is the tile's alone but for the column tiles of its
    // rows; the B panel (k x n) for the row tiles of its columns (of every
    // peer group; a weight gradient has none). With a shared cache, the ones
    // that run at once load it once between them: up to a core each.
    double shareA = 1, shareB = 1;
    if (profile.sharedCache) {
      const double cores = std::max<uint32_t>(profile.cubeCores, 1);
      shareA = std::min<double>(tiling.colTiles, cores);
      shareB = std::min<double>(tiling.rowTiles * tiling.peers,
                                std::max(1.0, std::floor(cores / shareA)));
    }
    // C is read too where the product adds onto an addend.
    double bytes =
        element * (m * k / shareA + k * n / shareB) +
        dtypeSize(program.slots[tiling.outputSlot].dtype) * m * n * (hasAddend(tiling) ? 2.0 : 1.0);
    work = std::max(flops / rate, bytes / profile.memoryBytes);
    break;
  }
  case OpKind::Swiglu:     // reads gate and up, writes the product
  case OpKind::SwigluGrad: { // reads Y (2 halves) and dA, writes dY (2 halves)
    double accesses = (op.kind == OpKind::Swiglu ? 3.0 : 5.0) * rows * cols;
    work = std::max(accesses * element / profile.vectorBytes, accesses / profile.vectorElems);
    break;
  }
  case OpKind::Quantize:   // reads rows of one type, writes them in the other
  case OpKind::Dequantize: {
    double bytes = rows * cols *
                   double(dtypeSize(program.slots[tiling.inputSlots[0]].dtype) +
                          dtypeSize(program.slots[tiling.outputSlot].dtype));
    work = std::max(bytes / profile.vectorBytes, 2.0 * rows * cols / profile.vectorElems);
    break;
  }
  case OpKind::Dispatch:
  case OpKind::Combine:
    work = putBytes(program, task, tile) /
           (tile.peer == 0 ? profile.vectorBytes : profile.linkBytes);
    break;
  }
  return profile.taskOverhead + work;
}

std::vector<double> taskCosts(const TaskProgram &program, const TargetProfile &profile) {
  std::vector<double> costs(program.tasks.size());
  for (size_t t = 0; t < costs.size(); ++t)
    costs[t] = taskSeconds(program, uint32_t(t), profile);
  return costs;
}

CostModel costModel(const TaskProgram &program, const TargetProfile &profile) {
  CostModel model;
  model.costs = taskCosts(program, profile);
  model.linkBytes.assign(program.tasks.size(), 0.0);
  for (uint32_t t = 0; t < program.tasks.size(); ++t) {
    const OpRecord &op = program.ops[program.tasks[t].op];
    if (!isPut(op.kind))
      continue;
    TileCoord tile = tileCoord(program.tilings[op.tiling], t - op.firstTask);
    if (tile.peer != 0)
      model.linkBytes[t] = putBytes(program, t, tile);
  }
  model.linkTotalBytes = profile.linkTotalBytes;
  model.sharing = profile.sharing;
  model.poolCores = std::max(profile.cubeCores, profile.vectorCores);
  return model;
}

} // namespace moec::target
