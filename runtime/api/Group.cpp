//===- Group.cpp - What every pass over an EP group checks and agrees on ---===//
//
// See Group.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/Group.h"

#include "runtime/backend/Registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

namespace moec::rt::detail {

namespace {

/// What one rank tells the others before a pass: whether its own checks
/// passed (else why), and its routing's size and per-expert row counts.
/// Followed by E int64 counts.
struct RankReport {
  int32_t ok = 1;
  int32_t code = 0; ///< the StatusCode of the error, when not ok
  int64_t tokens = 0;
  int64_t topK = 0;
  uint64_t routing = 0; ///< routingFingerprint() of the rank's routing
  char message[480] = {};
};

/// FNV-1a, a 64-bit word at a time, over the sorted order and the top-k
/// weights of a routing: equal for ranks given the same topk_ids and
/// topk_weights.
uint64_t routingFingerprint(const backend::RankRoute &route) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t row : route.layout.order)
    h = (h ^ uint64_t(row)) * 1099511628211ull;
  const std::vector<float> &w = route.weights;
  for (size_t i = 0; i < w.size(); i += 2) {
    uint64_t word = 0;
    std::memcpy(&word, w.data() + i, std::min<size_t>(2, w.size() - i) * sizeof(float));
    h = (h ^ word) * 1099511628211ull;
  }
  return h;
}
static_assert(sizeof(RankReport) == 512, "RankReport layout");

} // namespace

void copyText(char *dst, size_t size, const std::string &text) {
  const size_t n = std::min(size - 1, text.size());
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

int64_t elementCount(const Tensor &t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t.ndim; ++i)
    n *= t.dims[i];
  return n;
}

Status checkTimeout(double seconds, const std::string &what) {
  if (seconds == 0 || timeoutInRange(seconds))
    return Status::success();
  return Status::error(
      fmt::format("{} is {} s; it must be from {} to {} seconds, or 0 for the default ({})", what,
                  seconds, kTimeoutMinSeconds, kTimeoutMaxSeconds, kDefaultTimeoutSeconds));
}

Status Group::initialize(const LayerShape &shape, const ContextOptions &opts,
                         const std::string &source) {
  if (Status s = checkTimeout(opts.timeoutSeconds, "the timeout"); !s)
    return s;
  options = opts;
  options.timeoutSeconds = timeoutOrDefault(opts.timeoutSeconds);
  layer = shape;
  workerCount = opts.workers ? opts.workers : std::max(1u, std::thread::hardware_concurrency());
  const backend::BackendInfo *made = nullptr;
  if (Status s = backend::lookupBackend(opts.backend, &made); !s)
    return s.withPrefix(source + ": ");
  if (opts.packWeights)
    if (Status s = backend::requireFeature(opts.backend, backend::Feature::PackedWeights); !s)
      return s.withPrefix(source + ": ");
  backend::BackendOptions backendOptions;
  backendOptions.workers = workerCount;
  backend = made->create(backendOptions);
  const uint32_t R = shape.ranks;
  fabric = opts.fabric ? opts.fabric : comm::inProcessFabric(R);
  if (fabric->ranks() != R)
    return Status::error(fmt::format(
        "{}: the binary is compiled for {} ranks (the config's ep x tp: {} x {}), but the {} "
        "fabric has {} (e.g. mpirun -np {})",
        source, R, shape.epRanks(), shape.tp, fabric->name(), fabric->ranks(), R));
  ids.assign(R, Tensor{});
  weights.assign(R, Tensor{});
  return Status::success();
}

Status Group::usable() const {
  if (const pid_t me = ::getpid(); me != creator)
    return Status::error(fmt::format(
        "this context was created in process {}; this is process {}, a child of fork(), "
        "which has none of its threads: create a new context in this process",
        creator, me));
  if (!broken.empty())
    return Status::error("the context cannot run another pass (an earlier error left the ranks "
                         "out of step): " + broken);
  return Status::success();
}

void Group::markTraffic() {
  if (fabric->allLocal())
    return;
  trafficMark.resize(ranks());
  for (uint32_t p = 0; p < ranks(); ++p)
    trafficMark[p] = fabric->traffic(p);
}

Status Group::withTraffic(Status status, const backend::Pass &pass,
                          const std::vector<backend::RankRoute> &routes) const {
  if (status || fabric->allLocal() || fabric->localRanks() != 1 ||
      trafficMark.size() != ranks() || routes.size() != ranks())
    return status;
  const uint32_t me = fabric->firstLocal();
  const std::vector<uint64_t> expected =
      backend::expectedPutBytes(pass.tasks(), pass.plan(), routes, me);
  std::vector<std::string> from, to;
  for (uint32_t p = 0; p < ranks(); ++p) {
    if (p == me)
      continue;
    const comm::Traffic now = fabric->traffic(p);
    const uint64_t arrived = now.arrived - trafficMark[p].arrived;
    from.push_back(fmt::format("rank {} {} of {}{}", p, arrived, expected[p],
                               arrived < expected[p] ? " (short)" : ""));
    to.push_back(fmt::format("rank {} {}", p, now.sent - trafficMark[p].sent));
  }
  return Status::error(fmt::format("{}. Bytes of rows in this pass: arrived from {}; sent to {}",
                                   status.message(), fmt::join(from, ", "), fmt::join(to, ", ")),
                       status.code());
}

Status Group::localRank(uint32_t rank) const {
  if (rank >= ranks())
    return Status::error(
        fmt::format("rank {} is out of range: the EP group has {} ranks", rank, ranks()));
  if (!fabric->isLocal(rank))
    return Status::error(fmt::format(
        "rank {} is not run by this process: with the {} fabric it runs rank{} {}", rank,
        fabric->name(), fabric->localRanks() == 1 ? "" : "s",
        fabric->localRanks() == 1 ? fmt::format("{}", firstLocal())
                                  : fmt::format("{}..{}", firstLocal(), lastLocal() - 1)));
  return Status::success();
}

Status Group::setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights) {
  if (Status s = localRank(rank); !s)
    return s;
  const std::string where = fmt::format("rank {}: ", rank);
  if (topkIds.ndim != 2 || topkIds.dims[0] < 0 || topkIds.dims[1] < 1)
    return Status::error(where + fmt::format("topk_ids has shape {}; expected [S, K] with K >= 1",
                                             shapeString(topkIds)));
  if (topkIds.dtype != MOEC_I32 && topkIds.dtype != MOEC_I64)
    return Status::error(where + fmt::format("topk_ids is {}; expected i32 or i64",
                                             format::dtypeName(DType(topkIds.dtype))));
  if (topkWeights.ndim != 2 || topkWeights.dims[0] != topkIds.dims[0] ||
      topkWeights.dims[1] != topkIds.dims[1])
    return Status::error(where + fmt::format("topk_weights has shape {}; expected {} like "
                                             "topk_ids",
                                             shapeString(topkWeights), shapeString(topkIds)));
  if (topkWeights.dtype != MOEC_F32)
    return Status::error(where + fmt::format("topk_weights is {}; expected f32",
                                             format::dtypeName(DType(topkWeights.dtype))));
  if (elementCount(topkIds) > 0 && (!topkIds.data || !topkWeights.data))
    return Status::error(where + "topk_ids or topk_weights has no data");
  ids[rank] = topkIds;
  weights[rank] = topkWeights;
  return Status::success();
}

/// Checks and lays out the routing of local rank `rank`.
Status Group::checkRoute(uint32_t r, backend::RankRoute *out) const {
  const LayerShape &s = shape();
  const Tensor &idsT = ids[r];
  if (idsT.ndim != 2)
    return Status::error(fmt::format("rank {}: no routing set (setRouting)", r));
  // *out's vectors keep their storage from the pass before (route()).
  backend::RankRoute &route = *out;
  route.tokens = idsT.dims[0];
  route.topK = idsT.dims[1];
  if (route.tokens * route.topK > s.rowCapacity)
    return Status::error(
        fmt::format("rank {}: routing over capacity: {} tokens x top-{} = {} rows; the binary "
                    "serves at most {} rows per rank",
                    r, route.tokens, route.topK, route.tokens * route.topK, s.rowCapacity),
        StatusCode::OverCapacity);
  const Status built =
      idsT.dtype == MOEC_I32
          ? rt::buildRoutingLayout(static_cast<const int32_t *>(idsT.data), route.tokens,
                                    route.topK, s.experts(), &route.layout)
          : rt::buildRoutingLayout(static_cast<const int64_t *>(idsT.data), route.tokens,
                                    route.topK, s.experts(), &route.layout);
  if (!built)
    return built.withPrefix(fmt::format("rank {}: ", r));
  const float *w = static_cast<const float *>(weights[r].data);
  route.weights.assign(w, w + route.tokens * route.topK);
  return Status::success();
}

void Group::forEachLocalRank(const std::function<void(uint32_t)> &work) const {
  const uint32_t first = firstLocal(), count = lastLocal() - first;
  int64_t rows = 0;
  for (uint32_t r = first; r < first + count; ++r)
    if (ids[r].ndim == 2)
      rows += ids[r].dims[0] * ids[r].dims[1];
  // Below this a thread's share costs more than the routing it lays out.
  constexpr int64_t kRowsForThreads = 65536;
  const uint32_t threads = rows < kRowsForThreads
                               ? 1
                               : std::min(count, std::max(1u, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (uint32_t r = first; r < first + count; ++r)
      work(r);
    return;
  }
  // The process's team of that size (exec::ThreadTeam::shared), kept: no
  // thread is started per pass, and a system that starts fewer threads
  // gets a smaller team that runs every rank all the same.
  if (!team || teamThreads != threads) {
    team = exec::ThreadTeam::shared(threads);
    teamThreads = threads;
  }
  team->run(
      count, [&](size_t i) { work(first + uint32_t(i)); }, threads);
}

/// Tells every rank what the local checks found (`local`, one per local
/// rank) and, in `routes` (all ranks; the local ones filled), the routing
/// sizes and per-expert counts of every rank. Returns the error of the first
/// rank whose checks failed, the same on every rank.
Status Group::agree(const std::vector<Status> &local,
                            std::vector<backend::RankRoute> *routes) {
  const uint32_t R = ranks(), E = shape().experts();
  const size_t block = sizeof(RankReport) + size_t(E) * sizeof(int64_t);
  std::vector<uint8_t> mine(block * fabric->localRanks(), 0), all(block * R, 0);
  for (uint32_t i = 0; i < fabric->localRanks(); ++i) {
    RankReport report;
    const uint32_t r = firstLocal() + i;
    if (routes) {
      report.tokens = (*routes)[r].tokens;
      report.topK = (*routes)[r].topK;
      // Only the TP ranks of an EP rank compare their routings.
      if (local[i] && shape().tp > 1)
        report.routing = routingFingerprint((*routes)[r]);
    }
    if (!local[i]) {
      report.ok = 0;
      report.code = int32_t(local[i].code());
      copyText(report.message, sizeof report.message, local[i].message());
    } else if (routes && !(*routes)[r].layout.counts.empty()) {
      std::memcpy(mine.data() + i * block + sizeof report, (*routes)[r].layout.counts.data(),
                  size_t(E) * sizeof(int64_t));
    }
    std::memcpy(mine.data() + i * block, &report, sizeof report);
  }
  if (Status s = fabric->exchange(mine.data(), block, all.data(), options.timeoutSeconds); !s)
    return fatal(s);
  std::vector<RankReport> reports(R);
  for (uint32_t r = 0; r < R; ++r)
    std::memcpy(&reports[r], all.data() + r * block, sizeof(RankReport));
  if (routes) {
    need = CapacityNeed();
    for (const RankReport &report : reports)
      need.rowsPerRank = std::max(need.rowsPerRank, report.tokens * report.topK);
  }
  for (uint32_t r = 0; r < R; ++r)
    if (!reports[r].ok)
      return fabric->isLocal(r) ? local[r - firstLocal()]
                                : Status::error(reports[r].message, StatusCode(reports[r].code));
  if (!routes)
    return Status::success();
  // The TP ranks of an EP rank share its tokens: they exchange the same
  // rows, and each returns its partial sums to all of them.
  const uint32_t T = shape().tp;
  for (uint32_t r = 0; r < R; ++r) {
    const RankReport &first = reports[r - r % T], &mine = reports[r];
    if (mine.tokens != first.tokens || mine.topK != first.topK || mine.routing != first.routing)
      return Status::error(fmt::format(
          "rank {} (EP rank {}, TP rank {}) routes other tokens than rank {} (TP rank 0): "
          "{} tokens x top-{} against {} x top-{}{}; the TP ranks of an EP rank must be given "
          "the same x, topk_ids and topk_weights",
          r, r / T, r % T, r - r % T, mine.tokens, mine.topK, first.tokens, first.topK,
          mine.tokens == first.tokens && mine.topK == first.topK
              ? " (the same sizes, other expert ids or weights)"
              : ""));
  }
  for (uint32_t r = 0; r < R; ++r) {
    if (fabric->isLocal(r))
      continue;
    backend::RankRoute &route = (*routes)[r];
    route.tokens = reports[r].tokens;
    route.topK = reports[r].topK;
    route.layout.counts.assign(E, 0);
    std::memcpy(route.layout.counts.data(), all.data() + r * block + sizeof(RankReport),
                size_t(E) * sizeof(int64_t));
    route.layout.offsets.assign(E + 1, 0);
    for (uint32_t g = 0; g < E; ++g)
      route.layout.offsets[g + 1] = route.layout.offsets[g] + route.layout.counts[g];
  }
  return Status::success();
}

Status Group::checkCapacities(const std::vector<backend::RankRoute> &routes) {
  const LayerShape &s = shape();
  // Over EP ranks: the TP ranks of one route the same rows (agree()).
  const uint32_t R = s.epRanks(), L = s.localExperts, T = s.tp;
  // One pass: what the routing needs of every capacity, and the first
  // capacity it breaks (puts, then experts, then ranks, in rank order).
  std::string over;
  const auto exceeded = [&](std::string message) {
    if (over.empty())
      over = std::move(message);
  };
  for (uint32_t r = 0; r < R; ++r) {
    int64_t received = 0;
    for (uint32_t e = 0; e < L; ++e) {
      const uint32_t g = r * L + e;
      int64_t rows = 0;
      for (uint32_t q = 0; q < R; ++q) {
        const int64_t n = routes[size_t(q) * T].layout.counts[g];
        need.putRows = std::max(need.putRows, n);
        if (n > s.putCapacity)
          exceeded(fmt::format(
              "routing over capacity: rank {} sends {} rows to expert {}; the binary's puts "
              "carry at most {} rows from one rank to one expert",
              q, n, g, s.putCapacity));
        rows += n;
      }
      need.rowsPerExpert = std::max(need.rowsPerExpert, rows);
      if (rows > s.expertCapacity)
        exceeded(fmt::format(
            "routing over capacity: expert {} (local expert {} of rank {}) receives {} rows; "
            "the binary serves at most {} rows per expert",
            g, e, r, rows, s.expertCapacity));
      received += rows;
    }
    need.receivePerRank = std::max(need.receivePerRank, received);
    if (received > s.receiveCapacity)
      exceeded(fmt::format(
          "routing over capacity: the experts of rank {} receive {} rows; the binary serves "
          "at most {} rows per rank",
          r, received, s.receiveCapacity));
  }
  if (!over.empty())
    return Status::error(over, StatusCode::OverCapacity);
  return Status::success();
}

} // namespace moec::rt::detail
