//===- ThreadTeam.h - Persistent threads for parallel loops -----*- C++ -*-===//
//
// The parallel loops of a pass outside its task queues (routing layout,
// gathering the rows to send, combine, the top-k weight gradient) and the
// executor's workers run on a team of threads parked between jobs, so a pass
// starts no thread. A team is the process's (shared()): every pass of every
// layer and exchange that asks for the same size takes turns on one set of
// threads, so that a model of 48 layers does not start 48 sets.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_EXEC_THREADTEAM_H
#define MOEC_RUNTIME_EXEC_THREADTEAM_H

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moec::exec {

class ThreadTeam {
public:
  /// What starts a helper thread running `body`: a std::thread, or (a test
  /// of the fallback) a function that throws std::system_error as a system
  /// out of threads does.
  using Starter = std::function<std::thread(std::function<void()> body)>;

  /// A team of `threads` threads in all: the caller of run() and
  /// threads - 1 helpers, started here by `start` (null: std::thread), fewer
  /// where the system starts no more threads (size() says how many,
  /// whyFewer() why): the loops then run on fewer threads, not at all
  /// differently.
  explicit ThreadTeam(uint32_t threads, const Starter &start = nullptr);
  ~ThreadTeam();
  ThreadTeam(const ThreadTeam &) = delete;
  ThreadTeam &operator=(const ThreadTeam &) = delete;

  /// The process's team of `threads` threads, made at the first call and
  /// kept while someone holds it; every caller asking for the same size
  /// shares it, taking turns (run(), and launch() to join(), hold it).
  static std::shared_ptr<ThreadTeam> shared(uint32_t threads);

  uint32_t size() const { return uint32_t(helpers.size()) + 1; }

  /// Why the team has fewer threads than asked for ("" when it has all).
  const std::string &whyFewer() const { return startError; }

  /// Runs fn(i) for every i in [0, count) and returns when all are done.
  /// Thread t of the n = min(size(), count, limit) taking part (limit 0: no
  /// limit; the caller is thread 0) runs i = t, t + n, t + 2n, ...: items
  /// must be independent. Callers take turns.
  void run(size_t count, const std::function<void(size_t)> &fn, uint32_t limit = 0);

  /// Starts fn(i) for i in [0, count) on the helpers alone, one item each
  /// (count <= size() - 1), and returns at once; join() waits for them. The
  /// caller holds the team from launch() to join() (other callers wait).
  void launch(size_t count, const std::function<void(size_t)> &fn);
  void join();

private:
  void helperMain(uint32_t index);

  std::mutex turn;                       ///< held through a run() or launch()..join()
  std::unique_lock<std::mutex> launched; ///< the turn, from launch() to join()
  std::function<void(size_t)> launchedFn;

  std::mutex mutex;
  std::condition_variable wake; ///< helpers: a new job, or stop
  std::condition_variable done; ///< the caller: the helpers finished
  uint64_t generation = 0;      ///< jobs started
  bool stopping = false;
  const std::function<void(size_t)> *job = nullptr;
  size_t jobCount = 0;
  uint32_t jobThreads = 0; ///< run(): threads taking part; launch(): helpers taking part
  bool jobOnHelpers = false; ///< a launch() job: helper t runs item t - 1 only
  uint32_t busy = 0;         ///< helpers of the current job not yet done
  std::vector<std::thread> helpers;
  std::string startError;
};

} // namespace moec::exec

#endif // MOEC_RUNTIME_EXEC_THREADTEAM_H
