//===- BenchCommand.cpp - moec bench ----------------------------------------===//
//
// The runtime's numbers, measured side by side in one process:
//
//   1. this machine's fp32 FMA peak per core (measured, not looked up);
//   2. single-thread GMM tiles (the kernels' GEMM path) in GFLOP/s and as a
//      share of that peak;
//   3. whole layers, forward plus backward, compiled on the fly for 1, 2 and
//      4 ranks, with uniform and skewed routing: the fused schedule (the
//      binary's queues and events) against the same tasks run op by op with a
//      barrier over all ranks between ops. The two alternate, and each
//      reports its best time; the layer's flops over that time give a share of
//      the peak of all worker threads.
//
// With --calibrate it instead measures the rates of the `cpu` profile on
// this machine (a profile JSON), and holds the simulated makespan of every
// layer it ran against the measured one, with the built-in estimates and
// with the calibrated rates.
//
//===----------------------------------------------------------------------===//

#include "base/File.h"
#include "base/Memory.h"
#include "compiler/driver/Compile.h"
#include "compiler/target/Calibrate.h"
#include "compiler/target/Cost.h"
#include "compiler/target/Profile.h"
#include "compiler/target/Simulate.h"
#include "runtime/api/Runtime.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Peak.h"
#include "runtime/exec/Executor.h"
#include "runtime/tooling/LayerRun.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"
#include "tools/moec/Progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>
#include <unistd.h>

namespace moec::cli {

// The shipped graphs (tools/BUILD.bazel's bench_graphs).
extern const char kBenchForwardGraph[];
extern const char kBenchBackwardGraph[];

using namespace moec::tooling;

const CommandSpec kBenchSpec = {
    "bench",
    "moec bench [--config CFG] [--ranks LIST] [--threads N] [--repeat N] [--hot-share F] "
    "[--graphs DIR] [--skip-layers] | --calibrate [-o PROFILE] [--check PCT] [--threads N] "
    "[--repeat N] [--graphs DIR]",
    "Measures, in one run:\n"
    "  - the fp32 FMA peak of one core of this machine (and the bf16 one), with\n"
    "    an independent check: the core's clock times the flops a cycle its\n"
    "    vendor documents;\n"
    "  - what the worker threads' cores read from memory at once, in GB/s: the\n"
    "    bound of a pass whose weights stream from memory;\n"
    "  - single-thread GMM tiles (f32 and bf16 storage) in GFLOP/s and % of peak;\n"
    "  - the whole layer, forward + backward, compiled on the fly for the cpu\n"
    "    target: the fused schedule against the same tasks op by op (a barrier\n"
    "    over all ranks between ops), with uniform and skewed routing, for each\n"
    "    rank count; the layer's flops over the time, as % of the peak of all\n"
    "    worker threads, and the speed-up of fused over op by op.\n"
    "\n"
    "options:\n"
    "  --config CFG     the layer to run (its 'ep' is replaced by each rank count);\n"
    "                   default: H 1024, I 512, 4 local experts, top-2, 512 tokens\n"
    "                   per rank, f32\n"
    "  --ranks LIST     rank counts, comma-separated (default 1,2,4)\n"
    "  --threads N      worker threads, 1 to 4096 (default: the hardware threads)\n"
    "  --repeat N       timed runs of each schedule, alternating (default 5)\n"
    "  --hot-share F    skewed routing: the share of tokens whose first expert is\n"
    "                   expert 0 (default 0.5)\n"
    "  --graphs DIR     the folder with moe_ffn_fwd.json and moe_ffn_bwd.json\n"
    "                   (default: the shipped graphs, built into moec)\n"
    "  --skip-layers    only the peaks, the memory read and the GMM tiles\n"
    "\n"
    "calibration:\n"
    "  --calibrate      measure the rates of the cpu profile on this machine: run\n"
    "                   five layers (fp32 and bf16, 1 to 4 ranks) with tracing, fit\n"
    "                   the cube rate per dtype, the vector and copy rates to the\n"
    "                   traced tasks of two of them and the per-task overhead to\n"
    "                   the executor alone; then simulate every layer's binaries\n"
    "                   with the built-in and the calibrated profile and print the\n"
    "                   simulated against the measured makespan (the task program's\n"
    "                   wall time, best of --repeat runs)\n"
    "  -o PROFILE       write the calibrated profile JSON there (for --target)\n"
    "  --check PCT      exit 1 when the calibrated simulation of a layer the rates\n"
    "                   were not fitted to is off by more than PCT percent\n"
    "\n"
    "progress:\n"
    "  --progress       print progress (the step, a bar, an ETA) on stderr even when\n"
    "                   it is not a terminal (a line per step, and every 5 s); on a\n"
    "                   terminal it is on by default\n"
    "  --no-progress    no progress output\n",
    {"--config", "--ranks", "--threads", "--repeat", "--hot-share", "--graphs", "-o", "--check"},
    {"--skip-layers", "--calibrate", "--progress", "--no-progress"},
    0,
    0,
    {"-o"},
    {"--config", "--graphs"}};

namespace {

int usage(const std::string &message) {
  std::fprintf(stderr, "moec bench: %s\nusage: %s\n(see 'moec bench --help')\n",
               message.c_str(), kBenchSpec.usage);
  return kUsage;
}

int fail(const Status &status) {
  Progress::abandonCurrent();
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return kError;
}

/// Parses "1,2,4".
bool parseRanks(const std::string &text, std::vector<uint32_t> *out) {
  std::vector<uint32_t> ranks;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    if (item.empty() || item.size() > 4 ||
        !std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return false;
    const uint32_t r = uint32_t(std::stoul(item));
    if (r == 0)
      return false;
    ranks.push_back(r);
    start = comma + 1;
  }
  *out = ranks;
  return !ranks.empty();
}

/// The layer config for `ranks` ranks: the user's with ep set (and
/// num_experts scaled to keep its local experts), or the default layer.
Status layerConfig(const std::optional<std::string> &userConfig, uint32_t ranks,
                   ModelConfig *config, std::string *json) {
  ModelConfig c;
  if (userConfig) {
    std::string error;
    if (!loadConfig(*userConfig, &c, &error))
      return Status::error(error);
    c.numExperts = c.numExperts / c.ep * ranks;
    c.ep = ranks;
  } else {
    c.name = "bench";
    c.hiddenSize = 1024;
    c.intermediateSize = 512;
    c.numExperts = 4 * int64_t(ranks);
    c.topK = 2;
    c.ep = ranks;
    c.tp = 1;
    c.seqSize = 512;
    c.dtype = DType::F32;
  }
  *json = fmt::format(
      "{{\"name\": \"{}\", \"hidden_size\": {}, \"intermediate_size\": {}, \"num_experts\": {}, "
      "\"top_k\": {}, \"ep\": {}, \"tp\": {}, \"seq_size\": {}, \"dtype\": \"{}\", "
      "\"capacity_factor\": {}{}{}}}",
      c.name.empty() ? "bench" : c.name, c.hiddenSize, c.intermediateSize, c.numExperts, c.topK,
      c.ep, c.tp, c.seqSize, c.dtype == DType::BF16 ? "bf16" : "fp32", c.capacityFactor,
      c.numCubeCores ? fmt::format(", \"num_cube_cores\": {}", c.numCubeCores) : "",
      c.numVectorCores ? fmt::format(", \"num_vector_cores\": {}", c.numVectorCores) : "");
  *config = c;
  return Status::success();
}

/// Compiles both graphs, from the folder `graphs` or, when it is empty, the
/// ones built into moec, for the config text `json`.
Status compileLayer(const std::string &graphs, const std::string &json,
                    std::shared_ptr<const rt::Program> programs[2]) {
  std::string folder = std::filesystem::temp_directory_path().string() + "/moec-bench-XXXXXX";
  if (!::mkdtemp(folder.data()))
    return Status::error(fmt::format("{}: cannot create a temporary folder: {}", folder,
                                     std::strerror(errno)));
  const char *names[2] = {"moe_ffn_fwd.json", "moe_ffn_bwd.json"};
  const char *builtIn[2] = {kBenchForwardGraph, kBenchBackwardGraph};
  const std::string config = folder + "/config.json";
  Status status = writeFileAtomically(config, {{json.data(), json.size()}});
  for (int i = 0; i < 2 && status.ok() && graphs.empty(); ++i)
    status = writeFileAtomically(folder + "/" + names[i],
                                 {{builtIn[i], std::strlen(builtIn[i])}});
  for (int i = 0; i < 2 && status.ok(); ++i) {
    driver::CompileOptions options;
    options.configPath = config;
    driver::CompileResult result;
    status = driver::compileGraphFile((graphs.empty() ? folder : graphs) + "/" + names[i],
                                      options, &result);
    if (status)
      status = rt::Program::create(std::move(result.program), &programs[i]);
  }
  std::error_code ec;
  std::filesystem::remove_all(folder, ec);
  return status;
}

/// Times of one schedule: the best forward + backward over the runs.
struct Timing {
  double best = std::numeric_limits<double>::infinity();
  double forward = 0, backward = 0;
};

//===----------------------------------------------------------------------===//
// Calibration
//===----------------------------------------------------------------------===//

/// A layer the calibration runs: the rates are fitted to the traces of the
/// `fit` ones, and every one is simulated against its measured time.
struct CalibrationLayer {
  int64_t hidden, inter, localExperts, topK, tokens;
  uint32_t ranks;
  bool bf16;
  bool fit;

  std::string label() const {
    return fmt::format("H{} I{} L{} K{} S{} R{} {}", hidden, inter, localExperts, topK, tokens,
                       ranks, bf16 ? "bf16" : "fp32");
  }
  std::string configJson() const {
    return fmt::format("{{\"name\": \"calibration\", \"hidden_size\": {}, "
                       "\"intermediate_size\": {}, \"num_experts\": {}, \"top_k\": {}, \"ep\": {}, "
                       "\"tp\": 1, \"seq_size\": {}, \"dtype\": \"{}\"}}",
                       hidden, inter, localExperts * ranks, topK, ranks, tokens,
                       bf16 ? "bf16" : "fp32");
  }
};

const CalibrationLayer kCalibrationLayers[] = {
    {1024, 512, 4, 2, 512, 2, false, true},  {1024, 512, 4, 2, 512, 2, true, true},
    {768, 384, 8, 2, 1024, 2, false, false}, {1024, 256, 2, 4, 512, 4, true, false},
    {512, 1024, 2, 1, 256, 1, false, false},
};

/// What the calibration measured of one layer: per pass (forward,
/// backward) the best wall time of the task program and the trace of
/// that run.
struct MeasuredLayer {
  CalibrationLayer layer;
  std::shared_ptr<const rt::Program> programs[2];
  double seconds[2] = {std::numeric_limits<double>::infinity(),
                       std::numeric_limits<double>::infinity()};
  trace::Trace traces[2];
};

/// Runs `layer` `repeat` times or more (after a warm-up) with tracing on,
/// keeping the best times (and their traces) of this and earlier calls.
Status measureLayer(const std::string &graphs, uint32_t threads, long repeat,
                    MeasuredLayer *out) {
  if (!out->programs[0])
    if (Status s = compileLayer(graphs, out->layer.configJson(), out->programs); !s)
      return s.withPrefix(fmt::format("compiling {}: ", out->layer.label()));
  const rt::LayerShape &shape = out->programs[0]->shape();
  LayerData data;
  RandomOptions random;
  random.seed = 7;
  random.bf16 = out->layer.bf16;
  randomLayerData(shape, random, &data);
  rt::ContextOptions options;
  options.workers = threads;
  options.trace = true;
  std::unique_ptr<rt::Context> context;
  if (Status s = rt::Context::create(out->programs[0], out->programs[1], options, &context); !s)
    return s;
  LayerRun run;
  if (Status s = run.bind(*context, data); !s)
    return s;
  // At least `repeat` timed runs, and more (up to 10 times as many) until
  // they took half a second: a small layer's best time needs more tries.
  const auto begin = std::chrono::steady_clock::now();
  for (long rep = 0;; ++rep) {
    if (rep > repeat &&
        (rep > 10 * repeat || std::chrono::steady_clock::now() - begin > std::chrono::milliseconds(500)))
      break;
    LayerData result = data;
    if (Status s = run.run(*context, true, &result); !s)
      return s;
    if (rep == 0)
      continue; // warm-up: workspace, kernels
    const double times[2] = {context->forwardTimes().tasks, context->backwardTimes().tasks};
    for (int pass = 0; pass < 2; ++pass)
      if (times[pass] < out->seconds[pass]) {
        out->seconds[pass] = times[pass];
        out->traces[pass] =
            context->trace(pass == 0 ? rt::TracedPass::Forward : rt::TracedPass::Backward);
      }
  }
  return Status::success();
}

/// The executor's cost per task run, beyond the task's work: passes of
/// `program` whose tasks do nothing, on `threads` workers.
Status measureTaskOverhead(const format::TaskProgram &program, uint32_t threads,
                           double *seconds) {
  exec::ExecutorOptions options;
  options.workers = threads;
  std::unique_ptr<exec::Executor> executor;
  if (Status s = exec::Executor::create(
          program, [](uint32_t, uint32_t, uint32_t) { return Status::success(); }, options,
          &executor);
      !s)
    return s;
  double best = std::numeric_limits<double>::infinity();
  for (int pass = 0; pass < 30; ++pass) {
    if (Status s = executor->run(); !s)
      return s;
    best = std::min(best, executor->lastPass().seconds);
  }
  *seconds = best * threads / double(program.tasks.size() * program.ranks());
  return Status::success();
}

/// The model name of this machine's CPU, from /proc/cpuinfo.
std::string cpuModelName() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos)
        return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  return "unknown CPU";
}

int runCalibrate(const Args &args, uint32_t threads, long repeat, const std::string &graphs,
                 Progress &progress) {
  std::optional<double> check;
  if (auto c = args.value("--check")) {
    char *end = nullptr;
    double v = std::strtod(c->c_str(), &end);
    if (c->empty() || *end || !(v > 0))
      return usage("--check must be a positive percentage");
    check = v;
  }
  std::printf("calibrating the cpu profile: %u worker threads, best of %ld runs per layer, %s\n",
              threads, repeat, cpuModelName().c_str());
  std::fflush(stdout);

  // Two rounds over the layers, each keeping its best: a burst of other
  // load on a shared machine rarely spans both.
  std::vector<MeasuredLayer> layers;
  for (const CalibrationLayer &layer : kCalibrationLayers) {
    layers.emplace_back();
    layers.back().layer = layer;
  }
  progress.begin("measuring layers", double(2 * layers.size()));
  for (int round = 0; round < 2; ++round)
    for (MeasuredLayer &measured : layers) {
      progress.update(double(round * layers.size()) + double(&measured - layers.data()));
      if (round == 1) {
        if (Status s = measureLayer(graphs, threads, repeat, &measured); !s)
          return fail(s);
        continue;
      }
      progress.clear();
      std::printf("  running %-32s", measured.layer.label().c_str());
      std::fflush(stdout);
      if (Status s = measureLayer(graphs, threads, repeat, &measured); !s) {
        std::printf("\n");
        return fail(s);
      }
      progress.clear();
      std::printf(" forward %8.2f ms, backward %8.2f ms%s\n", measured.seconds[0] * 1e3,
                  measured.seconds[1] * 1e3, measured.layer.fit ? "  (fitted to)" : "");
      std::fflush(stdout);
    }
  progress.end();

  target::TargetProfile estimate;
  if (Status s = target::builtinProfile("cpu", &estimate); !s)
    return fail(s);
  progress.begin("fitting the task overhead");
  double floor = 0;
  if (Status s = measureTaskOverhead(layers.front().programs[0]->tasks(), threads, &floor); !s)
    return fail(s);
  std::vector<target::MeasuredPass> fitted;
  for (const MeasuredLayer &m : layers)
    if (m.layer.fit)
      for (int pass = 0; pass < 2; ++pass)
        fitted.push_back({&m.programs[pass]->tasks(), &m.traces[pass], m.seconds[pass]});
  target::TargetProfile calibrated = target::calibrateProfile(estimate, fitted, threads, floor);
  progress.end();
  // Its own name: a binary compiled with it records the name, and the
  // built-in profile's would stand for the estimates.
  calibrated.name = estimate.name + "-calibrated";
  calibrated.calibrated = fmt::format("moec bench --calibrate: {} worker threads on {}", threads,
                                      cpuModelName());
  std::printf("\ncalibrated rates (per core; built-in estimates in brackets):\n");
  std::printf("  cube fp32   %8.1f GFLOP/s  [%.1f]\n", calibrated.cubeFlops * 1e-9,
              estimate.cubeFlops * 1e-9);
  std::printf("  cube bf16   %8.1f GFLOP/s  [%.1f]\n", calibrated.cubeFlopsBf16 * 1e-9,
              estimate.cubeFlopsBf16 * 1e-9);
  std::printf("  SwiGLU      %8.2f G element accesses/s  [%.2f]\n", calibrated.vectorElems * 1e-9,
              estimate.vectorElems * 1e-9);
  std::printf("  own-rank put %7.2f GB/s     [%.2f]\n", calibrated.vectorBytes * 1e-9,
              estimate.vectorBytes * 1e-9);
  std::printf("  put to a peer %6.2f GB/s     [%.2f]\n", calibrated.linkBytes * 1e-9,
              estimate.linkBytes * 1e-9);
  std::printf("  task overhead %6.2f us      [%.2f] (the executor alone: %.2f us)\n",
              calibrated.taskOverhead * 1e6, estimate.taskOverhead * 1e6, floor * 1e6);

  std::printf("\nsimulated against measured makespan (the task program's wall time):\n");
  std::printf("  %-32s %-8s %11s %11s %7s %11s %7s\n", "layer", "pass", "measured", "estimate",
              "error", "calibrated", "error");
  double worstChecked = 0;
  for (const MeasuredLayer &m : layers)
    for (int pass = 0; pass < 2; ++pass) {
      const format::TaskProgram &program = m.programs[pass]->tasks();
      double simulated[2];
      const target::TargetProfile *profiles[2] = {&estimate, &calibrated};
      for (int i = 0; i < 2; ++i) {
        target::TimedRun run =
            target::simulateTimed(program, target::costModel(program, *profiles[i]));
        if (!run.ok())
          return fail(run.status);
        simulated[i] = run.makespan;
      }
      auto error = [&](double sim) { return 100.0 * (sim - m.seconds[pass]) / m.seconds[pass]; };
      if (!m.layer.fit)
        worstChecked = std::max(worstChecked, std::abs(error(simulated[1])));
      std::printf("  %-32s %-8s %8.2f ms %8.2f ms %+6.0f%% %8.2f ms %+6.0f%%%s\n",
                  m.layer.label().c_str(), pass ? "backward" : "forward", m.seconds[pass] * 1e3,
                  simulated[0] * 1e3, error(simulated[0]), simulated[1] * 1e3,
                  error(simulated[1]), m.layer.fit ? "  (fitted to)" : "");
    }
  std::printf("  the largest error of a layer not fitted to: %.0f%%\n", worstChecked);
  std::fflush(stdout);

  if (auto path = args.value("-o")) {
    if (!writeOutput(*path, target::profileJson(calibrated)))
      return kError;
    std::printf("wrote %s (use it with --target %s)\n", path->c_str(), path->c_str());
  }
  if (check && worstChecked > *check) {
    std::fprintf(stderr,
                 "moec bench: the calibrated simulation is off by %.0f%% on a layer it was not "
                 "fitted to, more than --check %.0f%%\n",
                 worstChecked, *check);
    return kError;
  }
  return kOk;
}

} // namespace

int runBench(int argc, char **argv, int first) {
  std::optional<Args> parsed = parseArgs(kBenchSpec, argc, argv, first);
  if (!parsed)
    return kUsage;
  const Args &args = *parsed;
  if (args.help) {
    printHelp(kBenchSpec);
    return kOk;
  }
  std::vector<std::string> graphFiles;
  if (auto dir = args.value("--graphs"))
    for (const char *name : {"moe_ffn_fwd.json", "moe_ffn_bwd.json"})
      graphFiles.push_back(*dir + "/" + name);
  if (int code = checkOutputs(kBenchSpec, args, graphFiles); code != kOk)
    return code;
  std::vector<uint32_t> rankCounts = {1, 2, 4};
  if (auto r = args.value("--ranks"); r && !parseRanks(*r, &rankCounts))
    return usage("--ranks must be a comma-separated list of positive integers");
  uint32_t threads = std::max(1u, std::thread::hardware_concurrency());
  if (auto t = args.value("--threads")) {
    char *end = nullptr;
    const long v = std::strtol(t->c_str(), &end, 10);
    if (t->empty() || *end || v < 1 || v > 4096)
      return usage("--threads must be an integer from 1 to 4096");
    threads = uint32_t(v);
  }
  long repeat = 5;
  if (auto t = args.value("--repeat")) {
    char *end = nullptr;
    repeat = std::strtol(t->c_str(), &end, 10);
    if (t->empty() || *end || repeat < 1 || repeat > 10000)
      return usage("--repeat must be a positive integer");
  }
  double hotShare = 0.5;
  if (auto h = args.value("--hot-share")) {
    char *end = nullptr;
    hotShare = std::strtod(h->c_str(), &end);
    if (h->empty() || *end || !(hotShare >= 0 && hotShare <= 1))
      return usage("--hot-share must be a number in [0, 1]");
  }
  // Empty: the graphs built into moec.
  const std::string graphs = args.value("--graphs").value_or("");
  if (!graphs.empty())
    for (const char *name : {"moe_ffn_fwd.json", "moe_ffn_bwd.json"})
      if (!std::filesystem::is_regular_file(graphs + "/" + name))
        return usage(fmt::format("--graphs {}: holds no {} (leave --graphs out to use the graphs "
                                 "built into moec)",
                                 graphs, name));
  // A bad --config is refused before anything is measured.
  for (uint32_t ranks : rankCounts) {
    ModelConfig config;
    std::string json;
    if (args.has("--calibrate"))
      break;
    if (Status s = layerConfig(args.value("--config"), ranks, &config, &json); !s)
      return fail(s);
  }
  if (args.has("--progress") && args.has("--no-progress"))
    return usage("--progress and --no-progress exclude each other");
  // Every line goes out as it is measured.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  Progress progress("moec bench", progressMode(args.has("--progress"), args.has("--no-progress")));
  if (args.has("--calibrate")) {
    for (const char *flag : {"--config", "--ranks", "--hot-share"})
      if (args.value(flag))
        return usage(fmt::format("{} does not go with --calibrate (it runs its own layers)", flag));
    if (args.has("--skip-layers"))
      return usage("--skip-layers does not go with --calibrate");
    return runCalibrate(args, threads, repeat, graphs, progress);
  }
  for (const char *flag : {"-o", "--check"})
    if (args.value(flag))
      return usage(fmt::format("{} goes with --calibrate", flag));

  std::string command = "moec";
  for (int i = 1; i < argc; ++i)
    command += std::string(" ") + argv[i];
  std::printf("$ %s\n", command.c_str());
  std::printf("GEMM: %s\n\n", cpu::gemmConfig());

  progress.begin("peak");
  const cpu::FmaPeak peak = cpu::measureFmaPeak(0.5);
  std::printf("fp32 FMA peak, one core: %.1f GFLOP/s (%s, %d lanes)\n", peak.gflops, peak.isa,
              peak.lanes);
  // bf16 tiles are measured against the bf16 dot-product peak where they
  // run on those instructions, else against the fp32 peak (widened).
  const std::optional<cpu::FmaPeak> bf16Peak = cpu::measureBf16DotPeak(0.5);
  if (bf16Peak)
    std::printf("bf16 dot-product peak, one core: %.1f GFLOP/s (%s)\n", bf16Peak->gflops,
                bf16Peak->isa);
  else
    std::printf("bf16 dot-product peak: none (no avx512_bf16): bf16 tiles widen to fp32 "
                "and are measured against the fp32 peak\n");
  // The cores the layer runs on, all measuring at once: the fair peak of
  // several threads where cores share a clock or power budget.
  if (threads > 1)
    for (const bool bf16 : {false, true})
      if (const std::optional<cpu::TogetherPeak> together =
              cpu::measurePeakTogether(threads, bf16, 0.3))
        std::printf("%s peak, %u cores at once: %.1f GFLOP/s (%.1f a core; %.1f%% of %u x one "
                    "core alone)\n",
                    bf16 ? "bf16 dot-product" : "fp32 FMA", threads, together->gflops,
                    together->gflops / threads,
                    100.0 * together->gflops / (threads * (bf16 ? bf16Peak->gflops : peak.gflops)),
                    threads);
  // What the same cores read from memory at once: a pass whose weights
  // stream from memory cannot run faster than their bytes at this rate.
  if (const std::optional<cpu::MemoryRead> read = cpu::measureMemoryRead(threads, 0.3)) {
    if (threads == 1)
      std::printf("memory read, one core: %.1f GB/s (%s)\n", read->gbPerSecond,
                  memoryText(double(read->bytes)).c_str());
    else
      std::printf("memory read, %u cores at once: %.1f GB/s (%.1f a core, the slowest %.1f; "
                  "%s a core)\n",
                  threads, read->gbPerSecond, read->gbPerSecond / threads, read->least,
                  memoryText(double(read->bytes)).c_str());
  }
  // Beside the probe, an independent check of it.
  std::printf("%s\n", cpu::clockCheckText(cpu::measureClockPeak(0.2), peak.gflops,
                                          bf16Peak ? std::optional<double>(bf16Peak->gflops)
                                                   : std::nullopt)
                          .c_str());
  const double bf16Denominator =
      bf16Peak && cpu::nativeBf16Gemm() ? bf16Peak->gflops : peak.gflops;
  progress.end();

  std::printf("GMM tiles, one thread (C = A B, C f32):\n");
  std::printf("  %-6s %-22s %12s %10s\n", "A, B", "m x n x k", "GFLOP/s", "of peak");
  // (fp32 rows: of the fp32 FMA peak; bf16 rows: of the bf16 one, see above)
  struct Shape {
    int64_t m, n, k;
  };
  progress.begin("GMM tiles", 6);
  int tiles = 0;
  for (cpu::Elt elt : {cpu::Elt::F32, cpu::Elt::BF16})
    for (const Shape &s : {Shape{512, 512, 512}, Shape{1024, 1024, 1024}, Shape{512, 1024, 1024}}) {
      const double gflops = cpu::measureGemmGflops(s.m, s.n, s.k, elt);
      progress.update(++tiles);
      progress.clear();
      std::printf("  %-6s %-22s %12.1f %9.1f%%\n", moec::dtypeName(elt),
                  fmt::format("{} x {} x {}", s.m, s.n, s.k).c_str(), gflops,
                  100.0 * gflops / (elt == cpu::Elt::BF16 ? bf16Denominator : peak.gflops));
    }
  progress.end();
  if (args.has("--skip-layers"))
    return kOk;

  std::printf("\nwhole layer, forward + backward, %u worker threads (peak %.1f GFLOP/s), best of "
              "%ld runs each, fused and op by op alternating:\n",
              threads, peak.gflops * threads, repeat);
  std::printf("  %-5s %-14s %12s %12s %9s %12s\n", "ranks", "routing", "fused ms", "op-by-op ms",
              "speed-up", "fused % peak");
  // Steps: a warm-up and `repeat` timed runs of both schedules, per layer.
  progress.begin("layers", double(rankCounts.size() * 2 * size_t(repeat + 1)));
  double stepsDone = 0;
  for (uint32_t ranks : rankCounts) {
    ModelConfig config;
    std::string json;
    if (Status s = layerConfig(args.value("--config"), ranks, &config, &json); !s)
      return fail(s);
    std::shared_ptr<const rt::Program> programs[2];
    if (Status s = compileLayer(graphs, json, programs); !s)
      return fail(s.withPrefix(fmt::format("compiling for {} ranks: ", ranks)));
    const rt::LayerShape &shape = programs[0]->shape();
    progress.clear();
    if (ranks == rankCounts.front())
      std::printf("  layer: H %lld, I %lld, %u local experts, top-%lld, %lld tokens per rank, "
                  "%s\n",
                  (long long)shape.hidden, (long long)shape.inter, shape.localExperts,
                  (long long)shape.topK, (long long)shape.tokens,
                  format::dtypeName(shape.activations));
    for (double share : {0.0, hotShare}) {
      LayerData data;
      RandomOptions random;
      random.seed = 1;
      random.hotShare = share;
      random.bf16 = shape.activations == format::DType::BF16;
      randomLayerData(shape, random, &data);
      std::unique_ptr<rt::Context> contexts[2];
      LayerRun runs[2];
      Timing timings[2];
      for (int i = 0; i < 2; ++i) {
        rt::ContextOptions options;
        options.workers = threads;
        options.schedule = i == 0 ? rt::Schedule::Fused : rt::Schedule::OpByOp;
        if (Status s = rt::Context::create(programs[0], programs[1], options, &contexts[i]); !s)
          return fail(s);
        if (Status s = runs[i].bind(*contexts[i], data); !s)
          return fail(s);
        LayerData out = data;
        if (Status s = runs[i].run(*contexts[i], true, &out); !s) // warm-up
          return fail(s);
      }
      progress.update(++stepsDone);
      for (long rep = 0; rep < repeat; ++rep)
        for (int i = 0; i < 2; ++i) {
          LayerData out = data;
          if (Status s = runs[i].run(*contexts[i], true, &out); !s)
            return fail(s);
          const double f = contexts[i]->forwardTimes().total();
          const double b = contexts[i]->backwardTimes().total();
          if (f + b < timings[i].best)
            timings[i] = Timing{f + b, f, b};
          if (i == 1)
            progress.update(++stepsDone);
        }
      const double rows = double(ranks) * double(data.tokens) * double(data.topK);
      const double flops = 18.0 * double(shape.hidden) * double(shape.inter) * rows;
      const double percent = 100.0 * flops / timings[0].best * 1e-9 / (peak.gflops * threads);
      progress.clear();
      std::printf("  %-5u %-14s %12.2f %12.2f %8.2fx %11.1f%%\n", ranks,
                  share > 0 ? fmt::format("skewed {:.0f}%", share * 100).c_str() : "uniform",
                  timings[0].best * 1e3, timings[1].best * 1e3, timings[1].best / timings[0].best,
                  percent);
    }
  }
  progress.end();
  std::printf("\nspeed-up = op-by-op time / fused time; skewed: that share of tokens picks "
              "expert 0 first.\n");
  return kOk;
}

} // namespace moec::cli
