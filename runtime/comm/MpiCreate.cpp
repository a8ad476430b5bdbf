//===- MpiCreate.cpp - Creating the MPI fabric, bounded -------------------===//
//
// See Mpi.h: createMpiFabric, after a meeting of every rank whose every wait
// is bounded (below); MPI's initialization, bounded; abort and finalize.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/MpiFabric.h"

namespace moec::comm {

using namespace detail; // the fabric's classes and MPI helpers (MpiFabric.h)

namespace {

/// Whether this process initialized MPI (and so finalizes it).
bool initializedByUs = false;

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
  std::mutex mutex;              ///< one creation at a time in this process
  uint64_t creations = 0;        ///< fabric creations this process began
  MPI_Comm comm = MPI_COMM_NULL; ///< after the first meeting: a dup of the world's
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
        return Status::error(
            fmt::format("mpi fabric: creating a fabric: MPI_Test: {}", mpiError(rc)));
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
    if (Status s = meetRound(comm, confirm ? kTagMeetGo : kTagMeetArrive, creation, uint32_t(rank),
                             uint32_t(size), timeoutSeconds, confirm);
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
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE") || std::getenv("PMIX_RANK");
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
