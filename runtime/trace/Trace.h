//===- Trace.h - What one pass of a task program did, over time -*- C++ -*-===//
//
// A trace of one pass: when each task ran (rank, core, tile), when a core
// sat waiting for an event and which task's signal released it, and the
// host phases around the task program (prepare, tasks, finish). The CPU
// runtime records one (ExecutorOptions::trace), and the simulator makes one
// from a cost model (target::simulateTimed), so that the measured and the
// simulated run of one binary can be read side by side.
//
// Written as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and
// chrome://tracing open:
//
//   - pid = rank ("rank 0"), tid = queue index ("cube core 0", "vector core
//     1"); one more thread per rank, tid = number of queues, holds the
//     host phases ("host").
//   - A task is a complete event ("ph": "X") named after its op, category
//     its op kind, with args {task, op, rank, expert (global), peer (a put's
//     destination rank), row_tile, col_tile, rows, cols, worker}.
//   - A wait is a complete event on the waiting core, named "wait <event
//     name>", category "wait", with args {event, event_name, task (the
//     task that waited), signal_rank, signal_task}; the signaller is -1
//     when it is not known (a signal from another process).
//   - For every wait whose signaller is known, a flow arrow (category
//     "signal"): a "ph": "s" event inside the signalling task's slice and a
//     "ph": "f" event ("bp": "e") inside the slice of the task that waited,
//     just after its start, with one id per arrow.
//   - A host phase is a complete event named "prepare", "tasks" or
//     "finish", category "phase".
//   - The top-level "metadata" object says where the trace comes from
//     ("source": "measured" or "simulated", "profile", "pass", "binary",
//     "ep_ranks", "local_experts").
//
// No MLIR/LLVM dependency.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TRACE_TRACE_H
#define MOEC_RUNTIME_TRACE_TRACE_H

#include "base/Status.h"
#include "format/TaskBinary.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace moec::trace {

/// No signaller known.
inline constexpr uint32_t kUnknown = std::numeric_limits<uint32_t>::max();

/// One task run.
struct TaskSpan {
  uint32_t rank = 0;   ///< the rank it ran for
  uint32_t queue = 0;  ///< index of its queue in the program (its core)
  uint32_t task = 0;   ///< index of the task in the program
  uint32_t worker = 0; ///< the worker thread that ran it (simulated: its queue)
  int64_t startNs = 0; ///< when it started, from the trace's origin
  int64_t endNs = 0;   ///< when it ended (its signals sent)
  /// Of that, the time the worker's thread was off its core (its wall time
  /// less the thread's CPU time: the OS ran something else there); -1 where
  /// not known (a simulated run).
  int64_t offCoreNs = -1;
};

/// A core waiting: the head task of a queue could not start until an event
/// reached the threshold it waits for.
struct WaitSpan {
  uint32_t rank = 0;  ///< the waiting rank
  uint32_t queue = 0; ///< the waiting queue
  uint32_t task = 0;  ///< the task that waited (the queue's head)
  uint32_t event = 0; ///< the event it waited for
  int64_t beginNs = 0, endNs = 0;
  uint32_t signalRank = kUnknown; ///< the rank of the task whose signal met the wait
  uint32_t signalTask = kUnknown; ///< that task
};

/// A host phase of a pass on one process: "prepare", "tasks", "finish".
struct PhaseSpan {
  uint32_t rank = 0; ///< the process's first rank (its track)
  std::string name;
  int64_t beginNs = 0, endNs = 0;
};

/// A trace of one pass.
struct Trace {
  std::string source = "measured"; ///< or "simulated"
  std::string profile;             ///< the cost profile of a simulated trace
  std::vector<TaskSpan> tasks;
  std::vector<WaitSpan> waits;
  std::vector<PhaseSpan> phases;

  /// Adds `ns` to every time.
  void shift(int64_t ns);
  /// Appends `other`'s spans (same origin).
  void append(const Trace &other);
  /// Sorts tasks and waits by start time (then rank, queue).
  void sort();
  bool empty() const { return tasks.empty() && waits.empty() && phases.empty(); }
};

/// The spans of `trace` as bytes, to send to another process.
std::vector<char> packTrace(const Trace &trace);
/// The spans packTrace() made of a trace, appended to *out. Errors: bytes
/// that packTrace() did not make.
Status unpackTrace(const char *bytes, size_t size, Trace *out);

/// Returns `trace` of a pass of `program` as Chrome trace-event JSON (see
/// the file comment). `binary` names the program in the metadata.
std::string chromeTraceJson(const format::TaskProgram &program, const Trace &trace,
                            const std::string &binary = "");

/// Writes chromeTraceJson() to `path`, whole or not at all. Errors start
/// with the path.
Status writeChromeTrace(const format::TaskProgram &program, const Trace &trace,
                        const std::string &path, const std::string &binary = "");

/// Returns "cube core 3" or "vector core 0" for queue `queue` of `program`.
std::string coreName(const format::TaskProgram &program, uint32_t queue);

} // namespace moec::trace

#endif // MOEC_RUNTIME_TRACE_TRACE_H
