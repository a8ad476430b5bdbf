//===- OpByOp.cpp - One op of a task program as a program of its own ------===//
//
// See OpByOp.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/OpByOp.h"

namespace moec::exec {

format::TaskProgram singleOpProgram(const format::TaskProgram &program, uint32_t op) {
  const format::OpRecord &source = program.ops[op];
  format::TaskProgram step;
  step.flags = program.flags;
  step.epRanks = program.epRanks;
  step.tpRanks = program.tpRanks;
  step.localExperts = program.localExperts;
  step.target = program.target;
  step.strings = program.strings;
  step.slots = program.slots;
  format::OpRecord only = source;
  only.firstTask = 0;
  only.tiling = 0;
  step.ops.push_back(only);
  step.tilings.push_back(program.tilings[source.tiling]);
  for (uint32_t i = 0; i < source.taskCount; ++i) {
    format::TaskRecord task = program.tasks[source.firstTask + i];
    task.op = 0;
    task.firstWait = task.waitCount = 0;
    task.firstSignal = task.signalCount = 0;
    step.tasks.push_back(task);
  }
  for (const format::QueueRecord &queue : program.queues) {
    format::QueueRecord copy = queue;
    copy.firstEntry = uint32_t(step.queueEntries.size());
    for (uint32_t k = 0; k < queue.entryCount; ++k) {
      const uint32_t task = program.queueEntries[queue.firstEntry + k];
      if (task >= source.firstTask && task - source.firstTask < source.taskCount)
        step.queueEntries.push_back(task - source.firstTask);
    }
    copy.entryCount = uint32_t(step.queueEntries.size()) - copy.firstEntry;
    step.queues.push_back(copy);
  }
  return step;
}

} // namespace moec::exec
