//===- Verify.cpp - A layer's outputs against the reference ---------------===//
//
// See LayerRun.h: verifyLayer, on every token or a sample, against the
// reference layer in double (runtime/tooling/Reference.h).
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/LayerRun.h"

#include "runtime/cpu/Element.h"
#include "runtime/cpu/Fp8.h"
#include "runtime/cpu/Quant.h"
#include "runtime/tooling/Reference.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>

namespace moec::tooling {

using format::DType;

namespace {

/// The max error of `out` against `want` (values at `index` in `out`).
OutputError compareOutput(const char *name, double tolerance, const std::vector<double> &want,
                          const std::function<float(size_t)> &out) {
  OutputError e;
  e.name = name;
  e.tolerance = tolerance;
  double scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double got = double(out(i));
    e.nonFinite += !std::isfinite(got);
    if (!std::isfinite(got) || !std::isfinite(want[i])) {
      // A NaN equals nothing; an infinity only the same infinity.
      e.mismatched += !(got == want[i]);
      continue;
    }
    e.maxAbs = std::max(e.maxAbs, std::abs(got - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  e.maxRel = scale > 0 ? e.maxAbs / scale : e.maxAbs;
  return e;
}

moec::reference::LayerShape referenceShape(const LayerData &d) {
  moec::reference::LayerShape shape;
  shape.ranks = uint32_t(d.ranks);
  shape.localExperts = uint32_t(d.experts / d.ranks);
  shape.hidden = d.hidden;
  shape.inter = d.inter;
  shape.topK = d.topK;
  shape.tokens = d.tokens;
  return shape;
}

/// Picks `count` distinct tokens of the group at random (all of them when
/// there are fewer), and for each expert they route to one random unit.
moec::reference::Sample pickSample(const LayerData &d, int64_t count, uint64_t seed) {
  moec::reference::Sample sample;
  const int64_t T = d.ranks * d.tokens;
  std::mt19937_64 rng(seed);
  if (count >= T) {
    for (int64_t g = 0; g < T; ++g)
      sample.tokens.push_back(g);
  } else {
    // Floyd's algorithm: `count` distinct values of 0..T-1.
    std::set<int64_t> chosen;
    for (int64_t j = T - count; j < T; ++j) {
      const int64_t t = std::uniform_int_distribution<int64_t>(0, j)(rng);
      chosen.insert(chosen.count(t) ? j : t);
    }
    sample.tokens.assign(chosen.begin(), chosen.end());
  }
  if (d.inter <= 0)
    return sample;
  std::set<int64_t> experts;
  for (int64_t g : sample.tokens)
    for (int64_t k = 0; k < d.topK; ++k)
      experts.insert(d.ids[size_t(g * d.topK + k)]);
  for (int64_t e : experts)
    sample.units.push_back({e, std::uniform_int_distribution<int64_t>(0, d.inter - 1)(rng)});
  return sample;
}

Status verifySample(const LayerData &d, const std::vector<float> &x, const VerifyOptions &options,
                    std::vector<OutputError> *errors, SampleSummary *summary) {
  namespace ref = moec::reference;
  const ref::LayerShape shape = referenceShape(d);
  ref::InputView<float> in;
  in.x = x.data();
  in.topkIds = d.ids.data();
  in.topkWeights = d.weights.data();
  in.w1 = d.w1.data();
  in.w2 = d.w2.data();
  in.dy = options.backward ? d.dy.data() : nullptr;
  for (int p = 0; p < 2; ++p)
    if (d.loraTargets >> p & 1) {
      in.loraA[p] = d.loraA[size_t(p)].data();
      in.loraB[p] = d.loraB[size_t(p)].data();
    }
  in.loraRank = d.loraRank;
  in.loraScale = d.loraScale;
  ref::Sample sample = pickSample(d, options.sampleTokens, options.seed);
  // A unit's weight gradients: the base's (a trained base), w1 adapter's
  // B columns and w2 adapter's A row.
  const bool unitGrads = !d.dw1.empty() || (d.loraTargets & 3) != 0;
  if (!options.backward || !unitGrads)
    sample.units.clear(); // no weight gradients to check
  ref::SampleOutputs<double> want;
  if (Status s = ref::sampled(shape, in, sample, &want, options.progress); !s)
    return s.withPrefix("reference: ");
  if (summary) {
    summary->tokens = int64_t(sample.tokens.size());
    summary->units = int64_t(sample.units.size());
    if (options.backward)
      for (const LoraTensor &t : loraTensors(d.loraTargets, true))
        if ((t.p == 0) != t.b) // w1's A and w2's B: every unit of each row
          summary->unsampled.push_back(t.name());
  }
  const double tolerance = options.bf16 ? 5e-2 : 1e-4;
  const int64_t H = d.hidden, K = d.topK, I = d.inter;
  const auto perToken = [&](const std::vector<float> &out, int64_t width) {
    return [&out, &sample, width](size_t i) {
      return out[size_t(sample.tokens[i / size_t(width)] * width) + i % size_t(width)];
    };
  };
  errors->push_back(compareOutput("y", tolerance, want.y, perToken(d.y, H)));
  if (!options.backward)
    return Status::success();
  errors->push_back(compareOutput("dx", tolerance, want.dx, perToken(d.dx, H)));
  errors->push_back(compareOutput("dtopk_weights", tolerance, want.dtopk, perToken(d.dtopk, K)));
  if (sample.units.empty())
    return Status::success();
  if (!d.dw1.empty()) { // a frozen base has none
    errors->push_back(compareOutput("dw1", tolerance, want.dw1, [&](size_t i) {
      const auto [e, unit] = sample.units[i / size_t(2 * H)];
      const int64_t h = int64_t(i % size_t(2 * H)) / 2, column = unit + (i % 2 ? I : 0);
      return d.dw1[size_t((e * H + h) * 2 * I + column)];
    }));
    errors->push_back(compareOutput("dw2", tolerance, want.dw2, [&](size_t i) {
      const auto [e, unit] = sample.units[i / size_t(H)];
      return d.dw2[size_t((e * I + unit) * H) + i % size_t(H)];
    }));
  }
  const int64_t r = d.loraRank;
  if (d.loraTargets & 1) // dlora_b1 [E, r, 2I]: columns unit and I + unit
    errors->push_back(compareOutput("dlora_b1", tolerance, want.dloraB1, [&](size_t i) {
      const auto [e, unit] = sample.units[i / size_t(2 * r)];
      const int64_t q = int64_t(i % size_t(2 * r)) / 2, column = unit + (i % 2 ? I : 0);
      return d.dLoraB[0][size_t((e * r + q) * 2 * I + column)];
    }));
  if (d.loraTargets & 2) // dlora_a2 [E, I, r]: row unit
    errors->push_back(compareOutput("dlora_a2", tolerance, want.dloraA2, [&](size_t i) {
      const auto [e, unit] = sample.units[i / size_t(r)];
      return d.dLoraA[1][size_t((e * I + unit) * r) + i % size_t(r)];
    }));
  return Status::success();
}

} // namespace

double verifyBytes(const rt::LayerShape &shape, bool backward) {
  const double R = shape.ranks, K = double(shape.topK),
               S = double(shape.rowCapacity) / std::max(1.0, K), E = double(shape.experts()),
               H = double(shape.hidden), I = double(shape.inter);
  // Copies of the inputs and the outputs, in double.
  double values = R * S * H * (backward ? 2 : 1) + 2 * R * S * K + 3 * E * H * I;
  values += R * S * H * 2; // y and its joined copy
  // Per dispatched row: X, Y, A, Z (H + 2I + I + H) and its source (3 int64).
  values += R * S * K * (2 * H + 3 * I + 3);
  if (backward) {
    values += R * S * H * 2 + R * S * K * 2 + 3 * E * H * I; // dx, dtopk (joined too), dw1, dw2
    // The largest expert's dZ, dA, dY: at most every row.
    values += R * S * K * (H + 3 * I);
  }
  return 8 * values;
}

/// x as the experts of an FP8 dispatch see it: each token's row quantized
/// (e4m3 codes, an fp32 scale per 128 values) and dequantized to the
/// compute dtype.
std::vector<float> fp8RoundTrip(const LayerData &d, bool bf16) {
  const int64_t rows = int64_t(d.x.size()) / std::max<int64_t>(1, d.hidden), H = d.hidden;
  const DType act = bf16 ? DType::BF16 : DType::F32;
  std::vector<uint8_t> codes(size_t(rows * fp8RowBytes(H)));
  cpu::quantizeRows(d.x.data(), DType::F32, H, codes.data(), fp8RowBytes(H), 0, rows, H);
  std::vector<char> back(size_t(rows * H) * dtypeSize(act));
  cpu::dequantizeRows(codes.data(), fp8RowBytes(H), back.data(), act, H, 0, rows, H);
  std::vector<float> x(size_t(rows * H));
  cpu::loadFloats(back.data(), act, x.data(), x.size());
  return x;
}

Status verifyLayer(const LayerData &d, const VerifyOptions &options,
                   std::vector<OutputError> *errors, SampleSummary *summary) {
  std::vector<float> rounded;
  if (options.fp8Dispatch)
    rounded = fp8RoundTrip(d, options.bf16);
  const std::vector<float> &x = options.fp8Dispatch ? rounded : d.x;
  if (options.sampleTokens > 0)
    return verifySample(d, x, options, errors, summary);
  namespace ref = moec::reference;
  const ref::LayerShape shape = referenceShape(d);
  const bool backward = options.backward;
  const int64_t S = d.tokens, K = d.topK, H = d.hidden;
  std::vector<ref::RankInputs<double>> inputs(size_t(d.ranks));
  std::vector<std::vector<double>> dy(size_t(d.ranks));
  for (int64_t r = 0; r < d.ranks; ++r) {
    inputs[size_t(r)].x.assign(x.begin() + r * S * H, x.begin() + (r + 1) * S * H);
    inputs[size_t(r)].topkIds.assign(d.ids.begin() + r * S * K, d.ids.begin() + (r + 1) * S * K);
    inputs[size_t(r)].topkWeights.assign(d.weights.begin() + r * S * K,
                                         d.weights.begin() + (r + 1) * S * K);
    if (backward)
      dy[size_t(r)].assign(d.dy.begin() + r * S * H, d.dy.begin() + (r + 1) * S * H);
  }
  ref::Weights<double> weights{std::vector<double>(d.w1.begin(), d.w1.end()),
                               std::vector<double>(d.w2.begin(), d.w2.end())};
  // LoRA adapters: the layer computes X W + s (X A) B, which is X (W + s A B):
  // the reference runs on those weights, and the gradient G of such a
  // weight gives the adapters' (dA = s G B^T, dB = s A^T G).
  const int64_t E = d.experts, r = d.loraRank;
  const double scale = d.loraScale;
  // Projection p's weight is K x N: w1 H x 2I, w2 I x H.
  const auto rowsOf = [&](int p) { return p == 0 ? H : d.inter; };
  const auto colsOf = [&](int p) { return p == 0 ? 2 * d.inter : H; };
  for (int p = 0; p < 2; ++p) {
    if (!(d.loraTargets >> p & 1))
      continue;
    std::vector<double> &w = p == 0 ? weights.w1 : weights.w2;
    const int64_t k = rowsOf(p), n = colsOf(p);
    const std::vector<float> &a = d.loraA[size_t(p)], &b = d.loraB[size_t(p)];
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0;
          for (int64_t q = 0; q < r; ++q)
            sum += double(a[size_t((e * k + i) * r + q)]) * double(b[size_t((e * r + q) * n + j)]);
          w[size_t((e * k + i) * n + j)] += scale * sum;
        }
  }
  // The forward pass is about a third of the work with backward.
  const double forwardShare = backward ? 1.0 / 3 : 1.0;
  ref::Progress progress;
  if (options.progress)
    progress = [&](double done) { options.progress(done * forwardShare); };
  ref::Forward<double> fwd;
  if (Status s = ref::forward(shape, inputs, weights, &fwd, progress); !s)
    return s.withPrefix("reference: ");
  const double tolerance = options.bf16 ? 5e-2 : 1e-4;
  const auto compare = [&](const char *name, const std::vector<float> &out,
                           const std::vector<double> &want) {
    errors->push_back(compareOutput(name, tolerance, want, [&out](size_t i) { return out[i]; }));
  };
  const auto joined = [](const std::vector<std::vector<double>> &parts) {
    std::vector<double> all;
    for (const auto &p : parts)
      all.insert(all.end(), p.begin(), p.end());
    return all;
  };
  compare("y", d.y, joined(fwd.y));
  if (!backward)
    return Status::success();
  if (options.progress)
    progress = [&](double done) { options.progress(forwardShare + done * (1 - forwardShare)); };
  ref::Backward<double> bwd;
  if (Status s = ref::backward(shape, inputs, weights, fwd, dy, &bwd, progress); !s)
    return s.withPrefix("reference: ");
  compare("dx", d.dx, joined(bwd.dx));
  compare("dtopk_weights", d.dtopk, joined(bwd.dtopkWeights));
  if (!d.dw1.empty()) { // a frozen layer's backward has none
    compare("dw1", d.dw1, bwd.dw1);
    compare("dw2", d.dw2, bwd.dw2);
  }
  for (const LoraTensor &t : loraTensors(d.loraTargets, true)) {
    const std::vector<double> &g = t.p == 0 ? bwd.dw1 : bwd.dw2;
    const std::vector<float> &a = d.loraA[size_t(t.p)], &b = d.loraB[size_t(t.p)];
    const int64_t k = rowsOf(t.p), n = colsOf(t.p);
    std::vector<double> want(size_t(E) * size_t(t.b ? r * n : k * r), 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const double gij = scale * g[size_t((e * k + i) * n + j)];
          for (int64_t q = 0; q < r; ++q)
            if (t.b) // dB[q, j] += s A[i, q] G[i, j]
              want[size_t((e * r + q) * n + j)] += double(a[size_t((e * k + i) * r + q)]) * gij;
            else // dA[i, q] += s G[i, j] B[q, j]
              want[size_t((e * k + i) * r + q)] += gij * double(b[size_t((e * r + q) * n + j)]);
        }
    const std::string name = t.name();
    errors->push_back(compareOutput(name.c_str(), tolerance, want,
                                    [&out = t.of(d)](size_t i) { return out[i]; }));
  }
  return Status::success();
}

} // namespace moec::tooling
