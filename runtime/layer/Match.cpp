//===- Match.cpp - A layer plan held against what it must agree with ------===//
//
// The checks of a plan against its binary's layer record (the config it was
// compiled from), and of two plans against each other: a forward and the
// backward that takes its saved tensors, a dispatch and its combine.
//
//===----------------------------------------------------------------------===//

#include "runtime/layer/Layer.h"

#include <fmt/format.h>

#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

namespace moec::rt {

using format::TaskProgram;

/// Checks what `program`'s ops say of the layer against its layer record,
/// and takes from the record what they cannot say.
Status checkLayerRecord(const TaskProgram &program, LayerPlan &plan) {
  if (!program.layer)
    return Status::error("the binary has no layer record: only a program compiled from a "
                         "config (moec compile) runs as a layer");
  const format::LayerRecord &r = *program.layer;
  LayerShape &shape = plan.shape;
  std::initializer_list<std::tuple<const char *, int64_t, int64_t>> sizes = {
      {"hidden size", r.hidden, shape.hidden},
      {"tokens per rank", r.seqSize, shape.tokens},
      {"top_k", r.topK, shape.topK},
      {"row capacity", r.rowCapacity, shape.rowCapacity},
      {"receive capacity", r.receiveCapacity, shape.receiveCapacity}};
  for (const auto &[what, record, ops] : sizes)
    if (record != ops)
      return Status::error(fmt::format("the binary's layer record says {} {}, but its ops "
                                       "have {}",
                                       what, record, ops));
  if (r.dtype != shape.activations)
    return Status::error(fmt::format("the binary's layer record says activations of {}, but "
                                     "its ops have {}",
                                     format::dtypeName(r.dtype),
                                     format::dtypeName(shape.activations)));
  if (plan.kind == PlanKind::Layer) {
    const int64_t inter = r.intermediate / int64_t(shape.tp);
    if (inter != shape.inter)
      return Status::error(fmt::format("the binary's layer record says an intermediate size "
                                       "of {} ({} a TP rank), but its ops have {}",
                                       r.intermediate, inter, shape.inter));
    // FP8 dispatch quantizes the forward's rows; the backward's travel as
    // they are.
    if (!shape.backward && (r.dispatchDtype == DType::F8E4M3) != shape.fp8Dispatch)
      return Status::error(fmt::format("the binary's layer record says the dispatched rows "
                                       "travel as {}, but its ops send {}",
                                       format::dtypeName(r.dispatchDtype),
                                       shape.fp8Dispatch ? "f8e4m3" : "them as they are"));
    if (shape.backward && !shape.frozen && r.mainGrad() != shape.accumulateWeightGrads)
      return Status::error(fmt::format("the binary's layer record says main_grad is {}, but "
                                       "its weight-gradient GMMs {} into dw1 and dw2",
                                       r.mainGrad(), shape.accumulateWeightGrads ? "add" : "write"));
    if (shape.loraTargets != 0 && (int64_t(r.loraRank) != shape.loraRank ||
                                   float(r.loraScaling()) != shape.loraScaling))
      return Status::error(fmt::format("the binary's layer record says LoRA rank {} and scaling "
                                       "{}, but its adapters have rank {} and scaling {}",
                                       r.loraRank, r.loraScaling(), shape.loraRank,
                                       shape.loraScaling));
    if (shape.weightFormat == WeightFormat::Int4Group && int64_t(r.weightGroup) != shape.weightGroup)
      return Status::error(fmt::format("the binary's layer record says int4 groups of {}, but "
                                       "its weights' scales have groups of {}",
                                       r.weightGroup, shape.weightGroup));
  }
  shape.capacityFactor = r.capacityFactor;
  plan.record = r;
  return Status::success();
}


namespace {

/// "the PAIR programs are for different layers: ", the start of a mismatch.
std::string differentLayers(const char *pair) {
  return fmt::format("the {} programs are for different layers: ", pair);
}

/// The first of `fields` whose two values differ, named in an error.
Status sameLayer(const char *pair,
                 std::initializer_list<std::pair<const char *, std::pair<int64_t, int64_t>>>
                     fields) {
  for (const auto &[what, values] : fields)
    if (values.first != values.second)
      return Status::error(differentLayers(pair) +
                           fmt::format("{} {} and {}", what, values.first, values.second));
  return Status::success();
}

} // namespace

Status checkExchangeMatch(const LayerPlan &dispatch, const LayerPlan &combine) {
  if (dispatch.kind != PlanKind::Dispatch)
    return Status::error("the dispatch program is not a dispatch alone (a graph of one "
                         "dispatch op)");
  if (combine.kind != PlanKind::Combine)
    return Status::error("the combine program is not a combine alone (a graph of one "
                         "combine op)");
  const LayerShape &d = dispatch.shape, &c = combine.shape;
  return sameLayer("dispatch and combine",
                   {{"ranks", {d.ranks, c.ranks}},
                    {"local experts", {d.localExperts, c.localExperts}},
                    {"hidden size", {d.hidden, c.hidden}},
                    {"tokens", {d.tokens, c.tokens}},
                    {"row capacity", {d.rowCapacity, c.rowCapacity}},
                    {"receive capacity", {d.receiveCapacity, c.receiveCapacity}},
                    {"put capacity", {d.putCapacity, c.putCapacity}},
                    {"activations", {int64_t(d.activations), int64_t(c.activations)}}});
}

Status checkPassesMatch(const LayerPlan &forward, const LayerPlan &backward) {
  const LayerShape &f = forward.shape, &b = backward.shape;
  if (f.backward)
    return Status::error("the forward program is a backward pass");
  if (!b.backward)
    return Status::error("the backward program is a forward pass");
  const char *pair = "forward and backward";
  if (Status s = sameLayer(pair,
                           {{"ranks", {f.ranks, b.ranks}},
                            {"TP ranks", {f.tp, b.tp}},
                            {"local experts", {f.localExperts, b.localExperts}},
                            {"hidden size", {f.hidden, b.hidden}},
                            {"intermediate size", {f.inter, b.inter}},
                            {"row capacity", {f.rowCapacity, b.rowCapacity}},
                            {"receive capacity", {f.receiveCapacity, b.receiveCapacity}},
                            {"expert capacity", {f.expertCapacity, b.expertCapacity}},
                            {"put capacity", {f.putCapacity, b.putCapacity}},
                            {"LoRA targets (bit 0: w1, bit 1: w2)", {f.loraTargets, b.loraTargets}},
                            {"LoRA rank", {f.loraRank, b.loraRank}},
                            {"transposed weights", {f.weightsTransposed, b.weightsTransposed}},
                            {"weight format (0 dense, 1 fp8_block128, 2 int8, 3 int4)",
                             {int64_t(f.weightFormat), int64_t(b.weightFormat)}},
                            {"int4 group", {f.weightGroup, b.weightGroup}},
                            {"int4 zero points", {f.weightZeroPoints, b.weightZeroPoints}}});
      !s)
    return s;
  if (f.loraScaling != b.loraScaling)
    return Status::error(differentLayers(pair) +
                         fmt::format("LoRA scaling {} and {}", f.loraScaling, b.loraScaling));
  if (f.activations != b.activations)
    return Status::error(differentLayers(pair) +
                         fmt::format("activations {} and {}", format::dtypeName(f.activations),
                                     format::dtypeName(b.activations)));
  return Status::success();
}

} // namespace moec::rt
