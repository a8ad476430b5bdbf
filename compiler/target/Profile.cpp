//===- Profile.cpp - Device profiles --------------------------------------===//

#include "compiler/target/Profile.h"

#include "compiler/support/Expr.h"
#include "compiler/support/Json.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <thread>

namespace moec::target {

namespace {

uint32_t hardwareThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

TargetProfile cpuProfile() {
  TargetProfile p;
  p.name = "cpu";
  p.cubeCores = p.vectorCores = hardwareThreads();
  p.tileM = p.tileN = p.tileK = 64;
  p.cubeFlops = 20e9;   // fp32 matmul of one core, sustained
  p.vectorBytes = 8e9;  // streaming element-wise work of one core
  p.linkBytes = 8e9;    // an in-process put is a memcpy
  p.taskOverhead = 2e-6;
  return p;
}

TargetProfile ascend910bProfile() {
  TargetProfile p;
  p.name = "ascend-910b";
  p.cubeCores = 24; // AIC
  p.vectorCores = 48; // AIV
  p.tileM = 128;
  p.tileN = 256;
  p.tileK = 64;
  p.cubeFlops = 13e12;   // ~313 TFLOP/s bf16 over 24 AIC
  p.vectorBytes = 33e9;  // ~1.6 TB/s HBM over 48 AIV
  p.linkBytes = 28e9;    // one HCCS put
  p.taskOverhead = 1e-6;
  return p;
}

TargetProfile h100Profile() {
  TargetProfile p;
  p.name = "h100";
  p.cubeCores = 132; // an SM runs either kind of task
  p.vectorCores = 132;
  p.tileM = 128;
  p.tileN = 128;
  p.tileK = 64;
  p.cubeFlops = 7.5e12; // ~989 TFLOP/s bf16 over 132 SMs
  p.vectorBytes = 25e9; // ~3.35 TB/s HBM over 132 SMs
  p.linkBytes = 50e9;   // one NVLink put
  p.taskOverhead = 2e-6;
  return p;
}

} // namespace

const std::vector<std::string> &builtinProfileNames() {
  static const std::vector<std::string> names = {"cpu", "ascend-910b", "h100"};
  return names;
}

Status builtinProfile(const std::string &name, TargetProfile *out) {
  if (name == "cpu")
    *out = cpuProfile();
  else if (name == "ascend-910b")
    *out = ascend910bProfile();
  else if (name == "h100")
    *out = h100Profile();
  else {
    std::string message = fmt::format("unknown target '{}' (known: cpu, ascend-910b, h100, or a "
                                      "profile JSON file)",
                                      name);
    std::string close = closestName(name, builtinProfileNames(), 3);
    if (!close.empty())
      message += fmt::format("; did you mean '{}'?", close);
    return Status::error(message);
  }
  return Status::success();
}

Status parseProfile(const std::string &text, const std::string &source, TargetProfile *out) {
  nlohmann::json json;
  std::string error;
  if (!parseJson(text, source, &json, &error))
    return Status::error(error);
  auto fail = [&](const std::string &message) {
    return Status::error(fmt::format("{}: {}", source, message));
  };
  if (!json.is_object())
    return fail(fmt::format("a target profile is a JSON object, got {}", json.type_name()));
  static const std::vector<std::string> keys = {
      "name",      "cube_cores",  "vector_cores", "tile_m",   "tile_n",
      "tile_k",    "cube_tflops", "vector_gbps",  "link_gbps", "task_overhead_us"};
  for (const auto &item : json.items())
    if (std::find(keys.begin(), keys.end(), item.key()) == keys.end()) {
      std::string message = fmt::format("unknown key '{}'", item.key());
      std::string close = closestName(item.key(), keys);
      if (!close.empty())
        message += fmt::format(" (did you mean '{}'?)", close);
      return fail(message);
    }
  for (const char *key : {"name", "cube_cores", "vector_cores"})
    if (!json.contains(key))
      return fail(fmt::format("missing required key '{}'", key));
  if (!json["name"].is_string() || json["name"].get<std::string>().empty())
    return fail(fmt::format("'name' must be a non-empty string, got {}", json["name"].dump()));

  TargetProfile p; // rates default to the cpu profile's
  TargetProfile cpu = cpuProfile();
  p.tileM = cpu.tileM;
  p.tileN = cpu.tileN;
  p.tileK = cpu.tileK;
  p.cubeFlops = cpu.cubeFlops;
  p.vectorBytes = cpu.vectorBytes;
  p.linkBytes = cpu.linkBytes;
  p.taskOverhead = cpu.taskOverhead;
  p.name = json["name"].get<std::string>();

  struct Count {
    const char *key;
    uint32_t *field;
  };
  for (Count c : {Count{"cube_cores", &p.cubeCores}, Count{"vector_cores", &p.vectorCores},
                  Count{"tile_m", &p.tileM}, Count{"tile_n", &p.tileN},
                  Count{"tile_k", &p.tileK}}) {
    auto it = json.find(c.key);
    if (it == json.end())
      continue;
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > 1 << 20)
      return fail(fmt::format("'{}' must be an integer in 1..{}, got {}", c.key, 1 << 20,
                              it->dump()));
    *c.field = uint32_t(it->get<int64_t>());
  }
  struct Rate {
    const char *key;
    double *field;
    double scale;
  };
  for (Rate r : {Rate{"cube_tflops", &p.cubeFlops, 1e12}, Rate{"vector_gbps", &p.vectorBytes, 1e9},
                 Rate{"link_gbps", &p.linkBytes, 1e9},
                 Rate{"task_overhead_us", &p.taskOverhead, 1e-6}}) {
    auto it = json.find(r.key);
    if (it == json.end())
      continue;
    bool overhead = r.field == &p.taskOverhead;
    if (!it->is_number() || it->get<double>() < 0 || (!overhead && it->get<double>() == 0))
      return fail(fmt::format("'{}' must be a {} number, got {}", r.key,
                              overhead ? "non-negative" : "positive", it->dump()));
    *r.field = it->get<double>() * r.scale;
  }
  *out = p;
  return Status::success();
}

Status resolveProfile(const std::string &spec, TargetProfile *out) {
  bool isFile = spec.find('/') != std::string::npos ||
                (spec.size() > 5 && spec.compare(spec.size() - 5, 5, ".json") == 0);
  if (!isFile)
    return builtinProfile(spec, out);
  std::string text, error;
  if (!readTextFile(spec, &text, &error))
    return Status::error(error);
  return parseProfile(text, spec, out);
}

} // namespace moec::target
