//===- CudaBench.cpp - The cuda backend's tiles and layer, timed ------------===//
//
//   cuda_bench gmm [M N K ...]        the persistent kernel's GMM tile function
//                                     on bf16 products (C bf16), 128 x 128
//                                     tiles, one thread block each: TFLOP/s
//   cuda_bench layer FWD BWD [--repeat N] [--hot-share F] [--sample N]
//                                     the layer, forward and backward, every
//                                     rank on the GPU, tensors in device
//                                     memory: median step time, the persistent
//                                     kernels' share, and a sampled check
//                                     against the reference (N tokens)
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

int fail(const Status &s) {
  std::fprintf(stderr, "cuda_bench: %s\n", s.message().c_str());
  return 1;
}

int gmm(const std::vector<int64_t> &shapes) {
  std::printf("%-22s %10s %10s\n", "M x N x K (bf16)", "ms", "TFLOP/s");
  for (size_t i = 0; i + 2 < shapes.size(); i += 3) {
    const int64_t m = shapes[i], n = shapes[i + 1], k = shapes[i + 2];
    double seconds = 0;
    const cuda::device::Error e = cuda::device::benchGemm(m, n, k, uint32_t(DType::BF16),
                                              uint32_t(DType::BF16), 128, 128, 20, &seconds);
    if (!e.empty())
      return fail(Status::error(e));
    std::printf("%-22s %10.3f %10.1f\n", fmt::format("{} x {} x {}", m, n, k).c_str(),
                seconds * 1e3, 2.0 * m * n * k / seconds / 1e12);
  }
  return 0;
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
  Status download(float *out) const {
    std::vector<uint8_t> host(count * dtypeSize(dtype));
    if (auto e = cuda::device::copy(host.data(), memory, host.size()); !e.empty())
      return Status::error(e);
    cpu::loadFloats(host.data(), dtype, out, count);
    return Status::success();
  }
};

int layer(const std::string &fwdPath, const std::string &bwdPath, int repeat, double hotShare,
          int64_t sample) {
  std::shared_ptr<const rt::Program> fwd, bwd;
  if (Status s = rt::Program::load(fwdPath, &fwd); !s)
    return fail(s);
  if (Status s = rt::Program::load(bwdPath, &bwd); !s)
    return fail(s);
  const rt::LayerShape &shape = fwd->shape();
  const DType act = shape.activations, grad = bwd->shape().weightGrads;
  tooling::LayerData data;
  tooling::RandomOptions random;
  random.hotShare = hotShare;
  random.bf16 = act == DType::BF16;
  tooling::randomLayerData(shape, random, &data);
  rt::ContextOptions options;
  options.backend = backend::Kind::Cuda;
  std::unique_ptr<rt::Context> context;
  if (Status s = rt::Context::create(fwd, bwd, options, &context); !s)
    return fail(s);

  const int64_t R = shape.ranks, S = data.tokens, K = data.topK, H = shape.hidden,
                I = shape.inter, L = shape.localExperts;
  enum { kX, kY, kW1, kW2, kDy, kDx, kDtopk, kDw1, kDw2, kCount };
  std::vector<DeviceTensor> t(size_t(R) * kCount);
  for (int64_t r = 0; r < R; ++r) {
    DeviceTensor *b = &t[size_t(r) * kCount];
    const size_t sh = size_t(S * H), w1n = size_t(L * H * 2 * I), w2n = size_t(L * I * H);
    Status s = b[kX].upload(data.x.data() + r * S * H, sh, act);
    if (s) s = b[kY].upload(nullptr, sh, act);
    if (s) s = b[kW1].upload(data.w1.data() + r * w1n, w1n, act);
    if (s) s = b[kW2].upload(data.w2.data() + r * w2n, w2n, act);
    if (s) s = b[kDy].upload(data.dy.data() + r * S * H, sh, act);
    if (s) s = b[kDx].upload(nullptr, sh, act);
    if (s) s = b[kDtopk].upload(nullptr, size_t(S * K), DType::F32);
    if (s) s = b[kDw1].upload(nullptr, w1n, grad);
    if (s) s = b[kDw2].upload(nullptr, w2n, grad);
    if (!s)
      return fail(s);
    const uint32_t rank = uint32_t(r);
    if (s = context->setRouting(rank, rt::makeTensor(data.ids.data() + r * S * K, DType::I64, {S, K}),
                                rt::makeTensor(data.weights.data() + r * S * K, DType::F32, {S, K}));
        !s)
      return fail(s);
    const std::pair<const char *, rt::Tensor> bindings[] = {
        {"x", rt::makeTensor(b[kX].memory, act, {S, H})},
        {"y", rt::makeTensor(b[kY].memory, act, {S, H})},
        {"w1", rt::makeTensor(b[kW1].memory, act, {L, H, 2 * I})},
        {"w2", rt::makeTensor(b[kW2].memory, act, {L, I, H})},
        {"dy", rt::makeTensor(b[kDy].memory, act, {S, H})},
        {"dx", rt::makeTensor(b[kDx].memory, act, {S, H})},
        {"dtopk_weights", rt::makeTensor(b[kDtopk].memory, DType::F32, {S, K})},
        {"dw1", rt::makeTensor(b[kDw1].memory, grad, {L, H, 2 * I})},
        {"dw2", rt::makeTensor(b[kDw2].memory, grad, {L, I, H})}};
    for (const auto &[name, tensor] : bindings)
      if (s = context->bind(rank, name, tensor); !s)
        return fail(s);
  }

  std::string gpu;
  (void)cuda::describeDevice(&gpu);
  std::printf("GPU: %s\n", gpu.c_str());
  std::printf("layer: R %lld, L %lld, S %lld, K %lld, H %lld, I %lld, %s, hot share %.2f\n",
              (long long)R, (long long)L, (long long)S, (long long)K, (long long)H, (long long)I,
              dtypeName(act), hotShare);
  std::vector<double> steps, kernels;
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
    kernels.push_back(context->forwardTimes().tasks + context->backwardTimes().tasks);
  }
  std::sort(steps.begin(), steps.end());
  std::sort(kernels.begin(), kernels.end());
  const double step = steps[steps.size() / 2], kernel = kernels[kernels.size() / 2];
  const double flops = 3.0 * 2 * double(R) * S * K * (H * 2.0 * I + double(I) * H);
  std::printf("moec cuda step (fwd+bwd): median %.3f ms over %d (%.1f TFLOP/s); the task "
              "programs' part %.3f ms\n",
              step * 1e3, repeat, flops / step / 1e12, kernel * 1e3);

  if (sample > 0) {
    data.y.assign(size_t(R * S * H), 0);
    data.dx = data.y;
    data.dtopk.assign(size_t(R * S * K), 0);
    data.dw1.assign(data.w1.size(), 0);
    data.dw2.assign(data.w2.size(), 0);
    for (int64_t r = 0; r < R; ++r) {
      const DeviceTensor *b = &t[size_t(r) * kCount];
      Status s = b[kY].download(data.y.data() + r * S * H);
      if (s) s = b[kDx].download(data.dx.data() + r * S * H);
      if (s) s = b[kDtopk].download(data.dtopk.data() + r * S * K);
      if (s) s = b[kDw1].download(data.dw1.data() + r * L * H * 2 * I);
      if (s) s = b[kDw2].download(data.dw2.data() + r * L * I * H);
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

} // namespace

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "gmm") {
    std::vector<int64_t> shapes;
    for (int i = 2; i < argc; ++i)
      shapes.push_back(std::atoll(argv[i]));
    if (shapes.empty())
      shapes = {128, 128, 2048, 1024, 1536, 2048, 4096, 4096, 4096, 8192, 8192, 8192};
    if (shapes.size() % 3)
      return fail(Status::error("give M N K triples"));
    std::string gpu;
    if (Status s = cuda::describeDevice(&gpu); !s)
      return fail(s);
    std::printf("GPU: %s\n", gpu.c_str());
    return gmm(shapes);
  }
  if (mode == "layer" && argc >= 4) {
    int repeat = 5;
    double hot = 0;
    int64_t sample = 0;
    for (int i = 4; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      if (flag == "--repeat")
        repeat = std::max(1, std::atoi(argv[i + 1]));
      else if (flag == "--hot-share")
        hot = std::atof(argv[i + 1]);
      else if (flag == "--sample")
        sample = std::atoll(argv[i + 1]);
      else
        return fail(Status::error("unknown option " + flag));
    }
    return layer(argv[2], argv[3], repeat, hot, sample);
  }
  std::fprintf(stderr, "usage: cuda_bench gmm [M N K ...]\n"
                       "       cuda_bench layer FWD BWD [--repeat N] [--hot-share F] "
                       "[--sample N]\n");
  return mode == "--help" || mode == "-h" ? 0 : 2;
}
