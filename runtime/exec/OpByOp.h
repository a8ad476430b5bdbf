//===- OpByOp.h - One op of a task program as a program of its own -*- C++ -*-===//
//
// The baseline a fused schedule is measured against runs the same tasks on
// the same cores, but one op at a time with a barrier over all ranks between
// ops, as an op-by-op framework would. singleOpProgram() cuts a program into
// such steps: step k holds op k's tasks only, in the queues they had, with no
// events (inside one op no task waits for another). An executor per step, run
// in op order, is then the op-by-op schedule; the end of each run() is the
// barrier.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_EXEC_OPBYOP_H
#define MOEC_RUNTIME_EXEC_OPBYOP_H

#include "format/TaskBinary.h"

namespace moec::exec {

/// Returns the program of op `op` of `program` alone: its slots and strings,
/// the op (now op 0) and its tiling, its tasks (task i is the op's task
/// program.ops[op].firstTask + i) with no waits or signals, no events, and
/// every queue of `program` holding just the op's tasks, in their order.
format::TaskProgram singleOpProgram(const format::TaskProgram &program, uint32_t op);

} // namespace moec::exec

#endif // MOEC_RUNTIME_EXEC_OPBYOP_H
