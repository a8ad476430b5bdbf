//===- ThreadTeam.h - Persistent threads for parallel loops -----*- C++ -*-===//
//
// The parallel loops of a pass outside its task queues (routing layout,
// gathering the rows to send, combine, the top-k weight gradient) run on a
// team of threads made once with the pass and parked between loops, so a
// pass starts no thread.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_EXEC_THREADTEAM_H
#define MOEC_RUNTIME_EXEC_THREADTEAM_H

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moec::exec {

class ThreadTeam {
public:
  /// A team of `threads` threads in all: the caller of run() and
  /// threads - 1 helpers, started here (fewer where the system starts no
  /// more threads: size() says how many).
  explicit ThreadTeam(uint32_t threads);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam &) = delete;
  ThreadTeam &operator=(const ThreadTeam &) = delete;

  uint32_t size() const { return uint32_t(helpers.size()) + 1; }

  /// Runs fn(i) for every i in [0, count) and returns when all are done.
  /// Thread t of the n = min(size(), count) taking part (the caller is
  /// thread 0) runs i = t, t + n, t + 2n, ...: items must be independent.
  /// One run at a time.
  void run(size_t count, const std::function<void(size_t)> &fn);

private:
  void helperMain(uint32_t index);

  std::mutex mutex;
  std::condition_variable wake; ///< helpers: a new loop, or stop
  std::condition_variable done; ///< the caller: the helpers finished
  uint64_t generation = 0;      ///< loops started
  bool stopping = false;
  const std::function<void(size_t)> *job = nullptr;
  size_t jobCount = 0;
  uint32_t jobThreads = 0; ///< threads taking part in the current loop
  uint32_t busy = 0;       ///< helpers of the current loop not yet done
  std::vector<std::thread> helpers;
};

} // namespace moec::exec

#endif // MOEC_RUNTIME_EXEC_THREADTEAM_H
