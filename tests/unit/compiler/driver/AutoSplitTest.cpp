//===- AutoSplitTest.cpp - Automatic splits across EP degrees -------------===//
//
// The shipped graphs leave their splits to the compiler. Compiled for
// deepseek-v3 and qwen3-30b-a3b at every expert-parallel degree, with only
// `ep` changed (every rank receives S * K rows on average at every degree),
// their simulated pass (the timed simulation with the shared link, as `moec
// dump` reports it) must stay near the best degree's, and no one chain of
// tiles may make up the pass. The seed-form graphs, hand-set for few
// experts per rank, collapse at EP 256; the chosen splits must not.
//
//===----------------------------------------------------------------------===//

#include "compiler/config/Config.h"
#include "compiler/driver/Compile.h"
#include "compiler/target/Cost.h"
#include "compiler/target/Profile.h"
#include "compiler/target/Simulate.h"
#include "format/TaskBinary.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <unistd.h>
#include <vector>

using namespace moec;

namespace {

struct Pass {
  double makespan = 0, criticalPath = 0; ///< seconds, simulated
  double estimate = 0;                   ///< seconds, the scheduler's makespan
  double compileMs = 0;
  uint64_t tasks = 0;
  format::TaskProgram program;
};

/// `config` (under examples/configs) with `ep` set, written to a file of
/// the test's temporary folder; returns its path.
std::string configWithEp(const std::string &config, int64_t ep) {
  std::ifstream in("examples/configs/" + config + ".json");
  nlohmann::json c = nlohmann::json::parse(in);
  c["ep"] = ep;
  const char *tmp = std::getenv("TEST_TMPDIR");
  std::string path = fmt::format("{}/{}-ep{}-{}.json", tmp ? tmp : "/tmp", config, ep, getpid());
  std::ofstream(path) << c.dump();
  return path;
}

/// The graph compiled for `config` at `ep` on `target`, and its timed
/// simulation with the profile's cost model.
Pass compile(const std::string &graph, const std::string &config, int64_t ep,
             const std::string &target) {
  driver::CompileOptions options;
  options.configPath = configWithEp(config, ep);
  options.target = target;
  driver::CompileResult result;
  const auto start = std::chrono::steady_clock::now();
  Status status = driver::compileGraphFile(graph, options, &result);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::remove(options.configPath.c_str());
  INFO(graph << " " << config << " ep " << ep << " " << target << ": " << status.message());
  REQUIRE(status.ok());
  target::TimedRun run =
      target::simulateTimed(result.program, target::costModel(result.program, result.profile));
  REQUIRE(run.ok());
  return {run.makespan, run.criticalPathSeconds, result.estimate.makespan, ms,
          result.program.tasks.size(), std::move(result.program)};
}

/// Every pass of `config` over `eps` on `target`: the worst ratio of a
/// degree's makespan to the best degree's, and the largest share of the
/// critical path in a makespan.
struct Spread {
  double worstRatio = 0, worstCriticalShare = 0;
  /// The worst ratio of a degree's makespan to the larger of the best
  /// degree's and its own link bound (linkBound()).
  double worstBoundRatio = 0;
  /// The largest gap between the scheduler's estimate and the simulation,
  /// as a share of the simulated makespan.
  double worstEstimateGap = 0;
};

/// The least time `config` at `ep` spends on the link of one rank in a
/// pass on `target`: the rows the dispatch and the combine move to other
/// ranks (S * K rows of H, (R - 1) / R of them remote under balanced
/// routing), over the rank's shared link rate; 0 without one.
double linkBound(const std::string &config, int64_t ep, const std::string &target) {
  std::ifstream in("examples/configs/" + config + ".json");
  const nlohmann::json c = nlohmann::json::parse(in);
  target::TargetProfile profile;
  REQUIRE(target::builtinProfile(target, &profile).ok());
  if (profile.linkTotalBytes <= 0)
    return 0;
  const double element = c.at("dtype") == "bf16" ? 2 : 4;
  const double rows = c.at("seq_size").get<double>() * c.at("top_k").get<double>();
  const double remote = rows * c.at("hidden_size").get<double>() * element * double(ep - 1) /
                        double(ep);
  return 2 * remote / profile.linkTotalBytes;
}

Spread spread(const std::string &graph, const std::string &config,
              const std::vector<int64_t> &eps, const std::string &target) {
  std::vector<Pass> passes;
  for (int64_t ep : eps)
    passes.push_back(compile(graph, config, ep, target));
  double best = passes[0].makespan;
  for (const Pass &p : passes)
    best = std::min(best, p.makespan);
  Spread s;
  for (size_t i = 0; i < passes.size(); ++i) {
    const Pass &p = passes[i];
    const double bound = linkBound(config, eps[i], target);
    UNSCOPED_INFO(fmt::format("{} {} ep {} {}: {} tasks, makespan {:.3f} ms ({:.2f}x the best; "
                              "link bound {:.3f} ms), critical path {:.0f}%, estimate {:.3f} ms, "
                              "compiled in {:.1f} ms",
                              graph, config, eps[i], target, p.tasks, p.makespan * 1e3,
                              p.makespan / best, bound * 1e3, 100 * p.criticalPath / p.makespan,
                              p.estimate * 1e3, p.compileMs));
    s.worstRatio = std::max(s.worstRatio, p.makespan / best);
    s.worstBoundRatio = std::max(s.worstBoundRatio, p.makespan / std::max(best, bound));
    s.worstCriticalShare = std::max(s.worstCriticalShare, p.criticalPath / p.makespan);
    s.worstEstimateGap = std::max(s.worstEstimateGap, std::abs(p.estimate / p.makespan - 1));
  }
  return s;
}

const std::vector<int64_t> kDeepseekEps = {8, 16, 32, 64, 128, 256};

} // namespace

TEST_CASE("deepseek-v3 on ascend-910b: the pass holds from EP 8 to EP 256",
          "[auto-split][scale]") {
  for (const char *graph : {"graphs/moe_ffn_fwd.json", "graphs/moe_ffn_bwd.json"}) {
    Spread s = spread(graph, "deepseek-v3", kDeepseekEps, "ascend-910b");
    CHECK(s.worstRatio <= 1.25);
    CHECK(s.worstCriticalShare <= 0.40);
    // The scheduler sees the link the simulation shares out.
    CHECK(s.worstEstimateGap <= 0.02);
  }
}

TEST_CASE("deepseek-v3 on h100: the pass holds from EP 8 to EP 256", "[auto-split][scale]") {
  // With one or two experts a rank, peer groups let an expert's first tiles
  // start while later ranks' rows arrive, and the combine return a group's
  // rows as soon as they are done.
  for (const char *graph : {"graphs/moe_ffn_fwd.json", "graphs/moe_ffn_bwd.json"}) {
    Spread s = spread(graph, "deepseek-v3", kDeepseekEps, "h100");
    CHECK(s.worstRatio <= 1.25);
    CHECK(s.worstCriticalShare <= 0.40);
    // The scheduler sees the SMs that cube and vector tasks share and the
    // link, but not the order in which a freed SM takes the queues that
    // wait for one: its estimate is up to 15% short where peer groups make
    // many puts and tiles ready at once (the compiler simulates its
    // finalists for that reason).
    CHECK(s.worstEstimateGap <= 0.16);
  }
}

TEST_CASE("qwen3-30b-a3b from EP 2 to EP 128: near the best degree, or the link",
          "[auto-split][scale]") {
  // qwen3's experts are small (H 2048, I 768), so moving the rows is much of
  // the pass: at EP 2 half of a rank's rows stay on it, at EP 128 all but
  // 1/128 cross the link. Where the link alone (linkBound) takes longer than
  // the best degree's pass, the pass is held to the link's time instead.
  struct Goal {
    const char *target, *graph;
    double ratio, criticalShare;
  };
  const std::vector<int64_t> eps = {2, 4, 8, 16, 32, 64, 128};
  for (const Goal &goal : {
           Goal{"ascend-910b", "graphs/moe_ffn_fwd.json", 1.25, 0.40},
           Goal{"ascend-910b", "graphs/moe_ffn_bwd.json", 1.25, 0.40},
           Goal{"h100", "graphs/moe_ffn_fwd.json", 1.25, 0.40},
           Goal{"h100", "graphs/moe_ffn_bwd.json", 1.25, 0.40},
       }) {
    Spread s = spread(goal.graph, "qwen3-30b-a3b", eps, goal.target);
    INFO(goal.target << " " << goal.graph);
    CHECK(s.worstBoundRatio <= goal.ratio);
    CHECK(s.worstCriticalShare <= goal.criticalShare);
  }
}

TEST_CASE("automatic GMM tiles are whole blocks of the target's kernel", "[auto-split]") {
  // On h100 a CTA computes 128 x 128 blocks: a weight-gradient tile of 768 /
  // 11 rows would pay for 128 of them. qwen3's weights (768 x 2048 and 2048
  // x 1536) and its activation columns (768, 1536, 2048) all cut into whole
  // blocks; at EP 128 one expert a rank gives the weight gradients the most
  // tiles to choose among.
  for (const char *graph : {"graphs/moe_ffn_fwd.json", "graphs/moe_ffn_bwd.json"}) {
    Pass pass = compile(graph, "qwen3-30b-a3b", 128, "h100");
    int weightGradients = 0;
    for (const format::OpRecord &op : pass.program.ops) {
      if (op.kind != format::OpKind::Gmm)
        continue;
      const format::TilingRecord &t = pass.program.tilings[op.tiling];
      INFO(graph << " " << pass.program.name(op.name) << ": " << t.rows << " x " << t.cols
                 << " in " << t.rowTiles << " x " << t.colTiles << " tiles");
      CHECK(t.cols % (128 * uint64_t(t.colTiles)) == 0);
      if (t.depth == 0) { // a weight gradient: rows are the weight's
        ++weightGradients;
        CHECK(t.rows % (128 * uint64_t(t.rowTiles)) == 0);
        // Fewer tiles than one wave of the cube cores would leave SMs idle.
        CHECK(t.tileCount() >= 96);
      }
    }
    CHECK(weightGradients == (std::string(graph).find("bwd") != std::string::npos ? 2 : 0));
  }
}

TEST_CASE("the search's peer groups hold a GMM tile's rows at least", "[auto-split]") {
  // 4 experts a rank, 1024 rows a rank at top-1: 256 balanced rows an
  // expert. 8 groups would leave GMM tiles of 32 rows, which pack the whole
  // weight panel for each (measured 30% slower on a CPU than 128-row tiles),
  // so the search stops at 2 groups of 128 rows.
  const char *tmp = std::getenv("TEST_TMPDIR");
  const std::string path = fmt::format("{}/groups-{}.json", tmp ? tmp : "/tmp", getpid());
  std::ofstream(path) << R"({"name": "groups", "hidden_size": 1024, "intermediate_size": 512,
    "num_experts": 32, "top_k": 1, "ep": 8, "tp": 1, "seq_size": 1024, "dtype": "fp32"})";
  for (const char *target : {"cpu", "h100"}) {
    driver::CompileOptions options;
    options.configPath = path;
    options.target = target;
    driver::CompileResult result;
    REQUIRE(driver::compileGraphFile("graphs/moe_ffn_fwd.json", options, &result).ok());
    INFO(target << "\n" << driver::splitNotes(result));
    for (const driver::SplitCandidate &c : result.candidates)
      CHECK(c.peerGroups <= 2);
    for (const format::OpRecord &op : result.program.ops)
      if (!format::isPut(op.kind))
        CHECK(result.program.tilings[op.tiling].peers <= 2);
  }
  std::remove(path.c_str());
}

TEST_CASE("at EP 256 the chosen splits beat the seed's hand-set ones", "[auto-split][scale]") {
  for (const char *target : {"ascend-910b", "h100"}) {
    Pass seed = compile("graphs/seed/moe_ffn_fwd.json", "deepseek-v3", 256, target);
    Pass chosen = compile("graphs/moe_ffn_fwd.json", "deepseek-v3", 256, target);
    INFO(target << ": seed " << seed.makespan * 1e3 << " ms, chosen " << chosen.makespan * 1e3
                << " ms");
    // The seed's up_proj cuts 2^20 bound rows into tiles that hold at most a
    // few of the 32768 rows present: three cube cores do all the work.
    CHECK(chosen.makespan * 3 < seed.makespan);
    // The binary says what was tried.
    REQUIRE((chosen.program.flags & format::kFlagNotes) != 0);
    CHECK(std::string(chosen.program.name(chosen.program.notes)).find("automatic splits") == 0);
    // Every row-tiled op shares out its rows; weight gradients do not.
    for (const format::TilingRecord &t : chosen.program.tilings)
      CHECK(((t.flags & format::kTilingShareRows) != 0) == !(t.opKind == format::OpKind::Gmm &&
                                                             t.depth == 0));
  }
}
