//===- MpiFabric.h - The MPI fabric's classes, inside runtime/comm -*- C++ -*-===//
//
// Internal to the MPI fabric's files (see Mpi.h for the protocol): the
// fabric (MpiFabric), its windows and inboxes over node-shared memory, the
// control messages between nodes. Mpi.cpp has the windows' and inboxes'
// memory; MpiCollectives.cpp the bounded collectives and the stop protocol;
// MpiCreate.cpp the bounded meeting before a fabric's creation, MPI's
// bounded initialization, abort and finalize. Every MPI call reports
// through MPI_ERRORS_RETURN on the fabric's communicators and windows, so a
// failure is a Status with MPI's message, not an abort.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_COMM_MPIFABRIC_H
#define MOEC_RUNTIME_COMM_MPIFABRIC_H

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

namespace moec::comm::detail {

inline std::string mpiError(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return fmt::format("MPI error {}", code);
  return std::string(text, size_t(length));
}

#define MOEC_MPI(call, what)                                                                       \
  do {                                                                                             \
    if (int rc_ = (call); rc_ != MPI_SUCCESS)                                                      \
      return Status::error(fmt::format("mpi fabric: {}: {}", what, mpiError(rc_)));                \
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
inline Status rowType(size_t rows, size_t rowBytes, size_t stride, MPI_Datatype *type, int *count) {
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

inline void freeType(MPI_Datatype *type) {
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
    int rc = MPI_Group_translate_ranks(world, int(count), ranksOfWorld.data(), node, onNode.data());
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

  Status put(const Window &window, uint32_t peer, size_t offset, size_t dstStride, const void *src,
             size_t srcStride, size_t rows, size_t rowBytes) override {
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
  Status sendRows(uint32_t window, uint32_t peer, size_t offset, size_t dstStride, const char *src,
                  size_t srcStride, size_t rows, size_t rowBytes) {
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
    int rc = MPI_Isend(message.data(), int(message.size()), MPI_BYTE, int(peer), kTagControl, comm,
                       &requests[0]);
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
  Status sendSignal(uint32_t inbox, uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) {
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

  Status exchange(const void *mine, size_t bytes, void *all, double timeoutSeconds) override;

  Status barrier(double timeoutSeconds) override;

  /// Two-sided messages to rank 0, in pieces of at most 1 GiB, each wait
  /// bounded by the fabric's timeout.
  Status gather(const void *mine, size_t bytes, void *all) override;

  Traffic traffic(uint32_t peer) const override {
    if (peer >= count)
      return {};
    return Traffic{sentBytes[peer].load(),
                   __atomic_load_n(&reinterpret_cast<const uint64_t *>(arrivals.base)[peer],
                                   __ATOMIC_ACQUIRE)};
  }

  /// An empty message to every peer on its own tag, and theirs received,
  /// bounded, driving progress meanwhile (a peer's stop ends it at once).
  Status finish(double timeoutSeconds) override;

  std::string stopJob(const std::string &report, double seconds) override;

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
    MOEC_MPI(MPI_Irecv(receive.buffer.data(), int(receive.buffer.size()), MPI_BYTE, MPI_ANY_SOURCE,
                       kTagControl, comm, &receive.request),
             "MPI_Irecv of control messages");
    return Status::success();
  }

  /// A control message from `peer` (under progressMutex).
  Status handle(uint32_t peer, const char *message, size_t bytes) {
    Control control;
    if (bytes < sizeof control)
      return Status::error(
          fmt::format("rank {}: a control message of {} bytes from rank {}", me, bytes, peer));
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
    __atomic_fetch_add(&reinterpret_cast<uint64_t *>(arrivals.base)[peer], bytes, __ATOMIC_RELAXED);
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

  std::mutex progressMutex;         ///< guards everything below
  std::vector<MpiWindow *> windows; ///< by id; null once destroyed
  std::vector<MpiInbox *> inboxes;
  ControlReceive ring[kControlRing];
  size_t ringHead = 0;
  std::vector<std::deque<Pending>> pending; ///< [peer]
  std::vector<uint64_t> landed;             ///< [peer]: puts whose rows are here
  std::vector<std::vector<char>> abandoned; ///< messages of sends that timed out
  std::string broken;
  std::string stopped;              ///< set when a peer stopped the job
  std::vector<std::string> reports; ///< [rank]: its report (rank 0, stopJob)
  std::vector<bool> reported;
  bool reportTaken = false; ///< rank 0 took this rank's report

  std::vector<std::atomic<uint64_t>> sent;      ///< [peer]: puts sent to it (other nodes)
  std::vector<std::atomic<uint64_t>> sentBytes; ///< [peer]: bytes put to it
  std::atomic<uint64_t> putsToPeers{0};
  std::atomic<uint32_t> nextTag{0};
  uint32_t dataTags = 1;
};

} // namespace moec::comm::detail

#endif // MOEC_RUNTIME_COMM_MPIFABRIC_H
