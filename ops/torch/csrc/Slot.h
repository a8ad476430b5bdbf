//===- Slot.h - A layer's context and its output buffers ---------*- C++ -*-===//
//
// The Slot that owns a layer's (or an exchange's) runtime context, the pool
// that recycles the memory of the tensors it returns, and, under MPI, the
// registry that frees contexts in creation order (finalize_mpi).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_OPS_TORCH_CSRC_SLOT_H
#define MOEC_OPS_TORCH_CSRC_SLOT_H

#include "ops/torch/csrc/Common.h"

#include <c10/core/CPUAllocator.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <unistd.h>

namespace moec::torchop {

/// A layer's runtime context and the lock that makes its passes one at a
/// time. Under MPI the registry below holds it too: freeing a context frees
/// MPI windows, which is collective, so it happens in finalize_mpi, in
/// creation order on every rank, and never when Python's garbage collector
/// happens to drop a Layer.
struct Slot;

/// The memory of the tensors a layer returns (y, dx, dtopk_weights, dw1,
/// dw2), recycled: when such a tensor dies (the optimizer's
/// zero_grad(set_to_none=True), or autograd adding it into an existing
/// .grad), its buffer comes back here, and a later step takes it with its
/// pages already touched instead of fresh pages from the OS. For
/// qwen3-30b-a3b on 2 ranks the weight gradients are 2.4 GB: first-touch
/// page faults on them cost about 0.6 s a step. A returned tensor is a
/// plain tensor that only its holders reference, so autograd takes it as
/// .grad without a copy.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
public:
  ~BufferPool() {
    for (const auto &[bytes, buffer] : idle)
      std::free(buffer);
  }

  /// A tensor of `sizes` and `options` (CPU, contiguous) over a recycled
  /// buffer of the same size when one is idle, else a new one.
  at::Tensor take(at::IntArrayRef sizes, const at::TensorOptions &options) {
    size_t bytes = c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
    for (int64_t d : sizes)
      bytes *= size_t(d);
    bytes = std::max<size_t>(bytes, 1);
    void *buffer = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (auto it = idle.find(bytes); it != idle.end()) {
        buffer = it->second;
        idle.erase(it);
        ++recycled;
      }
    }
    if (!buffer) {
      buffer = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      TORCH_CHECK(buffer, "moec: cannot allocate ", bytes, " bytes for an output");
    }
    std::shared_ptr<BufferPool> self = shared_from_this();
    return at::from_blob(
        buffer, sizes, [self, bytes](void *data) { self->giveBack(data, bytes); }, options);
  }

  /// Outputs served from an idle buffer so far.
  int64_t recycledCount() {
    std::lock_guard<std::mutex> lock(mutex);
    return recycled;
  }

private:
  /// At most this many idle buffers are kept; more go back to the system.
  static constexpr size_t kMaxIdle = 16;

  void giveBack(void *buffer, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex);
    if (idle.size() >= kMaxIdle) {
      std::free(buffer);
      return;
    }
    idle.emplace(bytes, buffer);
  }

  std::mutex mutex;
  std::multimap<size_t, void *> idle; ///< bytes -> buffer
  int64_t recycled = 0;
};

struct Slot {
  std::mutex mutex;
  std::unique_ptr<moec::rt::Context> context;
  std::unique_ptr<moec::rt::Exchange> exchange;
  std::shared_ptr<BufferPool> outputs = std::make_shared<BufferPool>();
  /// The process that made it: its worker threads, its watchdog and any
  /// pass in flight live there only. A child of fork() has a copy of the
  /// memory and none of the threads (a lock held then stays held for ever).
  const pid_t creator = ::getpid();

  /// Refuses a call from a child of fork(), before any lock.
  void sameProcess(const char *what) const {
    const pid_t me = ::getpid();
    TORCH_CHECK(me == creator, "moec: this ", what, " was created in process ", creator,
                "; this is process ", me,
                ", a child of fork(), which has none of its "
                "threads. Build a new ",
                what,
                " in this process (one made after fork() works), "
                "or start workers with the 'spawn' or 'forkserver' start method");
  }

  ~Slot() {
    // In a child of fork(), freeing the runtime would join threads that do
    // not exist here: the copy is left to the process's end.
    if (::getpid() != creator) {
      (void)context.release();
      (void)exchange.release();
    }
  }
};

inline std::mutex mpiSlotsMutex;
inline std::vector<std::shared_ptr<Slot>> mpiSlots;

} // namespace moec::torchop

#endif // MOEC_OPS_TORCH_CSRC_SLOT_H
