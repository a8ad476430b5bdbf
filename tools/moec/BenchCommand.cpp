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
//===----------------------------------------------------------------------===//

#include "compiler/driver/Compile.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Peak.h"
#include "runtime/api/Runtime.h"
#include "tools/moec/Cli.h"
#include "runtime/tooling/LayerRun.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>
#include <unistd.h>

namespace moec::cli {

using namespace moec::tooling;

const CommandSpec kBenchSpec = {
    "bench",
    "moec bench [--config CFG] [--ranks LIST] [--threads N] [--repeat N] [--hot-share F] "
    "[--graphs DIR] [--skip-layers]",
    "Measures, in one run:\n"
    "  - the fp32 FMA peak of one core of this machine;\n"
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
    "                   (default: graphs)\n"
    "  --skip-layers    only the peak and the GMM tiles\n",
    {"--config", "--ranks", "--threads", "--repeat", "--hot-share", "--graphs"},
    {"--skip-layers"},
    0,
    0};

namespace {

int usage(const std::string &message) {
  std::fprintf(stderr, "moec bench: %s\nusage: %s\n(see 'moec bench --help')\n",
               message.c_str(), kBenchSpec.usage);
  return kUsage;
}

int fail(const Status &status) {
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

/// Compiles both graphs for the config text `json`.
Status compileLayer(const std::string &graphs, const std::string &json,
                    std::shared_ptr<const rt::Program> programs[2]) {
  const std::string path = fmt::format("{}/moec-bench-{}.json",
                                       std::filesystem::temp_directory_path().string(), getpid());
  {
    std::ofstream out(path);
    out << json;
    if (!out)
      return Status::error("cannot write " + path);
  }
  const char *names[2] = {"moe_ffn_fwd.json", "moe_ffn_bwd.json"};
  Status status;
  for (int i = 0; i < 2 && status.ok(); ++i) {
    driver::CompileOptions options;
    options.configPath = path;
    driver::CompileResult result;
    status = driver::compileGraphFile(graphs + "/" + names[i], options, &result);
    if (status)
      status = rt::Program::create(std::move(result.program), &programs[i]);
  }
  std::error_code ec;
  std::filesystem::remove(path, ec);
  return status;
}

/// Times of one schedule: the best forward + backward over the runs.
struct Timing {
  double best = std::numeric_limits<double>::infinity();
  double forward = 0, backward = 0;
};

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
  const std::string graphs = args.value("--graphs").value_or("graphs");

  std::string command = "moec";
  for (int i = 1; i < argc; ++i)
    command += std::string(" ") + argv[i];
  std::printf("$ %s\n", command.c_str());
  std::printf("GEMM: %s\n\n", cpu::gemmConfig());

  const cpu::FmaPeak peak = cpu::measureFmaPeak(0.5);
  std::printf("fp32 FMA peak, one core: %.1f GFLOP/s (%s, %d lanes)\n", peak.gflops, peak.isa,
              peak.lanes);
  // bf16 tiles are measured against the bf16 dot-product peak where they
  // run on those instructions, else against the fp32 peak (widened).
  const std::optional<cpu::FmaPeak> bf16Peak = cpu::measureBf16DotPeak(0.5);
  if (bf16Peak)
    std::printf("bf16 dot-product peak, one core: %.1f GFLOP/s (%s; no AMX kernel yet)\n\n",
                bf16Peak->gflops, bf16Peak->isa);
  else
    std::printf("bf16 dot-product peak: none (no avx512_bf16, no AMX): bf16 tiles widen to fp32 "
                "and are measured against the fp32 peak\n\n");
  const double bf16Denominator =
      bf16Peak && cpu::nativeBf16Gemm() ? bf16Peak->gflops : peak.gflops;

  std::printf("GMM tiles, one thread (C = A B, C f32):\n");
  std::printf("  %-6s %-22s %12s %10s\n", "A, B", "m x n x k", "GFLOP/s", "of peak");
  // (fp32 rows: of the fp32 FMA peak; bf16 rows: of the bf16 one, see above)
  struct Shape {
    int64_t m, n, k;
  };
  for (cpu::Elt elt : {cpu::Elt::F32, cpu::Elt::BF16})
    for (const Shape &s : {Shape{512, 512, 512}, Shape{1024, 1024, 1024}, Shape{512, 1024, 1024}}) {
      const double gflops = cpu::measureGemmGflops(s.m, s.n, s.k, elt);
      std::printf("  %-6s %-22s %12.1f %9.1f%%\n", moec::dtypeName(elt),
                  fmt::format("{} x {} x {}", s.m, s.n, s.k).c_str(), gflops,
                  100.0 * gflops / (elt == cpu::Elt::BF16 ? bf16Denominator : peak.gflops));
    }
  if (args.has("--skip-layers"))
    return kOk;

  std::printf("\nwhole layer, forward + backward, %u worker threads (peak %.1f GFLOP/s), best of "
              "%ld runs each, fused and op by op alternating:\n",
              threads, peak.gflops * threads, repeat);
  std::printf("  %-5s %-14s %12s %12s %9s %12s\n", "ranks", "routing", "fused ms", "op-by-op ms",
              "speed-up", "fused % peak");
  for (uint32_t ranks : rankCounts) {
    ModelConfig config;
    std::string json;
    if (Status s = layerConfig(args.value("--config"), ranks, &config, &json); !s)
      return fail(s);
    std::shared_ptr<const rt::Program> programs[2];
    if (Status s = compileLayer(graphs, json, programs); !s)
      return fail(s.withPrefix(fmt::format("compiling for {} ranks: ", ranks)));
    const rt::LayerShape &shape = programs[0]->shape();
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
      for (long rep = 0; rep < repeat; ++rep)
        for (int i = 0; i < 2; ++i) {
          LayerData out = data;
          if (Status s = runs[i].run(*contexts[i], true, &out); !s)
            return fail(s);
          const double f = contexts[i]->forwardTimes().total();
          const double b = contexts[i]->backwardTimes().total();
          if (f + b < timings[i].best)
            timings[i] = Timing{f + b, f, b};
        }
      const double rows = double(ranks) * double(data.tokens) * double(data.topK);
      const double flops = 18.0 * double(shape.hidden) * double(shape.inter) * rows;
      const double percent = 100.0 * flops / timings[0].best * 1e-9 / (peak.gflops * threads);
      std::printf("  %-5u %-14s %12.2f %12.2f %8.2fx %11.1f%%\n", ranks,
                  share > 0 ? fmt::format("skewed {:.0f}%", share * 100).c_str() : "uniform",
                  timings[0].best * 1e3, timings[1].best * 1e3, timings[1].best / timings[0].best,
                  percent);
    }
  }
  std::printf("\nspeed-up = op-by-op time / fused time; skewed: that share of tokens picks "
              "expert 0 first.\n");
  return kOk;
}

} // namespace moec::cli
