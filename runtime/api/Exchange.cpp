//===- Exchange.cpp - Dispatch and combine as operations of their own ------===//
//
// See Runtime.h (class Exchange). Two CPU passes, one per program, over the
// same fabric: the dispatch pass gathers each rank's rows expert-major and
// puts them to the experts' ranks; its receive window is copied out to the
// caller's expert rows. The combine pass puts rows of the caller's expert
// rows (bound in place) back to their source ranks and reduces them there.
// Both take the routing layout of the last route().
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Group.h"
#include "runtime/backend/Registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>

namespace moec::rt {

struct Exchange::Impl : detail::Group {
  std::shared_ptr<const Program> dispatchProgram, combineProgram;
  std::unique_ptr<backend::Pass> dispatchPass, combinePass;
  std::vector<backend::RankRoute> routes; ///< of the last route()
  std::vector<std::vector<int64_t>> expertRows; ///< per rank (local ones): rows per local expert
  std::vector<int64_t> received;                ///< per rank (local ones): rows in all
  bool routed = false, combined = false;
  double dispatchTime = 0, combineTime = 0;

  /// Checks the tensors of every local rank (tensors[i] is local rank
  /// firstLocal() + i) against `dims(rank)` and `dtype`, then agrees with
  /// the other ranks, so that every rank stops with the same message.
  template <typename Dims>
  Status checkAll(std::initializer_list<std::tuple<const char *, const std::vector<Tensor> *,
                                                   Dims, DType>>
                      checks) {
    std::vector<Status> local;
    for (uint32_t r = firstLocal(); r < lastLocal(); ++r) {
      Status st;
      for (const auto &[name, tensors, dims, dtype] : checks) {
        const size_t i = r - firstLocal();
        if (tensors->size() != fabric->localRanks()) {
          st = Status::error(fmt::format("{} tensors of '{}' for {} local ranks", tensors->size(),
                                         name, fabric->localRanks()));
          break;
        }
        const Tensor &t = (*tensors)[i];
        const std::vector<int64_t> want = dims(r);
        const std::vector<int64_t> have(t.dims, t.dims + std::clamp(t.ndim, 0, MOEC_MAX_DIMS));
        if (have != want) {
          st = Status::error(fmt::format("rank {}: '{}' has shape {}; expected [{}]", r, name,
                                         shapeString(t), fmt::join(want, ", ")));
          break;
        }
        if (DType(t.dtype) != dtype) {
          st = Status::error(fmt::format("rank {}: '{}' is {}; expected {}", r, name,
                                         format::dtypeName(DType(t.dtype)),
                                         format::dtypeName(dtype)));
          break;
        }
        if (!t.data && detail::elementCount(t) > 0) {
          st = Status::error(fmt::format("rank {}: '{}' has no data", r, name));
          break;
        }
      }
      local.push_back(st);
    }
    return agree(local, nullptr);
  }

  /// ready(), then the shapes of [S, H] token rows and [received, H]
  /// expert rows of every local rank.
  Status checkTokensAndRows(const char *tokensName, const std::vector<Tensor> &tokens,
                            const char *rowsName, const std::vector<Tensor> &rows) {
    if (Status s = ready(); !s)
      return s;
    const int64_t H = shape().hidden;
    const DType act = shape().activations;
    using Dims = std::function<std::vector<int64_t>(uint32_t)>;
    const Dims tokenDims = [&](uint32_t r) { return std::vector<int64_t>{routes[r].tokens, H}; };
    const Dims rowDims = [&](uint32_t r) { return std::vector<int64_t>{received[r], H}; };
    return checkAll<Dims>({{rowsName, &rows, rowDims, act}, {tokensName, &tokens, tokenDims, act}});
  }

  Status ready() const {
    if (Status s = usable(); !s)
      return s;
    if (!routed)
      return Status::error("no routing laid out: call route() after setRouting()");
    return Status::success();
  }

  Status checksums() const {
    const uint32_t mine[2] = {dispatchProgram->checksum(), combineProgram->checksum()};
    std::vector<uint32_t> all(2 * size_t(ranks()));
    if (Status s = fabric->exchange(mine, sizeof mine, all.data(), options.timeoutSeconds); !s)
      return s.withPrefix("creating the exchange: ");
    for (uint32_t r = 1; r < ranks(); ++r)
      if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
        return Status::error(fmt::format(
            "ranks 0 and {} run different programs: dispatch crc32 {:08x} and {:08x}, combine "
            "crc32 {:08x} and {:08x}",
            r, all[0], all[2 * r], all[1], all[2 * r + 1]));
    return Status::success();
  }
};

Exchange::Exchange(std::unique_ptr<Impl> impl) : body(std::move(impl)) {}
Exchange::~Exchange() = default;

Status Exchange::create(std::shared_ptr<const Program> dispatch,
                        std::shared_ptr<const Program> combine, const ContextOptions &options,
                        std::unique_ptr<Exchange> *out) {
  if (!dispatch || !combine)
    return Status::error("an exchange needs a dispatch and a combine program");
  if (Status s = checkExchangeMatch(dispatch->impl().plan, combine->impl().plan); !s)
    return s.withPrefix(fmt::format("{} and {}: ", dispatch->source(), combine->source()));
  if (Status s = backend::requireFeature(options.backend, backend::Feature::Exchange); !s)
    return Status::error(
        fmt::format("{}, not on {}", s.message(), backend::kindName(options.backend)));
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->initialize(dispatch->shape(), options, dispatch->source()); !s)
    return s;
  impl->dispatchProgram = std::move(dispatch);
  impl->combineProgram = std::move(combine);
  if (!impl->fabric->allLocal())
    if (Status s = impl->checksums(); !s)
      return s;
  const backend::PassOptions po = impl->passOptions();
  if (Status s = impl->backend->createPass(impl->dispatchProgram->tasks(),
                                          impl->dispatchProgram->impl().plan, po,
                                          &impl->dispatchPass);
      !s)
    return s;
  if (Status s = impl->backend->createPass(impl->combineProgram->tasks(),
                                          impl->combineProgram->impl().plan, po,
                                          &impl->combinePass);
      !s)
    return s;
  const uint32_t R = impl->ranks();
  impl->expertRows.assign(R, {});
  impl->received.assign(R, 0);
  out->reset(new Exchange(std::move(impl)));
  return Status::success();
}

const LayerShape &Exchange::shape() const { return body->shape(); }
uint32_t Exchange::ranks() const { return body->ranks(); }
uint32_t Exchange::firstLocalRank() const { return body->firstLocal(); }
uint32_t Exchange::localRanks() const { return body->fabric->localRanks(); }
const CapacityNeed &Exchange::capacityNeed() const { return body->need; }
double Exchange::dispatchSeconds() const { return body->dispatchTime; }
double Exchange::combineSeconds() const { return body->combineTime; }
int64_t Exchange::receivedRows(uint32_t rank) const { return body->received.at(rank); }
const std::vector<int64_t> &Exchange::expertRows(uint32_t rank) const {
  return body->expertRows.at(rank);
}

Status Exchange::setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights) {
  return body->setRouting(rank, topkIds, topkWeights);
}

Status Exchange::route() {
  Impl &x = *body;
  if (Status s = x.usable(); !s)
    return s;
  x.routed = x.combined = false;
  if (Status s = x.route(&x.routes, [](uint32_t, const backend::RankRoute &) {
        return Status::success();
      });
      !s)
    return s;
  if (Status s = x.dispatchPass->allocate(); !s)
    return x.fatal(s);
  if (Status s = x.combinePass->allocate(); !s)
    return x.fatal(s);
  const uint32_t L = x.shape().localExperts;
  for (uint32_t r = x.firstLocal(); r < x.lastLocal(); ++r) {
    x.expertRows[r].assign(L, 0);
    for (uint32_t q = 0; q < x.ranks(); ++q)
      for (uint32_t e = 0; e < L; ++e)
        x.expertRows[r][e] += x.routes[q].layout.counts[r * L + e];
    x.received[r] = 0;
    for (int64_t n : x.expertRows[r])
      x.received[r] += n;
  }
  // The CPU passes' layout, gather and combine cannot fail.
  (void)x.dispatchPass->fillLayout(x.routes);
  (void)x.combinePass->fillLayout(x.routes);
  x.routed = true;
  return Status::success();
}

Status Exchange::dispatch(const std::vector<Tensor> &x, const std::vector<Tensor> &expertX,
                          bool weighted) {
  Impl &im = *body;
  if (Status s = im.checkTokensAndRows("x", x, "expert_x", expertX); !s)
    return s;
  const int64_t H = im.shape().hidden;
  const DType act = im.shape().activations;
  backend::Pass &pass = *im.dispatchPass;
  std::vector<const void *> source(im.ranks(), nullptr);
  for (uint32_t r = im.firstLocal(); r < im.lastLocal(); ++r)
    source[r] = x[r - im.firstLocal()].data;
  (void)pass.gatherSendRows(im.routes, source, weighted);
  const Status status = pass.runTasks();
  im.dispatchTime = pass.tasksSeconds();
  if (!status)
    return im.fatal(status);
  const uint32_t slot = pass.plan().dispatched;
  for (uint32_t r = im.firstLocal(); r < im.lastLocal(); ++r)
    std::memcpy(expertX[r - im.firstLocal()].data, pass.slot(r, slot),
                size_t(im.received[r] * H) * dtypeSize(act));
  return Status::success();
}

Status Exchange::combine(const std::vector<Tensor> &expertY, const std::vector<Tensor> &y,
                         bool weighted) {
  Impl &im = *body;
  if (Status s = im.checkTokensAndRows("y", y, "expert_y", expertY); !s)
    return s;
  im.combined = false;
  backend::Pass &pass = *im.combinePass;
  std::vector<void *> out(im.ranks(), nullptr);
  for (uint32_t r = im.firstLocal(); r < im.lastLocal(); ++r) {
    pass.bindSlot(r, pass.plan().toReturn, expertY[r - im.firstLocal()].data);
    out[r] = y[r - im.firstLocal()].data;
  }
  const Status status = pass.runTasks();
  im.combineTime = pass.tasksSeconds();
  if (!status)
    return im.fatal(status);
  (void)pass.combine(im.routes, out, weighted);
  im.combined = true;
  return Status::success();
}

Status Exchange::topkWeightGrad(const std::vector<Tensor> &dy, const std::vector<Tensor> &dtopk) {
  Impl &im = *body;
  if (Status s = im.ready(); !s)
    return s;
  if (!im.combined)
    return Status::error("topkWeightGrad needs the rows of a combine after the last route()");
  const int64_t H = im.shape().hidden;
  using Dims = std::function<std::vector<int64_t>(uint32_t)>;
  const Dims tokens = [&](uint32_t r) { return std::vector<int64_t>{im.routes[r].tokens, H}; };
  const Dims topk = [&](uint32_t r) {
    return std::vector<int64_t>{im.routes[r].tokens, im.routes[r].topK};
  };
  if (Status s = im.checkAll<Dims>({{"dy", &dy, tokens, im.shape().activations},
                                    {"dtopk_weights", &dtopk, topk, DType::F32}});
      !s)
    return s;
  std::vector<const void *> in(im.ranks(), nullptr);
  std::vector<float *> out(im.ranks(), nullptr);
  for (uint32_t r = im.firstLocal(); r < im.lastLocal(); ++r) {
    in[r] = dy[r - im.firstLocal()].data;
    out[r] = static_cast<float *>(dtopk[r - im.firstLocal()].data);
  }
  (void)im.combinePass->topkWeightGrad(*im.combinePass, im.routes, in, out);
  return Status::success();
}

} // namespace moec::rt
