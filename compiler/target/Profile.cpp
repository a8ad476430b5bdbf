//===- Profile.cpp - Device profiles --------------------------------------===//

#include "compiler/target/Profile.h"

#include "compiler/support/Expr.h"
#include "base/Json.h"
#include "base/File.h"
#include "base/Names.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <thread>

namespace moec::target {

namespace {

uint32_t hardwareThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

TargetProfile cpuProfile() {
  TargetProfile p;
  p.name = "cpu";
  p.cubeCores = p.vectorCores = hardwareThreads();
  p.tileM = p.tileN = p.tileK = 64;
  // Ballpark rates of one core of a recent x86 server; `moec bench
  // --calibrate` measures this machine's.
  p.cubeFlops = 80e9; // fp32 matmul, sustained
  p.cubeFlopsBf16 = 120e9;
  p.memoryBytes = 20e9;
  p.vectorBytes = 10e9; // a copy
  p.vectorElems = 1e9;  // SwiGLU's exp and divide make it compute-bound
  p.linkBytes = 10e9;   // an in-process put is a memcpy
  p.taskOverhead = 1e-6;
  p.sharing = CoreSharing::Group; // ranks are threads of one process
  return p;
}

TargetProfile ascend910bProfile() {
  TargetProfile p;
  p.name = "ascend-910b";
  p.cubeCores = 24;   // AIC
  p.vectorCores = 48; // AIV
  p.tileM = 128;
  p.tileN = 256;
  p.tileK = 64;
  p.padM = p.padN = p.padK = 16; // the cube unit's 16 x 16 x 16 fractal
  p.cubeFlopsBf16 = 13e12;       // ~313 TFLOP/s bf16 over 24 AIC
  p.cubeFlops = 6.5e12;          // fp32 through HF32, half the bf16 rate
  p.memoryBytes = 67e9;          // ~1.6 TB/s HBM over 24 AIC
  p.vectorBytes = 33e9;          // ~1.6 TB/s HBM over 48 AIV
  p.vectorElems = 64e9;          // 128 lanes at ~1 GHz, half the streaming rate's bound
  p.linkBytes = 28e9;            // one HCCS link
  p.linkTotalBytes = 196e9;      // 7 HCCS links
  p.taskOverhead = 1e-6;
  p.sharing = CoreSharing::None; // AIC and AIV are separate cores
  p.sharedCache = true;          // 192 MB of L2
  return p;
}

TargetProfile h100Profile() {
  TargetProfile p;
  p.name = "h100";
  p.cubeCores = 132; // SMs; an SM runs either kind of task, one at a time
  p.vectorCores = 132;
  p.tileM = 128;
  p.tileN = 128;
  p.tileK = 64;
  p.padM = 128; // a CTA computes whole 128 x 128 x 64 blocks
  p.padN = 128;
  p.padK = 64;
  p.cubeFlopsBf16 = 7.5e12; // ~989 TFLOP/s dense bf16 over 132 SMs
  p.cubeFlops = 3.75e12;    // fp32 through TF32, half the bf16 rate
  p.memoryBytes = 25e9;     // ~3.35 TB/s HBM over 132 SMs
  p.vectorBytes = 25e9;
  p.vectorElems = 60e9;     // 128 fp32 lanes at ~1.7 GHz, with exp: memory-bound
  p.linkBytes = 50e9;       // what one SM's copy into a peer reaches
  p.linkTotalBytes = 450e9; // NVLink 4, one direction
  p.taskOverhead = 2e-6;
  p.sharing = CoreSharing::Rank;
  p.sharedCache = true; // 50 MB of L2
  return p;
}

} // namespace

double paddedTo(double n, uint32_t granule) {
  const double g = std::max<uint32_t>(granule, 1);
  return std::ceil(n / g) * g;
}

namespace {
constexpr Named<CoreSharing> kCoreSharingNames[] = {
    {CoreSharing::None, "none"}, {CoreSharing::Rank, "rank"}, {CoreSharing::Group, "group"}};
} // namespace

const char *coreSharingName(CoreSharing sharing) { return nameIn(kCoreSharingNames, sharing, "?"); }

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
      "name",        "cube_cores",       "vector_cores", "tile_m",      "tile_n",
      "tile_k",      "pad_m",            "pad_n",        "pad_k",       "cube_tflops",
      "cube_tflops_bf16", "memory_gbps", "vector_gbps",  "vector_gelems", "link_gbps",   "link_total_gbps",
      "task_overhead_us", "core_sharing", "shared_cache", "calibrated"};
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

  TargetProfile p = cpuProfile(); // rates not given are the cpu profile's
  p.name = json["name"].get<std::string>();
  // A name goes into binaries and onto terminals: letters, digits, '.',
  // '_', '+' and '-' only.
  if (p.name.size() > 64 || !std::all_of(p.name.begin(), p.name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '+' ||
               c == '-';
      }))
    return fail(fmt::format("'name' must be 1 to 64 letters, digits, '.', '_', '+' or '-', got {}",
                            json["name"].dump()));
  // A binary records its profile's name, and `moec dump` resolves that name:
  // a file named like a built-in profile would be taken for the built-in one.
  const std::vector<std::string> &builtins = builtinProfileNames();
  if (std::find(builtins.begin(), builtins.end(), p.name) != builtins.end())
    return fail(fmt::format("'name' is '{}', the name of a built-in profile: binaries compiled "
                            "with this file would be taken for that profile's; give it a name "
                            "of its own (say '{}-calibrated')",
                            p.name, p.name));
  p.sharing = CoreSharing::None;
  p.calibrated.clear();

  struct Count {
    const char *key;
    uint32_t *field;
  };
  for (Count c : {Count{"cube_cores", &p.cubeCores}, Count{"vector_cores", &p.vectorCores},
                  Count{"tile_m", &p.tileM}, Count{"tile_n", &p.tileN}, Count{"tile_k", &p.tileK},
                  Count{"pad_m", &p.padM}, Count{"pad_n", &p.padN}, Count{"pad_k", &p.padK}}) {
    auto it = json.find(c.key);
    if (it == json.end())
      continue;
    if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > 1 << 20)
      return fail(fmt::format("'{}' must be an integer in 1..{}, got {}", c.key, 1 << 20,
                              it->dump()));
    *c.field = uint32_t(it->get<int64_t>());
  }
  // Rates and the overhead within what a device could have (and a cost
  // model can add up without overflowing its nanoseconds): from 1e-6 to 1e6
  // in the key's units; 0 where it means "none".
  struct Rate {
    const char *key;
    double *field;
    double scale;
    bool zeroAllowed;
  };
  constexpr double kLeast = 1e-6, kMost = 1e6;
  for (Rate r : {Rate{"cube_tflops", &p.cubeFlops, 1e12, false},
                 Rate{"cube_tflops_bf16", &p.cubeFlopsBf16, 1e12, false},
                 Rate{"memory_gbps", &p.memoryBytes, 1e9, false},
                 Rate{"vector_gbps", &p.vectorBytes, 1e9, false},
                 Rate{"vector_gelems", &p.vectorElems, 1e9, false},
                 Rate{"link_gbps", &p.linkBytes, 1e9, false},
                 Rate{"link_total_gbps", &p.linkTotalBytes, 1e9, true},
                 Rate{"task_overhead_us", &p.taskOverhead, 1e-6, true}}) {
    auto it = json.find(r.key);
    if (it == json.end())
      continue;
    const double v = it->is_number() ? it->get<double>() : -1;
    if (!(v == 0 && r.zeroAllowed) && !(v >= kLeast && v <= kMost))
      return fail(fmt::format("'{}' must be a number from {:g} to {:g}{}, got {}", r.key, kLeast,
                              kMost, r.zeroAllowed ? " (or 0)" : "", it->dump()));
    *r.field = v * r.scale;
  }
  if (auto it = json.find("core_sharing"); it != json.end()) {
    const std::string value = it->is_string() ? it->get<std::string>() : "";
    if (const std::optional<CoreSharing> sharing = valueIn(kCoreSharingNames, value))
      p.sharing = *sharing;
    else
      return fail(fmt::format("'core_sharing' must be \"none\", \"rank\" or \"group\", got {}",
                              it->dump()));
  }
  if (auto it = json.find("shared_cache"); it != json.end()) {
    if (!it->is_boolean())
      return fail(fmt::format("'shared_cache' must be true or false, got {}", it->dump()));
    p.sharedCache = it->get<bool>();
  }
  if (auto it = json.find("calibrated"); it != json.end()) {
    if (!it->is_string())
      return fail(fmt::format("'calibrated' must be a string, got {}", it->dump()));
    p.calibrated = it->get<std::string>();
  }
  *out = p;
  return Status::success();
}

std::string profileJson(const TargetProfile &p) {
  nlohmann::ordered_json j;
  j["name"] = p.name;
  if (!p.calibrated.empty())
    j["calibrated"] = p.calibrated;
  j["cube_cores"] = p.cubeCores;
  j["vector_cores"] = p.vectorCores;
  j["core_sharing"] = coreSharingName(p.sharing);
  j["shared_cache"] = p.sharedCache;
  j["tile_m"] = p.tileM;
  j["tile_n"] = p.tileN;
  j["tile_k"] = p.tileK;
  j["pad_m"] = p.padM;
  j["pad_n"] = p.padN;
  j["pad_k"] = p.padK;
  j["cube_tflops"] = p.cubeFlops / 1e12;
  j["cube_tflops_bf16"] = p.cubeFlopsBf16 / 1e12;
  j["memory_gbps"] = p.memoryBytes / 1e9;
  j["vector_gbps"] = p.vectorBytes / 1e9;
  j["vector_gelems"] = p.vectorElems / 1e9;
  j["link_gbps"] = p.linkBytes / 1e9;
  j["link_total_gbps"] = p.linkTotalBytes / 1e9;
  j["task_overhead_us"] = p.taskOverhead / 1e-6;
  return j.dump(2) + "\n";
}

Status resolveProfile(const std::string &spec, TargetProfile *out) {
  bool isFile = spec.find('/') != std::string::npos ||
                (spec.size() > 5 && spec.compare(spec.size() - 5, 5, ".json") == 0);
  if (!isFile)
    return builtinProfile(spec, out);
  std::string text;
  if (Status status = readTextFile(spec, &text); !status)
    return status;
  return parseProfile(text, spec, out);
}

Status loadConfigForTarget(const std::string &configPath, const std::string &targetSpec,
                           ModelConfig *config, TargetProfile *profile) {
  ModelConfig loaded;
  std::string error;
  if (!loadConfig(configPath, &loaded, &error))
    return Status::error(error);
  TargetProfile resolved;
  if (Status status = resolveProfile(targetSpec, &resolved); !status)
    return status;
  setDefaultCoreCounts(&loaded, resolved.cubeCores, resolved.vectorCores);
  *config = std::move(loaded);
  *profile = std::move(resolved);
  return Status::success();
}

} // namespace moec::target
