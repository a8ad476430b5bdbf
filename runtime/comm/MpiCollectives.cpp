//===- MpiCollectives.cpp - The MPI fabric's collectives and its stop -----===//
//
// See Mpi.h: the bounded exchange, barrier, gather and finish of the MPI
// fabric (MpiFabric.h), and stopJob, the protocol that gathers every rank's
// report on rank 0 before the job ends.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/MpiFabric.h"

namespace moec::comm::detail {

Status MpiFabric::exchange(const void *mine, size_t bytes, void *all, double timeoutSeconds) {
  std::lock_guard<std::mutex> lock(exchangeMutex);
  if (Status s = usable(); !s)
    return s;
  // The sequence advances even for a refused exchange, so that every rank
  // keeps counting the same exchanges.
  const uint64_t seq = ++sequence;
  if (bytes > kExchangePayload)
    return Status::error(fmt::format("mpi fabric: an exchange of {} bytes per rank; at most {} fit",
                                     bytes, kExchangePayload));
  const size_t block = kExchangeHeader + bytes;
  // The message lives as long as the fabric when the exchange times out.
  auto message = std::make_unique<std::vector<char>>(block);
  std::memcpy(message->data(), &seq, 8);
  const uint64_t bytes64 = bytes;
  std::memcpy(message->data() + 8, &bytes64, 8);
  if (bytes)
    std::memcpy(message->data() + kExchangeHeader, mine, bytes);
  if (bytes)
    std::memcpy(static_cast<char *>(all) + size_t(me) * bytes, mine, bytes);
  // Room for a larger block than ours, to tell a peer that sent one.
  const size_t room = kExchangeHeader + kExchangePayload;
  std::vector<std::vector<char>> inbound(count);
  std::vector<MPI_Request> receives(count, MPI_REQUEST_NULL), sends(count, MPI_REQUEST_NULL);
  for (uint32_t p = 0; p < count; ++p) {
    if (p == me)
      continue;
    inbound[p].resize(room);
    MOEC_MPI(
        MPI_Irecv(inbound[p].data(), int(room), MPI_BYTE, int(p), kTagExchange, comm, &receives[p]),
        "exchange: MPI_Irecv");
    MOEC_MPI(
        MPI_Isend(message->data(), int(block), MPI_BYTE, int(p), kTagExchange, comm, &sends[p]),
        "exchange: MPI_Isend");
  }
  std::vector<int> got(count, 0);
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    uint32_t missing = 0;
    bool progressed = false;
    for (uint32_t p = 0; p < count; ++p) {
      if (p == me || receives[p] == MPI_REQUEST_NULL)
        continue;
      int done = 0;
      MPI_Status status;
      MOEC_MPI(MPI_Test(&receives[p], &done, &status), "exchange: MPI_Test");
      if (!done) {
        ++missing;
        continue;
      }
      MPI_Get_count(&status, MPI_BYTE, &got[p]);
      progressed = true;
    }
    int sendsDone = 0;
    MOEC_MPI(MPI_Testall(int(count), sends.data(), &sendsDone, MPI_STATUSES_IGNORE),
             "exchange: MPI_Testall");
    if (missing == 0 && sendsDone)
      break;
    if (timeoutSeconds > 0 && secondsSince(start) > timeoutSeconds) {
      std::vector<uint32_t> absent;
      for (uint32_t p = 0; p < count; ++p)
        if (receives[p] != MPI_REQUEST_NULL) {
          absent.push_back(p);
          MPI_Cancel(&receives[p]);
          MPI_Wait(&receives[p], MPI_STATUS_IGNORE);
        }
      // A peer that reached the end of its job ran fewer passes.
      std::vector<uint32_t> ended;
      for (uint32_t p : absent) {
        int flag = 0;
        MPI_Iprobe(int(p), kTagFinish, comm, &flag, MPI_STATUS_IGNORE);
        if (flag)
          ended.push_back(p);
      }
      // Every block came in, but a peer took no block of ours: it stopped
      // after sending (a rendezvous send waits for the receiver).
      std::vector<uint32_t> stuck;
      if (absent.empty())
        for (uint32_t p = 0; p < count; ++p) {
          int done = 1;
          if (sends[p] != MPI_REQUEST_NULL)
            MPI_Test(&sends[p], &done, MPI_STATUS_IGNORE);
          if (!done)
            stuck.push_back(p);
        }
      std::lock_guard<std::mutex> lock(progressMutex);
      abandoned.push_back(std::move(*message));
      if (absent.empty() && stuck.empty())
        return breakDown(fmt::format("rank {}: the exchange's blocks did not leave within {:.3g} s",
                                     me, timeoutSeconds));
      if (absent.empty())
        return breakDown(fmt::format(
            "rank {}: the exchange's block to rank{} {} did not leave within {:.3g} s (rank{} "
            "{} stopped taking messages: it died, hangs, or its link is down)",
            me, stuck.size() == 1 ? "" : "s", fmt::join(stuck, ", "), timeoutSeconds,
            stuck.size() == 1 ? "" : "s", fmt::join(stuck, ", ")));
      return breakDown(fmt::format(
          "rank {}: rank{} {} did not reach the exchange within {:.3g} s ({})", me,
          absent.size() == 1 ? "" : "s", fmt::join(absent, ", "), timeoutSeconds,
          ended.empty() ? "a rank that stopped, never submitted the pass, runs another "
                          "program, cannot be reached, or is still starting: making a layer "
                          "starts its worker threads, which with thousands of them or on a "
                          "loaded machine takes a while (a longer --timeout / timeout_seconds "
                          "waits for it)"
                        : fmt::format("rank{} {} reached the end of the job: it ran fewer "
                                      "passes than this rank",
                                      ended.size() == 1 ? "" : "s", fmt::join(ended, ", "))));
    }
    // Peers that are through their exchange may already put rows here.
    // A peer that stopped once every block is here stopped after this
    // exchange: what the blocks say (an error every rank finds) comes
    // first.
    if (Status s = progress(/*wait=*/false); !s && !(missing == 0 && onlyStopped()))
      return s;
    if (progressed)
      backoff.reset();
    backoff.pause();
  }
  for (uint32_t p = 0; p < count; ++p) {
    if (p == me)
      continue;
    uint64_t theirSeq = 0, theirs = 0;
    if (got[p] >= int(kExchangeHeader)) {
      std::memcpy(&theirSeq, inbound[p].data(), 8);
      std::memcpy(&theirs, inbound[p].data() + 8, 8);
    }
    if (theirSeq != seq || theirs != bytes || size_t(got[p]) != kExchangeHeader + theirs)
      return Status::error(fmt::format("rank {}: rank {} contributed {} bytes to exchange {}, "
                                       "this rank {} bytes to exchange {} (the ranks run "
                                       "different programs)",
                                       me, p, theirs, theirSeq, bytes, seq));
    if (bytes)
      std::memcpy(static_cast<char *>(all) + size_t(p) * bytes, inbound[p].data() + kExchangeHeader,
                  bytes);
  }
  return Status::success();
}

Status MpiFabric::barrier(double timeoutSeconds) {
  // Every put to a node peer is a completed store; those to other nodes
  // have left. Tell each peer how many it gets, then wait for ours.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  std::vector<uint64_t> mine(count), all(size_t(count) * count);
  for (uint32_t p = 0; p < count; ++p)
    mine[p] = sent[p].load();
  if (Status s = exchange(mine.data(), mine.size() * 8, all.data(), timeoutSeconds); !s)
    return s;
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    if (Status s = progress(); !s)
      return s;
    uint32_t late = count;
    uint64_t lateLanded = 0;
    {
      std::lock_guard<std::mutex> lock(progressMutex);
      for (uint32_t p = 0; p < count && late == count; ++p)
        if (landed[p] < all[size_t(p) * count + me]) {
          late = p;
          lateLanded = landed[p];
        }
    }
    if (late == count)
      break;
    if (timeoutSeconds > 0 && secondsSince(start) > timeoutSeconds)
      return breakDown(
          fmt::format("rank {}: {} of the {} puts rank {} made here landed within {:.3g} s", me,
                      lateLanded, all[size_t(late) * count + me], late, timeoutSeconds));
    backoff.pause();
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return Status::success();
}

/// Two-sided messages to rank 0, in pieces of at most 1 GiB, each wait
/// bounded by the fabric's timeout.
Status MpiFabric::gather(const void *mine, size_t bytes, void *all) {
  if (Status s = usable(); !s)
    return s;
  if (me == 0 && bytes)
    std::memcpy(all, mine, bytes);
  std::vector<MPI_Request> requests;
  for (size_t done = 0; done < bytes; done += kMessageBytes) {
    const int n = int(std::min(kMessageBytes, bytes - done));
    if (me == 0) {
      for (uint32_t p = 1; p < count; ++p) {
        requests.emplace_back(MPI_REQUEST_NULL);
        MOEC_MPI(MPI_Irecv(static_cast<char *>(all) + size_t(p) * bytes + done, n, MPI_BYTE, int(p),
                           kTagGather, comm, &requests.back()),
                 "gather: MPI_Irecv");
      }
    } else {
      requests.emplace_back(MPI_REQUEST_NULL);
      MOEC_MPI(MPI_Isend(static_cast<const char *>(mine) + done, n, MPI_BYTE, 0, kTagGather, comm,
                         &requests.back()),
               "gather: MPI_Isend");
    }
  }
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    int done = 0;
    MOEC_MPI(MPI_Testall(int(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE),
             "gather: MPI_Testall");
    if (done)
      return Status::success();
    if (options.timeoutSeconds > 0 && secondsSince(start) > options.timeoutSeconds) {
      if (me != 0)
        return breakDown(fmt::format("rank {}: gathering on rank 0: {} bytes to rank 0 did "
                                     "not leave within {:.3g} s (rank 0 stopped, or cannot be "
                                     "reached)",
                                     me, bytes, options.timeoutSeconds));
      std::vector<uint32_t> late;
      for (size_t i = 0; i < requests.size(); ++i)
        if (requests[i] != MPI_REQUEST_NULL) {
          const uint32_t p = uint32_t(i % (count - 1)) + 1;
          if (std::find(late.begin(), late.end(), p) == late.end())
            late.push_back(p);
        }
      return breakDown(fmt::format("rank 0: gathering {} bytes per rank: the bytes from "
                                   "rank{} {} did not arrive within {:.3g} s (a rank that "
                                   "stopped, or cannot be reached)",
                                   bytes, late.size() == 1 ? "" : "s", fmt::join(late, ", "),
                                   options.timeoutSeconds));
    }
    backoff.pause();
  }
}

/// An empty message to every peer on its own tag, and theirs received,
/// bounded, driving progress meanwhile (a peer's stop ends it at once).
Status MpiFabric::finish(double timeoutSeconds) {
  if (Status s = usable(); !s)
    return s;
  std::vector<MPI_Request> receives(count, MPI_REQUEST_NULL), sends(count, MPI_REQUEST_NULL);
  for (uint32_t p = 0; p < count; ++p) {
    if (p == me)
      continue;
    MOEC_MPI(MPI_Irecv(nullptr, 0, MPI_BYTE, int(p), kTagFinish, comm, &receives[p]),
             "finish: MPI_Irecv");
    MOEC_MPI(MPI_Isend(nullptr, 0, MPI_BYTE, int(p), kTagFinish, comm, &sends[p]),
             "finish: MPI_Isend");
  }
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    int received = 0, left = 0;
    MOEC_MPI(MPI_Testall(int(count), receives.data(), &received, MPI_STATUSES_IGNORE),
             "finish: MPI_Testall");
    MOEC_MPI(MPI_Testall(int(count), sends.data(), &left, MPI_STATUSES_IGNORE),
             "finish: MPI_Testall");
    if (received && left)
      return Status::success();
    if (Status s = progress(/*wait=*/false); !s)
      return s;
    if (timeoutSeconds > 0 && secondsSince(start) > timeoutSeconds) {
      std::vector<uint32_t> absent;
      for (uint32_t p = 0; p < count; ++p)
        if (receives[p] != MPI_REQUEST_NULL)
          absent.push_back(p);
      return breakDown(fmt::format(
          "rank {}: rank{} {} did not reach the end of the job within {:.3g} s (a rank that "
          "runs more passes, stopped, or cannot be reached)",
          me, absent.size() == 1 ? "" : "s", fmt::join(absent, ", "), timeoutSeconds));
    }
    backoff.pause();
  }
}

std::string MpiFabric::stopJob(const std::string &report, double seconds) {
  std::unique_lock<std::mutex> lock(progressMutex);
  // The stop carries the report's first clause; the whole report goes to
  // rank 0.
  std::string reason = report.substr(0, std::min(report.find("; "), report.find(". ")));
  if (reason.size() > 300)
    reason = reason.substr(0, 300) + "...";
  // Tell every peer, and give rank 0 this rank's report. The sends are
  // not waited for beyond `seconds` (a dead peer never takes them).
  std::vector<MPI_Request> requests;
  const auto send = [&](uint32_t peer, ControlKind kind, const std::string &text) {
    const size_t bytes = std::min(text.size(), kInlineBytes);
    abandoned.emplace_back(sizeof(Control) + bytes);
    std::vector<char> &message = abandoned.back();
    const Control header{kind, 0, 0, 0, 0, 0, -1};
    std::memcpy(message.data(), &header, sizeof header);
    std::memcpy(message.data() + sizeof header, text.data(), bytes);
    requests.emplace_back(MPI_REQUEST_NULL);
    if (MPI_Isend(message.data(), int(message.size()), MPI_BYTE, int(peer), kTagControl, comm,
                  &requests.back()) != MPI_SUCCESS)
      requests.back() = MPI_REQUEST_NULL;
  };
  for (uint32_t p = 0; p < count; ++p)
    if (p != me)
      send(p, ControlKind::Stop, reason);
  if (me != 0)
    send(0, ControlKind::Report, report);
  reports[me] = report;
  reported[me] = true;
  const auto allIn = [&] {
    return me == 0 ? std::all_of(reported.begin(), reported.end(), [](bool b) { return b; })
                   : reportTaken;
  };
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  while (!allIn() && secondsSince(start) < seconds) {
    if (!drain())
      break;
    lock.unlock();
    backoff.pause();
    lock.lock();
  }
  if (broken.empty())
    broken = "the job stopped";
  if (me != 0)
    return reportTaken ? std::string()
                       : fmt::format("rank 0 did not take the report of rank {} within {:.3g} "
                                     "s (rank 0 died, is still busy or starting, or cannot be "
                                     "reached)\n",
                                     me, seconds);
  std::string out = fmt::format("report of the {} ranks, gathered on rank 0:\n", count);
  requests.clear();
  for (uint32_t p = 0; p < count; ++p) {
    if (reported[p]) {
      out += fmt::format("  [rank {}] {}\n", p, reports[p]);
      if (p != me)
        send(p, ControlKind::ReportTaken, std::string());
    } else {
      out += fmt::format("  [rank {}] no report within {:.3g} s (it died, waits outside moec, "
                         "is still starting, or cannot be reached)\n",
                         p, seconds);
    }
  }
  // The word that the reports were taken, so that the peers print nothing
  // of their own; bounded (a peer may be gone meanwhile).
  const Clock::time_point sentAt = Clock::now();
  int done = 0;
  while (!done && secondsSince(sentAt) < 1) {
    if (MPI_Testall(int(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE) !=
        MPI_SUCCESS)
      break;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return out;
}

} // namespace moec::comm::detail
