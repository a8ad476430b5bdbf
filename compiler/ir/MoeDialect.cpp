//===- MoeDialect.cpp - moe dialect, types and attributes ------------------===//

#include "compiler/ir/MoeDialect.h"

#include "compiler/support/Expr.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/DialectImplementation.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/TypeSwitch.h"

using namespace mlir;
using namespace moec::moe;

#include "compiler/ir/MoeDialect.cpp.inc"

#define GET_TYPEDEF_CLASSES
#include "compiler/ir/MoeTypes.cpp.inc"

#define GET_ATTRDEF_CLASSES
#include "compiler/ir/MoeAttrs.cpp.inc"

void MoeDialect::initialize() {
  registerTypes();
  registerAttributes();
  addOperations<
#define GET_OP_LIST
#include "compiler/ir/MoeOps.cpp.inc"
      >();
}

void MoeDialect::registerTypes() {
  addTypes<
#define GET_TYPEDEF_LIST
#include "compiler/ir/MoeTypes.cpp.inc"
      >();
}

void MoeDialect::registerAttributes() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "compiler/ir/MoeAttrs.cpp.inc"
      >();
}

//===----------------------------------------------------------------------===//
// MoeTensorType
//===----------------------------------------------------------------------===//

namespace {
bool isIdentifier(llvm::StringRef s) {
  if (s.empty() || !(llvm::isAlpha(s[0]) || s[0] == '_'))
    return false;
  return llvm::all_of(s, [](char c) { return llvm::isAlnum(c) || c == '_'; });
}

/// Parses `[a, b, ...]` of integers into `out`.
ParseResult parseIntList(AsmParser &p, SmallVectorImpl<int64_t> &out) {
  return p.parseCommaSeparatedList(AsmParser::Delimiter::Square, [&]() {
    int64_t v;
    if (p.parseInteger(v))
      return failure();
    out.push_back(v);
    return success();
  });
}

void printIntList(AsmPrinter &p, ArrayRef<int64_t> values) {
  p << '[';
  llvm::interleaveComma(values, p);
  p << ']';
}
} // namespace

Type MoeTensorType::parse(AsmParser &p) {
  MLIRContext *ctx = p.getContext();
  SmallVector<Attribute> dims;
  if (p.parseLess())
    return {};
  auto parseDim = [&]() -> ParseResult {
    int64_t value;
    OptionalParseResult intResult = p.parseOptionalInteger(value);
    if (intResult.has_value()) {
      if (failed(*intResult))
        return failure();
      dims.push_back(IntegerAttr::get(IntegerType::get(ctx, 64), value));
      return success();
    }
    std::string text;
    if (succeeded(p.parseOptionalString(&text))) {
      dims.push_back(StringAttr::get(ctx, text));
      return success();
    }
    StringRef keyword;
    if (failed(p.parseOptionalKeyword(&keyword)))
      return p.emitError(p.getCurrentLocation(),
                         "expected a dim: an integer, a symbol or a quoted expression");
    dims.push_back(StringAttr::get(ctx, keyword));
    return success();
  };
  if (p.parseCommaSeparatedList(AsmParser::Delimiter::Square, parseDim) || p.parseComma())
    return {};
  Type elementType;
  if (succeeded(p.parseOptionalKeyword("act")))
    elementType = ActType::get(ctx);
  else if (p.parseType(elementType))
    return {};
  bool isList = false, isDynamic = false;
  while (succeeded(p.parseOptionalComma())) {
    StringRef flag;
    SMLoc loc = p.getCurrentLocation();
    if (p.parseKeyword(&flag))
      return {};
    if (flag == "list")
      isList = true;
    else if (flag == "dynamic")
      isDynamic = true;
    else {
      p.emitError(loc) << "unknown tensor flag '" << flag << "' (expected 'list' or 'dynamic')";
      return {};
    }
  }
  if (p.parseGreater())
    return {};
  return p.getChecked<MoeTensorType>(ctx, ArrayAttr::get(ctx, dims), elementType, isList,
                                  isDynamic);
}

void MoeTensorType::print(AsmPrinter &p) const {
  p << "<[";
  llvm::interleaveComma(getDims(), p, [&](Attribute dim) {
    if (auto i = dim.dyn_cast<IntegerAttr>())
      p << i.getInt();
    else if (isIdentifier(dim.cast<StringAttr>().getValue()))
      p << dim.cast<StringAttr>().getValue();
    else
      p << '"' << dim.cast<StringAttr>().getValue() << '"';
  });
  p << "], ";
  if (getElementType().isa<ActType>())
    p << "act";
  else
    p << getElementType();
  if (getIsList())
    p << ", list";
  if (getIsDynamic())
    p << ", dynamic";
  p << '>';
}

LogicalResult MoeTensorType::verify(function_ref<InFlightDiagnostic()> emitError, ArrayAttr dims,
                                 Type elementType, bool, bool) {
  if (!elementType.isa<ActType>() && !elementType.isF32() && !elementType.isBF16() &&
      !elementType.isInteger(32) && !elementType.isInteger(64) &&
      !elementType.isa<Float8E4M3FNType>() && !elementType.isInteger(8) &&
      !elementType.isInteger(4))
    return emitError() << "tensor element type must be act, f32, bf16, f8E4M3FN, i8, i4, i32 or "
                          "i64, got "
                       << elementType;
  if (dims.empty())
    return emitError() << "tensor must have at least one dim";
  for (auto [i, dim] : llvm::enumerate(dims)) {
    if (auto v = dim.dyn_cast<IntegerAttr>()) {
      if (v.getInt() <= 0)
        return emitError() << "dim " << i << " must be positive, got " << v.getInt();
      continue;
    }
    auto text = dim.dyn_cast<StringAttr>();
    if (!text)
      return emitError() << "dim " << i << " must be an integer or an expression string";
    std::string error;
    if (!Expr::parse(text.getValue().str(), &error))
      return emitError() << "dim " << i << " '" << text.getValue() << "': " << error;
  }
  return success();
}

std::string MoeTensorType::getDimText(unsigned i) const {
  Attribute dim = getDims()[i];
  if (auto v = dim.dyn_cast<IntegerAttr>())
    return std::to_string(v.getInt());
  return dim.cast<StringAttr>().getValue().str();
}

std::optional<int64_t> MoeTensorType::getDimValue(unsigned i) const {
  if (auto v = getDims()[i].dyn_cast<IntegerAttr>())
    return v.getInt();
  return std::nullopt;
}

bool MoeTensorType::isResolved() const {
  if (getElementType().isa<ActType>())
    return false;
  return llvm::all_of(getDims(), [](Attribute d) { return d.isa<IntegerAttr>(); });
}

MoeTensorType MoeTensorType::withDims(ArrayAttr dims, Type elementType) const {
  return MoeTensorType::get(getContext(), dims, elementType, getIsList(), getIsDynamic());
}

//===----------------------------------------------------------------------===//
// SplitAttr: #moe.split<inputs = [0:0], output_dims = [0], task_num = "...">
//===----------------------------------------------------------------------===//

Attribute SplitAttr::parse(AsmParser &p, Type) {
  SmallVector<int64_t> pairs, outputDims;
  StringAttr taskNum;
  if (p.parseLess() || p.parseKeyword("inputs") || p.parseEqual())
    return {};
  if (p.parseCommaSeparatedList(AsmParser::Delimiter::Square, [&]() {
        int64_t operand, dim;
        if (p.parseInteger(operand) || p.parseColon() || p.parseInteger(dim))
          return failure();
        pairs.append({operand, dim});
        return success();
      }))
    return {};
  if (p.parseComma() || p.parseKeyword("output_dims") || p.parseEqual() ||
      parseIntList(p, outputDims))
    return {};
  if (succeeded(p.parseOptionalComma())) {
    std::string text;
    if (p.parseKeyword("task_num") || p.parseEqual() || p.parseString(&text))
      return {};
    taskNum = StringAttr::get(p.getContext(), text);
  }
  if (p.parseGreater())
    return {};
  return SplitAttr::get(p.getContext(), pairs, outputDims, taskNum);
}

void SplitAttr::print(AsmPrinter &p) const {
  p << "<inputs = [";
  for (unsigned i = 0; i < getNumSplitInputs(); ++i)
    p << (i ? ", " : "") << getSplitOperand(i) << ':' << getSplitDim(i);
  p << "], output_dims = ";
  printIntList(p, getOutputDims());
  if (getTaskNum())
    p << ", task_num = \"" << getTaskNum().getValue() << '"';
  p << '>';
}

//===----------------------------------------------------------------------===//
// TileMapAttr: #moe.tile_map<operand = 0, producer = "x", first = [..], last = [..]>
//===----------------------------------------------------------------------===//

Attribute TileMapAttr::parse(AsmParser &p, Type) {
  int64_t operand;
  std::string producer;
  SmallVector<int64_t> first, last;
  if (p.parseLess() || p.parseKeyword("operand") || p.parseEqual() || p.parseInteger(operand) ||
      p.parseComma() || p.parseKeyword("producer") || p.parseEqual() ||
      p.parseString(&producer) || p.parseComma() || p.parseKeyword("first") ||
      p.parseEqual() || parseIntList(p, first) || p.parseComma() ||
      p.parseKeyword("last") || p.parseEqual() || parseIntList(p, last) || p.parseGreater())
    return {};
  if (first.size() != last.size()) {
    p.emitError(p.getCurrentLocation(), "tile map 'first' and 'last' differ in length");
    return {};
  }
  return TileMapAttr::get(p.getContext(), operand, StringAttr::get(p.getContext(), producer),
                          first, last);
}

void TileMapAttr::print(AsmPrinter &p) const {
  p << "<operand = " << getOperand() << ", producer = \"" << getProducer().getValue()
    << "\", first = ";
  printIntList(p, getFirst());
  p << ", last = ";
  printIntList(p, getLast());
  p << '>';
}
