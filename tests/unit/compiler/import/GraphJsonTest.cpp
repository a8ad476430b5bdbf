//===- GraphJsonTest.cpp - Tests for the JSON <-> moe dialect mapping -----===//

#include "compiler/config/Config.h"
#include "compiler/import/GraphJson.h"
#include "compiler/ir/MoeDialect.h"
#include "compiler/transforms/Passes.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Location.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using json = nlohmann::ordered_json;
using moec::moe::GmmOp;
using moec::moe::GraphOp;

namespace {

/// One diagnostic as the handler saw it.
struct Diag {
  mlir::DiagnosticSeverity severity;
  std::string file; ///< empty when the location has no file
  unsigned line = 0;
  unsigned col = 0;
  std::string message;
};

std::ostream &operator<<(std::ostream &os, const Diag &d) {
  return os << d.file << ':' << d.line << ':' << d.col << ": " << d.message;
}

/// An MLIR context whose diagnostics are collected instead of printed.
class Harness {
public:
  Harness()
      : ctx(mlir::MLIRContext::Threading::DISABLED),
        handler(&ctx, [this](mlir::Diagnostic &diag) {
          Diag d{diag.getSeverity(), "", 0, 0, diag.str()};
          if (auto loc = diag.getLocation()->findInstanceOf<mlir::FileLineColLoc>()) {
            d.file = loc.getFilename().getValue().str();
            d.line = loc.getLine();
            d.col = loc.getColumn();
          }
          diags.push_back(d);
          return mlir::success();
        }) {
    ctx.printOpOnDiagnostic(false);
    ctx.getOrLoadDialect<moec::moe::MoeDialect>();
  }

  std::vector<Diag> errors() const {
    std::vector<Diag> out;
    for (const Diag &d : diags)
      if (d.severity == mlir::DiagnosticSeverity::Error)
        out.push_back(d);
    return out;
  }

  std::string dump() const {
    std::ostringstream os;
    for (const Diag &d : diags)
      os << d << '\n';
    return os.str();
  }

  mlir::MLIRContext ctx;
  std::vector<Diag> diags;

private:
  mlir::ScopedDiagnosticHandler handler;
};

std::string readFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  INFO("path: " << path);
  REQUIRE(in.good());
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

/// Writes `text` to a fresh file under the test's temporary folder.
std::string writeTemp(const std::string &name, const std::string &text) {
  const char *dir = std::getenv("TEST_TMPDIR");
  std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  REQUIRE(out.good());
  return path;
}

/// The 1-based line and column of byte `offset` of `text`.
std::pair<unsigned, unsigned> lineCol(const std::string &text, size_t offset) {
  unsigned line = 1, col = 1;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

/// The line and column of the `nth` (0-based) occurrence of `"name": "<name>"`
/// after the key `"<section>":` in text written by json::dump(2).
std::pair<unsigned, unsigned> namePos(const std::string &text, const std::string &section,
                                      const std::string &name, int nth = 0) {
  size_t at = text.find("\"" + section + "\":");
  REQUIRE(at != std::string::npos);
  std::string needle = "\"name\": \"" + name + "\"";
  for (int i = 0; i <= nth; ++i) {
    at = text.find(needle, at + 1);
    INFO("looking for " << needle);
    REQUIRE(at != std::string::npos);
  }
  return lineCol(text, at);
}

/// The line and column of the key `"<key>":` in `text`.
std::pair<unsigned, unsigned> keyPos(const std::string &text, const std::string &key) {
  size_t at = text.find("\"" + key + "\":");
  REQUIRE(at != std::string::npos);
  return lineCol(text, at);
}

json loadJson(const std::string &path) { return json::parse(readFile(path)); }

json &tensorNamed(json &g, const std::string &name) {
  for (json &t : g["tensors"])
    if (t["name"] == name)
      return t;
  static json none;
  FAIL("no tensor " << name);
  return none;
}

json &opNamed(json &g, const std::string &name) {
  for (json &o : g["ops"])
    if (o["name"] == name)
      return o;
  static json none;
  FAIL("no op " << name);
  return none;
}

/// The shipped forward / backward graphs as JSON, for tests to modify.
json fwdGraph() { return loadJson("graphs/seed/moe_ffn_fwd.json"); }
json bwdGraph() { return loadJson("graphs/seed/moe_ffn_bwd.json"); }

/// Imports `text` as "bad.json", which must fail with exactly one error (and
/// nothing else); returns that error.
Diag importTextError(const std::string &text) {
  Harness h;
  mlir::OwningOpRef<mlir::ModuleOp> module = moec::importGraphJson(text, "bad.json", &h.ctx);
  INFO("diagnostics:\n" << h.dump());
  CHECK(!module);
  REQUIRE(h.diags.size() == 1);
  REQUIRE(h.diags[0].severity == mlir::DiagnosticSeverity::Error);
  CHECK(h.diags[0].file == "bad.json");
  return h.diags[0];
}

Diag importError(const json &graph) { return importTextError(graph.dump(2) + "\n"); }

/// Imports `text` (which must import), runs the graph pipeline with config
/// `configPath` (which must fail) and returns the errors.
std::vector<Diag> pipelineErrors(const std::string &text, const std::string &configPath) {
  Harness h;
  mlir::OwningOpRef<mlir::ModuleOp> module = moec::importGraphJson(text, "bad.json", &h.ctx);
  INFO("diagnostics:\n" << h.dump());
  REQUIRE(module);
  REQUIRE(h.errors().empty());
  mlir::PassManager pm(&h.ctx);
  moec::moe::buildGraphPipeline(pm, configPath);
  CHECK(mlir::failed(pm.run(*module)));
  std::vector<Diag> errors = h.errors();
  REQUIRE(!errors.empty());
  return errors;
}

bool contains(const std::string &s, const std::string &part) {
  return s.find(part) != std::string::npos;
}

/// Exports `module`, failing the test when it cannot be exported.
json exportOrFail(Harness &h, mlir::ModuleOp module) {
  mlir::FailureOr<json> exported = moec::exportGraphJson(module);
  INFO("diagnostics:\n" << h.dump());
  REQUIRE(mlir::succeeded(exported));
  return *exported;
}

/// export(import(text)).
json roundTrip(const std::string &text, const std::string &source) {
  Harness h;
  mlir::OwningOpRef<mlir::ModuleOp> module = moec::importGraphJson(text, source, &h.ctx);
  INFO("diagnostics:\n" << h.dump());
  REQUIRE(module);
  CHECK(h.errors().empty());
  return exportOrFail(h, *module);
}

/// `j` with object keys in a canonical (sorted) order, for comparisons that
/// ignore key order.
nlohmann::json unordered(const json &j) { return nlohmann::json::parse(j.dump()); }

} // namespace

//===----------------------------------------------------------------------===//
// Lossless round trips
//===----------------------------------------------------------------------===//

TEST_CASE("shipped graphs round-trip through the dialect unchanged", "[graph-json]") {
  for (const char *path : {"graphs/seed/moe_ffn_fwd.json", "graphs/seed/moe_ffn_bwd.json"}) {
    INFO("graph: " << path);
    std::string text = readFile(path);
    json expected = json::parse(text);
    json exported = roundTrip(text, path);
    CHECK(exported == expected);
    // The shipped files are in the exporter's canonical form, byte for byte.
    CHECK(exported.dump(2) + "\n" == text);
  }
}

TEST_CASE("export(import(x)) is a fixed point for hand-written JSON", "[graph-json]") {
  // Keys in a non-canonical order; no param positions, tiling positions,
  // task_num, edges; fill keys unsorted.
  const std::string text = R"({
  "ops": [
    {
      "split_spec": {"split_output_dims": [0], "split_inputs": [[0, 0]]},
      "split_value": 4,
      "outputs": ["h"],
      "inputs": ["y", "w", "g"],
      "op": "gmm",
      "fill": {"num_cube_cores": "num_cube_cores", "advance": "cube", "offset_inputs": [0]},
      "name": "down"
    },
    {
      "inputs": ["x"],
      "name": "act",
      "op": "swiglu",
      "outputs": ["y"],
      "split_value": 8,
      "split_spec": {"split_inputs": null, "split_output_dims": [0]}
    }
  ],
  "name": "hand",
  "tensors": [
    {"shape": ["single_rank_expert_num", "intermediate_size", "hidden_size"], "name": "w",
     "dtype": "act", "list": true},
    {"dtype": "act", "name": "x", "shape": ["seq_size", "2 * intermediate_size"], "dynamic": true},
    {"name": "h", "dtype": "act", "shape": ["seq_size", "hidden_size"]},
    {"dtype": "act", "shape": ["seq_size", "intermediate_size"], "name": "y"},
    {"name": "g", "shape": ["single_rank_expert_num"], "dtype": "i64"}
  ]
}
)";
  json original = json::parse(text);
  json once = roundTrip(text, "hand.json");
  json twice = roundTrip(once.dump(2), "hand2.json");
  CHECK(twice == once);
  CHECK(twice.dump(2) == once.dump(2));

  // Canonical key order at the top level.
  std::vector<std::string> keys;
  for (const auto &[key, value] : once.items())
    keys.push_back(key);
  CHECK(keys == std::vector<std::string>{"name", "tensors", "ops"});

  // Nothing absent became present, and nothing is lost: each tensor and op
  // equals the original one up to key order.
  CHECK_FALSE(once.contains("edges"));
  REQUIRE(once["tensors"].size() == original["tensors"].size());
  REQUIRE(once["ops"].size() == original["ops"].size());
  for (json &t : original["tensors"]) {
    INFO("tensor " << t["name"]);
    json &back = tensorNamed(once, t["name"]);
    CHECK_FALSE(back.contains("param_position"));
    CHECK_FALSE(back.contains("transpose"));
    CHECK(unordered(back) == unordered(t));
  }
  CHECK_FALSE(tensorNamed(once, "h").contains("list"));
  CHECK_FALSE(tensorNamed(once, "h").contains("dynamic"));
  for (json &o : original["ops"]) {
    INFO("op " << o["name"]);
    json &back = opNamed(once, o["name"]);
    CHECK_FALSE(back.contains("tiling_position"));
    CHECK_FALSE(back.contains("accumulate"));
    CHECK_FALSE(back["split_spec"].contains("task_num"));
    CHECK(unordered(back) == unordered(o));
  }
  CHECK_FALSE(opNamed(once, "act").contains("fill"));
  // Ops keep their order.
  CHECK(once["ops"][0]["name"] == "down");
  CHECK(once["ops"][1]["name"] == "act");
}

TEST_CASE("the .mlir beside each graph exports to the same JSON", "[graph-json]") {
  for (const char *stem : {"graphs/seed/moe_ffn_fwd", "graphs/seed/moe_ffn_bwd"}) {
    INFO("graph: " << stem);
    Harness h;
    mlir::OwningOpRef<mlir::ModuleOp> module = moec::loadGraph(std::string(stem) + ".mlir", &h.ctx);
    INFO("diagnostics:\n" << h.dump());
    REQUIRE(module);
    json exported = exportOrFail(h, *module);
    std::string text = readFile(std::string(stem) + ".json");
    CHECK(exported == json::parse(text));
    CHECK(exported.dump(2) + "\n" == text);
  }
}

TEST_CASE("loadGraph reads JSON by extension", "[graph-json]") {
  Harness h;
  mlir::OwningOpRef<mlir::ModuleOp> module = moec::loadGraph("graphs/seed/moe_ffn_bwd.json", &h.ctx);
  REQUIRE(module);
  auto graphs = module->getOps<GraphOp>();
  REQUIRE(std::distance(graphs.begin(), graphs.end()) == 1);
  GraphOp graph = *graphs.begin();
  CHECK(graph.getSymName() == "moe_ffn_bwd");
  // Ops carry the location of their JSON object.
  std::string text = readFile("graphs/seed/moe_ffn_bwd.json");
  for (auto task : graph.getBlock().getOps<moec::moe::TaskOpInterface>()) {
    INFO("op " << task.getOpName().str());
    auto loc = task->getLoc().dyn_cast<mlir::FileLineColLoc>();
    REQUIRE(loc);
    CHECK(loc.getFilename().getValue() == "graphs/seed/moe_ffn_bwd.json");
    auto [line, col] = namePos(text, "ops", task.getOpName().str());
    CHECK(loc.getLine() == line);
    CHECK(loc.getColumn() == col);
  }
}

TEST_CASE("export fails on a tensor read both transposed and not", "[graph-json]") {
  Harness h;
  mlir::OwningOpRef<mlir::ModuleOp> module = moec::loadGraph("graphs/seed/moe_ffn_bwd.json", &h.ctx);
  REQUIRE(module);
  // act_grad reads 'target' as its plain lhs; make w1_grad read it transposed.
  GraphOp graph = *module->getOps<GraphOp>().begin();
  GmmOp w1Grad;
  for (GmmOp gmm : graph.getBlock().getOps<GmmOp>())
    if (gmm.getOpName() == "w1_grad")
      w1Grad = gmm;
  REQUIRE(w1Grad);
  w1Grad->setAttr("transpose_rhs", mlir::UnitAttr::get(&h.ctx));
  CHECK(mlir::failed(moec::exportGraphJson(*module)));
  std::vector<Diag> errors = h.errors();
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0].message, "tensor 'target' is read transposed by one grouped matmul "
                                    "and not by another"));
  auto [line, col] = namePos(readFile("graphs/seed/moe_ffn_bwd.json"), "ops", "w1_grad");
  CHECK(errors[0].file == "graphs/seed/moe_ffn_bwd.json");
  CHECK(errors[0].line == line);
  CHECK(errors[0].col == col);
}

//===----------------------------------------------------------------------===//
// Bad inputs: import errors
//===----------------------------------------------------------------------===//

TEST_CASE("malformed JSON is reported at the offending character", "[graph-json][errors]") {
  SECTION("trailing comma in an object") {
    Diag d = importTextError("{\n"
                         "  \"name\": \"g\",\n"
                         "  \"tensors\": [\n"
                         "    {\"name\": \"a\", \"shape\": [4], \"dtype\": \"fp32\",}\n"
                         "  ],\n"
                         "  \"ops\": []\n"
                         "}\n");
    CHECK(d.line == 4);
    CHECK(d.col == 49);
    CHECK(contains(d.message, "malformed JSON"));
    CHECK(contains(d.message, "unexpected '}'"));
    CHECK_FALSE(contains(d.message, "json.exception"));
  }
  SECTION("stray comma in an array") {
    Diag d = importTextError("{\n  \"name\": \"g\",\n  \"tensors\": [,]\n}\n");
    CHECK(d.line == 3);
    CHECK(d.col == 15);
    CHECK(contains(d.message, "malformed JSON"));
    CHECK(contains(d.message, "unexpected ','"));
  }
  SECTION("truncated file") {
    Diag d = importTextError("{\n  \"name\": \"g\",\n  \"tensors\": [");
    CHECK(d.line == 3);
    CHECK(d.col == 15);
    CHECK(contains(d.message, "unexpected end of input"));
  }
  SECTION("empty file") {
    Diag d = importTextError(std::string());
    CHECK(d.line == 1);
    CHECK(d.col == 1);
    CHECK(contains(d.message, "malformed JSON"));
  }
}

TEST_CASE("graph-level errors", "[graph-json][errors]") {
  SECTION("top level not an object") {
    Diag d = importTextError("[1, 2]\n");
    CHECK(d.line == 1);
    CHECK(d.col == 1);
    CHECK(contains(d.message, "graph must be a JSON object, got [1,2]"));
  }
  SECTION("unknown top-level key") {
    json g = fwdGraph();
    g["edgs"] = g["edges"];
    g.erase("edges");
    Diag d = importError(g);
    CHECK(d.line == 1);
    CHECK(d.col == 1);
    CHECK(contains(d.message, "unknown key 'edgs' (did you mean 'edges'?)"));
  }
  SECTION("missing 'ops'") {
    json g = fwdGraph();
    g.erase("ops");
    g.erase("edges");
    Diag d = importError(g);
    CHECK(contains(d.message, "missing required key 'ops'"));
  }
  SECTION("empty graph name") {
    json g = fwdGraph();
    g["name"] = "";
    Diag d = importError(g);
    CHECK(contains(d.message, "graph 'name' must be a non-empty string"));
  }
}

TEST_CASE("tensor errors name the tensor and its line", "[graph-json][errors]") {
  json g = fwdGraph();
  std::string expectWhat = "tensor 2 'src'";
  auto checkAtSrc = [&](const Diag &d, const std::string &text) {
    auto [line, col] = namePos(text, "tensors", "src");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(col == 7);
  };
  SECTION("missing 'shape'") {
    tensorNamed(g, "src").erase("shape");
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": missing required key 'shape'"));
  }
  SECTION("bad dtype") {
    tensorNamed(g, "src")["dtype"] = "f16";
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": unknown dtype 'f16'"));
    CHECK(contains(d.message, "act, fp32, bf16, fp8_e4m3, int8, int4, i32 or i64"));
  }
  SECTION("non-positive dim") {
    tensorNamed(g, "src")["shape"][1] = 0;
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": dim 1 must be positive, got 0"));
  }
  SECTION("negative dim") {
    tensorNamed(g, "src")["shape"][0] = -8;
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": dim 0 must be positive, got -8"));
  }
  SECTION("bad dim expression") {
    tensorNamed(g, "src")["shape"][1] = "hidden_size *";
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": dim 1 'hidden_size *'"));
    CHECK(contains(d.message, "expected an operand"));
  }
  SECTION("dim neither integer nor string") {
    tensorNamed(g, "src")["shape"][1] = 1.5;
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": dim 1 must be an integer or an expression string"));
  }
  SECTION("empty shape") {
    tensorNamed(g, "src")["shape"] = json::array();
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, "'shape' must be a non-empty array"));
  }
  SECTION("unknown tensor key") {
    tensorNamed(g, "src")["dynamc"] = true;
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": unknown key 'dynamc' (did you mean 'dynamic'?)"));
  }
  SECTION("non-boolean flag") {
    tensorNamed(g, "src")["list"] = 1;
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, expectWhat + ": 'list' must be true or false"));
  }
  SECTION("negative param position") {
    tensorNamed(g, "src")["param_position"] = -2;
    Diag d = importError(g);
    checkAtSrc(d, g.dump(2) + "\n");
    CHECK(contains(d.message, "'param_position' must be a non-negative integer, got -2"));
  }
  SECTION("duplicate tensor") {
    json dup = tensorNamed(g, "src");
    dup["param_position"] = 40;
    g["tensors"].push_back(dup);
    Diag d = importError(g);
    CHECK(contains(d.message, "tensor 'src' is declared twice"));
    // Located at the second declaration, not the first.
    std::string text = g.dump(2);
    size_t second = text.find("\"name\": \"src\"", text.find("\"name\": \"src\"") + 1);
    REQUIRE(second != std::string::npos);
    CHECK(d.line == 1 + std::count(text.begin(), text.begin() + second, '\n'));
  }
  SECTION("transpose on a non-gmm input") {
    tensorNamed(g, "src")["transpose"] = true;
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "tensors", "src");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "tensor 'src' is marked transpose, but op 'dispatch' reads it as "
                              "input 1; only grouped-matmul lhs and rhs inputs can be "
                              "transposed"));
  }
  SECTION("transpose on the group list of a gmm") {
    tensorNamed(g, "glist")["transpose"] = true;
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "tensors", "glist");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "tensor 'glist' is marked transpose, but op 'up_proj' reads it as "
                              "input 2"));
  }
  SECTION("transpose on a tensor no gmm reads") {
    tensorNamed(g, "combine_out")["transpose"] = true;
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "tensors", "combine_out");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "tensor 'combine_out' is marked transpose, but no grouped matmul "
                              "reads it"));
  }
}

TEST_CASE("op errors name the op and its line", "[graph-json][errors]") {
  json g = fwdGraph();
  auto checkAt = [&](const Diag &d, const std::string &op) {
    auto [line, col] = namePos(g.dump(2), "ops", op);
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(col == 7);
  };
  SECTION("unknown op kind") {
    opNamed(g, "up_proj")["op"] = "gemm";
    Diag d = importError(g);
    checkAt(d, "up_proj");
    CHECK(contains(d.message, "op 1 'up_proj': unknown op 'gemm' (did you mean 'gmm'?)"));
  }
  SECTION("unknown op kind far from any") {
    opNamed(g, "up_proj")["op"] = "convolution";
    Diag d = importError(g);
    checkAt(d, "up_proj");
    CHECK(contains(d.message, "unknown op 'convolution' (expected dispatch, combine, gmm, "
                              "swiglu, swiglu_grad, quantize or dequantize)"));
  }
  SECTION("missing tensor reference") {
    opNamed(g, "up_proj")["inputs"][1] = "up_proj_weigth";
    Diag d = importError(g);
    checkAt(d, "up_proj");
    CHECK(contains(d.message, "op 1 'up_proj': input 1 names tensor 'up_proj_weigth', which is "
                              "not declared in 'tensors' (did you mean 'up_proj_weight'?)"));
  }
  SECTION("missing output tensor") {
    opNamed(g, "swiglu")["outputs"][0] = "swiglu_ot";
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "output 0 names tensor 'swiglu_ot'"));
    CHECK(contains(d.message, "(did you mean 'swiglu_out'?)"));
  }
  SECTION("wrong input count") {
    opNamed(g, "swiglu")["inputs"].push_back("glist");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "op 2 'swiglu': a swiglu op takes 1 inputs, got 2"));
  }
  SECTION("two outputs") {
    opNamed(g, "swiglu")["outputs"].push_back("glist");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'outputs' must name exactly one tensor"));
  }
  SECTION("tensor written twice") {
    opNamed(g, "down_proj")["outputs"][0] = "up_proj_y";
    Diag d = importError(g);
    checkAt(d, "down_proj");
    CHECK(contains(d.message, "op 3 'down_proj': tensor 'up_proj_y' is already written by op "
                              "'up_proj'"));
  }
  SECTION("unknown op key") {
    json &op = opNamed(g, "down_proj");
    op["split_valu"] = op["split_value"];
    op.erase("split_value");
    Diag d = importError(g);
    checkAt(d, "down_proj");
    CHECK(contains(d.message, "op 3 'down_proj': unknown key 'split_valu' (did you mean "
                              "'split_value'?)"));
  }
  SECTION("non-positive split value") {
    opNamed(g, "swiglu")["split_value"] = 0;
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'split_value' must be a positive integer or \"auto\", got 0"));
  }
  SECTION("split spec missing split_output_dims") {
    opNamed(g, "swiglu")["split_spec"].erase("split_output_dims");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "op 2 'swiglu' split_spec: missing required key "
                              "'split_output_dims'"));
  }
  SECTION("malformed split input pair") {
    opNamed(g, "swiglu")["split_spec"]["split_inputs"] = json::parse("[[0]]");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "split input [0] is not an [input, dim] pair of integers"));
  }
  SECTION("split dim out of range") {
    opNamed(g, "swiglu")["split_spec"]["split_inputs"] = json::parse("[[0, 2]]");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'swiglu': split input 0 splits dim 2 of operand 0 'up_proj_y', "
                              "which has rank 2"));
  }
  SECTION("split operand out of range") {
    opNamed(g, "swiglu")["split_spec"]["split_inputs"] = json::parse("[[3, 0]]");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'swiglu': split input 0 names operand 3, but the op has 1 "
                              "operand"));
  }
  SECTION("split output dim out of range") {
    opNamed(g, "swiglu")["split_spec"]["split_output_dims"] = json::parse("[2]");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'swiglu': split output dim 2 is out of range for result "
                              "'swiglu_out' of rank 2"));
  }
  SECTION("bad task_num expression") {
    opNamed(g, "swiglu")["split_spec"]["task_num"] = "per_expert_seq /";
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'swiglu': task_num 'per_expert_seq /'"));
  }
  SECTION("unknown fill key") {
    opNamed(g, "up_proj")["fill"]["advnce"] = "cube";
    Diag d = importError(g);
    checkAt(d, "up_proj");
    CHECK(contains(d.message, "'up_proj': unknown fill key 'advnce' for a moe.gmm op"));
    CHECK(contains(d.message, "advance"));
  }
  SECTION("fill on an op that takes none") {
    opNamed(g, "swiglu")["fill"] = json::parse(R"({"advance": "vector"})");
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'swiglu': unknown fill key 'advance' for a moe.swiglu op (it "
                              "takes no fill config)"));
  }
  SECTION("bad fill enum value") {
    opNamed(g, "dispatch")["fill"]["advance"] = "cube";
    Diag d = importError(g);
    checkAt(d, "dispatch");
    CHECK(contains(d.message, "'dispatch': fill key 'advance' must be one of: \"vector\" "
                              "\"vector_only\""));
  }
  SECTION("fill offset input out of range") {
    opNamed(g, "up_proj")["fill"]["offset_inputs"] = json::parse("[0, 3]");
    Diag d = importError(g);
    checkAt(d, "up_proj");
    CHECK(contains(d.message, "fill key 'offset_inputs' holds 3"));
  }
  SECTION("accumulate on a non-gmm op") {
    opNamed(g, "swiglu")["accumulate"] = true;
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "op 2 'swiglu': 'accumulate' is a boolean of gmm ops only"));
  }
  SECTION("non-integer tiling position") {
    opNamed(g, "swiglu")["tiling_position"] = "one";
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "op 2 'swiglu': 'tiling_position' must be an integer"));
  }
  SECTION("tiling slot taken twice") {
    opNamed(g, "swiglu")["tiling_position"] = 0;
    Diag d = importError(g);
    checkAt(d, "swiglu");
    CHECK(contains(d.message, "'swiglu' takes tiling slot 0, already taken by 'up_proj'"));
  }
  SECTION("param position taken twice") {
    tensorNamed(g, "src")["param_position"] = 0;
    Diag d = importError(g);
    // The clash is found at the second definition in block order: the
    // dispatch result 'target', which comes after every graph input.
    checkAt(d, "dispatch");
    CHECK(contains(d.message, "tensor 'target' takes slot 0, already taken by tensor 'src'"));
  }
}

TEST_CASE("edge errors", "[graph-json][errors]") {
  json g = fwdGraph();
  SECTION("edge naming an unknown op") {
    g["edges"].push_back(json::parse(R"(["swiglu", "down_prj"])"));
    Diag d = importError(g);
    auto [line, col] = keyPos(g.dump(2), "edges");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "edge 4 names op 'down_prj', which is not in 'ops'"));
  }
  SECTION("edge that is not a pair") {
    g["edges"].push_back(json::parse(R"(["swiglu"])"));
    Diag d = importError(g);
    auto [line, col] = keyPos(g.dump(2), "edges");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "edge 4 must be a [producer, consumer] pair of op names"));
  }
  SECTION("edge from an op to itself") {
    g["edges"].push_back(json::parse(R"(["swiglu", "swiglu"])"));
    Diag d = importError(g);
    auto [line, col] = keyPos(g.dump(2), "edges");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "edge 4 goes from 'swiglu' to itself"));
  }
  SECTION("edge listed twice") {
    g["edges"].push_back(json::parse(R"(["swiglu", "down_proj"])"));
    Diag d = importError(g);
    auto [line, col] = keyPos(g.dump(2), "edges");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "edge 4 ('swiglu' -> 'down_proj') is listed twice"));
  }
}

TEST_CASE("mismatched shapes are reported at the op", "[graph-json][errors]") {
  SECTION("act_grad weight with a wrong dim") {
    json g = bwdGraph();
    tensorNamed(g, "act_grad_weight")["shape"][1] = "hidden_size";
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "ops", "act_grad");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "'act_grad': shape mismatch: result 'act_grad_y' dim 1 is "
                              "'local_intermediate_size' but rhs (transposed) 'act_grad_weight' dim 1 "
                              "is 'hidden_size'"));
  }
  SECTION("swiglu output not half its input") {
    json g = fwdGraph();
    tensorNamed(g, "swiglu_out")["shape"][1] = "2 * local_intermediate_size";
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "ops", "swiglu");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "'swiglu': shape mismatch: input 'up_proj_y' dim 1"));
  }
  SECTION("gmm operands of different element types") {
    json g = fwdGraph();
    tensorNamed(g, "up_proj_weight")["dtype"] = "fp32";
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "ops", "up_proj");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "'up_proj': dtype mismatch: lhs 'target' and rhs 'up_proj_weight' "
                              "differ in element type"));
  }
  SECTION("all-to-all offsets of the wrong rank") {
    json g = fwdGraph();
    tensorNamed(g, "src_offset")["shape"] = json::parse(R"(["num_experts", 2])");
    Diag d = importError(g);
    auto [line, col] = namePos(g.dump(2), "ops", "dispatch");
    CHECK(d.line == line);
    CHECK(d.col == col);
    CHECK(contains(d.message, "'dispatch': src_offset 'src_offset' must have rank 1, got rank 2"));
  }
}

//===----------------------------------------------------------------------===//
// Bad inputs: errors of the graph pipeline
//===----------------------------------------------------------------------===//

TEST_CASE("a cycle imports, and the pipeline names the ops on it", "[graph-json][errors]") {
  json g = fwdGraph();
  // dispatch reads what combine writes: dispatch -> up_proj -> swiglu ->
  // down_proj -> combine -> dispatch.
  opNamed(g, "dispatch")["inputs"][1] = "combine_out";
  std::vector<Diag> errors = pipelineErrors(g.dump(2), "examples/configs/tiny.json");
  REQUIRE(errors.size() == 1);
  const Diag &d = errors[0];
  CHECK(d.file == "bad.json");
  CHECK(d.line == 1);
  CHECK(d.col == 1);
  CHECK(contains(d.message, "graph 'moe_ffn_fwd' has a cycle: "));
  CHECK(contains(d.message, "has a cycle: 'dispatch' -> 'up_proj' -> 'swiglu' -> 'down_proj' -> "
                            "'combine' -> 'dispatch'"));
}

TEST_CASE("a cycle through an ordering edge", "[graph-json][errors]") {
  json g = fwdGraph();
  g["edges"].push_back(json::parse(R"(["down_proj", "up_proj"])"));
  std::vector<Diag> errors = pipelineErrors(g.dump(2), "examples/configs/tiny.json");
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0].message, "has a cycle: "));
  CHECK(contains(errors[0].message,
                 "has a cycle: 'up_proj' -> 'swiglu' -> 'down_proj' -> 'up_proj'"));
  CHECK_FALSE(contains(errors[0].message, "'dispatch'"));
  CHECK_FALSE(contains(errors[0].message, "'combine'"));
}

TEST_CASE("a bad config value fails the pipeline with loadConfig's error",
          "[graph-json][errors]") {
  // num_experts 4 is not a multiple of ep 3.
  json config = json::parse(readFile("examples/configs/tiny.json"));
  config["ep"] = 3;
  std::string path = writeTemp("bad-ep.json", config.dump(2));
  moec::ModelConfig parsed;
  std::string loadError;
  REQUIRE_FALSE(moec::loadConfig(path, &parsed, &loadError));
  CHECK(contains(loadError, path));
  CHECK(contains(loadError, "'num_experts' (4) must be a multiple of 'ep' (3)"));

  std::vector<Diag> errors = pipelineErrors(readFile("graphs/seed/moe_ffn_fwd.json"), path);
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].message == loadError);
}

TEST_CASE("a missing config file fails the pipeline", "[graph-json][errors]") {
  std::vector<Diag> errors =
      pipelineErrors(readFile("graphs/seed/moe_ffn_fwd.json"), "examples/configs/no-such.json");
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0].message, "examples/configs/no-such.json: cannot open"));
}

/// Imports `text`, runs the graph pipeline with config `configPath` (which
/// must succeed) and returns each op's propagated task count.
std::map<std::string, uint64_t> pipelineTasks(const std::string &text,
                                              const std::string &configPath) {
  Harness h;
  mlir::OwningOpRef<mlir::ModuleOp> module = moec::importGraphJson(text, "graph.json", &h.ctx);
  INFO("diagnostics:\n" << h.dump());
  REQUIRE(module);
  mlir::PassManager pm(&h.ctx);
  moec::moe::buildGraphPipeline(pm, configPath);
  REQUIRE(mlir::succeeded(pm.run(*module)));
  std::map<std::string, uint64_t> tasks;
  module->walk([&](moec::moe::TaskOpInterface op) {
    tasks[op.getOpName().str()] = op.getTasks().value_or(0);
  });
  return tasks;
}

TEST_CASE("a split value that does not divide its dim counts one more, smaller tile",
          "[graph-json]") {
  SECTION("task count from the dim") {
    json g = fwdGraph();
    json &swiglu = opNamed(g, "swiglu");
    swiglu["split_spec"].erase("task_num");
    swiglu["split_value"] = 100;
    // tiny: up_proj_y has per_rank_seq = 256 rows: ceil(256 / 100) = 3 tiles,
    // rounded up to a multiple of the 2 local experts.
    CHECK(pipelineTasks(g.dump(2), "examples/configs/tiny.json")["swiglu"] == 4);
  }
  SECTION("task count from task_num") {
    json g = fwdGraph();
    opNamed(g, "dispatch")["split_value"] = 96;
    // tiny: num_experts * (per_expert_seq_to_other / split_value) =
    // 4 * ceil(128 / 96) = 8.
    CHECK(pipelineTasks(g.dump(2), "examples/configs/tiny.json")["dispatch"] == 8);
  }
  SECTION("counts that divide stay the seed's") {
    const std::map<std::string, uint64_t> tasks =
        pipelineTasks(readFile("graphs/seed/moe_ffn_fwd.json"), "examples/configs/tiny.json");
    // 4 * (128 / 128), (256 / 128) * 2.
    CHECK(tasks.at("dispatch") == 4);
    CHECK(tasks.at("swiglu") == 4);
  }
}

TEST_CASE("pipeline errors on symbols and dims", "[graph-json][errors]") {
  SECTION("unknown symbol in a dim") {
    json g = fwdGraph();
    for (const char *t : {"target", "src", "up_proj_y", "swiglu_out", "down_proj_y",
                          "combine_out"})
      tensorNamed(g, t)["shape"][0] = "per_rank_sq";
    std::string text = g.dump(2);
    std::vector<Diag> errors = pipelineErrors(text, "examples/configs/tiny.json");
    REQUIRE(errors.size() == 1);
    // Graph inputs come first in the block, so 'src' is resolved first.
    auto [line, col] = namePos(text, "tensors", "src");
    CHECK(errors[0].line == line);
    CHECK(errors[0].col == col);
    CHECK(contains(errors[0].message, "tensor 'src' dim 0 ('per_rank_sq'): unknown symbol "
                                      "'per_rank_sq' (did you mean 'per_rank_seq'?)"));
  }
  SECTION("non-positive task_num") {
    json g = fwdGraph();
    opNamed(g, "swiglu")["split_spec"]["task_num"] = "num_experts - 100";
    std::string text = g.dump(2);
    std::vector<Diag> errors = pipelineErrors(text, "examples/configs/tiny.json");
    REQUIRE(errors.size() == 1);
    auto [line, col] = namePos(text, "ops", "swiglu");
    CHECK(errors[0].line == line);
    CHECK(contains(errors[0].message, "'swiglu': task_num 'num_experts - 100' is -96; it must be "
                                      "positive"));
  }
  SECTION("splitting a graph input") {
    json g = fwdGraph();
    opNamed(g, "dispatch")["split_spec"]["split_inputs"] = json::parse("[[1, 0]]");
    std::string text = g.dump(2);
    std::vector<Diag> errors = pipelineErrors(text, "examples/configs/tiny.json");
    REQUIRE(errors.size() == 1);
    auto [line, col] = namePos(text, "ops", "dispatch");
    CHECK(errors[0].line == line);
    CHECK(contains(errors[0].message, "'dispatch' splits operand 1 ('src'), which is a graph "
                                      "input"));
  }
}

TEST_CASE("loadGraph errors", "[graph-json][errors]") {
  SECTION("missing file") {
    Harness h;
    CHECK(!moec::loadGraph("graphs/no-such-graph.json", &h.ctx));
    REQUIRE(h.errors().size() == 1);
    CHECK(contains(h.errors()[0].message, "graphs/no-such-graph.json: cannot open"));
  }
  SECTION("MLIR without a graph") {
    std::string path = writeTemp("empty.mlir", "module {\n}\n");
    Harness h;
    CHECK(!moec::loadGraph(path, &h.ctx));
    REQUIRE(h.errors().size() == 1);
    CHECK(contains(h.errors()[0].message, "must hold exactly one moe.graph, found 0"));
  }
  SECTION("JSON file errors carry the path") {
    std::string path = writeTemp("bad-graph.json", "{\n  \"name\": 1\n}\n");
    Harness h;
    CHECK(!moec::loadGraph(path, &h.ctx));
    REQUIRE(h.errors().size() == 1);
    CHECK(h.errors()[0].file == path);
  }
}

TEST_CASE("dims equal by the config's derivations are not a mismatch", "[graph-json]") {
  // per_rank_seq is seq_all / ep: a tensor written either way verifies, and
  // a concrete config then checks the values.
  json g = fwdGraph();
  tensorNamed(g, "up_proj_y")["shape"][0] = "seq_all / ep";
  tensorNamed(g, "target")["shape"][0] = "seq_size * ep * top_k / tp / ep";
  json back = roundTrip(g.dump(2), "derived.json");
  CHECK(back == g);
  // A division-free symbolic mismatch is refused before any config is bound.
  tensorNamed(g, "up_proj_weight")["shape"][1] = "intermediate_size";
  Diag d = importError(g);
  CHECK(contains(d.message, "'up_proj': shape mismatch"));
}
