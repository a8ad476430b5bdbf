//===- RunCommand.cpp - moec run --------------------------------------------===//
//
// Runs a forward binary (and a backward one) on R in-process ranks with the
// CPU runtime, on inputs from .npy files or made at random, and writes the
// outputs as .npy; optionally checks them against the reference layer.
//
//===----------------------------------------------------------------------===//

#include "base/File.h"
#include "base/Memory.h"
#include "base/Time.h"
#include "format/Capacity.h"
#include "format/Crc32.h"
#include "format/TaskBinary.h"
#include "runtime/api/Runtime.h"
#include "runtime/backend/Registry.h"
#include "runtime/comm/Mpi.h"
#include "runtime/tooling/LayerRun.h"
#include "runtime/tooling/Profile.h"
#include "runtime/tooling/Workspace.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"
#include "tools/moec/Progress.h"
#include "tools/moec/RunOptions.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>


namespace moec::cli {

using namespace moec::tooling;

namespace {

/// Set once the MPI fabric exists: an error then ends the whole job, after
/// rank 0 gathered every rank's report (bounded by reportSeconds).
comm::Fabric *jobFabric = nullptr;
double reportSeconds = 10;

/// The outputs folder while the run holds it: released (and removed when
/// the run made it and wrote nothing) before an error ends the job.
std::unique_ptr<RunFolder> runFolder;

int fail(const Status &status) {
  Progress::abandonCurrent();
  runFolder.reset();
  if (jobFabric) {
    // Rank 0 prints its error and the report of every rank; another rank
    // prints its own only where rank 0 did not take it.
    const uint32_t rank = jobFabric->firstLocal();
    if (rank == 0) {
      std::fprintf(stderr, "error: [process of rank 0] %s\n", status.message().c_str());
      std::fflush(stderr);
    }
    const std::string report = jobFabric->stopJob(status.message(), reportSeconds);
    if (rank != 0 && !report.empty())
      std::fprintf(stderr, "error: [process of rank %u] %s\n", rank, status.message().c_str());
    std::fprintf(stderr, "%s", report.c_str());
    std::fflush(stderr);
    comm::abortMpi(kError);
  }
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return kError;
}

/// Under MPI every process reads (or makes) the inputs of all ranks; they
/// must be the same everywhere (a host with another copy of the folder
/// would run another layer, or overrun its buffers). Each process sends the
/// shape and a CRC-32 of each input to every other, and each refuses a
/// difference, naming the ranks and the input.
/// Refuses a job whose ranks were started with other options, naming both
/// ranks and their options; before anything else is exchanged, so that no
/// rank waits in a step another rank does not take.
Status checkSameOptions(comm::Fabric &fabric, const std::string &options,
                        double timeoutSeconds) {
  struct Fingerprint {
    uint32_t crc;
    char text[508]; // the start of the options, for the message
  };
  Fingerprint mine{format::crc32(reinterpret_cast<const uint8_t *>(options.data()), options.size()),
                   {}};
  std::memcpy(mine.text, options.data(), std::min(options.size(), sizeof mine.text - 1));
  std::vector<Fingerprint> all(fabric.ranks());
  if (Status s = fabric.exchange(&mine, sizeof mine, all.data(), timeoutSeconds); !s)
    return s.withPrefix("comparing the options of the ranks: ");
  // Every process compares each rank with rank 0, so that all of them name the
  // same pair, whichever stops the job first.
  const auto text = [](const Fingerprint &f) {
    return std::string(f.text, strnlen(f.text, sizeof f.text));
  };
  for (uint32_t p = 1; p < fabric.ranks(); ++p)
    if (all[p].crc != all[0].crc)
      return Status::error(fmt::format(
          "rank {} was started with other options than rank 0: '{}' against '{}' (every rank "
          "of the job needs the same options; only --threads, --timeout, --repeat, --outputs "
          "and the progress options may differ)",
          p, text(all[p]), text(all[0])));
  return Status::success();
}

/// Refuses a job whose ranks read other inputs (shapes and CRC-32s), naming
/// both ranks and what differs.
Status checkSameInputs(comm::Fabric &fabric, const LayerData &data, double timeoutSeconds) {
  struct Fingerprint {
    int64_t shape[6];
    uint32_t crc[10];
  };
  const auto crcOf = [](const auto &values) {
    return format::crc32(reinterpret_cast<const uint8_t *>(values.data()),
                         values.size() * sizeof(values[0]));
  };
  // Every input file, the adapters' of both projections last.
  std::vector<std::string> names = {"x.npy",  "topk_ids.npy", "topk_weights.npy",
                                    "w1.npy", "w2.npy",       "dy.npy"};
  Fingerprint mine{{data.ranks, data.tokens, data.topK, data.experts, data.hidden, data.inter},
                   {crcOf(data.x), crcOf(data.ids), crcOf(data.weights), crcOf(data.w1),
                    crcOf(data.w2), crcOf(data.dy)}};
  for (const LoraTensor &t : loraTensors(3, false)) {
    mine.crc[names.size()] = crcOf(t.of(data));
    names.push_back(t.name() + ".npy");
  }
  std::vector<Fingerprint> all(fabric.ranks());
  if (Status s = fabric.exchange(&mine, sizeof mine, all.data(), timeoutSeconds); !s)
    return s.withPrefix("comparing the inputs of the ranks: ");
  // Each rank against rank 0, the same pair in every process (see checkSameOptions).
  const Fingerprint &first = all[0];
  for (uint32_t p = 1; p < fabric.ranks(); ++p) {
    const Fingerprint &theirs = all[p];
    if (std::memcmp(first.shape, theirs.shape, sizeof first.shape) != 0)
      return Status::error(fmt::format(
          "rank {} read inputs of another shape than rank 0: R {}, S {}, K {}, E {}, H {}, I {} "
          "against R {}, S {}, K {}, E {}, H {}, I {} (every rank needs the same input folder "
          "and the same --random seed)",
          p, theirs.shape[0], theirs.shape[1], theirs.shape[2], theirs.shape[3], theirs.shape[4],
          theirs.shape[5], first.shape[0], first.shape[1], first.shape[2], first.shape[3],
          first.shape[4], first.shape[5]));
    for (size_t i = 0; i < names.size(); ++i)
      if (first.crc[i] != theirs.crc[i])
        return Status::error(fmt::format(
            "rank {} read another {} than rank 0 (CRC-32 {:08x} against {:08x}; every rank "
            "needs the same input folder, or the same --random seed and --hot-share)",
            p, names[i], theirs.crc[i], first.crc[i]));
  }
  return Status::success();
}

std::string describe(const rt::LayerShape &s) {
  return fmt::format("{} ranks{} x {} local experts, H {}, I {}, {}{}", s.ranks,
                     s.tp > 1 ? fmt::format(" ({} EP x {} TP)", s.epRanks(), s.tp) : "",
                     s.localExperts, s.hidden,
                     s.tp > 1 ? fmt::format("{} ({} per TP rank)", s.inter * s.tp, s.inter)
                              : fmt::format("{}", s.inter),
                     format::dtypeName(s.activations),
                     s.fp8Dispatch ? ", FP8 dispatch" : "");
}

void printSchedule(const char *pass, const format::TaskProgram &p) {
  uint32_t cube = 0, vector = 0;
  for (const format::QueueRecord &q : p.queues)
    (q.coreKind == format::CoreKind::Cube ? cube : vector)++;
  std::printf("  %-8s %zu ops, %zu tasks, %zu events on %u cube + %u vector queues per rank "
              "(target '%s')\n",
              pass, p.ops.size(), p.tasks.size(), p.events.size(), cube, vector,
              std::string(p.name(p.target)).c_str());
}

/// Prints a line for every tensor of `data` with NaN or infinite values, per
/// rank (or per expert for the weights): they pass through the layer
/// silently, so the run says where they are.
void reportNonFinite(const LayerData &d, bool backward, bool outputs) {
  const int64_t R = d.ranks, L = d.experts / std::max<int64_t>(1, d.ranks);
  const auto scan = [&](const char *name, const std::vector<float> &values, int64_t parts,
                        const char *part) {
    if (values.empty() || parts <= 0)
      return;
    const size_t per = values.size() / size_t(parts);
    for (int64_t p = 0; p < parts; ++p) {
      int64_t bad = 0;
      for (size_t i = size_t(p) * per; i < size_t(p + 1) * per; ++i)
        bad += !std::isfinite(values[i]);
      if (bad)
        std::printf("non-finite: %s of %s %lld: %lld NaN/inf value%s\n", name, part, (long long)p,
                    (long long)bad, bad == 1 ? "" : "s");
    }
  };
  if (!outputs) {
    scan("x", d.x, R, "rank");
    scan("topk_weights", d.weights, R, "rank");
    scan("w1", d.w1, R * L, "expert");
    scan("w2", d.w2, R * L, "expert");
    if (backward)
      scan("dy", d.dy, R, "rank");
    for (const LoraTensor &t : loraTensors(d.loraTargets, false))
      scan(t.name().c_str(), t.of(d), R * L, "expert");
    return;
  }
  scan("y", d.y, R, "rank");
  if (backward) {
    scan("dx", d.dx, R, "rank");
    scan("dtopk_weights", d.dtopk, R, "rank");
    scan("dw1", d.dw1, R * L, "expert");
    scan("dw2", d.dw2, R * L, "expert");
    for (const LoraTensor &t : loraTensors(d.loraTargets, true))
      scan(t.name().c_str(), t.of(d), R * L, "expert");
  }
}

/// What to change in the config for a routing the binary has no room for.
std::string capacityHint(const rt::LayerShape &shape, const rt::CapacityNeed &need) {
  std::string hint = fmt::format(
      "the routing needs: {} rows routed by the fullest rank (the binary: {}), {} rows received "
      "by the experts of the fullest rank (the binary: {})",
      need.rowsPerRank, shape.rowCapacity, need.receivePerRank, shape.receiveCapacity);
  // What the config the binary was compiled from (its layer record) must
  // change.
  const format::CapacityAdvice advice = format::adviseCapacity(
      shape.capacityInputs(), need.rowsPerRank, need.receivePerRank, /*headroom=*/false);
  if (!advice.fits)
    return hint + fmt::format("; no config of this layer holds it (seq_size is at most {} and "
                              "capacity_factor at most {}): route fewer rows to one rank",
                              format::kMaxSeqSize, format::kMaxCapacityFactor);
  if (advice.seqSize > shape.tokens)
    hint += fmt::format("; compile with \"seq_size\" at least {} (tokens per rank)",
                        advice.seqSize);
  if (need.receivePerRank > shape.receiveCapacity)
    hint += fmt::format("; compile with \"capacity_factor\": {:.2f} or more in the config",
                        advice.capacityFactor);
  return hint;
}

void printTimes(const char *pass, const rt::PassTimes &t, uint64_t repeat) {
  std::printf("  %-8s %9.3f ms   prepare %.3f (checks %.3f)  tasks %.3f  finish %.3f%s\n", pass,
              t.total() * 1e3, t.prepare * 1e3, t.checks * 1e3, t.tasks * 1e3, t.finish * 1e3,
              repeat > 1 ? fmt::format("   (best of {})", repeat).c_str() : "");
}

/// The memory a run needs (the layer's tensors as fp32 arrays and in the
/// binary's storage type, the workspace where it is host memory, and with
/// `wholeReference` the reference layer in double) against what this
/// process may use. The cuda backend's workspace is on the GPU.
Status checkRunMemory(const rt::LayerShape &shape, const rt::Context &context, bool backward,
                      bool wholeReference, bool workspaceOnHost) {
  const double R = shape.ranks,
               S = double(shape.rowCapacity) / double(std::max<int64_t>(1, shape.topK)),
               K = shape.topK, E = shape.experts(), H = shape.hidden, I = shape.inter;
  const double perCopy =
      4 * ((backward ? 4 : 2) * R * S * H + (backward ? 2 : 1) * 3 * E * H * I) + 16 * R * S * K;
  const double workspace = workspaceOnHost ? double(context.workspaceToAllocate()) : 0.0;
  const double needed = 2 * perCopy + workspace;
  const MemoryLimit limit = memoryLimit();
  if (!limit.error.empty())
    return Status::error(limit.error);
  const double memory = double(limit.bytes);
  if (memory > 0 && needed > memory)
    return Status::error(fmt::format(
        "the layer needs {} in this process ({} of tensors, twice: as fp32 arrays and in the "
        "binary's storage type; {} of workspace); {} {}",
        memoryText(needed), memoryText(perCopy), memoryText(workspace), limit.source,
        memoryText(memory)));
  const double reference = verifyBytes(shape, backward);
  if (wholeReference && memory > 0 && needed + reference > memory)
    return Status::error(fmt::format(
        "--verify runs the whole reference layer in double: {} on top of the run's {}, and "
        "{} {}; use --verify-sample N to check N random tokens and the weight-gradient units "
        "they touch",
        memoryText(reference), memoryText(needed), limit.source, memoryText(memory)));
  return Status::success();
}

/// The report of a run's passes: non-finite outputs, the best times, the
/// bytes between ranks, the workspace.
void printRunTimes(const Args &args, const rt::Context &context, const LayerData &data,
                   bool backward, const rt::PassTimes &bestFwd, const rt::PassTimes &bestBwd,
                   uint64_t warmup, uint64_t repeat, bool mpi) {
  reportNonFinite(data, backward, true);
  std::printf(
      "time (wall, %s%s):\n", mpi ? "the process of rank 0" : "all ranks",
      warmup ? fmt::format("; after {} untimed warm-up pass{}", warmup, warmup == 1 ? "" : "es")
                   .c_str()
             : "; the first pass is cold");
  printTimes("forward", bestFwd, repeat);
  if (backward)
    printTimes("backward", bestBwd, repeat);
  // What the puts moved between ranks (the last pass of each kind).
  const rt::PassTimes &f = context.forwardTimes(), &b = context.backwardTimes();
  const auto bytes = [](uint64_t n) { return fmt::format("{} ({} B)", memoryText(double(n)), n); };
  std::printf("  bytes between ranks: forward dispatch %s, combine %s",
              bytes(f.dispatchBytes).c_str(), bytes(f.combineBytes).c_str());
  if (backward)
    std::printf("; backward dispatch %s, combine %s", bytes(b.dispatchBytes).c_str(),
                bytes(b.combineBytes).c_str());
  std::printf("\n");
  std::printf("  workspace %s%s\n", tooling::totalsText(tooling::workspaceTotals(context)).c_str(),
              mpi ? " (per process)" : "");
  if (args.has("--workspace"))
    std::printf("%s", tooling::workspaceText(context).c_str());
}

/// --verify: the outputs against the reference layer (every token, or a
/// sample of `sampleTokens`), printed; kOk when every output is within its
/// tolerance.
int verifyRun(const LayerData &data, const rt::LayerShape &shape, bool backward,
              uint64_t sampleTokens, uint64_t seed, Progress &progress) {
  std::vector<OutputError> errors;
  VerifyOptions verifyOptions;
  verifyOptions.backward = backward;
  verifyOptions.bf16 = shape.activations == format::DType::BF16;
  verifyOptions.fp8Dispatch = shape.fp8Dispatch;
  verifyOptions.sampleTokens = int64_t(sampleTokens);
  verifyOptions.seed = seed + 1;
  verifyOptions.progress = [&progress](double done) { progress.update(done); };
  SampleSummary sample;
  progress.begin(sampleTokens ? "verify (sample)" : "verify", 1);
  if (Status s = verifyLayer(data, verifyOptions, &errors, &sample); !s)
    return fail(s);
  progress.end();
  if (sampleTokens)
    std::printf("verify %lld random token%s of %lld%s against the reference (plain loops in "
                "double):\n",
                (long long)sample.tokens, sample.tokens == 1 ? "" : "s",
                (long long)(data.ranks * data.tokens),
                sample.units ? fmt::format(", and {} expert unit{} of the weight gradients",
                                           sample.units, sample.units == 1 ? "" : "s")
                                   .c_str()
                             : "");
  else
    std::printf("verify against the reference (plain loops in double):\n");
  if (!sample.unsampled.empty())
    std::printf("  not checked by a sample (each row's every unit): %s; --verify checks them\n",
                fmt::format("{}", fmt::join(sample.unsampled, ", ")).c_str());
  std::printf("  %-14s %12s %12s %10s\n", "output", "max abs err", "max rel err", "tolerance");
  bool ok = true;
  for (const OutputError &e : errors) {
    std::printf("  %-14s %12.3e %12.3e %10.0e  %s%s\n", e.name.c_str(), e.maxAbs, e.maxRel,
                e.tolerance, e.ok() ? "ok" : "FAILED",
                e.nonFinite || e.mismatched
                    ? fmt::format("  ({} NaN/inf in the output, {} not as the reference)",
                                  e.nonFinite, e.mismatched)
                          .c_str()
                    : "");
    ok = ok && e.ok();
  }
  std::printf("verify: %s\n", ok ? "passed" : "FAILED");
  return ok ? kOk : kError;
}

/// The forward binary, and the backward one when given, checked against
/// each other and against the ranks of the run (`mpi`: mpirun's processes);
/// *ranks 0 (no --ranks, in-process ranks) becomes the binary's.
Status loadRunBinaries(const Args &args, uint64_t *rankCount, bool mpi,
                       std::shared_ptr<const rt::Program> *fwd,
                       std::shared_ptr<const rt::Program> *bwd) {
  if (Status s = rt::Program::load(args.positional[0], fwd); !s)
    return s;
  if ((*fwd)->shape().backward)
    return Status::error(args.positional[0] +
                         ": is a backward binary; give the forward binary first");
  const bool backward = args.positional.size() == 2;
  if (backward) {
    if (Status s = rt::Program::load(args.positional[1], bwd); !s)
      return s;
    if (!(*bwd)->shape().backward)
      return Status::error(args.positional[1] + ": is a forward binary, not a backward one");
  }
  const rt::LayerShape &shape = (*fwd)->shape();
  if (*rankCount == 0)
    *rankCount = shape.ranks;
  const uint64_t ranks = *rankCount;
  if (mpi && ranks != shape.ranks)
    return Status::error(fmt::format(
        "mpirun started {} processes, but {} was compiled for {} ranks (its config's ep x tp); "
        "one binary serves exactly its ranks: run it with mpirun -np {}",
        ranks, args.positional[0], shape.ranks, shape.ranks));
  if (ranks != shape.ranks)
    return Status::error(fmt::format(
        "--ranks {}, but {} was compiled for {} ranks (its config's ep x tp); one binary serves "
        "exactly its ranks",
        ranks, args.positional[0], shape.ranks));
  return Status::success();
}

/// The run's inputs: read from --inputs, or made at random; quantized
/// weights rounded to the values the layer computes with (which the inputs
/// written and the reference then hold).
Status runInputs(const Args &args, const RunOptions &o, const rt::LayerShape &shape, bool backward,
                 LayerData *data) {
  if (auto dir = args.value("--inputs")) {
    if (Status s = readLayerInputs(*dir, shape, backward, args.has("--hand-made"), data); !s)
      return s;
  } else {
    RandomOptions random;
    random.seed = o.seed;
    random.hotShare = o.hotShare;
    random.bf16 = shape.activations == format::DType::BF16;
    if (shape.topK == 0)
      return Status::error("cannot tell S and K from the binary; use --inputs");
    randomLayerData(shape, random, data);
    if (!backward)
      data->dy.clear();
  }
  // Quantized weights: the values the layer computes with, which the
  // inputs written and the reference then hold.
  if (Status s = roundWeightsToFormat(shape, data); !s)
    return s;
  return Status::success();
}

/// Writes the run's folder: the inputs when made at random, the outputs,
/// the manifest naming the command; then prints where they are.
Status writeRunOutputs(const Args &args, const LayerData &data, bool backward, int argc,
                       char **argv, int first) {
  const std::string outputs = *args.value("--outputs");
  std::vector<std::string> written;
  if (args.value("--random"))
    if (Status s = writeLayerInputs(runFolder->path(), data, backward, &written); !s)
      return runFolder->named(s);
  if (Status s = writeLayerOutputs(runFolder->path(), data, backward, &written); !s)
    return runFolder->named(s);
  // Inputs read from the outputs folder are this run's files too.
  std::vector<std::string> kept;
  if (auto inputs = args.value("--inputs"); inputs && sameFile(*inputs, outputs))
    for (const std::string &name : layerInputFiles(backward, data.loraTargets))
      kept.push_back(name), written.push_back(name);
  std::string command = "moec run";
  for (int i = first; i < argc; ++i)
    command += std::string(" ") + argv[i];
  if (Status s = runFolder->finish(written, command, kept); !s)
    return runFolder->named(s);
  runFolder.reset();
  std::string names = "y";
  if (backward) {
    names += ",dx,dtopk_weights";
    if (!data.dw1.empty())
      names += ",dw1,dw2";
    for (const tooling::LoraTensor &t : tooling::loraTensors(data.loraTargets, true))
      names += "," + t.name();
  }
  std::printf("outputs: %s/{%s}.npy\n", outputs.c_str(), names.c_str());
  return Status::success();
}

/// The first lines of a run's report: its binaries, layer, inputs, workers
/// and schedule (`processes`: mpirun's, or 0 for in-process ranks).
void printRunHeader(const Args &args, const rt::Program &fwd, const rt::Program *bwd,
                    const rt::Context &context, const LayerData &data, int64_t processes,
                    bool localPuts) {
  std::printf("moec run: %s%s, %s, S %lld, top-%lld, %u worker threads%s\n",
              args.positional[0].c_str(), bwd ? (" + " + args.positional[1]).c_str() : "",
              describe(fwd.shape()).c_str(), (long long)data.tokens, (long long)data.topK,
              context.workers(),
              processes ? fmt::format(" per process, {} MPI processes", processes).c_str()
                        : " (in-process ranks)");
  std::printf("schedule: %s%s\n", args.has("--op-by-op") ? "op by op" : "fused",
              localPuts ? ", puts into local memory (--local-puts)" : "");
  printSchedule("forward", fwd.tasks());
  if (bwd)
    printSchedule("backward", bwd->tasks());
}

/// --profile (printed by the reporting process) and --trace: the last timed
/// forward and backward passes.
Status writeRunProfileAndTrace(const Args &args, rt::Context &context, bool backward, bool report) {
  if (report && args.has("--profile")) {
    // The peaks are measured now, with the passes over and the workers idle.
    const tooling::Peaks peaks = tooling::measurePeaks(0.3);
    for (const rt::TracedPass pass : {rt::TracedPass::Forward, rt::TracedPass::Backward}) {
      if (pass == rt::TracedPass::Backward && !backward)
        continue;
      std::string text;
      if (Status s = tooling::profileText(context, pass, peaks, &text); !s)
        return s;
      std::printf("\nprofile of the last %s", text.c_str());
    }
  }

  if (auto option = args.value("--trace")) {
    // The last timed forward and backward passes, as they ran; under MPI
    // every rank's, in one file that rank 0 writes.
    const std::string &trace = *option;
    if (backward)
      if (Status s = context.writeTrace(tracePath(trace, ".bwd"), moec::rt::TracedPass::Backward);
          !s)
        return s;
    if (Status s = context.writeTrace(trace, moec::rt::TracedPass::Forward); !s)
      return s;
  }
  return Status::success();
}

} // namespace

int runRun(int argc, char **argv, int first) {
  std::optional<Args> parsed = parseArgs(kRunSpec, argc, argv, first);
  if (!parsed)
    return kUsage;
  const Args &args = *parsed;
  if (args.help) {
    printHelp(kRunSpec);
    return kOk;
  }
  if (int code = checkRunPaths(args); code != kOk)
    return code;
  // Every line of the report goes out as it is printed, so a run that is
  // killed (out of memory, a job's time limit) keeps the times it measured.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  RunOptions o;
  if (int code = parseRunOptions(args, &o); code != kOk)
    return code;
  const bool mpi = o.mpi, localPuts = o.localPuts, verify = o.verify;
  const uint64_t sampleTokens = o.sampleTokens, repeat = o.repeat, warmup = o.warmup,
                 seed = o.seed, threads = o.threads;
  uint64_t ranks = o.ranks;
  const double timeout = o.timeout;
  const backend::Kind backendKind = o.backend;

  std::shared_ptr<comm::Fabric> fabric;
  if (mpi) {
    comm::MpiOptions mpiOptions;
    mpiOptions.localPuts = localPuts;
    mpiOptions.timeoutSeconds = timeout;
    if (Status s = comm::createMpiFabric(&fabric, mpiOptions); !s)
      return fail(s);
    jobFabric = fabric.get();
    reportSeconds = timeout > 0 ? std::min(timeout, 10.0) : 10.0;
    if (ranks == 0)
      ranks = fabric->ranks();
    else if (ranks != fabric->ranks())
      return fail(Status::error(fmt::format("--ranks {}, but mpirun started {} processes", ranks,
                                            fabric->ranks())));
    if (Status s = checkSameOptions(*fabric, runOptionsText(args), timeout); !s)
      return fail(s);
  }
  // Under MPI only the process of rank 0 prints the report and writes files.
  const bool report = !fabric || fabric->firstLocal() == 0;
  Progress progress("moec run",
                    report ? progressMode(args.has("--progress"), args.has("--no-progress"))
                           : Progress::Mode::Never);
  progress.begin("load");

  std::shared_ptr<const rt::Program> fwd, bwd;
  if (Status s = loadRunBinaries(args, &ranks, fabric != nullptr, &fwd, &bwd); !s)
    return fail(s);
  const bool backward = bwd != nullptr;
  const rt::LayerShape &shape = fwd->shape();

  rt::ContextOptions options;
  options.workers = uint32_t(threads);
  options.trace = args.value("--trace").has_value() || args.has("--profile");
  options.packWeights = args.has("--pack-weights") || args.has("--pack-forward-weights");
  options.packBackward = !args.has("--pack-forward-weights");
  options.fabric = fabric;
  options.timeoutSeconds = timeout;
  options.backend = backendKind;
  if (args.has("--op-by-op"))
    options.schedule = rt::Schedule::OpByOp;
  std::unique_ptr<rt::Context> context;
  if (Status s = rt::Context::create(fwd, bwd, options, &context); !s)
    return fail(s);

  // The layer's tensors, as fp32 arrays and again in the binary's storage
  // type, and the whole reference layer of --verify, checked against the
  // machine before any is allocated.
  if (Status s = checkRunMemory(shape, *context, backward, report && verify && sampleTokens == 0,
                                backendKind == backend::Kind::Cpu);
      !s)
    return fail(s);

  LayerData data;
  const std::string outputs = *args.value("--outputs");
  progress.begin("inputs");
  if (Status s = runInputs(args, o, shape, backward, &data); !s)
    return fail(s);
  if (fabric)
    if (Status s = checkSameInputs(*fabric, data, timeout); !s)
      return fail(s);
  // The folder stops being an earlier run's before this run writes to it,
  // and no other run writes it meanwhile.
  if (report && !localPuts)
    if (Status s = RunFolder::open(
            outputs,
            runFolderFiles(backward, args.value("--random").has_value(), shape.loraTargets),
            args.positional, &runFolder);
        !s)
      return fail(s);

  progress.end();
  if (report)
    printRunHeader(args, *fwd, bwd.get(), *context, data, fabric ? int64_t(fabric->ranks()) : 0,
                   localPuts);

  if (report)
    reportNonFinite(data, backward, false);
  LayerRun run;
  progress.begin("bind");
  if (Status s = run.bind(*context, data); !s)
    return fail(s);
  // Steps: passes, each counted by the share of its task runs done.
  const uint64_t passesBefore = context->passesEnded();
  progress.begin(backward ? "passes (forward + backward)" : "passes",
                 double((warmup + repeat) * (backward ? 2 : 1)), [&context, passesBefore] {
                   const double share = context->passShare();
                   return double(context->passesEnded() - passesBefore) + (share < 1 ? share : 0);
                 });
  rt::PassTimes bestFwd, bestBwd;
  bestFwd.prepare = bestBwd.prepare = std::numeric_limits<double>::infinity();
  for (uint64_t i = 0; i < warmup + repeat; ++i) {
    if (Status s = run.run(*context, backward, &data); !s) {
      if (s.code() == StatusCode::OverCapacity)
        return fail(Status::error(s.message() + "\n" + capacityHint(shape, context->capacityNeed())));
      return fail(s);
    }
    if (i < warmup)
      continue;
    if (context->forwardTimes().total() < bestFwd.total())
      bestFwd = context->forwardTimes();
    if (backward && context->backwardTimes().total() < bestBwd.total())
      bestBwd = context->backwardTimes();
  }
  progress.end();
  if (report)
    printRunTimes(args, *context, data, backward, bestFwd, bestBwd, warmup, repeat,
                  fabric != nullptr);

  if (Status s = writeRunProfileAndTrace(args, *context, backward, report); !s)
    return fail(s);

  if (fabric) {
    // Every rank meets before the collectives that free the MPI resources
    // (bounded: a rank that runs more passes, or stopped, is reported). The
    // MPI resources go before MPI does; only rank 0 goes on.
    if (Status s = fabric->finish(timeout); !s)
      return fail(s.withPrefix("at the end of the job: "));
    context.reset();
    options.fabric.reset();
    jobFabric = nullptr;
    fabric.reset();
    comm::finalizeMpi();
    if (!report)
      return kOk;
  }

  if (localPuts) {
    std::printf("outputs: none (--local-puts)\n");
    return kOk;
  }
  progress.begin("write outputs");
  if (Status s = writeRunOutputs(args, data, backward, argc, argv, first); !s)
    return fail(s);
  progress.end();

  if (!verify)
    return kOk;
  return verifyRun(data, shape, backward, sampleTokens, seed, progress);
}

} // namespace moec::cli
