//===- MoeOps.cpp - moe op verifiers and graph queries ---------------------===//

#include "base/Text.h"
#include "compiler/config/Config.h"
#include "compiler/ir/GraphUtils.h"
#include "compiler/ir/MoeDialect.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/ADT/SetVector.h"
#include "llvm/ADT/StringSet.h"

#include <cmath>
#include <cstdio>
#include <regex>
#include <set>

using namespace mlir;
using namespace moec;
using namespace moec::moe;

#include "compiler/ir/MoeInterfaces.cpp.inc"

#define GET_OP_CLASSES
#include "compiler/ir/MoeOps.cpp.inc"

//===----------------------------------------------------------------------===//
// Graph queries
//===----------------------------------------------------------------------===//

StringRef moec::moe::tensorName(Value v) {
  if (auto def = v.getDefiningOp<TensorDefOpInterface>())
    return def.getResultName();
  return "<unnamed>";
}

TaskOpInterface moec::moe::producerOf(Value v) { return v.getDefiningOp<TaskOpInterface>(); }

SmallVector<TaskOpInterface> moec::moe::orderingPredecessors(TaskOpInterface op) {
  SmallVector<TaskOpInterface> preds;
  auto graph = op->getParentOfType<GraphOp>();
  if (!graph || !graph.getEdgesAttr())
    return preds;
  for (Attribute e : graph.getEdgesAttr()) {
    auto pair = e.cast<ArrayAttr>();
    if (pair[1].cast<StringAttr>().getValue() != op.getOpName())
      continue;
    for (auto other : graph.getBlock().getOps<TaskOpInterface>())
      if (other.getOpName() == pair[0].cast<StringAttr>().getValue())
        preds.push_back(other);
  }
  return preds;
}

void moec::moe::renameInEdges(GraphOp graph, StringRef from, StringRef to, EdgeEnds ends) {
  ArrayAttr edges = graph.getEdgesAttr();
  if (!edges)
    return;
  Builder b(graph.getContext());
  SmallVector<Attribute> renamed;
  for (Attribute edge : edges) {
    auto pair = edge.cast<ArrayAttr>();
    if (pair.size() != 2) {
      renamed.push_back(edge);
      continue;
    }
    StringRef first = pair[0].cast<StringAttr>().getValue(),
              second = pair[1].cast<StringAttr>().getValue();
    first = first == from ? to : first;
    if (ends == EdgeEnds::Both)
      second = second == from ? to : second;
    if (first == second)
      continue;
    renamed.push_back(b.getArrayAttr({b.getStringAttr(first), b.getStringAttr(second)}));
  }
  graph.setEdgesAttr(b.getArrayAttr(renamed));
}

/// Every op `op` waits for: producers of its operands, then ordering edges.
static SmallVector<Operation *> predecessors(TaskOpInterface op) {
  SmallVector<Operation *> preds;
  for (Value v : op->getOperands())
    if (TaskOpInterface p = producerOf(v))
      preds.push_back(p);
  for (TaskOpInterface p : orderingPredecessors(op))
    preds.push_back(p);
  return preds;
}

LogicalResult moec::moe::topologicalOrder(GraphOp graph,
                                          SmallVectorImpl<TaskOpInterface> &order) {
  SmallVector<TaskOpInterface> ops;
  for (Operation &op : graph.getBlock())
    if (auto task = dyn_cast<TaskOpInterface>(&op))
      ops.push_back(task);
  // Kahn's algorithm; among ready ops the earliest in block order goes first.
  llvm::DenseMap<Operation *, SmallVector<Operation *>> preds;
  for (TaskOpInterface op : ops)
    preds[op] = predecessors(op);
  llvm::SetVector<Operation *> done;
  bool progress = true;
  while (progress && done.size() < ops.size()) {
    progress = false;
    for (TaskOpInterface op : ops) {
      if (done.contains(op) ||
          llvm::any_of(preds[op], [&](Operation *p) { return !done.contains(p); }))
        continue;
      done.insert(op);
      order.push_back(op);
      progress = true;
      break;
    }
  }
  if (done.size() == ops.size())
    return success();
  // Walk back from a blocked op along unfinished producers until an op repeats.
  Operation *start = nullptr;
  for (TaskOpInterface op : ops)
    if (!done.contains(op)) {
      start = op;
      break;
    }
  SmallVector<Operation *> path;
  llvm::DenseMap<Operation *, unsigned> seenAt;
  Operation *cur = start;
  while (!seenAt.count(cur)) {
    seenAt[cur] = path.size();
    path.push_back(cur);
    for (Operation *p : preds[cur])
      if (!done.contains(p)) {
        cur = p;
        break;
      }
  }
  // path[i + 1] feeds path[i], and `cur` feeds path.back(): in data-flow
  // order the cycle is cur -> path.back() -> ... -> cur.
  auto name = [](Operation *op) { return "'" + cast<TaskOpInterface>(op).getOpName().str() + "'"; };
  std::string cycle = name(cur);
  for (unsigned i = path.size(); i-- > seenAt[cur];)
    cycle += " -> " + name(path[i]);
  return graph.emitError() << "graph '" << graph.getSymName()
                           << "' has a cycle: " << cycle;
}

Expr moec::moe::dimExpr(MoeTensorType type, unsigned i) {
  if (auto v = type.getDimValue(i))
    return Expr::constant(*v);
  std::string error;
  return *Expr::parse(type.getDimText(i), &error); // the type verifier parsed it already
}

/// `e` with every derived config symbol replaced by its definition, so that
/// e.g. `per_rank_seq` and `seq_all / ep` compare equal.
static Expr expandDerived(const Expr &e) {
  static const std::regex identifier("[A-Za-z_][A-Za-z0-9_]*");
  std::string text = e.text();
  for (bool changed = true; changed;) {
    changed = false;
    std::string out;
    auto begin = std::sregex_iterator(text.begin(), text.end(), identifier);
    size_t last = 0;
    for (auto it = begin; it != std::sregex_iterator(); ++it) {
      out += text.substr(last, it->position() - last);
      std::string word = it->str();
      auto def = llvm::find_if(derivedSymbolDefinitions(),
                               [&](const auto &d) { return d.first == word; });
      if (def != derivedSymbolDefinitions().end()) {
        out += "(" + def->second + ")";
        changed = true;
      } else {
        out += word;
      }
      last = it->position() + it->length();
    }
    text = out + text.substr(last);
  }
  std::string error;
  std::optional<Expr> expanded = Expr::parse(text, &error);
  return expanded ? *expanded : e;
}

DimRelation moec::moe::compareDims(const Expr &a, const Expr &b) {
  if (a.isConstant() != b.isConstant())
    return DimRelation::Unknown;
  if (a.canonical() == b.canonical())
    return DimRelation::Equal;
  std::string ca = expandDerived(a).canonical(), cb = expandDerived(b).canonical();
  if (ca == cb)
    return DimRelation::Equal;
  // Division-free polynomials over independent symbols that differ take
  // different values for some config; with a division we cannot tell yet.
  if (ca.find('/') != std::string::npos || cb.find('/') != std::string::npos)
    return DimRelation::Unknown;
  return DimRelation::Different;
}

//===----------------------------------------------------------------------===//
// Graph and input
//===----------------------------------------------------------------------===//

RegionKind GraphOp::getRegionKind(unsigned) { return RegionKind::Graph; }

/// Refuses a name that is not UTF-8 text or holds a control character,
/// naming where and which byte (never printing it): names are printed to
/// terminals and written into binaries, whose reader refuses them too.
static LogicalResult checkPrintable(Operation *op, const char *what, llvm::StringRef name) {
  const std::string_view text(name.data(), name.size());
  char code[8];
  if (const size_t at = firstNonUtf8(text); at != std::string_view::npos) {
    std::snprintf(code, sizeof code, "0x%02x", unsigned(static_cast<unsigned char>(name[at])));
    return op->emitOpError() << what << " holds byte " << code << " at byte " << at
                             << ", which is not UTF-8 text; names are printed to terminals and "
                                "written into binaries, so use UTF-8 text";
  }
  const size_t at = firstControlCharacter(text);
  if (at == std::string_view::npos)
    return success();
  std::snprintf(code, sizeof code, "U+%04X", unsigned(static_cast<unsigned char>(name[at])));
  return op->emitOpError() << what << " holds control character " << code << " at byte " << at
                           << "; names are printed to terminals and written into binaries, so "
                           << "use printable characters";
}

LogicalResult GraphOp::verifyRegions() {
  llvm::StringMap<Operation *> tensors, opNames;
  if (failed(checkPrintable(*this, "the graph's name", getSymName())))
    return failure();
  auto verifyEdges = [&]() -> LogicalResult {
    if (!getEdgesAttr())
      return success();
    std::set<std::pair<std::string, std::string>> seen;
    for (auto [i, e] : llvm::enumerate(getEdgesAttr())) {
      auto pair = e.dyn_cast<ArrayAttr>();
      if (!pair || pair.size() != 2 || !pair[0].isa<StringAttr>() || !pair[1].isa<StringAttr>())
        return emitOpError() << "edge " << i << " must be a pair of op names";
      for (Attribute end : pair)
        if (!opNames.count(end.cast<StringAttr>().getValue()))
          return emitOpError() << "edge " << i << " names op '"
                               << end.cast<StringAttr>().getValue() << "', which is not in the graph";
      std::pair<std::string, std::string> key{pair[0].cast<StringAttr>().str(),
                                              pair[1].cast<StringAttr>().str()};
      if (key.first == key.second)
        return emitOpError() << "edge " << i << " goes from '" << key.first << "' to itself";
      if (!seen.insert(key).second)
        return emitOpError() << "edge " << i << " ('" << key.first << "' -> '" << key.second
                             << "') is listed twice";
    }
    return success();
  };
  llvm::DenseMap<int64_t, Operation *> slots, tilingSlots;
  for (Operation &op : getBlock()) {
    auto def = dyn_cast<TensorDefOpInterface>(&op);
    if (!def)
      return op.emitOpError() << "is not allowed in a moe.graph (only moe ops are)";
    if (failed(checkPrintable(&op, "a tensor name", def.getResultName())))
      return failure();
    auto [it, fresh] = tensors.try_emplace(def.getResultName(), &op);
    if (!fresh)
      return op.emitOpError() << "defines tensor '" << def.getResultName()
                              << "' a second time (first defined at " << it->second->getLoc()
                              << ")";
    // Out-of-range slots are the op's own verifier's to report; they must
    // not reach the maps (INT64_MAX is a DenseMap's reserved key).
    if (auto slot = def.getSlot(); slot && *slot <= uint64_t(kMaxSlot)) {
      auto [s, freshSlot] = slots.try_emplace(*slot, &op);
      if (!freshSlot)
        return op.emitOpError() << "tensor '" << def.getResultName() << "' takes slot " << *slot
                                << ", already taken by tensor '"
                                << cast<TensorDefOpInterface>(s->second).getResultName() << "'";
    }
    auto task = dyn_cast<TaskOpInterface>(&op);
    if (!task)
      continue;
    if (failed(checkPrintable(&op, "an op name", task.getOpName())))
      return failure();
    auto [n, freshName] = opNames.try_emplace(task.getOpName(), &op);
    if (!freshName)
      return op.emitOpError() << "op name '" << task.getOpName() << "' is used twice";
    if (auto t = task.getTilingSlotValue(); t && *t >= 0 && *t <= kMaxSlot) {
      auto [s, freshSlot] = tilingSlots.try_emplace(*t, &op);
      if (!freshSlot)
        return op.emitOpError() << "'" << task.getOpName() << "' takes tiling slot " << *t
                                << ", already taken by '"
                                << cast<TaskOpInterface>(s->second).getOpName() << "'";
    }
  }
  if (DictionaryAttr bound = getBindingsAttr())
    for (NamedAttribute b : bound) {
      auto v = b.getValue().dyn_cast<IntegerAttr>();
      if (!v || b.getValue().isa<BoolAttr>() || !v.getType().isInteger(64))
        return emitOpError() << "binding '" << b.getName().getValue()
                             << "' must be an i64 integer, got " << b.getValue();
    }
  return verifyEdges();
}

LogicalResult InputOp::verify() {
  if (auto slot = getSlotAttr(); slot && (slot.getInt() < 0 || slot.getInt() > kMaxSlot))
    return emitOpError() << "tensor '" << getResultName() << "' has slot " << slot.getInt()
                         << ": a slot is 0 to " << kMaxSlot;
  return success();
}

//===----------------------------------------------------------------------===//
// Compute-op verification
//===----------------------------------------------------------------------===//

namespace {

/// Emits errors that name the op and its tensors.
class Checker {
public:
  explicit Checker(TaskOpInterface op) : op(op) {}

  InFlightDiagnostic error() {
    return op->emitOpError() << "'" << op.getOpName() << "': ";
  }

  /// Describes operand or result `v`: "lhs 'target'".
  std::string describe(StringRef role, Value v) {
    return (role + " '" + tensorName(v) + "'").str();
  }

  LogicalResult rank(StringRef role, Value v, unsigned want) {
    auto t = v.getType().cast<MoeTensorType>();
    if (t.getRank() == want)
      return success();
    return error() << describe(role, v) << " must have rank " << want << ", got rank "
                   << t.getRank();
  }

  /// Refuses `v` when it has no dim `i` (the rank checks of an op's
  /// operands may come after the dims compared with them).
  LogicalResult hasDim(StringRef role, Value v, unsigned i) {
    auto t = v.getType().cast<MoeTensorType>();
    if (i < t.getRank())
      return success();
    return error() << describe(role, v) << " has rank " << t.getRank() << ", so no dim " << i;
  }

  /// Checks dim `i` of `a` equals `expected` (an expression) unless unknown.
  LogicalResult dimIs(StringRef role, Value a, unsigned i, const Expr &expected,
                      StringRef expectedWhat) {
    if (failed(hasDim(role, a, i)))
      return failure();
    auto t = a.getType().cast<MoeTensorType>();
    Expr got = dimExpr(t, i);
    if (compareDims(got, expected) != DimRelation::Different)
      return success();
    return error() << "shape mismatch: " << describe(role, a) << " dim " << i << " is '"
                   << got.text() << "' but " << expectedWhat << " is '" << expected.text()
                   << "'";
  }

  LogicalResult dimsEqual(StringRef roleA, Value a, unsigned i, StringRef roleB, Value b,
                          unsigned j) {
    if (failed(hasDim(roleB, b, j)))
      return failure();
    return dimIs(roleA, a, i, dimExpr(b.getType().cast<MoeTensorType>(), j),
                 describe(roleB, b) + " dim " + std::to_string(j));
  }

  LogicalResult elementType(StringRef role, Value v, function_ref<bool(Type)> ok,
                            StringRef want) {
    Type t = v.getType().cast<MoeTensorType>().getElementType();
    if (ok(t))
      return success();
    std::string got;
    llvm::raw_string_ostream os(got);
    if (t.isa<ActType>())
      os << "act";
    else
      os << t;
    return error() << describe(role, v) << " must have element type " << want << ", got "
                   << os.str();
  }

  LogicalResult sameElementType(StringRef roleA, Value a, StringRef roleB, Value b) {
    Type ta = a.getType().cast<MoeTensorType>().getElementType();
    Type tb = b.getType().cast<MoeTensorType>().getElementType();
    if (ta == tb)
      return success();
    return error() << "dtype mismatch: " << describe(roleA, a) << " and " << describe(roleB, b)
                   << " differ in element type";
  }

  TaskOpInterface op;
};

bool isIndexType(Type t) { return t.isInteger(32) || t.isInteger(64); }
bool isDataType(Type t) { return t.isa<ActType>() || t.isF32() || t.isBF16(); }
constexpr const char *kDataTypes = "act, f32 or bf16";
bool isFp8(Type t) { return t.isa<Float8E4M3FNType>(); }
/// What rows a put moves: data, or FP8 rows a quantize made.
bool isRowType(Type t) { return isDataType(t) || isFp8(t); }
constexpr const char *kRowTypes = "act, f32, bf16 or f8E4M3FN";

/// The fill-config keys each op kind accepts, and what each holds.
enum class FillKind { Bool, Expr, IntList, Enum };
struct FillKey {
  const char *name;
  FillKind kind;
  std::vector<const char *> choices; // for Enum
};

const std::vector<FillKey> &fillKeysFor(StringRef seedType) {
  static const std::vector<FillKey> allToAll = {
      {"advance", FillKind::Enum, {"vector", "vector_only"}},
      {"event_group", FillKind::Expr, {}},
  };
  static const std::vector<FillKey> gmm = {
      {"offset_inputs", FillKind::IntList, {}},
      {"rank_in_event", FillKind::Bool, {}},
      {"global_trigger", FillKind::Bool, {}},
      {"out_offset", FillKind::Bool, {}},
      {"advance", FillKind::Enum, {"cube", "cube_only", "cube_custom"}},
      {"event_delta", FillKind::Expr, {}},
      {"num_cube_cores", FillKind::Expr, {}},
  };
  static const std::vector<FillKey> none = {};
  if (seedType == "ALLTOALL")
    return allToAll;
  if (seedType == "GMM")
    return gmm;
  return none;
}

LogicalResult verifyFill(Checker &c) {
  DictionaryAttr fill = c.op.getFillAttr();
  if (!fill)
    return success();
  const auto &keys = fillKeysFor(c.op.getSeedOpType());
  for (NamedAttribute entry : fill) {
    StringRef name = entry.getName().getValue();
    auto key = llvm::find_if(keys, [&](const FillKey &k) { return name == k.name; });
    if (key == keys.end()) {
      auto diag = c.error() << "unknown fill key '" << name << "' for a "
                            << c.op->getName().getStringRef() << " op";
      if (keys.empty())
        diag << " (it takes no fill config)";
      else {
        diag << " (expected one of:";
        for (const FillKey &k : keys)
          diag << " " << k.name;
        diag << ")";
      }
      return diag;
    }
    Attribute v = entry.getValue();
    switch (key->kind) {
    case FillKind::Bool:
      if (!v.isa<BoolAttr>())
        return c.error() << "fill key '" << name << "' must be a boolean";
      break;
    case FillKind::Expr: {
      if (v.isa<IntegerAttr>() && !v.isa<BoolAttr>())
        break;
      auto s = v.dyn_cast<StringAttr>();
      std::string error;
      if (!s)
        return c.error() << "fill key '" << name << "' must be an integer or an expression";
      if (!Expr::parse(s.getValue().str(), &error))
        return c.error() << "fill key '" << name << "': " << error;
      break;
    }
    case FillKind::IntList: {
      auto list = v.dyn_cast<ArrayAttr>();
      if (!list)
        return c.error() << "fill key '" << name << "' must be a list of operand indices";
      for (Attribute e : list) {
        auto i = e.dyn_cast<IntegerAttr>();
        if (!i || e.isa<BoolAttr>() || i.getInt() < 0 || i.getInt() >= c.op->getNumOperands())
          return c.error() << "fill key '" << name << "' holds " << e
                           << ", not an operand index below " << c.op->getNumOperands();
      }
      break;
    }
    case FillKind::Enum: {
      auto s = v.dyn_cast<StringAttr>();
      if (!s || llvm::none_of(key->choices,
                              [&](const char *choice) { return s.getValue() == choice; })) {
        auto diag = c.error() << "fill key '" << name << "' must be one of:";
        for (const char *choice : key->choices)
          diag << " \"" << choice << "\"";
        return diag;
      }
      break;
    }
    }
  }
  return success();
}

/// Checks shared by every compute op: split value, split spec, tiling slot, fill.
LogicalResult verifyTaskCommon(TaskOpInterface op) {
  Checker c(op);
  auto splitValue = op->getAttrOfType<IntegerAttr>("split_value");
  SplitAttr split = op.getSplit();
  if (op.isAutoSplit()) {
    if (split.getTaskNum())
      return c.error() << "an automatic split (split_value \"auto\") has no task_num: the "
                          "compiler chooses the task count";
  } else if (splitValue.getInt() <= 0) {
    return c.error() << "split_value must be positive, got " << splitValue.getInt();
  }
  if (split.getInputPairs().size() % 2)
    return c.error() << "split inputs must be (operand, dim) pairs";
  for (unsigned i = 0; i < split.getNumSplitInputs(); ++i) {
    int64_t operand = split.getSplitOperand(i), dim = split.getSplitDim(i);
    if (operand < 0 || operand >= op->getNumOperands())
      return c.error() << "split input " << i << " names operand " << operand
                       << ", but the op has " << op->getNumOperands() << " operand"
                       << (op->getNumOperands() == 1 ? "" : "s");
    auto type = op->getOperand(operand).getType().cast<MoeTensorType>();
    if (dim < 0 || dim >= type.getRank())
      return c.error() << "split input " << i << " splits dim " << dim << " of "
                       << c.describe("operand " + std::to_string(operand), op->getOperand(operand))
                       << ", which has rank " << type.getRank();
  }
  auto resultType = op->getResult(0).getType().cast<MoeTensorType>();
  if (split.getOutputDims().empty())
    return c.error() << "split spec needs at least one output dim";
  for (int64_t dim : split.getOutputDims())
    if (dim < 0 || dim >= resultType.getRank())
      return c.error() << "split output dim " << dim << " is out of range for "
                       << c.describe("result", op->getResult(0)) << " of rank "
                       << resultType.getRank();
  if (StringAttr taskNum = split.getTaskNum()) {
    std::string error;
    if (!Expr::parse(taskNum.getValue().str(), &error))
      return c.error() << "task_num '" << taskNum.getValue() << "': " << error;
  }
  if (auto tiling = op.getTilingSlotValue(); tiling && (*tiling < -1 || *tiling > kMaxSlot))
    return c.error() << "tiling slot must be -1 (none) or a slot index 0 to " << kMaxSlot
                     << ", got " << *tiling;
  if (auto slot = op->getAttrOfType<IntegerAttr>("slot");
      slot && (slot.getInt() < 0 || slot.getInt() > kMaxSlot))
    return c.error() << "result tensor '" << tensorName(op->getResult(0)) << "' has slot "
                     << slot.getInt() << ": a slot is 0 to " << kMaxSlot;
  return verifyFill(c);
}

/// Operands and result of an all-to-all exchange.
LogicalResult verifyAllToAll(TaskOpInterface op, Value targetOffset, Value src, Value srcOffset,
                             Value sizes, bool fp8Rows) {
  if (failed(verifyTaskCommon(op)))
    return failure();
  Checker c(op);
  Value result = op->getResult(0);
  auto isI64 = [](Type t) { return t.isInteger(64); };
  if (failed(c.rank("target_offset", targetOffset, 1)) || failed(c.rank("src", src, 2)) ||
      failed(c.rank("src_offset", srcOffset, 1)) || failed(c.rank("sizes", sizes, 1)) ||
      failed(c.rank("result", result, 2)) ||
      failed(c.elementType("target_offset", targetOffset, isI64, "i64")) ||
      failed(c.elementType("src_offset", srcOffset, isI64, "i64")) ||
      failed(c.elementType("sizes", sizes, isIndexType, "i32 or i64")) ||
      failed(c.elementType("src", src, fp8Rows ? isRowType : isDataType,
                           fp8Rows ? kRowTypes : kDataTypes)) ||
      failed(c.dimsEqual("src_offset", srcOffset, 0, "target_offset", targetOffset, 0)) ||
      failed(c.dimsEqual("sizes", sizes, 0, "target_offset", targetOffset, 0)) ||
      failed(c.dimsEqual("result", result, 1, "src", src, 1)) ||
      failed(c.sameElementType("result", result, "src", src)))
    return failure();
  return success();
}

} // namespace

LogicalResult DispatchOp::verify() {
  // A dispatch may move FP8 rows (moe-quantize-dispatch); a combine moves
  // the compute dtype.
  return verifyAllToAll(*this, getTargetOffset(), getSrc(), getSrcOffset(), getSizes(), true);
}

LogicalResult CombineOp::verify() {
  return verifyAllToAll(*this, getTargetOffset(), getSrc(), getSrcOffset(), getSizes(), false);
}

namespace {
/// The scales of a gmm's quantized weight `rhs` (codes of `elt`): present,
/// fp32, one per 128 x 128 block (FP8), per row (i8), or per group of 32,
/// 64 or 128 along a row, optionally with zero points (i4).
LogicalResult verifyQuantizedWeight(Checker &c, Value rhs, Type elt, Value scales,
                                    Attribute scale) {
  auto type = rhs.getType().cast<MoeTensorType>();
  if (type.getRank() != 3)
    return c.error() << c.describe("rhs", rhs) << " is " << elt
                     << " codes: quantized weights are expert weights (rank 3), read by the "
                        "activation form";
  const char *what = elt.isa<Float8E4M3FNType>() ? "one per 128 x 128 block"
                     : elt.isInteger(8)           ? "one per row"
                                                  : "one per group of 32, 64 or 128 along a row";
  if (!scales)
    return c.error() << c.describe("rhs", rhs) << " is " << elt
                     << " codes and the gmm has no fourth operand: quantized weights need their "
                        "fp32 scales, "
                     << what;
  if (scale)
    return c.error() << "a quantized weight's gmm takes no scale attribute";
  if (failed(c.elementType("scales", scales, [](Type t) { return t.isF32(); }, "f32")) ||
      failed(c.dimsEqual("scales", scales, 0, "rhs", rhs, 0)))
    return failure();
  if (elt.isa<Float8E4M3FNType>()) {
    const auto blocks = [&](unsigned i) {
      std::string error;
      return *Expr::parse("(" + dimExpr(type, i).text() + ") / 128", &error);
    };
    return success(succeeded(c.rank("scales", scales, 3)) &&
                   succeeded(c.dimIs("scales", scales, 1, blocks(1), "the 128-row blocks of rhs")) &&
                   succeeded(c.dimIs("scales", scales, 2, blocks(2),
                                     "the 128-column blocks of rhs")));
  }
  if (elt.isInteger(8))
    return success(succeeded(c.rank("scales", scales, 2)) &&
                   succeeded(c.dimsEqual("scales", scales, 1, "rhs", rhs, 1)));
  auto st = scales.getType().cast<MoeTensorType>();
  if (st.getRank() != 3 && st.getRank() != 4)
    return c.error() << c.describe("scales", scales)
                     << " must have rank 3 ([G, rows, groups]) or 4 ([G, rows, groups, 2]: "
                        "scales and zero points), got rank "
                     << st.getRank();
  if (failed(c.dimsEqual("scales", scales, 1, "rhs", rhs, 1)))
    return failure();
  if (st.getRank() == 4 && st.getDimValue(3) && *st.getDimValue(3) != 2)
    return c.error() << c.describe("scales", scales)
                     << " dim 3 must be 2 (a scale and a zero point per group), got "
                     << *st.getDimValue(3);
  // The group size, where both lengths are known.
  const std::optional<int64_t> cols = type.getDimValue(2), count = st.getDimValue(2);
  if (cols && count) {
    const int64_t group = *count > 0 ? *cols / *count : 0;
    if (group * *count != *cols || !(group == 32 || group == 64 || group == 128))
      return c.error() << c.describe("scales", scales) << " holds " << *count
                       << " groups for rows of " << *cols
                       << " values: an int4 weight's groups are 32, 64 or 128 values each";
  }
  return success();
}
} // namespace

LogicalResult GmmOp::verify() {
  if (failed(verifyTaskCommon(*this)))
    return failure();
  Checker c(*this);
  Value lhs = getLhs(), rhs = getRhs(), groups = getGroupList(), result = getResult();
  // A frozen weight stored quantized (FP8, int8 or int4 codes): its fourth
  // operand is the codes' fp32 scales (not an addend).
  Type rhsElt = rhs.getType().cast<MoeTensorType>().getElementType();
  const bool quantized = isQuantizedWeightType(rhsElt);
  if (failed(c.rank("group_list", groups, 1)) ||
      failed(c.elementType("group_list", groups, isIndexType, "i32 or i64")) ||
      failed(c.rank("lhs", lhs, 2)) || failed(c.elementType("lhs", lhs, isDataType, kDataTypes)) ||
      (!quantized && failed(c.sameElementType("lhs", lhs, "rhs", rhs))))
    return failure();
  Type resultElt = result.getType().cast<MoeTensorType>().getElementType();
  if (isQuantizedWeightType(resultElt))
    return c.error() << c.describe("result", result) << " is " << resultElt
                     << ": a quantized weight is frozen, no gmm writes one";
  if (quantized && failed(verifyQuantizedWeight(c, rhs, rhsElt, getAddend(), getScaleAttr())))
    return failure();
  if (Attribute scale = getScaleAttr()) {
    auto text = scale.dyn_cast<StringAttr>();
    auto number = scale.dyn_cast<FloatAttr>();
    if (!(number || (text && text.getValue() == kLoraScaling)))
      return c.error() << "scale must be a number or \"" << kLoraScaling << "\", got " << scale;
    if (number && !(std::isfinite(number.getValueAsDouble()) && number.getValueAsDouble() != 0))
      return c.error() << "scale must be finite and nonzero, got " << number.getValueAsDouble();
  }
  Type lhsElt = lhs.getType().cast<MoeTensorType>().getElementType();
  Type outElt = result.getType().cast<MoeTensorType>().getElementType();
  if (outElt != lhsElt && !(getAccumulate() && outElt.isF32()))
    return c.error() << "dtype mismatch: result '" << tensorName(result)
                     << "' must have the operands' element type (or f32 with accumulate)";
  unsigned rhsRank = rhs.getType().cast<MoeTensorType>().getRank();
  if (rhsRank == 3) {
    // Activation form: lhs[M, K] x rhs[G, K, N] (or rhs[G, N, K] transposed) -> [M, N].
    if (getTransposeLhs())
      return c.error() << "transpose_lhs needs the weight-gradient form (a rank-2 rhs); "
                       << c.describe("rhs", rhs) << " has rank 3";
    if (getAccumulate())
      return c.error() << "accumulate needs the weight-gradient form (a rank-2 rhs)";
    if (getExtra().size() > 3)
      return c.error() << "a gmm takes at most 6 operands (an addend or scales, then a low-rank "
                       << "pair), got " << getNumOperands();
    if (Value addend = quantized ? Value() : getAddend())
      if (failed(c.rank("addend", addend, 2)) ||
          failed(c.sameElementType("addend", addend, "result", result)) ||
          failed(c.dimsEqual("addend", addend, 0, "result", result, 0)) ||
          failed(c.dimsEqual("addend", addend, 1, "result", result, 1)))
        return failure();
    if (hasLowRank()) {
      // result = lhs x rhs + low_lhs[M, r] x low_rhs[G, r, N] (or [G, N, r]).
      if ((getAddend() && !quantized) || getScaleAttr())
        return c.error() << "a low-rank product needs a gmm without an addend or a scale";
      Value u = getLowLhs(), v = getLowRhs();
      const unsigned rDim = getTransposeLowRhs() ? 2 : 1, vnDim = getTransposeLowRhs() ? 1 : 2;
      std::string vRole = getTransposeLowRhs() ? "low_rhs (transposed)" : "low_rhs";
      if (failed(c.rank("low_lhs", u, 2)) || failed(c.rank("low_rhs", v, 3)) ||
          failed(c.sameElementType("low_lhs", u, "lhs", lhs)) ||
          failed(c.sameElementType("low_rhs", v, "lhs", lhs)) ||
          failed(c.dimsEqual("low_lhs", u, 0, "lhs", lhs, 0)) ||
          failed(c.dimsEqual(vRole, v, rDim, "low_lhs", u, 1)) ||
          failed(c.dimsEqual("low_rhs", v, 0, "group_list", groups, 0)) ||
          failed(c.dimsEqual(vRole, v, vnDim, "result", result, 1)))
        return failure();
    } else if (getTransposeLowRhs()) {
      return c.error() << "transpose_low_rhs needs a low-rank product";
    }
    unsigned kDim = getTransposeRhs() ? 2 : 1, nDim = getTransposeRhs() ? 1 : 2;
    std::string rhsRole = getTransposeRhs() ? "rhs (transposed)" : "rhs";
    if (failed(c.rank("result", result, 2)) ||
        failed(c.dimsEqual(rhsRole, rhs, kDim, "lhs", lhs, 1)) ||
        failed(c.dimsEqual("rhs", rhs, 0, "group_list", groups, 0)) ||
        failed(c.dimsEqual("result", result, 0, "lhs", lhs, 0)) ||
        failed(c.dimsEqual("result", result, 1, rhsRole, rhs, nDim)))
      return failure();
    return success();
  }
  if (rhsRank == 2) {
    // Weight-gradient form: lhs[M, K]^T x rhs[M, N] per group -> [G, K, N].
    if (hasLowRank() || getTransposeLowRhs())
      return c.error() << "a low-rank product needs the activation form (a rank-3 rhs)";
    if (getAddend())
      return c.error() << "an addend needs the activation form (a rank-3 rhs)";
    if (getScale())
      return c.error() << "scale needs the activation form (a rank-3 rhs)";
    if (!getTransposeLhs())
      return c.error() << "the weight-gradient form (a rank-2 rhs) needs transpose_lhs";
    if (getTransposeRhs())
      return c.error() << "transpose_rhs is not supported in the weight-gradient form";
    if (failed(c.rank("result", result, 3)) ||
        failed(c.dimsEqual("rhs", rhs, 0, "lhs", lhs, 0)) ||
        failed(c.dimsEqual("result", result, 0, "group_list", groups, 0)) ||
        failed(c.dimsEqual("result", result, 1, "lhs", lhs, 1)) ||
        failed(c.dimsEqual("result", result, 2, "rhs", rhs, 1)))
      return failure();
    return success();
  }
  return c.error() << c.describe("rhs", rhs)
                   << " must have rank 3 (expert weights) or rank 2 (weight-gradient form), got "
                   << rhsRank;
}

namespace {
/// 2 * (dim `i` of `v`), as an expression.
Expr twice(Value v, unsigned i) {
  Expr d = dimExpr(v.getType().cast<MoeTensorType>(), i);
  std::string error;
  return *Expr::parse("2 * (" + d.text() + ")", &error);
}
} // namespace

LogicalResult SwigluOp::verify() {
  if (failed(verifyTaskCommon(*this)))
    return failure();
  Checker c(*this);
  Value in = getInput(), out = getResult();
  if (failed(c.rank("input", in, 2)) || failed(c.rank("result", out, 2)) ||
      failed(c.elementType("input", in, isDataType, kDataTypes)) ||
      failed(c.sameElementType("input", in, "result", out)) ||
      failed(c.dimsEqual("result", out, 0, "input", in, 0)) ||
      failed(c.dimIs("input", in, 1, twice(out, 1),
                     "twice " + c.describe("result", out) + " dim 1")))
    return failure();
  return success();
}

LogicalResult SwigluGradOp::verify() {
  if (failed(verifyTaskCommon(*this)))
    return failure();
  Checker c(*this);
  Value grad = getGrad(), in = getInput(), out = getResult();
  if (failed(c.rank("grad", grad, 2)) || failed(c.rank("input", in, 2)) ||
      failed(c.rank("result", out, 2)) ||
      failed(c.elementType("input", in, isDataType, kDataTypes)) ||
      failed(c.sameElementType("grad", grad, "input", in)) ||
      failed(c.sameElementType("result", out, "input", in)) ||
      failed(c.dimsEqual("input", in, 0, "grad", grad, 0)) ||
      failed(c.dimIs("input", in, 1, twice(grad, 1),
                     "twice " + c.describe("grad", grad) + " dim 1")) ||
      failed(c.dimsEqual("result", out, 0, "input", in, 0)) ||
      failed(c.dimsEqual("result", out, 1, "input", in, 1)))
    return failure();
  return success();
}

namespace {
/// Dim `i` of `v` as a quantized row's width: d + 4 * ((d + 127) / 128).
Expr quantizedWidth(Value v, unsigned i) {
  auto type = v.getType().cast<MoeTensorType>();
  std::string error;
  if (std::optional<int64_t> h = type.getDimValue(i))
    return *Expr::parse(std::to_string(fp8RowBytes(*h)), &error);
  Expr d = dimExpr(type, i);
  return *Expr::parse("(" + d.text() + ") + 4 * (((" + d.text() + ") + 127) / 128)", &error);
}

/// A quantize's or dequantize's rows and widths: `values` [M, H] of a data
/// type, `codes` [M, H + 4 * ceil(H / 128)] of f8E4M3FN.
LogicalResult verifyQuantizePair(TaskOpInterface op, StringRef valuesRole, Value values,
                                 StringRef codesRole, Value codes) {
  if (failed(verifyTaskCommon(op)))
    return failure();
  Checker c(op);
  if (failed(c.rank(valuesRole, values, 2)) || failed(c.rank(codesRole, codes, 2)) ||
      failed(c.elementType(valuesRole, values, isDataType, kDataTypes)) ||
      failed(c.elementType(codesRole, codes, isFp8, "f8E4M3FN")) ||
      failed(c.dimsEqual("result", op->getResult(0), 0, "input", op->getOperand(0), 0)) ||
      failed(c.dimIs(codesRole, codes, 1, quantizedWidth(values, 1),
                     "the width of quantized rows of " + c.describe(valuesRole, values) +
                         " (H + 4 * ceil(H / 128))")))
    return failure();
  return success();
}
} // namespace

LogicalResult QuantizeOp::verify() {
  return verifyQuantizePair(*this, "input", getInput(), "result", getResult());
}

LogicalResult DequantizeOp::verify() {
  return verifyQuantizePair(*this, "result", getResult(), "input", getInput());
}
