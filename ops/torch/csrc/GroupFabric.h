//===- GroupFabric.h - A fabric over a torch.distributed group --*- C++ -*-===//
//
// The ranks of a torch.distributed process group (gloo on CPU) as the ranks
// of an EP group: rank r of the layer is rank r of the group, one rank per
// process. It implements moec's fabric interface (runtime/comm/Fabric.h)
// with the group's point-to-point calls, send and recv, and needs nothing
// else of the group, so any backend with ordered point-to-point messages
// between two ranks on one tag can carry it (NCCL's too, for device memory
// later). It lives with the torch op: the runtime does not depend on torch.
//
//   window    memory of this process, zeroed; windows (and inboxes) are
//             numbered in creation order, the same on every rank (creation
//             is collective: the ranks meet through a bounded exchange that
//             also checks the sizes)
//   put       a control message on the fabric's control tag (window,
//             offset, stride, rows) with the rows after it, up to 256 KiB;
//             larger ones: the control message with the tag of the data,
//             then the rows in one message on that tag; put() returns
//             once both are issued (the copy frees the source), and a
//             completing thread waits, bounded, for them to leave
//   signal    a control message on the control tag, issued after the
//             thread's puts: sends to one peer on one tag leave in the
//             order issued, so no wait between them
//   progress  a receiving thread per peer, started with the fabric: it keeps
//             a receive of the peer's next control message posted, and takes
//             the messages in order; a put's rows it receives before the next
//             control message, so a signal applies only once every put the
//             peer made before it (on any thread, since a put returns only
//             once its messages left) has landed. The group's messages from
//             one rank to another on one tag arrive in the order sent (gloo:
//             one connection per pair); that is all the order it relies on.
//   exchange  each rank sends every peer its block (with the exchange's
//             sequence number), and waits, bounded, until every peer's block
//             is in; a barrier is an exchange, since a peer's block arrives
//             behind every put the peer made before it
//   stop      a control message to every peer; their waits fail at once,
//             and the reports go to rank 0 as under MPI
//
// Every wait is bounded by the timeout: sends (Work::wait with a timeout,
// on the completing thread), exchanges, gathers and the end of the job. The receiving
// threads wait without a bound but are no caller's wait: a peer that dies
// closes its connection (their receive fails, the fabric breaks, and every
// later wait fails naming the peer); a peer that hangs is found by the
// caller's bounded waits. Tags: the fabric uses tags from kTagBase up (a
// user's point-to-point messages on the same group take other tags;
// collectives of gloo take slots of their own).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_OPS_TORCH_CSRC_GROUPFABRIC_H
#define MOEC_OPS_TORCH_CSRC_GROUPFABRIC_H

#include "runtime/comm/Fabric.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

namespace moec::torchop {

/// The first tag of the fabric's messages on the group.
constexpr int kTagBase = 0x4d4f0000;

/// The fabric over `group` (this process runs rank group->getRank() of
/// group->getSize()), one per group: later calls with the same group return
/// the same fabric until closeGroupFabrics. `timeoutSeconds` bounds every
/// wait; `groupTimeoutSeconds` is the group's own timeout (gloo closes the
/// group's connections when a receive waits longer, so the fabric sends
/// every peer a message at a quarter of it). Collective over the group the
/// first time (the ranks meet, bounded).
Status groupFabric(const c10::intrusive_ptr<c10d::ProcessGroup> &group, double timeoutSeconds,
                   double groupTimeoutSeconds, std::shared_ptr<comm::Fabric> *out);

/// Ends the fabrics of every group: tells each peer, waits at most
/// `seconds` for theirs, and stops the receiving threads. Collective: every
/// rank calls it once, at the end (moec_torch registers it to run at exit).
/// Fabrics still held by layers keep working until then.
void closeGroupFabrics(double seconds);

} // namespace moec::torchop

#endif // MOEC_OPS_TORCH_CSRC_GROUPFABRIC_H
