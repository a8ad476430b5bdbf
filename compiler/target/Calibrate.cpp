//===- Calibrate.cpp - the cost model's rates, fitted to measured runs ----===//

#include "compiler/target/Calibrate.h"

#include "compiler/target/Cost.h"
#include "compiler/target/Simulate.h"

#include <limits>

namespace moec::target {

std::pair<RateClass, double> taskWork(const format::TaskProgram &program, uint32_t task) {
  TargetProfile unit;
  unit.cubeFlops = unit.cubeFlopsBf16 = unit.vectorElems = unit.linkBytes = unit.vectorBytes = 1;
  unit.memoryBytes = std::numeric_limits<double>::infinity();
  unit.taskOverhead = 0;
  const format::OpRecord &op = program.ops[program.tasks[task].op];
  const format::TilingRecord &tiling = program.tilings[op.tiling];
  switch (op.kind) {
  case format::OpKind::Gmm:
    return {tiling.dtype == format::DType::BF16 ? RateClass::CubeBf16 : RateClass::CubeF32,
            taskSeconds(program, task, unit)};
  case format::OpKind::Dispatch:
  case format::OpKind::Combine:
    return {format::tileCoord(tiling, task - op.firstTask).peer != 0 ? RateClass::Link
                                                                     : RateClass::Copy,
            taskSeconds(program, task, unit)};
  default: // SwiGLU(-grad): its element accesses (bytes at an endless streaming rate)
    unit.vectorBytes = std::numeric_limits<double>::infinity();
    return {RateClass::VectorMath, taskSeconds(program, task, unit)};
  }
}

TargetProfile calibrateProfile(const TargetProfile &estimate,
                               const std::vector<MeasuredPass> &passes, uint32_t threads,
                               double overheadFloor) {
  // Rates: the work of a class over the time its tasks took.
  constexpr int kClasses = int(RateClass::Link) + 1;
  double work[kClasses] = {}, busy[kClasses] = {};
  for (const MeasuredPass &pass : passes)
    for (const trace::TaskSpan &span : pass.trace->tasks) {
      auto [rateClass, units] = taskWork(*pass.program, span.task);
      work[int(rateClass)] += units;
      busy[int(rateClass)] += double(span.endNs - span.startNs) * 1e-9;
    }
  TargetProfile calibrated = estimate;
  calibrated.cubeCores = calibrated.vectorCores = threads;
  auto rate = [&](RateClass c, double fallback) {
    return work[int(c)] > 0 && busy[int(c)] > 0 ? work[int(c)] / busy[int(c)] : fallback;
  };
  calibrated.cubeFlops = rate(RateClass::CubeF32, estimate.cubeFlops);
  calibrated.cubeFlopsBf16 = rate(RateClass::CubeBf16, estimate.cubeFlopsBf16);
  calibrated.vectorElems = rate(RateClass::VectorMath, estimate.vectorElems);
  calibrated.vectorBytes = rate(RateClass::Copy, estimate.vectorBytes);
  calibrated.linkBytes = rate(RateClass::Link, estimate.linkBytes);
  // A copy reads and writes each byte: operands stream at twice its rate.
  calibrated.memoryBytes = 2 * calibrated.vectorBytes;
  // The per-task overhead: above the floor, the value that makes the
  // simulated makespans add up to the measured ones (the makespan grows
  // with it), by bisection.
  auto fittedError = [&](double overhead) {
    TargetProfile p = calibrated;
    p.taskOverhead = overhead;
    double simulated = 0, measured = 0;
    for (const MeasuredPass &pass : passes) {
      simulated += simulateTimed(*pass.program, costModel(*pass.program, p)).makespan;
      measured += pass.seconds;
    }
    return simulated - measured;
  };
  double low = overheadFloor, high = 100e-6;
  if (fittedError(low) >= 0)
    high = low;
  for (int step = 0; step < 30 && high > low; ++step) {
    double mid = (low + high) / 2;
    (fittedError(mid) < 0 ? low : high) = mid;
  }
  calibrated.taskOverhead = high;
  return calibrated;
}

} // namespace moec::target
