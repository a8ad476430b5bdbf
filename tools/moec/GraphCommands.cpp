//===- GraphCommands.cpp - moec check, import, export ----------------------===//

#include "compiler/config/Config.h"
#include "compiler/import/GraphJson.h"
#include "compiler/ir/GraphUtils.h"
#include "compiler/target/Profile.h"
#include "compiler/transforms/Passes.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"
#include "tools/moec/GraphFrame.h"

#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/Pass/PassManager.h"

#include <fmt/format.h>

#include <cstdio>
#include <iostream>

using namespace mlir;
using namespace moec;
using namespace moec::moe;
using json = nlohmann::ordered_json;

namespace moec::cli {

const CommandSpec kCheckSpec = {
    "check",
    "moec check GRAPH --config CFG [--target PROFILE] [--json] [--print-ir] [-o OUT]",
    "Loads GRAPH (.json graph description or .mlir), binds its shapes with the\n"
    "model/parallel config CFG, verifies it, assigns missing slots and propagates\n"
    "the tile splits. Prints, per op: its type, core kind, split value, task count,\n"
    "split inputs and output dims, slots, and for every input an op produces, how\n"
    "consumer tiles map onto producer tiles.\n"
    "\n"
    "options:\n"
    "  --config CFG   model/parallel config (JSON; see docs/graph-format.md)\n"
    "  --target P     device profile giving the core counts the config does not set:\n"
    "                 cpu (default), ascend-910b, h100, or a profile JSON file\n"
    "  --json         print the report as JSON, with the full tile maps\n"
    "  --print-ir     print the graph after the passes (moe dialect) instead\n"
    "  -o OUT         write the report to OUT instead of stdout\n",
    {"--config", "--target", "-o"},
    {"--json", "--print-ir"},
    1,
    1,
    {"-o"},
    {"--config", "--target"}};

const CommandSpec kImportSpec = {
    "import",
    "moec import GRAPH.json [-o OUT.mlir]",
    "Converts a JSON graph description to the moe dialect and prints it (or writes\n"
    "it to OUT). The graph is verified on the way; shapes stay symbolic.\n"
    "\n"
    "options:\n"
    "  -o OUT   output file (default: stdout)\n",
    {"-o"},
    {},
    1,
    1,
    {"-o"}};

const CommandSpec kExportSpec = {
    "export",
    "moec export GRAPH.mlir [-o OUT.json]",
    "Converts a moe dialect graph to a JSON graph description and prints it (or\n"
    "writes it to OUT).\n"
    "\n"
    "options:\n"
    "  -o OUT   output file (default: stdout)\n",
    {"-o"},
    {},
    1,
    1,
    {"-o"}};

namespace {

/// Prints diagnostics as "file:line:col: error: message".
class DiagnosticPrinter {
public:
  explicit DiagnosticPrinter(MLIRContext &ctx)
      : handler(&ctx, [](Diagnostic &diag) {
          print(diag);
          for (Diagnostic &note : diag.getNotes())
            print(note);
          return success();
        }) {}

private:
  static void print(Diagnostic &diag) {
    std::string text;
    llvm::raw_string_ostream os(text);
    if (auto loc = diag.getLocation()->findInstanceOf<FileLineColLoc>())
      os << loc.getFilename().getValue() << ':' << loc.getLine() << ':' << loc.getColumn()
         << ": ";
    switch (diag.getSeverity()) {
    case DiagnosticSeverity::Error:
      os << "error: ";
      break;
    case DiagnosticSeverity::Warning:
      os << "warning: ";
      break;
    case DiagnosticSeverity::Note:
      os << "note: ";
      break;
    case DiagnosticSeverity::Remark:
      os << "remark: ";
      break;
    }
    os << diag.str() << '\n';
    std::fputs(os.str().c_str(), stderr);
  }
  ScopedDiagnosticHandler handler;
};

std::string toText(Operation *op) {
  std::string text;
  llvm::raw_string_ostream os(text);
  op->print(os);
  os << '\n';
  return os.str();
}

/// A one-line summary of a tile map.
std::string describeMap(TileMapAttr map, int64_t producerTiles) {
  ArrayRef<int64_t> first = map.getFirst(), last = map.getLast();
  bool all = true, identity = true;
  int64_t fanIn = 0;
  for (size_t j = 0; j < first.size(); ++j) {
    all &= first[j] == 0 && last[j] == producerTiles - 1;
    identity &= first[j] == (int64_t)j && last[j] == (int64_t)j;
    fanIn = std::max(fanIn, last[j] - first[j] + 1);
  }
  std::string how = all        ? "all " + std::to_string(producerTiles) + " tiles"
                    : identity ? "tile j <- tile j"
                               : fmt::format("overlap, <= {} tile{} each", fanIn,
                                             fanIn == 1 ? "" : "s");
  std::string input = map.getOperand() < 0 ? "after" : "in" + std::to_string(map.getOperand());
  return fmt::format("{} <- {} ({})", input, map.getProducer().getValue().str(), how);
}

json reportJson(GraphOp graph, const ModelConfig &config) {
  json r;
  r["graph"] = graph.getSymName().str();
  r["config"] = json::parse(configToJson(config).dump());
  r["task_split_value"] = taskSplitValueToJson(deriveTaskSplitValue(config));
  json ops = json::array();
  for (auto op : graph.getBlock().getOps<TaskOpInterface>()) {
    json o;
    o["name"] = op.getOpName().str();
    o["type"] = op.getSeedOpType().str();
    o["core"] = op.isCubeWork() ? "cube" : "vector";
    o["split_value"] = op.isAutoSplit() ? json("auto") : json(op.getSplitValue());
    o["tasks"] = *op.getTasks();
    o["grid"] = op.getGridAttr().asArrayRef().vec();
    SplitAttr split = op.getSplit();
    o["split_inputs"] = json::array();
    for (unsigned i = 0; i < split.getNumSplitInputs(); ++i)
      o["split_inputs"].push_back({split.getSplitOperand(i), split.getSplitDim(i)});
    o["split_output_dims"] = split.getOutputDims();
    o["tiling_position"] = *op.getTilingSlotValue();
    json slots = json::array();
    for (Value v : op->getOperands())
      slots.push_back(*v.getDefiningOp<TensorDefOpInterface>().getSlot());
    slots.push_back(*cast<TensorDefOpInterface>(op.getOperation()).getSlot());
    o["param_positions"] = slots;
    json deps = json::array();
    for (Attribute a : op.getDepsAttr()) {
      auto map = a.cast<TileMapAttr>();
      json d;
      d["input"] = map.getOperand();
      d["producer"] = map.getProducer().getValue().str();
      d["first"] = map.getFirst();
      d["last"] = map.getLast();
      deps.push_back(d);
    }
    o["deps"] = deps;
    ops.push_back(o);
  }
  r["ops"] = ops;
  return r;
}

std::string reportText(GraphOp graph, const ModelConfig &config, const std::string &cfgPath) {
  std::string out;
  TaskSplitValue t = deriveTaskSplitValue(config);
  out += fmt::format("graph {}  (config {}: H {}, I {}, E {}, top_k {}, ep {}, tp {}, seq {}, {}, "
                     "{} cube cores)\n",
                     graph.getSymName().str(), cfgPath, config.hiddenSize,
                     config.intermediateSize, config.numExperts, config.topK, config.ep,
                     config.tp, config.seqSize, configDTypeName(config.dtype), config.numCubeCores);
  out += fmt::format("task split value: single_rank_expert_num {}, seq_all {}, per_expert_seq {}, "
                     "per_rank_seq {}, per_expert_seq_to_other {}\n\n",
                     t.singleRankExpertNum, t.seqAll, t.perExpertSeq, t.perRankSeq,
                     t.perExpertSeqToOther);
  out += fmt::format("{:<14} {:<12} {:<6} {:>6} {:>6}  {:<13} {:<10} {:<8} {:<6} {:<16} {}\n",
                     "op", "type", "core", "split", "tasks", "grid", "split in", "out dims",
                     "tiling", "param slots", "tile deps");
  int64_t total = 0;
  llvm::StringMap<int64_t> tilesOf;
  for (auto op : graph.getBlock().getOps<TaskOpInterface>())
    tilesOf[op.getOpName()] = *op.getTasks();
  for (auto op : graph.getBlock().getOps<TaskOpInterface>()) {
    SplitAttr split = op.getSplit();
    std::string splitIn;
    for (unsigned i = 0; i < split.getNumSplitInputs(); ++i)
      splitIn += fmt::format("{}{}:{}", i ? "," : "", split.getSplitOperand(i),
                             split.getSplitDim(i));
    if (split.isSource())
      splitIn = "(source)";
    std::string outDims;
    for (int64_t d : split.getOutputDims())
      outDims += (outDims.empty() ? "" : ",") + std::to_string(d);
    std::string slots;
    for (Value v : op->getOperands())
      slots += std::to_string(*v.getDefiningOp<TensorDefOpInterface>().getSlot()) + ",";
    slots += "|" + std::to_string(*cast<TensorDefOpInterface>(op.getOperation()).getSlot());
    std::string deps;
    for (Attribute a : op.getDepsAttr()) {
      auto map = a.cast<TileMapAttr>();
      deps += (deps.empty() ? "" : "; ") + describeMap(map, tilesOf[map.getProducer()]);
    }
    if (deps.empty())
      deps = "-";
    ArrayRef<int64_t> grid = op.getGridAttr().asArrayRef();
    out += fmt::format("{:<14} {:<12} {:<6} {:>6} {:>6}  {:<13} {:<10} {:<8} {:<6} {:<16} {}\n",
                       op.getOpName().str(), op.getSeedOpType().str(),
                       op.isCubeWork() ? "cube" : "vector",
                       op.isAutoSplit() ? std::string("auto") : std::to_string(op.getSplitValue()),
                       *op.getTasks(),
                       fmt::format("{}x{}x{}x{}", grid[0], grid[1], grid[2], grid[3]), splitIn, "[" + outDims + "]", *op.getTilingSlotValue(), slots, deps);
    total += *op.getTasks();
  }
  out += fmt::format("\n{} ops, {} tile tasks\n", tilesOf.size(), total);
  if (llvm::any_of(graph.getBlock().getOps<TaskOpInterface>(),
                   [](TaskOpInterface op) { return op.isAutoSplit(); }))
    out += "automatic splits (\"auto\") are shown at the pass's default options; moec compile "
           "tries several and keeps the fastest (moec dump shows which)\n";
  return out;
}


bool anyArgs(const Args &) { return true; }

} // namespace

/// The frame of every graph command: parse the arguments (answering --help),
/// load GRAPH with diagnostics printed as file:line:col, run `body`, and write
/// what it produced to -o (default stdout) when it succeeds.
int runOnGraph(const CommandSpec &spec, int argc, char **argv, int first,
               llvm::function_ref<bool(const Args &)> checkArgs,
               llvm::function_ref<int(const Args &, ModuleOp, std::string &)> body,
               llvm::function_ref<void()> afterWrite) {
  std::optional<Args> args = parseArgs(spec, argc, argv, first);
  if (!args)
    return kUsage;
  if (args->help) {
    printHelp(spec);
    return kOk;
  }
  if (!checkArgs(*args))
    return kUsage;
  if (int code = checkOutputs(spec, *args); code != kOk)
    return code;
  MLIRContext ctx;
  ctx.printOpOnDiagnostic(false);
  DiagnosticPrinter printer(ctx);
  OwningOpRef<ModuleOp> module = loadGraph(args->positional[0], &ctx);
  if (!module)
    return kError;
  std::string out;
  if (int status = body(*args, *module, out); status != kOk)
    return status;
  if (!writeOutput(args->value("-o").value_or("-"), out))
    return kError;
  if (afterWrite)
    afterWrite();
  return kOk;
}


int runCheck(int argc, char **argv, int first) {
  auto needsConfig = [](const Args &args) {
    if (args.value("--config"))
      return true;
    std::fprintf(stderr, "moec check: missing --config CFG\nusage: %s\n", kCheckSpec.usage);
    return false;
  };
  return runOnGraph(kCheckSpec, argc, argv, first, needsConfig,
                    [](const Args &args, ModuleOp module, std::string &out) {
                      const std::string cfgPath = *args.value("--config");
                      ModelConfig config;
                      target::TargetProfile profile;
                      if (Status status = target::loadConfigForTarget(
                              cfgPath, args.value("--target").value_or("cpu"), &config,
                              &profile);
                          !status) {
                        std::fprintf(stderr, "error: %s\n", status.message().c_str());
                        return int(kError);
                      }
                      PassManager pm(module.getContext());
                      buildGraphPipeline(pm, config, cfgPath, splitOptionsFor(profile),
                                         fusesLowRank(profile));
                      if (failed(pm.run(module)))
                        return int(kError);
                      GraphOp graph = *module.getOps<GraphOp>().begin();
                      if (args.has("--print-ir"))
                        out = toText(module);
                      else if (args.has("--json"))
                        out = reportJson(graph, config).dump(2) + "\n";
                      else
                        out = reportText(graph, config, cfgPath);
                      return int(kOk);
                    });
}

int runImport(int argc, char **argv, int first) {
  return runOnGraph(kImportSpec, argc, argv, first, anyArgs,
                    [](const Args &, ModuleOp module, std::string &out) {
                      out = toText(module);
                      return int(kOk);
                    });
}

int runExport(int argc, char **argv, int first) {
  return runOnGraph(kExportSpec, argc, argv, first, anyArgs,
                    [](const Args &, ModuleOp module, std::string &out) {
                      FailureOr<json> exported = exportGraphJson(module);
                      if (failed(exported))
                        return int(kError);
                      out = exported->dump(2) + "\n";
                      return int(kOk);
                    });
}

} // namespace moec::cli
