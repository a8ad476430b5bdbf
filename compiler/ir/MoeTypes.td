//===- MoeTypes.td - moe dialect types and attributes ---------*- tablegen -*-===//

#ifndef MOEC_COMPILER_IR_MOETYPES_TD
#define MOEC_COMPILER_IR_MOETYPES_TD

include "MoeBase.td"

//===----------------------------------------------------------------------===//
// Types
//===----------------------------------------------------------------------===//

def Moe_ActType : TypeDef<Moe_Dialect, "Act"> {
  let mnemonic = "act";
  let summary = "the activation dtype of the config (fp32 or bf16), not yet bound";
}

def Moe_TensorType : TypeDef<Moe_Dialect, "MoeTensor"> {
  let mnemonic = "tensor";
  let summary = "a tensor with symbolic or concrete dims";
  let description = [{
    `!moe.tensor<[per_rank_seq, hidden_size], act, list, dynamic>`

    Each dim is an integer or an expression over config symbols (a bare
    identifier, or a quoted expression such as `"2 * intermediate_size"`).
    The element type is `act` (the config's activation dtype, bound by
    `moe-resolve-shapes`), `f32`, `bf16`, `i32` or `i64`. `list` marks a
    tensor list (the seed's tensor_type 1: one tensor per expert);
    `dynamic` marks a leading dim whose filled extent depends on routing
    (the dim is then a capacity).
  }];
  let parameters = (ins
    "::mlir::ArrayAttr":$dims,
    "::mlir::Type":$elementType,
    "bool":$isList,
    "bool":$isDynamic
  );
  let hasCustomAssemblyFormat = 1;
  let genVerifyDecl = 1;
  let extraClassDeclaration = [{
    /// Number of dims.
    unsigned getRank() const { return getDims().size(); }
    /// The dim as written: an integer, or the expression's text.
    std::string getDimText(unsigned i) const;
    /// The dim's value if it is a concrete integer.
    std::optional<int64_t> getDimValue(unsigned i) const;
    /// True when every dim is an integer and the element type is bound.
    bool isResolved() const;
    /// This type with other dims.
    MoeTensorType withDims(::mlir::ArrayAttr dims, ::mlir::Type elementType) const;
  }];
}

//===----------------------------------------------------------------------===//
// Attributes
//===----------------------------------------------------------------------===//

def Moe_SplitAttr : AttrDef<Moe_Dialect, "Split"> {
  let mnemonic = "split";
  let summary = "how an op is cut into tile tasks (the seed's SplitSpec)";
  let description = [{
    `#moe.split<inputs = [0:0], output_dims = [0], task_num = "expr">`

    `inputs` lists (operand index : dim) pairs the op is split along; an
    empty list marks a source op (the seed's `split_inputs=None`), whose
    tiles follow its output dims instead. `output_dims` are the dims of the
    result the tiles partition. `task_num`, when present, is an expression
    for the task count (the seed's `task_num_fn`), over config symbols and
    `split_value`.
  }];
  let parameters = (ins
    ArrayRefParameter<"int64_t">:$inputPairs,
    ArrayRefParameter<"int64_t">:$outputDims,
    "::mlir::StringAttr":$taskNum
  );
  let hasCustomAssemblyFormat = 1;
  let extraClassDeclaration = [{
    /// Number of (operand, dim) pairs.
    unsigned getNumSplitInputs() const { return getInputPairs().size() / 2; }
    int64_t getSplitOperand(unsigned i) const { return getInputPairs()[2 * i]; }
    int64_t getSplitDim(unsigned i) const { return getInputPairs()[2 * i + 1]; }
    bool isSource() const { return getInputPairs().empty(); }
  }];
}

def Moe_TileMapAttr : AttrDef<Moe_Dialect, "TileMap"> {
  let mnemonic = "tile_map";
  let summary = "which producer tiles each consumer tile needs, on one edge";
  let description = [{
    `#moe.tile_map<operand = 0, producer = "dispatch", first = [...], last = [...]>`

    Consumer tile `j` of the op carrying this map needs the producer's
    tiles `first[j] .. last[j]` (inclusive) of the tensor read through
    `operand`; operand -1 marks an ordering edge of the graph's `edges`
    that carries no tensor (it needs every producer tile). Written by `moe-propagate-splits`; task lowering turns it
    into events.
  }];
  let parameters = (ins
    "int64_t":$operand,
    "::mlir::StringAttr":$producer,
    ArrayRefParameter<"int64_t">:$first,
    ArrayRefParameter<"int64_t">:$last
  );
  let hasCustomAssemblyFormat = 1;
}

#endif // MOEC_COMPILER_IR_MOETYPES_TD
