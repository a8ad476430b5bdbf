//===- ThreadTeam.cpp - Persistent threads for parallel loops ------------===//

#include "runtime/exec/ThreadTeam.h"

#include <algorithm>
#include <map>
#include <utility>

#include <unistd.h>
#include <system_error>

namespace moec::exec {

ThreadTeam::ThreadTeam(uint32_t threads, const Starter &start) {
  helpers.reserve(threads > 1 ? threads - 1 : 0);
  // A system that will not start another thread (a process or memory
  // limit) gets a smaller team: the loops run on fewer threads, not at all
  // differently.
  for (uint32_t t = 1; t < threads; ++t) {
    try {
      std::function<void()> body = [this, t] { helperMain(t); };
      helpers.push_back(start ? start(std::move(body)) : std::thread(std::move(body)));
    } catch (const std::system_error &error) {
      startError = error.what();
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

std::shared_ptr<ThreadTeam> ThreadTeam::shared(uint32_t threads) {
  static std::mutex registryMutex;
  static std::map<std::pair<pid_t, uint32_t>, std::weak_ptr<ThreadTeam>> registry;
  std::lock_guard<std::mutex> lock(registryMutex);
  // By process too: a child of fork() has a copy of the registry but none
  // of the parent's threads.
  std::weak_ptr<ThreadTeam> &slot = registry[{::getpid(), threads}];
  std::shared_ptr<ThreadTeam> team = slot.lock();
  if (!team) {
    team = std::make_shared<ThreadTeam>(threads);
    slot = team;
  }
  return team;
}

void ThreadTeam::run(size_t count, const std::function<void(size_t)> &fn, uint32_t limit) {
  size_t n = std::min<size_t>(size(), count);
  if (limit > 0)
    n = std::min<size_t>(n, limit);
  if (n <= 1) {
    for (size_t i = 0; i < count; ++i)
      fn(i);
    return;
  }
  std::lock_guard<std::mutex> held(turn);
  {
    std::lock_guard<std::mutex> lock(mutex);
    job = &fn;
    jobCount = count;
    jobThreads = uint32_t(n);
    jobOnHelpers = false;
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

void ThreadTeam::launch(size_t count, const std::function<void(size_t)> &fn) {
  std::unique_lock<std::mutex> held(turn);
  launchedFn = fn;
  const uint32_t n = uint32_t(std::min<size_t>(count, helpers.size()));
  {
    std::lock_guard<std::mutex> lock(mutex);
    job = &launchedFn;
    jobCount = n;
    jobThreads = n;
    jobOnHelpers = true;
    busy = n;
    ++generation;
  }
  launched = std::move(held);
  wake.notify_all();
}

void ThreadTeam::join() {
  {
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [this] { return busy == 0; });
    job = nullptr;
  }
  launchedFn = nullptr;
  launched.unlock();
}

void ThreadTeam::helperMain(uint32_t index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(size_t)> *fn;
    size_t count, n;
    bool onHelpers;
    {
      std::unique_lock<std::mutex> lock(mutex);
      wake.wait(lock, [&] { return stopping || generation != seen; });
      if (stopping)
        return;
      seen = generation;
      onHelpers = jobOnHelpers;
      // run(): threads 1 .. n - 1 beside the caller (thread 0); launch():
      // helpers 1 .. n, helper t running item t - 1.
      if (onHelpers ? index > jobThreads : index >= jobThreads)
        continue; // not needed for this job
      fn = job;
      count = jobCount;
      n = jobThreads;
    }
    if (onHelpers)
      (*fn)(index - 1);
    else
      for (size_t i = index; i < count; i += n)
        (*fn)(i);
    std::lock_guard<std::mutex> lock(mutex);
    if (--busy == 0)
      done.notify_one();
  }
}

} // namespace moec::exec
