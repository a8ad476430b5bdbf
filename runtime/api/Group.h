//===- Group.h - What every pass over an EP group checks and agrees on -*- C++ -*-===//
//
// Internal to runtime/api. The state a Context and an Exchange share: the
// fabric, the routing the caller set per rank, and the checks before a pass
// that every rank of the group must agree on (routing, capacities), with
// the exchange that tells every rank every other rank's per-expert row
// counts, or its error.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_API_GROUP_H
#define MOEC_RUNTIME_API_GROUP_H

#include "runtime/api/Runtime.h"
#include "runtime/backend/Backend.h"
#include "runtime/exec/ThreadTeam.h"
#include "runtime/layer/Layer.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

namespace moec::rt {

struct Program::Impl {
  format::TaskProgram program;
  LayerPlan plan;
  std::string source;    ///< the file it came from, or "a program in memory"
  uint32_t checksum = 0; ///< CRC-32 of the program as a task binary
};

} // namespace moec::rt

namespace moec::rt::detail {

/// Copies `text` into `dst` (at most size - 1 bytes) and ends it with NUL.
void copyText(char *dst, size_t size, const std::string &text);

/// Elements of a tensor.
int64_t elementCount(const Tensor &tensor);

/// The one check of a timeout the runtime's APIs take (a context's, an
/// exchange's, the C API's before it makes a fabric): 0 (the default) or
/// base/Time.h's range; the error names `what` ("the timeout").
Status checkTimeout(double seconds, const std::string &what);

struct Group {
  ContextOptions options;
  uint32_t workerCount = 1;
  std::shared_ptr<comm::Fabric> fabric;
  std::unique_ptr<backend::Backend> backend; ///< makes the passes (options.backend)
  std::vector<comm::Traffic> trafficMark; ///< markTraffic()
  LayerShape layer;                  ///< sizes and capacities the routing is checked against
  std::vector<Tensor> ids, weights;  ///< per rank; data null until set
  CapacityNeed need;                 ///< what the last checked routing needed
  std::vector<backend::RankRoute> spareRoutes; ///< route()'s storage for the next routing
  /// forEachLocalRank()'s threads: the process's team of `teamThreads`.
  mutable std::shared_ptr<exec::ThreadTeam> team;
  mutable uint32_t teamThreads = 0;
  std::string broken;                ///< why no further pass can run
  pid_t creator = ::getpid();        ///< a child of fork() runs no pass (usable())

  /// Sets the options, the worker count, the backend and the fabric
  /// (in-process unless the options name one) for `shape`'s group; `source`
  /// names the program in errors.
  Status initialize(const LayerShape &shape, const ContextOptions &options,
                    const std::string &source);

  uint32_t ranks() const { return layer.ranks; }
  const LayerShape &shape() const { return layer; }
  uint32_t firstLocal() const { return fabric->firstLocal(); }
  uint32_t lastLocal() const { return fabric->firstLocal() + fabric->localRanks(); }

  /// Checks that this process runs `rank`.
  Status localRank(uint32_t rank) const;
  /// Checks and stores `rank`'s routing tensors (read when a pass runs).
  Status setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights);
  /// Checks and lays out the routing of local rank `rank`.
  Status checkRoute(uint32_t rank, backend::RankRoute *out) const;
  /// Calls `work(rank)` for every local rank: on the process's thread team
  /// (exec::ThreadTeam) when the ranks route enough rows between them for
  /// threads to pay (8 ranks of 4096 tokens x top-8 on one GPU's host),
  /// else one after the other. `work` must only write what belongs to its
  /// rank.
  void forEachLocalRank(const std::function<void(uint32_t)> &work) const;
  /// Tells every rank what the local checks found (`local`, one per local
  /// rank) and, in `routes` (all ranks; the local ones filled), the routing
  /// sizes and per-expert counts of every rank. Returns the error of the
  /// first rank whose checks failed, the same on every rank.
  Status agree(const std::vector<Status> &local, std::vector<backend::RankRoute> *routes);
  /// Checks the capacities of every rank and expert; sets `need`.
  Status checkCapacities(const std::vector<backend::RankRoute> &routes);
  /// Checks, agrees on and lays out the routing of every rank into *routes
  /// (checkRoute, agree, checkCapacities), with `extra` run on each local
  /// rank after its routing checks (binding checks); nothing is written
  /// anywhere before all of it passes on every rank.
  template <typename Extra>
  Status route(std::vector<backend::RankRoute> *routes, const Extra &extra) {
    markTraffic();
    // Built in the routes of the pass before last (spareRoutes), whose
    // storage is reused: at S 4096 x top-8 a rank's layout is 0.7 MB, and
    // fresh pages cost more than the sort.
    std::vector<backend::RankRoute> &staged = spareRoutes;
    staged.resize(ranks());
    std::vector<Status> local(lastLocal() - firstLocal());
    forEachLocalRank([&](uint32_t r) {
      Status st = checkRoute(r, &staged[r]);
      if (st)
        st = extra(r, staged[r]);
      local[r - firstLocal()] = st;
    });
    if (Status st = agree(local, &staged); !st)
      return st;
    if (Status st = checkCapacities(staged); !st)
      return st;
    routes->swap(staged);
    return Status::success();
  }
  /// Under a fabric of several processes, an error that the ranks may not
  /// share (an exchange that timed out, an allocation that failed on this
  /// rank) leaves the peers' state unknown: no further pass runs.
  Status fatal(Status status) {
    if (!status && !fabric->allLocal())
      broken = status.message();
    return status;
  }
  /// An error when an earlier error left the ranks out of step.
  Status usable() const;
  /// Under a fabric of several processes: notes the bytes moved so far
  /// between this rank and each peer: before a pass's exchange, after which
  /// peers may put the pass's rows, and at the end of every pass that
  /// succeeded (a backward has no exchange). A peer whose tasks ended
  /// first may put rows of its next pass before this rank's pass is over:
  /// a report then counts those few in the pass before.
  void markTraffic();
  /// `status`, the error of a pass of `pass` over `routes` that did not end,
  /// with the bytes of rows this rank expected from each peer against those
  /// that arrived since markTraffic(), and those it sent.
  Status withTraffic(Status status, const backend::Pass &pass,
                     const std::vector<backend::RankRoute> &routes) const;
  /// The options of the passes of this group.
  backend::PassOptions passOptions() const {
    backend::PassOptions po;
    po.workers = workerCount;
    po.timeoutSeconds = options.timeoutSeconds;
    po.trace = options.trace;
    po.opByOp = options.schedule == Schedule::OpByOp;
    po.packWeights = options.packWeights;
    po.fabric = fabric;
    return po;
  }
};

} // namespace moec::rt::detail

#endif // MOEC_RUNTIME_API_GROUP_H
