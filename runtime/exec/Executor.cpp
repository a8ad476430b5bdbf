//===- Executor.cpp - Runs a task program on every rank of an EP group ----===//
//
// See Executor.h for the design. Ownership rules that keep it race-free:
//
// - A logical queue's QueueState is written only by the worker that owns
//   the queue. Ownership moves through the ready FIFO (under `mutex`), an
//   event's waiter list (under the event's lock), or a worker's list of
//   queues its signals woke.
// - An event's waiter list and the waitThreshold/nextWaiter fields of the
//   queues on it are touched only under the event's lock.
// - A queue parks by linking itself and publishing the smallest waited-for
//   threshold (`minWaiting`), then re-reading the counter, all seq_cst; a
//   signaller adds to the counter and then reads `minWaiting`, both seq_cst.
//   Whichever runs second sees the other, so a wake-up is never lost.
// - The workers are the helpers of a thread team (ThreadTeam, the process's
//   when the options give one): run() resets all state single-threaded,
//   then launches one worker per helper and joins them at the end.
//
// This file makes the executor and runs a pass; ExecutorImpl.h holds its
// state, Workers.cpp the workers' loop, Supervise.cpp the reset, the
// watchdog and the reports.
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/ExecutorImpl.h"

namespace moec::exec {

Executor::Impl::Impl(TaskProgram programIn, TaskFunction runTaskIn,
                     const ExecutorOptions &optionsIn)
    : program(std::move(programIn)), runTask(std::move(runTaskIn)), options(optionsIn) {
  rankCount = program.ranks();
  queueCount = uint32_t(program.queues.size());
  eventCount = uint32_t(program.events.size());
  workerCount = options.workers;
  if (workerCount == 0)
    workerCount = std::max(1u, std::thread::hardware_concurrency());
  firstLocal = 0;
  localCount = rankCount;
  if (options.fabric && !options.fabric->allLocal()) {
    remote = true;
    firstLocal = options.fabric->firstLocal();
    localCount = options.fabric->localRanks();
    this->options.detectDeadlock = false;
    std::vector<bool> fromPeer(program.events.size(), false);
    eventTotal.assign(program.events.size(), 0);
    signallers.resize(program.events.size());
    // Every rank runs every task once, so each task's signals reach every
    // rank once in a pass (from the rank peerOffset before it). Tasks may
    // share signal records: count them per task.
    // A task that fans out reaches every rank once from each TP rank of
    // the EP rank peerOffset before it.
    for (const TaskRecord &task : program.tasks) {
      const bool fanOut = program.fansOut(task.op);
      for (uint32_t i = 0; i < task.signalCount; ++i) {
        const SignalRecord &signal = program.signals[task.firstSignal + i];
        eventTotal[signal.event] += uint64_t(signal.increment) * (fanOut ? program.tpRanks : 1);
        if (signal.peerOffset == 0 && !fanOut)
          continue;
        fromPeer[signal.event] = true;
        std::vector<Signaller> &from = signallers[signal.event];
        auto it = std::find_if(from.begin(), from.end(), [&](const Signaller &s) {
          return s.offset == signal.peerOffset && program.fansOut(s.op) == fanOut;
        });
        if (it == from.end())
          from.push_back({signal.peerOffset, signal.increment, task.op});
        else
          it->total += signal.increment;
      }
    }
    for (uint32_t e = 0; e < fromPeer.size(); ++e)
      if (fromPeer[e])
        remoteEvents.push_back(e);
    inboxValues.assign(size_t(localCount) * program.events.size(), 0);
    inboxSeen = inboxValues;
  }
  totalTasks = uint64_t(localCount) * program.tasks.size();

  queueInfo.resize(queueCount);
  for (uint32_t q = 0; q < queueCount; ++q)
    queueInfo[q] = {program.queues[q].firstEntry, program.queues[q].entryCount,
                    program.queues[q].coreKind == CoreKind::Cube};
  for (uint32_t e = 0; e < eventCount; ++e)
    if (program.events[e].kind == EventKind::Terminate)
      terminateEvents.push_back(e);
  for (uint32_t q = 0; q < queueCount; ++q)
    if (queueInfo[q].count > 0)
      for (uint32_t r = firstLocal; r < firstLocal + localCount; ++r)
        startOrder.push_back(r * queueCount + q);

  events.reset(new EventState[size_t(rankCount) * eventCount]);
  queues.reset(new QueueState[size_t(rankCount) * queueCount]);
  ring.assign(size_t(rankCount) * queueCount, kNil);
  workers.reset(new Worker[workerCount]);
  for (uint32_t w = 0; w < workerCount; ++w)
    workers[w].woken.reserve(64);
}

Executor::Impl::~Impl() = default;

//===----------------------------------------------------------------------===//
// Executor
//===----------------------------------------------------------------------===//

Executor::Executor(std::unique_ptr<Impl> implIn) : impl(std::move(implIn)) {}

Executor::~Executor() = default;

Status Executor::create(TaskProgram program, TaskFunction runTask, const ExecutorOptions &options,
                        std::unique_ptr<Executor> *out) {
  if (!runTask)
    return Status::error("executor: no task function");
  Status status = format::validateTaskProgram(program);
  if (!status.ok())
    return status.withPrefix("executor: invalid program: ");
  if (uint64_t(program.ranks()) * program.queues.size() >= kNil)
    return Status::error(fmt::format("executor: {} ranks x {} queues are too many logical queues",
                                     program.ranks(), program.queues.size()));
  std::unique_ptr<Impl> impl;
  try {
    impl = std::make_unique<Impl>(std::move(program), std::move(runTask), options);
  } catch (const std::bad_alloc &) {
    return Status::error("executor: out of memory for the per-rank state");
  }
  if (impl->remote) {
    status = impl->options.fabric->createInbox(impl->eventCount, &impl->inbox);
    if (!status.ok())
      return status.withPrefix("executor: ");
  }
  // The workers are the team's helpers: the options' team (the process's,
  // shared by the passes of every layer), or one of the executor's own.
  impl->team = options.team ? options.team
                            : std::make_shared<ThreadTeam>(impl->workerCount + 1);
  if (impl->team->size() - 1 < impl->workerCount)
    return Status::error(fmt::format(
        "executor: cannot start worker thread {} of {}: {} (the system starts no more threads: "
        "a memory or process limit; ask for fewer)",
        impl->team->size() - 1, impl->workerCount, impl->team->whyFewer()));
  out->reset(new Executor(std::move(impl)));
  return Status::success();
}

Status Executor::run() {
  Impl &state = *impl;
  if (state.inRun.exchange(true))
    return Status::error("executor: run() is already running");
  state.reset();
  state.passStart = Clock::now();
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    state.inPass = state.workerCount;
  }
  state.team->launch(state.workerCount,
                     [&state](size_t worker) { state.workerMain(uint32_t(worker)); });
  if (state.remote)
    state.superviseRemote();
  else
    state.supervise();
  state.team->join();
  Clock::time_point end = Clock::now();

  state.stats.tasksRun = state.totalTasks - state.remaining.load();
  state.stats.seconds = std::chrono::duration<double>(end - state.passStart).count();
  if (state.options.trace) {
    for (uint32_t w = 0; w < state.workerCount; ++w)
      state.trace.append(state.workers[w].trace);
    state.trace.append(state.remoteWaits);
    state.trace.sort();
  }
  Status status = state.result();
  if (state.remote && status.ok()) {
    // Every signal of this pass has arrived (the local waits and terminate
    // events count all of them), and peers signal the next pass only after
    // its exchange: the inbox can start again from zero.
    state.inbox->reset();
    std::fill(state.inboxValues.begin(), state.inboxValues.end(), 0);
    std::fill(state.inboxSeen.begin(), state.inboxSeen.end(), 0);
  }
  state.inRun.store(false);
  return status;
}

bool Executor::stopRequested() const {
  return impl->inRun.load(std::memory_order_relaxed) &&
         impl->passOver.load(std::memory_order_relaxed) &&
         impl->remaining.load(std::memory_order_relaxed) > 0;
}

uint64_t Executor::tasksPerPass() const { return impl->totalTasks; }

uint64_t Executor::tasksDone() const {
  return impl->totalTasks - std::min(impl->totalTasks,
                                     impl->remaining.load(std::memory_order_relaxed));
}

const TaskProgram &Executor::program() const { return impl->program; }

uint32_t Executor::ranks() const { return impl->rankCount; }

uint32_t Executor::workers() const { return impl->workerCount; }

const PassStats &Executor::lastPass() const { return impl->stats; }

const trace::Trace &Executor::trace() const { return impl->trace; }

std::chrono::steady_clock::time_point Executor::lastPassStart() const { return impl->passStart; }

Status Executor::writeTrace(const std::string &path) const {
  return trace::writeChromeTrace(impl->program, impl->trace, path);
}

} // namespace moec::exec
