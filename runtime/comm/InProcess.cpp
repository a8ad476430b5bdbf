//===- InProcess.cpp - The fabric of ranks that are threads of one process -===//
//
// All R ranks live in this process: a window is R zeroed buffers, a put is a
// memcpy into the peer's buffer, and an exchange is a copy (every block is
// already here). The executor keeps every rank's events itself, so an inbox
// is never signalled; it exists so that both fabrics have the same shape.
//
//===----------------------------------------------------------------------===//

#include "runtime/comm/Fabric.h"

#include "base/Memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace moec::comm {

namespace {

class InProcessWindow final : public Window {
public:
  InProcessWindow(uint32_t ranks, size_t bytes) : size(bytes) {
    // Zeroed pages, mapped when first written: rows a pass never puts
    // take no memory.
    for (uint32_t r = 0; r < ranks; ++r) {
      buffers.emplace_back(std::max<size_t>(bytes, 1));
      if (!buffers.back().data())
        throw std::bad_alloc();
    }
  }
  void *local(uint32_t rank) const override { return buffers[rank].data(); }
  size_t bytes() const override { return size; }

private:
  size_t size;
  std::vector<ZeroedPages> buffers;
};

class InProcessInbox final : public Inbox {
public:
  InProcessInbox(uint32_t ranks, uint32_t events) : count(events), values(size_t(ranks) * events) {}
  uint32_t events() const override { return count; }
  Status signal(uint32_t peer, uint32_t event, uint64_t delta, uint32_t) override {
    return Status::error("in-process fabric: every rank is local; events are the executor's");
  }
  Status read(uint32_t rank, uint64_t *out) override {
    std::memcpy(out, values.data() + size_t(rank) * count, count * sizeof(uint64_t));
    return Status::success();
  }
  void reset() override { std::fill(values.begin(), values.end(), 0); }

private:
  uint32_t count;
  std::vector<uint64_t> values;
};

class InProcessFabric final : public Fabric {
public:
  explicit InProcessFabric(uint32_t ranks) : count(ranks) {}
  const char *name() const override { return "in-process"; }
  uint32_t ranks() const override { return count; }
  uint32_t firstLocal() const override { return 0; }
  uint32_t localRanks() const override { return count; }

  Status createWindow(size_t bytes, std::unique_ptr<Window> *out) override {
    try {
      *out = std::make_unique<InProcessWindow>(count, bytes);
    } catch (const std::bad_alloc &) {
      return Status::error("in-process fabric: out of memory for a window of " +
                           std::to_string(bytes) + " bytes per rank");
    }
    return Status::success();
  }

  Status createInbox(uint32_t events, std::unique_ptr<Inbox> *out) override {
    *out = std::make_unique<InProcessInbox>(count, events);
    return Status::success();
  }

  Status put(const Window &window, uint32_t peer, size_t offset, size_t dstStride,
             const void *src, size_t srcStride, size_t rows, size_t rowBytes) override {
    // Past the caches: a put's rows are read next on the peer's side (a
    // tile of the next op, the combine after the pass), not by this core.
    streamRows(static_cast<char *>(window.local(peer)) + offset, dstStride,
               static_cast<const char *>(src), srcStride, rows, rowBytes);
    return Status::success();
  }

  Status exchange(const void *mine, size_t bytes, void *all, double) override {
    if (bytes > 0)
      std::memmove(all, mine, bytes * count);
    return Status::success();
  }

  Status barrier(double) override { return Status::success(); }

  Status gather(const void *mine, size_t bytes, void *all) override {
    return exchange(mine, bytes, all, 0);
  }

private:
  uint32_t count;
};

} // namespace

std::shared_ptr<Fabric> inProcessFabric(uint32_t ranks) {
  return std::make_shared<InProcessFabric>(ranks);
}

} // namespace moec::comm
