//===- MoeDialect.h - the moe dialect ---------------------------*- C++ -*-===//
//
// Everything the graph level defines: the dialect, its types and attributes,
// the op interfaces and the ops (generated from the .td files beside this).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_IR_MOEDIALECT_H
#define MOEC_COMPILER_IR_MOEDIALECT_H

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/IR/OpImplementation.h"
#include "mlir/IR/RegionKindInterface.h"

#include <cstdint>
#include <optional>
#include <string>

namespace moec::moe {
/// The largest parameter or tiling slot index a graph may name: slots index
/// the task binary's tables, which hold a few dozen entries.
inline constexpr int64_t kMaxSlot = 65535;
/// The symbolic gmm scale that moe-resolve-shapes binds to the config's
/// lora_alpha / lora_rank (PEFT's `scaling`).
inline constexpr const char *kLoraScaling = "lora_scaling";
/// The element types of a frozen weight stored quantized (a gmm's rhs with
/// fp32 scales as its fourth operand): f8E4M3FN, i8 or i4 codes.
inline bool isQuantizedWeightType(mlir::Type t) {
  return t.isa<mlir::Float8E4M3FNType>() || t.isInteger(8) || t.isInteger(4);
}
} // namespace moec::moe

#include "compiler/ir/MoeDialect.h.inc"

#define GET_TYPEDEF_CLASSES
#include "compiler/ir/MoeTypes.h.inc"

#define GET_ATTRDEF_CLASSES
#include "compiler/ir/MoeAttrs.h.inc"

#include "compiler/ir/MoeInterfaces.h.inc"

#define GET_OP_CLASSES
#include "compiler/ir/MoeOps.h.inc"

#endif // MOEC_COMPILER_IR_MOEDIALECT_H
