//===- ThreadTeam.cpp - Persistent threads for parallel loops ------------===//

#include "runtime/exec/ThreadTeam.h"

#include <algorithm>
#include <system_error>

namespace moec::exec {

ThreadTeam::ThreadTeam(uint32_t threads) {
  helpers.reserve(threads > 1 ? threads - 1 : 0);
  // A system that will not start another thread (a process or memory
  // limit) gets a smaller team: the loops run on fewer threads, not at all
  // differently.
  for (uint32_t t = 1; t < threads; ++t) {
    try {
      helpers.emplace_back([this, t] { helperMain(t); });
    } catch (const std::system_error &) {
      break;
    }
  }
}

ThreadTeam::~ThreadTeam() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  wake.notify_all();
  for (std::thread &h : helpers)
    h.join();
}

void ThreadTeam::run(size_t count, const std::function<void(size_t)> &fn) {
  const size_t n = std::min<size_t>(size(), count);
  if (n <= 1) {
    for (size_t i = 0; i < count; ++i)
      fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    job = &fn;
    jobCount = count;
    jobThreads = uint32_t(n);
    busy = uint32_t(n - 1);
    ++generation;
  }
  wake.notify_all();
  for (size_t i = 0; i < count; i += n)
    fn(i);
  std::unique_lock<std::mutex> lock(mutex);
  done.wait(lock, [this] { return busy == 0; });
  job = nullptr;
}

void ThreadTeam::helperMain(uint32_t index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(size_t)> *fn;
    size_t count, n;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stopping || generation != seen; });
      if (stopping)
        return;
      seen = generation;
      if (index >= jobThreads)
        continue; // not needed for this loop
      fn = job;
      count = jobCount;
      n = jobThreads;
    }
    for (size_t i = index; i < count; i += n)
      (*fn)(i);
    std::lock_guard<std::mutex> lock(mutex);
    if (--busy == 0)
      done.notify_one();
  }
}

} // namespace moec::exec
