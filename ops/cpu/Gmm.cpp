//===- Gmm.cpp - Grouped matmul tile kernels on OpenBLAS ------------------===//

#include "ops/cpu/Gmm.h"

#include <cblas.h>

#include <algorithm>
#include <mutex>
#include <new>

// Under ThreadSanitizer (-fsanitize=thread, g++ or clang), the matrices
// OpenBLAS reads and writes are reported to it; see tsanAccess below.
#if defined(__SANITIZE_THREAD__)
#define MOEC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MOEC_TSAN 1
#endif
#endif
#ifdef MOEC_TSAN
extern "C" void __tsan_read_range(void *addr, unsigned long size);
extern "C" void __tsan_write_range(void *addr, unsigned long size);
#endif

namespace moec::ops {

//===----------------------------------------------------------------------===//
// Scratch and BLAS set-up
//===----------------------------------------------------------------------===//

namespace {
constexpr size_t kScratchAlignment = 64;
} // namespace

void Scratch::Free::operator()(float *p) const {
  ::operator delete(p, std::align_val_t(kScratchAlignment));
}

float *Scratch::floats(size_t count) {
  if (count > size || !buffer) {
    // Round up to whole cache lines; the old contents need not survive.
    const size_t perLine = kScratchAlignment / sizeof(float);
    const size_t want = std::max<size_t>((count + perLine - 1) / perLine * perLine, perLine);
    buffer.reset();
    buffer.reset(static_cast<float *>(
        ::operator new(want * sizeof(float), std::align_val_t(kScratchAlignment))));
    size = want;
  }
  return buffer.get();
}

namespace {
std::mutex blasMutex;
int blasHolders = 0;  ///< BlasSingleThread objects alive
int blasThreads = 0;  ///< OpenBLAS's thread count before the first of them
} // namespace

BlasSingleThread::BlasSingleThread() {
  std::lock_guard<std::mutex> lock(blasMutex);
  if (blasHolders++ == 0) {
    blasThreads = openblas_get_num_threads();
    openblas_set_num_threads(1);
  }
}

BlasSingleThread::~BlasSingleThread() {
  std::lock_guard<std::mutex> lock(blasMutex);
  if (--blasHolders == 0)
    openblas_set_num_threads(blasThreads);
}

const char *blasConfig() { return openblas_get_config(); }

//===----------------------------------------------------------------------===//
// The tile matmul
//===----------------------------------------------------------------------===//

namespace {

/// Block sizes of the bf16 path: C blocks of kBlockM x kBlockN, reduction
/// slices of kBlockK.
constexpr int64_t kBlockM = 256;
constexpr int64_t kBlockN = 512;
constexpr int64_t kBlockK = 512;

/// Rounds a float count up to whole cache lines, so scratch regions stay
/// aligned.
size_t lineRound(int64_t count) {
  const size_t perLine = kScratchAlignment / sizeof(float);
  return (size_t(count) + perLine - 1) / perLine * perLine;
}

/// The leading stride to hand BLAS for a stored `rows` x `cols` matrix with
/// stride `ld`: BLAS insists on ld >= max(1, cols) even where the stride is
/// never used (a single row), so a one-row matrix gets that minimum.
int ldFor(int64_t rows, int64_t cols, int64_t ld) {
  if (rows <= 1)
    return int(std::max<int64_t>({ld, cols, 1}));
  return int(ld);
}

#ifdef MOEC_TSAN
/// Tells ThreadSanitizer about the accesses to a stored `rows` x `cols` fp32
/// matrix: OpenBLAS is not instrumented, so without this a race on a matrix
/// that only sgemm reads or writes would go unseen.
void tsanAccess(const float *x, int64_t rows, int64_t cols, int64_t ld, bool write) {
  for (int64_t r = 0; r < rows; ++r) {
    void *row = const_cast<float *>(x + r * ld);
    if (write)
      __tsan_write_range(row, (unsigned long)(cols * int64_t(sizeof(float))));
    else
      __tsan_read_range(row, (unsigned long)(cols * int64_t(sizeof(float))));
  }
}
#endif

/// One fp32 sgemm, row-major: C = op(A) op(B) + beta C with op(A) m x k and
/// op(B) k x n. `a` is stored m x k (k x m when transA), `b` k x n (n x k
/// when transB).
void sgemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, const float *a,
           int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
#ifdef MOEC_TSAN
  tsanAccess(a, transA ? k : m, transA ? m : k, lda, false);
  tsanAccess(b, transB ? n : k, transB ? k : n, ldb, false);
  tsanAccess(c, m, n, ldc, true);
#endif
  cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
              transB ? CblasTrans : CblasNoTrans, int(m), int(n), int(k), 1.0f, a,
              transA ? ldFor(k, m, lda) : ldFor(m, k, lda), b,
              transB ? ldFor(n, k, ldb) : ldFor(k, n, ldb), beta, c, ldFor(m, n, ldc));
}

/// Returns the view of `x` that starts at its element (i, j).
ConstMatrix shifted(ConstMatrix x, int64_t i, int64_t j) {
  return ConstMatrix{x.address(i, j), x.elt, x.ld};
}
Matrix shifted(Matrix x, int64_t i, int64_t j) { return Matrix{x.address(i, j), x.elt, x.ld}; }

/// An fp32 panel that sgemm can read: either the operand in place or a
/// widened copy in scratch.
struct Panel {
  const float *data;
  int64_t ld;
};

/// Returns the stored `rows` x `cols` panel of `x` at element (i, j) as fp32:
/// in place for fp32, else widened into `buffer` (ld = cols).
Panel panel(ConstMatrix x, int64_t i, int64_t j, int64_t rows, int64_t cols, float *buffer) {
  if (x.elt == Elt::F32)
    return Panel{static_cast<const float *>(x.address(i, j)), x.ld};
  for (int64_t r = 0; r < rows; ++r)
    loadFloats(x.address(i + r, j), x.elt, buffer + r * cols, size_t(cols));
  return Panel{buffer, cols};
}

/// Sets the m x n tile of `c` to zero.
void zeroTile(Matrix c, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    std::memset(c.address(i, 0), 0, size_t(n) * eltSize(c.elt));
}

} // namespace

void gemmTile(int64_t m, int64_t n, int64_t k, ConstMatrix a, bool transA, ConstMatrix b,
              bool transB, Matrix c, bool accumulate, Scratch *scratch) {
  if (m <= 0 || n <= 0)
    return;
  if (k <= 0) {
    if (!accumulate)
      zeroTile(c, m, n);
    return;
  }
  // All fp32: one sgemm on the buffers in place.
  if (a.elt == Elt::F32 && b.elt == Elt::F32 && c.elt == Elt::F32) {
    sgemm(transA, transB, m, n, k, static_cast<const float *>(a.data), a.ld,
          static_cast<const float *>(b.data), b.ld, accumulate ? 1.0f : 0.0f,
          static_cast<float *>(c.data), c.ld);
    return;
  }

  // Some operand is bf16: block C and the reduction, widen bf16 panels.
  static thread_local Scratch threadScratch;
  Scratch &mem = scratch ? *scratch : threadScratch;
  const int64_t mc = std::min(m, kBlockM), nc = std::min(n, kBlockN), kc = std::min(k, kBlockK);
  const size_t aSize = a.elt == Elt::F32 ? 0 : lineRound(mc * kc);
  const size_t bSize = b.elt == Elt::F32 ? 0 : lineRound(kc * nc);
  const size_t cSize = c.elt == Elt::F32 ? 0 : lineRound(mc * nc);
  float *base = mem.floats(std::max<size_t>(aSize + bSize + cSize, 1));
  float *aBuf = base, *bBuf = base + aSize, *cBuf = base + aSize + bSize;

  for (int64_t i0 = 0; i0 < m; i0 += kBlockM) {
    const int64_t mb = std::min(kBlockM, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
      const int64_t nb = std::min(kBlockN, n - j0);
      // The fp32 block that sgemm accumulates into.
      float *cBlock;
      int64_t ldc;
      if (c.elt == Elt::F32) {
        cBlock = static_cast<float *>(c.address(i0, j0));
        ldc = c.ld;
      } else {
        cBlock = cBuf;
        ldc = nb;
        if (accumulate)
          for (int64_t i = 0; i < mb; ++i)
            loadFloats(c.address(i0 + i, j0), c.elt, cBuf + i * nb, size_t(nb));
      }
      for (int64_t p0 = 0; p0 < k; p0 += kBlockK) {
        const int64_t kb = std::min(kBlockK, k - p0);
        const Panel pa = transA ? panel(a, p0, i0, kb, mb, aBuf) : panel(a, i0, p0, mb, kb, aBuf);
        const Panel pb = transB ? panel(b, j0, p0, nb, kb, bBuf) : panel(b, p0, j0, kb, nb, bBuf);
        const float beta = (p0 == 0 && !accumulate) ? 0.0f : 1.0f;
        sgemm(transA, transB, mb, nb, kb, pa.data, pa.ld, pb.data, pb.ld, beta, cBlock, ldc);
      }
      if (c.elt != Elt::F32)
        for (int64_t i = 0; i < mb; ++i)
          storeFloats(cBuf + i * nb, c.address(i0 + i, j0), c.elt, size_t(nb));
    }
  }
}

//===----------------------------------------------------------------------===//
// The layer's three grouped matmuls
//===----------------------------------------------------------------------===//

namespace {

/// Clips a tile's row range (rows of the segment) to the segment.
Range clipToSegment(Range rows, Segment segment) {
  return Range{std::max<int64_t>(rows.begin, 0), std::min(rows.end, segment.rows)};
}

} // namespace

void gmmForwardTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                    Range rows, Range cols, Scratch *scratch) {
  const Range r = clipToSegment(rows, segment);
  if (r.empty() || cols.empty())
    return;
  const int64_t first = segment.offset + r.begin;
  gemmTile(r.size(), cols.size(), depth, shifted(a, first, 0), false,
           shifted(b, 0, cols.begin), false, shifted(c, first, cols.begin), false, scratch);
}

void gmmDgradTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                  Range rows, Range cols, Scratch *scratch) {
  const Range r = clipToSegment(rows, segment);
  if (r.empty() || cols.empty())
    return;
  const int64_t first = segment.offset + r.begin;
  gemmTile(r.size(), cols.size(), depth, shifted(a, first, 0), false,
           shifted(b, cols.begin, 0), true, shifted(c, first, cols.begin), false, scratch);
}

void gmmWgradTile(ConstMatrix a, ConstMatrix b, Matrix c, Segment segment, Range rows, Range cols,
                  bool accumulate, Scratch *scratch) {
  if (rows.empty() || cols.empty())
    return;
  const int64_t m = std::max<int64_t>(segment.rows, 0);
  gemmTile(rows.size(), cols.size(), m, shifted(a, segment.offset, rows.begin), true,
           shifted(b, segment.offset, cols.begin), false, shifted(c, rows.begin, cols.begin),
           accumulate, scratch);
}

} // namespace moec::ops
