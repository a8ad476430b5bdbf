//===- ProgramBuilder.h - Task programs built by hand in tests -*- C++ -*-===//
//
// The tests of the code that runs or analyses task programs (the deadlock
// proof, the timed simulation, the executor) build small programs by hand
// with this builder.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TESTS_UNIT_SUPPORT_PROGRAMBUILDER_H
#define MOEC_TESTS_UNIT_SUPPORT_PROGRAMBUILDER_H

#include "format/TaskBinary.h"

#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace moec::test {

using namespace moec::format;

/// A wait threshold that build() replaces by the event's final value.
constexpr uint32_t kFinal = UINT32_MAX;

/// Builds small valid task programs: ops whose tasks are the columns of a
/// 1 x peers x 1 x n grid, events, per-task waits and signals, and queues.
/// Event thresholds are the sums of their signals.
class ProgramBuilder {
public:
  explicit ProgramBuilder(uint32_t ranks = 1, uint32_t localExperts = 1) {
    p.epRanks = ranks;
    p.localExperts = localExperts;
    p.target = p.addString("cpu");
    SlotRecord slot;
    slot.name = p.addString("x");
    slot.rank = 2;
    slot.dims[0] = 64;
    slot.dims[1] = 64;
    p.slots.push_back(slot);
  }

  /// Adds op `name` of `tasks` tasks on `core` cores, `peers` (1 or R) of
  /// them per grid column; returns the index of its first task.
  uint32_t op(const std::string &name, OpKind kind, CoreKind core, uint32_t tasks,
              uint32_t peers = 1) {
    TilingRecord tiling;
    tiling.opKind = kind;
    tiling.peers = peers;
    tiling.colTiles = tasks / peers;
    tiling.rows = 64;
    tiling.cols = 64ull * tiling.colTiles;
    tiling.depth = kind == OpKind::Gmm ? 64 : 0;
    tiling.tileM = tiling.tileN = tiling.tileK = 64;
    tiling.balancedRows = 64;
    p.tilings.push_back(tiling);
    OpRecord record;
    record.name = p.addString(name);
    record.kind = kind;
    record.firstTask = uint32_t(p.tasks.size());
    record.taskCount = tasks;
    record.tiling = uint32_t(p.tilings.size() - 1);
    p.ops.push_back(record);
    for (uint32_t t = 0; t < tasks; ++t) {
      TaskRecord task;
      task.op = uint32_t(p.ops.size() - 1);
      task.coreKind = core;
      p.tasks.push_back(task);
    }
    waits.resize(p.tasks.size());
    signals.resize(p.tasks.size());
    return record.firstTask;
  }

  /// Adds an event; returns its index.
  uint32_t event(const std::string &name, EventKind kind = EventKind::Local) {
    EventRecord record;
    record.name = p.addString(name);
    record.kind = kind;
    p.events.push_back(record);
    return uint32_t(p.events.size() - 1);
  }

  /// Makes `task` wait until `event` reaches `threshold` (kFinal: its final
  /// value).
  void wait(uint32_t task, uint32_t event, uint32_t threshold = kFinal) {
    waits[task].push_back({event, threshold});
  }

  /// Makes `task` add `increment` to `event` on the rank `peerOffset` ahead.
  void signal(uint32_t task, uint32_t event, uint32_t increment = 1, uint32_t peerOffset = 0) {
    signals[task].push_back({event, increment, peerOffset, 0});
  }

  /// Adds the queue of core (`kind`, `index`) running `tasks` in order.
  void queue(CoreKind kind, uint32_t index, const std::vector<uint32_t> &tasks) {
    QueueRecord record;
    record.coreKind = kind;
    record.coreIndex = index;
    record.firstEntry = uint32_t(p.queueEntries.size());
    record.entryCount = uint32_t(tasks.size());
    p.queues.push_back(record);
    p.queueEntries.insert(p.queueEntries.end(), tasks.begin(), tasks.end());
  }

  /// Lays out the waits and signals and sets each event's threshold to the
  /// sum of its signals (and each kFinal wait to that).
  TaskProgram build() {
    TaskProgram out = p;
    std::vector<uint32_t> sums(out.events.size(), 0);
    for (const auto &list : signals)
      for (const SignalRecord &signal : list)
        sums[signal.event] += signal.increment;
    for (size_t t = 0; t < out.tasks.size(); ++t) {
      TaskRecord &task = out.tasks[t];
      task.firstWait = uint32_t(out.waits.size());
      task.waitCount = uint32_t(waits[t].size());
      for (WaitRecord wait : waits[t]) {
        if (wait.threshold == kFinal)
          wait.threshold = sums[wait.event];
        out.waits.push_back(wait);
      }
      task.firstSignal = uint32_t(out.signals.size());
      task.signalCount = uint32_t(signals[t].size());
      out.signals.insert(out.signals.end(), signals[t].begin(), signals[t].end());
    }
    for (size_t e = 0; e < out.events.size(); ++e)
      out.events[e].threshold = sums[e];
    return out;
  }

private:
  TaskProgram p;
  std::vector<std::vector<WaitRecord>> waits;
  std::vector<std::vector<SignalRecord>> signals;
};

/// Requires `program` to pass validation, with the message on failure.
inline void requireValid(const TaskProgram &program) {
  Status status = validateTaskProgram(program);
  INFO(status.message());
  REQUIRE(status.ok());
}

} // namespace moec::test

#endif // MOEC_TESTS_UNIT_SUPPORT_PROGRAMBUILDER_H
