//===- Time.h - Wall time between two points ---------------------*- C++ -*-===//
//
// The one clock the runtime, its tools and its benchmarks time passes with,
// and the calling thread's own CPU time (what a traced task run spent on a
// core, against its wall time).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_TIME_H
#define MOEC_BASE_TIME_H

#include <chrono>
#include <cstdint>
#include <ctime>

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

/// The CPU time the calling thread has used, in ns (CLOCK_THREAD_CPUTIME_ID;
/// -1 where the system cannot say). A system call: about 1.3 us on a 2-core
/// VM, so the executor reads it only when tracing.
inline int64_t threadCpuNs() {
  timespec now{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now) != 0)
    return -1;
  return int64_t(now.tv_sec) * 1000000000 + now.tv_nsec;
}

} // namespace moec

#endif // MOEC_BASE_TIME_H
