//===- Parallel.h - A loop shared out among the hardware's threads --------===//
//
// The layer tools' host work (random inputs, weights quantized and
// transposed expert by expert) on every hardware thread.
//
//===----------------------------------------------------------------------===//
#ifndef MOEC_RUNTIME_TOOLING_PARALLEL_H
#define MOEC_RUNTIME_TOOLING_PARALLEL_H

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace moec::tooling {

/// Runs fn(0) .. fn(count - 1), the items shared out among the hardware's
/// threads. Each item must be work of its own (what it writes no other
/// item reads or writes), so the thread count does not change a bit.
template <typename Fn> void forEachOnThreads(int64_t count, Fn fn) {
  const int64_t threads =
      std::min<int64_t>(count, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (int64_t e = 0; e < count; ++e)
      fn(e);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&fn, t, threads, count] {
      for (int64_t e = t; e < count; e += threads)
        fn(e);
    });
  for (std::thread &x : pool)
    x.join();
}

} // namespace moec::tooling

#endif // MOEC_RUNTIME_TOOLING_PARALLEL_H
