//===- Config.cpp - Model and parallel config of an MoE-FFN layer ---------===//

#include "compiler/config/Config.h"
#include "base/Json.h"
#include "base/File.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

namespace moec {

namespace {

/// An integer-valued config key.
struct IntKey {
  const char *key;
  int64_t ModelConfig::*field;
  bool optional = false; ///< 0 means unset
  int64_t max = 0;       ///< the largest value the compiler and runtime take
};

/// The integer keys, in the order they are checked and reported, with the
/// limits of format/Capacity.h.
const IntKey kIntKeys[] = {
    {"hidden_size", &ModelConfig::hiddenSize, false, format::kMaxModelWidth},
    {"intermediate_size", &ModelConfig::intermediateSize, false, format::kMaxModelWidth},
    {"num_experts", &ModelConfig::numExperts, false, format::kMaxCount},
    {"top_k", &ModelConfig::topK, false, format::kMaxCount},
    {"ep", &ModelConfig::ep, false, format::kMaxCount},
    {"tp", &ModelConfig::tp, false, format::kMaxCount},
    {"seq_size", &ModelConfig::seqSize, false, format::kMaxSeqSize},
    {"num_cube_cores", &ModelConfig::numCubeCores, true, format::kMaxCount},
    {"num_vector_cores", &ModelConfig::numVectorCores, true, format::kMaxCount},
    {"lora_rank", &ModelConfig::loraRank, true, format::kMaxCount},
    {"weight_group", &ModelConfig::weightGroup, true, format::kMaxCount},
};

constexpr const char *kDTypeKey = "dtype";
constexpr const char *kNameKey = "name";
constexpr const char *kCapacityFactorKey = "capacity_factor";
constexpr const char *kMainGradKey = "main_grad";
constexpr const char *kLoraAlphaKey = "lora_alpha";
constexpr const char *kDispatchDTypeKey = "dispatch_dtype";

/// The keys a config must have, in the order missing ones are reported.
const char *const kRequiredKeys[] = {
    "hidden_size", "intermediate_size", "num_experts", "top_k", "ep",
    "tp",          "seq_size",          "dtype",
};

/// Returns every key a config may have.
std::vector<std::string> knownKeys() {
  std::vector<std::string> keys;
  for (const IntKey &key : kIntKeys)
    keys.push_back(key.key);
  keys.push_back(kDTypeKey);
  keys.push_back(kNameKey);
  keys.push_back(kCapacityFactorKey);
  keys.push_back(kMainGradKey);
  keys.push_back(kLoraAlphaKey);
  keys.push_back(kDispatchDTypeKey);
  return keys;
}

/// Sets *error to "SOURCE: message" and returns false.
bool fail(std::string *error, const std::string &source,
          const std::string &message) {
  if (error)
    *error = fmt::format("{}: {}", source, message);
  return false;
}

/// What `tp` means, for the messages of configs written when it divided
/// the tokens.
constexpr const char *kTpMeaning =
    "'tp' is expert tensor parallelism on an [ep, tp] mesh of ep * tp ranks: the tp ranks of "
    "an EP rank share its seq_size tokens and each computes intermediate_size / tp of every "
    "expert's columns. It no longer divides seq_size; a config that used it that way should "
    "set seq_size to seq_size / tp and tp to 1";

/// Checks `product` = a * b for overflow; returns false when it overflows.
bool checkedMul(int64_t a, int64_t b, int64_t *product) {
  return !__builtin_mul_overflow(a, b, product);
}

} // namespace

bool parseConfig(std::string_view text, const std::string &source,
                 ModelConfig *out, std::string *error) {
  nlohmann::json json;
  if (!parseJson(text, source, &json, error))
    return false;

  if (!json.is_object())
    return fail(error, source,
                fmt::format("top-level value must be a JSON object, got {}",
                            json.type_name()));

  std::vector<std::string> keys = knownKeys();
  for (const auto &item : json.items()) {
    const std::string &key = item.key();
    if (std::find(keys.begin(), keys.end(), key) != keys.end())
      continue;
    std::string message = fmt::format("unknown key '{}'", key);
    std::string suggestion = closestName(key, keys);
    if (!suggestion.empty())
      message += fmt::format(" (did you mean '{}'?)", suggestion);
    return fail(error, source, message);
  }

  for (const char *key : kRequiredKeys) {
    if (!json.contains(key))
      return fail(error, source, fmt::format("missing required key '{}'", key));
  }

  ModelConfig config;
  for (const IntKey &key : kIntKeys) {
    auto it = json.find(key.key);
    if (it == json.end())
      continue;
    if (!it->is_number_integer())
      return fail(error, source,
                  fmt::format("key '{}' must be a positive integer, got {}",
                              key.key, it->dump()));
    if (it->is_number_unsigned() &&
        it->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
      return fail(error, source,
                  fmt::format("key '{}' is too large for int64, got {}",
                              key.key, it->dump()));
    config.*key.field = it->get<int64_t>();
    if (key.optional && config.*key.field <= 0)
      return fail(error, source,
                  fmt::format("'{}' must be positive, got {}", key.key, it->dump()));
  }

  const nlohmann::json &dtype = json.at(kDTypeKey);
  std::optional<DType> parsedDType;
  if (dtype.is_string())
    parsedDType = parseDType(dtype.get<std::string>());
  if (!parsedDType || (*parsedDType != DType::F32 && *parsedDType != DType::BF16))
    return fail(error, source,
                fmt::format("'dtype' must be \"fp32\" or \"bf16\", got {}",
                            dtype.dump()));
  config.dtype = *parsedDType;

  auto name = json.find(kNameKey);
  if (name != json.end()) {
    if (!name->is_string())
      return fail(
          error, source,
          fmt::format("key 'name' must be a string, got {}", name->dump()));
    config.name = name->get<std::string>();
  }

  for (const auto &[key, field] : {std::pair<const char *, double ModelConfig::*>{
                                       kCapacityFactorKey, &ModelConfig::capacityFactor},
                                   {kLoraAlphaKey, &ModelConfig::loraAlpha}}) {
    auto it = json.find(key);
    if (it == json.end())
      continue;
    if (!it->is_number())
      return fail(error, source,
                  fmt::format("key '{}' must be a number, got {}", key, it->dump()));
    config.*field = it->get<double>();
    // 0 stands for "not given" inside (the default: lora_rank); written
    // out, lora_alpha must be a scale.
    if (field == &ModelConfig::loraAlpha && !(config.loraAlpha > 0))
      return fail(error, source,
                  fmt::format("key '{}' must be a positive number, got {}", key, it->dump()));
  }

  auto mainGrad = json.find(kMainGradKey);
  if (mainGrad != json.end()) {
    if (!mainGrad->is_boolean())
      return fail(error, source,
                  fmt::format("key '{}' must be true or false, got {}", kMainGradKey,
                              mainGrad->dump()));
    config.mainGrad = mainGrad->get<bool>();
  }

  auto wire = json.find(kDispatchDTypeKey);
  if (wire != json.end()) {
    const std::string value = wire->is_string() ? wire->get<std::string>() : "";
    if (value == configDTypeName(DType::F8E4M3))
      config.fp8Dispatch = true;
    else if (value != configDTypeName(config.dtype))
      return fail(error, source,
                  fmt::format("'{}' must be \"fp8_e4m3\" or the config's dtype (\"{}\"), got {}",
                              kDispatchDTypeKey, configDTypeName(config.dtype), wire->dump()));
  }

  if (!validateConfig(config, source, error))
    return false;
  *out = std::move(config);
  return true;
}

format::CapacityInputs capacityInputs(const ModelConfig &c) {
  return {c.seqSize, c.topK, c.ep, c.ep > 0 ? c.numExperts / c.ep : 0, c.capacityFactor};
}

format::LayerRecord layerRecord(const ModelConfig &c) {
  format::LayerRecord r;
  r.hidden = c.hiddenSize;
  r.intermediate = c.intermediateSize;
  r.seqSize = c.seqSize;
  r.topK = c.topK;
  r.experts = c.numExperts;
  const format::CapacityInputs inputs = capacityInputs(c);
  r.rowCapacity = format::rowCapacityRows(inputs);
  r.receiveCapacity = format::receiveCapacityRows(inputs);
  r.capacityFactor = c.capacityFactor;
  r.loraAlpha = c.loraAlpha;
  r.loraRank = uint32_t(c.loraRank);
  r.weightGroup = uint32_t(c.weightGroup);
  r.dtype = c.dtype;
  r.dispatchDtype = c.fp8Dispatch ? DType::F8E4M3 : c.dtype;
  r.flags = c.mainGrad ? format::kLayerMainGrad : 0;
  return r;
}

bool loadConfig(const std::string &path, ModelConfig *out, std::string *error) {
  std::string text;
  if (Status status = readTextFile(path, &text); !status) {
    if (error)
      *error = status.message();
    return false;
  }
  return parseConfig(text, path, out, error);
}

bool validateConfig(const ModelConfig &c, const std::string &source,
                    std::string *error) {
  for (const IntKey &key : kIntKeys) {
    int64_t value = c.*key.field;
    if (value < 0 || (value == 0 && !key.optional))
      return fail(error, source,
                  fmt::format("'{}' must be positive, got {}", key.key, value));
    if (value > key.max)
      return fail(error, source,
                  fmt::format("'{}' is {}; at most {} is supported", key.key, value, key.max));
  }
  if (c.dtype != DType::F32 && c.dtype != DType::BF16)
    return fail(error, source,
                fmt::format("'dtype' has an invalid value ({})",
                            static_cast<int>(c.dtype)));
  if (!(c.capacityFactor >= format::kMinCapacityFactor &&
        c.capacityFactor <= format::kMaxCapacityFactor))
    return fail(error, source,
                fmt::format("'capacity_factor' must be between {} and {}, got {}",
                            format::kMinCapacityFactor, format::kMaxCapacityFactor,
                            c.capacityFactor));
  if (c.loraAlpha != 0 && c.loraRank == 0)
    return fail(error, source, "'lora_alpha' needs 'lora_rank' (the adapters' rank)");
  if (!std::isfinite(c.loraAlpha) || c.loraAlpha < 0)
    return fail(error, source,
                fmt::format("'lora_alpha' must be a positive number, got {}", c.loraAlpha));
  if (c.loraRank > 0) {
    // The adapters' scale travels as a float32: it must be one, and normal.
    const float scale = float(loraScaling(c));
    if (!std::isfinite(scale) || std::fpclassify(scale) != FP_NORMAL)
      return fail(error, source,
                  fmt::format("'lora_alpha' / 'lora_rank' = {} / {} = {:g} is not a scale a "
                              "float32 holds (a normal number, about 1.2e-38 to 3.4e38)",
                              c.loraAlpha, c.loraRank, loraScaling(c)));
  }
  if (c.numExperts % c.ep != 0)
    return fail(error, source,
                fmt::format("'num_experts' ({}) must be a multiple of 'ep' "
                            "({})",
                            c.numExperts, c.ep));
  if (c.topK > c.numExperts)
    return fail(error, source,
                fmt::format("'top_k' ({}) must not exceed 'num_experts' ({})",
                            c.topK, c.numExperts));

  if (c.intermediateSize % c.tp != 0)
    return fail(error, source,
                fmt::format("'intermediate_size' ({}) must be a multiple of 'tp' ({}): each of "
                            "an expert's tp tensor-parallel ranks holds intermediate_size / tp "
                            "of its columns. ({})",
                            c.intermediateSize, c.tp, kTpMeaning));
  int64_t ranks = 0;
  if (!checkedMul(c.ep, c.tp, &ranks) || ranks > (int64_t(1) << 16))
    return fail(error, source,
                fmt::format("ep * tp ({} * {}) ranks; at most {} are supported", c.ep, c.tp,
                            int64_t(1) << 16));
  int64_t seqAll = 0;
  if (!checkedMul(c.seqSize, c.ep, &seqAll) ||
      !checkedMul(seqAll, c.topK, &seqAll))
    return fail(error, source,
                fmt::format("seq_size * ep * top_k ({} * {} * {}) overflows "
                            "int64",
                            c.seqSize, c.ep, c.topK));
  // seq_all = seq_size * ep * top_k: the divisions that derive
  // per_expert_seq, per_rank_seq and per_expert_seq_to_other are exact.
  return true;
}

TaskSplitValue deriveTaskSplitValue(const ModelConfig &c) {
  TaskSplitValue v;
  v.allExpertNum = c.numExperts;
  v.singleRankExpertNum = c.numExperts / c.ep;
  v.seqAll = c.seqSize * c.ep * c.topK;
  v.perExpertSeq = v.seqAll / c.topK;
  v.perRankSeq = v.seqAll / c.ep;
  v.perExpertSeqToOther = v.seqAll / (c.ep * c.topK);
  return v;
}

void setDefaultCoreCounts(ModelConfig *c, int64_t cubeCores, int64_t vectorCores) {
  if (c->numCubeCores == 0)
    c->numCubeCores = cubeCores;
  if (c->numVectorCores == 0)
    c->numVectorCores = vectorCores;
}

std::vector<std::string> configNotes(const ModelConfig &c, const std::string &source) {
  std::vector<std::string> notes;
  if (c.tp > 1)
    notes.push_back(fmt::format("{}: 'tp' is {}: {} ranks ({} EP x {} TP). {}.", source, c.tp,
                                c.ep * c.tp, c.ep, c.tp, kTpMeaning));
  return notes;
}

double loraScaling(const ModelConfig &c) { return layerRecord(c).loraScaling(); }

Bindings configBindings(const ModelConfig &c) {
  TaskSplitValue v = deriveTaskSplitValue(c);
  Bindings bindings;
  for (const IntKey &key : kIntKeys)
    if (c.*key.field > 0)
      bindings[key.key] = c.*key.field;
  bindings["dtype_size"] = int64_t(dtypeSize(c.dtype));
  bindings["fp8_dispatch"] = c.fp8Dispatch ? 1 : 0;
  // An independent symbol for dim comparisons (not a derived definition):
  // shapes over it stay division-free polynomials.
  bindings["local_intermediate_size"] = c.intermediateSize / c.tp;
  bindings["single_rank_expert_num"] = v.singleRankExpertNum;
  bindings["seq_all"] = v.seqAll;
  bindings["per_expert_seq"] = v.perExpertSeq;
  bindings["per_rank_seq"] = v.perRankSeq;
  bindings["per_expert_seq_to_other"] = v.perExpertSeqToOther;
  return bindings;
}

const std::vector<std::pair<std::string, std::string>> &derivedSymbolDefinitions() {
  static const std::vector<std::pair<std::string, std::string>> defs = {
      {"single_rank_expert_num", "num_experts / ep"},
      {"seq_all", "seq_size * ep * top_k"},
      {"per_expert_seq", "seq_all / top_k"},
      {"per_rank_seq", "seq_all / ep"},
      {"per_expert_seq_to_other", "seq_all / (ep * top_k)"},
  };
  return defs;
}

nlohmann::ordered_json taskSplitValueToJson(const TaskSplitValue &v) {
  return nlohmann::ordered_json{{"all_expert_num", v.allExpertNum},
                        {"single_rank_expert_num", v.singleRankExpertNum},
                        {"seq_all", v.seqAll},
                        {"per_expert_seq", v.perExpertSeq},
                        {"per_rank_seq", v.perRankSeq},
                        {"per_expert_seq_to_other", v.perExpertSeqToOther}};
}

nlohmann::json configToJson(const ModelConfig &c) {
  nlohmann::json json = nlohmann::json::object();
  for (const IntKey &key : kIntKeys)
    if (c.*key.field > 0)
      json[key.key] = c.*key.field;
  json[kDTypeKey] = configDTypeName(c.dtype);
  json[kNameKey] = c.name;
  if (c.mainGrad)
    json[kMainGradKey] = true;
  if (c.loraRank > 0)
    json[kLoraAlphaKey] = c.loraAlpha > 0 ? c.loraAlpha : double(c.loraRank);
  return json;
}

} // namespace moec
