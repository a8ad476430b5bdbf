//===- JsonImport.cpp - JSON graph description -> moe dialect --------------===//

#include "compiler/import/GraphJson.h"
#include "compiler/ir/GraphUtils.h"
#include "compiler/support/Expr.h"
#include "base/Json.h"
#include "base/File.h"
#include "compiler/support/Nesting.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/ADT/StringMap.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/SourceMgr.h"

using namespace mlir;
using namespace moec;
using namespace moec::moe;
using json = nlohmann::ordered_json;

namespace {

/// The operand count of each op kind, in the JSON's "op" spelling.
const std::vector<std::pair<std::string, unsigned>> &opKinds() {
  static const std::vector<std::pair<std::string, unsigned>> kinds = {
      {"dispatch", 4},   {"combine", 4}, {"gmm", 3},       {"swiglu", 1},
      {"swiglu_grad", 2}, {"quantize", 1}, {"dequantize", 1}};
  return kinds;
}

std::vector<std::string> keysOf(std::initializer_list<const char *> keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

class Importer {
public:
  Importer(std::string_view text, const std::string &source, MLIRContext *ctx)
      : text(text), source(source), ctx(ctx), b(ctx) {}

  OwningOpRef<ModuleOp> run();

private:
  /// The location of byte `offset` of the text.
  Location locAt(size_t offset) {
    auto [line, column] = lineAndColumn(text, offset + 1);
    return FileLineColLoc::get(ctx, source, unsigned(line), unsigned(column));
  }

  /// The location of the `occurrence`-th `"name": "<name>"` inside the
  /// section `"<section>"`, or of the section, or of the file start.
  Location locOf(const std::string &section, const std::string &name, unsigned occurrence = 0) {
    size_t from = 0, after = 0;
    if (size_t at = findKey(section, 0, &after); at != std::string_view::npos)
      from = at;
    if (name.empty())
      return locAt(from);
    const std::string quoted = "\"" + name + "\"";
    size_t found = std::string_view::npos;
    for (unsigned i = 0; i <= occurrence; ++i) {
      size_t at = from, next = std::string_view::npos;
      while ((at = findKey("name", at, &after)) != std::string_view::npos) {
        const size_t value = skipSpace(after);
        if (text.compare(value, quoted.size(), quoted) == 0) {
          next = at;
          from = value + quoted.size();
          break;
        }
        at = after;
      }
      if (next == std::string_view::npos)
        break;
      found = next;
    }
    return found == std::string_view::npos ? locAt(from) : locAt(found);
  }

  /// The first offset at or after `offset` that is not JSON whitespace.
  size_t skipSpace(size_t offset) const {
    while (offset < text.size() &&
           (text[offset] == ' ' || text[offset] == '\t' || text[offset] == '\n' ||
            text[offset] == '\r'))
      ++offset;
    return offset;
  }

  /// The offset of the first `"<key>"` at or after `from` that a colon
  /// follows (whitespace between), with `*after` just past the colon; npos
  /// when there is none.
  size_t findKey(const std::string &key, size_t from, size_t *after) const {
    const std::string quoted = "\"" + key + "\"";
    for (size_t at = text.find(quoted, from); at != std::string_view::npos;
         at = text.find(quoted, at + 1)) {
      const size_t colon = skipSpace(at + quoted.size());
      if (colon < text.size() && text[colon] == ':') {
        *after = colon + 1;
        return at;
      }
    }
    return std::string_view::npos;
  }

  InFlightDiagnostic error(Location loc) { return mlir::emitError(loc); }

  /// Checks that `obj` is an object with only `allowed` keys and has `required`.
  LogicalResult checkKeys(const json &obj, Location loc, const std::string &what,
                          const std::vector<std::string> &allowed,
                          const std::vector<std::string> &required) {
    if (!obj.is_object())
      return error(loc) << what << " must be a JSON object, got " << obj.dump();
    for (const auto &[key, value] : obj.items()) {
      if (std::find(allowed.begin(), allowed.end(), key) != allowed.end())
        continue;
      auto diag = error(loc) << what << ": unknown key '" << key << "'";
      std::string near = closestName(key, allowed);
      if (!near.empty())
        diag << " (did you mean '" << near << "'?)";
      return diag;
    }
    for (const std::string &key : required)
      if (!obj.contains(key))
        return error(loc) << what << ": missing required key '" << key << "'";
    return success();
  }

  LogicalResult importTensor(const json &t, unsigned index);
  LogicalResult importOp(const json &o, unsigned index);
  FailureOr<ArrayAttr> importEdges(const json &edges);
  FailureOr<Attribute> fillValue(const json &v, Location loc, const std::string &what);

  std::string_view text;
  std::string source;
  MLIRContext *ctx;
  Builder b;

  struct TensorDecl {
    std::string name;
    MoeTensorType type;
    std::optional<int64_t> slot;
    bool transpose = false;
    Location loc;
    std::string producer; // op writing it, empty for a graph input
    Value value;
  };
  std::vector<TensorDecl> tensors;
  llvm::StringMap<unsigned> tensorIndex;
  /// An op, validated: everything the dialect op needs but its operands' values.
  struct OpDecl {
    std::string name, kind;
    Location loc;
    std::vector<unsigned> inputs; // indices into `tensors`
    unsigned output;
    NamedAttrList attrs;
  };
  llvm::StringMap<unsigned> opIndex;
  std::vector<OpDecl> ops;
};

LogicalResult Importer::importTensor(const json &t, unsigned index) {
  std::string name = t.is_object() && t.contains("name") && t["name"].is_string()
                         ? t["name"].get<std::string>()
                         : "";
  Location loc = locOf("tensors", name, tensorIndex.count(name));
  std::string what = "tensor " + std::to_string(index) + (name.empty() ? "" : " '" + name + "'");
  if (failed(checkKeys(t, loc, what,
                       keysOf({"name", "shape", "dtype", "param_position", "list", "dynamic",
                               "transpose"}),
                       keysOf({"name", "shape", "dtype"}))))
    return failure();
  if (!t["name"].is_string() || name.empty())
    return error(loc) << what << ": 'name' must be a non-empty string";
  if (tensorIndex.count(name))
    return error(loc) << "tensor '" << name << "' is declared twice";
  if (!t["shape"].is_array() || t["shape"].empty())
    return error(loc) << what << ": 'shape' must be a non-empty array of dims";
  SmallVector<Attribute> dims;
  for (const auto &[i, d] : llvm::enumerate(t["shape"])) {
    if (d.is_number_integer()) {
      if (d.get<int64_t>() <= 0)
        return error(loc) << what << ": dim " << i << " must be positive, got " << d.dump();
      dims.push_back(b.getI64IntegerAttr(d.get<int64_t>()));
    } else if (d.is_string()) {
      std::string err;
      if (!Expr::parse(d.get<std::string>(), &err))
        return error(loc) << what << ": dim " << i << " '" << d.get<std::string>()
                          << "': " << err;
      dims.push_back(b.getStringAttr(d.get<std::string>()));
    } else {
      return error(loc) << what << ": dim " << i
                        << " must be an integer or an expression string, got " << d.dump();
    }
  }
  if (!t["dtype"].is_string())
    return error(loc) << what << ": 'dtype' must be a string";
  std::string dtype = t["dtype"];
  Type elt;
  if (dtype == "act")
    elt = ActType::get(ctx);
  else if (dtype == "fp32")
    elt = b.getF32Type();
  else if (dtype == "bf16")
    elt = b.getBF16Type();
  else if (dtype == "fp8_e4m3")
    elt = b.getFloat8E4M3FNType();
  else if (dtype == "int8")
    elt = b.getIntegerType(8);
  else if (dtype == "int4")
    elt = b.getIntegerType(4);
  else if (dtype == "i32")
    elt = b.getI32Type();
  else if (dtype == "i64")
    elt = b.getI64Type();
  else
    return error(loc) << what << ": unknown dtype '" << dtype
                      << "' (expected act, fp32, bf16, fp8_e4m3, int8, int4, i32 or i64)";
  auto flag = [&](const char *key, bool *out) -> LogicalResult {
    *out = false;
    if (!t.contains(key))
      return success();
    if (!t[key].is_boolean())
      return error(loc) << what << ": '" << key << "' must be true or false";
    *out = t[key].get<bool>();
    return success();
  };
  bool list, dynamic, transpose;
  if (failed(flag("list", &list)) || failed(flag("dynamic", &dynamic)) ||
      failed(flag("transpose", &transpose)))
    return failure();
  std::optional<int64_t> slot;
  if (t.contains("param_position")) {
    if (!t["param_position"].is_number_integer() || t["param_position"].get<int64_t>() < 0)
      return error(loc) << what << ": 'param_position' must be a non-negative integer, got "
                        << t["param_position"].dump();
    slot = t["param_position"].get<int64_t>();
  }
  auto type = MoeTensorType::getChecked([&] { return error(loc) << what << ": "; }, ctx,
                                        b.getArrayAttr(dims), elt, list, dynamic);
  if (!type)
    return failure();
  tensorIndex[name] = tensors.size();
  tensors.push_back(TensorDecl{name, type, slot, transpose, loc, "", Value()});
  return success();
}

FailureOr<Attribute> Importer::fillValue(const json &v, Location loc, const std::string &what) {
  if (v.is_boolean())
    return Attribute(b.getBoolAttr(v.get<bool>()));
  if (v.is_number_integer())
    return Attribute(b.getI64IntegerAttr(v.get<int64_t>()));
  if (v.is_string())
    return Attribute(b.getStringAttr(v.get<std::string>()));
  if (v.is_array()) {
    SmallVector<Attribute> items;
    for (const json &e : v) {
      if (!e.is_number_integer())
        return error(loc) << what << " must hold integers, got " << e.dump();
      items.push_back(b.getI64IntegerAttr(e.get<int64_t>()));
    }
    return Attribute(b.getArrayAttr(items));
  }
  return error(loc) << what << " must be a boolean, integer, string or list of integers, got "
                    << v.dump();
}

LogicalResult Importer::importOp(const json &o, unsigned index) {
  std::string name = o.is_object() && o.contains("name") && o["name"].is_string()
                         ? o["name"].get<std::string>()
                         : "";
  Location loc = locOf("ops", name, opIndex.count(name));
  std::string what = "op " + std::to_string(index) + (name.empty() ? "" : " '" + name + "'");
  if (failed(checkKeys(o, loc, what,
                       keysOf({"name", "op", "inputs", "outputs", "split_value", "split_spec",
                               "tiling_position", "fill", "accumulate", "scale", "quantizable",
                               "reduce_tp"}),
                       keysOf({"name", "op", "inputs", "outputs", "split_value", "split_spec"}))))
    return failure();
  if (!o["name"].is_string() || name.empty())
    return error(loc) << what << ": 'name' must be a non-empty string";
  if (opIndex.count(name))
    return error(loc) << "op name '" << name << "' is used twice";
  if (!o["op"].is_string())
    return error(loc) << what << ": 'op' must be a string";
  std::string kind = o["op"];
  auto kindIt = llvm::find_if(opKinds(), [&](const auto &k) { return k.first == kind; });
  if (kindIt == opKinds().end()) {
    std::vector<std::string> names;
    for (const auto &k : opKinds())
      names.push_back(k.first);
    auto diag = error(loc) << what << ": unknown op '" << kind << "'";
    std::string near = closestName(kind, names);
    if (!near.empty())
      diag << " (did you mean '" << near << "'?)";
    else
      diag << " (expected dispatch, combine, gmm, swiglu, swiglu_grad, quantize or dequantize)";
    return diag;
  }
  // Inputs and output.
  if (!o["inputs"].is_array())
    return error(loc) << what << ": 'inputs' must be an array of tensor names";
  // A gmm takes an optional fourth input: the addend (or, when its weight is
  // FP8 e4m3, the weight's block scales).
  const bool addend = kind == "gmm" && o["inputs"].size() == kindIt->second + 1;
  if (o["inputs"].size() != kindIt->second && !addend)
    return error(loc) << what << ": a " << kind << " op takes " << kindIt->second
                      << (kind == "gmm" ? " inputs (4 with an addend)" : " inputs") << ", got "
                      << o["inputs"].size();
  if (!o["outputs"].is_array() || o["outputs"].size() != 1 || !o["outputs"][0].is_string())
    return error(loc) << what << ": 'outputs' must name exactly one tensor";
  auto lookup = [&](const json &n, const std::string &role) -> FailureOr<unsigned> {
    if (!n.is_string())
      return error(loc) << what << ": " << role << " must be a tensor name, got " << n.dump();
    auto it = tensorIndex.find(n.get<std::string>());
    if (it != tensorIndex.end())
      return it->second;
    std::vector<std::string> names;
    for (const TensorDecl &t : tensors)
      names.push_back(t.name);
    auto diag = error(loc) << what << ": " << role << " names tensor '" << n.get<std::string>()
                           << "', which is not declared in 'tensors'";
    std::string near = closestName(n.get<std::string>(), names);
    if (!near.empty())
      diag << " (did you mean '" << near << "'?)";
    return diag;
  };
  for (const auto &[i, in] : llvm::enumerate(o["inputs"]))
    if (failed(lookup(in, "input " + std::to_string(i))))
      return failure();
  FailureOr<unsigned> out = lookup(o["outputs"][0], "output 0");
  if (failed(out))
    return failure();
  TensorDecl &result = tensors[*out];
  if (!result.producer.empty())
    return error(loc) << what << ": tensor '" << result.name << "' is already written by op '"
                      << result.producer << "'";
  result.producer = name;
  // Split value and spec.
  const bool autoSplit = o["split_value"].is_string() && o["split_value"] == "auto";
  if (!autoSplit &&
      (!o["split_value"].is_number_integer() || o["split_value"].get<int64_t>() <= 0))
    return error(loc) << what << ": 'split_value' must be a positive integer or \"auto\", got "
                      << o["split_value"].dump();
  const json &spec = o["split_spec"];
  if (failed(checkKeys(spec, loc, what + " split_spec",
                       keysOf({"split_inputs", "split_output_dims", "task_num"}),
                       keysOf({"split_inputs", "split_output_dims"}))))
    return failure();
  SmallVector<int64_t> pairs, outDims;
  if (!spec["split_inputs"].is_null()) {
    if (!spec["split_inputs"].is_array())
      return error(loc) << what << ": 'split_inputs' must be null or a list of [input, dim] pairs";
    for (const json &p : spec["split_inputs"]) {
      if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() ||
          !p[1].is_number_integer())
        return error(loc) << what << ": split input " << p.dump()
                          << " is not an [input, dim] pair of integers";
      pairs.append({p[0].get<int64_t>(), p[1].get<int64_t>()});
    }
  }
  if (!spec["split_output_dims"].is_array())
    return error(loc) << what << ": 'split_output_dims' must be a list of dims";
  for (const json &d : spec["split_output_dims"]) {
    if (!d.is_number_integer())
      return error(loc) << what << ": split output dim " << d.dump() << " is not an integer";
    outDims.push_back(d.get<int64_t>());
  }
  StringAttr taskNum;
  if (spec.contains("task_num")) {
    if (!spec["task_num"].is_string())
      return error(loc) << what << ": 'task_num' must be an expression string, e.g. "
                        << "\"num_cube_cores * single_rank_expert_num\"";
    taskNum = b.getStringAttr(spec["task_num"].get<std::string>());
    if (autoSplit)
      return error(loc) << what << ": 'task_num' and 'split_value' \"auto\" exclude each "
                        << "other: with \"auto\" the compiler chooses the task count";
  }
  OpDecl decl{name, kind, loc, {}, *out, {}};
  for (const json &in : o["inputs"])
    decl.inputs.push_back(tensorIndex[in.get<std::string>()]);
  NamedAttrList &attrs = decl.attrs;
  attrs.append("op_name", b.getStringAttr(name));
  attrs.append("result_name", b.getStringAttr(result.name));
  if (result.slot)
    attrs.append("slot", b.getI64IntegerAttr(*result.slot));
  attrs.append("split_value", b.getI64IntegerAttr(autoSplit ? 0 : o["split_value"].get<int64_t>()));
  if (autoSplit)
    attrs.append("auto_split", b.getUnitAttr());
  attrs.append("split", SplitAttr::get(ctx, pairs, outDims, taskNum));
  if (o.contains("tiling_position")) {
    if (!o["tiling_position"].is_number_integer())
      return error(loc) << what << ": 'tiling_position' must be an integer (-1 for none)";
    attrs.append("tiling_slot", b.getI64IntegerAttr(o["tiling_position"].get<int64_t>()));
  }
  if (o.contains("fill")) {
    const json &fill = o["fill"];
    if (!fill.is_object())
      return error(loc) << what << ": 'fill' must be an object";
    SmallVector<NamedAttribute> entries;
    for (const auto &[key, v] : fill.items()) {
      FailureOr<Attribute> a = fillValue(v, loc, what + " fill key '" + key + "'");
      if (failed(a))
        return failure();
      entries.push_back(b.getNamedAttr(key, *a));
    }
    attrs.append("fill", b.getDictionaryAttr(entries));
  }
  if (o.contains("quantizable")) {
    if (kind != "dispatch" || !o["quantizable"].is_boolean())
      return error(loc) << what << ": 'quantizable' is a boolean of dispatch ops only";
    if (o["quantizable"].get<bool>())
      attrs.append("quantizable", b.getUnitAttr());
  }
  if (o.contains("reduce_tp")) {
    if (kind != "combine" || !o["reduce_tp"].is_boolean())
      return error(loc) << what << ": 'reduce_tp' is a boolean of combine ops only";
    if (o["reduce_tp"].get<bool>())
      attrs.append("reduce_tp", b.getUnitAttr());
  }
  if (o.contains("accumulate")) {
    if (kind != "gmm" || !o["accumulate"].is_boolean())
      return error(loc) << what << ": 'accumulate' is a boolean of gmm ops only";
    if (o["accumulate"].get<bool>())
      attrs.append("accumulate", b.getUnitAttr());
  }
  if (o.contains("scale")) {
    const json &scale = o["scale"];
    if (kind != "gmm")
      return error(loc) << what << ": 'scale' is a key of gmm ops only";
    if (scale.is_number())
      attrs.append("scale", b.getF64FloatAttr(scale.get<double>()));
    else if (scale.is_string() && scale.get<std::string>() == kLoraScaling)
      attrs.append("scale", b.getStringAttr(kLoraScaling));
    else
      return error(loc) << what << ": 'scale' must be a number or \"" << kLoraScaling
                        << "\" (lora_alpha / lora_rank of the config), got " << scale.dump();
  }
  opIndex[name] = ops.size();
  ops.push_back(std::move(decl));
  return success();
}

FailureOr<ArrayAttr> Importer::importEdges(const json &edges) {
  Location loc = locOf("edges", "");
  if (!edges.is_array())
    return error(loc) << "'edges' must be an array of [producer, consumer] op-name pairs";
  SmallVector<Attribute> pairs;
  for (const auto &[i, e] : llvm::enumerate(edges)) {
    if (!e.is_array() || e.size() != 2 || !e[0].is_string() || !e[1].is_string())
      return error(loc) << "edge " << i << " must be a [producer, consumer] pair of op names, got "
                        << e.dump();
    for (const json &end : e)
      if (!opIndex.count(end.get<std::string>()))
        return error(loc) << "edge " << i << " names op '" << end.get<std::string>()
                          << "', which is not in 'ops'";
    std::string from = e[0], to = e[1];
    if (from == to)
      return error(loc) << "edge " << i << " goes from '" << from << "' to itself";
    for (Attribute earlier : pairs)
      if (earlier.cast<ArrayAttr>()[0].cast<StringAttr>().getValue() == from &&
          earlier.cast<ArrayAttr>()[1].cast<StringAttr>().getValue() == to)
        return error(loc) << "edge " << i << " ('" << from << "' -> '" << to
                          << "') is listed twice";
    pairs.push_back(b.getStrArrayAttr({from, to}));
  }
  return b.getArrayAttr(pairs);
}

OwningOpRef<ModuleOp> Importer::run() {
  json root;
  try {
    root = parseJsonLimited<json>(text);
  } catch (const json::parse_error &e) {
    error(locAt(e.byte ? e.byte - 1 : 0)) << "malformed JSON: " << jsonParseMessage(e);
    return nullptr;
  } catch (const json::exception &e) {
    error(locAt(0)) << "malformed JSON: " << e.what();
    return nullptr;
  } catch (const JsonRefused &e) {
    error(locAt(e.byte)) << "malformed JSON: " << e.what();
    return nullptr;
  }
  Location top = locAt(0);
  if (failed(checkKeys(root, top, "graph", keysOf({"name", "tensors", "ops", "edges"}),
                       keysOf({"name", "tensors", "ops"}))))
    return nullptr;
  if (!root["name"].is_string() || root["name"].get<std::string>().empty()) {
    error(top) << "graph 'name' must be a non-empty string";
    return nullptr;
  }
  if (!root["tensors"].is_array() || !root["ops"].is_array()) {
    error(top) << "graph 'tensors' and 'ops' must be arrays";
    return nullptr;
  }
  for (const auto &[i, t] : llvm::enumerate(root["tensors"]))
    if (failed(importTensor(t, i)))
      return nullptr;
  for (const auto &[i, o] : llvm::enumerate(root["ops"]))
    if (failed(importOp(o, i)))
      return nullptr;
  ArrayAttr edges;
  if (root.contains("edges")) {
    FailureOr<ArrayAttr> imported = importEdges(root["edges"]);
    if (failed(imported))
      return nullptr;
    edges = *imported;
  }

  // Transposed tensors: only grouped-matmul lhs/rhs operands may be.
  for (auto [index, t] : llvm::enumerate(tensors)) {
    if (!t.transpose)
      continue;
    bool read = false;
    for (OpDecl &op : ops)
      for (auto [i, in] : llvm::enumerate(op.inputs)) {
        if (in != index)
          continue;
        read = true;
        if (op.kind != "gmm" || i > 1) {
          error(t.loc) << "tensor '" << t.name << "' is marked transpose, but op '" << op.name
                       << "' reads it as input " << i
                       << "; only grouped-matmul lhs and rhs inputs can be transposed";
          return nullptr;
        }
        op.attrs.set(i == 0 ? "transpose_lhs" : "transpose_rhs", b.getUnitAttr());
      }
    if (!read) {
      error(t.loc) << "tensor '" << t.name
                   << "' is marked transpose, but no grouped matmul reads it";
      return nullptr;
    }
  }

  OwningOpRef<ModuleOp> module = ModuleOp::create(top);
  OpBuilder ob(ctx);
  ob.setInsertionPointToEnd(module->getBody());
  auto graph = ob.create<GraphOp>(top, b.getStringAttr(root["name"].get<std::string>()), edges,
                                  DictionaryAttr());
  Block *body = new Block();
  graph.getBody().push_back(body);
  ob.setInsertionPointToEnd(body);

  // Graph inputs first, then ops in the order given; the region is a graph
  // region, so an op may read a tensor an op further down writes.
  for (TensorDecl &t : tensors) {
    if (!t.producer.empty())
      continue;
    auto input = ob.create<InputOp>(t.loc, t.type, b.getStringAttr(t.name),
                                    t.slot ? b.getI64IntegerAttr(*t.slot) : IntegerAttr());
    t.value = input.getResult();
  }
  SmallVector<std::pair<Operation *, std::vector<unsigned>>> pendingOperands;
  for (OpDecl &decl : ops) {
    TensorDecl &out = tensors[decl.output];
    OperationState state(decl.loc, "moe." + decl.kind);
    state.addTypes(out.type);
    state.addAttributes(decl.attrs);
    Operation *op = ob.create(state);
    out.value = op->getResult(0);
    pendingOperands.push_back({op, decl.inputs});
  }
  // Operands are set once every op exists, so order does not matter.
  for (auto &[op, inputs] : pendingOperands) {
    SmallVector<Value> operands;
    for (unsigned i : inputs)
      operands.push_back(tensors[i].value);
    op->setOperands(operands);
  }
  if (failed(mlir::verify(*module)))
    return nullptr;
  return module;
}

} // namespace

OwningOpRef<ModuleOp> moec::importGraphJson(std::string_view text, const std::string &source,
                                            MLIRContext *context) {
  context->getOrLoadDialect<MoeDialect>();
  return Importer(text, source, context).run();
}

OwningOpRef<ModuleOp> moec::loadGraph(const std::string &path, MLIRContext *context) {
  context->getOrLoadDialect<MoeDialect>();
  std::string content;
  if (moec::Status status = moec::readTextFile(path, &content); !status) {
    mlir::emitError(UnknownLoc::get(context)) << status.message();
    return nullptr;
  }
  // JSON by its name, or by its first character under any other name (an
  // MLIR file never starts with '{'): a graph.txt is still a graph.
  const llvm::StringRef text = content;
  if (llvm::StringRef(path).endswith(".json") ||
      (!llvm::StringRef(path).endswith(".mlir") && text.ltrim().startswith("{")))
    return importGraphJson(content, path, context);
  return parseGraphMlir(text, path, context);
}

OwningOpRef<ModuleOp> moec::parseGraphMlir(llvm::StringRef text, const std::string &source,
                                           MLIRContext *context) {
  context->getOrLoadDialect<MoeDialect>();
  if (std::optional<DeepNesting> deep = findDeepNesting(std::string_view(text.data(), text.size()))) {
    mlir::emitError(FileLineColLoc::get(context, source, deep->line, deep->column))
        << deep->message;
    return nullptr;
  }
  llvm::SourceMgr sourceMgr;
  // A copy: MLIR's lexer reads up to a terminating NUL, which `text` need
  // not have.
  sourceMgr.AddNewSourceBuffer(llvm::MemoryBuffer::getMemBufferCopy(text, source), SMLoc());
  OwningOpRef<ModuleOp> module = parseSourceFile<ModuleOp>(sourceMgr, context);
  if (!module)
    return nullptr;
  auto graphOps = module->getOps<GraphOp>();
  auto graphs = std::distance(graphOps.begin(), graphOps.end());
  if (graphs != 1) {
    mlir::emitError(FileLineColLoc::get(context, source, 1, 1))
        << "'" << source << "' must hold exactly one moe.graph, found " << graphs;
    return nullptr;
  }
  return module;
}
