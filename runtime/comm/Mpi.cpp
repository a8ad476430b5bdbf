//===- Mpi.cpp - The fabric of ranks that are MPI processes ----------------===//
//
// See Mpi.h for the protocol. Every MPI call reports through MPI_ERRORS_RETURN
// on the fabric's communicators and windows, so a failure is a Status with
// MPI's message, not an abort.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/Mpi.h"

#include "base/Env.h"
#include "base/Time.h"
#include "runtime/comm/Hooks.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace moec::comm {

namespace {

bool initializedByUs = false;

std::string mpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return fmt::format("MPI error {}", code);
  return std::string(text, size_t(length));
}

#define MOEC_MPI(call, what)                                                                    \
  do {                                                                                          \
    if (int rc_ = (call); rc_ != MPI_SUCCESS)                                                   \
      return Status::error(fmt::format("mpi fabric: {}: {}", what, mpiError(rc_)));             \
  } while (0)

/// Sleeps a little longer each time nothing happened, up to 50 us.
class Backoff {
public:
  void reset() { spins = 0; }
  void pause() {
    if (++spins < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(std::min<uint32_t>(spins - 63, 50)));
  }

private:
  uint32_t spins = 0;
};

// Tags on the fabric's communicator: control messages (put headers,
// signals), exchange blocks, and from kTagFirstData on, one tag per put's rows.
constexpr int kTagControl = 1;
constexpr int kTagExchange = 2;
constexpr int kTagGather = 3;
constexpr int kTagFinish = 4;
constexpr int kTagFirstData = 16;

/// Rows up to this size travel inside their put's header message.
constexpr size_t kInlineBytes = 16 * 1024;
/// The most bytes one message of rows carries (MPI counts are ints).
constexpr size_t kMessageBytes = size_t(1) << 30;
/// Control receives kept posted.
constexpr size_t kControlRing = 8;

/// Control messages: a put's header, a signal, and the messages that stop a
/// failed job (stopJob): the stop with its reason, a rank's report to rank 0,
/// and rank 0's word that it took the report.
enum class ControlKind : uint32_t { Put = 1, Signal = 2, Stop = 3, Report = 4, ReportTaken = 5 };

/// A control message; a put's inline rows, or a stop's or a report's text,
/// follow it.
struct Control {
  ControlKind kind;
  uint32_t object; ///< the window (put) or inbox (signal), by creation order
  uint64_t offset; ///< put: byte offset in the window; signal: the event
  uint64_t stride; ///< put: bytes between rows in the window; signal: the delta
  uint64_t rows;
  uint64_t rowBytes;
  int32_t tag; ///< put: the tag of its rows' message, or -1 when inline
  uint32_t unused = 0;
};
constexpr size_t kControlBytes = sizeof(Control) + kInlineBytes;

/// An hvector of `rows` blocks of `rowBytes` bytes, `stride` apart, or
/// MPI_BYTE (with *count the byte count) when the rows are contiguous.
Status rowType(size_t rows, size_t rowBytes, size_t stride, MPI_Datatype *type, int *count) {
  if (rowBytes == stride || rows == 1) {
    *type = MPI_BYTE;
    *count = int(rows * rowBytes);
    return Status::success();
  }
  MOEC_MPI(MPI_Type_create_hvector(int(rows), int(rowBytes), MPI_Aint(stride), MPI_BYTE, type),
           "MPI_Type_create_hvector");
  MOEC_MPI(MPI_Type_commit(type), "MPI_Type_commit");
  *count = 1;
  return Status::success();
}

void freeType(MPI_Datatype *type) {
  if (*type != MPI_BYTE && *type != MPI_DATATYPE_NULL)
    MPI_Type_free(type);
}

class MpiFabric;

/// Memory every rank of the group has `bytes` of, allocated over the ranks
/// of each node (MPI_Win_allocate_shared), so that node peers map it.
struct SharedMemory {
  MPI_Win win = MPI_WIN_NULL;
  char *base = nullptr;
  size_t size = 0;
  std::vector<char *> peer; ///< [rank]: its memory when it shares this node, else null

  Status create(MpiFabric &fabric, size_t bytes);
  void destroy() {
    if (win != MPI_WIN_NULL)
      MPI_Win_free(&win);
    win = MPI_WIN_NULL;
  }
};

class MpiWindow final : public Window {
public:
  MpiWindow(MpiFabric &fabric, uint32_t id) : owner(fabric), id(id) {}
  ~MpiWindow() override;
  void *local(uint32_t) const override { return memory.base; }
  size_t bytes() const override { return memory.size; }

  MpiFabric &owner;
  uint32_t id;
  SharedMemory memory;
};

class MpiInbox final : public Inbox {
public:
  MpiInbox(MpiFabric &fabric, uint32_t id, uint32_t events)
      : owner(fabric), id(id), count(events) {}
  ~MpiInbox() override;
  uint32_t events() const override { return count; }
  Status signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) override;
  Status read(uint32_t rank, uint64_t *values) override;
  void reset() override {
    uint64_t *counters = this->counters();
    for (size_t e = 0; e < counterCount(); ++e)
      __atomic_store_n(&counters[e], 0, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  uint64_t signalledBy(uint32_t rank, uint32_t peer, uint32_t event) const override;
  uint64_t lastSignaller(uint32_t rank, uint32_t event) const override;
  /// The counters of this rank: events() sums that the executor reads, the
  /// latest signaller of each (rank << 32 | task, for traces), then what
  /// each rank added to them ([ranks][events()], for reports).
  uint64_t *counters() const { return reinterpret_cast<uint64_t *>(memory.base); }
  size_t counterCount() const;
  size_t lastIndex(uint32_t event) const { return size_t(count) + event; }
  size_t peerIndex(uint32_t peer, uint32_t event) const {
    return size_t(count) * (2 + peer) + event;
  }
  static uint64_t signaller(uint32_t rank, uint32_t task) { return uint64_t(rank) << 32 | task; }

  MpiFabric &owner;
  uint32_t id;
  uint32_t count;
  SharedMemory memory;
};

class MpiFabric final : public Fabric {
public:
  /// Bytes one rank may contribute to an exchange.
  static constexpr size_t kExchangePayload = 64 * 1024;
  static constexpr size_t kExchangeHeader = 16; ///< sequence number, byte count

  ~MpiFabric() override {
    arrivals.destroy();
    for (ControlReceive &receive : ring)
      if (receive.request != MPI_REQUEST_NULL) {
        MPI_Cancel(&receive.request);
        MPI_Wait(&receive.request, MPI_STATUS_IGNORE);
      }
    if (nodeComm != MPI_COMM_NULL)
      MPI_Comm_free(&nodeComm);
    if (comm != MPI_COMM_NULL)
      MPI_Comm_free(&comm);
  }

  Status init(const MpiOptions &opts) {
    options = opts;
    MOEC_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    int size = 0, rank = 0;
    MOEC_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    MOEC_MPI(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    count = uint32_t(size);
    me = uint32_t(rank);
    if (options.noSharedMemory)
      MOEC_MPI(MPI_Comm_split(comm, rank, 0, &nodeComm), "MPI_Comm_split");
    else
      MOEC_MPI(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &nodeComm),
               "MPI_Comm_split_type");
    MPI_Comm_set_errhandler(nodeComm, MPI_ERRORS_RETURN);
    // Which world ranks share this node, and their rank on it.
    MPI_Group world = MPI_GROUP_NULL, node = MPI_GROUP_NULL;
    MPI_Comm_group(comm, &world);
    MPI_Comm_group(nodeComm, &node);
    std::vector<int> ranksOfWorld(count), onNode(count);
    for (uint32_t p = 0; p < count; ++p)
      ranksOfWorld[p] = int(p);
    int rc = MPI_Group_translate_ranks(world, int(count), ranksOfWorld.data(), node,
                                      onNode.data());
    MPI_Group_free(&world);
    MPI_Group_free(&node);
    MOEC_MPI(rc, "MPI_Group_translate_ranks");
    nodeRank.assign(count, -1);
    for (uint32_t p = 0; p < count; ++p)
      nodeRank[p] = onNode[p] == MPI_UNDEFINED ? -1 : onNode[p];
    int *tagUb = nullptr, flag = 0;
    MOEC_MPI(MPI_Comm_get_attr(comm, MPI_TAG_UB, &tagUb, &flag), "MPI_Comm_get_attr(MPI_TAG_UB)");
    dataTags = uint32_t((flag && tagUb ? *tagUb : 32767) - kTagFirstData);
    sent = std::vector<std::atomic<uint64_t>>(count);
    sentBytes = std::vector<std::atomic<uint64_t>>(count);
    landed.assign(count, 0);
    pending.resize(count);
    reports.assign(count, std::string());
    reported.assign(count, false);
    for (ControlReceive &receive : ring) {
      receive.buffer.resize(kControlBytes);
      if (Status s = post(receive); !s)
        return s;
    }
    // Bytes that arrived from each rank: node peers add to it after their
    // stores, progress() when a peer's rows land.
    return arrivals.create(*this, size_t(count) * sizeof(uint64_t));
  }

  const char *name() const override { return "mpi"; }
  uint32_t ranks() const override { return count; }
  uint32_t firstLocal() const override { return me; }
  uint32_t localRanks() const override { return 1; }

  /// True when `peer` shares this process's memory (a store reaches it).
  bool sharesMemory(uint32_t peer) const { return nodeRank[peer] >= 0; }

  Status createWindow(size_t bytes, std::unique_ptr<Window> *out) override {
    if (Status s = usable(); !s)
      return s;
    std::unique_ptr<MpiWindow> window;
    {
      std::lock_guard<std::mutex> lock(progressMutex);
      window = std::make_unique<MpiWindow>(*this, uint32_t(windows.size()));
      windows.push_back(nullptr); // what arrives for it before it exists is an error
    }
    if (Status s = window->memory.create(*this, bytes); !s)
      return s;
    std::lock_guard<std::mutex> lock(progressMutex);
    windows[window->id] = window.get();
    *out = std::move(window);
    return Status::success();
  }

  Status createInbox(uint32_t events, std::unique_ptr<Inbox> *out) override {
    if (Status s = usable(); !s)
      return s;
    std::unique_ptr<MpiInbox> inbox;
    {
      std::lock_guard<std::mutex> lock(progressMutex);
      inbox = std::make_unique<MpiInbox>(*this, uint32_t(inboxes.size()), events);
      inboxes.push_back(nullptr);
    }
    if (Status s = inbox->memory.create(*this, inbox->counterCount() * sizeof(uint64_t)); !s)
      return s;
    std::lock_guard<std::mutex> lock(progressMutex);
    inboxes[inbox->id] = inbox.get();
    *out = std::move(inbox);
    return Status::success();
  }

  void forgetWindow(uint32_t id) {
    std::lock_guard<std::mutex> lock(progressMutex);
    windows[id] = nullptr;
  }
  void forgetInbox(uint32_t id) {
    std::lock_guard<std::mutex> lock(progressMutex);
    inboxes[id] = nullptr;
  }

  Status put(const Window &window, uint32_t peer, size_t offset, size_t dstStride,
             const void *src, size_t srcStride, size_t rows, size_t rowBytes) override {
    if (rows == 0 || rowBytes == 0)
      return Status::success();
    const auto &shared = static_cast<const MpiWindow &>(window);
    const char *from = static_cast<const char *>(src);
    if (peer == me || options.localPuts) {
      copyRows(shared.memory.base + offset, dstStride, from, srcStride, rows, rowBytes);
      return Status::success();
    }
    if (drop.dropsPut(me, peer, putsToPeers))
      return Status::success();
    sentBytes[peer].fetch_add(rows * rowBytes);
    if (sharesMemory(peer)) {
      copyRows(shared.memory.peer[peer] + offset, dstStride, from, srcStride, rows, rowBytes);
      // For reports only: the signal after it orders the rows.
      __atomic_fetch_add(&reinterpret_cast<uint64_t *>(arrivals.peer[peer])[me], rows * rowBytes,
                         __ATOMIC_RELAXED);
      return Status::success();
    }
    if (rowBytes > kMessageBytes)
      return Status::error("mpi fabric: a put of rows longer than 1 GiB");
    // Messages of at most 1 GiB each.
    const size_t batch = std::max<size_t>(1, kMessageBytes / rowBytes);
    for (size_t first = 0; first < rows; first += batch) {
      const size_t n = std::min(batch, rows - first);
      if (Status s = sendRows(shared.id, peer, offset + first * dstStride, dstStride,
                              from + first * srcStride, srcStride, n, rowBytes);
          !s)
        return s;
    }
    return Status::success();
  }

  /// Sends one put's header and rows to `peer` on another node, and waits
  /// until they have left this process.
  Status sendRows(uint32_t window, uint32_t peer, size_t offset, size_t dstStride,
                  const char *src, size_t srcStride, size_t rows, size_t rowBytes) {
    const size_t bytes = rows * rowBytes;
    std::vector<char> message(sizeof(Control) + (bytes <= kInlineBytes ? bytes : 0));
    Control header{ControlKind::Put, window, offset, dstStride, rows, rowBytes, -1};
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    MPI_Datatype type = MPI_BYTE;
    int typeCount = 0;
    if (bytes <= kInlineBytes) {
      copyRows(message.data() + sizeof(Control), rowBytes, src, srcStride, rows, rowBytes);
    } else {
      header.tag = int32_t(kTagFirstData + nextTag.fetch_add(1) % dataTags);
      if (Status s = rowType(rows, rowBytes, srcStride, &type, &typeCount); !s)
        return s;
    }
    std::memcpy(message.data(), &header, sizeof header);
    int rc = MPI_Isend(message.data(), int(message.size()), MPI_BYTE, int(peer), kTagControl,
                       comm, &requests[0]);
    if (rc == MPI_SUCCESS && header.tag >= 0)
      rc = MPI_Isend(src, typeCount, type, int(peer), header.tag, comm, &requests[1]);
    freeType(&type);
    MOEC_MPI(rc, fmt::format("a put of {} bytes to rank {}: MPI_Isend", bytes, peer));
    if (Status s = waitSent(requests, 2, std::move(message), peer, "a put"); !s)
      return s;
    sent[peer].fetch_add(1);
    return Status::success();
  }

  /// Sends a signal to `peer` on another node.
  Status sendSignal(uint32_t inbox, uint32_t peer, uint32_t event, uint64_t delta,
                    uint32_t task) {
    std::vector<char> message(sizeof(Control));
    const Control header{ControlKind::Signal, inbox, event, delta, task, 0, -1};
    std::memcpy(message.data(), &header, sizeof header);
    MPI_Request request = MPI_REQUEST_NULL;
    MOEC_MPI(MPI_Isend(message.data(), int(message.size()), MPI_BYTE, int(peer), kTagControl, comm,
                       &request),
             fmt::format("a signal to rank {}: MPI_Isend", peer));
    return waitSent(&request, 1, std::move(message), peer, "a signal");
  }

  /// Waits, bounded, for sends to leave this process, driving progress
  /// meanwhile. On a timeout the sends stay posted and the message is kept
  /// alive; the fabric is then unusable.
  Status waitSent(MPI_Request *requests, int n, std::vector<char> message, uint32_t peer,
                  const char *what) {
    const Clock::time_point start = Clock::now();
    Backoff backoff;
    for (;;) {
      int done = 0;
      MOEC_MPI(MPI_Testall(n, requests, &done, MPI_STATUSES_IGNORE),
               fmt::format("{} to rank {}: MPI_Testall", what, peer));
      if (done)
        return Status::success();
      if (options.timeoutSeconds > 0 && secondsSince(start) > options.timeoutSeconds) {
        std::lock_guard<std::mutex> lock(progressMutex);
        abandoned.push_back(std::move(message));
        return breakDown(fmt::format(
            "rank {}: {} to rank {} did not leave within {:.3g} s (rank {} stopped taking "
            "messages: it died, hangs, or its link is down)",
            me, what, peer, options.timeoutSeconds, peer));
      }
      if (Status s = progress(/*wait=*/false); !s)
        return s;
      backoff.pause();
    }
  }

  /// Handles what peers on other nodes sent: control messages, rows that
  /// landed, signals whose rows are all in. With `wait` false, returns at
  /// once when another thread is at it.
  Status progress(bool wait = true) {
    std::unique_lock<std::mutex> lock(progressMutex, std::defer_lock);
    if (wait)
      lock.lock();
    else if (!lock.try_lock())
      return Status::success();
    if (!broken.empty())
      return Status::error(broken);
    if (Status s = drain(); !s)
      return s;
    if (!stopped.empty())
      return Status::error(stopped);
    return Status::success();
  }

  /// progress() under progressMutex, whatever stopped or broke the fabric.
  Status drain() {
    for (;;) {
      ControlReceive &receive = ring[ringHead];
      int done = 0;
      MPI_Status status;
      MOEC_MPI(MPI_Test(&receive.request, &done, &status), "progress: MPI_Test");
      if (!done)
        break;
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      if (Status s = handle(uint32_t(status.MPI_SOURCE), receive.buffer.data(), size_t(bytes)); !s)
        return breakDown(s.message());
      if (Status s = post(receive); !s)
        return s;
      ringHead = (ringHead + 1) % kControlRing;
    }
    for (uint32_t p = 0; p < count; ++p) {
      std::deque<Pending> &queue = pending[p];
      while (!queue.empty()) {
        Pending &front = queue.front();
        if (front.request != MPI_REQUEST_NULL) {
          int done = 0;
          MOEC_MPI(MPI_Test(&front.request, &done, MPI_STATUS_IGNORE),
                   fmt::format("rows from rank {}: MPI_Test", p));
          if (!done)
            break;
          ++landed[p];
          arrived(p, front.control.rows * front.control.rowBytes);
        } else {
          applySignal(p, front.control);
        }
        queue.pop_front();
      }
    }
    return Status::success();
  }

  Status exchange(const void *mine, size_t bytes, void *all, double timeoutSeconds) override {
    std::lock_guard<std::mutex> lock(exchangeMutex);
    if (Status s = usable(); !s)
      return s;
    // The sequence advances even for a refused exchange, so that every rank
    // keeps counting the same exchanges.
    const uint64_t seq = ++sequence;
    if (bytes > kExchangePayload)
      return Status::error(fmt::format(
          "mpi fabric: an exchange of {} bytes per rank; at most {} fit", bytes, kExchangePayload));
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
      MOEC_MPI(MPI_Irecv(inbound[p].data(), int(room), MPI_BYTE, int(p), kTagExchange, comm,
                         &receives[p]),
               "exchange: MPI_Irecv");
      MOEC_MPI(MPI_Isend(message->data(), int(block), MPI_BYTE, int(p), kTagExchange, comm,
                         &sends[p]),
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
          return breakDown(fmt::format(
              "rank {}: the exchange's blocks did not leave within {:.3g} s", me, timeoutSeconds));
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
        std::memcpy(static_cast<char *>(all) + size_t(p) * bytes,
                    inbound[p].data() + kExchangeHeader, bytes);
    }
    return Status::success();
  }

  Status barrier(double timeoutSeconds) override {
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
        return breakDown(fmt::format(
            "rank {}: {} of the {} puts rank {} made here landed within {:.3g} s", me,
            lateLanded, all[size_t(late) * count + me], late, timeoutSeconds));
      backoff.pause();
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return Status::success();
  }

  /// Two-sided messages to rank 0, in pieces of at most 1 GiB, each wait
  /// bounded by the fabric's timeout.
  Status gather(const void *mine, size_t bytes, void *all) override {
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
          MOEC_MPI(MPI_Irecv(static_cast<char *>(all) + size_t(p) * bytes + done, n, MPI_BYTE,
                             int(p), kTagGather, comm, &requests.back()),
                   "gather: MPI_Irecv");
        }
      } else {
        requests.emplace_back(MPI_REQUEST_NULL);
        MOEC_MPI(MPI_Isend(static_cast<const char *>(mine) + done, n, MPI_BYTE, 0, kTagGather,
                           comm, &requests.back()),
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

  Traffic traffic(uint32_t peer) const override {
    if (peer >= count)
      return {};
    return Traffic{sentBytes[peer].load(),
                   __atomic_load_n(&reinterpret_cast<const uint64_t *>(arrivals.base)[peer],
                                   __ATOMIC_ACQUIRE)};
  }

  /// An empty message to every peer on its own tag, and theirs received,
  /// bounded, driving progress meanwhile (a peer's stop ends it at once).
  Status finish(double timeoutSeconds) override {
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

  std::string stopJob(const std::string &report, double seconds) override {
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

  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm nodeComm = MPI_COMM_NULL;
  uint32_t count = 1, me = 0;
  std::vector<int> nodeRank; ///< [rank]: its rank on this node's communicator, or -1
  MpiOptions options;
  DropPut drop;
  SharedMemory arrivals; ///< [rank]: bytes of its rows that landed here

private:
  struct ControlReceive {
    std::vector<char> buffer;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  /// What arrived from one peer and waits for earlier rows: the receive of
  /// a put's rows, or a signal (request null).
  struct Pending {
    MPI_Request request = MPI_REQUEST_NULL;
    Control control{};
  };

  Status post(ControlReceive &receive) {
    MOEC_MPI(MPI_Irecv(receive.buffer.data(), int(receive.buffer.size()), MPI_BYTE,
                       MPI_ANY_SOURCE, kTagControl, comm, &receive.request),
             "MPI_Irecv of control messages");
    return Status::success();
  }

  /// A control message from `peer` (under progressMutex).
  Status handle(uint32_t peer, const char *message, size_t bytes) {
    Control control;
    if (bytes < sizeof control)
      return Status::error(fmt::format("rank {}: a control message of {} bytes from rank {}", me,
                                       bytes, peer));
    std::memcpy(&control, message, sizeof control);
    // The text a stop or a report carries.
    const auto text = [&] { return std::string(message + sizeof control, bytes - sizeof control); };
    switch (control.kind) {
    case ControlKind::Stop:
      if (stopped.empty())
        stopped = fmt::format("rank {} stopped the job: {}", peer, text());
      return Status::success();
    case ControlKind::Report:
      reports[peer] = text();
      reported[peer] = true;
      return Status::success();
    case ControlKind::ReportTaken:
      reportTaken = true;
      return Status::success();
    default:
      break;
    }
    if (control.kind == ControlKind::Signal) {
      if (control.object >= inboxes.size() || !inboxes[control.object] ||
          control.offset >= inboxes[control.object]->count)
        return Status::error(fmt::format("rank {}: rank {} signalled event {} of inbox {}, which "
                                         "this rank does not have (the ranks run different "
                                         "programs)",
                                         me, peer, control.offset, control.object));
      if (pending[peer].empty())
        applySignal(peer, control);
      else
        pending[peer].push_back(Pending{MPI_REQUEST_NULL, control});
      return Status::success();
    }
    if (control.kind != ControlKind::Put || control.object >= windows.size() ||
        !windows[control.object])
      return Status::error(fmt::format("rank {}: a control message from rank {} names no window "
                                       "of this rank (the ranks run different programs)",
                                       me, peer));
    const SharedMemory &memory = windows[control.object]->memory;
    const uint64_t rows = control.rows, rowBytes = control.rowBytes;
    if (rows == 0 || rowBytes == 0 || (rowBytes > control.stride && rows > 1) ||
        control.offset + (rows - 1) * control.stride + rowBytes > memory.size)
      return Status::error(fmt::format("rank {}: rank {} put {} rows of {} bytes at byte {} of a "
                                       "{}-byte window (the ranks run different programs)",
                                       me, peer, rows, rowBytes, control.offset, memory.size));
    char *dst = memory.base + control.offset;
    if (control.tag < 0) {
      if (bytes != sizeof control + rows * rowBytes)
        return Status::error(fmt::format("rank {}: a put from rank {} of {} bytes carries {}", me,
                                         peer, rows * rowBytes, bytes - sizeof control));
      copyRows(dst, control.stride, message + sizeof control, rowBytes, rows, rowBytes);
      ++landed[peer];
      arrived(peer, rows * rowBytes);
      return Status::success();
    }
    MPI_Datatype type = MPI_BYTE;
    int typeCount = 0;
    if (Status s = rowType(rows, rowBytes, control.stride, &type, &typeCount); !s)
      return s;
    Pending item;
    int rc = MPI_Irecv(dst, typeCount, type, int(peer), control.tag, comm, &item.request);
    freeType(&type);
    MOEC_MPI(rc, fmt::format("rows from rank {}: MPI_Irecv", peer));
    pending[peer].push_back(item);
    return Status::success();
  }

  void applySignal(uint32_t peer, const Control &control) {
    MpiInbox &inbox = *inboxes[control.object];
    const uint32_t event = uint32_t(control.offset);
    __atomic_fetch_add(&inbox.counters()[inbox.peerIndex(peer, event)], control.stride,
                       __ATOMIC_RELAXED);
    __atomic_store_n(&inbox.counters()[inbox.lastIndex(event)],
                     MpiInbox::signaller(peer, uint32_t(control.rows)) + 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&inbox.counters()[control.offset], control.stride, __ATOMIC_SEQ_CST);
  }

  /// Counts `bytes` of `peer`'s rows as landed here.
  void arrived(uint32_t peer, uint64_t bytes) {
    __atomic_fetch_add(&reinterpret_cast<uint64_t *>(arrivals.base)[peer], bytes,
                       __ATOMIC_RELAXED);
  }

  /// Makes every later call fail with `message` (a wait that gave up left
  /// messages in flight, or a peer sent what this rank cannot place).
  Status breakDown(std::string message) {
    if (broken.empty())
      broken = message;
    return Status::error(message);
  }
  /// True when a peer stopped the job and nothing else broke the fabric.
  bool onlyStopped() {
    std::lock_guard<std::mutex> lock(progressMutex);
    return broken.empty() && !stopped.empty();
  }
  Status usable() {
    std::lock_guard<std::mutex> lock(progressMutex);
    if (!broken.empty())
      return Status::error("mpi fabric: unusable after an earlier error: " + broken);
    if (!stopped.empty())
      return Status::error(stopped);
    return Status::success();
  }

  std::mutex exchangeMutex; ///< one exchange at a time
  uint64_t sequence = 0;

  std::mutex progressMutex; ///< guards everything below
  std::vector<MpiWindow *> windows; ///< by id; null once destroyed
  std::vector<MpiInbox *> inboxes;
  ControlReceive ring[kControlRing];
  size_t ringHead = 0;
  std::vector<std::deque<Pending>> pending; ///< [peer]
  std::vector<uint64_t> landed;             ///< [peer]: puts whose rows are here
  std::vector<std::vector<char>> abandoned; ///< messages of sends that timed out
  std::string broken;
  std::string stopped;               ///< set when a peer stopped the job
  std::vector<std::string> reports;  ///< [rank]: its report (rank 0, stopJob)
  std::vector<bool> reported;
  bool reportTaken = false;          ///< rank 0 took this rank's report

  std::vector<std::atomic<uint64_t>> sent; ///< [peer]: puts sent to it (other nodes)
  std::vector<std::atomic<uint64_t>> sentBytes; ///< [peer]: bytes put to it
  std::atomic<uint64_t> putsToPeers{0};
  std::atomic<uint32_t> nextTag{0};
  uint32_t dataTags = 1;
};

Status SharedMemory::create(MpiFabric &fabric, size_t bytes) {
  size = bytes;
  // MPI_Win_allocate_shared has no timeout: every rank meets first, bounded,
  // so that a rank whose peers do not come (an error on one rank between
  // two windows) gets an error instead of waiting in it. Two meetings: a
  // rank whose first one timed out never comes to the second (its fabric
  // is unusable), so a peer that came late fails there rather than
  // entering the collective alone (as in creating a fabric, below).
  for (const char *which : {"first", "second"})
    if (Status s = fabric.exchange(nullptr, 0, nullptr, fabric.options.timeoutSeconds); !s)
      return s.withPrefix(fmt::format("creating a window ({} meeting): ", which));
  MPI_Info info = MPI_INFO_NULL;
  MPI_Info_create(&info);
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  void *mine = nullptr;
  const int rc = MPI_Win_allocate_shared(MPI_Aint(std::max<size_t>(bytes, 8)), 1, info,
                                         fabric.nodeComm, &mine, &win);
  MPI_Info_free(&info);
  MOEC_MPI(rc, fmt::format("MPI_Win_allocate_shared of {} bytes", bytes));
  MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
  base = static_cast<char *>(mine);
  std::memset(base, 0, std::max<size_t>(bytes, 8));
  peer.assign(fabric.count, nullptr);
  for (uint32_t p = 0; p < fabric.count; ++p) {
    if (p == fabric.me || fabric.nodeRank[p] < 0)
      continue;
    MPI_Aint theirSize = 0;
    int unit = 0;
    void *theirs = nullptr;
    MOEC_MPI(MPI_Win_shared_query(win, fabric.nodeRank[p], &theirSize, &unit, &theirs),
             "MPI_Win_shared_query");
    peer[p] = static_cast<char *>(theirs);
  }
  // No peer may write before every rank has zeroed its memory (MPI does
  // not zero it, and a fast peer's first put would be wiped): a bounded
  // meeting of every rank.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (Status s = fabric.exchange(nullptr, 0, nullptr, fabric.options.timeoutSeconds); !s)
    return s.withPrefix("creating a window: ");
  return Status::success();
}

MpiWindow::~MpiWindow() {
  owner.forgetWindow(id);
  memory.destroy();
}

MpiInbox::~MpiInbox() {
  owner.forgetInbox(id);
  memory.destroy();
}

size_t MpiInbox::counterCount() const { return size_t(count) * (2 + owner.count); }

uint64_t MpiInbox::signalledBy(uint32_t, uint32_t peer, uint32_t event) const {
  if (peer >= owner.count || event >= count)
    return kUnknown;
  return __atomic_load_n(&counters()[peerIndex(peer, event)], __ATOMIC_RELAXED);
}

uint64_t MpiInbox::lastSignaller(uint32_t, uint32_t event) const {
  if (event >= count)
    return kUnknown;
  const uint64_t last = __atomic_load_n(&counters()[lastIndex(event)], __ATOMIC_ACQUIRE);
  return last == 0 ? kUnknown : last - 1;
}

Status MpiInbox::signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) {
  if (DropPut::dropsSignal(peer))
    return Status::success();
  if (owner.sharesMemory(peer)) {
    // After this thread's stores of the rows (seq_cst orders them).
    uint64_t *theirs = reinterpret_cast<uint64_t *>(memory.peer[peer]);
    __atomic_fetch_add(&theirs[peerIndex(owner.me, event)], delta, __ATOMIC_RELAXED);
    __atomic_store_n(&theirs[lastIndex(event)], signaller(owner.me, task) + 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&theirs[event], delta, __ATOMIC_SEQ_CST);
    return Status::success();
  }
  return owner.sendSignal(id, peer, event, delta, task);
}

Status MpiInbox::read(uint32_t, uint64_t *values) {
  if (Status s = owner.progress(); !s)
    return s;
  const uint64_t *counters = this->counters();
  for (uint32_t e = 0; e < count; ++e)
    values[e] = __atomic_load_n(&counters[e], __ATOMIC_ACQUIRE);
  return Status::success();
}

// Creating a fabric: its communicators (MPI_Comm_dup, MPI_Comm_split_type)
// and its first window are MPI collectives without a timeout, so a rank
// whose peers never create the fabric (a program that makes other layers
// on different ranks, a rank that raised instead of growing its layer)
// would wait in them without end. Every rank therefore first meets the
// others with point-to-point messages, each wait bounded: once every rank
// is known to be at the same creation, the collectives that follow all
// find their peers.
//
// The meeting has two rounds. In the first, each rank sends every peer the
// number of the creation it is at (1 for the first fabric this process
// creates, 2 for the next, ...) and waits for theirs. In the second, a rank
// that got every peer's number sends every peer its word that it goes on,
// and waits for theirs. A rank that gave up in the first round sends no
// word, so a peer that came late (after the first rank's timeout) fails in
// the second round instead of entering the collectives alone. Numbers below
// the rank's own are messages of a meeting that failed earlier, and are
// skipped; a number above it means the ranks create different fabrics. The
// first meeting runs on MPI_COMM_WORLD (tags the fabric's communicators do
// not see); it then makes a communicator of its own for the later ones.

constexpr int kTagMeetArrive = 32611;
constexpr int kTagMeetGo = 32612;
constexpr uint64_t kMeetMagic = 0x6d6f65632d6d6565; // "moec-mee"

struct MeetMessage {
  uint64_t magic;
  uint64_t creation;
};

struct Meeting {
  std::mutex mutex;               ///< one creation at a time in this process
  uint64_t creations = 0;         ///< fabric creations this process began
  MPI_Comm comm = MPI_COMM_NULL;  ///< after the first meeting: a dup of the world's
  /// Sent messages, kept for as long as the process lives: a send to a rank
  /// that never came stays posted.
  std::deque<MeetMessage> sent;
};

Meeting &meeting() {
  static Meeting *m = new Meeting; // never destroyed: sends may be in flight at exit
  return *m;
}

/// "#3", for messages.
std::string creationName(uint64_t n) { return fmt::format("#{}", n); }

/// One round of the meeting on `comm`: sends `creation` to every peer on
/// `tag`, and waits at most `timeoutSeconds` (<= 0: no limit) for every
/// peer's. The error names the ranks that did not come.
Status meetRound(MPI_Comm comm, int tag, uint64_t creation, uint32_t me, uint32_t count,
                 double timeoutSeconds, bool confirm) {
  Meeting &m = meeting();
  m.sent.push_back(MeetMessage{kMeetMagic, creation});
  MeetMessage *out = &m.sent.back();
  for (uint32_t p = 0; p < count; ++p) {
    if (p == me)
      continue;
    MPI_Request send = MPI_REQUEST_NULL;
    MOEC_MPI(MPI_Isend(out, int(sizeof *out), MPI_BYTE, int(p), tag, comm, &send),
             "creating a fabric: MPI_Isend");
    // It completes on its own; the message lives as long as the process.
    MPI_Request_free(&send);
  }
  // Room for more than a meeting message, to tell a stranger's.
  std::vector<std::array<char, 64>> inbound(count);
  std::vector<MPI_Request> receives(count, MPI_REQUEST_NULL);
  std::vector<uint64_t> earlier(count, 0); ///< [peer]: the latest earlier creation it sent
  const auto post = [&](uint32_t p) {
    return MPI_Irecv(inbound[p].data(), int(inbound[p].size()), MPI_BYTE, int(p), tag, comm,
                     &receives[p]);
  };
  for (uint32_t p = 0; p < count; ++p)
    if (p != me)
      MOEC_MPI(post(p), "creating a fabric: MPI_Irecv");
  // What a received message says: done (this creation), an earlier one
  // (repost), or an error.
  const auto take = [&](uint32_t p, const MPI_Status &status, bool *done) -> Status {
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    MeetMessage in{};
    if (bytes == int(sizeof in))
      std::memcpy(&in, inbound[p].data(), sizeof in);
    if (in.magic != kMeetMagic)
      return Status::error(fmt::format(
          "rank {}: creating MPI fabric {}: rank {} sent a message of {} bytes on moec's tag "
          "{} that is not moec's",
          me, creationName(creation), p, bytes, tag));
    if (in.creation > creation)
      return Status::error(fmt::format(
          "rank {}: rank {} creates MPI fabric {} while this rank creates {}: the ranks create "
          "different layers (every rank must create the same layers, and grow them, in the "
          "same order)",
          me, p, creationName(in.creation), creationName(creation)));
    if (in.creation < creation) {
      earlier[p] = in.creation;
      MOEC_MPI(post(p), "creating a fabric: MPI_Irecv");
      *done = false;
      return Status::success();
    }
    *done = true;
    return Status::success();
  };
  const auto cancelAll = [&] {
    for (uint32_t p = 0; p < count; ++p)
      if (receives[p] != MPI_REQUEST_NULL) {
        MPI_Cancel(&receives[p]);
        MPI_Wait(&receives[p], MPI_STATUS_IGNORE);
      }
  };
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    uint32_t missing = 0;
    for (uint32_t p = 0; p < count; ++p) {
      if (receives[p] == MPI_REQUEST_NULL)
        continue;
      int flag = 0;
      MPI_Status status;
      if (int rc = MPI_Test(&receives[p], &flag, &status); rc != MPI_SUCCESS) {
        cancelAll();
        return Status::error(fmt::format("mpi fabric: creating a fabric: MPI_Test: {}",
                                         mpiError(rc)));
      }
      bool done = false;
      if (flag) {
        if (Status s = take(p, status, &done); !s) {
          cancelAll();
          return s;
        }
        backoff.reset();
      }
      if (!done)
        ++missing;
    }
    if (missing == 0)
      return Status::success();
    if (timeoutSeconds > 0 && secondsSince(start) > timeoutSeconds)
      break;
    backoff.pause();
  }
  // Timed out: take back the receives; one whose message came meanwhile
  // counts.
  std::vector<uint32_t> absent;
  for (uint32_t p = 0; p < count; ++p) {
    if (receives[p] == MPI_REQUEST_NULL)
      continue;
    MPI_Cancel(&receives[p]);
    MPI_Status status;
    MPI_Wait(&receives[p], &status);
    int cancelled = 0;
    MPI_Test_cancelled(&status, &cancelled);
    bool done = false;
    if (!cancelled) {
      if (Status s = take(p, status, &done); !s) {
        cancelAll();
        return s;
      }
      if (!done && receives[p] != MPI_REQUEST_NULL) { // reposted: take it back
        MPI_Cancel(&receives[p]);
        MPI_Wait(&receives[p], MPI_STATUS_IGNORE);
      }
    }
    if (!done)
      absent.push_back(p);
  }
  if (absent.empty())
    return Status::success();
  std::string behind;
  for (uint32_t p : absent)
    if (earlier[p])
      behind += fmt::format("; rank {} last came to creation {}", p, creationName(earlier[p]));
  if (confirm)
    return Status::error(fmt::format(
        "rank {}: rank{} {} came to create MPI fabric {} but did not go on within {:.3g} s "
        "({} gave up waiting for another rank)",
        me, absent.size() == 1 ? "" : "s", fmt::join(absent, ", "), creationName(creation),
        timeoutSeconds, absent.size() == 1 ? "it" : "they"));
  return Status::error(fmt::format(
      "rank {}: rank{} {} did not come to create MPI fabric {} within {:.3g} s (every rank "
      "creates each fabric together, the N-th of each process at once: one for each context "
      "or layer made, or grown, on every rank); {} not make this layer or grow it, raised an "
      "error instead, stopped, or cannot be reached{}",
      me, absent.size() == 1 ? "" : "s", fmt::join(absent, ", "), creationName(creation),
      timeoutSeconds, absent.size() == 1 ? "it did" : "they did", behind));
}

/// Meets every rank of MPI_COMM_WORLD before a fabric's collectives
/// (above), bounded by `timeoutSeconds`. Under meeting().mutex.
Status meetToCreate(double timeoutSeconds) {
  Meeting &m = meeting();
  int size = 0, rank = 0;
  MOEC_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  MOEC_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  const uint64_t creation = ++m.creations;
  if (size == 1)
    return Status::success();
  const MPI_Comm comm = m.comm != MPI_COMM_NULL ? m.comm : MPI_COMM_WORLD;
  for (const bool confirm : {false, true})
    if (Status s = meetRound(comm, confirm ? kTagMeetGo : kTagMeetArrive, creation,
                             uint32_t(rank), uint32_t(size), timeoutSeconds, confirm);
        !s)
      return s;
  if (m.comm == MPI_COMM_NULL) {
    // Every rank is here: the dup finds its peers.
    MOEC_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &m.comm), "creating a fabric: MPI_Comm_dup");
    MPI_Comm_set_errhandler(m.comm, MPI_ERRORS_RETURN);
  }
  return Status::success();
}

} // namespace

bool launchedByMpi() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") ||
         std::getenv("PMIX_RANK");
}

int launcherRank() {
  for (const char *name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"})
    if (const char *value = std::getenv(name))
      return std::atoi(value);
  return 0;
}

int launcherSize() {
  for (const char *name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char *value = std::getenv(name))
      return std::max(1, std::atoi(value));
  return 1;
}

namespace {

/// MPI_Init_thread under a watchdog: MPI's start-up waits for every process
/// of the job, without a bound of its own, so a job one of whose processes
/// never starts MPI (another program given to mpirun, a process that
/// failed before it) would wait for ever. After `seconds` (> 0) the
/// watchdog says so and ends the process.
int initMpiBounded(int *provided, double seconds) {
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog;
  if (seconds > 0) {
    try {
      watchdog = std::thread([&] {
        std::unique_lock<std::mutex> lock(mutex);
        if (cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done; }))
          return;
        std::fprintf(stderr,
                     "error: [process of rank %d] MPI's start-up did not end within %g s: some "
                     "process of the job did not start MPI (every process mpirun starts must "
                     "run the layer: moec run, or a program that makes it)\n",
                     launcherRank(), seconds);
        std::fflush(stderr);
        std::_Exit(1);
      });
    } catch (const std::system_error &) {
      // No watchdog: the start-up as MPI does it.
    }
  }
  const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, provided);
  {
    std::lock_guard<std::mutex> lock(mutex);
    done = true;
  }
  cv.notify_all();
  if (watchdog.joinable())
    watchdog.join();
  return rc;
}

} // namespace

Status createMpiFabric(std::shared_ptr<Fabric> *out, const MpiOptions &options) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized)
    return Status::error("mpi fabric: MPI is already finalized");
  int provided = 0;
  if (!initialized) {
    if (int rc = initMpiBounded(&provided, options.timeoutSeconds); rc != MPI_SUCCESS)
      return Status::error("mpi fabric: MPI_Init_thread: " + mpiError(rc));
    initializedByUs = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    return Status::error("mpi fabric: MPI runs at a thread level below MPI_THREAD_MULTIPLE; "
                         "moec's workers put and signal from several threads (initialize MPI "
                         "with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...))");
  MpiOptions chosen = options;
  if (const char *value = envValue("MOEC_MPI_NO_SHARED_MEMORY"))
    if (std::strcmp(value, "0") != 0)
      chosen.noSharedMemory = true;
  int worldSize = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &worldSize);
  DropPut drop;
  if (Status s = DropPut::fromEnvironment(uint32_t(worldSize), &drop); !s)
    return s;
  // Every rank meets the others, bounded, before the collectives that
  // create the fabric (which have no timeout).
  std::lock_guard<std::mutex> lock(meeting().mutex);
  if (Status s = meetToCreate(chosen.timeoutSeconds); !s)
    return s;
  auto fabric = std::make_shared<MpiFabric>();
  fabric->drop = drop;
  if (Status s = fabric->init(chosen); !s)
    return s;
  *out = std::move(fabric);
  return Status::success();
}

void abortMpi(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    // MPI_Abort asks the launcher to end the job; where the launcher cannot
    // be reached (a host whose link is down) it may wait for it without
    // end. This process ends regardless, a few seconds later.
    try {
      std::thread([code] {
        std::this_thread::sleep_for(std::chrono::seconds(5));
        std::_Exit(code);
      }).detach();
    } catch (const std::system_error &) {
      std::_Exit(code);
    }
    MPI_Abort(MPI_COMM_WORLD, code);
  }
  std::_Exit(code);
}

void finalizeMpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (initializedByUs && !finalized)
    MPI_Finalize();
}

} // namespace moec::comm
