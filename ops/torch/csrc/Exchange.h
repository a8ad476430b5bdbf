//===- Exchange.h - torch.classes.moec.Exchange ------------------*- C++ -*-===//
//
// Dispatch and combine as ops of their own (rt::Exchange) for a framework's
// own expert computation. MoeOps.cpp registers it.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_OPS_TORCH_CSRC_EXCHANGE_H
#define MOEC_OPS_TORCH_CSRC_EXCHANGE_H

#include "ops/torch/csrc/Slot.h"

#include <tuple>

namespace moec::torchop {

class Exchange : public torch::CustomClassHolder {
public:
  Exchange(std::string dispatchPath, std::string combinePath, int64_t workers,
           double timeoutSeconds, std::string fabric, int64_t group, double groupTimeoutSeconds) {
    moec::rt::ContextOptions options =
        contextOptions(workers, timeoutSeconds, {fabric, group, groupTimeoutSeconds});
    std::shared_ptr<const moec::rt::Program> dispatch, combine;
    check(moec::rt::Program::load(dispatchPath, &dispatch), "dispatch binary");
    check(moec::rt::Program::load(combinePath, &combine), "combine binary");
    check(moec::rt::Exchange::create(dispatch, combine, options, &slot->exchange), "exchange");
    if (fabric == "mpi") {
      std::lock_guard<std::mutex> lock(mpiSlotsMutex);
      mpiSlots.push_back(slot);
    }
  }

  c10::Dict<std::string, int64_t> info() const {
    live();
    return shapeInfo(ex().shape(), ex().firstLocalRank(), ex().localRanks());
  }

  /// -> (expert_x [rows, H], tokens_per_expert [P*L], route)
  std::tuple<at::Tensor, at::Tensor, int64_t> dispatch(const at::Tensor &x, const at::Tensor &ids,
                                                       const at::Tensor &weights) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    const at::Tensor xc = tokens(x, "x");
    expectInput(ids, "topk_ids", 3, ex().localRanks(), "this process's ranks");
    expectInput(weights, "topk_weights", 3, ex().localRanks(), "this process's ranks");
    expectRoutingFor(xc, ids, weights);
    setRoute(++routes, ids, weights);
    const int64_t P = ex().localRanks(), L = ex().shape().localExperts;
    at::Tensor counts = at::empty({P * L}, at::kLong);
    for (int64_t p = 0; p < P; ++p) {
      const std::vector<int64_t> &rows = ex().expertRows(uint32_t(ex().firstLocalRank() + p));
      std::copy(rows.begin(), rows.end(), counts.data_ptr<int64_t>() + p * L);
    }
    at::Tensor expertX = at::empty({totalRows(), ex().shape().hidden}, xc.options());
    check(ex().dispatch(perRank(xc, "x"), expertRowsOf(expertX, "expert_x"), false), "dispatch");
    return {expertX, counts, current};
  }

  /// -> (y [P, S, H], combine step)
  std::tuple<at::Tensor, int64_t> combine(int64_t route, const at::Tensor &ids,
                                          const at::Tensor &weights, const at::Tensor &expertY) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    setRoute(route, ids, weights);
    const at::Tensor rows = expertRowsIn(expertY, "expert_y");
    at::Tensor y = at::empty({ex().localRanks(), ids.size(1), ex().shape().hidden}, rows.options());
    runCombine(rows, y);
    return {y, combineStep};
  }

  /// A dispatch's backward: dx [P, S, H] = the unweighted combine of the
  /// gradient of the expert rows.
  at::Tensor dispatchBackward(int64_t route, const at::Tensor &ids, const at::Tensor &weights,
                              const at::Tensor &dExpertX) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    setRoute(route, ids, weights);
    const at::Tensor rows = expertRowsIn(dExpertX, "the gradient of expert_x");
    at::Tensor dx =
        at::empty({ex().localRanks(), ids.size(1), ex().shape().hidden}, rows.options());
    check(ex().combine(expertRowsOf(rows, "the gradient of expert_x"), perRank(dx, "dx"), false),
          "dispatch backward");
    // The combine pass's rows are no longer a weighted combine's.
    combineStep = -1;
    return dx;
  }

  /// A combine's backward: (d expert_y [rows, H] = the dispatch of
  /// topk_weight * dy, d topk_weights [P, S, K] = <dy[t], row(t, k)>).
  std::tuple<at::Tensor, at::Tensor>
  combineBackward(int64_t route, int64_t step, const at::Tensor &ids, const at::Tensor &weights,
                  const at::Tensor &expertY, const at::Tensor &dyIn) {
    live();
    std::lock_guard<std::mutex> lock(slot->mutex);
    setRoute(route, ids, weights);
    const at::Tensor rows = expertRowsIn(expertY, "expert_y");
    // The returned rows of this combine: run it again when the runtime no
    // longer holds them.
    if (step != combineStep) {
      at::Tensor y =
          at::empty({ex().localRanks(), ids.size(1), ex().shape().hidden}, rows.options());
      runCombine(rows, y);
    }
    const at::Tensor dy = tokens(dyIn, "dy");
    at::Tensor dtopk = at::empty(ids.sizes(), at::kFloat);
    check(ex().topkWeightGrad(perRank(dy, "dy"), perRank(dtopk, "dtopk_weights")),
          "combine backward");
    at::Tensor dExpertY = at::empty_like(rows);
    check(
        ex().dispatch(perRank(dy, "dy"), expertRowsOf(dExpertY, "the gradient of expert_y"), true),
        "combine backward");
    return {dExpertY, dtopk};
  }

  /// Seconds of the last dispatch and combine task programs.
  std::vector<double> times() const {
    live();
    return {ex().dispatchSeconds(), ex().combineSeconds()};
  }

private:
  moec::rt::Exchange &ex() const { return *slot->exchange; }

  void live() const {
    slot->sameProcess("exchange");
    TORCH_CHECK(slot->exchange, "moec: this exchange was released (moec_torch.finalize_mpi)");
  }

  /// x or dy: [P, S, H] in the activations' dtype, contiguous.
  at::Tensor tokens(const at::Tensor &t, const char *name) const {
    expectInput(t, name, 3, ex().localRanks(), "this process's ranks");
    TORCH_CHECK(t.size(2) == ex().shape().hidden, "moec: '", name, "' has shape ", t.sizes(),
                "; expected the hidden size ", ex().shape().hidden, " last");
    expectLayerDType(t, name, ex().shape().activations);
    return t.contiguous();
  }

  /// Expert rows handed in: [rows of this process's ranks, H], contiguous.
  at::Tensor expertRowsIn(const at::Tensor &t, const char *name) const {
    TORCH_CHECK(t.defined() && t.device().is_cpu(), "moec: '", name, "' must be a CPU tensor");
    TORCH_CHECK(t.dim() == 2 && t.size(0) == totalRows() && t.size(1) == ex().shape().hidden,
                "moec: '", name, "' has shape ", t.sizes(), "; expected [", totalRows(), ", ",
                ex().shape().hidden, "] (the rows the dispatch gave, by rank and expert)");
    expectLayerDType(t, name, ex().shape().activations);
    return t.contiguous();
  }

  int64_t totalRows() const {
    int64_t n = 0;
    for (uint32_t p = 0; p < ex().localRanks(); ++p)
      n += ex().receivedRows(ex().firstLocalRank() + p);
    return n;
  }

  /// The runtime tensors of each local rank's part of `t` ([P, ...]).
  std::vector<moec::rt::Tensor> perRank(const at::Tensor &t, const char *name) const {
    const int64_t P = ex().localRanks();
    std::vector<moec::rt::Tensor> out;
    for (int64_t p = 0; p < P; ++p)
      out.push_back(slice(t, name, P, p, false));
    return out;
  }

  /// The runtime tensors of each local rank's rows of `t` ([rows, H]).
  std::vector<moec::rt::Tensor> expertRowsOf(const at::Tensor &t, const char *name) const {
    std::vector<moec::rt::Tensor> out;
    int64_t first = 0;
    for (uint32_t p = 0; p < ex().localRanks(); ++p) {
      const int64_t n = ex().receivedRows(ex().firstLocalRank() + p);
      moec::rt::Tensor part{};
      part.dtype = moec_dtype(moecType(t, name));
      part.ndim = 2;
      part.dims[0] = n;
      part.dims[1] = t.size(1);
      part.data = static_cast<char *>(t.data_ptr()) + first * t.size(1) * t.element_size();
      out.push_back(part);
      first += n;
    }
    return out;
  }

  /// Lays out routing `route` (topk_ids and topk_weights [P, S, K]) unless
  /// it is the current one.
  void setRoute(int64_t route, const at::Tensor &idsIn, const at::Tensor &weightsIn) {
    if (route == current)
      return;
    const int64_t P = ex().localRanks();
    expectInput(idsIn, "topk_ids", 3, P, "this process's ranks");
    expectInput(weightsIn, "topk_weights", 3, P, "this process's ranks");
    expectRoutingDTypes(idsIn, weightsIn);
    ids = idsIn.contiguous();
    weights = weightsIn.contiguous();
    current = -1;
    combineStep = -1;
    for (int64_t p = 0; p < P; ++p)
      check(ex().setRouting(uint32_t(ex().firstLocalRank() + p),
                            slice(ids, "topk_ids", P, p, false),
                            slice(weights, "topk_weights", P, p, false)),
            "routing");
    check(ex().route(), "routing");
    current = route;
  }

  void runCombine(const at::Tensor &rows, at::Tensor &y) {
    combineStep = -1;
    check(ex().combine(expertRowsOf(rows, "expert_y"), perRank(y, "y"), true), "combine");
    combineStep = ++combines;
  }

  std::shared_ptr<Slot> slot = std::make_shared<Slot>();
  at::Tensor ids, weights;  ///< the routing laid out now (kept alive while in use)
  int64_t routes = 0;       ///< dispatches so far (route ids)
  int64_t current = -1;     ///< the route laid out now; -1: none
  int64_t combines = 0;     ///< weighted combines so far
  int64_t combineStep = -1; ///< the weighted combine whose rows the runtime holds
};

} // namespace moec::torchop

#endif // MOEC_OPS_TORCH_CSRC_EXCHANGE_H
