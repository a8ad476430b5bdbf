//===- GraphJson.h - graph descriptions: JSON <-> moe dialect ----*- C++ -*-===//
//
// The JSON graph format (docs/graph-format.md) and its lossless mapping to a
// module holding one moe.graph.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_IMPORT_GRAPHJSON_H
#define MOEC_COMPILER_IMPORT_GRAPHJSON_H

#include "compiler/ir/MoeDialect.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace moec {

/// Builds a module with one moe.graph from JSON `text`. `source` names the
/// file in locations. Errors go to the context's diagnostic handler with the
/// file, line and column of the element at fault; returns null then.
mlir::OwningOpRef<mlir::ModuleOp> importGraphJson(std::string_view text,
                                                  const std::string &source,
                                                  mlir::MLIRContext *context);

/// Writes the one moe.graph of `module` as a JSON graph description.
/// Fails with a diagnostic on what JSON cannot say (e.g. a tensor read
/// transposed by one grouped matmul and not by another).
mlir::FailureOr<nlohmann::ordered_json> exportGraphJson(mlir::ModuleOp module);

/// Reads a graph from `path`: JSON when it ends in ".json", or, under a name
/// that ends in neither ".json" nor ".mlir", when its text starts with '{';
/// MLIR otherwise.
/// Errors go to the context's diagnostic handler; returns null then.
mlir::OwningOpRef<mlir::ModuleOp> loadGraph(const std::string &path,
                                            mlir::MLIRContext *context);

/// Parses MLIR `text` (named `source` in locations) that must hold exactly
/// one moe.graph. Text nested deeper than kMaxTextNesting is refused before
/// it is parsed. Errors go to the context's diagnostic handler; returns null
/// then.
mlir::OwningOpRef<mlir::ModuleOp> parseGraphMlir(llvm::StringRef text, const std::string &source,
                                                 mlir::MLIRContext *context);


} // namespace moec

#endif // MOEC_COMPILER_IMPORT_GRAPHJSON_H
