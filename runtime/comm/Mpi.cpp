//===- Mpi.cpp - The fabric of ranks that are MPI processes ----------------===//
//
// See Mpi.h for the protocol. Every MPI call reports through MPI_ERRORS_RETURN
// on the fabric's communicator and windows, so a failure is a Status with
// MPI's message, not an abort.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/Mpi.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>
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

using Clock = std::chrono::steady_clock;

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

class MpiFabric;

/// An MPI window in one passive-target epoch for its whole life.
struct EpochWindow {
  MPI_Win win = MPI_WIN_NULL;
  void *base = nullptr;
  size_t size = 0;

  Status create(MPI_Comm comm, size_t bytes, int dispUnit) {
    size = bytes;
    MOEC_MPI(MPI_Win_allocate(MPI_Aint(std::max<size_t>(bytes, 8)), dispUnit, MPI_INFO_NULL, comm,
                              &base, &win),
             fmt::format("MPI_Win_allocate of {} bytes", bytes));
    MPI_Win_set_errhandler(win, MPI_ERRORS_RETURN);
    std::memset(base, 0, std::max<size_t>(bytes, 8));
    MOEC_MPI(MPI_Win_lock_all(MPI_MODE_NOCHECK, win), "MPI_Win_lock_all");
    MPI_Win_sync(win);
    // No peer may write before every rank has zeroed its memory (MPI does
    // not zero it, and a fast peer's first put would be wiped).
    MOEC_MPI(MPI_Barrier(comm), "MPI_Barrier after MPI_Win_allocate");
    return Status::success();
  }
  void destroy() {
    if (win == MPI_WIN_NULL)
      return;
    MPI_Win_unlock_all(win);
    MPI_Win_free(&win);
    win = MPI_WIN_NULL;
  }
};

class MpiWindow final : public Window {
public:
  explicit MpiWindow(MpiFabric &fabric) : owner(fabric) {}
  ~MpiWindow() override;
  void *local(uint32_t) const override { return window.base; }
  size_t bytes() const override { return window.size; }

  MpiFabric &owner;
  EpochWindow window;
};

class MpiInbox final : public Inbox {
public:
  MpiInbox(MpiFabric &fabric, uint32_t events) : owner(fabric), count(events) {}
  ~MpiInbox() override { window.destroy(); }
  uint32_t events() const override { return count; }
  Status signal(uint32_t peer, uint32_t event, uint64_t delta) override;
  Status read(uint32_t rank, uint64_t *values) override;
  void reset() override {
    std::memset(window.base, 0, size_t(count) * sizeof(uint64_t));
    MPI_Win_sync(window.win);
  }

  MpiFabric &owner;
  uint32_t count;
  EpochWindow window;
};

class MpiFabric final : public Fabric {
public:
  /// Bytes one rank may contribute to an exchange.
  static constexpr size_t kSlotPayload = 64 * 1024;
  static constexpr size_t kSlotHeader = 16; ///< sequence number, byte count
  static constexpr size_t kSlot = kSlotHeader + kSlotPayload;

  ~MpiFabric() override {
    mailbox.destroy();
    if (comm != MPI_COMM_NULL)
      MPI_Comm_free(&comm);
  }

  Status init() {
    MOEC_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    int size = 0, rank = 0;
    MOEC_MPI(MPI_Comm_size(comm, &size), "MPI_Comm_size");
    MOEC_MPI(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank");
    count = uint32_t(size);
    me = uint32_t(rank);
    return mailbox.create(comm, size_t(count) * 2 * kSlot, 1);
  }

  const char *name() const override { return "mpi"; }
  uint32_t ranks() const override { return count; }
  uint32_t firstLocal() const override { return me; }
  uint32_t localRanks() const override { return 1; }

  Status createWindow(size_t bytes, std::unique_ptr<Window> *out) override {
    auto window = std::make_unique<MpiWindow>(*this);
    if (Status s = window->window.create(comm, bytes, 1); !s)
      return s;
    {
      std::unique_lock<std::shared_mutex> lock(windowsMutex);
      dataWindows.push_back(window->window.win);
    }
    *out = std::move(window);
    return Status::success();
  }

  Status createInbox(uint32_t events, std::unique_ptr<Inbox> *out) override {
    auto inbox = std::make_unique<MpiInbox>(*this, events);
    if (Status s = inbox->window.create(comm, size_t(events) * sizeof(uint64_t), 8); !s)
      return s;
    *out = std::move(inbox);
    return Status::success();
  }

  Status put(const Window &window, uint32_t peer, size_t offset, size_t dstStride,
             const void *src, size_t srcStride, size_t rows, size_t rowBytes) override {
    if (rows == 0 || rowBytes == 0)
      return Status::success();
    MPI_Win win = static_cast<const MpiWindow &>(window).window.win;
    if (peer == me || localPuts) {
      char *dst = static_cast<char *>(window.local(me)) + offset;
      for (size_t i = 0; i < rows; ++i)
        std::memcpy(dst + i * dstStride, static_cast<const char *>(src) + i * srcStride, rowBytes);
      return Status::success();
    }
    if (rowBytes == srcStride && rowBytes == dstStride) {
      // One run of bytes, in pieces MPI's int counts can hold.
      const size_t total = rows * rowBytes;
      constexpr size_t kPiece = size_t(1) << 30;
      for (size_t done = 0; done < total; done += kPiece) {
        const int n = int(std::min(kPiece, total - done));
        MOEC_MPI(MPI_Put(static_cast<const char *>(src) + done, n, MPI_BYTE, int(peer),
                         MPI_Aint(offset + done), n, MPI_BYTE, win),
                 fmt::format("MPI_Put of {} bytes to rank {}", n, peer));
      }
      return Status::success();
    }
    if (rowBytes > (size_t(1) << 30))
      return Status::error("mpi fabric: a put of rows longer than 1 GiB");
    // Strided rows, in batches of at most 1 GiB.
    const size_t batch = std::max<size_t>(1, (size_t(1) << 30) / rowBytes);
    for (size_t first = 0; first < rows; first += batch) {
      const int n = int(std::min(batch, rows - first));
      MPI_Datatype from = MPI_DATATYPE_NULL, to = MPI_DATATYPE_NULL;
      int rc = MPI_Type_create_hvector(n, int(rowBytes), MPI_Aint(srcStride), MPI_BYTE, &from);
      if (rc == MPI_SUCCESS)
        rc = MPI_Type_commit(&from);
      if (rc == MPI_SUCCESS)
        rc = MPI_Type_create_hvector(n, int(rowBytes), MPI_Aint(dstStride), MPI_BYTE, &to);
      if (rc == MPI_SUCCESS)
        rc = MPI_Type_commit(&to);
      if (rc == MPI_SUCCESS)
        rc = MPI_Put(static_cast<const char *>(src) + first * srcStride, 1, from, int(peer),
                     MPI_Aint(offset + first * dstStride), 1, to, win);
      if (from != MPI_DATATYPE_NULL)
        MPI_Type_free(&from);
      if (to != MPI_DATATYPE_NULL)
        MPI_Type_free(&to);
      MOEC_MPI(rc, fmt::format("MPI_Put of {} rows to rank {}", n, peer));
    }
    return Status::success();
  }

  /// Completes every put of this process to `peer` (every rank: kAll).
  Status flushData(uint32_t peer) {
    std::shared_lock<std::shared_mutex> lock(windowsMutex);
    for (MPI_Win win : dataWindows)
      MOEC_MPI(peer == kAll ? MPI_Win_flush_all(win) : MPI_Win_flush(int(peer), win),
               "MPI_Win_flush");
    return Status::success();
  }
  /// Makes what peers put into this process's windows visible to its loads.
  void syncData() {
    std::shared_lock<std::shared_mutex> lock(windowsMutex);
    for (MPI_Win win : dataWindows)
      MPI_Win_sync(win);
  }
  void forget(MPI_Win win) {
    std::unique_lock<std::shared_mutex> lock(windowsMutex);
    dataWindows.erase(std::remove(dataWindows.begin(), dataWindows.end(), win), dataWindows.end());
  }

  Status exchange(const void *mine, size_t bytes, void *all, double timeoutSeconds) override {
    std::lock_guard<std::mutex> lock(exchangeMutex);
    // The sequence advances even for a refused exchange, so that every rank
    // keeps counting the same exchanges.
    const uint64_t seq = ++sequence;
    if (bytes > kSlotPayload)
      return Status::error(fmt::format(
          "mpi fabric: an exchange of {} bytes per rank; at most {} fit", bytes, kSlotPayload));
    const size_t parity = seq & 1;
    const auto slot = [&](uint32_t from) { return (parity * count + from) * kSlot; };
    char *base = static_cast<char *>(mailbox.base);
    // Our block, into our slot on every rank (ourselves included), then the
    // sequence number once the block is there.
    const uint64_t payloadBytes = bytes;
    for (uint32_t p = 0; p < count; ++p) {
      if (p == me) {
        std::memcpy(base + slot(me) + 8, &bytes, 8);
        if (bytes)
          std::memcpy(base + slot(me) + kSlotHeader, mine, bytes);
        continue;
      }
      MOEC_MPI(MPI_Put(&payloadBytes, 8, MPI_BYTE, int(p), MPI_Aint(slot(me) + 8), 8, MPI_BYTE,
                       mailbox.win),
               "exchange: MPI_Put");
      if (bytes)
        MOEC_MPI(MPI_Put(mine, int(bytes), MPI_BYTE, int(p), MPI_Aint(slot(me) + kSlotHeader),
                         int(bytes), MPI_BYTE, mailbox.win),
                 "exchange: MPI_Put");
    }
    MOEC_MPI(MPI_Win_flush_all(mailbox.win), "exchange: MPI_Win_flush_all");
    for (uint32_t p = 0; p < count; ++p)
      MOEC_MPI(MPI_Accumulate(&seq, 1, MPI_UINT64_T, int(p), MPI_Aint(slot(me)), 1, MPI_UINT64_T,
                              MPI_REPLACE, mailbox.win),
               "exchange: MPI_Accumulate");
    MOEC_MPI(MPI_Win_flush_all(mailbox.win), "exchange: MPI_Win_flush_all");

    // Wait for every rank's block.
    std::vector<bool> arrived(count, false);
    uint32_t missing = count;
    const Clock::time_point start = Clock::now();
    Backoff backoff;
    for (;;) {
      bool progress = false;
      for (uint32_t p = 0; p < count; ++p) {
        if (arrived[p])
          continue;
        uint64_t value = 0;
        MOEC_MPI(MPI_Fetch_and_op(nullptr, &value, MPI_UINT64_T, int(me), MPI_Aint(slot(p)),
                                  MPI_NO_OP, mailbox.win),
                 "exchange: MPI_Fetch_and_op");
        MOEC_MPI(MPI_Win_flush(int(me), mailbox.win), "exchange: MPI_Win_flush");
        if (value == seq) {
          arrived[p] = true;
          --missing;
          progress = true;
        }
      }
      if (missing == 0)
        break;
      if (progress)
        backoff.reset();
      if (timeoutSeconds > 0 &&
          std::chrono::duration<double>(Clock::now() - start).count() > timeoutSeconds) {
        std::vector<uint32_t> absent;
        for (uint32_t p = 0; p < count; ++p)
          if (!arrived[p])
            absent.push_back(p);
        return Status::error(fmt::format(
            "rank {}: rank{} {} did not reach the exchange within {:.3g} s (a rank that stopped, "
            "never submitted the pass, or runs another program)",
            me, absent.size() == 1 ? "" : "s", fmt::join(absent, ", "), timeoutSeconds));
      }
      backoff.pause();
    }
    MPI_Win_sync(mailbox.win);
    for (uint32_t p = 0; p < count; ++p) {
      uint64_t theirs = 0;
      std::memcpy(&theirs, base + slot(p) + 8, 8);
      if (theirs != bytes)
        return Status::error(fmt::format("rank {}: rank {} contributed {} bytes to an exchange "
                                         "of {} bytes (the ranks run different programs)",
                                         me, p, theirs, bytes));
      if (bytes)
        std::memcpy(static_cast<char *>(all) + p * bytes, base + slot(p) + kSlotHeader, bytes);
    }
    return Status::success();
  }

  Status barrier(double timeoutSeconds) override {
    if (Status s = flushData(kAll); !s)
      return s;
    if (Status s = exchange(nullptr, 0, nullptr, timeoutSeconds); !s)
      return s;
    syncData(); // what peers put before the barrier is visible to our loads
    return Status::success();
  }

  Status gather(const void *mine, size_t bytes, void *all) override {
    constexpr size_t kPiece = size_t(1) << 28;
    std::vector<char> staging;
    for (size_t done = 0; done < bytes || (bytes == 0 && done == 0); done += kPiece) {
      const size_t n = std::min(kPiece, bytes - done);
      if (me == 0)
        staging.resize(n * count);
      MOEC_MPI(MPI_Gather(static_cast<const char *>(mine) + done, int(n), MPI_BYTE,
                          staging.data(), int(n), MPI_BYTE, 0, comm),
               "MPI_Gather");
      if (me == 0)
        for (uint32_t p = 0; p < count; ++p)
          std::memcpy(static_cast<char *>(all) + p * bytes + done, staging.data() + p * n, n);
      if (bytes == 0)
        break;
    }
    return Status::success();
  }

  static constexpr uint32_t kAll = UINT32_MAX;
  bool localPuts = false;
  MPI_Comm comm = MPI_COMM_NULL;
  uint32_t count = 1, me = 0;
  uint64_t sequence = 0;
  std::mutex exchangeMutex; ///< one exchange at a time per fabric
  EpochWindow mailbox;
  std::shared_mutex windowsMutex;
  std::vector<MPI_Win> dataWindows;
};

MpiWindow::~MpiWindow() {
  owner.forget(window.win);
  window.destroy();
}

Status MpiInbox::signal(uint32_t peer, uint32_t event, uint64_t delta) {
  if (Status s = owner.flushData(peer); !s)
    return s;
  MOEC_MPI(MPI_Accumulate(&delta, 1, MPI_UINT64_T, int(peer), MPI_Aint(event), 1, MPI_UINT64_T,
                          MPI_SUM, window.win),
           fmt::format("signal to rank {}: MPI_Accumulate", peer));
  MOEC_MPI(MPI_Win_flush(int(peer), window.win), fmt::format("signal to rank {}: flush", peer));
  return Status::success();
}

Status MpiInbox::read(uint32_t, uint64_t *values) {
  const int me = int(owner.me);
  MOEC_MPI(MPI_Get_accumulate(nullptr, 0, MPI_UINT64_T, values, int(count), MPI_UINT64_T, me, 0,
                              int(count), MPI_UINT64_T, MPI_NO_OP, window.win),
           "inbox: MPI_Get_accumulate");
  MOEC_MPI(MPI_Win_flush(me, window.win), "inbox: MPI_Win_flush");
  owner.syncData();
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

Status createMpiFabric(std::shared_ptr<Fabric> *out, const MpiOptions &options) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized)
    return Status::error("mpi fabric: MPI is already finalized");
  int provided = 0;
  if (!initialized) {
    if (int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
        rc != MPI_SUCCESS)
      return Status::error("mpi fabric: MPI_Init_thread: " + mpiError(rc));
    initializedByUs = true;
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE)
    return Status::error("mpi fabric: MPI runs at a thread level below MPI_THREAD_MULTIPLE; "
                         "moec's workers put and signal from several threads (initialize MPI "
                         "with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...))");
  auto fabric = std::make_shared<MpiFabric>();
  fabric->localPuts = options.localPuts;
  if (Status s = fabric->init(); !s)
    return s;
  *out = std::move(fabric);
  return Status::success();
}

void abortMpi(int code) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized)
    MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void finalizeMpi() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (initializedByUs && !finalized)
    MPI_Finalize();
}

} // namespace moec::comm
