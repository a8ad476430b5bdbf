//===- Analysis.cpp - what a task program costs, simulated ----------------===//

#include "compiler/inspect/Analysis.h"

#include "compiler/target/Cost.h"

#include <fmt/format.h>

#include <algorithm>

namespace moec::inspect {

using namespace moec::format;

Status analysisProfile(const TaskProgram &program, const std::optional<std::string> &target,
                       std::optional<target::TargetProfile> *profile, std::string *note) {
  target::TargetProfile resolved;
  profile->reset();
  note->clear();
  if (target) {
    if (Status status = target::resolveProfile(*target, &resolved); !status)
      return status.withPrefix("--target: ");
    *profile = resolved;
    return Status::success();
  }
  std::string name(program.name(program.target));
  if (Status status = target::resolveProfile(name, &resolved); status)
    *profile = resolved;
  else
    *note = fmt::format("the binary's target '{}' cannot be resolved here ({}); give --target "
                        "PROFILE for time estimates",
                        name, status.message());
  return Status::success();
}

Analysis analyzeProgram(const TaskProgram &program, const target::TargetProfile *profile,
                        const std::string &note, bool recordTrace) {
  Analysis a;
  a.timed = profile != nullptr;
  if (profile) {
    a.profileName = profile->name;
    target::CostModel model = target::costModel(program, *profile);
    a.costs = model.costs;
    a.run = target::simulateTimed(program, model, recordTrace);
    if (recordTrace)
      a.run.trace.profile = profile->name;
  } else {
    a.note = note;
    a.costs.assign(program.tasks.size(), 1.0);
    a.run = target::simulateTimed(program, a.costs);
  }
  a.signallers.assign(program.events.size(), 0);
  a.waiters.assign(program.events.size(), 0);
  for (const TaskRecord &task : program.tasks) {
    for (uint32_t k = 0; k < task.waitCount; ++k)
      ++a.waiters[program.waits[size_t(task.firstWait) + k].event];
    for (uint32_t k = 0; k < task.signalCount; ++k)
      ++a.signallers[program.signals[size_t(task.firstSignal) + k].event];
  }
  return a;
}

std::string coreCountWarning(const TaskProgram &program, const target::TargetProfile &profile) {
  uint32_t cubeQueues = 0, vectorQueues = 0;
  for (const QueueRecord &queue : program.queues)
    (queue.coreKind == CoreKind::Cube ? cubeQueues : vectorQueues) += 1;
  if (cubeQueues == profile.cubeCores && vectorQueues == profile.vectorCores)
    return "";
  return fmt::format("profile '{}' has {} cube + {} vector cores per rank, but the binary was "
                     "scheduled for {} cube + {} vector queues; the estimates keep the binary's "
                     "queues (compile with --target {} for that profile's schedule)",
                     profile.name, profile.cubeCores, profile.vectorCores, cubeQueues,
                     vectorQueues, profile.name);
}


std::string formatSeconds(double seconds) {
  if (seconds == 0)
    return "0 s";
  static const struct {
    double scale;
    const char *unit;
  } units[] = {{1, "s"}, {1e-3, "ms"}, {1e-6, "us"}, {1e-9, "ns"}};
  for (const auto &u : units)
    if (seconds >= u.scale || u.scale == 1e-9) {
      double v = seconds / u.scale;
      int decimals = v >= 100 ? 0 : v >= 10 ? 1 : 2;
      return fmt::format("{:.{}f} {}", v, decimals, u.unit);
    }
  return fmt::format("{} s", seconds);
}

std::string summarizePath(const TaskProgram &program, const std::vector<uint32_t> &tasks,
                          const std::vector<uint32_t> &ranks, size_t maxRuns) {
  struct Run {
    uint32_t op, rank;
    size_t count;
  };
  std::vector<Run> runs;
  for (size_t i = 0; i < tasks.size(); ++i) {
    uint32_t op = program.tasks[tasks[i]].op;
    uint32_t rank = i < ranks.size() ? ranks[i] : 0;
    if (!runs.empty() && runs.back().op == op && runs.back().rank == rank)
      ++runs.back().count;
    else
      runs.push_back({op, rank, 1});
  }
  std::string out;
  for (size_t i = 0; i < runs.size() && i < maxRuns; ++i) {
    out += fmt::format("{}{} x{}", i ? " → " : "", program.name(program.ops[runs[i].op].name),
                       runs[i].count);
    if (runs[i].rank != 0)
      out += fmt::format(" on rank {}", runs[i].rank);
  }
  if (runs.size() > maxRuns)
    out += fmt::format(" → ... ({} more)", runs.size() - maxRuns);
  return out;
}

Status analyzeBinary(const TaskProgram &program, const std::optional<std::string> &target,
                     bool recordTrace, const std::string &source, Analysis *out) {
  std::optional<target::TargetProfile> profile;
  std::string note;
  if (Status status = analysisProfile(program, target, &profile, &note); !status)
    return status;
  if (recordTrace && !profile)
    return Status::error(fmt::format("{}: a simulated trace (--trace) needs a profile: {}", source, note));
  *out = analyzeProgram(program, profile ? &*profile : nullptr, note, recordTrace);
  if (target && profile)
    if (std::string warning = coreCountWarning(program, *profile); !warning.empty())
      out->warnings.push_back(warning);
  return Status::success();
}

} // namespace moec::inspect
