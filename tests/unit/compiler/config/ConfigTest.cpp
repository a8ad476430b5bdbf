//===- ConfigTest.cpp - Tests for moec::ModelConfig -----------------------===//

#include "compiler/config/Config.h"

#include <catch2/catch.hpp>

#include <limits>

using moec::ModelConfig;
using nlohmann::json;

namespace {

/// A valid config (the tiny example) as JSON, for tests to modify.
json baseJson() {
  return json{{"name", "tiny"},
              {"hidden_size", 64},
              {"intermediate_size", 32},
              {"num_experts", 4},
              {"top_k", 2},
              {"ep", 2},
              {"tp", 1},
              {"seq_size", 128},
              {"dtype", "fp32"},
              {"num_cube_cores", 2},
              {"num_vector_cores", 4}};
}

/// Loads an example config, failing the test when it does not load.
ModelConfig loadExample(const std::string &name) {
  ModelConfig config;
  std::string error;
  bool ok = moec::loadConfig("examples/configs/" + name, &config, &error);
  INFO("error: " << error);
  REQUIRE(ok);
  return config;
}

/// Returns the error parseConfig() reports for `text`, failing the test when
/// it parses.
std::string parseError(const std::string &text) {
  ModelConfig config;
  std::string error;
  bool ok = moec::parseConfig(text, "src.json", &config, &error);
  INFO("text: " << text);
  REQUIRE_FALSE(ok);
  return error;
}

/// Returns the error for `j` with `key` set to `value`.
std::string errorWith(const std::string &key, const json &value) {
  json j = baseJson();
  j[key] = value;
  return parseError(j.dump());
}

} // namespace

TEST_CASE("dtype helpers", "[config]") {
  CHECK(std::string(moec::configDTypeName(moec::DType::F32)) == "fp32");
  CHECK(std::string(moec::configDTypeName(moec::DType::BF16)) == "bf16");
  CHECK(moec::dtypeSize(moec::DType::F32) == 4);
  CHECK(moec::dtypeSize(moec::DType::BF16) == 2);
  CHECK(moec::parseDType("fp32") == moec::DType::F32);
  CHECK(moec::parseDType("bf16") == moec::DType::BF16);
  CHECK_FALSE(moec::parseDType("fp16").has_value());
}

TEST_CASE("tiny.json loads", "[config]") {
  ModelConfig c = loadExample("tiny.json");
  CHECK(c.name == "tiny");
  CHECK(c.hiddenSize == 64);
  CHECK(c.intermediateSize == 32);
  CHECK(c.numExperts == 4);
  CHECK(c.topK == 2);
  CHECK(c.ep == 2);
  CHECK(c.tp == 1);
  CHECK(c.seqSize == 128);
  CHECK(c.dtype == moec::DType::F32);
  CHECK(c.numCubeCores == 2);
  CHECK(c.numVectorCores == 4);
}

TEST_CASE("qwen3-30b-a3b.json loads with default core counts", "[config]") {
  ModelConfig c = loadExample("qwen3-30b-a3b.json");
  CHECK(c.name == "qwen3-30b-a3b");
  CHECK(c.hiddenSize == 2048);
  CHECK(c.intermediateSize == 768);
  CHECK(c.numExperts == 128);
  CHECK(c.topK == 8);
  CHECK(c.ep == 8);
  CHECK(c.tp == 1);
  CHECK(c.seqSize == 4096);
  CHECK(c.dtype == moec::DType::BF16);
  CHECK(c.numCubeCores == 0); // from the target profile
  CHECK(c.numVectorCores == 0);
}

TEST_CASE("deepseek-v3.json loads", "[config]") {
  ModelConfig c = loadExample("deepseek-v3.json");
  CHECK(c.name == "deepseek-v3");
  CHECK(c.hiddenSize == 7168);
  CHECK(c.intermediateSize == 2048);
  CHECK(c.numExperts == 256);
  CHECK(c.topK == 8);
  CHECK(c.ep == 32);
  CHECK(c.tp == 1);
  CHECK(c.seqSize == 4096);
  CHECK(c.dtype == moec::DType::BF16);
  CHECK(c.numCubeCores == 0);
  CHECK(c.numVectorCores == 0);
  moec::TaskSplitValue v = moec::deriveTaskSplitValue(c);
  CHECK(v.singleRankExpertNum == 8);
  CHECK(v.seqAll == 4096 * 32 * 8);
}

TEST_CASE("seed-test.json derives the seed's TaskSplitValue", "[config]") {
  ModelConfig c = loadExample("seed-test.json");
  CHECK(c.tp == 1);
  CHECK(c.ep == 2);
  CHECK(c.seqSize == 512);
  CHECK(c.numExperts == 16);
  CHECK(c.topK == 8);
  CHECK(c.hiddenSize == 5120);
  CHECK(c.intermediateSize == 2048);
  CHECK(c.dtype == moec::DType::BF16);
  moec::TaskSplitValue v = moec::deriveTaskSplitValue(c);
  CHECK(v.allExpertNum == 16);
  CHECK(v.singleRankExpertNum == 8);
  CHECK(v.seqAll == 8192);
  CHECK(v.perExpertSeq == 1024);
  CHECK(v.perRankSeq == 4096);
  CHECK(v.perExpertSeqToOther == 512);
}

TEST_CASE("seed-defaults.json derives the seed's TaskSplitValue", "[config]") {
  ModelConfig c = loadExample("seed-defaults.json");
  CHECK(c.tp == 1);
  CHECK(c.ep == 4);
  CHECK(c.seqSize == 2048);
  CHECK(c.numExperts == 32);
  CHECK(c.topK == 8);
  CHECK(c.hiddenSize == 7168);
  CHECK(c.intermediateSize == 2048);
  CHECK(c.numCubeCores == 24);
  CHECK(moec::dtypeSize(c.dtype) == 2);
  moec::TaskSplitValue v = moec::deriveTaskSplitValue(c);
  CHECK(v.allExpertNum == 32);
  CHECK(v.singleRankExpertNum == 8);
  CHECK(v.seqAll == 65536);
  CHECK(v.perExpertSeq == 8192);
  CHECK(v.perRankSeq == 16384);
  CHECK(v.perExpertSeqToOther == 2048);
}

TEST_CASE("configBindings names every symbol", "[config]") {
  ModelConfig c = loadExample("seed-test.json");
  moec::setDefaultCoreCounts(&c, 24, 48); // the ascend-910b profile's
  moec::Bindings expected = {
      {"hidden_size", 5120},
      {"intermediate_size", 2048},
      {"num_experts", 16},
      {"top_k", 8},
      {"ep", 2},
      {"tp", 1},
      {"seq_size", 512},
      {"num_cube_cores", 24},
      {"num_vector_cores", 48},
      {"dtype_size", 2},
      {"fp8_dispatch", 0},
      {"local_intermediate_size", 2048},
      {"single_rank_expert_num", 8},
      {"seq_all", 8192},
      {"per_expert_seq", 1024},
      {"per_rank_seq", 4096},
      {"per_expert_seq_to_other", 512},
  };
  moec::Bindings bindings = moec::configBindings(c);
  CHECK(bindings == expected);
  CHECK(bindings.count("all_expert_num") == 0);

  ModelConfig tiny = loadExample("tiny.json");
  CHECK(moec::configBindings(tiny).at("dtype_size") == 4);
}

TEST_CASE("configToJson round-trips", "[config]") {
  ModelConfig c = loadExample("tiny.json");
  json j = moec::configToJson(c);
  CHECK(j == baseJson());

  ModelConfig qwen = loadExample("qwen3-30b-a3b.json");
  json q = moec::configToJson(qwen);
  CHECK(q.count("num_cube_cores") == 0); // unset keys stay unset
  CHECK(q.count("num_vector_cores") == 0);
  CHECK(q.at("dtype") == "bf16");
  ModelConfig back;
  std::string error;
  REQUIRE(moec::parseConfig(q.dump(), "q.json", &back, &error));
  CHECK(moec::configToJson(back) == q);
}

TEST_CASE("optional keys may be left out", "[config]") {
  json j = baseJson();
  j.erase("name");
  j.erase("num_cube_cores");
  j.erase("num_vector_cores");
  ModelConfig c;
  std::string error;
  REQUIRE(moec::parseConfig(j.dump(), "src.json", &c, &error));
  CHECK(c.name.empty());
  CHECK(c.numCubeCores == 0);
  CHECK(c.numVectorCores == 0);
  CHECK(moec::configBindings(c).count("num_cube_cores") == 0);
  moec::setDefaultCoreCounts(&c, 24, 48);
  CHECK(c.numCubeCores == 24);
  CHECK(c.numVectorCores == 48);
  CHECK(moec::configBindings(c).at("num_cube_cores") == 24);
  c.numCubeCores = 3; // a config's own count wins over the target's
  moec::setDefaultCoreCounts(&c, 24, 48);
  CHECK(c.numCubeCores == 3);
}

TEST_CASE("unknown and missing keys", "[config]") {
  CHECK(errorWith("hiden_size", 64) ==
        "src.json: unknown key 'hiden_size' (did you mean 'hidden_size'?)");
  CHECK(errorWith("topk", 2) ==
        "src.json: unknown key 'topk' (did you mean 'top_k'?)");
  CHECK(errorWith("experts_per_token", 2) ==
        "src.json: unknown key 'experts_per_token'");

  json j = baseJson();
  j.erase("top_k");
  CHECK(parseError(j.dump()) == "src.json: missing required key 'top_k'");
  j = baseJson();
  j.erase("dtype");
  CHECK(parseError(j.dump()) == "src.json: missing required key 'dtype'");
  j = baseJson();
  j.erase("hidden_size");
  j.erase("seq_size");
  CHECK(parseError(j.dump()) == "src.json: missing required key 'hidden_size'");
}

TEST_CASE("wrong types", "[config]") {
  CHECK(errorWith("ep", "4") ==
        "src.json: key 'ep' must be a positive integer, got \"4\"");
  CHECK(errorWith("ep", 4.0) ==
        "src.json: key 'ep' must be a positive integer, got 4.0");
  CHECK(errorWith("seq_size", true) ==
        "src.json: key 'seq_size' must be a positive integer, got true");
  CHECK(errorWith("num_cube_cores", nullptr) ==
        "src.json: key 'num_cube_cores' must be a positive integer, got null");
  CHECK(errorWith("hidden_size", json::array({64})) ==
        "src.json: key 'hidden_size' must be a positive integer, got [64]");
  CHECK(errorWith("tp", 18446744073709551615ULL) ==
        "src.json: key 'tp' is too large for int64, got 18446744073709551615");
  CHECK(errorWith("name", 5) == "src.json: key 'name' must be a string, got 5");
  CHECK(parseError("[1, 2]") ==
        "src.json: top-level value must be a JSON object, got array");
  CHECK(parseError("42") ==
        "src.json: top-level value must be a JSON object, got number");
}

TEST_CASE("dtype values", "[config]") {
  CHECK(errorWith("dtype", "fp16") ==
        "src.json: 'dtype' must be \"fp32\" or \"bf16\", got \"fp16\"");
  CHECK(errorWith("dtype", 16) ==
        "src.json: 'dtype' must be \"fp32\" or \"bf16\", got 16");
}

TEST_CASE("non-positive values", "[config]") {
  CHECK(errorWith("ep", 0) == "src.json: 'ep' must be positive, got 0");
  CHECK(errorWith("tp", -2) == "src.json: 'tp' must be positive, got -2");
  CHECK(errorWith("hidden_size", 0) ==
        "src.json: 'hidden_size' must be positive, got 0");
  CHECK(errorWith("num_vector_cores", 0) ==
        "src.json: 'num_vector_cores' must be positive, got 0");
}

TEST_CASE("expert counts", "[config]") {
  json j = baseJson();
  j["num_experts"] = 30;
  j["ep"] = 4;
  CHECK(parseError(j.dump()) ==
        "src.json: 'num_experts' (30) must be a multiple of 'ep' (4)");
  j = baseJson();
  j["num_experts"] = 8;
  j["top_k"] = 9;
  CHECK(parseError(j.dump()) ==
        "src.json: 'top_k' (9) must not exceed 'num_experts' (8)");
}

TEST_CASE("tp must divide the intermediate size, and says what it means", "[config]") {
  auto withTp = [](int64_t inter, int64_t tp) {
    json j = baseJson();
    j["intermediate_size"] = inter;
    j["tp"] = tp;
    return parseError(j.dump());
  };
  const std::string error = withTp(30, 4);
  CHECK(error.rfind("src.json: 'intermediate_size' (30) must be a multiple of 'tp' (4)", 0) == 0);
  // The message says what changed for a config written when tp divided the
  // tokens.
  CHECK(error.find("It no longer divides seq_size") != std::string::npos);
  CHECK(error.find("set seq_size to seq_size / tp and tp to 1") != std::string::npos);
  CHECK(withTp(65536, 65536).find("ep * tp (2 * 65536) ranks; at most 65536") != std::string::npos);

  // A valid tp > 1: seq_all no longer divides by it, and a note says so.
  json j = baseJson();
  j["tp"] = 4;
  ModelConfig c;
  std::string parseErrorText;
  REQUIRE(moec::parseConfig(j.dump(), "src.json", &c, &parseErrorText));
  CHECK(moec::deriveTaskSplitValue(c).seqAll == 128 * 2 * 2);
  CHECK(moec::format::receiveCapacityRows(moec::capacityInputs(c)) == 512); // 2 x the balanced 256, under the worst 512
  const std::vector<std::string> notes = moec::configNotes(c, "src.json");
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].rfind("src.json: 'tp' is 4: 8 ranks (2 EP x 4 TP).", 0) == 0);
  j["tp"] = 1;
  REQUIRE(moec::parseConfig(j.dump(), "src.json", &c, &parseErrorText));
  CHECK(moec::configNotes(c, "src.json").empty());
}

TEST_CASE("a config's layer record: its values and the capacities they give", "[config][capacity]") {
  json j = baseJson();
  j["capacity_factor"] = 1.17;
  j["dtype"] = "bf16";
  j["dispatch_dtype"] = "fp8_e4m3";
  j["main_grad"] = true;
  j["lora_rank"] = 8;
  j["lora_alpha"] = 16;
  ModelConfig c;
  std::string error;
  REQUIRE(moec::parseConfig(j.dump(), "src.json", &c, &error));
  const moec::format::LayerRecord r = moec::layerRecord(c);
  CHECK(r.hidden == 64);
  CHECK(r.intermediate == 32);
  CHECK(r.seqSize == 128);
  CHECK(r.topK == 2);
  CHECK(r.experts == 4);
  CHECK(r.capacityFactor == 1.17);
  CHECK(r.rowCapacity == 256);
  CHECK(r.receiveCapacity == 300); // ceil(1.17 * 256), under the worst 512
  CHECK(r.dtype == moec::DType::BF16);
  CHECK(r.dispatchDtype == moec::DType::F8E4M3);
  CHECK(r.mainGrad());
  CHECK(r.loraRank == 8);
  CHECK(r.loraScaling() == 2.0);
  CHECK(moec::loraScaling(c) == 2.0);
  const moec::format::CapacityInputs in = moec::capacityInputs(c);
  CHECK(in.epRanks == 2);
  CHECK(in.localExperts == 2);
  // The record passes the format's checks on its ranks.
  moec::format::TaskProgram p;
  p.epRanks = 2;
  p.localExperts = 2;
  p.target = p.addString("cpu");
  p.layer = r;
  CHECK(moec::format::validateTaskProgram(p).ok());
}

TEST_CASE("sizes past the supported limits are refused", "[config]") {
  json j = baseJson();
  j["seq_size"] = int64_t(1) << 62;
  // Refused before any product is formed (so none can overflow).
  CHECK(parseError(j.dump()) ==
        "src.json: 'seq_size' is 4611686018427387904; at most 16777216 is supported");
}

TEST_CASE("validateConfig checks a config built in code", "[config]") {
  ModelConfig c;
  std::string error;
  CHECK_FALSE(moec::validateConfig(c, "code", &error));
  CHECK(error == "code: 'hidden_size' must be positive, got 0");

  c.hiddenSize = 64;
  c.intermediateSize = 32;
  c.numExperts = 4;
  c.topK = 2;
  c.ep = 2;
  c.tp = 1;
  c.seqSize = 64;
  c.dtype = moec::DType::F32;
  error.clear();
  CHECK(moec::validateConfig(c, "code", &error));
  CHECK(error.empty());

  c.tp = 3;
  CHECK_FALSE(moec::validateConfig(c, "code", &error));
  CHECK(error.rfind("code: 'intermediate_size' (32) must be a multiple of 'tp' (3)", 0) == 0);
}

TEST_CASE("malformed JSON reports line and column", "[config]") {
  CHECK(parseError("{\n  \"hidden_size\": 64,\n  \"ep\": ,\n}") ==
        "src.json:3:9: syntax error while parsing value - unexpected ','; "
        "expected '[', '{', or a literal");
  CHECK(parseError("{\"ep\": 1") ==
        "src.json:1:9: syntax error while parsing object - unexpected end "
        "of input; expected '}'");
  CHECK(parseError("") ==
        "src.json:1:1: syntax error while parsing value - unexpected end of "
        "input; expected '[', '{', or a literal");
  std::string trailing = parseError("{\"ep\": 1}\n\n  x");
  CHECK(trailing.rfind("src.json:3:3: syntax error while parsing value - "
                       "invalid literal",
                       0) == 0);
  std::string literal = parseError("{\n\n\n    \"ep\": tru }");
  CHECK(literal.rfind("src.json:4:14: syntax error while parsing value - "
                      "invalid literal",
                      0) == 0);
}

TEST_CASE("loadConfig reports unreadable files", "[config]") {
  ModelConfig c;
  std::string error;
  CHECK_FALSE(moec::loadConfig("examples/configs/no-such.json", &c, &error));
  CHECK(error == "examples/configs/no-such.json: cannot open: No such file or "
                 "directory");
  CHECK_FALSE(moec::loadConfig("examples/configs", &c, &error));
  CHECK(error == "examples/configs: is a directory, not a file");
}

TEST_CASE("derived symbol definitions agree with the derived values", "[config]") {
  for (const char *file : {"tiny.json", "seed-test.json", "seed-defaults.json", "deepseek-v3.json"}) {
    ModelConfig c = loadExample(file);
    moec::Bindings all = moec::configBindings(c);
    moec::Bindings base = all;
    for (const auto &[name, def] : moec::derivedSymbolDefinitions())
      base.erase(name);
    REQUIRE(moec::derivedSymbolDefinitions().size() == 5);
    for (const auto &[name, def] : moec::derivedSymbolDefinitions()) {
      std::string error;
      std::optional<moec::Expr> e = moec::Expr::parse(def, &error);
      REQUIRE(e);
      std::optional<int64_t> v = e->evaluate(base, &error);
      INFO(file << ": " << name << " = " << def << " " << error);
      REQUIRE(v);
      CHECK(*v == all.at(name));
      base[name] = *v; // later definitions may use earlier ones
    }
  }
}

TEST_CASE("main_grad is a boolean, false by default, and round-trips", "[config]") {
  ModelConfig c = loadExample("tiny.json");
  CHECK_FALSE(c.mainGrad);
  CHECK(moec::configToJson(c).count("main_grad") == 0);
  json j = baseJson();
  j["main_grad"] = true;
  ModelConfig m;
  std::string error;
  REQUIRE(moec::parseConfig(j.dump(), "src.json", &m, &error));
  CHECK(m.mainGrad);
  CHECK(moec::configToJson(m) == j);
  CHECK(errorWith("main_grad", 1) == "src.json: key 'main_grad' must be true or false, got 1");
  CHECK(errorWith("main_grad", "yes") ==
        "src.json: key 'main_grad' must be true or false, got \"yes\"");
}

TEST_CASE("dispatch_dtype: fp8_e4m3, or the config's own dtype") {
  const std::string base = R"({"hidden_size": 64, "intermediate_size": 32, "num_experts": 4,
      "top_k": 2, "ep": 2, "tp": 1, "seq_size": 128, "dtype": "bf16")";
  ModelConfig c;
  std::string error;
  REQUIRE(moec::parseConfig(base + "}", "c.json", &c, &error));
  CHECK(!c.fp8Dispatch);
  REQUIRE(moec::parseConfig(base + R"(, "dispatch_dtype": "fp8_e4m3"})", "c.json", &c, &error));
  CHECK(c.fp8Dispatch);
  CHECK(moec::configBindings(c).at("fp8_dispatch") == 1);
  REQUIRE(moec::parseConfig(base + R"(, "dispatch_dtype": "bf16"})", "c.json", &c, &error));
  CHECK(!c.fp8Dispatch);
  CHECK_FALSE(moec::parseConfig(base + R"(, "dispatch_dtype": "fp32"})", "c.json", &c, &error));
  CHECK(error == "c.json: 'dispatch_dtype' must be \"fp8_e4m3\" or the config's dtype "
                 "(\"bf16\"), got \"fp32\"");
  CHECK_FALSE(moec::parseConfig(base + R"(, "dispatch_dtype": "fp8"})", "c.json", &c, &error));
  CHECK_FALSE(moec::parseConfig(base + R"(, "dispatch_dtype": 8})", "c.json", &c, &error));
}
