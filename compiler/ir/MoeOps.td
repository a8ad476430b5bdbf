//===- MoeOps.td - moe dialect ops ----------------------------*- tablegen -*-===//

#ifndef MOEC_COMPILER_IR_MOEOPS_TD
#define MOEC_COMPILER_IR_MOEOPS_TD

include "MoeBase.td"
include "MoeTypes.td"
include "mlir/IR/OpBase.td"
include "mlir/IR/RegionKindInterface.td"

//===----------------------------------------------------------------------===//
// Interfaces
//===----------------------------------------------------------------------===//

def Moe_TensorDefOpInterface : OpInterface<"TensorDefOpInterface"> {
  let cppNamespace = "::moec::moe";
  let description = [{
    An op that defines one named tensor of the graph, with an optional
    parameter slot (the seed's param_position).
  }];
  let methods = [
    InterfaceMethod<"The tensor's name.", "::llvm::StringRef", "getResultName", (ins),
                    [{ return $_op.getResultName(); }]>,
    InterfaceMethod<"The tensor's slot, if assigned.", "std::optional<uint64_t>",
                    "getSlot", (ins), [{ return $_op.getSlot(); }]>,
    InterfaceMethod<"Sets the tensor's slot.", "void", "setSlotValue", (ins "int64_t":$slot),
                    [{ $_op.setSlotAttr(::mlir::Builder($_op->getContext()).getI64IntegerAttr(slot)); }]>,
    InterfaceMethod<"The defined tensor.", "::mlir::TypedValue<::moec::moe::MoeTensorType>",
                    "getTensor", (ins), [{ return $_op.getResult(); }]>,
  ];
}

def Moe_TaskOpInterface : OpInterface<"TaskOpInterface"> {
  let cppNamespace = "::moec::moe";
  let description = [{
    A compute op of the graph, cut into tile tasks: it has a name, a split
    value (tile size), a split spec, an optional tiling slot and fill config,
    and after `moe-propagate-splits` a task count, a tile grid and tile maps.
  }];
  let methods = [
    InterfaceMethod<"The op's name in the graph.", "::llvm::StringRef", "getOpName", (ins),
                    [{ return $_op.getOpName(); }]>,
    InterfaceMethod<"The tile size.", "uint64_t", "getSplitValue", (ins),
                    [{ return $_op.getSplitValue(); }]>,
    InterfaceMethod<"Whether the compiler chooses the split (split_value \"auto\").", "bool",
                    "isAutoSplit", (ins), [{ return $_op.getAutoSplit(); }]>,
    InterfaceMethod<"The split spec.", "::moec::moe::SplitAttr", "getSplit", (ins),
                    [{ return $_op.getSplit(); }]>,
    InterfaceMethod<"The tiling slot (-1: none), if assigned.", "std::optional<int64_t>",
                    "getTilingSlotValue", (ins), [{
      if (auto a = $_op.getTilingSlotAttr()) return a.getInt();
      return std::nullopt;
    }]>,
    InterfaceMethod<"Sets the tiling slot.", "void", "setTilingSlotValue", (ins "int64_t":$slot),
                    [{ $_op.setTilingSlotAttr(::mlir::Builder($_op->getContext()).getI64IntegerAttr(slot)); }]>,
    InterfaceMethod<"The fill config.", "::mlir::DictionaryAttr", "getFillAttr", (ins),
                    [{ return $_op.getFillAttr(); }]>,
    InterfaceMethod<"The propagated task count.", "std::optional<uint64_t>", "getTasks", (ins),
                    [{ return $_op.getTasks(); }]>,
    InterfaceMethod<"Sets the task count.", "void", "setTasksValue", (ins "int64_t":$n),
                    [{ $_op.setTasksAttr(::mlir::Builder($_op->getContext()).getI64IntegerAttr(n)); }]>,
    InterfaceMethod<"The propagated tile grid [experts, peers, row tiles, column tiles, rows, columns].",
                    "::mlir::DenseI64ArrayAttr", "getGridAttr", (ins),
                    [{ return $_op.getGridAttr(); }]>,
    InterfaceMethod<"Sets the tile grid.", "void", "setGridValue",
                    (ins "::llvm::ArrayRef<int64_t>":$grid),
                    [{ $_op->setAttr("grid", ::mlir::DenseI64ArrayAttr::get($_op->getContext(), grid)); }]>,
    InterfaceMethod<"The propagated tile maps.", "::mlir::ArrayAttr", "getDepsAttr", (ins),
                    [{ return $_op.getDepsAttr(); }]>,
    InterfaceMethod<"Sets the tile maps.", "void", "setDepsValue", (ins "::mlir::ArrayAttr":$deps),
                    [{ $_op->setAttr("deps", deps); }]>,
    InterfaceMethod<"True for cube-core (matrix) work, false for vector-core work.",
                    "bool", "isCubeWork", (ins), [{ return $_op.isCubeWork(); }]>,
    InterfaceMethod<"The seed's op type name (ALLTOALL, GMM, SWIGLU, SWIGLU_GRAD).",
                    "::llvm::StringRef", "getSeedOpType", (ins),
                    [{ return $_op.getSeedOpType(); }]>,
    InterfaceMethod<"True when the op needs a tiling descriptor.", "bool", "needsTiling", (ins),
                    [{ return $_op.needsTiling(); }]>,
  ];
}

//===----------------------------------------------------------------------===//
// Graph structure
//===----------------------------------------------------------------------===//

def Moe_GraphOp : Moe_Op<"graph", [
    IsolatedFromAbove, NoTerminator, SingleBlock,
    DeclareOpInterfaceMethods<RegionKindInterface>]> {
  let summary = "one MoE-FFN layer pass as a graph of tile-split ops";
  let description = [{
    The body is a graph region: ops may appear in any order and the
    verify-graph pass checks that the data flow is acyclic. Tensors that no
    op reads are the graph's outputs. `edges` lists extra ordering edges
    between ops by name (the seed's `add_edge`), `[["a", "b"], ...]`: `b`
    runs after all of `a`, whether or not it reads what `a` writes.
    `bindings`, set by `moe-resolve-shapes`, holds the config symbols the
    shapes were resolved with.
  }];
  let arguments = (ins
    StrAttr:$sym_name,
    OptionalAttr<ArrayAttr>:$edges,
    OptionalAttr<DictionaryAttr>:$bindings
  );
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$sym_name attr-dict-with-keyword $body";
  // Checked after the ops of the body have verified (their attributes are
  // then known to be there).
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    /// The block holding the graph's ops.
    ::mlir::Block &getBlock() { return getBody().front(); }
  }];
}

def Moe_InputOp : Moe_Op<"input", [Moe_TensorDefOpInterface]> {
  let summary = "a tensor handed in by the runtime";
  let arguments = (ins StrAttr:$result_name, OptionalAttr<I64Attr>:$slot);
  let results = (outs Moe_TensorType:$result);
  let assemblyFormat = "$result_name attr-dict `:` type($result)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Compute ops
//===----------------------------------------------------------------------===//

class Moe_TaskOp<string mnemonic, string seedType, bit cube, bit tiling,
                 list<Trait> traits = []>
    : Moe_Op<mnemonic, traits # [Moe_TensorDefOpInterface, Moe_TaskOpInterface]> {
  dag commonAttrs = (ins
    StrAttr:$op_name,
    StrAttr:$result_name,
    OptionalAttr<I64Attr>:$slot,
    I64Attr:$split_value,
    UnitAttr:$auto_split,
    Moe_SplitAttr:$split,
    OptionalAttr<I64Attr>:$tiling_slot,
    OptionalAttr<DictionaryAttr>:$fill,
    OptionalAttr<I64Attr>:$tasks,
    OptionalAttr<DenseI64ArrayAttr>:$grid,
    OptionalAttr<TypedArrayAttrBase<Moe_TileMapAttr, "tile maps">>:$deps
  );
  let results = (outs Moe_TensorType:$result);
  let assemblyFormat =
      "$op_name `(` operands `)` `->` $result_name attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
  code taskImpl = [{
    bool isCubeWork() { return }] # !if(cube, "true", "false") # [{; }
    ::llvm::StringRef getSeedOpType() { return "}] # seedType # [{"; }
    bool needsTiling() { return }] # !if(tiling, "true", "false") # [{; }
  }];
}

def Moe_DispatchOp : Moe_TaskOp<"dispatch", "ALLTOALL", 0, 0> {
  let summary = "all-to-all: send each (token, k) row to the rank owning its expert";
  let description = [{
    Operands: target offsets per expert, the source rows, source offsets
    per expert, row counts per expert. The result holds the received rows
    grouped by local expert. Fill config: `advance` ("vector" or
    "vector_only") and `event_group` (expression).

    `quantizable` marks the dispatch of the layer's tokens, whose rows
    travel as FP8 when the config's `dispatch_dtype` is `fp8_e4m3`:
    `moe-quantize-dispatch` then puts a `moe.quantize` before it and a
    `moe.dequantize` after it (src and result become `f8E4M3FN` rows).
  }];
  let arguments = !con((ins Moe_TensorType:$target_offset, Moe_TensorType:$src,
                            Moe_TensorType:$src_offset, Moe_TensorType:$sizes),
                       commonAttrs, (ins UnitAttr:$quantizable));
  let extraClassDeclaration = taskImpl;
}

def Moe_CombineOp : Moe_TaskOp<"combine", "ALLTOALL", 0, 0> {
  let summary = "all-to-all: return expert-output rows to their source ranks";
  let description = [{
    The inverse exchange of `moe.dispatch`, with the same operands. Fill
    config as for dispatch.

    `reduce_tp` marks a combine whose rows are partial sums over the
    config's `tp` tensor-parallel ranks (the down projection's output, or
    dX, of an expert whose intermediate size is split over them): each tile
    is put to all `tp` ranks of the EP rank the rows came from, and each of
    them sums the `tp` partials of a row in TP order. With `tp` > 1, every
    combine of a graph with expert weights must be marked.
  }];
  let arguments = !con((ins Moe_TensorType:$target_offset, Moe_TensorType:$src,
                            Moe_TensorType:$src_offset, Moe_TensorType:$sizes),
                       commonAttrs, (ins UnitAttr:$reduce_tp));
  let extraClassDeclaration = taskImpl;
}

def Moe_GmmOp : Moe_TaskOp<"gmm", "GMM", 1, 1> {
  let summary = "grouped matmul: one matmul per expert over its rows";
  let description = [{
    Two forms, told apart by the rank of `rhs`:

    - activation form (forward, dgrad): `lhs[M, K]` rows grouped by expert,
      `rhs[G, K, N]` one weight per expert (`transpose_rhs`: `rhs[G, N, K]`),
      result `[M, N]`.
    - weight-gradient form: `lhs[M, K]` with `transpose_lhs` (each group
      contributes `lhs_gᵀ`), `rhs[M, N]`, result `[G, K, N]`; `accumulate`
      adds into the result (an fp32 main-grad buffer may be used).

    Activation form only: an optional fourth operand `addend[M, N]` (the
    result's shape and type) is added to the product, result = addend +
    lhs x rhs (a LoRA adapter's B product onto the base projection's
    output). `scale` multiplies the product: a number, or "lora_scaling"
    (lora_alpha / lora_rank of the config, bound by moe-resolve-shapes).

    A frozen weight may be stored quantized (`rhs` of rank 3 [G, d1, d2]
    holding f8E4M3FN, i8 or i4 codes): the fourth operand is then not an
    addend but its fp32 scales: one per 128 x 128 block, `[G, d1 / 128,
    d2 / 128]` (f8E4M3FN: DeepSeek-V3's `weight_scale_inv`; value = code x
    scale); one per row, `[G, d1]` (i8; value = code x scale); one per
    group of g = 32, 64 or 128 values along a row, `[G, d1, d2 / g]` (i4,
    two codes a byte; value = (code - 8) x scale), or with zero points
    `[G, d1, d2 / g, 2]` ((scale, zero) pairs; value = (code - zero) x
    scale). No gmm may write a quantized tensor.

    A second, low-rank product (activation form; made by moe-fuse-low-rank
    from a LoRA adapter's second gmm and its base's, never read from a
    graph file): two more operands `low_lhs[M, r]` (rows as lhs's, the
    adapter's rank-r rows) and `low_rhs[G, r, N]` (`transpose_low_rhs`:
    `[G, N, r]`), of lhs's element type: result = lhs x rhs + low_lhs x
    low_rhs. Such a gmm has no addend and no scale.

    `group_list[G]` (i64) holds the per-expert row counts. Fill config:
    `offset_inputs`, `rank_in_event`, `global_trigger`, `out_offset`,
    `advance` ("cube", "cube_only", "cube_custom"), `event_delta`,
    `num_cube_cores`.
  }];
  // `extra`: none; the addend (or a quantized rhs's scales); the low-rank
  // pair; or both, in that order (at most one addend, so the count says).
  let arguments = !con((ins Moe_TensorType:$lhs, Moe_TensorType:$rhs,
                            Moe_TensorType:$group_list,
                            Variadic<Moe_TensorType>:$extra),
                       commonAttrs,
                       (ins UnitAttr:$transpose_lhs, UnitAttr:$transpose_rhs,
                            UnitAttr:$accumulate, OptionalAttr<AnyAttr>:$scale,
                            UnitAttr:$transpose_low_rhs));
  let extraClassDeclaration = taskImpl # [{
    /// True for the weight-gradient form (rank-2 rhs).
    bool isWeightGradient() { return getRhs().getType().getRank() == 2; }
    /// The addend (or a quantized rhs's scales), or null.
    ::mlir::Value getAddend() {
      auto extra = getExtra();
      return extra.size() % 2 == 1 ? extra.front() : ::mlir::Value();
    }
    /// Whether the gmm adds a low-rank product (low_lhs x low_rhs).
    bool hasLowRank() { return getExtra().size() >= 2; }
    /// The low-rank product's rows and weight, or null.
    ::mlir::Value getLowLhs() {
      return hasLowRank() ? getExtra()[getExtra().size() - 2] : ::mlir::Value();
    }
    ::mlir::Value getLowRhs() { return hasLowRank() ? getExtra().back() : ::mlir::Value(); }
  }];
}

def Moe_SwigluOp : Moe_TaskOp<"swiglu", "SWIGLU", 0, 1> {
  let summary = "A = silu(Y[:, :I]) * Y[:, I:]";
  let description = [{ `input[M, 2I]` -> `result[M, I]`. No fill config. }];
  let arguments = !con((ins Moe_TensorType:$input), commonAttrs);
  let extraClassDeclaration = taskImpl;
}

def Moe_SwigluGradOp : Moe_TaskOp<"swiglu_grad", "SWIGLU_GRAD", 0, 1> {
  let summary = "dY = swiglu_grad(Y, dA)";
  let description = [{
    `grad[M, I]` (dA) and `input[M, 2I]` (the forward's Y) ->
    `result[M, 2I]` (dY). No fill config.
  }];
  let arguments = !con((ins Moe_TensorType:$grad, Moe_TensorType:$input), commonAttrs);
  let extraClassDeclaration = taskImpl;
}

def Moe_QuantizeOp : Moe_TaskOp<"quantize", "QUANTIZE", 0, 1> {
  let summary = "rows to FP8 e4m3 rows with one fp32 scale per 128 values";
  let description = [{
    `input[M, H]` (f32, bf16 or act) -> `result[M, H + 4 * ceil(H / 128)]`
    (f8E4M3FN): each result row holds H e4m3 codes, then its block scales
    as fp32 bytes (runtime/cpu/Fp8.h). Tiles are row tiles of the input
    rows. No fill config.
  }];
  let arguments = !con((ins Moe_TensorType:$input), commonAttrs);
  let extraClassDeclaration = taskImpl;
}

def Moe_DequantizeOp : Moe_TaskOp<"dequantize", "DEQUANTIZE", 0, 1> {
  let summary = "FP8 e4m3 rows with block scales back to the compute dtype";
  let description = [{
    `input[M, H + 4 * ceil(H / 128)]` (f8E4M3FN, as `moe.quantize` makes
    it) -> `result[M, H]` (f32, bf16 or act). Rows are grouped by local
    expert, as a dispatch's result is; tiles are row tiles of each
    expert's segment. No fill config.
  }];
  let arguments = !con((ins Moe_TensorType:$input), commonAttrs);
  let extraClassDeclaration = taskImpl;
}

#endif // MOEC_COMPILER_IR_MOEOPS_TD
