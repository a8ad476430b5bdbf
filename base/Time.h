//===- Time.h - Wall time between two points ---------------------*- C++ -*-===//
//
// The one clock the runtime, its tools and its benchmarks time passes with.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_TIME_H
#define MOEC_BASE_TIME_H

#include <chrono>

namespace moec {

using Clock = std::chrono::steady_clock;

/// Seconds from `start` to now.
inline double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

} // namespace moec

#endif // MOEC_BASE_TIME_H
