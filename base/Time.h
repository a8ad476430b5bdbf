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

/// The range of every timeout moec takes (the watchdog's, a wait for a
/// peer's): below a millisecond its clock cannot tell a timeout from none,
/// and above 10^6 s (11.6 days) it is no timeout; the bounds also keep the
/// nanoseconds far from int64's end. The CLI's --timeout, the C and C++
/// APIs and the torch op all check against it (timeoutInRange).
constexpr double kTimeoutMinSeconds = 1e-3;
constexpr double kTimeoutMaxSeconds = 1e6;
/// The timeout when none is given (every API's default). A timeout of 0
/// means this default in every API (the C and C++ APIs, the CLI, the torch
/// op); there is no "off": 10^6 s is the longest wait.
constexpr double kDefaultTimeoutSeconds = 60;

/// `seconds`, or the default when it is 0.
inline double timeoutOrDefault(double seconds) {
  return seconds == 0 ? kDefaultTimeoutSeconds : seconds;
}

/// True for a timeout in the range above (false for NaN and infinities).
inline bool timeoutInRange(double seconds) {
  return seconds >= kTimeoutMinSeconds && seconds <= kTimeoutMaxSeconds;
}

/// Seconds from `start` to now.
inline double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

} // namespace moec

#endif // MOEC_BASE_TIME_H
