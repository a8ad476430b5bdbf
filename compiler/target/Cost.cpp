//===- Cost.cpp - Estimated run time of a task ----------------------------===//

#include "compiler/target/Cost.h"

#include <algorithm>

namespace moec::target {

using namespace moec::format;

double taskSeconds(const TaskProgram &program, uint32_t task, const TargetProfile &profile) {
  const OpRecord &op = program.ops[program.tasks[task].op];
  const TilingRecord &tiling = program.tilings[op.tiling];
  TileCoord tile = tileCoord(tiling, task - op.firstTask);
  double cols = double(tile.colEnd - tile.colBegin);
  // Rows the tile holds when every segment has its balanced size.
  double rows = double(std::min<uint64_t>(tile.rowEnd, tiling.balancedRows) -
                       std::min<uint64_t>(tile.rowBegin, tiling.balancedRows));
  double element = dtypeSize(tiling.dtype);
  double work = 0;
  switch (op.kind) {
  case OpKind::Gmm:
    if (tiling.depth > 0) // activation GMM: rows x cols x K
      work = 2.0 * rows * cols * double(tiling.depth) / profile.cubeFlops;
    else // weight-gradient GMM: a weight tile, reduced over the expert's rows
      work = 2.0 * double(tile.rowEnd - tile.rowBegin) * cols * double(tiling.balancedRows) /
             profile.cubeFlops;
    break;
  case OpKind::Swiglu: // reads gate and up, writes the product
    work = 3.0 * rows * cols * element / profile.vectorBytes;
    break;
  case OpKind::SwigluGrad: // reads Y (2 halves) and dA, writes dY (2 halves)
    work = 5.0 * rows * cols * element / profile.vectorBytes;
    break;
  case OpKind::Dispatch:
  case OpKind::Combine:
    work = rows * cols * element / (tile.peer == 0 ? profile.vectorBytes : profile.linkBytes);
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

} // namespace moec::target
