//===- GroupFabric.cpp - A fabric over a torch.distributed group ---------===//
//
// See GroupFabric.h for the protocol.
//
//===----------------------------------------------------------------------===//

#include "ops/torch/csrc/GroupFabric.h"

#include "base/Time.h"
#include "runtime/comm/Hooks.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace moec::torchop {

namespace {

using comm::copyRows;
using comm::Fabric;
using comm::Inbox;
using comm::Traffic;
using comm::Window;

constexpr int kTagControl = kTagBase;
/// Tags of the rows and blocks that follow control messages: kTagFirstData
/// on, per peer in turn (the receiver reads the tag from the control
/// message, so a wrap is harmless).
constexpr int kTagFirstData = kTagBase + 16;
constexpr uint32_t kDataTags = 1u << 24;
/// Rows up to this size travel inside their put's control message (the
/// receive of a control message has room for them; a message may be
/// shorter than its receive): one message instead of two, and no wait for
/// the receiver to post the second.
constexpr size_t kInlineBytes = 256 * 1024;
/// The `tag` of a put whose rows are inline.
constexpr uint32_t kInlineTag = 0;

/// What a control message says.
enum class Kind : uint32_t {
  Put = 1,    ///< rows follow on `tag`, for window `object`
  Signal = 2, ///< add `stride` to event `offset` of inbox `object`
  Block = 3,  ///< a block of kind `object` and sequence `offset`, `rows` bytes on `tag`
  Stop = 4,   ///< the sender stopped the job; its reason follows as a block
  Close = 5,  ///< the sender ends the fabric: no message follows
  Alive = 6,  ///< nothing: keeps the connection's receive from timing out
};

/// The kinds of blocks.
enum class BlockKind : uint32_t { Exchange = 1, Gather = 2, Finish = 3, Report = 4, Taken = 5 };

struct Control {
  Kind kind;
  uint32_t object;
  uint64_t offset;
  uint64_t stride;
  uint64_t rows;
  uint64_t rowBytes;
  uint32_t tag;
  uint32_t task;
};

/// What awaitBlocks got: per rank, its block, or none.
using Blocks = std::vector<std::optional<std::vector<char>>>;

class GroupFabricImpl;

class GroupWindow final : public Window {
public:
  GroupWindow(GroupFabricImpl &owner, uint32_t id, size_t bytes);
  ~GroupWindow() override;
  void *local(uint32_t) const override { return memory.get(); }
  size_t bytes() const override { return size; }

  GroupFabricImpl &owner;
  uint32_t id;
  size_t size;
  std::unique_ptr<char[]> memory;
};

class GroupInbox final : public Inbox {
public:
  GroupInbox(GroupFabricImpl &owner, uint32_t id, uint32_t events);
  ~GroupInbox() override;
  uint32_t events() const override { return count; }
  Status signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) override;
  Status read(uint32_t rank, uint64_t *values) override;
  void reset() override {
    for (size_t i = 0; i < counters.size(); ++i)
      counters[i].store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  uint64_t signalledBy(uint32_t, uint32_t peer, uint32_t event) const override {
    if (event >= count || peer >= ranks)
      return kUnknown;
    return counters[size_t(count) * (2 + peer) + event].load(std::memory_order_relaxed);
  }
  uint64_t lastSignaller(uint32_t, uint32_t event) const override {
    if (event >= count)
      return kUnknown;
    const uint64_t last = counters[size_t(count) + event].load(std::memory_order_acquire);
    return last == 0 ? kUnknown : last - 1;
  }
  /// Applies a peer's signal (the receiving thread of `peer`).
  void apply(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) {
    counters[size_t(count) * (2 + peer) + event].fetch_add(delta, std::memory_order_relaxed);
    counters[size_t(count) + event].store((uint64_t(peer) << 32 | task) + 1,
                                          std::memory_order_relaxed);
    counters[event].fetch_add(delta, std::memory_order_seq_cst);
  }

  GroupFabricImpl &owner;
  uint32_t id;
  uint32_t count;
  uint32_t ranks;
  /// The sums the executor reads [events], the latest signaller of each
  /// [events], then what each rank added [ranks][events].
  std::vector<std::atomic<uint64_t>> counters;
};

class GroupFabricImpl final : public Fabric, public std::enable_shared_from_this<GroupFabricImpl> {
public:
  GroupFabricImpl(c10::intrusive_ptr<c10d::ProcessGroup> group, double timeoutSeconds)
      : group(std::move(group)), me(uint32_t(this->group->getRank())),
        count(uint32_t(this->group->getSize())), timeoutSeconds(timeoutSeconds), sentBytes(count),
        arrivedBytes(count), dataTag(count), closedBy(count, false), links(count) {}

  /// Starts the receiving threads and the keep-alive (a message to every
  /// peer each `aliveSeconds`), then meets every rank (bounded).
  Status start(double aliveSeconds) {
    for (uint32_t p = 0; p < count; ++p)
      if (p != me)
        receivers.emplace_back([this, p] { receive(p); });
    completer = std::thread([this] { complete(); });
    keepAlive = std::thread([this, aliveSeconds] { sendAlive(aliveSeconds); });
    return exchange(nullptr, 0, nullptr, timeoutSeconds);
  }

  const char *name() const override { return "process-group"; }
  uint32_t ranks() const override { return count; }
  uint32_t firstLocal() const override { return me; }
  uint32_t localRanks() const override { return 1; }

  Status createWindow(size_t bytes, std::unique_ptr<Window> *out) override {
    return create("window", bytes, windows, out,
                  [&](uint32_t id) { return std::make_unique<GroupWindow>(*this, id, bytes); });
  }

  Status createInbox(uint32_t events, std::unique_ptr<Inbox> *out) override {
    return create("inbox", events, inboxes, out,
                  [&](uint32_t id) { return std::make_unique<GroupInbox>(*this, id, events); });
  }

  /// Makes object `what` of `size` (a window's bytes, an inbox's events)
  /// with make(id): numbered in creation order, entered in `registry` for
  /// the receiving threads, then agreed with every rank (bounded). Entered
  /// first: a peer that is through the agreement may put or signal at
  /// once, and it is through only once this rank's part came, which this
  /// rank sends after entering the object. (An object whose agreement
  /// fails leaves the registry as it is destroyed.)
  template <typename Object, typename Base, typename Make>
  Status create(const char *what, uint64_t size, std::map<uint32_t, Object *> &registry,
                std::unique_ptr<Base> *out, Make make) {
    uint32_t id;
    {
      std::lock_guard<std::mutex> lock(objectsMutex);
      id = nextObject++;
    }
    std::unique_ptr<Object> object;
    try {
      object = make(id);
    } catch (const std::bad_alloc &) {
      return Status::error(fmt::format("rank {}: process-group fabric: out of memory for {} {} "
                                       "of size {}",
                                       me, what, id, size));
    }
    {
      std::lock_guard<std::mutex> lock(objectsMutex);
      registry[id] = object.get();
    }
    if (Status s = agreeOnObject(what, id, size); !s)
      return s;
    *out = std::move(object);
    return Status::success();
  }

  void forget(uint32_t id) {
    std::lock_guard<std::mutex> lock(objectsMutex);
    windows.erase(id);
    inboxes.erase(id);
  }

  Status put(const Window &window, uint32_t peer, size_t offset, size_t dstStride, const void *src,
             size_t srcStride, size_t rows, size_t rowBytes) override {
    const auto &w = static_cast<const GroupWindow &>(window);
    if (peer == me || localPuts) {
      copyRows(w.memory.get() + offset, dstStride, static_cast<const char *>(src), srcStride, rows,
               rowBytes);
      return Status::success();
    }
    if (Status s = usable(); !s)
      return s;
    const size_t bytes = rows * rowBytes;
    if (bytes == 0)
      return Status::success();
    if (drop.dropsPut(me, peer, putsToPeers)) // a test hook
      return Status::success();
    // One message up to kInlineBytes of rows, else the header and the rows
    // on a tag of their own, which the peer receives once it took the
    // header, before its next control message (so before a signal this
    // thread sends after). (Rows cut into several inline messages instead
    // were slower: more messages.)
    const bool inline_ = bytes <= kInlineBytes;
    const size_t head = inline_ ? sizeof(Control) : 0;
    std::vector<char> data(head + bytes);
    copyRows(data.data() + head, rowBytes, static_cast<const char *>(src), srcStride, rows,
             rowBytes);
    std::lock_guard<std::mutex> lock(*links[peer].sending);
    Control header{Kind::Put, w.id, offset, dstStride, rows, rowBytes, kInlineTag, 0};
    if (inline_) {
      std::memcpy(data.data(), &header, sizeof header);
      if (Status s = send(peer, std::move(data), kTagControl, "a put"); !s)
        return s;
    } else {
      header.tag = uint32_t(nextDataTag(peer));
      if (Status s = sendControl(peer, header, "a put's header"); !s)
        return s;
      if (Status s = send(peer, std::move(data), int(header.tag), "a put's rows"); !s)
        return s;
    }
    sentBytes[peer] += bytes;
    return Status::success();
  }

  Status sendSignal(uint32_t inbox, uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) {
    if (Status s = usable(); !s)
      return s;
    if (comm::DropPut::dropsSignal(peer))
      return Status::success();
    std::lock_guard<std::mutex> lock(*links[peer].sending);
    return sendControl(peer, Control{Kind::Signal, inbox, event, delta, 0, 0, 0, task}, "a signal");
  }

  Status exchange(const void *mine, size_t bytes, void *all, double timeoutSeconds) override {
    const uint64_t seq = ++exchanges;
    if (bytes)
      std::memcpy(static_cast<char *>(all) + size_t(me) * bytes, mine, bytes);
    for (uint32_t p = 0; p < count; ++p)
      if (p != me)
        if (Status s = sendBlock(p, BlockKind::Exchange, seq, mine, bytes); !s)
          return s;
    Blocks blocks;
    if (Status s = awaitBlocks(BlockKind::Exchange, seq, allPeers(), timeoutSeconds, &blocks,
                               "the exchange");
        !s)
      return s;
    for (uint32_t p = 0; p < count; ++p) {
      if (p == me)
        continue;
      if (blocks[p]->size() != bytes)
        return Status::error(fmt::format("rank {}: rank {} contributed {} bytes to exchange {}, "
                                         "this rank {} bytes (the ranks run different programs)",
                                         me, p, blocks[p]->size(), seq, bytes));
      if (bytes)
        std::memcpy(static_cast<char *>(all) + size_t(p) * bytes, blocks[p]->data(), bytes);
    }
    return Status::success();
  }

  /// A peer's block arrives behind every put it made before it, and put()
  /// returns once its messages left: once every peer's block is in, every
  /// put of every rank before the barrier has landed.
  Status barrier(double timeoutSeconds) override {
    return exchange(nullptr, 0, nullptr, timeoutSeconds);
  }

  Status gather(const void *mine, size_t bytes, void *all) override {
    const uint64_t seq = ++gathers;
    if (me != 0)
      return sendBlock(0, BlockKind::Gather, seq, mine, bytes);
    if (bytes)
      std::memcpy(all, mine, bytes);
    Blocks blocks;
    if (Status s = awaitBlocks(BlockKind::Gather, seq, allPeers(), timeoutSeconds, &blocks,
                               "the gather on rank 0");
        !s)
      return s;
    for (uint32_t p = 1; p < count; ++p) {
      if (blocks[p]->size() != bytes)
        return Status::error(fmt::format("rank 0: rank {} gathered {} bytes, this rank {}", p,
                                         blocks[p]->size(), bytes));
      if (bytes)
        std::memcpy(static_cast<char *>(all) + size_t(p) * bytes, blocks[p]->data(), bytes);
    }
    return Status::success();
  }

  Traffic traffic(uint32_t peer) const override {
    if (peer >= count)
      return {};
    return Traffic{sentBytes[peer].load(), arrivedBytes[peer].load()};
  }

  Status finish(double timeoutSeconds) override {
    const uint64_t seq = ++finishes;
    for (uint32_t p = 0; p < count; ++p)
      if (p != me)
        if (Status s = sendBlock(p, BlockKind::Finish, seq, nullptr, 0); !s)
          return s;
    Blocks blocks;
    return awaitBlocks(BlockKind::Finish, seq, allPeers(), timeoutSeconds, &blocks,
                       "the end of the job");
  }

  std::string stopJob(const std::string &report, double seconds) override {
    std::string reason = report.substr(0, std::min(report.find("; "), report.find(". ")));
    if (reason.size() > 300)
      reason = reason.substr(0, 300) + "...";
    sendTimeoutSeconds = std::min(timeoutSeconds, seconds);
    for (uint32_t p = 0; p < count; ++p)
      if (p != me) {
        std::lock_guard<std::mutex> lock(*links[p].sending);
        (void)sendWith(p, Control{Kind::Stop, 0, 0, 0, reason.size(), 0, 0, 0}, reason.data(),
                       reason.size(), "a stop");
      }
    std::string out;
    if (me != 0) {
      bool taken = false;
      if (sendBlock(0, BlockKind::Report, 1, report.data(), report.size())) {
        Blocks blocks;
        taken = bool(awaitBlocks(BlockKind::Taken, 1, {0}, seconds, &blocks, "the report",
                                 /*evenIfStopped=*/true));
      }
      if (!taken)
        out = fmt::format("rank 0 did not take the report of rank {} within {:.3g} s (rank 0 "
                          "died, or cannot be reached)\n",
                          me, seconds);
    } else {
      Blocks blocks;
      std::vector<uint32_t> peers = allPeers();
      (void)awaitBlocks(BlockKind::Report, 1, peers, seconds, &blocks, "the reports",
                        /*evenIfStopped=*/true);
      out = fmt::format("report of the {} ranks, gathered on rank 0:\n", count);
      for (uint32_t p = 0; p < count; ++p) {
        if (p == me) {
          out += fmt::format("  [rank {}] {}\n", p, report);
        } else if (blocks[p]) {
          out +=
              fmt::format("  [rank {}] {}\n", p, std::string(blocks[p]->begin(), blocks[p]->end()));
          (void)sendBlock(p, BlockKind::Taken, 1, nullptr, 0);
        } else {
          out += fmt::format("  [rank {}] no report within {:.3g} s (it died, waits outside "
                             "moec, or cannot be reached)\n",
                             p, seconds);
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mailMutex);
      if (broken.empty())
        broken = "the job stopped";
    }
    return out;
  }

  /// Tells every peer that this rank ends the fabric, waits at most
  /// `seconds` for theirs, and joins the receiving threads that got it
  /// (the others are left to end with their connection).
  void close(double seconds) {
    if (closed.exchange(true))
      return;
    {
      std::lock_guard<std::mutex> lock(aliveMutex);
      aliveStop = true;
    }
    aliveCv.notify_all();
    if (keepAlive.joinable())
      keepAlive.join();
    sendTimeoutSeconds = std::max(0.1, std::min(timeoutSeconds, seconds));
    for (uint32_t p = 0; p < count; ++p)
      if (p != me && !links[p].down) {
        std::lock_guard<std::mutex> lock(*links[p].sending);
        (void)sendControl(p, Control{Kind::Close, 0, 0, 0, 0, 0, 0, 0}, "the close");
      }
    std::unique_lock<std::mutex> lock(mailMutex);
    mailCv.wait_for(lock, std::chrono::duration<double>(seconds), [&] {
      for (uint32_t p = 0; p < count; ++p)
        if (p != me && !closedBy[p] && !links[p].down)
          return false;
      return true;
    });
    lock.unlock();
    {
      std::lock_guard<std::mutex> out(outMutex);
      outStop = true;
    }
    outCv.notify_all();
    if (completer.joinable())
      completer.join(); // each send it still waits for: at most sendTimeoutSeconds
    size_t i = 0;
    bool detached = false;
    for (uint32_t p = 0; p < count; ++p) {
      if (p == me)
        continue;
      std::thread &t = receivers[i++];
      bool done;
      {
        std::lock_guard<std::mutex> l(mailMutex);
        done = closedBy[p] || links[p].down;
      }
      if (done) {
        t.join();
      } else {
        t.detach(); // ends with its connection
        detached = true;
      }
    }
    // A thread still receiving uses this fabric: it is kept to the end of
    // the process.
    if (detached) {
      static std::mutex keptMutex;
      static auto *kept = new std::vector<std::shared_ptr<GroupFabricImpl>>;
      std::lock_guard<std::mutex> l(keptMutex);
      kept->push_back(shared_from_this());
    }
  }

private:
  friend class GroupInbox;

  struct Link {
    std::unique_ptr<std::mutex> sending = std::make_unique<std::mutex>();
    std::atomic<bool> down{false};
  };

  std::vector<uint32_t> allPeers() const {
    std::vector<uint32_t> peers;
    for (uint32_t p = 0; p < count; ++p)
      if (p != me)
        peers.push_back(p);
    return peers;
  }

  int nextDataTag(uint32_t peer) { return kTagFirstData + int(dataTag[peer]++ % kDataTags); }

  /// The error that broke or stopped the fabric, if any.
  Status usable() {
    std::lock_guard<std::mutex> lock(mailMutex);
    if (!broken.empty())
      return Status::error(broken);
    if (!stopped.empty())
      return Status::error(stopped);
    return Status::success();
  }

  Status breakDown(std::string message) {
    std::lock_guard<std::mutex> lock(mailMutex);
    if (broken.empty())
      broken = std::move(message);
    mailCv.notify_all();
    return Status::error(broken);
  }

  /// Sends `message` to `peer` on `tag`: issues the send and returns; the
  /// completing thread waits for it to leave, bounded (sendTimeoutSeconds),
  /// and keeps the message until then. Sends to one peer on one tag leave
  /// in the order issued, so a thread's put, then its signal, arrive in
  /// that order without waiting between them.
  Status send(uint32_t peer, std::vector<char> message, int tag, const char *what) {
    auto buffer = std::make_shared<std::vector<char>>(std::move(message));
    std::vector<at::Tensor> tensors{at::from_blob(buffer->data(), {int64_t(buffer->size())},
                                                  at::TensorOptions().dtype(at::kByte))};
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = group->send(tensors, int(peer), tag);
    } catch (const std::exception &e) {
      return breakDown(fmt::format("rank {}: {} to rank {} failed (rank {} died, or its link is "
                                   "down): {}",
                                   me, what, peer, peer, firstLine(e.what())));
    }
    {
      std::lock_guard<std::mutex> lock(outMutex);
      outgoing.push_back(Outgoing{std::move(buffer), std::move(work), peer, what});
    }
    outCv.notify_one();
    return Status::success();
  }

  static std::string firstLine(std::string text) {
    if (const size_t cut = text.find('\n'); cut != std::string::npos)
      text.resize(cut);
    return text;
  }

  /// The completing thread: waits, in the order issued, for each send to
  /// leave, at most sendTimeoutSeconds each; a send that does not breaks
  /// the fabric (naming the peer) and its message is kept (the group may
  /// still read it). Ends once close() asked and every send is done.
  void complete() {
    std::unique_lock<std::mutex> lock(outMutex);
    for (;;) {
      outCv.wait(lock, [&] { return !outgoing.empty() || outStop; });
      if (outgoing.empty())
        return;
      Outgoing out = std::move(outgoing.front());
      outgoing.pop_front();
      lock.unlock();
      const double seconds = sendTimeoutSeconds;
      const Clock::time_point start = Clock::now();
      try {
        if (seconds > 0)
          out.work->wait(std::chrono::milliseconds(int64_t(seconds * 1000)));
        else
          out.work->wait();
      } catch (const std::exception &e) {
        {
          std::lock_guard<std::mutex> mail(mailMutex);
          abandoned.emplace_back(out.buffer, out.work);
        }
        // A timeout, or a connection that failed before it.
        const bool late = seconds > 0 && secondsSince(start) >= 0.9 * seconds;
        (void)breakDown(
            late ? fmt::format("rank {}: {} to rank {} did not leave within {:.3g} s (rank {} "
                               "stopped taking messages: it died, hangs, or its link is down): {}",
                               me, out.what, out.peer, seconds, out.peer, firstLine(e.what()))
                 : fmt::format("rank {}: {} to rank {} failed (rank {} died, or its link is "
                               "down): {}",
                               me, out.what, out.peer, out.peer, firstLine(e.what())));
      }
      lock.lock();
    }
  }

  Status sendControl(uint32_t peer, const Control &control, const char *what) {
    std::vector<char> message(sizeof control);
    std::memcpy(message.data(), &control, sizeof control);
    return send(peer, std::move(message), kTagControl, what);
  }

  /// Sends control message `c` with `bytes` of `data`: inline up to
  /// kInlineBytes, else on a tag of their own after it (c.rows says how
  /// many). The caller holds the peer's sending lock.
  Status sendWith(uint32_t peer, Control c, const void *data, size_t bytes, const char *what) {
    const char *from = static_cast<const char *>(data);
    if (bytes <= kInlineBytes) {
      c.tag = kInlineTag;
      std::vector<char> message(sizeof c + bytes);
      std::memcpy(message.data(), &c, sizeof c);
      if (bytes)
        std::memcpy(message.data() + sizeof c, from, bytes);
      return send(peer, std::move(message), kTagControl, what);
    }
    c.tag = uint32_t(nextDataTag(peer));
    if (Status s = sendControl(peer, c, what); !s)
      return s;
    return send(peer, std::vector<char>(from, from + bytes), int(c.tag), what);
  }

  Status sendBlock(uint32_t peer, BlockKind kind, uint64_t seq, const void *data, size_t bytes) {
    std::lock_guard<std::mutex> lock(*links[peer].sending);
    return sendWith(peer, Control{Kind::Block, uint32_t(kind), seq, 0, bytes, 0, 0, 0}, data, bytes,
                    "a block");
  }

  /// Waits, bounded, for the block `seq` of `kind` from each of `peers`;
  /// `blocks` [ranks] gets them. Fails at once when the fabric breaks or a
  /// peer stops the job (unless `evenIfStopped`); the error names the peers
  /// that did not come.
  Status awaitBlocks(BlockKind kind, uint64_t seq, const std::vector<uint32_t> &peers,
                     double seconds, Blocks *blocks, const char *what, bool evenIfStopped = false) {
    blocks->assign(count, std::nullopt);
    const Clock::time_point start = Clock::now();
    std::unique_lock<std::mutex> lock(mailMutex);
    for (;;) {
      std::vector<uint32_t> absent;
      for (uint32_t p : peers) {
        if ((*blocks)[p])
          continue;
        auto &queue = mail[{uint32_t(kind), p}];
        // Blocks of an earlier round that failed are skipped.
        while (!queue.empty() && queue.front().first < seq)
          queue.pop_front();
        if (!queue.empty() && queue.front().first == seq) {
          (*blocks)[p] = std::move(queue.front().second);
          queue.pop_front();
        } else if (!queue.empty()) {
          return Status::error(fmt::format("rank {}: rank {} is at {} {} of kind {}, this rank "
                                           "at {} (the ranks run different programs)",
                                           me, p, what, queue.front().first, uint32_t(kind), seq));
        } else {
          absent.push_back(p);
        }
      }
      if (absent.empty())
        return Status::success();
      if (!broken.empty())
        return Status::error(broken);
      if (!stopped.empty() && !evenIfStopped)
        return Status::error(stopped);
      std::vector<uint32_t> gone;
      for (uint32_t p : absent)
        if (links[p].down || closedBy[p])
          gone.push_back(p);
      if (!gone.empty() && !evenIfStopped)
        return Status::error(fmt::format("rank {}: rank{} {} left the job before {} ({})", me,
                                         gone.size() == 1 ? "" : "s", fmt::join(gone, ", "), what,
                                         downReason));
      const double left = seconds > 0 ? seconds - secondsSince(start) : 1.0;
      if (seconds > 0 && left <= 0) {
        if (evenIfStopped)
          return Status::error("timed out");
        return Status::error(fmt::format(
            "rank {}: rank{} {} did not reach {} within {:.3g} s (a rank that stopped, never "
            "submitted the pass, runs another program, cannot be reached, or is still starting: "
            "making a layer starts its worker threads, which with thousands of them or on a "
            "loaded machine takes a while; a longer timeout_seconds waits for it)",
            me, absent.size() == 1 ? "" : "s", fmt::join(absent, ", "), what, seconds));
      }
      mailCv.wait_for(lock, std::chrono::duration<double>(std::min(left, 1.0)));
    }
  }

  /// Windows and inboxes are created in the same order with the same sizes
  /// on every rank: the ranks check that in a bounded exchange.
  Status agreeOnObject(const char *what, uint32_t id, uint64_t size) {
    const uint64_t mine[2] = {id, size};
    std::vector<uint64_t> all(size_t(count) * 2);
    if (Status s = exchange(mine, sizeof mine, all.data(), timeoutSeconds); !s)
      return s;
    for (uint32_t p = 0; p < count; ++p)
      if (all[2 * p] != id || all[2 * p + 1] != size)
        return Status::error(fmt::format("rank {}: creating {} {} of size {}, rank {} its object "
                                         "{} of size {} (the ranks run different programs)",
                                         me, what, id, size, p, all[2 * p], all[2 * p + 1]));
    return Status::success();
  }

  /// Posts a receive of one message of at most `bytes` from `peer` on
  /// `tag` into `data`; null with `error` set when the group refuses.
  c10::intrusive_ptr<c10d::Work> post(uint32_t peer, void *data, size_t bytes, int tag,
                                      std::string *error) {
    std::vector<at::Tensor> tensors{
        at::from_blob(data, {int64_t(bytes)}, at::TensorOptions().dtype(at::kByte))};
    try {
      return group->recv(tensors, int(peer), tag);
    } catch (const std::exception &e) {
      *error = firstLine(e.what());
      return {};
    }
  }

  /// Waits, without a bound (see the header), for a posted receive.
  static bool await(const c10::intrusive_ptr<c10d::Work> &work, std::string *error) {
    if (!work)
      return false;
    try {
      work->wait();
      return true;
    } catch (const std::exception &e) {
      *error = firstLine(e.what());
      return false;
    }
  }

  /// Receives one message of `bytes` from `peer` on `tag` into `data`.
  bool receiveInto(uint32_t peer, void *data, size_t bytes, int tag, std::string *error) {
    return await(post(peer, data, bytes, tag, error), error);
  }

  /// Control receives kept posted per peer: a sender's messages leave once
  /// the receiver posted their receive, so several posted let several
  /// messages travel at once.
  static constexpr size_t kControlRing = 8;

  /// The receiving thread of `peer`: takes its control messages in order.
  void receive(uint32_t peer) {
    std::string error;
    // Each a control message, and the rows of an inline put after it; they
    // outlive the thread (the group may hold receives still posted when it
    // ends), so they are never freed.
    struct Ring {
      std::vector<char> buffer[kControlRing];
      c10::intrusive_ptr<c10d::Work> work[kControlRing];
    };
    Ring &ring = *new Ring;
    for (size_t i = 0; i < kControlRing; ++i) {
      ring.buffer[i].resize(sizeof(Control) + kInlineBytes);
      ring.work[i] = post(peer, ring.buffer[i].data(), ring.buffer[i].size(), kTagControl, &error);
    }
    for (size_t head = 0;; head = (head + 1) % kControlRing) {
      if (!await(ring.work[head], &error))
        break;
      std::vector<char> &message = ring.buffer[head];
      Control c;
      std::memcpy(&c, message.data(), sizeof c);
      if (c.kind == Kind::Close) {
        std::lock_guard<std::mutex> lock(mailMutex);
        closedBy[peer] = true;
        mailCv.notify_all();
        return;
      }
      // What the message carries is used before its buffer is posted again.
      if (!take(peer, c, message.data() + sizeof c, &error))
        break;
      ring.work[head] = post(peer, message.data(), message.size(), kTagControl, &error);
    }
    // The connection failed: the peer died, or its link is down.
    std::lock_guard<std::mutex> lock(mailMutex);
    links[peer].down = true;
    if (downReason.empty())
      downReason = fmt::format("the connection to rank {} failed: {}", peer, error);
    if (!closed && broken.empty())
      broken = fmt::format("rank {}: the connection to rank {} failed (rank {} died, or its link "
                           "is down): {}",
                           me, peer, peer, error);
    mailCv.notify_all();
  }

  /// Takes a control message of `peer` (not Close); `inline_` is what
  /// followed it in its message. False when the connection failed.
  bool take(uint32_t peer, const Control &c, const char *inline_, std::string *error) {
    switch (c.kind) {
    case Kind::Alive:
      return true;
    case Kind::Put:
      return land(peer, c, inline_, error);
    case Kind::Signal: {
      std::lock_guard<std::mutex> lock(objectsMutex);
      auto it = inboxes.find(c.object);
      if (it == inboxes.end() || c.offset >= it->second->count)
        noteError(fmt::format("rank {}: rank {} signalled event {} of inbox {}, which this rank "
                              "does not have (the ranks run different programs)",
                              me, peer, c.offset, c.object));
      else
        it->second->apply(peer, uint32_t(c.offset), c.stride, c.task);
      return true;
    }
    case Kind::Block:
    case Kind::Stop: {
      std::vector<char> data;
      if (c.tag == kInlineTag) {
        if (c.rows > kInlineBytes) {
          *error = fmt::format("a block of {} bytes inline", c.rows);
          return false;
        }
        data.assign(inline_, inline_ + c.rows);
      } else {
        data.resize(c.rows);
        if (c.rows && !receiveInto(peer, data.data(), data.size(), int(c.tag), error))
          return false;
      }
      std::lock_guard<std::mutex> lock(mailMutex);
      if (c.kind == Kind::Stop) {
        if (stopped.empty())
          stopped = fmt::format("rank {} stopped the job: {}", peer,
                                std::string(data.begin(), data.end()));
      } else {
        mail[{c.object, peer}].emplace_back(c.offset, std::move(data));
      }
      mailCv.notify_all();
      return true;
    }
    default:
      *error = fmt::format("an unknown message ({})", uint32_t(c.kind));
      return false;
    }
  }

  /// Lands a put's rows in its window: from `inline_` (the control
  /// message's rows) or received on their own tag (through a buffer when
  /// the window's rows are apart).
  bool land(uint32_t peer, const Control &c, const char *inline_, std::string *error) {
    const size_t bytes = c.rows * c.rowBytes;
    char *dst = nullptr;
    {
      std::lock_guard<std::mutex> lock(objectsMutex);
      auto it = windows.find(c.object);
      const size_t span = c.rows ? (c.rows - 1) * c.stride + c.rowBytes : 0;
      if (it != windows.end() && c.offset <= it->second->size &&
          span <= it->second->size - c.offset)
        dst = it->second->memory.get() + c.offset;
    }
    const auto noWindow = [&] {
      noteError(fmt::format("rank {}: rank {} put {} bytes at offset {} of window {}, which this "
                            "rank does not have or is smaller (the ranks run different programs)",
                            me, peer, bytes, c.offset, c.object));
      return true; // the connection is fine
    };
    if (c.tag == kInlineTag) {
      if (bytes > kInlineBytes || !dst)
        return noWindow();
      copyRows(dst, c.stride, inline_, c.rowBytes, c.rows, c.rowBytes);
    } else if (dst && c.stride == c.rowBytes) {
      if (!receiveInto(peer, dst, bytes, int(c.tag), error))
        return false;
    } else {
      std::vector<char> rows(bytes);
      if (!receiveInto(peer, rows.data(), bytes, int(c.tag), error))
        return false;
      if (!dst)
        return noWindow();
      copyRows(dst, c.stride, rows.data(), c.rowBytes, c.rows, c.rowBytes);
    }
    arrivedBytes[peer] += bytes;
    return true;
  }

  void noteError(std::string message) {
    std::lock_guard<std::mutex> lock(mailMutex);
    if (broken.empty())
      broken = std::move(message);
    mailCv.notify_all();
  }

  /// Sends every peer a message when nothing else went for `seconds`, so
  /// that no receive waits as long as the group's timeout (gloo closes
  /// every connection of a group whose receive times out).
  void sendAlive(double seconds) {
    std::unique_lock<std::mutex> lock(aliveMutex);
    while (!aliveStop) {
      aliveCv.wait_for(lock, std::chrono::duration<double>(seconds));
      if (aliveStop)
        return;
      lock.unlock();
      for (uint32_t p = 0; p < count; ++p)
        if (p != me && !links[p].down) {
          std::lock_guard<std::mutex> sending(*links[p].sending);
          (void)sendControl(p, Control{Kind::Alive, 0, 0, 0, 0, 0, 0, 0}, "a keep-alive");
        }
      lock.lock();
    }
  }

public:
  comm::DropPut drop;     ///< the test hook MOEC_TEST_DROP_PUT
  bool localPuts = false; ///< the measurement mode MOEC_LOCAL_PUTS (comm/Hooks.h)

private:
  std::atomic<uint64_t> putsToPeers{0};
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  const uint32_t me, count;
  const double timeoutSeconds;
  std::atomic<double> sendTimeoutSeconds{timeoutSeconds};

  std::mutex objectsMutex;
  uint32_t nextObject = 0;
  std::map<uint32_t, GroupWindow *> windows;
  std::map<uint32_t, GroupInbox *> inboxes;

  std::vector<std::atomic<uint64_t>> sentBytes, arrivedBytes;
  std::vector<std::atomic<uint32_t>> dataTag;
  std::atomic<uint64_t> exchanges{0}, gathers{0}, finishes{0};

  /// Under mailMutex: the blocks that came in per (kind, peer), in order;
  /// what broke or stopped the fabric; the peers that closed.
  std::mutex mailMutex;
  std::condition_variable mailCv;
  std::map<std::pair<uint32_t, uint32_t>, std::deque<std::pair<uint64_t, std::vector<char>>>> mail;
  std::string broken, stopped, downReason;
  std::vector<bool> closedBy;
  std::vector<Link> links;
  std::vector<std::pair<std::shared_ptr<std::vector<char>>, c10::intrusive_ptr<c10d::Work>>>
      abandoned;

  /// Sends issued and not yet known to have left (complete()).
  struct Outgoing {
    std::shared_ptr<std::vector<char>> buffer;
    c10::intrusive_ptr<c10d::Work> work;
    uint32_t peer;
    const char *what;
  };
  std::mutex outMutex;
  std::condition_variable outCv;
  std::deque<Outgoing> outgoing;
  bool outStop = false;
  std::thread completer;

  std::vector<std::thread> receivers;
  std::thread keepAlive;
  std::mutex aliveMutex;
  std::condition_variable aliveCv;
  bool aliveStop = false;
  std::atomic<bool> closed{false};
};

GroupWindow::GroupWindow(GroupFabricImpl &owner, uint32_t id, size_t bytes)
    : owner(owner), id(id), size(bytes), memory(new char[std::max<size_t>(bytes, 1)]()) {}

GroupWindow::~GroupWindow() { owner.forget(id); }

GroupInbox::GroupInbox(GroupFabricImpl &owner, uint32_t id, uint32_t events)
    : owner(owner), id(id), count(events), ranks(owner.ranks()),
      counters(size_t(events) * (2 + owner.ranks())) {
  reset();
}

GroupInbox::~GroupInbox() { owner.forget(id); }

Status GroupInbox::signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t task) {
  return owner.sendSignal(id, peer, event, delta, task);
}

Status GroupInbox::read(uint32_t, uint64_t *values) {
  if (Status s = owner.usable(); !s)
    return s;
  for (uint32_t e = 0; e < count; ++e)
    values[e] = counters[e].load(std::memory_order_acquire);
  return Status::success();
}

std::mutex registryMutex;
std::map<c10d::ProcessGroup *, std::shared_ptr<GroupFabricImpl>> registry;

} // namespace

Status groupFabric(const c10::intrusive_ptr<c10d::ProcessGroup> &group, double timeoutSeconds,
                   double groupTimeoutSeconds, std::shared_ptr<comm::Fabric> *out) {
  std::lock_guard<std::mutex> lock(registryMutex);
  if (auto it = registry.find(group.get()); it != registry.end()) {
    *out = it->second;
    return Status::success();
  }
  auto fabric = std::make_shared<GroupFabricImpl>(group, timeoutSeconds);
  if (Status s = comm::DropPut::fromEnvironment(fabric->ranks(), &fabric->drop); !s)
    return s;
  fabric->localPuts = comm::localPutsRequested();
  // gloo closes a group's connections when a receive waits longer than the
  // group's timeout (30 minutes unless the program set it): a message goes
  // to every peer well before.
  const double alive = std::max(0.05, std::min(60.0, groupTimeoutSeconds / 4));
  if (Status s = fabric->start(alive); !s) {
    fabric->close(0);
    return Status::error("process-group fabric: " + s.message());
  }
  registry[group.get()] = fabric;
  *out = fabric;
  return Status::success();
}

void closeGroupFabrics(double seconds) {
  std::map<c10d::ProcessGroup *, std::shared_ptr<GroupFabricImpl>> fabrics;
  {
    std::lock_guard<std::mutex> lock(registryMutex);
    fabrics.swap(registry);
  }
  for (auto &[group, fabric] : fabrics)
    fabric->close(seconds);
}

} // namespace moec::torchop
