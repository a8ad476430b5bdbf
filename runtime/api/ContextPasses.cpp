//===- ContextPasses.cpp - A context's passes ------------------------------===//
//
// See ContextImpl.h: a pass's checks (bindings, overlaps), its forward and
// backward (route, bind, layout, gather, the task program, combine), and
// the ranks' agreement on the layer they run (fingerprint).
//
//===----------------------------------------------------------------------===//

#include "runtime/api/ContextImpl.h"

namespace moec::rt {

namespace {

/// What one rank tells the others when a context is created: the layer it
/// runs.
struct RankFingerprint {
  uint32_t forwardChecksum = 0, backwardChecksum = 0;
  LayerShape shape; ///< the forward program's
  char forwardSource[200] = {};
  char backwardSource[200] = {};
};

std::string describe(const RankFingerprint &f) {
  std::string text = fmt::format("forward '{}' (crc32 {:08x})", f.forwardSource, f.forwardChecksum);
  if (f.backwardSource[0])
    text += fmt::format(", backward '{}' (crc32 {:08x})", f.backwardSource, f.backwardChecksum);
  else
    text += ", no backward";
  const LayerShape &s = f.shape;
  return text + fmt::format(" for R {} (TP {}), L {}, H {}, I {}, S {}, K {}, {}", s.ranks, s.tp,
                            s.localExperts, s.hidden, s.inter, s.tokens, s.topK,
                            dtypeName(s.activations));
}

} // namespace

Status Context::Impl::checkOverlaps(uint32_t rank, const std::vector<Binding> &used,
                                    const std::vector<Binding> &outputs) const {
  struct Range {
    uint32_t rank;
    const char *name;
    bool output;
    uintptr_t begin, end;
  };
  std::vector<Range> ranges;
  const auto add = [&](uint32_t q, const char *name, bool output, const Tensor &t) {
    const int64_t n = elementCount(t);
    if (t.data && n > 0 && t.ndim >= 0) {
      const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data);
      ranges.push_back(
          {q, name, output, begin, begin + uintptr_t(n) * format::dtypeSize(DType(t.dtype))});
    }
  };
  size_t mine = 0; ///< ranges[mine..]: rank `rank`'s (added last)
  for (uint32_t q = firstLocal(); q <= rank; ++q) {
    mine = ranges.size();
    for (Binding b : used)
      add(q, kBindingNames[b], std::find(outputs.begin(), outputs.end(), b) != outputs.end(),
          bound[q][b]);
    add(q, "topk_ids", false, ids[q]);
    add(q, "topk_weights", false, weights[q]);
  }
  // Each pair with a range of this rank once (those of earlier ranks were
  // checked with theirs): a pass checks R x (its tensors) x (all tensors).
  for (size_t i = mine; i < ranges.size(); ++i)
    for (size_t j = 0; j < i; ++j) {
      const Range &a = ranges[i], &b = ranges[j];
      if (!(a.output || b.output) || a.begin >= b.end || b.begin >= a.end)
        continue;
      const Range &out = a.output ? a : b, &other = a.output ? b : a;
      return Status::error(fmt::format(
          "rank {}: output '{}' shares memory with {} '{}'{}: an output of a pass must have "
          "memory of its own (no output over an input or over another output)",
          out.rank, out.name, other.output ? "output" : "input", other.name,
          other.rank != out.rank ? fmt::format(" of rank {}", other.rank) : ""));
    }
  return Status::success();
}

Status Context::Impl::checkBinding(uint32_t rank, Binding b, std::vector<int64_t> dims) const {
  const Tensor &t = bound[rank][b];
  if (t.ndim == 0 && t.data == nullptr)
    return Status::error(
        fmt::format("rank {}: tensor '{}' is not bound (bind it first)", rank, kBindingNames[b]));
  const std::vector<int64_t> have(t.dims, t.dims + t.ndim);
  if (have != dims)
    return Status::error(fmt::format("rank {}: tensor '{}' has shape {}; expected [{}]", rank,
                                     kBindingNames[b], shapeString(t), fmt::join(dims, ", ")));
  // A quantized weight's scales, once their shape is right: what
  // checkScales found.
  if ((b == kW1Scale || b == kW2Scale) && rank < scaleVerdicts.size())
    return scaleVerdicts[rank][b == kW1Scale ? 0 : 1];
  return Status::success();
}

void Context::Impl::checkScales(const backend::Pass &pass) {
  scaleVerdicts.assign(bound.size(), {});
  const LayerShape &s = shape();
  if (s.weightFormat == WeightFormat::Dense)
    return;
  // A quantized weight's scales multiply its codes: each must be a finite
  // positive number (a NaN or zero scale would make every value it scales
  // NaN or zero without a word); a zero point is a code, 0 to 15.
  const bool pairs = s.weightFormat == WeightFormat::Int4Group && s.weightZeroPoints;
  std::vector<backend::ScaleCheck> checks;
  std::vector<std::pair<uint32_t, int>> of; // (rank, w1 or w2) of each check
  scalesFoundGood.resize(bound.size(), {nullptr, nullptr});
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r)
    for (int w = 0; w < 2; ++w) {
      const Tensor &t = bound[r][w == 0 ? kW1Scale : kW2Scale];
      const std::vector<int64_t> dims = s.scaleDims(w == 0 ? s.w1Dims() : s.w2Dims());
      const void *&good = scalesFoundGood[r][size_t(w)];
      if (good && good != t.data)
        good = nullptr;
      if (t.data && std::vector<int64_t>(t.dims, t.dims + t.ndim) == dims && !good) {
        checks.push_back({static_cast<const float *>(t.data), elementCount(t), pairs});
        of.emplace_back(r, w);
      }
    }
  const Status found = pass.findBadScales(checks);
  for (size_t c = 0; c < checks.size(); ++c) {
    const auto [rank, w] = of[c];
    const Binding b = w == 0 ? kW1Scale : kW2Scale;
    Status &verdict = scaleVerdicts[rank][size_t(w)];
    if (!found) {
      verdict = found.withPrefix(fmt::format("rank {}: tensor '{}': ", rank, kBindingNames[b]));
      continue;
    }
    const int64_t i = checks[c].index;
    if (i < 0) {
      if (options.packWeights)
        scalesFoundGood[rank][size_t(w)] = checks[c].scales;
      continue;
    }
    const std::vector<int64_t> dims = s.scaleDims(w == 0 ? s.w1Dims() : s.w2Dims());
    const bool zero = pairs && i % 2 == 1;
    // Where: the local expert, then the block, row, or row and group.
    const int64_t at = pairs ? i / 2 : i, perExpert = checks[c].count / dims[0] / (pairs ? 2 : 1);
    const int64_t e = at / perExpert, within = at % perExpert;
    std::string where;
    if (s.weightFormat == WeightFormat::Int8Channel)
      where = fmt::format("row {}", within);
    else
      where = fmt::format(s.weightFormat == WeightFormat::Fp8Block128 ? "block [{}, {}]"
                                                                      : "row {}, group {}",
                          within / dims[2], within % dims[2]);
    const std::string what = s.weightFormat == WeightFormat::Fp8Block128   ? "FP8 block scales"
                             : s.weightFormat == WeightFormat::Int8Channel ? "int8 row scales"
                             : zero                                        ? "int4 zero points"
                                                                           : "int4 group scales";
    verdict =
        Status::error(fmt::format("rank {}: tensor '{}' ({}) holds {} at local expert {}, {}; {}",
                                  rank, kBindingNames[b], what, checks[c].value, e, where,
                                  zero ? "a zero point must be a finite number from 0 to 15"
                                       : "a scale must be a finite positive number"));
  }
}

void Context::Impl::countPuts(const backend::Pass &pass,
                              const std::vector<backend::RankRoute> &routes, PassTimes *times) {
  const backend::PutBytes bytes = backend::groupPutBytes(pass.tasks(), pass.plan(), routes);
  times->dispatchBytes = bytes.dispatch;
  times->combineBytes = bytes.combine;
}

Status Context::Impl::runTasks(backend::Pass &pass, PassTimes &times) {
  running.store(&pass);
  stage.store(1);
  const Status status = pass.runTasks();
  stage.store(2);
  times.tasks = pass.tasksSeconds();
  if (status) {
    // A backward pass has no exchange of its own: its rows are counted
    // from the end of the pass before it.
    markTraffic();
    return status;
  }
  return fatal(withTraffic(status, pass, routes));
}

/// The trace of a pass that started at t0 and began its finish at t1: the
/// task program's spans and the three host phases, from t0.
void Context::Impl::recordTrace(const backend::Pass &pass, Clock::time_point t0,
                                Clock::time_point t1, const PassTimes &times,
                                trace::Trace *out) const {
  auto ns = [](Clock::duration d) { return int64_t(std::chrono::nanoseconds(d).count()); };
  *out = pass.tasksTrace();
  out->shift(ns(pass.tasksStarted() - t0));
  const uint32_t host = firstLocal();
  const int64_t tasksBegin = ns(pass.tasksStarted() - t0), finishBegin = ns(t1 - t0);
  out->phases.push_back({host, "prepare", 0, int64_t(times.prepare * 1e9)});
  out->phases.push_back({host, "tasks", tasksBegin, tasksBegin + int64_t(times.tasks * 1e9)});
  out->phases.push_back({host, "finish", finishBegin, finishBegin + int64_t(times.finish * 1e9)});
}

void Context::Impl::bindBaseWeights(backend::Pass &pass, uint32_t r) const {
  const LayerPlan &plan = pass.plan();
  pass.bindSlot(r, plan.w1, bound[r][kW1].data);
  pass.bindSlot(r, plan.w2, bound[r][kW2].data);
  if (plan.w1Scale != kNoSlot) {
    pass.bindSlot(r, plan.w1Scale, bound[r][kW1Scale].data);
    pass.bindSlot(r, plan.w2Scale, bound[r][kW2Scale].data);
  }
}

Status Context::Impl::layoutAndRun(backend::Pass &pass, const std::vector<const void *> &source,
                                   bool weighted, Clock::time_point t0, PassTimes &times) {
  if (Status st = pass.fillLayout(routes); !st)
    return fatal(st);
  if (Status st = pass.gatherSendRows(routes, source, weighted); !st)
    return fatal(st);
  times.prepare = secondsSince(t0);
  countPuts(pass, routes, &times);
  return runTasks(pass, times);
}

Status Context::Impl::forward() {
  if (Status st = usable(); !st)
    return st;
  const Clock::time_point t0 = Clock::now();
  const LayerShape &s = shape();
  const int64_t H = s.hidden;
  const std::array<int64_t, 3> w1 = s.w1Dims(), w2 = s.w2Dims();
  const auto bindings = [&](uint32_t r, const backend::RankRoute &route) {
    const int64_t S = route.tokens;
    for (const auto &[b, dims] : {std::pair<Binding, std::vector<int64_t>>{kX, {S, H}},
                                  {kY, {S, H}},
                                  {kW1, s.storedDims(w1)},
                                  {kW2, s.storedDims(w2)}})
      if (Status st = checkBinding(r, b, dims); !st)
        return st;
    for (const AdapterBinding &a : adapterBindings(s, fwd->plan(), false))
      if (Status st = checkBinding(r, a.binding, a.dims); !st)
        return st;
    if (s.weightFormat != WeightFormat::Dense)
      for (const auto &[b, dims] :
           {std::pair{kW1Scale, s.scaleDims(w1)}, std::pair{kW2Scale, s.scaleDims(w2)}})
        if (Status st = checkBinding(r, b, dims); !st)
          return st;
    std::vector<Binding> used = {kX, kY, kW1, kW2};
    for (const AdapterBinding &a : adapterBindings(s, fwd->plan(), false))
      used.push_back(a.binding);
    if (s.weightFormat != WeightFormat::Dense)
      used.insert(used.end(), {kW1Scale, kW2Scale});
    return checkOverlaps(r, used, {kY});
  };
  checkScales(fwd ? *fwd : *bwd);
  // Every check passes on every rank before state and outputs change.
  if (Status st = route(&routes, bindings); !st)
    return st;
  fwdTimes.checks = secondsSince(t0);
  haveForward = false;
  backend::Pass &pass = *fwd;
  if (Status st = pass.allocate(); !st)
    return fatal(st);
  const LayerPlan &plan = pass.plan();
  std::vector<const void *> x(ranks(), nullptr);
  std::vector<void *> y(ranks(), nullptr);
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
    bindBaseWeights(pass, r);
    for (const AdapterBinding &a : adapterBindings(s, plan, false))
      pass.bindSlot(r, a.slot, bound[r][a.binding].data);
    x[r] = bound[r][kX].data;
    y[r] = bound[r][kY].data;
  }
  if (Status st = layoutAndRun(pass, x, false, t0, fwdTimes); !st)
    return st;

  const Clock::time_point t1 = Clock::now();
  if (Status st = pass.combine(routes, y, true); !st)
    return fatal(st);
  fwdTimes.finish = secondsSince(t1);
  haveForward = true;
  lastWasBackward = false;
  if (options.trace) {
    recordTrace(pass, t0, t1, fwdTimes, &fwdTrace);
    fwdOrigin = t0;
  }
  return Status::success();
}

Status Context::Impl::backward() {
  if (Status st = usable(); !st)
    return st;
  if (!bwd)
    return Status::error("this context has no backward program");
  if (!haveForward)
    return Status::error("backward needs a forward pass first: it uses the routing and "
                         "activations the last forward pass saved");
  const Clock::time_point t0 = Clock::now();
  const LayerShape &s = shape();
  const int64_t H = s.hidden, I = s.inter, L = s.localExperts;
  const std::array<int64_t, 3> w1 = s.w1Dims(), w2 = s.w2Dims();
  // A frozen layer's backward has no weight gradients to bind.
  const bool frozen = bwd->plan().shape.frozen;
  std::vector<Status> local;
  checkScales(fwd ? *fwd : *bwd);
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
    const int64_t S = routes[r].tokens, K = routes[r].topK;
    Status st;
    for (const auto &[b, dims] : {std::pair<Binding, std::vector<int64_t>>{kDy, {S, H}},
                                  {kDx, {S, H}},
                                  {kDtopk, {S, K}},
                                  {kW1, s.storedDims(w1)},
                                  {kW2, s.storedDims(w2)},
                                  {kDw1, {L, H, 2 * I}},
                                  {kDw2, {L, I, H}}}) {
      if (frozen && (b == kDw1 || b == kDw2))
        continue;
      if (st = checkBinding(r, b, dims); !st)
        break;
    }
    for (bool gradients : {false, true})
      for (const AdapterBinding &a : adapterBindings(s, bwd->plan(), gradients))
        if (st && !(st = checkBinding(r, a.binding, a.dims)))
          break;
    if (s.weightFormat != WeightFormat::Dense)
      for (const auto &[b, dims] :
           {std::pair{kW1Scale, s.scaleDims(w1)}, std::pair{kW2Scale, s.scaleDims(w2)}})
        if (st && !(st = checkBinding(r, b, dims)))
          break;
    if (st) {
      std::vector<Binding> used = {kDy, kDx, kDtopk, kW1, kW2}, outputs = {kDx, kDtopk};
      if (!frozen)
        for (Binding b : {kDw1, kDw2})
          used.push_back(b), outputs.push_back(b);
      for (bool gradients : {false, true})
        for (const AdapterBinding &a : adapterBindings(s, bwd->plan(), gradients)) {
          used.push_back(a.binding);
          if (gradients)
            outputs.push_back(a.binding);
        }
      if (s.weightFormat != WeightFormat::Dense)
        used.insert(used.end(), {kW1Scale, kW2Scale});
      st = checkOverlaps(r, used, outputs);
    }
    local.push_back(st);
  }
  if (Status st = agree(local, nullptr); !st)
    return st;
  bwdTimes.checks = secondsSince(t0);

  backend::Pass &pass = *bwd;
  pass.borrowFrom(*fwd);
  if (Status st = pass.allocate(); !st)
    return fatal(st);
  const LayerPlan &plan = pass.plan();
  const LayerPlan &saved = fwd->plan();
  std::vector<const void *> dy(ranks(), nullptr);
  std::vector<void *> dx(ranks(), nullptr);
  std::vector<float *> dtopk(ranks(), nullptr);
  for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
    bindBaseWeights(pass, r);
    pass.bindSlot(r, plan.upOut, fwd->slot(r, saved.upOut));
    if (!frozen) {
      pass.bindSlot(r, plan.dw1, bound[r][kDw1].data);
      pass.bindSlot(r, plan.dw2, bound[r][kDw2].data);
    }
    // The activations this backward reads from forward: X and A for the
    // weight gradients (dw or the adapters' dA), U for the adapters' dB.
    if (plan.dispatched != kNoSlot)
      pass.bindSlot(r, plan.dispatched, fwd->slot(r, saved.dispatched));
    if (plan.swigluOut != kNoSlot)
      pass.bindSlot(r, plan.swigluOut, fwd->slot(r, saved.swigluOut));
    for (int t = 0; t < 2; ++t)
      if (plan.lora[t].u != kNoSlot)
        pass.bindSlot(r, plan.lora[t].u, fwd->slot(r, saved.lora[t].u));
    for (bool gradients : {false, true})
      for (const AdapterBinding &a : adapterBindings(s, plan, gradients))
        pass.bindSlot(r, a.slot, bound[r][a.binding].data);
    dy[r] = bound[r][kDy].data;
    dx[r] = bound[r][kDx].data;
    dtopk[r] = static_cast<float *>(bound[r][kDtopk].data);
  }
  if (Status st = layoutAndRun(pass, dy, true, t0, bwdTimes); !st)
    return st;

  const Clock::time_point t1 = Clock::now();
  if (Status st = pass.combine(routes, dx, false); !st)
    return fatal(st);
  if (Status st = pass.topkWeightGrad(*fwd, routes, dy, dtopk); !st)
    return fatal(st);
  bwdTimes.finish = secondsSince(t1);
  lastWasBackward = true;
  if (options.trace) {
    recordTrace(pass, t0, t1, bwdTimes, &bwdTrace);
    bwdOrigin = t0;
  }
  return Status::success();
}

/// Under a fabric of several processes: checks that every rank runs the
/// same binaries (by checksum) of the same layer.
Status Context::Impl::fingerprint() const {
  RankFingerprint mine;
  mine.forwardChecksum = fwdProgram->checksum();
  copyText(mine.forwardSource, sizeof mine.forwardSource, fwdProgram->source());
  if (bwdProgram) {
    mine.backwardChecksum = bwdProgram->checksum();
    copyText(mine.backwardSource, sizeof mine.backwardSource, bwdProgram->source());
  }
  mine.shape = fwdProgram->shape();
  std::vector<RankFingerprint> all(fabric->ranks());
  if (Status st = fabric->exchange(&mine, sizeof mine, all.data(), options.timeoutSeconds); !st)
    return st.withPrefix("creating the context: ");
  for (uint32_t r = 1; r < all.size(); ++r)
    if (all[r].forwardChecksum != all[0].forwardChecksum ||
        all[r].backwardChecksum != all[0].backwardChecksum)
      return Status::error(
          fmt::format("ranks 0 and {} run different layers: rank 0 runs {}; rank {} runs {}", r,
                      describe(all[0]), r, describe(all[r])));
  return Status::success();
}

} // namespace moec::rt
