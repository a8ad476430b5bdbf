//===- JsonExport.cpp - moe dialect -> JSON graph description --------------===//

#include "compiler/import/GraphJson.h"
#include "compiler/ir/GraphUtils.h"

#include "llvm/ADT/DenseMap.h"


using namespace mlir;
using namespace moec;
using namespace moec::moe;
using json = nlohmann::ordered_json;

namespace {

json dimJson(Attribute dim) {
  if (auto i = dim.dyn_cast<IntegerAttr>())
    return i.getInt();
  return dim.cast<StringAttr>().getValue().str();
}

std::string dtypeJson(Type t) {
  if (t.isa<ActType>())
    return "act";
  if (t.isF32())
    return "fp32";
  if (t.isBF16())
    return "bf16";
  if (t.isa<Float8E4M3FNType>())
    return "fp8_e4m3";
  if (t.isInteger(8))
    return "int8";
  if (t.isInteger(4))
    return "int4";
  return t.isInteger(32) ? "i32" : "i64";
}

json fillJson(Attribute v) {
  if (auto bv = v.dyn_cast<BoolAttr>())
    return bv.getValue();
  if (auto i = v.dyn_cast<IntegerAttr>())
    return i.getInt();
  if (auto s = v.dyn_cast<StringAttr>())
    return s.getValue().str();
  json list = json::array();
  for (Attribute e : v.cast<ArrayAttr>())
    list.push_back(e.cast<IntegerAttr>().getInt());
  return list;
}

} // namespace

FailureOr<json> moec::exportGraphJson(ModuleOp module) {
  auto graphs = module.getOps<GraphOp>();
  if (std::distance(graphs.begin(), graphs.end()) != 1)
    return module.emitError() << "exactly one moe.graph can be exported, found "
                              << std::distance(graphs.begin(), graphs.end());
  GraphOp graph = *graphs.begin();

  // A tensor is transposed when a grouped matmul reads it so; JSON keeps that
  // on the tensor, so every reader must agree.
  llvm::DenseMap<Value, bool> transposed;
  for (GmmOp gmm : graph.getBlock().getOps<GmmOp>()) {
    std::pair<Value, bool> reads[] = {{gmm.getLhs(), gmm.getTransposeLhs()},
                                      {gmm.getRhs(), gmm.getTransposeRhs()}};
    for (auto [v, t] : reads) {
      auto [it, fresh] = transposed.try_emplace(v, t);
      if (!fresh && it->second != t)
        return gmm.emitError() << "tensor '" << tensorName(v)
                               << "' is read transposed by one grouped matmul and not by "
                                  "another; the JSON format cannot say that";
    }
  }

  for (auto [v, isTransposed] : transposed) {
    if (!isTransposed)
      continue;
    for (OpOperand &use : v.getUses()) {
      auto gmm = dyn_cast<GmmOp>(use.getOwner());
      if (!gmm || use.getOperandNumber() > 1)
        return use.getOwner()->emitError()
               << "tensor '" << tensorName(v) << "' is read transposed by a grouped matmul and "
               << "also as operand " << use.getOperandNumber() << " of this op; the JSON "
               << "format marks transposition on the tensor, so it cannot say that";
    }
  }

  // Tensors by slot, then those without a slot in block order.
  SmallVector<TensorDefOpInterface> defs;
  for (Operation &op : graph.getBlock())
    defs.push_back(cast<TensorDefOpInterface>(&op));
  std::stable_sort(defs.begin(), defs.end(), [](TensorDefOpInterface a, TensorDefOpInterface b) {
    auto sa = a.getSlot(), sb = b.getSlot();
    if (sa && sb)
      return *sa < *sb;
    return sa.has_value() && !sb.has_value();
  });
  json tensors = json::array();
  for (TensorDefOpInterface def : defs) {
    MoeTensorType type = def.getTensor().getType();
    json t;
    t["name"] = def.getResultName().str();
    t["shape"] = json::array();
    for (Attribute d : type.getDims())
      t["shape"].push_back(dimJson(d));
    t["dtype"] = dtypeJson(type.getElementType());
    if (auto slot = def.getSlot())
      t["param_position"] = *slot;
    if (type.getIsList())
      t["list"] = true;
    if (type.getIsDynamic())
      t["dynamic"] = true;
    if (transposed.lookup(def.getTensor()))
      t["transpose"] = true;
    tensors.push_back(t);
  }

  json ops = json::array();
  for (auto task : graph.getBlock().getOps<TaskOpInterface>()) {
    json o;
    o["name"] = task.getOpName().str();
    o["op"] = task->getName().stripDialect().str();
    o["inputs"] = json::array();
    for (Value v : task->getOperands())
      o["inputs"].push_back(tensorName(v).str());
    o["outputs"] = {tensorName(task->getResult(0)).str()};
    if (task.isAutoSplit())
      o["split_value"] = "auto";
    else
      o["split_value"] = task.getSplitValue();
    SplitAttr split = task.getSplit();
    json spec;
    if (split.isSource()) {
      spec["split_inputs"] = nullptr;
    } else {
      spec["split_inputs"] = json::array();
      for (unsigned i = 0; i < split.getNumSplitInputs(); ++i)
        spec["split_inputs"].push_back({split.getSplitOperand(i), split.getSplitDim(i)});
    }
    spec["split_output_dims"] = split.getOutputDims();
    if (split.getTaskNum())
      spec["task_num"] = split.getTaskNum().getValue().str();
    o["split_spec"] = spec;
    if (auto tiling = task.getTilingSlotValue())
      o["tiling_position"] = *tiling;
    if (auto dispatch = dyn_cast<DispatchOp>(task.getOperation()); dispatch && dispatch.getQuantizable())
      o["quantizable"] = true;
    if (auto combine = dyn_cast<CombineOp>(task.getOperation()); combine && combine.getReduceTp())
      o["reduce_tp"] = true;
    if (auto gmm = dyn_cast<GmmOp>(task.getOperation())) {
      if (gmm.hasLowRank())
        return gmm.emitError() << "gmm '" << task.getOpName()
                               << "' has a low-rank product (moe-fuse-low-rank makes one), which "
                                  "a graph file cannot hold; export the graph before the passes";
      if (gmm.getAccumulate())
        o["accumulate"] = true;
      if (Attribute scale = gmm.getScaleAttr()) {
        if (auto number = scale.dyn_cast<FloatAttr>())
          o["scale"] = number.getValueAsDouble();
        else
          o["scale"] = scale.cast<StringAttr>().str();
      }
    }
    if (DictionaryAttr fill = task.getFillAttr()) {
      json f = json::object();
      for (NamedAttribute entry : fill)
        f[entry.getName().str()] = fillJson(entry.getValue());
      o["fill"] = f;
    }
    ops.push_back(o);
  }

  json root;
  root["name"] = graph.getSymName().str();
  root["tensors"] = tensors;
  root["ops"] = ops;
  if (ArrayAttr edges = graph.getEdgesAttr()) {
    root["edges"] = json::array();
    for (Attribute e : edges) {
      auto pair = e.cast<ArrayAttr>();
      root["edges"].push_back({pair[0].cast<StringAttr>().str(), pair[1].cast<StringAttr>().str()});
    }
  }
  return root;
}
