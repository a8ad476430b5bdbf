//===- MoeBase.td - the moe dialect --------------------------*- tablegen -*-===//
//
// The graph level of moec: an MoE-FFN layer as a graph of all-to-all,
// grouped-matmul and SwiGLU ops over symbolically shaped tensors.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_IR_MOEBASE_TD
#define MOEC_COMPILER_IR_MOEBASE_TD

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"

def Moe_Dialect : Dialect {
  let name = "moe";
  let cppNamespace = "::moec::moe";
  let summary = "Graph IR of fused MoE-FFN layers";
  let description = [{
    A `moe.graph` holds the ops of one MoE-FFN layer pass (forward or
    backward): `moe.input` declares the tensors the runtime hands in,
    `moe.dispatch` / `moe.combine` are the all-to-all exchanges,
    `moe.gmm` the grouped matrix multiplies, `moe.swiglu` and
    `moe.swiglu_grad` the element-wise activation and its gradient.
    Every tensor has a `!moe.tensor` type whose dims may be symbolic
    expressions over the model/parallel config (`per_rank_seq`,
    `2 * intermediate_size`, ...) until `moe-resolve-shapes` binds them.
  }];
  let useDefaultTypePrinterParser = 1;
  let useDefaultAttributePrinterParser = 1;
  let useFoldAPI = kEmitFoldAdaptorFolder;
  let extraClassDeclaration = [{
    void registerTypes();
    void registerAttributes();
  }];
}

class Moe_Op<string mnemonic, list<Trait> traits = []>
    : Op<Moe_Dialect, mnemonic, traits>;

#endif // MOEC_COMPILER_IR_MOEBASE_TD
