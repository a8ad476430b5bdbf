//===- GraphUtils.h - walking a moe.graph ------------------------*- C++ -*-===//
//
// The graph-level queries the passes, importer and exporter share: tensor
// names, producers, topological order, ordering edges (and their renaming),
// and symbolic dim comparison.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_IR_GRAPHUTILS_H
#define MOEC_COMPILER_IR_GRAPHUTILS_H

#include "compiler/ir/MoeDialect.h"
#include "compiler/support/Expr.h"

#include "llvm/ADT/SmallVector.h"

namespace moec::moe {

/// The name of the tensor `v` ("<unnamed>" for a value no moe op defines).
llvm::StringRef tensorName(mlir::Value v);

/// The compute op producing `v`, or null for a graph input.
TaskOpInterface producerOf(mlir::Value v);

/// The ops `op` must follow by the graph's ordering edges (not by data flow).
llvm::SmallVector<TaskOpInterface> orderingPredecessors(TaskOpInterface op);

/// Which ends of the graph's ordering edges renameInEdges renames.
enum class EdgeEnds { Sources, Both };

/// Renames op `from` to `to` in the graph's ordering edges: where it is an
/// edge's source (EdgeEnds::Sources: what followed `from` follows `to`), or
/// at either end (EdgeEnds::Both: `from`'s edges become `to`'s; an edge
/// between the two is dropped).
void renameInEdges(GraphOp graph, llvm::StringRef from, llvm::StringRef to, EdgeEnds ends);

/// The compute ops of `graph` in a topological order of data flow and
/// ordering edges (ties keep block order).
/// On a cycle, emits an error on the graph naming the ops on it and fails.
mlir::LogicalResult topologicalOrder(GraphOp graph,
                                     llvm::SmallVectorImpl<TaskOpInterface> &order);

/// Dim `i` of `type` as an expression (an integer dim becomes a constant).
Expr dimExpr(MoeTensorType type, unsigned i);

/// Whether two dims are provably equal, provably different, or unknown
/// (one concrete and one symbolic: decided once shapes are resolved).
enum class DimRelation { Equal, Different, Unknown };
DimRelation compareDims(const Expr &a, const Expr &b);

} // namespace moec::moe

#endif // MOEC_COMPILER_IR_GRAPHUTILS_H
