//===- CpuReferenceTest.cpp - Tests for the reference MoE-FFN layer -------===//
//
// The reference layer against an independent direct computation, against
// itself under a different rank partition, and its backward pass against
// finite differences (in double). Then the CPU kernels, chained the way a
// runtime chains them (layout, dispatch puts, grouped matmuls, SwiGLU,
// combine), against the reference, in fp32 and bf16.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Quant.h"
#include "runtime/cpu/Rows.h"
#include "runtime/cpu/Swiglu.h"
#include "runtime/layer/Routing.h"
#include "runtime/tooling/LayerRun.h"
#include "runtime/tooling/Reference.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace moec::cpu;
using moec::rt::buildRoutingLayout;
using moec::rt::RoutingLayout;
namespace ref = moec::reference;
using moec::Status;

namespace {

//===----------------------------------------------------------------------===//
// Random layers
//===----------------------------------------------------------------------===//

template <typename T> std::vector<T> randomVector(std::mt19937 &rng, size_t n, double scale) {
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<T> v(n);
  for (T &x : v)
    x = T(dist(rng));
  return v;
}

/// Random inputs for every rank: distinct experts per token (a random
/// permutation's first K), weights in [0.1, 1).
template <typename T>
std::vector<ref::RankInputs<T>> randomInputs(const ref::LayerShape &s, std::mt19937 &rng) {
  std::vector<ref::RankInputs<T>> inputs(size_t(s.ranks));
  std::uniform_real_distribution<double> weight(0.1, 1.0);
  std::vector<int64_t> perm(size_t(s.experts()));
  for (ref::RankInputs<T> &in : inputs) {
    in.x = randomVector<T>(rng, size_t(s.tokens * s.hidden), 1.0);
    for (int64_t t = 0; t < s.tokens; ++t) {
      for (int64_t e = 0; e < int64_t(s.experts()); ++e)
        perm[size_t(e)] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t k = 0; k < s.topK; ++k) {
        in.topkIds.push_back(perm[size_t(k)]);
        in.topkWeights.push_back(T(weight(rng)));
      }
    }
  }
  return inputs;
}

template <typename T> ref::Weights<T> randomWeights(const ref::LayerShape &s, std::mt19937 &rng) {
  ref::Weights<T> w;
  w.w1 = randomVector<T>(rng, size_t(s.experts() * s.hidden * 2 * s.inter),
                         1.0 / std::sqrt(double(s.hidden)));
  w.w2 = randomVector<T>(rng, size_t(s.experts() * s.inter * s.hidden),
                         1.0 / std::sqrt(double(s.inter)));
  return w;
}

template <typename T>
std::vector<std::vector<T>> randomGrads(const ref::LayerShape &s, std::mt19937 &rng) {
  std::vector<std::vector<T>> dy;
  for (int64_t r = 0; r < s.ranks; ++r)
    dy.push_back(randomVector<T>(rng, size_t(s.tokens * s.hidden), 1.0));
  return dy;
}

/// Largest |a - b| over two equally long vectors.
template <typename T> double maxDiff(const std::vector<T> &a, const std::vector<T> &b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
  return d;
}

ref::LayerShape layerShape(uint32_t ranks, uint32_t localExperts, int64_t hidden, int64_t inter,
                           int64_t topK, int64_t tokens) {
  ref::LayerShape s;
  s.ranks = ranks;
  s.localExperts = localExperts;
  s.hidden = hidden;
  s.inter = inter;
  s.topK = topK;
  s.tokens = tokens;
  return s;
}

/// A random layer with a random upstream gradient, and the reference's
/// forward and backward results on it.
template <typename T> struct SolvedLayer {
  std::vector<ref::RankInputs<T>> inputs;
  ref::Weights<T> weights;
  std::vector<std::vector<T>> dy;
  ref::Forward<T> fwd;
  ref::Backward<T> bwd;
};

template <typename T> SolvedLayer<T> solvedLayer(const ref::LayerShape &s, unsigned seed) {
  std::mt19937 rng(seed);
  SolvedLayer<T> l;
  l.inputs = randomInputs<T>(s, rng);
  l.weights = randomWeights<T>(s, rng);
  l.dy = randomGrads<T>(s, rng);
  REQUIRE(ref::forward(s, l.inputs, l.weights, &l.fwd).ok());
  REQUIRE(ref::backward(s, l.inputs, l.weights, l.fwd, l.dy, &l.bwd).ok());
  return l;
}

/// The per-rank parts `part` of each rank's inputs, one after the other
/// (rank-major), as U.
template <typename U, typename T, typename Part>
std::vector<U> rankMajor(const std::vector<ref::RankInputs<T>> &inputs, Part part) {
  std::vector<U> all;
  for (const ref::RankInputs<T> &in : inputs)
    for (const auto &v : in.*part)
      all.push_back(U(v));
  return all;
}

template <typename U, typename T> std::vector<U> rankMajor(const std::vector<std::vector<T>> &parts) {
  std::vector<U> all;
  for (const std::vector<T> &p : parts)
    all.insert(all.end(), p.begin(), p.end());
  return all;
}

} // namespace

//===----------------------------------------------------------------------===//
// The reference on its own
//===----------------------------------------------------------------------===//

TEST_CASE("reference: one rank, one expert, top-1 is a weighted SwiGLU MLP", "[cpu][reference]") {
  ref::LayerShape s;
  s.ranks = 1;
  s.localExperts = 1;
  s.hidden = 6;
  s.inter = 4;
  s.topK = 1;
  s.tokens = 5;
  std::mt19937 rng(1);
  auto inputs = randomInputs<double>(s, rng);
  auto weights = randomWeights<double>(s, rng);
  ref::Forward<double> fwd;
  REQUIRE(ref::forward(s, inputs, weights, &fwd).ok());

  // Directly: per token, gate = x Wg, up = x Wu, h = silu(gate) * up,
  // y = w * h W2.
  const auto &in = inputs[0];
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<double> h(size_t(s.inter));
    for (int64_t i = 0; i < s.inter; ++i) {
      double gate = 0, up = 0;
      for (int64_t d = 0; d < s.hidden; ++d) {
        gate += in.x[size_t(t * s.hidden + d)] * weights.w1[size_t(d * 2 * s.inter + i)];
        up += in.x[size_t(t * s.hidden + d)] * weights.w1[size_t(d * 2 * s.inter + s.inter + i)];
      }
      h[size_t(i)] = gate / (1.0 + std::exp(-gate)) * up;
    }
    for (int64_t d = 0; d < s.hidden; ++d) {
      double out = 0;
      for (int64_t i = 0; i < s.inter; ++i)
        out += h[size_t(i)] * weights.w2[size_t(i * s.hidden + d)];
      CHECK(fwd.y[0][size_t(t * s.hidden + d)] ==
            Approx(in.topkWeights[size_t(t)] * out).epsilon(1e-12).margin(1e-14));
    }
  }
  // The saved rows are the tokens in order.
  REQUIRE(fwd.experts.size() == 1);
  REQUIRE(fwd.experts[0].rows.size() == size_t(s.tokens));
  for (int64_t t = 0; t < s.tokens; ++t)
    CHECK(fwd.experts[0].rows[size_t(t)].token == t);
  CHECK(fwd.experts[0].x == in.x);
}

TEST_CASE("reference: results do not depend on how tokens split over ranks",
          "[cpu][reference]") {
  // Two ranks of 4 tokens each equal one rank of all 8 tokens.
  ref::LayerShape two;
  two.ranks = 2;
  two.localExperts = 2;
  two.hidden = 5;
  two.inter = 3;
  two.topK = 2;
  two.tokens = 4;
  std::mt19937 rng(2);
  auto inputs = randomInputs<double>(two, rng);
  auto weights = randomWeights<double>(two, rng);
  auto dy = randomGrads<double>(two, rng);

  ref::LayerShape one = two;
  one.ranks = 1;
  one.localExperts = 4;
  one.tokens = 8;
  std::vector<ref::RankInputs<double>> merged(1);
  std::vector<std::vector<double>> dyMerged(1);
  for (int r = 0; r < 2; ++r) {
    auto &m = merged[0];
    m.x.insert(m.x.end(), inputs[size_t(r)].x.begin(), inputs[size_t(r)].x.end());
    m.topkIds.insert(m.topkIds.end(), inputs[size_t(r)].topkIds.begin(),
                     inputs[size_t(r)].topkIds.end());
    m.topkWeights.insert(m.topkWeights.end(), inputs[size_t(r)].topkWeights.begin(),
                         inputs[size_t(r)].topkWeights.end());
    dyMerged[0].insert(dyMerged[0].end(), dy[size_t(r)].begin(), dy[size_t(r)].end());
  }

  ref::Forward<double> f2, f1;
  ref::Backward<double> b2, b1;
  REQUIRE(ref::forward(two, inputs, weights, &f2).ok());
  REQUIRE(ref::backward(two, inputs, weights, f2, dy, &b2).ok());
  REQUIRE(ref::forward(one, merged, weights, &f1).ok());
  REQUIRE(ref::backward(one, merged, weights, f1, dyMerged, &b1).ok());

  for (int r = 0; r < 2; ++r) {
    const size_t sh = size_t(two.tokens * two.hidden), sk = size_t(two.tokens * two.topK);
    std::vector<double> y1(f1.y[0].begin() + r * sh, f1.y[0].begin() + (r + 1) * sh);
    std::vector<double> dx1(b1.dx[0].begin() + r * sh, b1.dx[0].begin() + (r + 1) * sh);
    std::vector<double> dw1(b1.dtopkWeights[0].begin() + r * sk,
                            b1.dtopkWeights[0].begin() + (r + 1) * sk);
    CHECK(maxDiff(f2.y[size_t(r)], y1) < 1e-12);
    CHECK(maxDiff(b2.dx[size_t(r)], dx1) < 1e-12);
    CHECK(maxDiff(b2.dtopkWeights[size_t(r)], dw1) < 1e-12);
  }
  CHECK(maxDiff(b2.dw1, b1.dw1) < 1e-12);
  CHECK(maxDiff(b2.dw2, b1.dw2) < 1e-12);
  // Dispatch order: by source rank, then token, then k.
  for (const auto &ex : f2.experts)
    for (size_t i = 1; i < ex.rows.size(); ++i) {
      const ref::RowSource &a = ex.rows[i - 1], &b = ex.rows[i];
      CHECK((a.rank < b.rank || (a.rank == b.rank && a.token < b.token)));
    }
}

TEST_CASE("reference: backward matches finite differences", "[cpu][reference]") {
  ref::LayerShape s;
  s.ranks = 2;
  s.localExperts = 2;
  s.hidden = 3;
  s.inter = 2;
  s.topK = 2;
  s.tokens = 3;
  std::mt19937 rng(3);
  auto inputs = randomInputs<double>(s, rng);
  auto weights = randomWeights<double>(s, rng);
  auto dy = randomGrads<double>(s, rng);

  // The loss whose gradients backward computes: sum_r <dy_r, y_r>.
  auto loss = [&](const std::vector<ref::RankInputs<double>> &in, const ref::Weights<double> &w) {
    ref::Forward<double> f;
    REQUIRE(ref::forward(s, in, w, &f).ok());
    double l = 0;
    for (int64_t r = 0; r < s.ranks; ++r)
      for (size_t i = 0; i < dy[size_t(r)].size(); ++i)
        l += dy[size_t(r)][i] * f.y[size_t(r)][i];
    return l;
  };
  ref::Forward<double> fwd;
  ref::Backward<double> grads;
  REQUIRE(ref::forward(s, inputs, weights, &fwd).ok());
  REQUIRE(ref::backward(s, inputs, weights, fwd, dy, &grads).ok());

  const double h = 1e-6;
  // Perturbs one value, returns the central difference of the loss.
  auto numeric = [&](double &value) {
    const double saved = value;
    value = saved + h;
    const double up = loss(inputs, weights);
    value = saved - h;
    const double down = loss(inputs, weights);
    value = saved;
    return (up - down) / (2 * h);
  };
  auto check = [&](const char *name, std::vector<double> &values,
                   const std::vector<double> &analytic) {
    REQUIRE(values.size() == analytic.size());
    for (size_t i = 0; i < values.size(); ++i) {
      INFO(name << "[" << i << "]");
      CHECK(analytic[i] == Approx(numeric(values[i])).epsilon(1e-6).margin(1e-8));
    }
  };
  for (int64_t r = 0; r < s.ranks; ++r) {
    check("x", inputs[size_t(r)].x, grads.dx[size_t(r)]);
    check("topk_weights", inputs[size_t(r)].topkWeights, grads.dtopkWeights[size_t(r)]);
  }
  check("w1", weights.w1, grads.dw1);
  check("w2", weights.w2, grads.dw2);
}

TEST_CASE("reference: errors", "[cpu][reference]") {
  ref::LayerShape s;
  s.ranks = 2;
  s.localExperts = 2;
  s.hidden = 2;
  s.inter = 2;
  s.topK = 2;
  s.tokens = 2;
  std::mt19937 rng(4);
  auto inputs = randomInputs<float>(s, rng);
  auto weights = randomWeights<float>(s, rng);
  ref::Forward<float> fwd;

  ref::LayerShape bad = s;
  bad.localExperts = 0;
  CHECK(ref::validateShape(bad).message() ==
        "layer: every rank needs at least one expert, got 0 local experts");
  bad = s;
  bad.topK = 5;
  CHECK(ref::validateShape(bad).message() == "layer: top-k (5) must be in 1..4");

  auto wrongId = inputs;
  wrongId[1].topkIds[3] = 4;
  Status status = ref::forward(s, wrongId, weights, &fwd);
  CHECK(status.message() == "rank 1: topk_ids[1][1] = 4 is not an expert");
  auto twice = inputs;
  twice[0].topkIds[1] = twice[0].topkIds[0];
  status = ref::forward(s, twice, weights, &fwd);
  CHECK(status.message() == "rank 0: token 0 routes to expert " +
                                std::to_string(twice[0].topkIds[0]) + " twice");
  auto shortW = weights;
  shortW.w2.pop_back();
  CHECK(ref::forward(s, inputs, shortW, &fwd).message() == "w2 has 15 elements, expected 16");
  REQUIRE(ref::forward(s, inputs, weights, &fwd).ok());
  ref::Backward<float> grads;
  std::vector<std::vector<float>> dy(1, std::vector<float>(4));
  CHECK(ref::backward(s, inputs, weights, fwd, dy, &grads).message() ==
        "layer: 1 dy tensors for 2 ranks");
}

TEST_CASE("reference: a sample's tokens and units are the whole layer's values",
          "[cpu][reference]") {
  const ref::LayerShape s = layerShape(3, 2, 10, 6, 3, 7);
  const SolvedLayer<float> l = solvedLayer<float>(s, 11);
  const ref::Forward<float> &fwd = l.fwd;
  const ref::Backward<float> &bwd = l.bwd;
  const ref::Weights<float> &weights = l.weights;

  // The same inputs as flat rank-major arrays.
  const std::vector<float> x = rankMajor<float>(l.inputs, &ref::RankInputs<float>::x);
  const std::vector<float> topkWeights =
      rankMajor<float>(l.inputs, &ref::RankInputs<float>::topkWeights);
  std::vector<int64_t> ids = rankMajor<int64_t>(l.inputs, &ref::RankInputs<float>::topkIds);
  const std::vector<float> dyAll = rankMajor<float>(l.dy);
  ref::InputView<float> view;
  view.x = x.data();
  view.topkIds = ids.data();
  view.topkWeights = topkWeights.data();
  view.w1 = weights.w1.data();
  view.w2 = weights.w2.data();
  view.dy = dyAll.data();
  ref::Sample sample;
  sample.tokens = {0, 8, 20};                // rank 0 token 0, rank 1 token 1, rank 2 token 6
  sample.units = {{0, 0}, {3, 5}, {5, 2}};   // first, a middle and the last expert
  std::vector<double> shares;
  ref::SampleOutputs<double> got;
  REQUIRE(ref::sampled(s, view, sample, &got, [&](double d) { shares.push_back(d); }).ok());
  REQUIRE(shares.size() == sample.tokens.size() + sample.units.size());
  CHECK(shares.back() == 1.0);

  const int64_t H = s.hidden, I = s.inter, K = s.topK;
  for (size_t n = 0; n < sample.tokens.size(); ++n) {
    const int64_t r = sample.tokens[n] / s.tokens, t = sample.tokens[n] % s.tokens;
    for (int64_t h = 0; h < H; ++h) {
      CHECK(got.y[n * size_t(H) + size_t(h)] ==
            Approx(fwd.y[size_t(r)][size_t(t * H + h)]).margin(1e-5));
      CHECK(got.dx[n * size_t(H) + size_t(h)] ==
            Approx(bwd.dx[size_t(r)][size_t(t * H + h)]).margin(1e-5));
    }
    for (int64_t k = 0; k < K; ++k)
      CHECK(got.dtopk[n * size_t(K) + size_t(k)] ==
            Approx(bwd.dtopkWeights[size_t(r)][size_t(t * K + k)]).margin(1e-5));
  }
  for (size_t u = 0; u < sample.units.size(); ++u) {
    const auto [e, i] = sample.units[u];
    for (int64_t h = 0; h < H; ++h) {
      CHECK(got.dw2[u * size_t(H) + size_t(h)] ==
            Approx(bwd.dw2[size_t((e * I + i) * H + h)]).margin(1e-5));
      CHECK(got.dw1[u * size_t(2 * H) + size_t(2 * h)] ==
            Approx(bwd.dw1[size_t((e * H + h) * 2 * I + i)]).margin(1e-5));
      CHECK(got.dw1[u * size_t(2 * H) + size_t(2 * h + 1)] ==
            Approx(bwd.dw1[size_t((e * H + h) * 2 * I + I + i)]).margin(1e-5));
    }
  }

  // Forward only: y, and no gradients.
  view.dy = nullptr;
  REQUIRE(ref::sampled(s, view, sample, &got).ok());
  CHECK(got.y.size() == sample.tokens.size() * size_t(H));
  CHECK(got.dx.empty());
  CHECK(got.dw1.empty());

  // Indices out of range and a bad routing are errors.
  ref::Sample bad = sample;
  bad.tokens.push_back(21);
  CHECK(ref::sampled(s, view, bad, &got).message() == "sample: token 21 is not one of the 21 tokens");
  bad = sample;
  bad.units.push_back({6, 0});
  CHECK(ref::sampled(s, view, bad, &got).message() ==
        "sample: unit (6, 0) is not a unit of 6 experts x 6");
  ids[4] = ids[3];
  CHECK(ref::sampled(s, view, sample, &got).message() ==
        "rank 0: token 1 routes to expert " + std::to_string(ids[3]) + " twice");
}

TEST_CASE("verifyLayer: a sampled check passes right outputs and names a wrong one",
          "[cpu][reference]") {
  namespace tooling = moec::tooling;
  const ref::LayerShape s = layerShape(2, 3, 12, 5, 2, 9);
  const SolvedLayer<double> l = solvedLayer<double>(s, 5);

  // The layer's data with the reference's outputs in place of a run's.
  tooling::LayerData d;
  d.ranks = s.ranks;
  d.tokens = s.tokens;
  d.topK = s.topK;
  d.experts = int64_t(s.experts());
  d.hidden = s.hidden;
  d.inter = s.inter;
  d.x = rankMajor<float>(l.inputs, &ref::RankInputs<double>::x);
  d.ids = rankMajor<int64_t>(l.inputs, &ref::RankInputs<double>::topkIds);
  d.weights = rankMajor<float>(l.inputs, &ref::RankInputs<double>::topkWeights);
  d.dy = rankMajor<float>(l.dy);
  d.y = rankMajor<float>(l.fwd.y);
  d.dx = rankMajor<float>(l.bwd.dx);
  d.dtopk = rankMajor<float>(l.bwd.dtopkWeights);
  d.w1.assign(l.weights.w1.begin(), l.weights.w1.end());
  d.w2.assign(l.weights.w2.begin(), l.weights.w2.end());
  d.dw1.assign(l.bwd.dw1.begin(), l.bwd.dw1.end());
  d.dw2.assign(l.bwd.dw2.begin(), l.bwd.dw2.end());

  tooling::VerifyOptions options;
  options.backward = true;
  options.sampleTokens = 4;
  std::vector<tooling::OutputError> errors;
  tooling::SampleSummary summary;
  REQUIRE(tooling::verifyLayer(d, options, &errors, &summary).ok());
  REQUIRE(errors.size() == 5);
  for (const tooling::OutputError &e : errors)
    CHECK(e.ok());
  CHECK(summary.tokens == 4);
  CHECK(summary.units >= 2); // one per expert the 4 tokens route to
  CHECK(summary.units <= 8);

  // A layer with LoRA adapters on w1 and w2 over a frozen base: the solved
  // layer's weights W are base + s A B (base = W - s A B), its outputs the
  // layer's, the adapters' gradients dA = s G B^T, dB = s A^T G from W's
  // gradient G. Every token sampled: y, dx, dtopk_weights, the units'
  // columns of dlora_b1 and rows of dlora_a2 pass, dlora_a1 and dlora_b2
  // are named unsampled; a spoilt output fails alone, and the adapters
  // dropped (the base alone) fail y.
  {
    const int64_t E = int64_t(s.experts()), H = s.hidden, I = s.inter, r = 2;
    const float scale = 0.75f;
    tooling::LayerData lora = d;
    lora.loraTargets = 3;
    lora.loraRank = r;
    lora.loraScale = scale;
    lora.dw1.clear();
    lora.dw2.clear();
    std::mt19937 rng(17);
    std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
    for (int p = 0; p < 2; ++p) {
      const int64_t k = p == 0 ? H : I, n = p == 0 ? 2 * I : H;
      std::vector<float> &a = lora.loraA[size_t(p)], &b = lora.loraB[size_t(p)];
      a.resize(size_t(E * k * r));
      b.resize(size_t(E * r * n));
      for (float &v : a)
        v = dist(rng);
      for (float &v : b)
        v = dist(rng);
      const std::vector<double> &w = p == 0 ? l.weights.w1 : l.weights.w2;
      const std::vector<double> &grad = p == 0 ? l.bwd.dw1 : l.bwd.dw2;
      std::vector<float> &base = p == 0 ? lora.w1 : lora.w2;
      std::vector<float> &dA = lora.dLoraA[size_t(p)], &dB = lora.dLoraB[size_t(p)];
      dA.assign(a.size(), 0.0f);
      dB.assign(b.size(), 0.0f);
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < k; ++i)
          for (int64_t j = 0; j < n; ++j) {
            const size_t at = size_t((e * k + i) * n + j);
            double ab = 0;
            for (int64_t q = 0; q < r; ++q) {
              const size_t ai = size_t((e * k + i) * r + q), bi = size_t((e * r + q) * n + j);
              ab += double(a[ai]) * double(b[bi]);
              dA[ai] += float(scale * grad[at] * double(b[bi]));
              dB[bi] += float(scale * double(a[ai]) * grad[at]);
            }
            base[at] = float(w[at] - scale * ab);
          }
    }
    tooling::VerifyOptions all = options;
    all.sampleTokens = s.ranks * s.tokens;
    const auto failing = [&](const tooling::LayerData &data, tooling::SampleSummary *summary) {
      std::vector<tooling::OutputError> found;
      REQUIRE(tooling::verifyLayer(data, all, &found, summary).ok());
      std::vector<std::string> names, bad;
      for (const tooling::OutputError &e : found) {
        names.push_back(e.name);
        if (!e.ok())
          bad.push_back(e.name);
      }
      CHECK(names == std::vector<std::string>{"y", "dx", "dtopk_weights", "dlora_b1", "dlora_a2"});
      return bad;
    };
    tooling::SampleSummary loraSummary;
    CHECK(failing(lora, &loraSummary).empty());
    CHECK(loraSummary.unsampled == std::vector<std::string>{"dlora_a1", "dlora_b2"});
    CHECK(loraSummary.units >= 2);
    tooling::LayerData wrong = lora;
    for (int64_t i = 0; i < r * 2 * I; ++i) // expert 0's dlora_b1
      wrong.dLoraB[0][size_t(i)] += 1.0f;
    CHECK(failing(wrong, nullptr) == std::vector<std::string>{"dlora_b1"});
    wrong = lora;
    for (int64_t i = 0; i < I * r; ++i) // expert 5's dlora_a2
      wrong.dLoraA[1][size_t(5 * I * r + i)] -= 1.0f;
    CHECK(failing(wrong, nullptr) == std::vector<std::string>{"dlora_a2"});
    wrong = lora;
    std::fill(wrong.loraB[1].begin(), wrong.loraB[1].end(), 0.0f); // w2's adapter dropped
    const std::vector<std::string> dropped = failing(wrong, nullptr);
    CHECK(std::find(dropped.begin(), dropped.end(), "y") != dropped.end());
  }

  // Every token sampled: a wrong y of any token, or a wrong weight-gradient
  // element of a sampled unit, fails its output and no other.
  options.sampleTokens = s.ranks * s.tokens;
  const auto failing = [&](const tooling::LayerData &data) {
    std::vector<tooling::OutputError> found;
    REQUIRE(tooling::verifyLayer(data, options, &found).ok());
    std::vector<std::string> names;
    for (const tooling::OutputError &e : found)
      if (!e.ok())
        names.push_back(e.name);
    return names;
  };
  CHECK(failing(d).empty());
  tooling::LayerData wrong = d;
  wrong.y[size_t(s.tokens * s.hidden + 7)] += 1.0f; // rank 1, token 0
  CHECK(failing(wrong) == std::vector<std::string>{"y"});
  wrong = d;
  wrong.dtopk.back() += 1.0f;
  CHECK(failing(wrong) == std::vector<std::string>{"dtopk_weights"});
  // Every expert is touched, so each has a sampled unit; spoil all units of
  // expert 0's w2 gradient, and of expert 5's up columns of dw1.
  wrong = d;
  for (int64_t i = 0; i < s.inter * s.hidden; ++i)
    wrong.dw2[size_t(i)] += 1.0f;
  CHECK(failing(wrong) == std::vector<std::string>{"dw2"});
  wrong = d;
  for (int64_t h = 0; h < s.hidden; ++h)
    for (int64_t i = 0; i < s.inter; ++i)
      wrong.dw1[size_t((5 * s.hidden + h) * 2 * s.inter + s.inter + i)] -= 1.0f;
  CHECK(failing(wrong) == std::vector<std::string>{"dw1"});
}

//===----------------------------------------------------------------------===//
// The kernels, chained, against the reference
//===----------------------------------------------------------------------===//

namespace {

/// A tensor in a storage type, with an fp32 view for reading it back.
struct Stored {
  Elt elt;
  int64_t rows, cols;
  std::vector<float> f32;
  std::vector<uint16_t> b16;

  Stored(Elt elt, int64_t rows, int64_t cols) : elt(elt), rows(rows), cols(cols) {
    const size_t n = size_t(std::max<int64_t>(rows * cols, 1));
    if (elt == Elt::F32)
      f32.assign(n, 0.0f);
    else
      b16.assign(n, 0);
  }
  Stored(Elt elt, int64_t rows, int64_t cols, const std::vector<float> &values)
      : Stored(elt, rows, cols) {
    storeFloats(values.data(), data(), elt, values.size());
  }
  void *data() { return elt == Elt::F32 ? static_cast<void *>(f32.data()) : b16.data(); }
  const void *data() const {
    return elt == Elt::F32 ? static_cast<const void *>(f32.data()) : b16.data();
  }
  Matrix view() { return Matrix{data(), elt, cols}; }
  ConstMatrix cview() const { return ConstMatrix{data(), elt, cols}; }
  /// A view that starts at row `row`.
  Matrix rowsFrom(int64_t row) { return Matrix{view().address(row, 0), elt, cols}; }
  ConstMatrix rowsFrom(int64_t row) const {
    return ConstMatrix{cview().address(row, 0), elt, cols};
  }
  std::vector<float> values() const {
    std::vector<float> out(size_t(rows * cols));
    loadFloats(data(), elt, out.data(), out.size());
    return out;
  }
};

/// The layer computed by the kernels for every rank, as a runtime would:
/// each rank builds its routing layout and gathers its rows expert-major;
/// rank p receives, for each local expert, the rows of rank 0, then rank 1,
/// ... (puts); per expert the grouped matmuls and SwiGLU run as ragged tile
/// grids; Z rows go back to their sources (puts) and combine. Backward
/// mirrors it; weight gradients accumulate into fp32 main-grad buffers.
struct KernelLayer {
  const ref::LayerShape &s;
  Elt elt;
  std::vector<std::vector<float>> y, dx, dtopkWeights;
  std::vector<float> dw1, dw2;

  void run(const std::vector<ref::RankInputs<float>> &inputs, const ref::Weights<float> &weights,
           const std::vector<std::vector<float>> &dy) {
    const int64_t R = s.ranks, E = s.experts(), L = s.localExperts, H = s.hidden, I = s.inter,
                  K = s.topK, S = s.tokens;
    // Inputs in storage; weights of expert e are rows of one [E*H, 2I] and one
    // [E*I, H] tensor.
    Stored w1(elt, E * H, 2 * I, weights.w1), w2(elt, E * I, H, weights.w2);
    std::vector<RoutingLayout> layouts(static_cast<size_t>(R));
    std::vector<Stored> x, send;
    for (int64_t r = 0; r < R; ++r) {
      REQUIRE(buildRoutingLayout(inputs[size_t(r)].topkIds.data(), S, K, E, &layouts[size_t(r)])
                  .ok());
      x.emplace_back(elt, S, H, inputs[size_t(r)].x);
      send.emplace_back(elt, S * K, H);
      gatherTokenRows(x.back().cview(), layouts[size_t(r)].order.data(), K, nullptr,
                      send.back().view(), S * K, H);
    }

    // Receive side: rank p, local expert e gets rows from r = 0..R-1.
    // recvAt[p][e][r] is the first row of rank r's rows in p's buffer.
    std::vector<std::vector<std::vector<int64_t>>> recvAt(static_cast<size_t>(R));
    std::vector<std::vector<Segment>> segments(static_cast<size_t>(R));
    std::vector<int64_t> recvRows(size_t(R), 0);
    for (int64_t p = 0; p < R; ++p) {
      recvAt[size_t(p)].assign(size_t(L), std::vector<int64_t>(size_t(R)));
      for (int64_t e = 0; e < L; ++e) {
        Segment seg{recvRows[size_t(p)], 0};
        for (int64_t r = 0; r < R; ++r) {
          recvAt[size_t(p)][size_t(e)][size_t(r)] = seg.offset + seg.rows;
          seg.rows += layouts[size_t(r)].counts[size_t(p * L + e)];
        }
        segments[size_t(p)].push_back(seg);
        recvRows[size_t(p)] += seg.rows;
      }
    }
    // A put: rows of one strided buffer copied, bytes as they are, into
    // another (the runtime's fabrics do this).
    auto putRows = [](ConstMatrix src, Matrix dst, int64_t rows, int64_t cols) {
      REQUIRE(src.elt == dst.elt);
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(dst.address(i, 0), src.address(i, 0), size_t(cols) * dtypeSize(src.elt));
    };
    // Moves rows between each source's expert-major buffer and the
    // receivers' buffers, one put per (source, expert).
    auto exchange = [&](std::vector<Stored> &srcSide, std::vector<Stored> &recvSide,
                        bool toReceiver, int64_t cols) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < E; ++g) {
          const int64_t p = g / L, e = g % L;
          const int64_t n = layouts[size_t(r)].counts[size_t(g)];
          const int64_t at = layouts[size_t(r)].offsets[size_t(g)];
          const int64_t there = recvAt[size_t(p)][size_t(e)][size_t(r)];
          if (toReceiver)
            putRows(srcSide[size_t(r)].rowsFrom(at), recvSide[size_t(p)].rowsFrom(there), n, cols);
          else
            putRows(recvSide[size_t(p)].rowsFrom(there), srcSide[size_t(r)].rowsFrom(at), n, cols);
        }
    };
    auto capacityGrid = [&](int64_t p, int64_t e) {
      // A capacity a bit above the segment, so some tiles are clipped.
      return segments[size_t(p)][size_t(e)].rows + 3;
    };
    auto forEachTile = [](int64_t rows, int64_t cols, int64_t rowTiles, int64_t colTiles,
                          const std::function<void(Range, Range)> &body) {
      for (int64_t i = 0; i < rowTiles; ++i)
        for (int64_t j = 0; j < colTiles; ++j)
          body(Range{i * rows / rowTiles, (i + 1) * rows / rowTiles},
               Range{j * cols / colTiles, (j + 1) * cols / colTiles});
    };

    // Forward.
    std::vector<Stored> xr, yr, ar, zr, zBack;
    for (int64_t p = 0; p < R; ++p) {
      xr.emplace_back(elt, recvRows[size_t(p)], H);
      yr.emplace_back(elt, recvRows[size_t(p)], 2 * I);
      ar.emplace_back(elt, recvRows[size_t(p)], I);
      zr.emplace_back(elt, recvRows[size_t(p)], H);
      zBack.emplace_back(elt, S * K, H);
    }
    exchange(send, xr, true, H);
    for (int64_t p = 0; p < R; ++p)
      for (int64_t e = 0; e < L; ++e) {
        const Segment seg = segments[size_t(p)][size_t(e)];
        const int64_t g = p * L + e;
        forEachTile(capacityGrid(p, e), 2 * I, 3, 2, [&](Range rows, Range cols) {
          gmmForwardTile(xr[size_t(p)].cview(), w1.rowsFrom(g * H), yr[size_t(p)].view(), H, seg,
                         rows, cols);
        });
        forEachTile(seg.rows, I, 2, 2, [&](Range rows, Range cols) {
          swigluForward(yr[size_t(p)].rowsFrom(seg.offset), ar[size_t(p)].rowsFrom(seg.offset), I,
                        rows, cols);
        });
        forEachTile(capacityGrid(p, e), H, 2, 3, [&](Range rows, Range cols) {
          gmmForwardTile(ar[size_t(p)].cview(), w2.rowsFrom(g * I), zr[size_t(p)].view(), I, seg,
                         rows, cols);
        });
      }
    exchange(zBack, zr, false, H);
    y.clear();
    for (int64_t r = 0; r < R; ++r) {
      Stored out(elt, S, H);
      forEachTile(S, H, 2, 2, [&](Range tokens, Range cols) {
        combineRows(zBack[size_t(r)].cview(), layouts[size_t(r)].position.data(),
                    inputs[size_t(r)].topkWeights.data(), K, out.view(), tokens, cols);
      });
      y.push_back(out.values());
    }

    // Backward: dtopk_weights, dZ = w * dy dispatched, dA, dw2, dY, dX, dw1,
    // dX back and combined.
    std::vector<Stored> dzSend, dzr, dar, dyr, dxr, dxBack;
    dtopkWeights.assign(size_t(R), std::vector<float>(size_t(S * K)));
    for (int64_t r = 0; r < R; ++r) {
      Stored g(elt, S, H, dy[size_t(r)]);
      combineWeightGrad(g.cview(), zBack[size_t(r)].cview(), layouts[size_t(r)].position.data(),
                        K, {0, S}, H, dtopkWeights[size_t(r)].data());
      dzSend.emplace_back(elt, S * K, H);
      gatherTokenRows(g.cview(), layouts[size_t(r)].order.data(), K,
                      inputs[size_t(r)].topkWeights.data(), dzSend.back().view(), S * K, H);
      dxBack.emplace_back(elt, S * K, H);
    }
    for (int64_t p = 0; p < R; ++p) {
      dzr.emplace_back(elt, recvRows[size_t(p)], H);
      dar.emplace_back(elt, recvRows[size_t(p)], I);
      dyr.emplace_back(elt, recvRows[size_t(p)], 2 * I);
      dxr.emplace_back(elt, recvRows[size_t(p)], H);
    }
    exchange(dzSend, dzr, true, H);
    // Main-grad buffers start at 1 and accumulate; 1 is taken off at the end.
    Stored mainW1(Elt::F32, E * H, 2 * I, std::vector<float>(size_t(E * H * 2 * I), 1.0f));
    Stored mainW2(Elt::F32, E * I, H, std::vector<float>(size_t(E * I * H), 1.0f));
    for (int64_t p = 0; p < R; ++p)
      for (int64_t e = 0; e < L; ++e) {
        const Segment seg = segments[size_t(p)][size_t(e)];
        const int64_t g = p * L + e;
        forEachTile(capacityGrid(p, e), I, 2, 2, [&](Range rows, Range cols) {
          gmmDgradTile(dzr[size_t(p)].cview(), w2.rowsFrom(g * I), dar[size_t(p)].view(), H, seg,
                       rows, cols);
        });
        forEachTile(I, H, 2, 3, [&](Range rows, Range cols) {
          gmmWgradTile(ar[size_t(p)].cview(), dzr[size_t(p)].cview(), mainW2.rowsFrom(g * I), seg,
                       rows, cols, true);
        });
        forEachTile(seg.rows, I, 3, 1, [&](Range rows, Range cols) {
          swigluBackward(yr[size_t(p)].rowsFrom(seg.offset), dar[size_t(p)].rowsFrom(seg.offset),
                         dyr[size_t(p)].rowsFrom(seg.offset), I, rows, cols);
        });
        forEachTile(capacityGrid(p, e), H, 2, 2, [&](Range rows, Range cols) {
          gmmDgradTile(dyr[size_t(p)].cview(), w1.rowsFrom(g * H), dxr[size_t(p)].view(), 2 * I,
                       seg, rows, cols);
        });
        forEachTile(H, 2 * I, 3, 2, [&](Range rows, Range cols) {
          gmmWgradTile(xr[size_t(p)].cview(), dyr[size_t(p)].cview(), mainW1.rowsFrom(g * H), seg,
                       rows, cols, true);
        });
      }
    exchange(dxBack, dxr, false, H);
    dx.clear();
    for (int64_t r = 0; r < R; ++r) {
      Stored out(elt, S, H);
      combineRows(dxBack[size_t(r)].cview(), layouts[size_t(r)].position.data(), nullptr, K,
                  out.view(), {0, S}, {0, H});
      dx.push_back(out.values());
    }
    dw1 = mainW1.values();
    dw2 = mainW2.values();
    for (float &v : dw1)
      v -= 1.0f;
    for (float &v : dw2)
      v -= 1.0f;
  }
};

/// Largest |got - want| relative to the largest |want| (or 1).
double relError(const std::vector<float> &got, const std::vector<float> &want) {
  REQUIRE(got.size() == want.size());
  double err = 0, top = 1e-3;
  for (size_t i = 0; i < got.size(); ++i) {
    err = std::max(err, std::fabs(double(got[i]) - double(want[i])));
    top = std::max(top, std::fabs(double(want[i])));
  }
  return err / top;
}

} // namespace

TEST_CASE("the kernels, chained, compute the reference layer", "[cpu][reference][layer]") {
  ref::LayerShape s;
  s.ranks = 2;
  s.localExperts = 3;
  s.hidden = 40;
  s.inter = 24;
  s.topK = 2;
  s.tokens = 23;
  std::mt19937 rng(5);
  auto inputs = randomInputs<float>(s, rng);
  // Leave expert 4 without rows, so an empty segment runs through.
  for (auto &in : inputs)
    for (int64_t &id : in.topkIds)
      if (id == 4)
        id = 5;
  for (auto &in : inputs)
    for (int64_t t = 0; t < s.tokens; ++t)
      if (in.topkIds[size_t(t * 2)] == in.topkIds[size_t(t * 2 + 1)])
        in.topkIds[size_t(t * 2 + 1)] = (in.topkIds[size_t(t * 2)] + 1) % 4;
  auto weights = randomWeights<float>(s, rng);
  auto dy = randomGrads<float>(s, rng);

  for (Elt elt : {Elt::F32, Elt::BF16}) {
    INFO(dtypeName(elt));
    // The reference sees what the kernels see: inputs rounded to storage.
    auto refInputs = inputs;
    auto refWeights = weights;
    auto refDy = dy;
    if (elt == Elt::BF16) {
      auto round = [](std::vector<float> &v) {
        for (float &x : v)
          x = roundToBf16(x);
      };
      for (auto &in : refInputs)
        round(in.x);
      round(refWeights.w1);
      round(refWeights.w2);
      for (auto &g : refDy)
        round(g);
    }
    ref::Forward<float> fwd;
    ref::Backward<float> bwd;
    REQUIRE(ref::forward(s, refInputs, refWeights, &fwd).ok());
    REQUIRE(ref::backward(s, refInputs, refWeights, fwd, refDy, &bwd).ok());
    REQUIRE(fwd.experts[4].rows.empty());

    KernelLayer layer{s, elt, {}, {}, {}, {}, {}};
    layer.run(inputs, weights, dy);
    // fp32: only summation order differs. bf16: every stored intermediate is
    // rounded (relative 2^-9 each), a few of them in a row.
    const double tol = elt == Elt::F32 ? 5e-6 : 2e-2;
    for (int64_t r = 0; r < s.ranks; ++r) {
      INFO("rank " << r);
      CHECK(relError(layer.y[size_t(r)], fwd.y[size_t(r)]) < tol);
      CHECK(relError(layer.dx[size_t(r)], bwd.dx[size_t(r)]) < tol);
      CHECK(relError(layer.dtopkWeights[size_t(r)], bwd.dtopkWeights[size_t(r)]) < tol);
    }
    CHECK(relError(layer.dw1, bwd.dw1) < tol);
    CHECK(relError(layer.dw2, bwd.dw2) < tol);
  }
}

TEST_CASE("randomLayerData: a seed's values, in range, the same every time; another seed's others",
          "[cpu][reference]") {
  namespace tooling = moec::tooling;
  moec::LayerShape shape;
  shape.ranks = 2;
  shape.localExperts = 3;
  shape.hidden = 512;
  shape.inter = 400;
  shape.tokens = 9;
  shape.topK = 2;
  tooling::RandomOptions options;
  options.seed = 7;
  tooling::LayerData a, b, c;
  tooling::randomLayerData(shape, options, &a);
  tooling::randomLayerData(shape, options, &b);
  options.seed = 8;
  tooling::randomLayerData(shape, options, &c);
  REQUIRE(a.x.size() == size_t(2 * 9 * 512));
  // w1 (2.5 million values) is filled in several pieces of 2^20.
  REQUIRE(a.w1.size() == size_t(6 * 512 * 2 * 400));
  REQUIRE(a.w2.size() == size_t(6 * 400 * 512));
  CHECK(a.x == b.x);
  CHECK(a.dy == b.dy);
  CHECK(a.w1 == b.w1);
  CHECK(a.w2 == b.w2);
  CHECK(a.ids == b.ids);
  CHECK(a.x != c.x);
  CHECK(a.w1 != c.w1);
  // Uniform in [-1, 1) x the scale (1 / sqrt(fan-in) for the weights); the
  // tensors differ from one another, and hold no repeated runs of values.
  const auto check = [](const std::vector<float> &v, float scale) {
    double sum = 0;
    for (float e : v) {
      REQUIRE(e >= -scale);
      REQUIRE(e < scale);
      sum += e;
    }
    CHECK(std::abs(sum / double(v.size())) < 0.1 * scale);
    const std::set<float> distinct(v.begin(), v.end());
    CHECK(distinct.size() > v.size() * 9 / 10);
  };
  check(a.x, 1.0f);
  check(a.dy, 1.0f);
  check(a.w1, 1.0f / std::sqrt(512.0f));
  check(a.w2, 1.0f / std::sqrt(400.0f));
  CHECK(!std::equal(a.x.begin(), a.x.end(), a.dy.begin()));
}

TEST_CASE("a TP rank's quantized weights are its slice of the whole expert's codes and scales",
          "[tooling][quant]") {
  // Experts quantized whole, as a checkpoint stores them; each TP rank holds
  // w1's gate and up rows and w2's columns of them ([out, in]), with the
  // scales that cover those values. Dequantized, a rank's part is the
  // whole expert's dequantized values there, bit for bit. The weights'
  // magnitude differs from one 32-column group to the next, so that a
  // block's or group's scale taken for another's changes the values.
  using moec::WeightFormat;
  using moec::tooling::LayerData;
  const int64_t P = 2, T = 2, L = 2, H = 256, I = 256, Is = I / T, E = P * L;
  struct Format {
    WeightFormat format;
    int64_t group;
    bool zero;
  };
  for (const Format f :
       {Format{WeightFormat::Fp8Block128, 0, false}, Format{WeightFormat::Int8Channel, 0, false},
        Format{WeightFormat::Int4Group, 32, false}, Format{WeightFormat::Int4Group, 64, true},
        Format{WeightFormat::Int4Group, 128, false}}) {
    moec::rt::LayerShape shape;
    shape.ranks = uint32_t(P * T);
    shape.tp = uint32_t(T);
    shape.localExperts = uint32_t(L);
    shape.hidden = H;
    shape.inter = Is;
    shape.activations = moec::DType::BF16;
    shape.weightsTransposed = true;
    shape.frozen = true;
    shape.weightFormat = f.format;
    shape.weightGroup = f.group;
    shape.weightZeroPoints = f.zero;
    INFO(shape.weightFormatName());
    LayerData d;
    d.ranks = P;
    d.tp = T;
    d.experts = E;
    d.hidden = H;
    d.inter = I;
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    d.w1.resize(size_t(E * H * 2 * I));
    d.w2.resize(size_t(E * I * H));
    for (size_t i = 0; i < d.w1.size(); ++i) // [E, H, 2I]: by column group
      d.w1[i] = u(gen) * float(1 + (i % (2 * I)) / 32 % 5);
    for (size_t i = 0; i < d.w2.size(); ++i) // [E, I, H]: by row group (w2's in)
      d.w2[i] = u(gen) * float(1 + (i / H % I) / 32 % 5);
    LayerData whole = d;
    REQUIRE(moec::tooling::roundWeightsToFormat(shape, &whole));
    for (int64_t r = 0; r < P * T; ++r) {
      const int64_t t = r % T, first = r / T * L;
      const moec::tooling::StoredWeights w = moec::tooling::storedWeights(shape, d, r);
      REQUIRE(w.w1Dims == shape.storedDims(shape.w1Dims()));
      REQUIRE(w.w1Scale.size() == size_t(L * (f.format == WeightFormat::Fp8Block128 ? 2 * 2
                                              : f.format == WeightFormat::Int8Channel
                                                  ? 2 * Is
                                                  : 2 * Is * (H / f.group) * (f.zero ? 2 : 1))));
      const int64_t codes1 = int64_t(w.w1.size()) / L, codes2 = int64_t(w.w2.size()) / L;
      const int64_t scales1 = int64_t(w.w1Scale.size()) / L,
                    scales2 = int64_t(w.w2Scale.size()) / L;
      int64_t wrong = 0;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t e = first + l;
        QuantizedMatrix m1{
            f.format, w.w1.data() + l * codes1, w.w1Scale.data() + l * scales1, 2 * Is, H, f.group,
            f.zero};
        QuantizedMatrix m2{
            f.format, w.w2.data() + l * codes2, w.w2Scale.data() + l * scales2, H, Is, f.group,
            f.zero};
        std::vector<float> v1(size_t(2 * Is * H)), v2(size_t(H * Is));
        dequantize(m1, 0, 2 * Is, 0, H, v1.data(), moec::DType::F32, H);
        dequantize(m2, 0, H, 0, Is, v2.data(), moec::DType::F32, Is);
        for (int64_t j = 0; j < 2 * Is; ++j) // shard row j: gate or up column of w1
          for (int64_t h = 0; h < H; ++h) {
            const int64_t col = j < Is ? t * Is + j : I + t * Is + (j - Is);
            wrong += v1[size_t(j * H + h)] != whole.w1[size_t((e * H + h) * 2 * I + col)];
          }
        for (int64_t h = 0; h < H; ++h)
          for (int64_t j = 0; j < Is; ++j)
            wrong += v2[size_t(h * Is + j)] != whole.w2[size_t((e * I + t * Is + j) * H + h)];
      }
      INFO("rank " << r);
      CHECK(wrong == 0);
    }
  }
}
