//===- RuntimeConformanceTest.cpp - The runtime against the reference -----===//
//
// The conformance suite every fabric (and any later backend) passes
// unchanged. Compiles the forward and backward graphs for a matrix of small
// configs (RuntimeCompile.h: in process for runtime_test; through the moec
// binary for runtime_tsan_test, which builds this file and the runtime with
// ThreadSanitizer), runs them through the runtime API on the fabric of
// TestFabric.h (in-process ranks, or one rank per MPI process under mpirun),
// and compares every output of the ranks this process runs with the
// plain-loop reference (runtime/tooling/Reference.h, in double). Also:
// determinism across runs, worker counts and schedules; submit and wait; bad
// input that must be refused with outputs untouched, on every rank; the C
// API (in process).
//
// Under MPI every process runs the same cases in the same order (contexts
// and passes are collective), each binds and checks its own rank, and a case
// for another number of ranks than the job's is skipped.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Runtime.h"
#include "runtime/backend/Registry.h"
#include "runtime/cpu/Element.h"
#include "runtime/cpu/Gmm.h"
#include "runtime/cpu/Quant.h"
#include "runtime/cpu/Tile.h"
#include "runtime/tooling/Reference.h"
#include "tests/conformance/RuntimeCompile.h"
#include "tests/conformance/TestFabric.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <unistd.h>

namespace {

using moec::Status;
using moec::format::DType;
using moec::rt::Context;
using moec::rt::ContextOptions;
using moec::rt::makeTensor;
using moec::rt::Program;
using moec::rt::Schedule;
namespace ref = moec::reference;

enum class Routing { Uniform, Skewed, ZeroExpert, SilentRank };

/// The event granularity a case is compiled with (moec compile --granularity).
enum class Granularity { PerExpert, PerTileRange };

const char *granularityName(Granularity g) {
  return g == Granularity::PerExpert ? "per-expert" : "per-tile-range";
}

const char *routingName(Routing r) {
  switch (r) {
  case Routing::Uniform: return "uniform";
  case Routing::Skewed: return "skewed";
  case Routing::ZeroExpert: return "zero-token expert";
  case Routing::SilentRank: return "silent rank";
  }
  return "?";
}

/// One configuration of the layer.
struct Case {
  uint32_t ranks = 2, localExperts = 2, topK = 2;
  int64_t seq = 128, hidden = 32, inter = 16;
  bool bf16 = false;
  Granularity granularity = Granularity::PerTileRange;
  Routing routing = Routing::Uniform;
  double capacityFactor = 0; ///< 0: the config's default
  bool fp8Dispatch = false;  ///< "dispatch_dtype": "fp8_e4m3"
  uint32_t tp = 1;           ///< TP ranks of each of the `ranks` EP ranks
  int64_t weightGroup = 0;   ///< "weight_group" (int4 weights' group); 0: unset
  int64_t loraRank = 0;      ///< "lora_rank" (graphs with adapters); 0: unset
  int64_t loraAlpha = 0;     ///< "lora_alpha"; 0: unset
  uint32_t experts() const { return ranks * localExperts; }
  std::string describe() const {
    return "R=" + std::to_string(ranks) + " L=" + std::to_string(localExperts) +
           " K=" + std::to_string(topK) + (bf16 ? " bf16" : " f32") + " " +
           granularityName(granularity) + " " + routingName(routing);
  }
};

/// A file of this process (the processes of an MPI job share TEST_TMPDIR).
std::string tempPath(const std::string &name) {
  const char *dir = std::getenv("TEST_TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/" + std::to_string(getpid()) + "_" + name;
}

/// True when the fabric under test runs a case of `ranks` ranks.
bool runs(uint32_t ranks) {
  bool yes = false;
  moec::test::testFabric(ranks, &yes);
  return yes;
}

/// The ranks of the fixed-size cases: `preferred`, or the job's size under
/// MPI.
uint32_t groupSize(uint32_t preferred) {
  bool yes = false;
  std::shared_ptr<moec::comm::Fabric> fabric = moec::test::testFabric(preferred, &yes);
  return fabric ? fabric->ranks() : preferred;
}

/// The backend under test: MOEC_TEST_BACKEND=cuda runs the suite's layers
/// on the GPU (tests/cuda/run_gpu.sh); the default is the CPU.
moec::backend::Kind testBackend() {
  const char *name = std::getenv("MOEC_TEST_BACKEND");
  const moec::backend::BackendInfo *b = moec::backend::findBackend(name ? name : "cpu");
  REQUIRE(b != nullptr); // MOEC_TEST_BACKEND names a backend of this build
  return b->kind;
}

/// Whether the backend under test has `feature`: a case of a feature it
/// lacks (the registry says which, Registry.h) checks what it can and skips
/// the rest.
bool testBackendHas(moec::backend::Feature feature) {
  return moec::backend::findBackend(testBackend())->has(feature);
}

/// Context::create on the fabric and backend under test.
Status makeContext(std::shared_ptr<const Program> fwd, std::shared_ptr<const Program> bwd,
                   ContextOptions options, std::unique_ptr<Context> *out) {
  bool yes = false;
  options.fabric = moec::test::testFabric(fwd->shape().ranks, &yes);
  options.backend = testBackend();
  return Context::create(std::move(fwd), std::move(bwd), options, out);
}

/// Cases checked against the reference on this fabric.
int casesRun = 0;

/// Compiles both graphs of `c` (cached by config).
std::pair<std::shared_ptr<const Program>, std::shared_ptr<const Program>>
compile(const Case &c, const char *firstGraph = "graphs/moe_ffn_fwd.json",
        const char *secondGraph = "graphs/moe_ffn_bwd.json") {
  static std::map<std::string, std::pair<std::shared_ptr<const Program>,
                                         std::shared_ptr<const Program>>>
      cache;
  const std::string key = std::to_string(c.ranks) + "_" + std::to_string(c.localExperts) + "_" +
                          std::to_string(c.seq) + "_" + std::to_string(c.topK) + "_" +
                          std::to_string(c.hidden) + "_" + std::to_string(c.inter) +
                          (c.bf16 ? "_bf16_" : "_f32_") + granularityName(c.granularity) + "_" +
                          std::to_string(c.capacityFactor) + (c.fp8Dispatch ? "_fp8" : "") + "_tp" +
                          std::to_string(c.tp) + "_g" + std::to_string(c.weightGroup) + "_r" +
                          std::to_string(c.loraRank) + "_a" + std::to_string(c.loraAlpha);
  const std::string graphKey = key + "_" + firstGraph + "_" + secondGraph;
  if (auto it = cache.find(graphKey); it != cache.end())
    return it->second;
  const std::string config = tempPath("runtime_" + key + ".json");
  {
    std::ofstream out(config);
    out << "{\"name\": \"case\", \"hidden_size\": " << c.hidden
        << ", \"intermediate_size\": " << c.inter << ", \"num_experts\": " << c.experts()
        << ", \"top_k\": " << c.topK << ", \"ep\": " << c.ranks
        << ", \"tp\": " << c.tp << ", \"seq_size\": " << c.seq << ", \"dtype\": \""
        << (c.bf16 ? "bf16" : "fp32") << "\", \"num_cube_cores\": 2, \"num_vector_cores\": 3";
    if (c.capacityFactor > 0)
      out << ", \"capacity_factor\": " << c.capacityFactor;
    if (c.fp8Dispatch)
      out << ", \"dispatch_dtype\": \"fp8_e4m3\"";
    if (c.weightGroup > 0)
      out << ", \"weight_group\": " << c.weightGroup;
    if (c.loraRank > 0)
      out << ", \"lora_rank\": " << c.loraRank << ", \"lora_alpha\": " << c.loraAlpha;
    out << "}";
  }
  std::shared_ptr<const Program> programs[2];
  const char *graphs[2] = {firstGraph, secondGraph};
  for (int i = 0; i < 2; ++i) {
    moec::format::TaskProgram program;
    Status compiled =
        moec::test::compileLayer(graphs[i], config, granularityName(c.granularity), &program);
    INFO(compiled.message());
    REQUIRE(compiled.ok());
    Status created = Program::create(std::move(program), &programs[i]);
    INFO(created.message());
    REQUIRE(created.ok());
  }
  return cache[graphKey] = {programs[0], programs[1]};
}

/// Inputs of all ranks, in float (bf16 cases hold bf16-representable values).
struct Inputs {
  std::vector<int64_t> tokens;             // per rank
  std::vector<std::vector<float>> x, dy;   // per rank [S, H]
  std::vector<std::vector<int64_t>> ids;   // per rank [S, K]
  std::vector<std::vector<float>> weights; // per rank [S, K]
  std::vector<float> w1, w2;               // [E, H, 2I], [E, I, H]
};

Inputs makeInputs(const Case &c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  const auto value = [&](float scale) {
    const float v = uni(rng) * scale;
    return c.bf16 ? moec::cpu::roundToBf16(v) : v;
  };
  const uint32_t R = c.ranks, E = c.experts(), K = c.topK;
  const int64_t H = c.hidden, I = c.inter;
  Inputs in;
  for (uint32_t r = 0; r < R; ++r) {
    const int64_t S = (c.routing == Routing::SilentRank && r == R - 1) ? 0 : c.seq;
    in.tokens.push_back(S);
    std::vector<float> x(size_t(S * H)), dy(size_t(S * H)), w(size_t(S * K));
    std::vector<int64_t> ids(size_t(S * K));
    for (float &v : x)
      v = value(1.0f);
    for (float &v : dy)
      v = value(1.0f);
    for (int64_t t = 0; t < S; ++t) {
      std::vector<int64_t> experts(E);
      std::iota(experts.begin(), experts.end(), 0);
      if (c.routing == Routing::ZeroExpert)
        experts.pop_back(); // the last expert gets nothing
      std::shuffle(experts.begin(), experts.end(), rng);
      if (c.routing == Routing::Skewed && rng() % 4 != 0) {
        // Three tokens in four pick expert 0 first.
        std::swap(*std::find(experts.begin(), experts.end(), 0), experts[0]);
      }
      for (uint32_t k = 0; k < K; ++k) {
        ids[size_t(t * K + k)] = experts[k];
        w[size_t(t * K + k)] = (uni(rng) + 1.5f) / 2.5f;
      }
    }
    in.x.push_back(x);
    in.dy.push_back(dy);
    in.ids.push_back(ids);
    in.weights.push_back(w);
  }
  in.w1.resize(size_t(E * H * 2 * I));
  in.w2.resize(size_t(E * I * H));
  for (float &v : in.w1)
    v = value(1.0f / std::sqrt(float(H)));
  for (float &v : in.w2)
    v = value(1.0f / std::sqrt(float(I)));
  return in;
}

/// Storage of a float vector in the runtime's activation dtype.
struct Stored {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  bool isBf16 = false;
  Stored() = default;
  Stored(const std::vector<float> &values, bool asBf16) : isBf16(asBf16) {
    if (asBf16) {
      bf16.resize(values.size());
      moec::cpu::floatToBf16(values.data(), bf16.data(), values.size());
    } else {
      f32 = values;
    }
  }
  Stored(size_t count, bool asBf16, float fill) : isBf16(asBf16) {
    if (asBf16)
      bf16.assign(count, moec::cpu::floatToBf16(fill));
    else
      f32.assign(count, fill);
  }
  void *data() { return isBf16 ? static_cast<void *>(bf16.data()) : f32.data(); }
  DType dtype() const { return isBf16 ? DType::BF16 : DType::F32; }
  std::vector<float> values() const {
    if (!isBf16)
      return f32;
    std::vector<float> out(bf16.size());
    moec::cpu::bf16ToFloat(bf16.data(), out.data(), bf16.size());
    return out;
  }
  bool operator==(const Stored &o) const { return f32 == o.f32 && bf16 == o.bf16; }
};

/// The runtime's tensors for all ranks.
struct Run {
  std::vector<Stored> x, dy, y, dx, w1, w2, dw1, dw2;
  std::vector<std::vector<float>> weights, dtopk;
  std::vector<std::vector<int64_t>> ids;

  bool sameOutputs(const Run &o) const {
    return y == o.y && dx == o.dx && dw1 == o.dw1 && dw2 == o.dw2 && dtopk == o.dtopk;
  }
};

Run prepare(const Case &c, const Inputs &in, const moec::rt::LayerShape &shape) {
  Run run;
  const int64_t H = c.hidden, I = c.inter, L = c.localExperts;
  const bool bf16 = c.bf16;
  const bool gradBf16 = shape.weightGrads == DType::BF16;
  for (uint32_t r = 0; r < c.ranks; ++r) {
    const int64_t S = in.tokens[r];
    run.x.emplace_back(in.x[r], bf16);
    run.dy.emplace_back(in.dy[r], bf16);
    run.y.emplace_back(size_t(S * H), bf16, -7.0f);
    run.dx.emplace_back(size_t(S * H), bf16, -7.0f);
    run.w1.emplace_back(std::vector<float>(in.w1.begin() + r * L * H * 2 * I,
                                           in.w1.begin() + (r + 1) * L * H * 2 * I),
                        bf16);
    run.w2.emplace_back(std::vector<float>(in.w2.begin() + r * L * I * H,
                                           in.w2.begin() + (r + 1) * L * I * H),
                        bf16);
    run.dw1.emplace_back(size_t(L * H * 2 * I), gradBf16, -7.0f);
    run.dw2.emplace_back(size_t(L * I * H), gradBf16, -7.0f);
    run.dtopk.emplace_back(size_t(S * c.topK), -7.0f);
    run.weights.push_back(in.weights[r]);
    run.ids.push_back(in.ids[r]);
  }
  return run;
}

/// Binds the tensors of the ranks this process runs.
Status bindAll(Context &ctx, const Case &c, Run &run) {
  const int64_t H = c.hidden, I = c.inter, L = c.localExperts, K = c.topK;
  for (uint32_t r = ctx.firstLocalRank(); r < ctx.firstLocalRank() + ctx.localRanks(); ++r) {
    const int64_t S = int64_t(run.ids[r].size()) / K;
    const std::pair<const char *, moec::rt::Tensor> tensors[] = {
        {"x", makeTensor(run.x[r].data(), run.x[r].dtype(), {S, H})},
        {"y", makeTensor(run.y[r].data(), run.y[r].dtype(), {S, H})},
        {"w1", makeTensor(run.w1[r].data(), run.w1[r].dtype(), {L, H, 2 * I})},
        {"w2", makeTensor(run.w2[r].data(), run.w2[r].dtype(), {L, I, H})},
        {"dy", makeTensor(run.dy[r].data(), run.dy[r].dtype(), {S, H})},
        {"dx", makeTensor(run.dx[r].data(), run.dx[r].dtype(), {S, H})},
        {"dtopk_weights", makeTensor(run.dtopk[r].data(), DType::F32, {S, K})},
        {"dw1", makeTensor(run.dw1[r].data(), run.dw1[r].dtype(), {L, H, 2 * I})},
        {"dw2", makeTensor(run.dw2[r].data(), run.dw2[r].dtype(), {L, I, H})},
    };
    for (const auto &[name, tensor] : tensors)
      if (Status s = ctx.bind(r, name, tensor); !s)
        return s;
    if (Status s = ctx.setRouting(r, makeTensor(run.ids[r].data(), DType::I64, {S, K}),
                                  makeTensor(run.weights[r].data(), DType::F32, {S, K}));
        !s)
      return s;
  }
  return Status::success();
}

/// max |a - b| / max(max |b|, 1e-3): an error relative to the output's scale.
double relError(const std::vector<float> &a, const std::vector<double> &b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 1e-3;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

/// Runs `c` through the runtime and the reference and compares.
void checkAgainstReference(const Case &c, uint32_t seed, uint32_t workers = 2,
                           int passes = 1) {
  INFO(c.describe() << " on the " << moec::test::testFabricName() << " fabric");
  if (!runs(c.ranks))
    return;
  ++casesRun;
  auto [fwd, bwd] = compile(c);
  const Inputs in = makeInputs(c, seed);

  ref::LayerShape shape;
  shape.ranks = c.ranks;
  shape.localExperts = c.localExperts;
  shape.hidden = c.hidden;
  shape.inter = c.inter;
  shape.topK = c.topK;
  shape.tokens = c.seq;

  ContextOptions options;
  options.workers = workers;
  options.timeoutSeconds = 20;
  std::unique_ptr<Context> ctx;
  Status created = makeContext(fwd, bwd, options, &ctx);
  INFO(created.message());
  REQUIRE(created.ok());
  Run run = prepare(c, in, bwd->shape());
  Status bound = bindAll(*ctx, c, run);
  INFO(bound.message());
  REQUIRE(bound.ok());
  Run first;
  for (int pass = 0; pass < passes; ++pass) {
    Status f = ctx->forward();
    INFO("forward: " << f.message());
    REQUIRE(f.ok());
    Status b = ctx->backward();
    INFO("backward: " << b.message());
    REQUIRE(b.ok());
    if (pass == 0)
      first = run;
    else
      REQUIRE(run.sameOutputs(first)); // bitwise, pass after pass
  }

  // The reference, in double, on the same (rounded) inputs. It has S tokens
  // on every rank; a silent rank's are zeros with zero weights and zero dy,
  // which add nothing to any other rank's outputs or to dw1, dw2.
  std::vector<ref::RankInputs<double>> rin(c.ranks);
  std::vector<std::vector<double>> rdy(c.ranks);
  const int64_t S = c.seq, H = c.hidden, I = c.inter, K = c.topK, L = c.localExperts;
  for (uint32_t r = 0; r < c.ranks; ++r) {
    const bool silent = in.tokens[r] == 0;
    rin[r].x.assign(size_t(S * H), 0.0);
    rin[r].topkIds.resize(size_t(S * K));
    rin[r].topkWeights.assign(size_t(S * K), 0.0);
    rdy[r].assign(size_t(S * H), 0.0);
    for (int64_t i = 0; i < S * K; ++i)
      rin[r].topkIds[size_t(i)] = silent ? (i % K) : in.ids[r][size_t(i)];
    if (silent)
      continue;
    std::copy(in.x[r].begin(), in.x[r].end(), rin[r].x.begin());
    std::copy(in.weights[r].begin(), in.weights[r].end(), rin[r].topkWeights.begin());
    std::copy(in.dy[r].begin(), in.dy[r].end(), rdy[r].begin());
  }
  ref::Weights<double> rw{std::vector<double>(in.w1.begin(), in.w1.end()),
                          std::vector<double>(in.w2.begin(), in.w2.end())};
  ref::Forward<double> rf;
  REQUIRE(ref::forward(shape, rin, rw, &rf).ok());
  ref::Backward<double> rb;
  REQUIRE(ref::backward(shape, rin, rw, rf, rdy, &rb).ok());

  const double tol = c.bf16 ? 3e-2 : 2e-5;
  for (uint32_t r = 0; r < c.ranks; ++r) {
    INFO("rank " << r);
    if (in.tokens[r] == 0 || !ctx->fabric().isLocal(r))
      continue;
    CHECK(relError(run.y[r].values(), rf.y[r]) < tol);
    CHECK(relError(run.dx[r].values(), rb.dx[r]) < tol);
    CHECK(relError(run.dtopk[r], rb.dtopkWeights[r]) < tol);
    const auto slice = [&](const std::vector<double> &all, int64_t per) {
      return std::vector<double>(all.begin() + r * L * per, all.begin() + (r + 1) * L * per);
    };
    CHECK(relError(run.dw1[r].values(), slice(rb.dw1, H * 2 * I)) < tol);
    CHECK(relError(run.dw2[r].values(), slice(rb.dw2, I * H)) < tol);
  }
}

} // namespace

TEST_CASE("runtime matches the reference over ranks, experts and top-k", "[runtime][gpu]") {
  const int before = casesRun;
  for (uint32_t R : {1u, 2u, 3u, 4u})
    for (uint32_t L : {1u, 2u, 4u, 8u})
      for (uint32_t K : {1u, 2u, 8u}) {
        if (K > R * L || (R == 4 && L == 8) || (R == 3 && L > 2))
          continue;
        Case c;
        c.ranks = R;
        c.localExperts = L;
        c.topK = K;
        checkAgainstReference(c, 100 * R + 10 * L + K);
      }
  CHECK(casesRun > before); // every fabric size 1..4 has cases here
}

TEST_CASE("runtime matches the reference on awkward shapes", "[runtime][gpu]") {
  // Token counts, hidden and intermediate sizes that are no multiple of any
  // split value or tile (1, 37, 1000 tokens; H, I not multiples of 16): the
  // last tiles are smaller. E = 3 ranks x 3 experts; top-1 and top-E.
  struct Shape {
    uint32_t R, L, K;
    int64_t S, H, I;
  };
  const Shape shapes[] = {
      {1, 3, 1, 1, 20, 12},    {2, 2, 2, 37, 50, 24},   {3, 3, 1, 37, 18, 10},
      {3, 3, 9, 37, 18, 10},   {2, 2, 4, 1000, 24, 20}, {1, 2, 2, 37, 100, 96},
      {3, 1, 3, 1, 33, 17},    {2, 3, 6, 5, 40, 14},    {4, 1, 2, 37, 20, 12},
  };
  const int before = casesRun;
  for (const Shape &shape : shapes)
    for (bool bf16 : {false, true})
      for (auto g : {Granularity::PerTileRange, Granularity::PerExpert}) {
        if (bf16 && g == Granularity::PerExpert && shape.S == 1000)
          continue; // the largest case once is enough
        Case c;
        c.ranks = shape.R;
        c.localExperts = shape.L;
        c.topK = shape.K;
        c.seq = shape.S;
        c.hidden = shape.H;
        c.inter = shape.I;
        c.bf16 = bf16;
        c.granularity = g;
        c.capacityFactor = 2 * shape.R; // any routing of these small layers fits
        checkAgainstReference(c, uint32_t(shape.S * 7 + shape.H));
      }
  CHECK(casesRun > before);
}

TEST_CASE("runtime matches the reference in bf16 and with per-expert events", "[runtime][gpu]") {
  for (bool bf16 : {false, true})
    for (auto g : {Granularity::PerExpert, Granularity::PerTileRange})
      for (uint32_t R : {1u, 2u, 3u, 4u}) {
        Case c;
        c.ranks = R;
        c.localExperts = 4 / R > 0 ? 4 / R + 1 : 1;
        c.topK = 2;
        c.bf16 = bf16;
        c.granularity = g;
        checkAgainstReference(c, 7 + R);
      }
  Case big;
  big.ranks = 2;
  big.localExperts = 4;
  big.topK = 8;
  big.bf16 = true;
  checkAgainstReference(big, 3);
}

TEST_CASE("runtime handles skew, empty experts and silent ranks", "[runtime][gpu]") {
  for (Routing routing : {Routing::Skewed, Routing::ZeroExpert, Routing::SilentRank}) {
    for (uint32_t R : {1u, 2u, 3u, 4u}) {
      if (routing == Routing::SilentRank && R == 1)
        continue;
      Case c;
      c.ranks = R;
      c.localExperts = 2;
      c.topK = R; // skew to expert 0 stays within a rank's S*K rows
      c.routing = routing;
      checkAgainstReference(c, 11 * R);
    }
  }
}

TEST_CASE("runtime is deterministic across passes, workers and schedules", "[runtime]") {
  Case c;
  c.ranks = groupSize(2);
  c.localExperts = 3;
  c.topK = 2;
  c.routing = Routing::Skewed;
  c.capacityFactor = 4; // skew to expert 0 from up to 4 ranks
  checkAgainstReference(c, 5, 2, 3); // three passes of one context, bitwise equal

  auto [fwd, bwd] = compile(c);
  const Inputs in = makeInputs(c, 99);
  std::vector<Run> runs;
  for (auto [workers, schedule] : {std::pair{1u, Schedule::Fused}, std::pair{3u, Schedule::Fused},
                                   std::pair{2u, Schedule::OpByOp}}) {
    ContextOptions options;
    options.workers = workers;
    options.schedule = schedule;
    std::unique_ptr<Context> ctx;
    REQUIRE(makeContext(fwd, bwd, options, &ctx).ok());
    Run run = prepare(c, in, bwd->shape());
    REQUIRE(bindAll(*ctx, c, run).ok());
    INFO(workers << " workers, " << (schedule == Schedule::Fused ? "fused" : "op by op"));
    const Status f = ctx->forward();
    INFO("forward: " << f.message());
    REQUIRE(f.ok());
    const Status b = ctx->backward();
    INFO("backward: " << b.message());
    REQUIRE(b.ok());
    runs.push_back(std::move(run));
  }
  CHECK(runs[0].sameOutputs(runs[1]));
  CHECK(runs[0].sameOutputs(runs[2]));
}

TEST_CASE("a routing of 65536 rows is laid out on threads, and each new routing replaces the "
          "last",
          "[runtime][gpu]") {
  // 2 ranks x 4096 tokens x top-8: the runtime lays out the ranks' routings
  // on the process's thread team (in process), into the storage of the routing
  // before last. Three passes of one context give the same bits, and so
  // do routings A, B, A in one context against fresh contexts.
  Case c;
  c.ranks = 2;
  c.localExperts = 4;
  c.topK = 8;
  c.seq = 4096;
  c.hidden = 16;
  c.inter = 8;
  checkAgainstReference(c, 41, 2, 3);
  if (!runs(c.ranks))
    return;
  auto [fwd, bwd] = compile(c);
  const Inputs a = makeInputs(c, 42), b = makeInputs(c, 43);
  const auto fresh = [&, fwd = fwd, bwd = bwd](const Inputs &in) {
    std::unique_ptr<Context> ctx;
    REQUIRE(makeContext(fwd, bwd, ContextOptions(), &ctx).ok());
    Run run = prepare(c, in, bwd->shape());
    REQUIRE(bindAll(*ctx, c, run).ok());
    REQUIRE(ctx->forward().ok());
    REQUIRE(ctx->backward().ok());
    return run;
  };
  const Run wantA = fresh(a), wantB = fresh(b);
  CHECK_FALSE(wantA.sameOutputs(wantB));
  std::unique_ptr<Context> ctx;
  REQUIRE(makeContext(fwd, bwd, ContextOptions(), &ctx).ok());
  for (const auto &[in, want, name] : {std::tuple{&a, &wantA, "A"}, std::tuple{&b, &wantB, "B"},
                                       std::tuple{&a, &wantA, "A again"}}) {
    INFO("routing " << name);
    Run run = prepare(c, *in, bwd->shape());
    REQUIRE(bindAll(*ctx, c, run).ok());
    REQUIRE(ctx->forward().ok());
    REQUIRE(ctx->backward().ok());
    CHECK(run.sameOutputs(*want));
  }
}

TEST_CASE("backward keeps slots in the forward's dead ones; a second backward gives the "
          "same bits", "[runtime]") {
  Case c;
  c.ranks = groupSize(2);
  c.localExperts = 3;
  c.topK = 2;
  auto [fwd, bwd] = compile(c);
  const Inputs in = makeInputs(c, 7);
  ContextOptions options;
  options.workers = 2;
  std::unique_ptr<Context> ctx;
  REQUIRE(makeContext(fwd, bwd, options, &ctx).ok());
  Run run = prepare(c, in, bwd->shape());
  REQUIRE(bindAll(*ctx, c, run).ok());
  REQUIRE(ctx->forward().ok());
  REQUIRE(ctx->backward().ok());
  const Run first = run;
  // A second backward of the same forward (autograd's retain_graph): what it
  // reads of the forward pass must have survived the first one.
  REQUIRE(ctx->backward().ok());
  CHECK(run.sameOutputs(first));
  // And a new forward and backward after that: the forward's slots the
  // backward used are rewritten before they are read.
  REQUIRE(ctx->forward().ok());
  REQUIRE(ctx->backward().ok());
  CHECK(run.sameOutputs(first));

  if (!testBackendHas(moec::backend::Feature::SlotItems))
    return;
  const std::vector<moec::rt::WorkspaceSlot> slots = ctx->workspace();
  size_t borrowed = 0, own = 0;
  for (const moec::rt::WorkspaceSlot &w : slots) {
    INFO(w.pass << " " << w.name);
    CHECK(w.resident <= w.bytes + 4096 * ctx->localRanks());
    if (w.borrowed) {
      CHECK(std::string(w.pass) == "backward");
      CHECK_FALSE(w.window);
      borrowed += w.bytes;
    } else {
      own += w.bytes;
    }
  }
  // The send rows and the down projection's output of forward are dead
  // after it: backward's send rows and dX rows live there.
  CHECK(borrowed > 0);
  CHECK(ctx->workspaceBytes() == own);
}

TEST_CASE("runtime submit and wait", "[runtime]") {
  Case c;
  c.ranks = groupSize(2);
  auto [fwd, bwd] = compile(c);
  const Inputs in = makeInputs(c, 1);
  std::unique_ptr<Context> a, b;
  REQUIRE(makeContext(fwd, bwd, {}, &a).ok());
  REQUIRE(makeContext(fwd, bwd, {}, &b).ok());
  Run ra = prepare(c, in, bwd->shape()), rb = prepare(c, in, bwd->shape());
  REQUIRE(bindAll(*a, c, ra).ok());
  REQUIRE(bindAll(*b, c, rb).ok());
  REQUIRE(a->forward().ok());
  REQUIRE(a->backward().ok());
  REQUIRE(b->submitForward().ok());
  Status busy = b->forward();
  CHECK_THAT(busy.message(), Catch::Contains("still running"));
  REQUIRE(b->wait().ok());
  REQUIRE(b->submitBackward().ok());
  REQUIRE(b->wait().ok());
  CHECK(ra.sameOutputs(rb));
  CHECK_THAT(b->wait().message(), Catch::Contains("no pass was submitted"));
  CHECK(b->workspaceBytes() > 0);

  // The trace of a pass in flight is refused, not read while it is written.
  ContextOptions traced;
  traced.trace = true;
  std::unique_ptr<Context> t;
  REQUIRE(makeContext(fwd, bwd, traced, &t).ok());
  Run rt = prepare(c, in, bwd->shape());
  REQUIRE(bindAll(*t, c, rt).ok());
  const std::string trace = tempPath("submitted_trace.json");
  REQUIRE(t->submitForward().ok());
  CHECK_THAT(t->writeTrace(trace).message(), Catch::Contains("still running"));
  REQUIRE(t->wait().ok());
  CHECK(t->writeTrace(trace).ok());
}

TEST_CASE("runtime refuses bad input and leaves outputs untouched", "[runtime][gpu]") {
  Case c;
  c.capacityFactor = 1.5; // a rank's experts hold 1.5 * S * K = 384 rows
  c.ranks = 2;
  c.localExperts = 2;
  c.topK = 2;
  if (!runs(c.ranks))
    return;
  auto [fwd, bwd] = compile(c);
  const Inputs in = makeInputs(c, 4);
  std::unique_ptr<Context> ctx;
  REQUIRE(makeContext(fwd, bwd, {}, &ctx).ok());
  // Under MPI a bad input is given to its rank's process only; every rank
  // must stop with that rank's message.
  const auto local = [&](uint32_t r) { return ctx->fabric().isLocal(r); };
  Run run = prepare(c, in, bwd->shape());
  REQUIRE(bindAll(*ctx, c, run).ok());
  const Run pristine = run;
  const int64_t S = c.seq, H = c.hidden, K = c.topK;

  const auto expectRefused = [&](const std::string &text) {
    Status s = ctx->forward();
    INFO(s.message());
    CHECK_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::Contains(text));
    CHECK(run.sameOutputs(pristine));
  };

  SECTION("wrong shapes") {
    std::vector<float> wide(size_t(S * (H + 1)));
    if (local(0)) {
      Status s = ctx->bind(0, "x", makeTensor(wide.data(), DType::F32, {S, H + 1}));
      REQUIRE(s.ok()); // S-independent dims are checked when a pass runs
    }
    expectRefused("rank 0: tensor 'x' has shape [128, 33]; expected [128, 32]");
    if (local(0)) {
      CHECK_THAT(ctx->bind(0, "x", makeTensor(wide.data(), DType::BF16, {S, H})).message(),
                 Catch::Contains("'x' is bf16; expected f32"));
      CHECK_THAT(ctx->bind(0, "z", makeTensor(wide.data(), DType::F32, {S, H})).message(),
                 Catch::Contains("no tensor is named 'z'"));
    } else {
      CHECK_THAT(ctx->bind(0, "x", makeTensor(wide.data(), DType::F32, {S, H})).message(),
                 Catch::Contains("rank 0 is not run by this process"));
    }
    CHECK_THAT(ctx->bind(5, "x", makeTensor(wide.data(), DType::F32, {S, H})).message(),
               Catch::Contains("rank 5 is out of range"));
    if (local(1)) {
      CHECK_THAT(ctx->setRouting(1, makeTensor(run.ids[1].data(), DType::F32, {S, K}),
                                 makeTensor(run.weights[1].data(), DType::F32, {S, K}))
                     .message(),
                 Catch::Contains("topk_ids is f32; expected i32 or i64"));
      CHECK_THAT(ctx->setRouting(1, makeTensor(run.ids[1].data(), DType::I64, {S, K}),
                                 makeTensor(run.weights[1].data(), DType::F32, {S, 1}))
                     .message(),
                 Catch::Contains("topk_weights has shape [128, 1]"));
    }
  }
  SECTION("an expert id out of range") {
    run.ids[1][17] = 4;
    expectRefused("rank 1: topk_ids[8][1] = 4 is not an expert");
  }
  SECTION("a duplicate expert in one token's top-k") {
    run.ids[0][6] = run.ids[0][7];
    expectRefused("rank 0: topk_ids: token 3 routes to expert");
  }
  SECTION("routing over capacity") {
    // Every token of both ranks to experts 0 and 1, both on rank 0: rank 0
    // receives 512 rows, twice its 256.
    for (auto &ids : run.ids)
      for (size_t i = 0; i < ids.size(); ++i)
        ids[i] = int64_t(i % 2);
    expectRefused("routing over capacity: the experts of rank 0 receive 512 rows; the binary "
                  "serves at most 384 rows per rank");
    // Its own status code, and what the routing needs (on every rank), so a
    // caller can compile a binary with more capacity.
    CHECK(ctx->forward().code() == moec::StatusCode::OverCapacity);
    const moec::rt::CapacityNeed &need = ctx->capacityNeed();
    CHECK(need.receivePerRank == 512); // every row of both ranks
    CHECK(need.rowsPerExpert == 256);  // experts 0 and 1 take a row of every token
    CHECK(need.putRows == 128);        // each rank sends each of them all its tokens
    CHECK(need.rowsPerRank == S * K);
    CHECK(run.sameOutputs(pristine));
  }
  SECTION("backward before forward") {
    Status s = ctx->backward();
    CHECK_THAT(s.message(), Catch::Contains("backward needs a forward pass first"));
    CHECK(run.sameOutputs(pristine));
  }
  SECTION("a binary that is not a layer") {
    moec::format::TaskProgram broken = fwd->tasks();
    broken.tilings[1].lda += 1; // up_proj's A stride
    std::shared_ptr<const Program> program;
    Status s = Program::create(broken, &program);
    CHECK_THAT(s.message(), Catch::Contains("op 'up_proj' (gmm): tiling lda is 33; expected 32"));
    std::shared_ptr<const Program> none;
    CHECK_THAT(makeContext(bwd, nullptr, {}, &ctx).message(),
               Catch::Contains("the forward program is a backward pass"));
  }
}

/// A C call's status, taken: its code and message, the status freed.
struct CStatus {
  moec_status_code_t code = MOEC_STATUS_OK;
  std::string message;
};

CStatus take(moec_status_t status) {
  CStatus taken{moec_status_code(status), moec_status_message(status)};
  moec_status_free(status);
  return taken;
}

/// "" for a call that succeeded, else its message (the status freed).
std::string failure(moec_status_t status) {
  const CStatus taken = take(status);
  return taken.code == MOEC_STATUS_OK ? "" : taken.message.empty() ? "(no message)" : taken.message;
}

TEST_CASE("runtime C API", "[runtime]") {
  // In-process: moec_context_create; under MPI: moec_context_create_mpi,
  // each process binding and routing its own rank.
  Case c;
  if (!runs(c.ranks))
    return;
  // A failed call's status, taken (its code and message kept, it freed).
  CStatus last;
  auto [fwd, bwd] = compile(c);
  const std::string fwdPath = tempPath("c_api_fwd.moebin"), bwdPath = tempPath("c_api_bwd.moebin");
  REQUIRE(moec::format::writeTaskBinaryFile(fwd->tasks(), fwdPath).ok());
  REQUIRE(moec::format::writeTaskBinaryFile(bwd->tasks(), bwdPath).ok());
  // The library's version is the header's, with the format it reads.
  uint32_t format = 0;
  CHECK(std::string(moec_runtime_version(&format)) == MOEC_VERSION_STRING);
  CHECK(format == moec::format::kFormatVersion);
  CHECK(moec_runtime_version(nullptr) == std::string(MOEC_VERSION_STRING));
  moec_program *f = nullptr, *b = nullptr;
  REQUIRE(failure(moec_program_load(fwdPath.c_str(), &f)) == "");
  REQUIRE(failure(moec_program_load(bwdPath.c_str(), &b)) == "");
  CHECK((last = take(moec_program_load("/nonexistent.moebin", &f))).code != MOEC_STATUS_OK);
  CHECK_THAT(last.message, Catch::Contains("/nonexistent.moebin"));
  moec_context *ctx = nullptr;
  // One range for every timeout: 0.001 to 10^6 s, or 0 for the default;
  // through the fabric's entry point (moec_context_create, or under mpirun
  // moec_context_create_mpi), refused before any fabric is made.
  for (double bad : {std::nan(""), HUGE_VAL, -HUGE_VAL, 1e300, 1e-9, -1.0}) {
    CHECK((last = take(moec::test::testCContext(f, b, 2, bad, &ctx))).code != MOEC_STATUS_OK);
    CHECK_THAT(last.message, Catch::Contains("timeout_seconds is") &&
                                 Catch::Contains("from 0.001 to 1000000 seconds"));
    CHECK(ctx == nullptr);
  }
  CHECK((last = take(moec_context_create_on(f, b, 2, 10, "tpu", &ctx))).code != MOEC_STATUS_OK);
  CHECK_THAT(last.message, Catch::Contains("no backend is named 'tpu'; expected cpu or cuda"));
  CHECK(ctx == nullptr);
  REQUIRE(failure(moec::test::testCContext(f, b, 2, 10, &ctx)) == "");
  moec_program_free(f);
  moec_program_free(b);
  REQUIRE(moec_context_ranks(ctx) == c.ranks);
  const uint32_t first = moec_context_first_rank(ctx), local = moec_context_local_ranks(ctx);
  REQUIRE(local == (std::string(moec::test::testFabricName()) == "mpi" ? 1u : c.ranks));

  const Inputs in = makeInputs(c, 8);
  Run run = prepare(c, in, bwd->shape());
  const int64_t S = c.seq, H = c.hidden, K = c.topK;
  for (uint32_t r = first; r < first + local; ++r) {
    moec_tensor ids = makeTensor(run.ids[r].data(), DType::I64, {S, K});
    moec_tensor w = makeTensor(run.weights[r].data(), DType::F32, {S, K});
    REQUIRE(failure(moec_set_routing(ctx, r, &ids, &w)) == "");
    const std::pair<const char *, moec_tensor> t[] = {
        {"x", makeTensor(run.x[r].data(), DType::F32, {S, H})},
        {"y", makeTensor(run.y[r].data(), DType::F32, {S, H})},
        {"w1", makeTensor(run.w1[r].data(), DType::F32, {2, H, 2 * c.inter})},
        {"w2", makeTensor(run.w2[r].data(), DType::F32, {2, c.inter, H})},
    };
    for (const auto &[name, tensor] : t)
      REQUIRE(failure(moec_bind(ctx, r, name, &tensor)) == "");
  }
  REQUIRE(failure(moec_forward(ctx)) == "");
  int64_t need[4] = {};
  REQUIRE(failure(moec_capacity_need(ctx, need)) == "");
  CHECK(need[0] == S * K);
  CHECK(need[1] > 0);
  CHECK((last = take(moec_backward(ctx))).code == MOEC_ERROR); // dy etc. not bound
  CHECK_THAT(last.message, Catch::Contains("tensor 'dy' is not bound"));

  // An output over an input or over another output is refused before the
  // pass writes anything, naming both.
  const auto bindBackward = [&](const char *dxOver, const char *dw1Over) {
    for (uint32_t r = first; r < first + local; ++r) {
      const std::pair<const char *, moec_tensor> t[] = {
          {"dy", makeTensor(run.dy[r].data(), DType::F32, {S, H})},
          {"dx", makeTensor(dxOver ? run.dy[r].data() : run.dx[r].data(), DType::F32, {S, H})},
          {"dtopk_weights", makeTensor(run.dtopk[r].data(), DType::F32, {S, K})},
          {"dw1", makeTensor(dw1Over ? run.w1[r].data() : run.dw1[r].data(), DType::F32,
                             {2, H, 2 * c.inter})},
          {"dw2", makeTensor(run.dw2[r].data(), DType::F32, {2, c.inter, H})},
      };
      for (const auto &[name, tensor] : t)
        REQUIRE(failure(moec_bind(ctx, r, name, &tensor)) == "");
    }
  };
  bindBackward("dy", nullptr);
  CHECK((last = take(moec_backward(ctx))).code == MOEC_ERROR);
  CHECK_THAT(last.message, Catch::Contains("output 'dx' shares memory with input 'dy'"));
  bindBackward(nullptr, "w1");
  CHECK((last = take(moec_backward(ctx))).code == MOEC_ERROR);
  CHECK_THAT(last.message, Catch::Contains("output 'dw1' shares memory with input 'w1'"));
  for (uint32_t r = first; r < first + local; ++r) {
    moec_tensor yOverX = makeTensor(run.x[r].data(), DType::F32, {S, H});
    REQUIRE(failure(moec_bind(ctx, r, "y", &yOverX)) == "");
  }
  CHECK((last = take(moec_forward(ctx))).code == MOEC_ERROR);
  CHECK_THAT(last.message, Catch::Contains("output 'y' shares memory with input 'x'"));
  for (uint32_t r = first; r < first + local; ++r) {
    moec_tensor y = makeTensor(run.y[r].data(), DType::F32, {S, H});
    REQUIRE(failure(moec_bind(ctx, r, "y", &y)) == "");
  }
  if (local > 1) {
    // Rank 1's y over rank 0's x: the ranks of one process share memory.
    moec_tensor yOverRank0 = makeTensor(run.x[first].data(), DType::F32, {S, H});
    REQUIRE(failure(moec_bind(ctx, first + 1, "y", &yOverRank0)) == "");
    CHECK((last = take(moec_forward(ctx))).code == MOEC_ERROR);
    CHECK_THAT(last.message, Catch::Contains("output 'y' shares memory with input 'x' of rank 0"));
    moec_tensor y = makeTensor(run.y[first + 1].data(), DType::F32, {S, H});
    REQUIRE(failure(moec_bind(ctx, first + 1, "y", &y)) == "");
  }
  REQUIRE(failure(moec_forward(ctx)) == "");

  // A routing over capacity has its own return code: one token more than
  // compiled on rank 0.
  std::vector<int64_t> moreIds(size_t((S + 1) * K));
  std::vector<float> moreWeights(moreIds.size(), 0.5f);
  for (size_t i = 0; i < moreIds.size(); ++i)
    moreIds[i] = int64_t(i % K);
  moec_tensor more = makeTensor(moreIds.data(), DType::I64, {S + 1, K});
  moec_tensor moreW = makeTensor(moreWeights.data(), DType::F32, {S + 1, K});
  if (first == 0)
    REQUIRE(failure(moec_set_routing(ctx, 0, &more, &moreW)) == "");
  CHECK((last = take(moec_forward(ctx))).code == MOEC_OVER_CAPACITY);
  CHECK_THAT(last.message, Catch::Contains("rank 0: routing over capacity: 129 tokens"));
  REQUIRE(failure(moec_capacity_need(ctx, need)) == "");
  CHECK(need[0] == (S + 1) * K);

  // The same forward through the C++ API gives the same bits.
  std::unique_ptr<Context> cpp;
  REQUIRE(makeContext(fwd, bwd, {}, &cpp).ok());
  Run again = prepare(c, in, bwd->shape());
  REQUIRE(bindAll(*cpp, c, again).ok());
  REQUIRE(cpp->forward().ok());
  for (uint32_t r = first; r < first + local; ++r)
    CHECK(again.y[r] == run.y[r]);
  CHECK((last = take(moec_bind(ctx, 0, nullptr, nullptr))).code != MOEC_STATUS_OK);
  CHECK_THAT(last.message, Catch::Contains("moec_bind: null argument"));
  CHECK((last = take(moec_wait(ctx))).code != MOEC_STATUS_OK);
  CHECK_THAT(last.message, Catch::Contains("no pass was submitted"));
  moec_context_free(ctx);
}

TEST_CASE("exchange: dispatch, combine and the top-k weight gradient", "[runtime]") {
  Case c;
  c.ranks = groupSize(2);
  c.capacityFactor = 2 * c.ranks; // any routing fits
  if (!runs(c.ranks))
    return;
  auto [dispatch, combine] = compile(c, "graphs/moe_dispatch.json", "graphs/moe_combine.json");
  ContextOptions options;
  bool yes = false;
  options.fabric = moec::test::testFabric(c.ranks, &yes);
  std::unique_ptr<moec::rt::Exchange> ex;
  REQUIRE(moec::rt::Exchange::create(dispatch, combine, options, &ex).ok());
  const Inputs in = makeInputs(c, 21);
  const uint32_t R = c.ranks, L = c.localExperts, K = c.topK;
  const int64_t S = c.seq, H = c.hidden;
  const uint32_t first = ex->firstLocalRank(), last = first + ex->localRanks();

  // Nothing runs before a routing is laid out.
  std::vector<moec::rt::Tensor> none(ex->localRanks());
  CHECK_THAT(ex->dispatch(none, none, false).message(), Catch::Contains("call route()"));

  for (uint32_t r = first; r < last; ++r)
    REQUIRE(ex->setRouting(r, makeTensor(const_cast<int64_t *>(in.ids[r].data()), DType::I64, {S, K}),
                           makeTensor(const_cast<float *>(in.weights[r].data()), DType::F32,
                                      {S, K}))
                .ok());
  REQUIRE(ex->route().ok());
  // A top-k weight gradient needs the rows of a combine first.
  CHECK_THAT(ex->topkWeightGrad(none, none).message(), Catch::Contains("needs the rows of a combine"));

  // What each local rank's experts must receive: expert g's (token, k) rows
  // by source rank, token, k.
  std::vector<std::vector<float>> want(R), rows(R), y(R), dtopk(R);
  std::vector<moec::rt::Tensor> xs, rowTs, ys, dys, dtopks;
  for (uint32_t r = first; r < last; ++r) {
    std::vector<int64_t> counts(L, 0);
    for (uint32_t e = 0; e < L; ++e)
      for (uint32_t q = 0; q < R; ++q)
        for (int64_t t = 0; t < S; ++t)
          for (uint32_t k = 0; k < K; ++k)
            if (in.ids[q][size_t(t * K + k)] == int64_t(r * L + e)) {
              want[r].insert(want[r].end(), in.x[q].begin() + t * H,
                             in.x[q].begin() + (t + 1) * H);
              ++counts[e];
            }
    CHECK(ex->expertRows(r) == counts);
    REQUIRE(ex->receivedRows(r) * H == int64_t(want[r].size()));
    rows[r].assign(want[r].size(), -1.0f);
    y[r].assign(size_t(S * H), 0.0f);
    dtopk[r].assign(size_t(S * K), 0.0f);
    xs.push_back(makeTensor(const_cast<float *>(in.x[r].data()), DType::F32, {S, H}));
    rowTs.push_back(makeTensor(rows[r].data(), DType::F32, {ex->receivedRows(r), H}));
    ys.push_back(makeTensor(y[r].data(), DType::F32, {S, H}));
    dys.push_back(makeTensor(const_cast<float *>(in.dy[r].data()), DType::F32, {S, H}));
    dtopks.push_back(makeTensor(dtopk[r].data(), DType::F32, {S, K}));
  }
  // Wrong expert rows are refused on every rank before anything runs.
  std::vector<moec::rt::Tensor> shortRows = rowTs;
  shortRows[0].dims[0] -= 1;
  CHECK_THAT(ex->dispatch(xs, shortRows, false).message(),
             Catch::Contains("'expert_x' has shape"));

  REQUIRE(ex->dispatch(xs, rowTs, false).ok());
  for (uint32_t r = first; r < last; ++r)
    CHECK(rows[r] == want[r]); // the rows themselves, bit for bit

  // Combining the dispatched rows: y[t] = sum_k w[t, k] x[t], in k order;
  // unweighted, the sum over k.
  for (bool weighted : {false, true}) {
    INFO("weighted " << weighted);
    REQUIRE(ex->combine(rowTs, ys, weighted).ok());
    for (uint32_t r = first; r < last; ++r)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t h = 0; h < H; h += 7) {
          float sum = 0;
          for (uint32_t k = 0; k < K; ++k)
            sum += (weighted ? in.weights[r][size_t(t * K + k)] : 1.0f) *
                   in.x[r][size_t(t * H + h)];
          REQUIRE(y[r][size_t(t * H + h)] == Approx(sum).epsilon(1e-6));
        }
  }
  // d topk_weights[t, k] = <dy[t], x[t]>, the row the combine brought back.
  REQUIRE(ex->topkWeightGrad(dys, dtopks).ok());
  for (uint32_t r = first; r < last; ++r)
    for (int64_t t = 0; t < S; ++t) {
      double dot = 0;
      for (int64_t h = 0; h < H; ++h)
        dot += double(in.dy[r][size_t(t * H + h)]) * double(in.x[r][size_t(t * H + h)]);
      for (uint32_t k = 0; k < K; ++k)
        REQUIRE(dtopk[r][size_t(t * K + k)] == Approx(dot).epsilon(1e-4).margin(1e-5));
    }

  // The halves must belong together, and neither is a layer pass.
  std::unique_ptr<moec::rt::Exchange> wrong;
  CHECK_THAT(moec::rt::Exchange::create(dispatch, dispatch, options, &wrong).message(),
             Catch::Contains("the combine program is not a combine alone"));
  // An exchange runs on the CPU backend alone, and says so.
  ContextOptions onGpu = options;
  onGpu.backend = moec::backend::Kind::Cuda;
  CHECK(moec::rt::Exchange::create(dispatch, combine, onGpu, &wrong).message() ==
        "an exchange runs on the cpu backend only, not on cuda");
  CHECK(wrong == nullptr);
  // Its timeout has the context's range, checked in the same place.
  ContextOptions noWatchdog = options;
  noWatchdog.timeoutSeconds = -1;
  CHECK_THAT(moec::rt::Exchange::create(dispatch, combine, noWatchdog, &wrong).message(),
             Catch::Contains("the timeout is -1 s; it must be from 0.001 to 1000000 seconds"));
  CHECK(wrong == nullptr);
  std::unique_ptr<Context> ctx;
  CHECK_THAT(makeContext(dispatch, nullptr, {}, &ctx).message(),
             Catch::Contains("the binary is the dispatch alone"));
}

TEST_CASE("a frozen layer's backward takes no weight gradients", "[runtime][gpu]") {
  Case c;
  c.ranks = groupSize(2);
  c.capacityFactor = 2 * c.ranks;
  if (!runs(c.ranks))
    return;
  auto [fwd, frozen] = compile(c, "graphs/moe_ffn_fwd.json", "graphs/moe_ffn_bwd_frozen.json");
  CHECK(frozen->shape().frozen);
  CHECK_FALSE(compile(c).second->shape().frozen);
  std::unique_ptr<Context> ctx;
  REQUIRE(makeContext(fwd, frozen, {}, &ctx).ok());
  const uint32_t r = ctx->firstLocalRank();
  std::vector<float> dw1(size_t(c.localExperts * c.hidden * 2 * c.inter));
  CHECK_THAT(ctx->bind(r, "dw1", makeTensor(dw1.data(), DType::F32,
                                            {c.localExperts, c.hidden, 2 * c.inter}))
                 .message(),
             Catch::Contains("backward program has none (frozen weights)"));
}

/// Binds rank r's tensors of `run` but its weights, which are `w1` and
/// `w2` as given (another layout or format), with `extra` tensors (block
/// scales), and its routing; a frozen backward's, so no weight gradients.
void bindRank(Context &ctx, const Case &c, Run &run, uint32_t r, const moec::rt::Tensor &w1,
              const moec::rt::Tensor &w2,
              const std::vector<std::pair<const char *, moec::rt::Tensor>> &extra = {}) {
  const int64_t S = int64_t(run.ids[r].size()) / c.topK, H = c.hidden;
  std::vector<std::pair<const char *, moec::rt::Tensor>> tensors = {
      {"x", makeTensor(run.x[r].data(), run.x[r].dtype(), {S, H})},
      {"y", makeTensor(run.y[r].data(), run.y[r].dtype(), {S, H})},
      {"w1", w1},
      {"w2", w2},
      {"dy", makeTensor(run.dy[r].data(), run.dy[r].dtype(), {S, H})},
      {"dx", makeTensor(run.dx[r].data(), run.dx[r].dtype(), {S, H})},
      {"dtopk_weights", makeTensor(run.dtopk[r].data(), DType::F32, {S, c.topK})}};
  tensors.insert(tensors.end(), extra.begin(), extra.end());
  for (const auto &[name, tensor] : tensors) {
    Status bound = ctx.bind(r, name, tensor);
    INFO(name << ": " << bound.message());
    REQUIRE(bound.ok());
  }
  REQUIRE(ctx.setRouting(r, makeTensor(run.ids[r].data(), DType::I64, {S, c.topK}),
                         makeTensor(run.weights[r].data(), DType::F32, {S, c.topK}))
              .ok());
}

/// A forward and a backward pass of `ctx`, both required to succeed.
void runPasses(Context &ctx) {
  Status f = ctx.forward();
  INFO("forward: " << f.message());
  REQUIRE(f.ok());
  Status b = ctx.backward();
  INFO("backward: " << b.message());
  REQUIRE(b.ok());
}

/// y, dx and dtopk_weights of `got` within `tol` of `want`'s (relative to
/// their scale) on ranks [first, first + count).
void checkClose(const Run &got, const Run &want, uint32_t first, uint32_t count, double tol) {
  const auto close = [&](const std::vector<float> &a, const std::vector<float> &b) {
    return relError(a, std::vector<double>(b.begin(), b.end())) < tol;
  };
  for (uint32_t r = first; r < first + count; ++r) {
    INFO("rank " << r);
    CHECK(close(got.y[r].values(), want.y[r].values()));
    CHECK(close(got.dx[r].values(), want.dx[r].values()));
    CHECK(close(got.dtopk[r], want.dtopk[r]));
  }
}

/// Each expert's w1 [H, 2I] and w2 [I, H] of `L` experts, transposed: the
/// [L, 2I, H] and [L, H, I] layout of Hugging Face's fused experts.
std::pair<std::vector<float>, std::vector<float>>
transposeExperts(const std::vector<float> &w1, const std::vector<float> &w2, int64_t L, int64_t H,
                 int64_t I) {
  std::vector<float> t1(w1.size()), t2(w2.size());
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < 2 * I; ++j)
        t1[size_t((l * 2 * I + j) * H + h)] = w1[size_t((l * H + h) * 2 * I + j)];
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h)
        t2[size_t((l * H + h) * I + i)] = w2[size_t((l * I + i) * H + h)];
  }
  return {std::move(t1), std::move(t2)};
}

/// A bf16 layer for the packed-weight store: depths over one 256-value
/// block and ending mid-pair, columns cut into tiles and 48-column panels
/// unevenly; a plain context (run a) and one that packs its weights (run b,
/// the backward's too with `packBackward`), bound to the same inputs.
struct PackedTwins {
  Case c;
  std::unique_ptr<Context> plain, packed;
  Run a, b;

  PackedTwins(bool packBackward, uint32_t seed) {
    c.ranks = groupSize(2);
    c.localExperts = 3;
    c.topK = 2;
    c.bf16 = true;
    c.hidden = 301;
    c.inter = 70;
    c.seq = 64;
    auto [fwd, bwd] = compile(c);
    const Inputs in = makeInputs(c, seed);
    ContextOptions plainOptions;
    plainOptions.workers = 2;
    ContextOptions packedOptions = plainOptions;
    packedOptions.packWeights = true;
    packedOptions.packBackward = packBackward;
    REQUIRE(makeContext(fwd, bwd, plainOptions, &plain).ok());
    REQUIRE(makeContext(fwd, bwd, packedOptions, &packed).ok());
    a = prepare(c, in, bwd->shape());
    b = prepare(c, in, bwd->shape());
    REQUIRE(bindAll(*plain, c, a).ok());
    REQUIRE(bindAll(*packed, c, b).ok());
  }
  PackedTwins(const PackedTwins &) = delete; // the contexts hold a's and b's memory

  /// The bf16 bytes of w1 and w2 on this process's ranks.
  uint64_t weightBytes() const {
    return uint64_t(packed->localRanks() * c.localExperts * 3 * c.hidden * c.inter) * 2;
  }
};

TEST_CASE("packed weights: the bits of packing in every tile, packed again when a weight "
          "changes or another is bound", "[runtime]") {
  if (!testBackendHas(moec::backend::Feature::PackedWeights))
    return;
  PackedTwins twins(true, 41);
  const Case &c = twins.c;
  Run &a = twins.a, &b = twins.b;
  const std::unique_ptr<Context> &plain = twins.plain, &packed = twins.packed;
  runPasses(*plain);
  runPasses(*packed);
  CHECK(b.sameOutputs(a));
  // A second step reads what the first packed.
  runPasses(*packed);
  CHECK(b.sameOutputs(a));
  CHECK(plain->packedWeightBytes() == 0);
  if (!moec::cpu::packedTile(DType::BF16, DType::BF16)) {
    WARN("moec's bf16 tile does not run on this CPU: nothing is packed");
    CHECK(packed->packedWeightBytes() == 0);
    return;
  }
  // w1 and w2 packed for the forward, and again for the backward's
  // transposed reads where the tile reads them from panels (AMX, and the
  // AVX-512 tile but in its dot form): at least this process's ranks'
  // weights' bytes twice; once where it reads those rows as they lie (the
  // dot form, MOEC_DOT_FORM).
  const uint64_t weightBytes = twins.weightBytes();
  if (moec::cpu::tile::dotForm(false, true, true)) {
    CHECK(packed->packedWeightBytes() >= weightBytes);
    CHECK(packed->packedWeightBytes() < 2 * weightBytes);
  } else {
    CHECK(packed->packedWeightBytes() >= 2 * weightBytes);
  }

  // The weights written in place (every third value negated), as an
  // optimizer step would: a context not told reads its packed copies still.
  const auto step = [](Run &run) {
    for (std::vector<Stored> *w : {&run.w1, &run.w2})
      for (Stored &rank : *w)
        for (size_t i = 0; i < rank.bf16.size(); i += 3)
          rank.bf16[i] ^= 0x8000;
  };
  step(a);
  step(b);
  runPasses(*plain);
  runPasses(*packed);
  CHECK_FALSE(b.sameOutputs(a));
  // Told, it packs them again: the same bits as the plain context.
  REQUIRE(packed->weightChanged("w1").ok());
  REQUIRE(packed->weightChanged("w2").ok());
  runPasses(*packed);
  CHECK(b.sameOutputs(a));

  // Another tensor bound for w2 is packed anew without being told.
  for (Run *run : {&a, &b})
    for (Stored &rank : run->w2)
      for (size_t i = 1; i < rank.bf16.size(); i += 5)
        rank.bf16[i] ^= 0x8000;
  std::vector<Stored> moved = b.w2;
  const int64_t L = c.localExperts, H = c.hidden, I = c.inter;
  for (uint32_t r = packed->firstLocalRank(); r < packed->firstLocalRank() + packed->localRanks();
       ++r)
    REQUIRE(packed->bind(r, "w2", makeTensor(moved[r].data(), DType::BF16, {L, I, H})).ok());
  runPasses(*plain);
  runPasses(*packed);
  CHECK(b.sameOutputs(a));

  CHECK_THAT(packed->weightChanged("x").message(),
             Catch::Contains("'x' is not a weight; expected one of w1, w2, lora_a1"));
}

TEST_CASE("packed weights for the forward pass only: the bits of packing in every tile, the "
          "forward's cells alone",
          "[runtime]") {
  if (!testBackendHas(moec::backend::Feature::PackedWeights))
    return;
  PackedTwins twins(false, 43);
  for (int step = 0; step < 3; ++step) {
    runPasses(*twins.plain);
    runPasses(*twins.packed);
    CHECK(twins.b.sameOutputs(twins.a));
  }
  const std::unique_ptr<Context> &packed = twins.packed;
  if (!moec::cpu::packedTile(DType::BF16, DType::BF16)) {
    WARN("moec's bf16 tile does not run on this CPU: nothing is packed");
    CHECK(packed->packedWeightBytes() == 0);
    return;
  }
  // w1 and w2 packed once each, for the forward (read as stored k x n) on
  // either tile; the backward's transposed reads keep none, where the AMX
  // tile with the backward's cells too holds them twice (the case above).
  CHECK(packed->packedWeightBytes() >= twins.weightBytes());
  CHECK(packed->packedWeightBytes() < 2 * twins.weightBytes());
}

TEST_CASE("base weights stored transposed: the layer of the [L, H, 2I] layout", "[runtime][gpu]") {
  // w1 [L, 2I, H] and w2 [L, H, I], each expert's matrix transposed (the
  // layout of Hugging Face's fused experts), run by the *_transposed graphs:
  // the forward and the frozen backward give what the [L, H, 2I] layout's
  // binaries give on the same weights.
  for (const bool bf16 : {false, true}) {
    Case c;
    c.ranks = groupSize(2);
    c.bf16 = bf16;
    c.routing = Routing::Skewed;
    c.capacityFactor = 2 * c.ranks;
    c.hidden = 48; // not 2I: the two layouts' dims differ
    INFO(c.describe());
    if (!runs(c.ranks))
      return;
    auto [fwd, bwd] = compile(c, "graphs/moe_ffn_fwd.json", "graphs/moe_ffn_bwd_frozen.json");
    auto [fwdT, bwdT] = compile(c, "graphs/moe_ffn_fwd_transposed.json",
                                "graphs/moe_ffn_bwd_frozen_transposed.json");
    REQUIRE(fwdT->shape().weightsTransposed);
    REQUIRE(bwdT->shape().weightsTransposed);
    REQUIRE_FALSE(fwd->shape().weightsTransposed);
    // A transposed forward does not pair with an untransposed backward.
    std::unique_ptr<Context> mixed;
    CHECK_THAT(makeContext(fwdT, bwd, {}, &mixed).message(),
               Catch::Contains("transposed weights"));
    const Inputs in = makeInputs(c, 11);
    const int64_t H = c.hidden, I = c.inter, L = c.localExperts;
    Run plain = prepare(c, in, bwd->shape());
    Run swapped = prepare(c, in, bwdT->shape());
    for (uint32_t r = 0; r < c.ranks; ++r) { // each expert's matrices transposed
      auto [t1, t2] = transposeExperts(plain.w1[r].values(), plain.w2[r].values(), L, H, I);
      swapped.w1[r] = Stored(t1, bf16);
      swapped.w2[r] = Stored(t2, bf16);
    }
    uint32_t firstLocal = 0, localRanks = 0;
    for (auto [fp, bp, run, transposed] :
         {std::tuple{fwd, bwd, &plain, false}, std::tuple{fwdT, bwdT, &swapped, true}}) {
      std::unique_ptr<Context> ctx;
      REQUIRE(makeContext(fp, bp, {}, &ctx).ok());
      firstLocal = ctx->firstLocalRank();
      localRanks = ctx->localRanks();
      for (uint32_t r = ctx->firstLocalRank(); r < ctx->firstLocalRank() + ctx->localRanks();
           ++r) {
        const int64_t d1[3] = {L, transposed ? 2 * I : H, transposed ? H : 2 * I};
        const int64_t d2[3] = {L, transposed ? H : I, transposed ? I : H};
        bindRank(*ctx, c, *run, r,
                 makeTensor(run->w1[r].data(), run->w1[r].dtype(), {d1[0], d1[1], d1[2]}),
                 makeTensor(run->w2[r].data(), run->w2[r].dtype(), {d2[0], d2[1], d2[2]}));
      }
      if (transposed) { // the [L, H, 2I] dims are refused, naming the expected ones
        const uint32_t r = firstLocal;
        std::vector<float> wrong(size_t(L * H * 2 * I));
        REQUIRE(ctx->bind(r, "w1", makeTensor(wrong.data(), DType::F32, {L, H, 2 * I})).ok() ==
                !bf16);
        if (!bf16)
          CHECK_THAT(ctx->forward().message(),
                     Catch::Contains("[" + std::to_string(L) + ", " + std::to_string(2 * I) +
                                     ", " + std::to_string(H) + "]"));
        REQUIRE(ctx->bind(r, "w1", makeTensor(run->w1[r].data(), run->w1[r].dtype(),
                                              {L, 2 * I, H}))
                    .ok());
      }
      runPasses(*ctx);
    }
    checkClose(swapped, plain, firstLocal, localRanks, bf16 ? 2e-2 : 1e-5);
  }
}

namespace {

/// The product of `dims`.
int64_t product(const std::vector<int64_t> &dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t(1), std::multiplies<int64_t>());
}

/// "[2, 3, 4]".
std::string dimsString(const std::vector<int64_t> &dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i)
    out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

/// A quantized format of the base weights: the suffix of its graphs
/// (graphs/moe_ffn_{fwd,bwd_frozen}_transposed_<suffix>.json), the config's
/// weight_group, the name the binaries give the format
/// (LayerShape::weightFormatName), and H and I whose rows hold whole
/// blocks or groups (H differs from 2I, so swapped dims are caught).
struct QuantizedFormat {
  const char *suffix;
  int64_t group;
  const char *name;
  int64_t hidden, inter;
};

const QuantizedFormat kQuantizedFormats[] = {
    {"fp8", 0, "fp8_block128", 128, 128},
    {"int8", 0, "int8", 48, 40},
    {"int4", 64, "int4_g64", 128, 128},
    {"int4zp", 32, "int4_g32_zp", 96, 32},
};

/// A case of `format`'s sizes and group.
Case quantizedCase(const QuantizedFormat &format) {
  Case c;
  c.ranks = groupSize(2);
  c.hidden = format.hidden;
  c.inter = format.inter;
  c.weightGroup = format.group;
  c.seq = 64;
  c.routing = Routing::Skewed;
  c.capacityFactor = 2 * c.ranks;
  return c;
}

/// The forward and frozen backward of `format`'s transposed graphs.
std::pair<std::shared_ptr<const Program>, std::shared_ptr<const Program>>
compileQuantized(const Case &c, const QuantizedFormat &format) {
  const std::string fwd = std::string("graphs/moe_ffn_fwd_transposed_") + format.suffix + ".json",
                    bwd = std::string("graphs/moe_ffn_bwd_frozen_transposed_") + format.suffix +
                          ".json";
  auto programs = compile(c, fwd.c_str(), bwd.c_str());
  REQUIRE(programs.first->shape().weightFormatName() == format.name);
  REQUIRE(programs.second->shape().weightFormatName() == format.name);
  REQUIRE(programs.first->shape().weightsTransposed);
  REQUIRE(programs.second->shape().frozen);
  return programs;
}

/// One rank's weight [L, rows, cols] in `shape`'s format: its codes and
/// scales, and their dims as bound (LayerShape::storedDims, scaleDims).
struct QuantizedWeight {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  std::vector<int64_t> codeDims, scaleDims;
  moec::rt::Tensor codesTensor(const moec::rt::LayerShape &shape) {
    return makeTensor(codes.data(), shape.weightDType(), codeDims);
  }
  moec::rt::Tensor scalesTensor() { return makeTensor(scales.data(), DType::F32, scaleDims); }
};

/// Quantizes each expert's matrix of `values` ([L, rows, cols] = `dims`) in
/// `shape`'s format, and replaces `values` by the dequantized values.
QuantizedWeight quantizeExperts(const moec::rt::LayerShape &shape, std::vector<float> &values,
                                const std::array<int64_t, 3> &dims) {
  QuantizedWeight q;
  q.codeDims = shape.storedDims(dims);
  q.scaleDims = shape.scaleDims(dims);
  const int64_t L = dims[0], rows = dims[1], cols = dims[2];
  const int64_t codeBytes = product(q.codeDims) / L, scaleCount = product(q.scaleDims) / L;
  q.codes.resize(size_t(L * codeBytes));
  q.scales.resize(size_t(L * scaleCount));
  moec::cpu::QuantizedMatrix m;
  m.format = shape.weightFormat;
  m.rows = rows;
  m.cols = cols;
  m.group = shape.weightGroup;
  m.zeroPoints = shape.weightZeroPoints;
  for (int64_t l = 0; l < L; ++l) {
    float *w = values.data() + l * rows * cols;
    uint8_t *codes = q.codes.data() + l * codeBytes;
    float *scales = q.scales.data() + l * scaleCount;
    moec::cpu::quantize(m, w, cols, codes, scales);
    m.codes = codes;
    m.scales = scales;
    moec::cpu::dequantize(m, 0, rows, 0, cols, w, DType::F32, cols);
  }
  return q;
}

/// Per rank: w1 and w2 of `dense` transposed and quantized in `shape`'s
/// format, `dense`'s weights replaced by their dequantized values.
std::pair<std::vector<QuantizedWeight>, std::vector<QuantizedWeight>>
quantizeRun(const Case &c, const moec::rt::LayerShape &shape, Run &dense) {
  const int64_t H = c.hidden, I = c.inter, L = c.localExperts;
  std::vector<QuantizedWeight> q1(c.ranks), q2(c.ranks);
  for (uint32_t r = 0; r < c.ranks; ++r) {
    auto [t1, t2] = transposeExperts(dense.w1[r].values(), dense.w2[r].values(), L, H, I);
    q1[r] = quantizeExperts(shape, t1, {L, 2 * I, H});
    q2[r] = quantizeExperts(shape, t2, {L, H, I});
    dense.w1[r] = Stored(t1, c.bf16);
    dense.w2[r] = Stored(t2, c.bf16);
  }
  return {std::move(q1), std::move(q2)};
}

} // namespace

TEST_CASE("quantized base weights (FP8 blocks, int8 rows, int4 groups): the dense layer on the "
          "dequantized weights",
          "[runtime][gpu]") {
  // w1 [L, 2I, H] and w2 [L, H, I] as codes with their fp32 scales
  // (graphs/*_transposed_<format>.json) against the dense transposed
  // binaries on the same weights dequantized: the forward and the frozen
  // backward agree within the dtype's tolerance, in fp32 and bf16, for FP8
  // blocks, int8 rows and int4 groups of 64 and (with zero points) of 32.
  for (const QuantizedFormat &format : kQuantizedFormats)
    for (const bool bf16 : {false, true}) {
      Case c = quantizedCase(format);
      c.bf16 = bf16;
      INFO(format.name << " " << c.describe());
      if (!runs(c.ranks))
        return;
      auto [fwd, bwd] = compile(c, "graphs/moe_ffn_fwd_transposed.json",
                                "graphs/moe_ffn_bwd_frozen_transposed.json");
      auto [fwdQ, bwdQ] = compileQuantized(c, format);
      const moec::rt::LayerShape &shape = fwdQ->shape();
      const int64_t H = c.hidden, I = c.inter, L = c.localExperts;
      const Inputs in = makeInputs(c, 17);
      Run dense = prepare(c, in, bwd->shape()), quantized = prepare(c, in, bwdQ->shape());
      auto [q1, q2] = quantizeRun(c, shape, dense);
      uint32_t firstLocal = 0, localRanks = 0;
      for (const bool isQuantized : {false, true}) {
        Run &run = isQuantized ? quantized : dense;
        std::unique_ptr<Context> ctx;
        REQUIRE(makeContext(isQuantized ? fwdQ : fwd, isQuantized ? bwdQ : bwd, {}, &ctx).ok());
        firstLocal = ctx->firstLocalRank();
        localRanks = ctx->localRanks();
        for (uint32_t r = firstLocal; r < firstLocal + localRanks; ++r)
          if (isQuantized)
            bindRank(*ctx, c, run, r, q1[r].codesTensor(shape), q2[r].codesTensor(shape),
                     {{"w1_scale", q1[r].scalesTensor()}, {"w2_scale", q2[r].scalesTensor()}});
          else
            bindRank(*ctx, c, run, r,
                     makeTensor(run.w1[r].data(), run.w1[r].dtype(), {L, 2 * I, H}),
                     makeTensor(run.w2[r].data(), run.w2[r].dtype(), {L, H, I}));
        if (isQuantized) {
          QuantizedWeight &w1 = q1[firstLocal];
          // Weights of the activations' dtype are refused when bound.
          CHECK_THAT(ctx->bind(firstLocal, "w1",
                               makeTensor(run.w1[firstLocal].data(), run.w1[firstLocal].dtype(),
                                          {L, 2 * I, H}))
                         .message(),
                     Catch::Contains(std::string("expected ") +
                                     moec::format::dtypeName(shape.weightDType())));
          // Scales of the wrong shape (int8: twice the rows; int4: of groups
          // half as long; FP8: blocks of 64 columns) are refused, naming the
          // expected shape.
          std::vector<int64_t> wrongDims = w1.scaleDims;
          wrongDims[wrongDims.size() >= 3 ? 2 : 1] *= 2;
          std::vector<float> wrong(size_t(product(wrongDims)), 1.0f);
          REQUIRE(ctx->bind(firstLocal, "w1_scale", makeTensor(wrong.data(), DType::F32, wrongDims))
                      .ok());
          std::string refused = ctx->forward().message();
          CHECK_THAT(refused, Catch::Contains("tensor 'w1_scale' has shape " +
                                              dimsString(wrongDims) + "; expected " +
                                              dimsString(w1.scaleDims)));
          REQUIRE(ctx->bind(firstLocal, "w1_scale", w1.scalesTensor()).ok());
          // 4-bit codes are bound two a byte: [L, 2I, H / 2], not [L, 2I, H].
          if (shape.weightFormat == moec::WeightFormat::Int4Group) {
            std::vector<uint8_t> unpacked(size_t(L * 2 * I * H));
            REQUIRE(ctx->bind(firstLocal, "w1",
                              makeTensor(unpacked.data(), DType::I4, {L, 2 * I, H}))
                        .ok());
            refused = ctx->forward().message();
            CHECK_THAT(refused, Catch::Contains("tensor 'w1' has shape " +
                                                dimsString({L, 2 * I, H}) + "; expected " +
                                                dimsString({L, 2 * I, H / 2})));
            REQUIRE(ctx->bind(firstLocal, "w1", w1.codesTensor(shape)).ok());
          }
          CHECK(run.sameOutputs(prepare(c, in, bwdQ->shape()))); // nothing written yet
        }
        runPasses(*ctx);
      }
      checkClose(quantized, dense, firstLocal, localRanks, bf16 ? 2e-2 : 1e-5);
    }
}

TEST_CASE("quantized weights in the packed-weight store: the bits of a context that packs or "
          "decodes them each pass, again after weightChanged or another tensor bound",
          "[runtime][gpu]") {
  // The cpu backend packs a quantized base into its tile's panels; the cuda
  // backend keeps it decoded, one copy the forward and backward passes
  // share. Either way a packing context (b) gives the bits of a plain one
  // (a) on the same codes, pass after pass; reads its kept copy, stale,
  // after the codes or scales change in place until weightChanged(); and
  // takes another tensor bound without being told. (With
  // MOEC_CUDA_DECODE=tiles the cuda tiles decode as they load: nothing kept.)
  if (!testBackendHas(moec::backend::Feature::PackedWeights))
    return;
  const char *decode = std::getenv("MOEC_CUDA_DECODE");
  const bool cuda =
      testBackend() == moec::backend::Kind::Cuda && !(decode && std::string(decode) == "tiles");
  const bool packs = cuda || (testBackend() == moec::backend::Kind::Cpu &&
                              moec::cpu::packedTile(DType::BF16, DType::BF16));
  for (const QuantizedFormat &format : kQuantizedFormats) {
    Case c = quantizedCase(format);
    c.bf16 = true;
    INFO(format.name << " " << c.describe());
    if (!runs(c.ranks))
      return;
    auto [fwd, bwd] = compileQuantized(c, format);
    const moec::rt::LayerShape &shape = fwd->shape();
    const int64_t H = c.hidden, I = c.inter, L = c.localExperts;
    const Inputs in = makeInputs(c, 29);
    Run source = prepare(c, in, bwd->shape());
    const auto [q1, q2] = quantizeRun(c, shape, source);
    Run a = prepare(c, in, bwd->shape()), b = prepare(c, in, bwd->shape());
    std::vector<QuantizedWeight> a1 = q1, a2 = q2, b1 = q1, b2 = q2;
    ContextOptions plainOptions;
    plainOptions.workers = 2;
    ContextOptions packedOptions = plainOptions;
    packedOptions.packWeights = true;
    std::unique_ptr<Context> plain, packed;
    REQUIRE(makeContext(fwd, bwd, plainOptions, &plain).ok());
    REQUIRE(makeContext(fwd, bwd, packedOptions, &packed).ok());
    const uint32_t first = packed->firstLocalRank(), local = packed->localRanks();
    const auto bind = [&](Context &ctx, Run &run, std::vector<QuantizedWeight> &w1,
                          std::vector<QuantizedWeight> &w2) {
      for (uint32_t r = first; r < first + local; ++r)
        bindRank(ctx, c, run, r, w1[r].codesTensor(shape), w2[r].codesTensor(shape),
                 {{"w1_scale", w1[r].scalesTensor()}, {"w2_scale", w2[r].scalesTensor()}});
    };
    bind(*plain, a, a1, a2);
    bind(*packed, b, b1, b2);
    for (int step = 0; step < 2; ++step) {
      runPasses(*plain);
      runPasses(*packed);
      CHECK(b.sameOutputs(a));
    }
    CHECK(plain->packedWeightBytes() == 0);
    if (cuda) // w1 and w2 decoded to bf16 once, for both passes
      CHECK(packed->packedWeightBytes() == uint64_t(local) * uint64_t(L * 3 * H * I) * 2);
    else
      CHECK((packed->packedWeightBytes() > 0) == packs);

    // In place, as a host that loads new weights would: w1's codes swapped
    // in pairs (every code stays a valid one), w2's scales doubled (not
    // the zero points between them).
    const size_t scaleStep = shape.weightZeroPoints ? 2 : 1;
    const auto change = [&](std::vector<QuantizedWeight> &w1, std::vector<QuantizedWeight> &w2) {
      for (uint32_t r = first; r < first + local; ++r) {
        for (size_t i = 0; i + 1 < w1[r].codes.size(); i += 6)
          std::swap(w1[r].codes[i], w1[r].codes[i + 1]);
        for (size_t i = 0; i < w2[r].scales.size(); i += scaleStep)
          w2[r].scales[i] *= 2;
      }
    };
    change(a1, a2);
    change(b1, b2);
    runPasses(*plain);
    runPasses(*packed);
    if (packs)
      CHECK_FALSE(b.sameOutputs(a)); // the kept copies, stale
    REQUIRE(packed->weightChanged("w1").ok());
    REQUIRE(packed->weightChanged("w2").ok());
    runPasses(*packed);
    CHECK(b.sameOutputs(a));

    // Scales found good are not read again until weightChanged() names
    // their weight: a NaN written in place is refused once it does.
    float &scale = b2[first].scales.back();
    const float kept = scale;
    scale = std::numeric_limits<float>::quiet_NaN();
    REQUIRE(packed->weightChanged("w2").ok());
    CHECK_THAT(packed->forward().message(),
               Catch::Contains("tensor 'w2_scale'") && Catch::Contains("nan"));
    scale = kept;
    REQUIRE(packed->weightChanged("w2").ok());
    runPasses(*packed);
    CHECK(b.sameOutputs(a));

    // Other tensors bound, not told: taken anew.
    change(a1, a2);
    std::vector<QuantizedWeight> moved1 = a1, moved2 = a2;
    bind(*plain, a, a1, a2);
    bind(*packed, b, moved1, moved2);
    runPasses(*plain);
    runPasses(*packed);
    CHECK(b.sameOutputs(a));
  }
}

namespace {

/// Each of the `L` row-major [rows, cols] matrices of `m`, transposed.
std::vector<float> transposeEach(const std::vector<float> &m, int64_t L, int64_t rows,
                                 int64_t cols) {
  std::vector<float> t(m.size());
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        t[size_t((l * cols + j) * rows + i)] = m[size_t((l * rows + i) * cols + j)];
  return t;
}

/// C[l] = scale * op(A[l]) op(B[l]) of L experts, in double: A [L, m, k]
/// (or [L, k, m] with transA), B [L, k, n] (or [L, n, k] with transB).
std::vector<double> expertProducts(const std::vector<float> &a, const std::vector<float> &b,
                                   int64_t L, int64_t m, int64_t k, int64_t n, bool transA,
                                   bool transB, double scale) {
  std::vector<double> c(size_t(L * m * n));
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0;
        for (int64_t p = 0; p < k; ++p)
          sum += double(a[size_t(l * m * k + (transA ? p * m + i : i * k + p))]) *
                 double(b[size_t(l * k * n + (transB ? j * k + p : p * n + j))]);
        c[size_t((l * m + i) * n + j)] = scale * sum;
      }
  return c;
}

} // namespace

TEST_CASE("LoRA adapters, on a dense and on an FP8 base: the dense layer on the merged weights",
          "[runtime][gpu]") {
  // Y = X (W + s A B) with the base W frozen: the LoRA binaries' y, dx and
  // dtopk_weights are the full layer's on the merged weights W + s A B,
  // and the adapters' gradients follow from its weight gradient dW:
  // dA = s dW B^T, dB = s A^T dW. The base is dense ([L, H, 2I]) or FP8
  // blocks stored [out, in] (its dequantized values merged).
  for (const bool fp8 : {false, true})
    for (const bool bf16 : {false, true}) {
      Case c;
      c.ranks = groupSize(2);
      c.hidden = 128;
      c.inter = 128;
      c.seq = 64;
      c.bf16 = bf16;
      c.routing = Routing::Skewed;
      c.capacityFactor = 2 * c.ranks;
      INFO((fp8 ? "fp8 base " : "dense base ") << c.describe());
      if (!runs(c.ranks))
        return;
      const auto [full, fullBwd] = compile(c);
      Case lc = c;
      lc.loraRank = 8;
      lc.loraAlpha = 16;
      const double scaling = 2.0;
      const auto [fwd, bwd] =
          fp8 ? compile(lc, "graphs/moe_ffn_fwd_lora_transposed_fp8.json",
                        "graphs/moe_ffn_bwd_lora_transposed_fp8.json")
              : compile(lc, "graphs/moe_ffn_fwd_lora.json", "graphs/moe_ffn_bwd_lora.json");
      REQUIRE(bwd->shape().loraTargets == 3);
      const int64_t H = c.hidden, I = c.inter, L = c.localExperts, r = lc.loraRank;
      const Inputs in = makeInputs(c, 23);
      Run merged = prepare(c, in, fullBwd->shape()), lora = prepare(c, in, bwd->shape());
      std::vector<QuantizedWeight> q1, q2;
      if (fp8) {
        Run base = prepare(c, in, bwd->shape());
        std::tie(q1, q2) = quantizeRun(c, fwd->shape(), base); // base: dequantized, [out, in]
        for (uint32_t k = 0; k < c.ranks; ++k) {
          lora.w1[k] = Stored(transposeEach(base.w1[k].values(), L, 2 * I, H), bf16);
          lora.w2[k] = Stored(transposeEach(base.w2[k].values(), L, H, I), bf16);
        }
      }
      // Adapters of every rank, and the merged weights.
      std::mt19937 gen(41);
      std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
      const auto draw = [&](size_t n, double over) {
        std::vector<float> v(n);
        for (float &x : v)
          x = float(uniform(gen) / over);
        return Stored(v, bf16).values();
      };
      std::vector<std::array<std::vector<float>, 4>> adapters(c.ranks); // A1, B1, A2, B2
      std::vector<std::array<Stored, 4>> grads(c.ranks);
      for (uint32_t k = 0; k < c.ranks; ++k) {
        auto &[a1, b1, a2, b2] = adapters[k];
        a1 = draw(size_t(L * H * r), std::sqrt(double(H)));
        b1 = draw(size_t(L * r * 2 * I), 4 * std::sqrt(double(r)));
        a2 = draw(size_t(L * I * r), std::sqrt(double(I)));
        b2 = draw(size_t(L * r * H), 4 * std::sqrt(double(r)));
        for (const auto &[w, a, b, K, N] : {std::tuple{&merged.w1[k], &a1, &b1, H, 2 * I},
                                            std::tuple{&merged.w2[k], &a2, &b2, I, H}}) {
          const std::vector<double> ab = expertProducts(*a, *b, L, K, r, N, false, false, scaling);
          std::vector<float> m = (w == &merged.w1[k] ? lora.w1[k] : lora.w2[k]).values();
          for (size_t e = 0; e < m.size(); ++e)
            m[e] = float(m[e] + ab[e]);
          *w = Stored(m, bf16);
        }
        const DType grad = bwd->shape().weightGrads;
        for (int g = 0; g < 4; ++g)
          grads[k][g] = Stored(adapters[k][g].size(), grad == DType::BF16, -7.0f);
      }
      std::unique_ptr<Context> mctx, lctx;
      REQUIRE(makeContext(full, fullBwd, {}, &mctx).ok());
      REQUIRE(bindAll(*mctx, c, merged).ok());
      runPasses(*mctx);
      REQUIRE(makeContext(fwd, bwd, {}, &lctx).ok());
      const uint32_t first = lctx->firstLocalRank(), count = lctx->localRanks();
      std::vector<std::array<Stored, 4>> bound(c.ranks); // the adapters as the layer reads them
      for (uint32_t k = first; k < first + count; ++k) {
        const DType act = bf16 ? DType::BF16 : DType::F32;
        std::array<Stored, 4> &A = bound[k];
        for (int g = 0; g < 4; ++g)
          A[g] = Stored(adapters[k][g], bf16);
        std::vector<std::pair<const char *, moec::rt::Tensor>> extra = {
            {"lora_a1", makeTensor(A[0].data(), act, {L, H, r})},
            {"lora_b1", makeTensor(A[1].data(), act, {L, r, 2 * I})},
            {"lora_a2", makeTensor(A[2].data(), act, {L, I, r})},
            {"lora_b2", makeTensor(A[3].data(), act, {L, r, H})},
            {"dlora_a1", makeTensor(grads[k][0].data(), grads[k][0].dtype(), {L, H, r})},
            {"dlora_b1", makeTensor(grads[k][1].data(), grads[k][1].dtype(), {L, r, 2 * I})},
            {"dlora_a2", makeTensor(grads[k][2].data(), grads[k][2].dtype(), {L, I, r})},
            {"dlora_b2", makeTensor(grads[k][3].data(), grads[k][3].dtype(), {L, r, H})}};
        if (fp8) {
          extra.push_back({"w1_scale", q1[k].scalesTensor()});
          extra.push_back({"w2_scale", q2[k].scalesTensor()});
          bindRank(*lctx, c, lora, k, q1[k].codesTensor(fwd->shape()),
                   q2[k].codesTensor(fwd->shape()), extra);
        } else {
          bindRank(*lctx, c, lora, k, makeTensor(lora.w1[k].data(), act, {L, H, 2 * I}),
                   makeTensor(lora.w2[k].data(), act, {L, I, H}), extra);
        }
      }
      runPasses(*lctx);
      const double tol = bf16 ? 3e-2 : 1e-4;
      checkClose(lora, merged, first, count, tol);
      for (uint32_t k = first; k < first + count; ++k) {
        INFO("rank " << k);
        const auto &[a1, b1, a2, b2] = adapters[k];
        const std::vector<float> dw1 = merged.dw1[k].values(), dw2 = merged.dw2[k].values();
        // dA = s dW B^T ([K, N] x [N, r]); dB = s A^T dW ([r, K] x [K, N]).
        CHECK(relError(grads[k][0].values(),
                       expertProducts(dw1, b1, L, H, 2 * I, r, false, true, scaling)) < tol);
        CHECK(relError(grads[k][1].values(),
                       expertProducts(a1, dw1, L, r, H, 2 * I, true, false, scaling)) < tol);
        CHECK(relError(grads[k][2].values(),
                       expertProducts(dw2, b2, L, I, H, r, false, true, scaling)) < tol);
        CHECK(relError(grads[k][3].values(),
                       expertProducts(a2, dw2, L, r, I, H, true, false, scaling)) < tol);
      }
    }
}

TEST_CASE("quantized weights' scales out of range and zero points outside 0..15 are refused, "
          "naming where",
          "[runtime][gpu]") {
  // Rank 1's scales hold a bad value (under MPI in its process only); every
  // rank's forward (and a backward after a good forward) stops with rank 1's
  // message, outputs untouched; the good value back, both passes run.
  struct Bad {
    const char *format;   ///< kQuantizedFormats' name
    bool w2;              ///< w2_scale, else w1_scale
    int64_t expert, row, col; ///< FP8: block [row, col]; int4: group col
    bool zeroPoint;       ///< the zero point of the pair, else the scale
    float value;
    const char *text;     ///< the message, after "rank 1: "
  };
  const float inf = std::numeric_limits<float>::infinity();
  const Bad bads[] = {
      {"int4_g32_zp", true, 1, 3, 0, true, 16.0f,
       "tensor 'w2_scale' (int4 zero points) holds 16 at local expert 1, row 3, group 0; a zero "
       "point must be a finite number from 0 to 15"},
      {"int4_g32_zp", false, 0, 5, 2, true, -1.0f,
       "tensor 'w1_scale' (int4 zero points) holds -1 at local expert 0, row 5, group 2; a zero "
       "point must be a finite number from 0 to 15"},
      {"int4_g32_zp", false, 1, 0, 1, true, std::nanf(""),
       "tensor 'w1_scale' (int4 zero points) holds nan at local expert 1, row 0, group 1; a zero "
       "point must be a finite number from 0 to 15"},
      {"int4_g32_zp", true, 0, 7, 0, false, 0.0f,
       "tensor 'w2_scale' (int4 group scales) holds 0 at local expert 0, row 7, group 0; a scale "
       "must be a finite positive number"},
      {"int4_g64", false, 1, 2, 1, false, -0.5f,
       "tensor 'w1_scale' (int4 group scales) holds -0.5 at local expert 1, row 2, group 1; a "
       "scale must be a finite positive number"},
      {"int8", true, 1, 5, 0, false, 0.0f,
       "tensor 'w2_scale' (int8 row scales) holds 0 at local expert 1, row 5; a scale must be a "
       "finite positive number"},
      {"int8", false, 0, 9, 0, false, -inf,
       "tensor 'w1_scale' (int8 row scales) holds -inf at local expert 0, row 9; a scale must be "
       "a finite positive number"},
      {"fp8_block128", false, 1, 1, 0, false, std::nanf(""),
       "tensor 'w1_scale' (FP8 block scales) holds nan at local expert 1, block [1, 0]; a scale "
       "must be a finite positive number"},
  };
  for (const Bad &bad : bads) {
    const QuantizedFormat &format = *std::find_if(
        std::begin(kQuantizedFormats), std::end(kQuantizedFormats),
        [&](const QuantizedFormat &f) { return std::string(f.name) == bad.format; });
    Case c = quantizedCase(format);
    INFO(bad.text);
    if (!runs(c.ranks))
      return;
    auto [fwd, bwd] = compileQuantized(c, format);
    const moec::rt::LayerShape &shape = fwd->shape();
    const Inputs in = makeInputs(c, 29);
    Run run = prepare(c, in, bwd->shape());
    auto [q1, q2] = quantizeRun(c, shape, run);
    std::unique_ptr<Context> ctx;
    REQUIRE(makeContext(fwd, bwd, {}, &ctx).ok());
    for (uint32_t r = ctx->firstLocalRank(); r < ctx->firstLocalRank() + ctx->localRanks(); ++r)
      bindRank(*ctx, c, run, r, q1[r].codesTensor(shape), q2[r].codesTensor(shape),
               {{"w1_scale", q1[r].scalesTensor()}, {"w2_scale", q2[r].scalesTensor()}});
    // The element of rank 1's scales: [L, d1, n] or [L, d1, n, 2] (int4
    // with zero points), [L, d1] (int8), [L, blocks, blocks] (FP8).
    QuantizedWeight &w = bad.w2 ? q2[1] : q1[1];
    const std::vector<int64_t> &d = w.scaleDims;
    REQUIRE(bad.expert < d[0]);
    REQUIRE(bad.row < d[1]);
    int64_t at = bad.expert * d[1] + bad.row;
    if (d.size() >= 3) {
      REQUIRE(bad.col < d[2]);
      at = at * d[2] + bad.col;
    }
    if (d.size() == 4)
      at = at * 2 + (bad.zeroPoint ? 1 : 0);
    const float good = w.scales[size_t(at)];
    const std::string message = std::string("rank 1: ") + bad.text;
    const Run pristine = run;
    w.scales[size_t(at)] = bad.value;
    Status f = ctx->forward();
    CHECK_FALSE(f.ok());
    CHECK_THAT(f.message(), Catch::Contains(message));
    CHECK(run.sameOutputs(pristine));
    w.scales[size_t(at)] = good;
    REQUIRE(ctx->forward().ok());
    w.scales[size_t(at)] = bad.value;
    Status b = ctx->backward();
    CHECK_FALSE(b.ok());
    CHECK_THAT(b.message(), Catch::Contains(message));
    w.scales[size_t(at)] = good;
    runPasses(*ctx);
  }
}

TEST_CASE("a binary whose event is never reached ends in an error naming the wait", "[runtime][gpu]") {
  Case c;
  c.ranks = groupSize(2);
  auto [fwd, bwd] = compile(c);
  // The first task of a queue also waits for the final value of an event
  // that a later task of the same queue signals: it can never run.
  moec::format::TaskProgram bad = fwd->tasks();
  uint32_t first = 0, event = 0;
  bool found = false;
  for (const moec::format::QueueRecord &q : bad.queues) {
    for (uint32_t e = q.entryCount; e-- > 1 && !found;) {
      const moec::format::TaskRecord &later = bad.tasks[bad.queueEntries[q.firstEntry + e]];
      for (uint32_t i = 0; i < later.signalCount && !found; ++i)
        if (bad.signals[later.firstSignal + i].peerOffset == 0) {
          first = bad.queueEntries[q.firstEntry];
          event = bad.signals[later.firstSignal + i].event;
          found = true;
        }
    }
    if (found)
      break;
  }
  REQUIRE(found);
  moec::format::TaskRecord &task = bad.tasks[first];
  std::vector<moec::format::WaitRecord> waits(bad.waits.begin() + task.firstWait,
                                              bad.waits.begin() + task.firstWait + task.waitCount);
  waits.insert(waits.begin(), {event, bad.events[event].threshold});
  task.firstWait = uint32_t(bad.waits.size());
  task.waitCount = uint32_t(waits.size());
  bad.waits.insert(bad.waits.end(), waits.begin(), waits.end());
  std::shared_ptr<const Program> program;
  Status created = Program::create(std::move(bad), &program);
  INFO(created.message());
  REQUIRE(created.ok());

  const Inputs in = makeInputs(c, 3);
  ContextOptions options;
  // A timeout of 0 is the default in the C++ API as in the C API; out of
  // range is refused with the range and the default.
  std::unique_ptr<Context> ctx;
  options.timeoutSeconds = 0;
  REQUIRE(makeContext(program, bwd, options, &ctx).ok());
  CHECK(ctx->timeoutSeconds() == moec::kDefaultTimeoutSeconds);
  for (double bad : {-1.0, 1e-9, 1e7, std::nan("")}) {
    options.timeoutSeconds = bad;
    const Status refused = makeContext(program, bwd, options, &ctx);
    CHECK_THAT(refused.message(), Catch::Contains("from 0.001 to 1000000 seconds, or 0 for the "
                                                  "default (60)"));
  }
  options.timeoutSeconds = 2;
  REQUIRE(makeContext(program, bwd, options, &ctx).ok());
  CHECK(ctx->timeoutSeconds() == 2);
  Run run = prepare(c, in, bwd->shape());
  REQUIRE(bindAll(*ctx, c, run).ok());
  const Status f = ctx->forward();
  REQUIRE_FALSE(f.ok());
  INFO(f.message());
  CHECK_THAT(f.message(), Catch::Contains("task " + std::to_string(first) + " (op '"));
  CHECK_THAT(f.message(), Catch::Contains("waits for event " + std::to_string(event) + " '"));
  CHECK_THAT(f.message(), Catch::Contains("rank "));
}

TEST_CASE("backends register themselves, with what each lacks", "[runtime]") {
  using moec::backend::Feature;
  using moec::backend::Kind;
  const std::vector<const moec::backend::BackendInfo *> all = moec::backend::registeredBackends();
  REQUIRE(all.size() == 2);
  CHECK(all[0]->kind == Kind::Cpu);
  CHECK(all[1]->kind == Kind::Cuda);
  CHECK(moec::backend::backendNames() == "cpu or cuda");
  CHECK(moec::backend::findBackend("cuda") == all[1]);
  CHECK(moec::backend::findBackend("tpu") == nullptr);
  const moec::backend::BackendInfo *cuda = nullptr;
  REQUIRE(moec::backend::lookupBackend(Kind::Cuda, &cuda).ok());
  CHECK(cuda == all[1]);
  // The cuda backend keeps quantized weights decoded (its packed-weight store).
  CHECK(all[1]->has(Feature::PackedWeights));
  CHECK(moec::backend::backendsWith(Feature::PackedWeights) == "cpu or cuda");
  for (Feature f : {Feature::MultiProcess, Feature::OpByOp, Feature::TaskTrace, Feature::Exchange,
                    Feature::SlotItems}) {
    INFO(moec::backend::featureName(f));
    CHECK(all[0]->has(f)); // the CPU backend has everything
    CHECK(moec::backend::requireFeature(Kind::Cpu, f).ok());
    CHECK_FALSE(all[1]->has(f));
    CHECK(moec::backend::backendsWith(f) == "cpu");
  }
  CHECK(moec::backend::requireFeature(Kind::Cuda, Feature::OpByOp).message() ==
        "the op-by-op schedule runs on the cpu backend only");
  // Every backend makes its Backend through the registry.
  for (const moec::backend::BackendInfo *b : all) {
    moec::backend::BackendOptions options;
    options.workers = 2;
    const std::unique_ptr<moec::backend::Backend> made = b->create(options);
    REQUIRE(made != nullptr);
    CHECK(made->kind() == b->kind);
  }
}

TEST_CASE("the cuda backend refuses what it does not do, before it looks for a GPU", "[runtime]") {
  Case c;
  c.ranks = groupSize(2);
  auto [fwd, bwd] = compile(c);
  const auto refusal = [&](ContextOptions options) {
    options.backend = moec::backend::Kind::Cuda;
    bool yes = false;
    options.fabric = moec::test::testFabric(fwd->shape().ranks, &yes);
    std::unique_ptr<Context> ctx;
    const Status s = Context::create(fwd, bwd, options, &ctx);
    CHECK(ctx == nullptr);
    return s.message();
  };
  ContextOptions opByOp;
  opByOp.schedule = Schedule::OpByOp;
  CHECK_THAT(refusal(opByOp), Catch::Contains("the op-by-op schedule runs on the cpu backend only"));
  ContextOptions traced;
  traced.trace = true;
  if (std::string(moec::test::testFabricName()) == "in-process")
    CHECK_THAT(refusal(traced),
               Catch::Contains("the cuda backend records no task trace (the cpu backend does)"));
  else
    CHECK_THAT(refusal(traced), Catch::Contains("it does not run under MPI"));
  // FP8 dispatch: no quantize or dequantize kernels there.
  Case fp8 = c;
  fp8.fp8Dispatch = true;
  std::tie(fwd, bwd) = compile(fp8);
  REQUIRE(fwd->shape().fp8Dispatch);
  if (std::string(moec::test::testFabricName()) == "in-process")
    CHECK_THAT(refusal(ContextOptions()), Catch::Contains("the cuda backend has no FP8 dispatch"));
  // LoRA adapters compiled for the cpu target: each adapter's second GMM
  // fused into its base's (a low-rank product), which the cuda tiles lack.
  Case lora = c;
  lora.loraRank = 4;
  lora.loraAlpha = 8;
  std::tie(fwd, bwd) =
      compile(lora, "graphs/moe_ffn_fwd_lora.json", "graphs/moe_ffn_bwd_lora.json");
  REQUIRE(fwd->shape().loraTargets == 3);
  if (std::string(moec::test::testFabricName()) == "in-process")
    CHECK_THAT(refusal(ContextOptions()),
               Catch::Contains("op 'up_proj' adds a LoRA adapter's rank-r product inside its "
                               "base's GMM (compiled for the 'cpu' target), which the cuda "
                               "backend does not run"));
}

TEST_CASE("an FP8 forward binary is refused when its quantize chain is broken", "[runtime]") {
  Case c;
  c.ranks = groupSize(2);
  c.fp8Dispatch = true;
  const std::shared_ptr<const Program> fwd = compile(c).first;
  REQUIRE(fwd->shape().fp8Dispatch);
  const auto refusal = [](moec::format::TaskProgram program) {
    std::shared_ptr<const Program> out;
    const Status s = Program::create(std::move(program), &out);
    CHECK(out == nullptr);
    return s.message();
  };
  const moec::format::TaskProgram &good = fwd->tasks();
  uint32_t dequantize = 0;
  for (uint32_t i = 0; i < good.ops.size(); ++i)
    if (good.ops[i].kind == moec::format::OpKind::Dequantize)
      dequantize = i;
  // Two quantizes and no dequantize.
  moec::format::TaskProgram p = good;
  p.ops[dequantize].kind = moec::format::OpKind::Quantize;
  p.tilings[p.ops[dequantize].tiling].opKind = moec::format::OpKind::Quantize;
  CHECK_THAT(refusal(p), Catch::Contains("expected a quantize and a dequantize around the "
                                         "forward's dispatch, or neither"));
  // Quantized rows of the wrong width.
  p = good;
  const uint32_t sent = p.tilings[p.ops[dequantize].tiling].inputSlots[0];
  p.slots[sent].dims[1] -= 4;
  CHECK_THAT(refusal(p), Catch::Contains("(quantized dispatched rows) has shape"));
}

TEST_CASE("expert tensor parallelism: TP ranks agree on the bits, and must route alike",
          "[runtime]") {
  // EP x 2 TP ranks: 2 x 2 in process, the job's size under MPI when even.
  const uint32_t R = groupSize(4);
  if (R % 2 != 0)
    return;
  Case c;
  c.ranks = R / 2;
  c.tp = 2;
  c.inter = 24; // 12 columns per TP rank
  c.seq = 64;
  auto [fwd, bwd] = compile(c);
  REQUIRE(fwd->shape().ranks == R);
  REQUIRE(fwd->shape().tp == 2);
  REQUIRE(fwd->shape().inter == 12);
  std::unique_ptr<Context> ctx;
  REQUIRE(makeContext(fwd, bwd, {}, &ctx).ok());
  const int64_t S = c.seq, H = c.hidden, I = 12, L = c.localExperts, K = c.topK;
  // Every rank: its EP rank's tokens (the same on its TP ranks) and any
  // weights of its slice's shape.
  const Inputs in = makeInputs(c, 9);
  std::vector<std::vector<float>> x(R), y(R, std::vector<float>(size_t(S * H), -7.0f)),
      w1(R), w2(R), weights(R);
  std::vector<std::vector<int64_t>> ids(R);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> uni(-0.2f, 0.2f);
  const auto bindRank = [&](uint32_t r) {
    x[r] = in.x[r / 2];
    ids[r] = in.ids[r / 2];
    weights[r] = in.weights[r / 2];
    w1[r].resize(size_t(L * H * 2 * I));
    w2[r].resize(size_t(L * I * H));
    for (float &v : w1[r])
      v = uni(rng);
    for (float &v : w2[r])
      v = uni(rng);
    for (const auto &[name, tensor] :
         {std::pair<const char *, moec::rt::Tensor>{"x", makeTensor(x[r].data(), DType::F32, {S, H})},
          {"y", makeTensor(y[r].data(), DType::F32, {S, H})},
          {"w1", makeTensor(w1[r].data(), DType::F32, {L, H, 2 * I})},
          {"w2", makeTensor(w2[r].data(), DType::F32, {L, I, H})}})
      REQUIRE(ctx->bind(r, name, tensor).ok());
    REQUIRE(ctx->setRouting(r, makeTensor(ids[r].data(), DType::I64, {S, K}),
                            makeTensor(weights[r].data(), DType::F32, {S, K}))
                .ok());
  };
  for (uint32_t r = ctx->firstLocalRank(); r < ctx->firstLocalRank() + ctx->localRanks(); ++r)
    bindRank(r);

  SECTION("the TP ranks of an EP rank end with the same bits of y") {
    Status s = ctx->forward();
    INFO(s.message());
    REQUIRE(s.ok());
    // Gathered on rank 0's process: every rank's y.
    std::vector<float> all(size_t(R * S * H));
    const size_t mine = size_t(S * H) * ctx->localRanks();
    std::vector<float> local(mine);
    for (uint32_t i = 0; i < ctx->localRanks(); ++i)
      std::copy(y[ctx->firstLocalRank() + i].begin(), y[ctx->firstLocalRank() + i].end(),
                local.begin() + i * S * H);
    REQUIRE(ctx->fabric().gather(local.data(), size_t(S * H) * sizeof(float), all.data()).ok());
    if (ctx->fabric().isLocal(0))
      for (uint32_t r = 1; r < R; r += 2)
        CHECK(std::equal(all.begin() + r * S * H, all.begin() + (r + 1) * S * H,
                         all.begin() + (r - 1) * S * H));
    CHECK(std::none_of(y[ctx->firstLocalRank()].begin(), y[ctx->firstLocalRank()].end(),
                       [](float v) { return v == -7.0f; }));
  }
  SECTION("a TP rank routing other tokens is refused before anything is written") {
    if (ctx->fabric().isLocal(1)) {
      weights[1][5] += 0.25f; // TP rank 1 of EP rank 0: other top-k weights
      REQUIRE(ctx->setRouting(1, makeTensor(ids[1].data(), DType::I64, {S, K}),
                              makeTensor(weights[1].data(), DType::F32, {S, K}))
                  .ok());
    }
    Status s = ctx->forward();
    CHECK_FALSE(s.ok());
    CHECK_THAT(s.message(), Catch::Contains("rank 1 (EP rank 0, TP rank 1) routes other tokens "
                                            "than rank 0 (TP rank 0)"));
    CHECK_THAT(s.message(), Catch::Contains("the same sizes, other expert ids or weights"));
    for (uint32_t r = ctx->firstLocalRank(); r < ctx->firstLocalRank() + ctx->localRanks(); ++r)
      CHECK(std::all_of(y[r].begin(), y[r].end(), [](float v) { return v == -7.0f; }));
  }
}

TEST_CASE("a TP binary whose combine disagrees with its TP ranks is refused", "[runtime]") {
  Case c;
  c.ranks = 1;
  c.tp = 2;
  if (!runs(2))
    return;
  const moec::format::TaskProgram good = compile(c).first->tasks();
  const auto refusal = [](moec::format::TaskProgram program) {
    std::shared_ptr<const Program> out;
    const Status s = Program::create(std::move(program), &out);
    CHECK(out == nullptr);
    return s.message();
  };
  uint32_t combine = 0;
  for (uint32_t i = 0; i < good.ops.size(); ++i)
    if (good.ops[i].kind == moec::format::OpKind::Combine)
      combine = i;
  // Events whose thresholds are the sums of their signals again (each
  // counted once per rank it reaches), so that the reader passes the
  // program and the layer check is what refuses it.
  const auto rethreshold = [](moec::format::TaskProgram &q) {
    std::vector<uint32_t> sums(q.events.size(), 0);
    for (const moec::format::TaskRecord &task : q.tasks)
      for (uint32_t k = 0; k < task.signalCount; ++k) {
        const moec::format::SignalRecord &signal = q.signals[task.firstSignal + k];
        sums[signal.event] += signal.increment * (q.fansOut(task.op) ? q.tpRanks : 1);
      }
    for (moec::format::WaitRecord &wait : q.waits)
      if (wait.threshold == q.events[wait.event].threshold)
        wait.threshold = sums[wait.event];
    for (size_t e = 0; e < q.events.size(); ++e)
      q.events[e].threshold = sums[e];
  };
  moec::format::TaskProgram p = good;
  p.tilings[p.ops[combine].tiling].flags &= uint8_t(~moec::format::kTilingReduceTp);
  CHECK_THAT(refusal(p), Catch::Contains("its signals add up to"));
  rethreshold(p);
  CHECK_THAT(refusal(p), Catch::Contains("op 'combine' (combine): the binary runs on 2 TP ranks, "
                                         "whose rows it returns are partial sums, but it does not "
                                         "reduce over them"));
  p = good;
  p.tpRanks = 1;
  rethreshold(p);
  CHECK_THAT(refusal(p), Catch::Contains("op 'combine' (combine) reduces over TP, but the binary "
                                         "has 1 TP rank"));
}

