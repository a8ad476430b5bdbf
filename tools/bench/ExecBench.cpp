//===- ExecBench.cpp - Scheduling overhead of the executor ---------------===//
//
// Runs a task binary's passes for all of its ranks with a task function that
// only spins for a fixed time, and prints the wall time per pass and the
// executor's overhead per task run:
//
//   bazel run //tools/bench:exec_bench -- FILE [workers [passes [task_us]]]
//
//===----------------------------------------------------------------------===//

#include "runtime/exec/Executor.h"
#include "format/TaskBinary.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <string>

using namespace moec;

int main(int argc, char **argv) {
  const char *usage = "usage: exec_bench FILE [workers [passes [task_us]]]\n"
                      "  runs FILE's passes (a task binary) on the executor with tasks that\n"
                      "  only spin task_us each; prints the wall time a pass and the\n"
                      "  executor's overhead a task\n";
  if (argc > 1 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    fmt::print("{}", usage);
    return 0;
  }
  if (argc < 2) {
    fmt::print(stderr, "{}", usage);
    return 2;
  }
  uint32_t workers = argc > 2 ? uint32_t(std::atoi(argv[2])) : 0;
  int passes = argc > 3 ? std::atoi(argv[3]) : 5;
  double taskUs = argc > 4 ? std::atof(argv[4]) : 0;

  format::TaskProgram program;
  Status status = format::loadTaskBinaryFile(argv[1], &program);
  if (!status.ok()) {
    fmt::print(stderr, "{}\n", status.message());
    return 1;
  }
  auto taskTime = std::chrono::nanoseconds(int64_t(taskUs * 1000));
  exec::ExecutorOptions options;
  options.workers = workers;
  std::unique_ptr<exec::Executor> executor;
  status = exec::Executor::create(
      program,
      [taskTime](uint32_t, uint32_t, uint32_t) {
        if (taskTime.count() > 0) {
          auto end = std::chrono::steady_clock::now() + taskTime;
          while (std::chrono::steady_clock::now() < end) {
          }
        }
        return Status();
      },
      options, &executor);
  if (!status.ok()) {
    fmt::print(stderr, "{}\n", status.message());
    return 1;
  }
  uint64_t runs = uint64_t(program.epRanks) * program.tasks.size();
  fmt::print("{} ranks x {} queues, {} tasks per rank ({} task runs a pass), {} workers, "
             "{} us per task\n",
             program.epRanks, program.queues.size(), program.tasks.size(), runs,
             executor->workers(), taskUs);
  double ideal = double(runs) * taskUs * 1e-6 / executor->workers();
  for (int pass = 0; pass < passes; ++pass) {
    status = executor->run();
    if (!status.ok()) {
      fmt::print(stderr, "{}\n", status.message());
      return 1;
    }
    double seconds = executor->lastPass().seconds;
    fmt::print("pass {}: {:.3f} ms, {:.0f} ns per task run over the ideal {:.3f} ms\n", pass,
               seconds * 1e3, (seconds - ideal) * 1e9 * executor->workers() / double(runs),
               ideal * 1e3);
  }
  return 0;
}
