//===- ResolveShapes.cpp - bind symbolic dims from a config ----------------===//

#include "compiler/config/Config.h"
#include "compiler/target/Profile.h"
#include "compiler/ir/GraphUtils.h"
#include "compiler/transforms/Passes.h"

#include <optional>

namespace moec::moe {
#define GEN_PASS_DEF_RESOLVESHAPES
#include "compiler/transforms/Passes.h.inc"
} // namespace moec::moe

using namespace mlir;
using namespace moec;
using namespace moec::moe;

namespace {

struct ResolveShapesPass : moec::moe::impl::ResolveShapesBase<ResolveShapesPass> {
  using ResolveShapesBase::ResolveShapesBase;
  /// With a config the caller loaded (its core counts set): `source`, its
  /// path, names it in messages.
  ResolveShapesPass(const ModelConfig &config, const std::string &source) : given(config) {
    configPath = source;
  }

  std::optional<ModelConfig> given;

  void runOnOperation() override {
    ModuleOp module = getOperation();
    ModelConfig config;
    std::string error;
    if (given) {
      config = *given;
    } else {
      if (configPath.empty()) {
        module.emitError() << "moe-resolve-shapes needs a config: pass config=PATH";
        return signalPassFailure();
      }
      target::TargetProfile profile;
      if (Status status = target::loadConfigForTarget(configPath, target, &config, &profile);
          !status) {
        module.emitError() << status.message();
        return signalPassFailure();
      }
    }
    Bindings bindings = configBindings(config);
    Builder b(module.getContext());
    Type act = config.dtype == DType::BF16 ? Type(b.getBF16Type()) : Type(b.getF32Type());
    SmallVector<NamedAttribute> bound;
    for (const auto &[name, value] : bindings)
      bound.push_back(b.getNamedAttr(name, b.getI64IntegerAttr(value)));
    DictionaryAttr boundAttr = b.getDictionaryAttr(bound);

    for (GraphOp graph : module.getOps<GraphOp>()) {
      for (Operation &op : graph.getBlock()) {
        auto def = dyn_cast<TensorDefOpInterface>(&op);
        if (!def)
          continue;
        auto type = def.getTensor().getType();
        SmallVector<Attribute> dims;
        for (unsigned i = 0; i < type.getRank(); ++i) {
          Expr dim = dimExpr(type, i);
          std::optional<int64_t> value = dim.evaluate(bindings, &error);
          if (!value) {
            auto diag = op.emitError() << "tensor '" << def.getResultName() << "' dim " << i
                                       << " ('" << dim.text() << "'): " << error;
            if (config.loraRank == 0 && dim.text().find("lora_rank") != std::string::npos)
              diag << " (a graph with LoRA adapters needs 'lora_rank' in the config '"
                   << configPath << "')";
            return signalPassFailure();
          }
          if (*value <= 0) {
            op.emitError() << "tensor '" << def.getResultName() << "' dim " << i << " ('"
                           << dim.text() << "') is " << *value << " with config '"
                           << configPath << "'; dims must be positive";
            return signalPassFailure();
          }
          dims.push_back(b.getI64IntegerAttr(*value));
        }
        Type elt = type.getElementType().isa<ActType>() ? act : type.getElementType();
        def.getTensor().setType(type.withDims(b.getArrayAttr(dims), elt));
        ++numResolvedTensors;
      }
      // A scale of "lora_scaling" becomes the config's lora_alpha / lora_rank.
      for (GmmOp gmm : graph.getBlock().getOps<GmmOp>()) {
        auto symbolic = gmm.getScaleAttr().dyn_cast_or_null<StringAttr>();
        if (!symbolic)
          continue;
        if (config.loraRank == 0) {
          gmm.emitError() << "'" << gmm.getOpName() << "': scale \"" << kLoraScaling
                          << "\" needs 'lora_rank' (and optionally 'lora_alpha') in the config '"
                          << configPath << "'";
          return signalPassFailure();
        }
        gmm.setScaleAttr(b.getF64FloatAttr(loraScaling(config)));
      }
      // main_grad: every weight gradient accumulates into an fp32 buffer the
      // caller keeps across micro-batches.
      if (config.mainGrad)
        for (GmmOp gmm : graph.getBlock().getOps<GmmOp>()) {
          if (!gmm.isWeightGradient())
            continue;
          gmm.setAccumulate(true);
          auto type = gmm.getResult().getType();
          gmm.getResult().setType(type.withDims(type.getDims(), b.getF32Type()));
        }
      // The fill config's expressions are the seed's and moec derives what
      // they said (docs/graph-format.md), but a symbol they name must still
      // be one the config binds: a typo is an error, not silence.
      Bindings fillBindings = bindings;
      fillBindings["split_value"] = 1;
      for (TaskOpInterface task : graph.getBlock().getOps<TaskOpInterface>()) {
        DictionaryAttr fill = task.getFillAttr();
        if (!fill)
          continue;
        for (NamedAttribute entry : fill) {
          // The keys that hold expressions (MoeOps.cpp's fill keys).
          const StringRef key = entry.getName().getValue();
          auto text = entry.getValue().dyn_cast<StringAttr>();
          if (!text || (key != "event_group" && key != "event_delta" && key != "num_cube_cores"))
            continue;
          std::optional<Expr> expr = Expr::parse(text.getValue().str(), &error);
          if (expr && expr->evaluate(fillBindings, &error))
            continue;
          if (expr && error.find("unknown symbol") == std::string::npos)
            continue; // e.g. a division that does not divide: the value is not used
          task->emitError() << "'" << task.getOpName() << "': fill key '"
                            << entry.getName().getValue() << "': " << error;
          return signalPassFailure();
        }
      }
      graph.setBindingsAttr(boundAttr);
    }
  }
};

} // namespace

std::unique_ptr<Pass> moec::moe::createResolveShapes(const ModelConfig &config,
                                                     const std::string &source) {
  return std::make_unique<ResolveShapesPass>(config, source);
}
