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
