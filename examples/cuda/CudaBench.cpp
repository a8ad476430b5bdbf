//===- CudaBench.cpp - The cuda backend's tiles and layer, timed ------------===//
//
//   cuda_bench gmm [--tile-n N] [--weight-format F] [[G*]MxNxK[:ab] ...]
//                                     the persistent kernel's GMM tile function
//                                     on bf16 products (C bf16; G of them in
//                                     one launch; a, b: n as read, t stored
//                                     transposed), 128 x N tiles (256), one thread
//                                     block each: TFLOP/s, and a check (every
//                                     element written, sampled ones against
//                                     an fp32 reference); with F (fp8_block128,
//                                     int8, int4_g32 .. int4_g128, _zp) B is
//                                     that format's random codes and scales
//   cuda_bench decode                 the tiles' decode of quantized weights
//                                     (FP8, int8, int4): its rate in values a
//                                     clock an SM, and its bits against the
//                                     decode of one value at a time
//   cuda_bench layer FWD BWD [FWD BWD ...] [--repeat N] [--hot-share F] [--sample N]
//                    [--pack-weights off|on|both] [--backend cuda|cpu]
//                                     the layer, forward and backward, every
//                                     rank on the GPU, tensors in device
//                                     memory (LoRA adapters too, where the
//                                     binaries have them; tooling::LayerRun
//                                     binds them): median step time, the persistent
//                                     kernels' share, and a sampled check
//                                     against the reference (N tokens); several
//                                     pairs one after another, the random
//                                     layer made once for binaries of one
//                                     shape (the weight formats of a layer);
//                                     a quantized weight's decode before each
//                                     pass counts in the pass (runtime/cuda/
//                                     Pass.h, MOEC_CUDA_DECODE); with
//                                     --pack-weights on, decoded once and
//                                     kept (the packed-weight store), both:
//                                     each pair without it, then with it;
//                                     --backend cpu runs the same on the
//                                     cpu backend in host memory (the
//                                     harness checked where there is no GPU)
//
// Prints the GPU first. PyTorch's side (cuBLAS, eager) is
// examples/cuda/bench_torch.py; examples/cuda/bench.sh runs both.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Runtime.h"
#include "runtime/cuda/Device.h"
#include "runtime/cuda/Pass.h"
#include "runtime/tooling/LayerRun.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace moec;

namespace {

/// `cuda_bench gmm`'s products without arguments: the layouts on odd
/// shapes (the check), square anchors, then qwen3-30b-a3b's grouped
/// products, EP 8 on one GPU (128 experts), at 1024 and 4096 tokens per
/// rank (512 and 2048 rows an expert): the forward's gate/up and down
/// projections, the backward's input gradient (nt) and weight gradient (tn).
const char *const kDefaultProducts[] = {
    "3*184x200x136:nn",     "3*184x200x136:nt",     "3*184x200x136:tn",
    "3*184x200x136:tt",     "2*136x48x520:nn",      "2*136x96x520:tt",
    "4096x4096x4096",       "8192x8192x8192",       "128*512x1536x2048",
    "128*512x2048x768",     "128*512x2048x1536:nt", "128*2048x1536x512:tn",
    "128*2048x1536x2048",   "128*2048x2048x768",    "128*2048x2048x1536:nt",
    "128*2048x1536x2048:tn"};

int fail(const Status &s) {
  std::fprintf(stderr, "cuda_bench: %s\n", s.message().c_str());
  return 1;
}

/// A product of `cuda_bench gmm`: [G*]MxNxK[:ab], a and b each n (stored
/// as the product reads it: A m x k, B k x n) or t (stored transposed).
bool parseProduct(const std::string &text, cuda::device::GemmBenchCase *out) {
  cuda::device::GemmBenchCase c;
  std::string shape = text, layout = "nn";
  if (const size_t colon = text.find(':'); colon != std::string::npos) {
    shape = text.substr(0, colon);
    layout = text.substr(colon + 1);
  }
  if (layout.size() != 2 || (layout[0] != 'n' && layout[0] != 't') ||
      (layout[1] != 'n' && layout[1] != 't'))
    return false;
  long long g = 1, m = 0, n = 0, k = 0;
  char tail = 0;
  if (shape.find('*') != std::string::npos) {
    if (std::sscanf(shape.c_str(), "%lld*%lldx%lldx%lld%c", &g, &m, &n, &k, &tail) != 4)
      return false;
  } else if (std::sscanf(shape.c_str(), "%lldx%lldx%lld%c", &m, &n, &k, &tail) != 3) {
    return false;
  }
  if (g < 1 || m < 1 || n < 1 || k < 1)
    return false;
  c.groups = g;
  c.m = m;
  c.n = n;
  c.k = k;
  c.transA = layout[0] == 't';
  c.transB = layout[1] == 't';
  c.type = c.cType = uint32_t(DType::BF16);
  *out = c;
  return true;
}

/// The format named `name` as the binaries name them
/// (LayerShape::weightFormatName): dense, fp8_block128, int8, int4_gG[_zp].
bool parseWeightFormat(const std::string &name, rt::LayerShape *out) {
  for (WeightFormat f : {WeightFormat::Dense, WeightFormat::Fp8Block128, WeightFormat::Int8Channel,
                         WeightFormat::Int4Group})
    for (int64_t group : {32, 64, 128})
      for (bool zero : {false, true}) {
        rt::LayerShape shape;
        shape.weightFormat = f;
        shape.weightGroup = group;
        shape.weightZeroPoints = zero;
        if (shape.weightFormatName() == name) {
          *out = shape;
          return true;
        }
      }
  return false;
}

int decode() {
  int64_t mismatches[3];
  double rate[3];
  if (const cuda::device::Error e = cuda::device::checkDecodeBits(mismatches); !e.empty())
    return fail(Status::error(e));
  if (const cuda::device::Error e = cuda::device::benchDecode(rate); !e.empty())
    return fail(Status::error(e));
  std::printf("%-14s %22s %s\n", "format", "values/clock/SM", "bits against one value at a time");
  const char *const names[3] = {"fp8_block128", "int8", "int4"};
  for (int f = 0; f < 3; ++f)
    std::printf("%-14s %22.1f %s\n", names[f], rate[f],
                mismatches[f] == 0 ? "same"
                                   : fmt::format("FAILED: {} differ", mismatches[f]).c_str());
  return mismatches[0] || mismatches[1] || mismatches[2] ? 1 : 0;
}

int gmm(const std::vector<std::string> &products, int64_t tileN, const rt::LayerShape &format) {
  std::printf("%-26s %10s %10s %10s %s\n",
              fmt::format("G*MxNxK:ab (bf16, B {})", format.weightFormatName()).c_str(), "ms",
              "TFLOP/s", "error", "check");
  int failed = 0;
  for (const std::string &text : products) {
    cuda::device::GemmBenchCase c;
    parseProduct(text, &c); // checked in main
    c.tileN = tileN;
    c.quant = uint32_t(format.weightFormat);
    c.group = format.weightGroup;
    c.zeroPoints = format.weightZeroPoints;
    cuda::device::GemmBenchResult r;
    if (const cuda::device::Error e = cuda::device::benchGemm(c, &r); !e.empty())
      return fail(Status::error(text + ": " + e));
    // bf16 output: about 2^-8 of the largest value; an unwritten or wrong
    // element is far over it.
    const bool ok = r.unwritten == 0 && r.error < 1e-2;
    failed += ok ? 0 : 1;
    std::printf("%-26s %10.3f %10.1f %10.2e %s\n", text.c_str(), r.seconds * 1e3,
                2.0 * c.groups * c.m * c.n * c.k / r.seconds / 1e12, r.error,
                ok ? "ok" : fmt::format("FAILED ({} unwritten)", r.unwritten).c_str());
  }
  return failed ? 1 : 0;
}

/// The GPU's memory for the layer's tensors: its passes read their inputs
/// and write their outputs there (nothing staged from the host).
struct GpuMemory final : tooling::TensorMemory {
  std::string allocate(size_t bytes, void **memory) override {
    return cuda::device::allocate(bytes, memory);
  }
  void release(void *memory) override { cuda::device::release(memory); }
  std::string copy(void *to, const void *from, size_t bytes) override {
    return cuda::device::copy(to, from, bytes);
  }
};

/// One forward and backward binary's layer on `data` (random, of its
/// shape; its own copy), on `kind`'s backend: the cuda one with every
/// tensor in the GPU's memory, or the cpu one (host memory).
int layer(const std::shared_ptr<const rt::Program> &fwd,
          const std::shared_ptr<const rt::Program> &bwd, tooling::LayerData data, int repeat,
          double hotShare, int64_t sample, bool pack, backend::Kind kind) {
  const rt::LayerShape &shape = fwd->shape();
  const DType act = shape.activations;
  // Quantized weights: the reference sees the values the layer computes with.
  if (Status s = tooling::roundWeightsToFormat(shape, &data); !s)
    return fail(s);
  rt::ContextOptions options;
  options.backend = kind;
  options.packWeights = pack;
  std::unique_ptr<rt::Context> context;
  if (Status s = rt::Context::create(fwd, bwd, options, &context); !s)
    return fail(s);
  GpuMemory gpuMemory;
  const bool gpu = kind == backend::Kind::Cuda;
  tooling::LayerRun run(gpu ? &gpuMemory : nullptr);
  if (Status s = run.bind(*context, data); !s)
    return fail(s);

  // A frozen layer's backward (quantized weights, frozen=True, LoRA) gives
  // no weight gradients of the base.
  const bool frozen = bwd->shape().frozen;
  const int64_t R = shape.ranks, S = data.tokens, K = data.topK, H = shape.hidden,
                I = shape.inter, L = shape.localExperts;
  if (gpu) {
    std::string name;
    (void)cuda::describeDevice(&name);
    std::printf("GPU: %s\n", name.c_str());
  } else {
    std::printf("the cpu backend (%u worker threads)\n", context->workers());
  }
  const std::string lora = shape.loraRank ? fmt::format(", LoRA r {} on {}", shape.loraRank,
                                                        shape.loraTargets == 3   ? "w1, w2"
                                                        : shape.loraTargets == 1 ? "w1"
                                                                                 : "w2")
                                          : "";
  std::printf("layer: R %lld, L %lld, S %lld, K %lld, H %lld, I %lld, %s, weights %s%s%s%s, "
              "hot share %.2f%s\n",
              (long long)R, (long long)L, (long long)S, (long long)K, (long long)H, (long long)I,
              dtypeName(act), shape.weightFormatName().c_str(),
              shape.weightsTransposed ? " (stored transposed)" : "", frozen ? ", frozen" : "",
              lora.c_str(), hotShare, pack ? ", packed weights" : "");
  std::vector<double> steps, kernels, before, checks, after;
  for (int i = 0; i < repeat + 1; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (Status s = context->forward(); !s)
      return fail(s.withPrefix("forward: "));
    if (Status s = context->backward(); !s)
      return fail(s.withPrefix("backward: "));
    const double step = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i == 0)
      continue; // warm-up: workspace, first launches
    steps.push_back(step);
    const rt::PassTimes &f = context->forwardTimes(), &b = context->backwardTimes();
    kernels.push_back(f.tasks + b.tasks);
    before.push_back(f.prepare + b.prepare);
    checks.push_back(f.checks + b.checks);
    after.push_back(f.finish + b.finish);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double step = median(steps), kernel = median(kernels);
  // The base's products: forward, dX and dA; and dW1, dW2 unless frozen (a
  // LoRA adapter's rank-r products not counted).
  const double flops = (frozen ? 2.0 : 3.0) * 2 * double(R) * S * K * (H * 2.0 * I + double(I) * H);
  std::printf("moec %s step (fwd+bwd): median %.3f ms over %d (%.1f TFLOP/s%s); the task "
              "programs' part %.3f ms\n",
              gpu ? "cuda" : "cpu", step * 1e3, repeat, flops / step / 1e12,
              shape.loraRank ? ", the base's FLOPs" : "", kernel * 1e3);
  std::printf("  around them: %.3f ms before (of it %.3f ms the checks, routing layout and "
              "agreement; then the layout's upload and the gather of the rows to send), %.3f ms "
              "after (combine, top-k weight gradient)\n",
              median(before) * 1e3, median(checks) * 1e3, median(after) * 1e3);
  if (pack)
    std::printf("  packed weights (%s): %.1f MB\n", gpu ? "kept decoded" : "in the tile's layout",
                double(context->packedWeightBytes()) / 1e6);

  if (sample > 0) {
    // One more step, whose outputs are read back and checked.
    if (Status s = run.run(*context, true, &data); !s)
      return fail(s);
    tooling::VerifyOptions verify;
    verify.backward = true;
    verify.bf16 = act == DType::BF16;
    verify.sampleTokens = sample;
    std::vector<tooling::OutputError> errors;
    if (Status s = tooling::verifyLayer(data, verify, &errors); !s)
      return fail(s);
    bool ok = true;
    for (const tooling::OutputError &e : errors) {
      std::printf("  %-14s max rel %.2e (tolerance %.0e)%s\n", e.name.c_str(), e.maxRel,
                  e.tolerance, e.ok() ? "" : "  FAILED");
      ok = ok && e.ok();
    }
    std::printf("verify (%lld sampled tokens): %s\n", (long long)sample, ok ? "passed" : "FAILED");
    if (!ok)
      return 1;
  }
  return 0;
}

/// Each pair of `paths` (forward, backward) in turn, on random data made
/// once for binaries of one shape (making it takes seconds of a single
/// thread at qwen3's sizes: the weights' formats of one layer share it).
/// Fails after the last pair if any failed.
int layers(const std::vector<std::string> &paths, int repeat, double hotShare, int64_t sample,
           const std::vector<bool> &packs, backend::Kind kind) {
  tooling::LayerData data;
  std::vector<int64_t> madeFor;
  int failed = 0;
  for (size_t p = 0; p + 1 < paths.size(); p += 2) {
    std::shared_ptr<const rt::Program> fwd, bwd;
    if (Status s = rt::Program::load(paths[p], &fwd); !s) {
      failed += fail(s);
      continue;
    }
    if (Status s = rt::Program::load(paths[p + 1], &bwd); !s) {
      failed += fail(s);
      continue;
    }
    const rt::LayerShape &shape = fwd->shape();
    const std::vector<int64_t> key = {
        shape.epRanks(), shape.tp,     shape.tokens, shape.topK,
        shape.experts(), shape.hidden, shape.inter,  int64_t(shape.activations)};
    if (key != madeFor) {
      tooling::RandomOptions random;
      random.hotShare = hotShare;
      random.bf16 = shape.activations == DType::BF16;
      tooling::randomLayerData(shape, random, &data);
      madeFor = key;
    }
    for (const bool pack : packs) {
      if (p > 0 || pack != packs.front())
        std::printf("\n");
      std::printf("binaries: %s %s\n", paths[p].c_str(), paths[p + 1].c_str());
      failed += layer(fwd, bwd, data, repeat, hotShare, sample, pack, kind) != 0;
    }
  }
  return failed ? 1 : 0;
}

void usage(std::FILE *to) {
  std::fprintf(to, "usage: cuda_bench gmm [--tile-n N] [--weight-format F] "
                   "[[G*]MxNxK[:ab] ...]\n"
                   "       cuda_bench decode\n"
                   "       cuda_bench layer FWD BWD [FWD BWD ...] [--repeat N] "
                   "[--hot-share F] [--sample N]\n"
                   "                  [--pack-weights off|on|both] [--backend cuda|cpu]\n"
                   "(each mode is described at the top of examples/cuda/CudaBench.cpp)\n");
}

} // namespace

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      usage(stdout);
      return 0;
    }
  if (mode == "gmm") {
    std::vector<std::string> products;
    int64_t tileN = 256;
    rt::LayerShape format;
    for (int i = 2; i < argc; ++i) {
      const std::string arg = argv[i];
      const bool takesValue = arg == "--tile-n" || arg == "--weight-format";
      if (arg == "--tile-n" && i + 1 < argc)
        tileN = std::atoll(argv[++i]);
      else if (arg == "--weight-format" && i + 1 < argc) {
        if (!parseWeightFormat(argv[++i], &format))
          return fail(Status::error(fmt::format(
              "--weight-format {}: give dense, fp8_block128, int8 or int4_g32, int4_g64, "
              "int4_g128 (with _zp for zero points)",
              argv[i])));
      } else if (arg.rfind("--", 0) == 0) {
        return fail(Status::error(
            fmt::format("unknown option {}{}", arg, takesValue ? " (it takes a value)" : "")));
      } else
        products.push_back(arg);
    }
    if (tileN < 1)
      return fail(Status::error("--tile-n takes a positive column count"));
    if (products.empty())
      products = {kDefaultProducts, kDefaultProducts + sizeof(kDefaultProducts) / sizeof(char *)};
    for (const std::string &text : products) {
      cuda::device::GemmBenchCase c;
      if (!parseProduct(text, &c))
        return fail(Status::error("'" + text +
                                  "' is no product: give [G*]MxNxK[:ab], a and b n or t"));
      c.quant = uint32_t(format.weightFormat);
      c.group = format.weightGroup;
      if (const cuda::device::Error e = cuda::device::gemmBenchCaseError(c); !e.empty())
        return fail(
            Status::error(fmt::format("'{}' with B {}: {}", text, format.weightFormatName(), e)));
    }
    std::string gpu;
    if (Status s = cuda::describeDevice(&gpu); !s)
      return fail(s);
    std::printf("GPU: %s\n", gpu.c_str());
    return gmm(products, tileN, format);
  }
  if (mode == "decode" && argc == 2) {
    std::string gpu;
    if (Status s = cuda::describeDevice(&gpu); !s)
      return fail(s);
    std::printf("GPU: %s\n", gpu.c_str());
    return decode();
  }
  if (mode == "layer") {
    std::vector<std::string> paths;
    int i = 2;
    for (; i < argc && std::string(argv[i]).rfind("--", 0) != 0; ++i)
      paths.push_back(argv[i]);
    if (paths.empty() || paths.size() % 2)
      return fail(Status::error(fmt::format(
          "layer takes binaries in pairs, FWD BWD [FWD BWD ...]; {} given", paths.size())));
    int repeat = 5;
    double hot = 0;
    int64_t sample = 0;
    std::vector<bool> packs = {false};
    backend::Kind kind = backend::Kind::Cuda;
    for (; i < argc; i += 2) {
      const std::string flag = argv[i];
      if (i + 1 >= argc)
        return fail(Status::error(flag + " takes a value"));
      if (flag == "--repeat")
        repeat = std::max(1, std::atoi(argv[i + 1]));
      else if (flag == "--hot-share")
        hot = std::atof(argv[i + 1]);
      else if (flag == "--sample")
        sample = std::atoll(argv[i + 1]);
      else if (flag == "--pack-weights") {
        const std::string v = argv[i + 1];
        if (v != "off" && v != "on" && v != "both")
          return fail(Status::error("--pack-weights takes off, on or both, not '" + v + "'"));
        packs = v == "off"  ? std::vector<bool>{false}
                : v == "on" ? std::vector<bool>{true}
                            : std::vector<bool>{false, true};
      } else if (flag == "--backend") {
        const std::string v = argv[i + 1];
        if (v != "cuda" && v != "cpu")
          return fail(Status::error("--backend takes cuda or cpu, not '" + v + "'"));
        kind = v == "cuda" ? backend::Kind::Cuda : backend::Kind::Cpu;
      } else
        return fail(Status::error("unknown option " + flag));
    }
    return layers(paths, repeat, hot, sample, packs, kind);
  }
  usage(stderr);
  return 2;
}
