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
//                    [--pack-weights off|on|both]
//                                     the layer, forward and backward, every
//                                     rank on the GPU, tensors in device
//                                     memory: median step time, the persistent
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
//                                     each pair without it, then with it
//
// Prints the GPU first. PyTorch's side (cuBLAS, eager) is
// examples/cuda/bench_torch.py; examples/cuda/bench.sh runs both.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Runtime.h"
#include "runtime/cpu/Element.h"
#include "runtime/cuda/Device.h"
#include "runtime/cuda/Pass.h"
#include "runtime/tooling/LayerRun.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

/// A tensor of the layer in device memory, converted from fp32.
struct DeviceTensor {
  void *memory = nullptr;
  DType dtype = DType::F32;
  size_t count = 0;
  ~DeviceTensor() { cuda::device::release(memory); }
  Status upload(const float *values, size_t n, DType type) {
    dtype = type;
    count = n;
    std::vector<uint8_t> host(n * dtypeSize(type));
    if (values)
      cpu::storeFloats(values, host.data(), type, n);
    if (auto e = cuda::device::allocate(host.size(), &memory); !e.empty())
      return Status::error(e);
    if (auto e = cuda::device::copy(memory, host.data(), host.size()); !e.empty())
      return Status::error(e);
    return Status::success();
  }
  Status uploadBytes(const void *bytes, size_t n) {
    count = n;
    if (auto e = cuda::device::allocate(n, &memory); !e.empty())
      return Status::error(e);
    if (auto e = cuda::device::copy(memory, bytes, n); !e.empty())
      return Status::error(e);
    return Status::success();
  }
  Status download(float *out) const {
    std::vector<uint8_t> host(count * dtypeSize(dtype));
    if (auto e = cuda::device::copy(host.data(), memory, host.size()); !e.empty())
      return Status::error(e);
    cpu::loadFloats(host.data(), dtype, out, count);
    return Status::success();
  }
};

/// One forward and backward binary's layer on `data` (random, of its
/// shape; its own copy).
int layer(const std::shared_ptr<const rt::Program> &fwd,
          const std::shared_ptr<const rt::Program> &bwd, tooling::LayerData data, int repeat,
          double hotShare, int64_t sample, bool pack) {
  const rt::LayerShape &shape = fwd->shape();
  const DType act = shape.activations, grad = bwd->shape().weightGrads;
  // Quantized weights: the reference sees the values the layer computes with.
  if (Status s = tooling::roundWeightsToFormat(shape, &data); !s)
    return fail(s);
  rt::ContextOptions options;
  options.backend = backend::Kind::Cuda;
  options.packWeights = pack;
  std::unique_ptr<rt::Context> context;
  if (Status s = rt::Context::create(fwd, bwd, options, &context); !s)
    return fail(s);

  // A frozen layer's backward (quantized weights, or frozen=True) gives
  // no weight gradients.
  const bool frozen = bwd->shape().frozen;
  const int64_t R = shape.ranks, S = data.tokens, K = data.topK, H = shape.hidden,
                I = shape.inter, L = shape.localExperts;
  enum { kX, kY, kW1, kW2, kW1Scale, kW2Scale, kDy, kDx, kDtopk, kDw1, kDw2, kCount };
  std::vector<DeviceTensor> t(size_t(R) * kCount);
  for (int64_t r = 0; r < R; ++r) {
    DeviceTensor *b = &t[size_t(r) * kCount];
    const size_t sh = size_t(S * H), w1n = size_t(L * H * 2 * I), w2n = size_t(L * I * H);
    const tooling::StoredWeights w = tooling::storedWeights(shape, data, r);
    Status s = b[kX].upload(data.x.data() + r * S * H, sh, act);
    if (s) s = b[kY].upload(nullptr, sh, act);
    if (s)
      s = b[kW1].uploadBytes(w.w1.data(), w.w1.size());
    if (s)
      s = b[kW2].uploadBytes(w.w2.data(), w.w2.size());
    if (s && !w.w1Scale.empty())
      s = b[kW1Scale].upload(w.w1Scale.data(), w.w1Scale.size(), DType::F32);
    if (s && !w.w2Scale.empty())
      s = b[kW2Scale].upload(w.w2Scale.data(), w.w2Scale.size(), DType::F32);
    if (s) s = b[kDy].upload(data.dy.data() + r * S * H, sh, act);
    if (s) s = b[kDx].upload(nullptr, sh, act);
    if (s) s = b[kDtopk].upload(nullptr, size_t(S * K), DType::F32);
    if (s && !frozen)
      s = b[kDw1].upload(nullptr, w1n, grad);
    if (s && !frozen)
      s = b[kDw2].upload(nullptr, w2n, grad);
    if (!s)
      return fail(s);
    const uint32_t rank = uint32_t(r);
    if (s = context->setRouting(rank, rt::makeTensor(data.ids.data() + r * S * K, DType::I64, {S, K}),
                                rt::makeTensor(data.weights.data() + r * S * K, DType::F32, {S, K}));
        !s)
      return fail(s);
    std::vector<std::pair<const char *, rt::Tensor>> bindings = {
        {"x", rt::makeTensor(b[kX].memory, act, {S, H})},
        {"y", rt::makeTensor(b[kY].memory, act, {S, H})},
        {"w1", rt::makeTensor(b[kW1].memory, w.dtype, w.w1Dims)},
        {"w2", rt::makeTensor(b[kW2].memory, w.dtype, w.w2Dims)},
        {"dy", rt::makeTensor(b[kDy].memory, act, {S, H})},
        {"dx", rt::makeTensor(b[kDx].memory, act, {S, H})},
        {"dtopk_weights", rt::makeTensor(b[kDtopk].memory, DType::F32, {S, K})}};
    if (!w.w1Scale.empty()) {
      bindings.push_back(
          {"w1_scale", rt::makeTensor(b[kW1Scale].memory, DType::F32, w.w1ScaleDims)});
      bindings.push_back(
          {"w2_scale", rt::makeTensor(b[kW2Scale].memory, DType::F32, w.w2ScaleDims)});
    }
    if (!frozen) {
      bindings.push_back({"dw1", rt::makeTensor(b[kDw1].memory, grad, {L, H, 2 * I})});
      bindings.push_back({"dw2", rt::makeTensor(b[kDw2].memory, grad, {L, I, H})});
    }
    for (const auto &[name, tensor] : bindings)
      if (s = context->bind(rank, name, tensor); !s)
        return fail(s);
  }

  std::string gpu;
  (void)cuda::describeDevice(&gpu);
  std::printf("GPU: %s\n", gpu.c_str());
  std::printf("layer: R %lld, L %lld, S %lld, K %lld, H %lld, I %lld, %s, weights %s%s%s, "
              "hot share %.2f%s\n",
              (long long)R, (long long)L, (long long)S, (long long)K, (long long)H, (long long)I,
              dtypeName(act), shape.weightFormatName().c_str(),
              shape.weightsTransposed ? " (stored transposed)" : "", frozen ? ", frozen" : "",
              hotShare, pack ? ", packed weights" : "");
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
  // Forward, dX and dA; and dW1, dW2 unless frozen.
  const double flops = (frozen ? 2.0 : 3.0) * 2 * double(R) * S * K * (H * 2.0 * I + double(I) * H);
  std::printf("moec cuda step (fwd+bwd): median %.3f ms over %d (%.1f TFLOP/s); the task "
              "programs' part %.3f ms\n",
              step * 1e3, repeat, flops / step / 1e12, kernel * 1e3);
  std::printf("  around them: %.3f ms before (of it %.3f ms the checks, routing layout and "
              "agreement; then the layout's upload and the gather of the rows to send), %.3f ms "
              "after (combine, top-k weight gradient)\n",
              median(before) * 1e3, median(checks) * 1e3, median(after) * 1e3);
  if (pack)
    std::printf("  packed weights (kept decoded): %.1f MB\n",
                double(context->packedWeightBytes()) / 1e6);

  if (sample > 0) {
    data.y.assign(size_t(R * S * H), 0);
    data.dx = data.y;
    data.dtopk.assign(size_t(R * S * K), 0);
    data.dw1.assign(frozen ? 0 : data.w1.size(), 0);
    data.dw2.assign(frozen ? 0 : data.w2.size(), 0);
    for (int64_t r = 0; r < R; ++r) {
      const DeviceTensor *b = &t[size_t(r) * kCount];
      Status s = b[kY].download(data.y.data() + r * S * H);
      if (s) s = b[kDx].download(data.dx.data() + r * S * H);
      if (s) s = b[kDtopk].download(data.dtopk.data() + r * S * K);
      if (s && !frozen)
        s = b[kDw1].download(data.dw1.data() + r * L * H * 2 * I);
      if (s && !frozen)
        s = b[kDw2].download(data.dw2.data() + r * L * I * H);
      if (!s)
        return fail(s);
    }
    // Every backward overwrites the weight gradients (no main_grad): the
    // last step's are compared.
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
           const std::vector<bool> &packs) {
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
      failed += layer(fwd, bwd, data, repeat, hotShare, sample, pack) != 0;
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
                   "                  [--pack-weights off|on|both]\n"
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
      } else
        return fail(Status::error("unknown option " + flag));
    }
    return layers(paths, repeat, hot, sample, packs);
  }
  usage(stderr);
  return 2;
}
