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

#include <optional>
#include <string>

#include "compiler/ir/MoeDialect.h.inc"

#define GET_TYPEDEF_CLASSES
#include "compiler/ir/MoeTypes.h.inc"

#define GET_ATTRDEF_CLASSES
#include "compiler/ir/MoeAttrs.h.inc"

#include "compiler/ir/MoeInterfaces.h.inc"

#define GET_OP_CLASSES
#include "compiler/ir/MoeOps.h.inc"

#endif // MOEC_COMPILER_IR_MOEDIALECT_H
