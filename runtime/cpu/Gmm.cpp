//===- Gmm.cpp - Grouped matmul tile kernels on oneDNN's GEMM -------------===//

#include "runtime/cpu/Gmm.h"

#include "base/Env.h"

#include "runtime/cpu/Tile.h"

#include <immintrin.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <utility>

// oneDNN 2.6 exports its bf16 GEMM (bf16 inputs, fp32 accumulation and
// output, row-major like dnnl_sgemm) without declaring it in a public header.
extern "C" dnnl_status_t dnnl_gemm_bf16bf16f32(char transa, char transb, dnnl_dim_t M,
                                               dnnl_dim_t N, dnnl_dim_t K, float alpha,
                                               const uint16_t *A, dnnl_dim_t lda,
                                               const uint16_t *B, dnnl_dim_t ldb, float beta,
                                               float *C, dnnl_dim_t ldc);

// Under ThreadSanitizer (-fsanitize=thread, g++ or clang), the matrices
// oneDNN reads and writes are reported to it; see tsanAccess below.
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

namespace moec::cpu {

//===----------------------------------------------------------------------===//
// Scratch and the GEMM library
//===----------------------------------------------------------------------===//

namespace {
constexpr size_t kScratchAlignment = 64;
std::atomic<size_t> scratchHeld{0};
} // namespace

Scratch::~Scratch() { scratchHeld -= size * sizeof(float); }

size_t Scratch::heldBytes() { return scratchHeld.load(std::memory_order_relaxed); }

float *Scratch::floats(size_t count) {
  if (count > size || !buffer.data()) {
    // Pages of their own (not the calling thread's malloc arena, which would
    // keep every smaller buffer a growing scratch left behind resident), an
    // eighth more than asked, in whole pages, so that a run of growing
    // requests maps anew only a few times. The old contents need not
    // survive.
    const size_t page = 4096 / sizeof(float);
    const size_t want = std::max<size_t>((count + count / 8 + page - 1) / page * page, page);
    buffer = ZeroedPages();
    scratchHeld -= size * sizeof(float);
    size = 0;
    buffer = ZeroedPages(want * sizeof(float));
    if (!buffer.data())
      throw std::bad_alloc();
    size = want;
    scratchHeld += size * sizeof(float);
  }
  return static_cast<float *>(buffer.data());
}

namespace {
/// Whether oneDNN's effective ISA on this CPU holds `isa`'s bits: ISA values
/// are nested bit sets. Fixed once oneDNN has looked at the CPU (and at
/// DNNL_MAX_CPU_ISA).
bool oneDnnHas(dnnl_cpu_isa_t isa) {
  static const unsigned effective = unsigned(dnnl_get_effective_cpu_isa());
  return (effective & unsigned(isa)) == unsigned(isa);
}

/// Whether oneDNN runs its AVX-512 kernels on this CPU.
bool oneDnnAvx512() { return oneDnnHas(dnnl_cpu_isa_avx512_core); }
} // namespace

bool nativeBf16Gemm() { return oneDnnHas(dnnl_cpu_isa_avx512_core_bf16); }

GemmKernel gemmKernel() {
  static const GemmKernel chosen = [] {
    const char *value = envValue("MOEC_GEMM");
    if (!value || std::strcmp(value, "auto") == 0)
      return GemmKernel::Auto;
    if (std::strcmp(value, "moec") == 0)
      return GemmKernel::Moec;
    if (std::strcmp(value, "onednn") == 0)
      return GemmKernel::OneDnn;
    std::fprintf(stderr, "moec: %s is none of 'auto', 'moec', 'onednn'; using 'auto'\n",
                 envShown("MOEC_GEMM", value).c_str());
    return GemmKernel::Auto;
  }();
  return chosen;
}

bool moecTile(bool bf16) {
  switch (gemmKernel()) {
  case GemmKernel::Auto: return bf16 && tile::available(true);
  case GemmKernel::Moec: return tile::available(bf16);
  case GemmKernel::OneDnn: return false;
  }
  return false;
}

const char *gemmConfig() {
  static const std::string text = [] {
    const dnnl_version_t *v = dnnl_version();
    const char *isa = "unknown";
    switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_avx512_core_amx: isa = "avx512_core_amx"; break;
    case dnnl_cpu_isa_avx512_core_bf16: isa = "avx512_core_bf16"; break;
    case dnnl_cpu_isa_avx512_core_vnni: isa = "avx512_core_vnni"; break;
    case dnnl_cpu_isa_avx512_core: isa = "avx512_core"; break;
    case dnnl_cpu_isa_avx2_vnni: isa = "avx2_vnni"; break;
    case dnnl_cpu_isa_avx2: isa = "avx2"; break;
    default: break;
    }
    // What moec's own tile runs; oneDNN the rest.
    const std::string bf16Tile =
        tile::amx() ? "AMX tiles"
                    : std::string("avx512_bf16, a B stored n x k ") +
                          (tile::dotForm(false, true, true)                 ? "in the dot form"
                           : tile::swappedForm(17, 2048, false, true, true) ? "as its transpose"
                                                                            : "through panels");
    std::string own;
    if (moecTile(false))
      own = "fp32 (AVX-512)";
    else if (streamedTile(Elt::F32, Elt::F32, tile::kPanelColumns, tile::kPanelColumns))
      own = "fp32 weight gradients (AVX-512)";
    if (moecTile(true))
      own += (own.empty() ? "" : " and ") + ("bf16 (" + bf16Tile + ")");
    if (!own.empty())
      own = "moec's tile for " + own + "; otherwise ";
    return own + "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
           std::to_string(v->patch) + " GEMM, CPU ISA " + isa + ", one OpenMP thread per call; " +
           (nativeBf16Gemm() ? "bf16 products on bf16 dot-product instructions"
                             : "bf16 operands widened to fp32 (no bf16 dot products)");
  }();
  return text.c_str();
}

//===----------------------------------------------------------------------===//
// The tile matmul
//===----------------------------------------------------------------------===//

namespace {

/// Block sizes of the bf16-C path: C blocks of kBlockM x kBlockN.
constexpr int64_t kBlockM = 256;
constexpr int64_t kBlockN = 512;

/// Rounds a float count up to whole cache lines, so scratch regions stay
/// aligned.
size_t lineRound(int64_t count) {
  const size_t perLine = kScratchAlignment / sizeof(float);
  return (size_t(count) + perLine - 1) / perLine * perLine;
}

/// The leading stride to hand the GEMM for a stored `rows` x `cols` matrix
/// with stride `ld`: it insists on ld >= max(1, cols) even where the stride
/// is never used (a single row), so a one-row matrix gets that minimum.
dnnl_dim_t ldFor(int64_t rows, int64_t cols, int64_t ld) {
  if (rows <= 1)
    return std::max<int64_t>({ld, cols, 1});
  return ld;
}

#ifdef MOEC_TSAN
/// Tells ThreadSanitizer about the accesses to a stored `rows` x `cols`
/// matrix of `eltBytes`-byte elements: oneDNN is not instrumented, so without
/// this a race on a matrix that only the GEMM reads or writes would go
/// unseen.
void tsanAccess(const void *x, int64_t rows, int64_t cols, int64_t ld, size_t eltBytes,
                bool write) {
  for (int64_t r = 0; r < rows; ++r) {
    void *row = const_cast<char *>(static_cast<const char *>(x) + size_t(r * ld) * eltBytes);
    if (write)
      __tsan_write_range(row, (unsigned long)(size_t(cols) * eltBytes));
    else
      __tsan_read_range(row, (unsigned long)(size_t(cols) * eltBytes));
  }
}
#endif

/// Runs `call` with OpenMP (oneDNN's threading) at one thread on the calling
/// thread: the runtime runs many tiles at once on its own workers, and a GEMM
/// must not start a thread team inside each. The setting is per thread and
/// is put back after, so a host's own calls on the same thread (PyTorch's
/// matmuls, say) keep their threads.
template <typename Call> void oneThread(Call call) {
  const int threads = omp_get_max_threads();
  if (threads != 1)
    omp_set_num_threads(1);
  call();
  if (threads != 1)
    omp_set_num_threads(threads);
}

/// Ends the process on a call oneDNN refused (`what`: the call, "GEMM NT"
/// or "matmul"). The runtime validates every shape and stride before
/// kernels run, so a refusal is a bug in the caller.
[[noreturn]] void refused(const char *what, int64_t m, int64_t n, int64_t k, dnnl_status_t status) {
  std::fprintf(stderr, "moec: oneDNN %s refused m=%lld n=%lld k=%lld (status %d)\n", what,
               (long long)m, (long long)n, (long long)k, int(status));
  std::abort();
}

/// One GEMM, row-major, fp32 accumulation into fp32 C:
/// C = alpha op(A) op(B) + beta C with op(A) m x k and op(B) k x n. `a` is stored
/// m x k (k x m when transA), `b` k x n (n x k when transB); both fp32
/// (dnnl_sgemm) or both bf16 (dnnl_gemm_bf16bf16f32).
void gemm(bool transA, bool transB, int64_t m, int64_t n, int64_t k, const void *a,
          int64_t lda, const void *b, int64_t ldb, Elt elt, float alpha, float beta, float *c,
          int64_t ldc) {
#ifdef MOEC_TSAN
  tsanAccess(a, transA ? k : m, transA ? m : k, lda, dtypeSize(elt), false);
  tsanAccess(b, transB ? n : k, transB ? k : n, ldb, dtypeSize(elt), false);
  tsanAccess(c, m, n, ldc, sizeof(float), true);
#endif
  const char ta = transA ? 'T' : 'N', tb = transB ? 'T' : 'N';
  const dnnl_dim_t la = transA ? ldFor(k, m, lda) : ldFor(m, k, lda);
  const dnnl_dim_t lb = transB ? ldFor(n, k, ldb) : ldFor(k, n, ldb);
  const dnnl_dim_t lc = ldFor(m, n, ldc);
  dnnl_status_t status;
  oneThread([&] {
    status = elt == Elt::F32
                 ? dnnl_sgemm(ta, tb, m, n, k, alpha, static_cast<const float *>(a), la,
                              static_cast<const float *>(b), lb, beta, c, lc)
                 : dnnl_gemm_bf16bf16f32(ta, tb, m, n, k, alpha,
                                         static_cast<const uint16_t *>(a), la,
                                         static_cast<const uint16_t *>(b), lb, beta, c, lc);
  });
  if (status != dnnl_success)
    refused((std::string("GEMM ") + ta + tb).c_str(), m, n, k, status);
}

/// Returns the view of `x` that starts at its element (i, j).
ConstMatrix shifted(ConstMatrix x, int64_t i, int64_t j) {
  return ConstMatrix{x.address(i, j), x.elt, x.ld};
}
Matrix shifted(Matrix x, int64_t i, int64_t j) { return Matrix{x.address(i, j), x.elt, x.ld}; }

/// An fp32 panel the GEMM can read: either the operand in place or a
/// widened copy in scratch.
struct Panel {
  const float *data;
  int64_t ld;
};

/// Whether rows `ld` elements of `eltBytes` apart fall into few sets of the
/// L1 and L2 caches: a stride that is a multiple of 1 KiB maps every row's
/// start onto at most 4 of the 64 sets of a 4 KiB way. The layer's weights
/// are such matrices (w1 rows of 2I = 1536 fp32, 6 KiB; w2 rows of H = 2048,
/// 8 KiB), and the GEMM's packing of a panel of them, row after row, then
/// keeps evicting what it just read: oneDNN's sgemm ran an up_proj tile of
/// qwen3-30b-a3b (128 x 768 x 2048) at 64 GFLOP/s with B's rows 6 KiB apart
/// and at 89 with them 6 KiB + 64 B apart, and a down_proj tile at 43
/// against 89 (one thread, each tile on a new expert's weight). In the
/// whole layer the gain is smaller: down_proj went from 69-76% of the peak
/// to 74-83%, the forward pass 2-5% faster (moec run --profile, runs
/// alternated).
bool aliasedStride(int64_t ld, size_t eltBytes) { return (size_t(ld) * eltBytes) % 1024 == 0; }

/// The row stride of a copy of `cols` elements per row: whole cache lines,
/// and not a stride aliasedStride() refuses.
int64_t copyStride(int64_t cols, size_t eltBytes) {
  const int64_t perLine = int64_t(kScratchAlignment / eltBytes);
  int64_t ld = (cols + perLine - 1) / perLine * perLine;
  if (aliasedStride(ld, eltBytes))
    ld += perLine;
  return ld;
}

/// Returns the stored `rows` x `cols` panel of `x` at element (i, j) as fp32:
/// in place for fp32, else widened into `buffer` (ld = copyStride(cols)).
Panel panel(ConstMatrix x, int64_t i, int64_t j, int64_t rows, int64_t cols, float *buffer) {
  if (x.elt == Elt::F32)
    return Panel{static_cast<const float *>(x.address(i, j)), x.ld};
  const int64_t ld = copyStride(cols, sizeof(float));
  for (int64_t r = 0; r < rows; ++r)
    loadFloats(x.address(i + r, j), x.elt, buffer + r * ld, size_t(cols));
  return Panel{buffer, ld};
}

/// Copies the stored `rows` x `cols` matrix `x` into `buffer` with the row
/// stride copyStride(cols): same element type, rows that do not alias.
ConstMatrix realigned(ConstMatrix x, int64_t rows, int64_t cols, void *buffer) {
  const size_t eltBytes = dtypeSize(x.elt);
  const int64_t ld = copyStride(cols, eltBytes);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(static_cast<char *>(buffer) + size_t(r * ld) * eltBytes, x.address(r, 0),
                size_t(cols) * eltBytes);
  return ConstMatrix{buffer, x.elt, ld};
}

/// Writes the transpose of the stored `rows` x `cols` fp32 matrix `src`
/// (stride `ls`) to `dst` (stride `ld`): dst[j][i] = src[i][j]. 8 x 8 blocks
/// in AVX2 registers, the edges one element at a time. (The tile's own 16 x
/// 16 transposes in AVX-512 registers, Tile.cpp's transposeInto, ran the
/// act_grad tile below 2-6% slower on Zen 4, whose 512-bit shuffles take
/// two cycles.)
__attribute__((target("avx2"))) void transposeFloats(const float *src, int64_t ls, int64_t rows,
                                                     int64_t cols, float *dst, int64_t ld) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t i = 0; i < rows8; i += 8)
    for (int64_t j = 0; j < cols8; j += 8) {
      __m256 r[8], t[8];
      for (int q = 0; q < 8; ++q)
        r[q] = _mm256_loadu_ps(src + (i + q) * ls + j);
      for (int q = 0; q < 8; q += 2) {
        t[q] = _mm256_unpacklo_ps(r[q], r[q + 1]);
        t[q + 1] = _mm256_unpackhi_ps(r[q], r[q + 1]);
      }
      for (int q = 0; q < 8; q += 4) {
        r[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
        r[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xEE);
        r[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
        r[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xEE);
      }
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_ps(dst + (j + q) * ld + i, _mm256_permute2f128_ps(r[q], r[q + 4], 0x20));
        _mm256_storeu_ps(dst + (j + q + 4) * ld + i, _mm256_permute2f128_ps(r[q], r[q + 4], 0x31));
      }
    }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = i < rows8 ? cols8 : 0; j < cols; ++j)
      dst[j * ld + i] = src[i * ls + j];
}

/// Rows of A a transposed sgemm (below) takes at a time.
constexpr int64_t kTransposedRows = 128;

/// Whether an fp32 C = op(A) B^T, with B stored n x k, runs as its transpose
/// C^T = B A^T instead: where B's rows lie a multiple of 4 KiB apart and
/// oneDNN runs AVX-512 kernels. Its sgemm then packs B^T from rows that
/// fall into one set of L1 (a backward act_grad tile of qwen3-30b-a3b, 128 x
/// 768 x 2048 against w2's rows of 2048 fp32, 87-88 GFLOP/s a thread on Zen
/// 4), while B as the first operand, not transposed, and A transposed
/// beforehand into a copy run at 98-103 (two threads, each on 16 experts'
/// weights in turn; gate_grad's 128 x 2048 x 1536, w1's rows 6 KiB apart:
/// level).
bool transposedSgemm(bool transA, bool transB, int64_t ldb) {
  return !transA && transB && ldb > 0 && (size_t(ldb) * sizeof(float)) % 4096 == 0 &&
         oneDnnAvx512();
}

/// One GEMM as gemm() below for fp32 operands under transposedSgemm():
/// C^T = alpha B A^T, kTransposedRows rows of A at a time into scratch, and
/// C = C^T's transpose (+ C with `accumulate`). Its bits are not those of
/// sgemm's N-T form (the header: different forms of one matmul may differ
/// in the last bits).
void gemmTransposed(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                    int64_t ldb, float alpha, bool accumulate, float *c, int64_t ldc) {
  static thread_local Scratch mem;
  const int64_t rows = std::min(m, kTransposedRows);
  const int64_t ld = copyStride(rows, sizeof(float));
  float *at = mem.floats(lineRound(k * ld) + lineRound(n * ld));
  float *ct = at + lineRound(k * ld);
  for (int64_t i0 = 0; i0 < m; i0 += rows) {
    const int64_t mb = std::min(rows, m - i0);
    transposeFloats(a + i0 * lda, lda, mb, k, at, ld);
    gemm(false, false, n, mb, k, b, ldb, at, ld, Elt::F32, alpha, 0.0f, ct, ld);
    float *out = c + i0 * ldc;
    if (!accumulate) {
      transposeFloats(ct, ld, n, mb, out, ldc);
      continue;
    }
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t j = 0; j < n; ++j)
        out[i * ldc + j] += ct[j * ld + i];
  }
}

/// oneDNN's matmul primitive for one fp32 shape: the primitive and memory
/// objects bound to its descriptors, whose buffers each call sets. Null
/// `primitive`: oneDNN runs no brgemm kernels for the shape (its matmul
/// would be the same GEMM as dnnl_sgemm), so sgemm runs it.
struct Matmul {
  dnnl_primitive_t primitive = nullptr;
  dnnl_memory_t a = nullptr, b = nullptr, c = nullptr;
};

/// A thread's matmul primitives, by shape: a primitive is made (its kernels
/// generated, ~0.2 ms) the first time a shape comes, then reused; a layer
/// meets about a hundred row counts an op. Past kMaxShapes shapes the
/// thread's primitives are dropped and made again as they come.
class MatmulCache {
public:
  static constexpr size_t kMaxShapes = 512;
  ~MatmulCache() {
    clear();
    if (onStream)
      dnnl_stream_destroy(onStream);
  }

  /// The primitive of C[m x n] = A[m x k] B^T (+ C with `load`), A, B and C
  /// row-major with strides lda, ldb (B stored n x k) and ldc.
  const Matmul &get(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                    bool load) {
    const std::array<int64_t, 7> key{m, n, k, lda, ldb, ldc, load};
    const auto found = shapes.find(key);
    if (found != shapes.end())
      return found->second;
    if (shapes.size() >= kMaxShapes)
      clear();
    return shapes.emplace(key, make(m, n, k, lda, ldb, ldc, load)).first->second;
  }

  dnnl_stream_t stream() const { return onStream; }

private:
  static dnnl_engine_t engine() {
    static const dnnl_engine_t cpu = [] {
      dnnl_engine_t e = nullptr;
      return dnnl_engine_create(&e, dnnl_cpu, 0) == dnnl_success ? e : nullptr;
    }();
    return cpu;
  }

  Matmul make(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool load) {
    // One thread at a time makes primitives: oneDNN's own cache of them is
    // shared by every thread and its locking is not visible to
    // ThreadSanitizer; this costs only a layer's first steps.
    static std::mutex making;
    const std::lock_guard<std::mutex> hold(making);
    Matmul made;
    dnnl_engine_t cpu = engine();
    if (!cpu || (!onStream &&
                 dnnl_stream_create(&onStream, cpu, dnnl_stream_default_flags) != dnnl_success))
      return made;
    dnnl_memory_desc_t aDesc, bDesc, cDesc;
    const dnnl_dims_t aDims{m, k}, aStrides{lda, 1}, bDims{k, n}, bStrides{1, ldb}, cDims{m, n},
        cStrides{ldc, 1};
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = nullptr;
    dnnl_post_ops_t ops = nullptr;
    dnnl_primitive_desc_t pd = nullptr;
    const char *impl = nullptr;
    bool ok =
        dnnl_memory_desc_init_by_strides(&aDesc, 2, aDims, dnnl_f32, aStrides) == dnnl_success &&
        dnnl_memory_desc_init_by_strides(&bDesc, 2, bDims, dnnl_f32, bStrides) == dnnl_success &&
        dnnl_memory_desc_init_by_strides(&cDesc, 2, cDims, dnnl_f32, cStrides) == dnnl_success &&
        dnnl_matmul_desc_init(&desc, &aDesc, &bDesc, nullptr, &cDesc) == dnnl_success &&
        dnnl_primitive_attr_create(&attr) == dnnl_success;
    if (ok && load)
      ok = dnnl_post_ops_create(&ops) == dnnl_success &&
           dnnl_post_ops_append_sum(ops, 1.0f) == dnnl_success &&
           dnnl_primitive_attr_set_post_ops(attr, ops) == dnnl_success;
    // Its kernels are chosen for the threads it may use: one, as it runs.
    oneThread([&] {
      ok = ok && dnnl_primitive_desc_create(&pd, &desc, attr, cpu, nullptr) == dnnl_success &&
           dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
           impl && std::strncmp(impl, "brg", 3) == 0 &&
           dnnl_primitive_create(&made.primitive, pd) == dnnl_success;
    });
    ok = ok && dnnl_memory_create(&made.a, &aDesc, cpu, DNNL_MEMORY_NONE) == dnnl_success &&
         dnnl_memory_create(&made.b, &bDesc, cpu, DNNL_MEMORY_NONE) == dnnl_success &&
         dnnl_memory_create(&made.c, &cDesc, cpu, DNNL_MEMORY_NONE) == dnnl_success;
    if (pd)
      dnnl_primitive_desc_destroy(pd);
    if (ops)
      dnnl_post_ops_destroy(ops);
    if (attr)
      dnnl_primitive_attr_destroy(attr);
    if (!ok) {
      release(made);
      made = Matmul();
    }
    return made;
  }

  static void release(const Matmul &x) {
    if (x.primitive)
      dnnl_primitive_destroy(x.primitive);
    for (dnnl_memory_t memory : {x.a, x.b, x.c})
      if (memory)
        dnnl_memory_destroy(memory);
  }

  void clear() {
    for (const auto &shape : shapes)
      release(shape.second);
    shapes.clear();
  }

  std::map<std::array<int64_t, 7>, Matmul> shapes;
  dnnl_stream_t onStream = nullptr;
};

/// fp32 C = A B^T (+ C with `accumulate`), B stored n x k, on oneDNN's
/// matmul primitive where it runs brgemm kernels for the shape; false (and
/// nothing done) where it does not. On Zen 4 its brgemm kernels ran the
/// qwen3 gate_grad tile (128 x 2048 x 1536, w1's rows 6 KiB apart) at
/// 102-103 GFLOP/s a thread against sgemm's N-T form at 94-96, a
/// transposed-layout down_proj (128 x 2048 x 768) at 99-101 against 95-98,
/// and N-T products 16 wide or 16 deep (128 x 16 x 2048, 128 x 2048 x 16)
/// 7-25% faster (two threads, each on 32 experts' weights in turn, 88-168
/// rows an expert); sgemm stays for the forward's N-N products (98-100
/// against 108 on up_proj, 92-95 against 94-96 on down_proj), and act_grad
/// keeps its transposed form (transposedSgemm: 101-103 against 98-101
/// here, the steps level).
bool matmulDgrad(int64_t m, int64_t n, int64_t k, const float *a, int64_t lda, const float *b,
                 int64_t ldb, bool accumulate, float *c, int64_t ldc) {
  static thread_local MatmulCache cache;
  const Matmul &mm = cache.get(m, n, k, lda, ldb, ldc, accumulate);
  if (!mm.primitive)
    return false;
#ifdef MOEC_TSAN
  tsanAccess(a, m, k, lda, sizeof(float), false);
  tsanAccess(b, n, k, ldb, sizeof(float), false);
  tsanAccess(c, m, n, ldc, sizeof(float), true);
#endif
  for (const auto &[memory, data] : {std::pair{mm.a, const_cast<float *>(a)},
                                     std::pair{mm.b, const_cast<float *>(b)}, std::pair{mm.c, c}})
    if (dnnl_status_t status = dnnl_memory_set_data_handle(memory, data); status != dnnl_success)
      refused("matmul", m, n, k, status);
  const dnnl_exec_arg_t args[3] = {
      {DNNL_ARG_SRC, mm.a}, {DNNL_ARG_WEIGHTS, mm.b}, {DNNL_ARG_DST, mm.c}};
  dnnl_status_t status;
  oneThread([&] {
    status = dnnl_primitive_execute(mm.primitive, cache.stream(), 3, args);
    if (status == dnnl_success)
      status = dnnl_stream_wait(cache.stream());
  });
  if (status != dnnl_success)
    refused("matmul", m, n, k, status);
  return true;
}

/// B panels of at least this many rows are copied when their stride
/// aliases, for products of at least kRealignRows rows of A: the copy reads
/// each element once, the GEMM reads it once per row of A.
constexpr int64_t kRealignRows = 32;

/// Sets the m x n tile of `c` to zero.
void zeroTile(Matrix c, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i)
    std::memset(c.address(i, 0), 0, size_t(n) * dtypeSize(c.elt));
}

} // namespace

bool packedTile(Elt a, Elt b) {
  return a == b && !(a == Elt::BF16 && !nativeBf16Gemm()) && moecTile(a == Elt::BF16);
}

bool streamedTile(Elt a, Elt b, int64_t m, int64_t n) {
  if (packedTile(a, b))
    return true;
  static const bool intel = __builtin_cpu_is("intel");
  return gemmKernel() == GemmKernel::Auto && a == Elt::F32 && b == Elt::F32 && intel &&
         tile::available(false) && std::min(m, n) > 16;
}

void gemmTile(int64_t m, int64_t n, int64_t k, ConstMatrix a, bool transA, ConstMatrix b,
              bool transB, Matrix c, bool accumulate, Scratch *scratch, float alpha, bool streamC,
              const void *packedB, const tile::DecodedB *decodedB, ConstMatrix addend,
              const tile::LowRank *lowRank) {
  if (m <= 0 || n <= 0)
    return;
  const bool cBf16 = c.elt == Elt::BF16;
  // moec's own tile writes C itself unless it must scale or add onto a bf16
  // C: then its last depth block does (tile::AddScaled), from the sums in
  // registers. Any other way adds onto C: a separate addend is copied there
  // first.
  const bool ownTile = k > 0 && (streamC && !accumulate ? streamedTile(a.elt, b.elt, m, n)
                                                        : packedTile(a.elt, b.elt));
  const bool direct = alpha == 1.0f && !(cBf16 && (accumulate || addend.data));
  if (addend.data && addend.data != c.data && !(ownTile && !direct)) {
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(c.address(i, 0), addend.address(i, 0), size_t(n) * dtypeSize(c.elt));
    accumulate = true;
    addend = ConstMatrix{};
  } else if (addend.data) {
    accumulate = addend.data == c.data;
    addend = accumulate ? ConstMatrix{} : addend;
  }
  if (k <= 0) {
    if (!accumulate)
      zeroTile(c, m, n);
    return;
  }
  // A bf16 operand beside an fp32 one, or two bf16 operands on a CPU
  // without bf16 dot products (where oneDNN's bf16 GEMM is absent or a
  // quarter of sgemm's speed): widen the bf16 operands to fp32 once, then
  // multiply in fp32.
  if (a.elt != b.elt || (a.elt == Elt::BF16 && !nativeBf16Gemm())) {
    static thread_local Scratch widened;
    const int64_t aRows = transA ? k : m, aCols = transA ? m : k;
    const int64_t bRows = transB ? n : k, bCols = transB ? k : n;
    const size_t aSize =
        a.elt == Elt::F32 ? 0 : lineRound(aRows * copyStride(aCols, sizeof(float)));
    const size_t bSize =
        b.elt == Elt::F32 ? 0 : lineRound(bRows * copyStride(bCols, sizeof(float)));
    float *base = widened.floats(aSize + bSize);
    const Panel pa = panel(a, 0, 0, aRows, aCols, base);
    const Panel pb = panel(b, 0, 0, bRows, bCols, base + aSize);
    gemmTile(m, n, k, ConstMatrix{pa.data, Elt::F32, pa.ld}, transA,
             ConstMatrix{pb.data, Elt::F32, pb.ld}, transB, c, accumulate, scratch, alpha,
             streamC);
    return;
  }
  // moec's own tile: packs its operands per depth block, so aliasing strides
  // cost it nothing. It sums into fp32 C in place, or into fp32 scratch when
  // C is bf16 or the sums are scaled or added onto.
  if (ownTile) {
    static thread_local Scratch threadScratch;
    Scratch &mem = scratch ? *scratch : threadScratch;
    const bool bf16 = a.elt == Elt::BF16;
    size_t bytes =
        tile::packBytes(m, n, k, transA, bf16, cBf16, decodedB, !direct, lowRank ? lowRank->k : 0);
    if (lowRank && lowRank->lead)
      bytes = std::max(bytes, tile::leadPackBytes(m, lowRank->k, k, bf16, lowRank->lead->scale));
    float *base = mem.floats(lineRound(int64_t(bytes / 4 + 1)));
    if (direct) {
      tile::gemm(m, n, k, a.data, a.ld, transA, b.data, b.ld, transB, bf16, c.data, c.ld, cBf16,
                 accumulate, base, streamC && !accumulate, packedB, decodedB, nullptr, lowRank);
      return;
    }
    // C = (C or the addend, or nothing) + alpha * the sums, as the sums
    // leave the registers.
    const tile::AddScaled epilogue{alpha, accumulate ? c.data : addend.data,
                                   accumulate ? c.ld : addend.ld};
    tile::gemm(m, n, k, a.data, a.ld, transA, b.data, b.ld, transB, bf16, c.data, c.ld, cBf16,
               false, base, false, packedB, decodedB, &epilogue);
    return;
  }
  // B (the weight of a forward tile) stored k x n with rows that alias in
  // the caches: a copy with a stride that does not, once per call, where
  // oneDNN runs AVX2 kernels (Zen 3: the forward 2-5% faster). Only there:
  // the GEMM packs a stored n x k B (transB) along its rows, and A and the
  // weight-gradient operands were measured not to gain (a copy of a dgrad
  // tile's weight cost 2-9%); and not where oneDNN runs AVX-512 kernels
  // (Zen 4: the fp32 step 0.978-0.983x the time without the copy, steps
  // alternating in one process; the log, 2026-11-28).
  if (!transA && !transB && m >= kRealignRows && k >= kRealignRows && !oneDnnAvx512() &&
      aliasedStride(b.ld, dtypeSize(b.elt))) {
    static thread_local Scratch copies;
    const size_t bytes = size_t(k * copyStride(n, dtypeSize(b.elt))) * dtypeSize(b.elt);
    const ConstMatrix copy =
        realigned(b, k, n, copies.floats((bytes + sizeof(float) - 1) / sizeof(float)));
    gemmTile(m, n, k, a, transA, copy, transB, c, accumulate, scratch, alpha, streamC);
    return;
  }
  // A and B of one storage type, C fp32: one GEMM on the buffers in place
  // (fp32 with B's rows aliasing: as its transpose).
  if (c.elt == Elt::F32 && a.elt == Elt::F32 && transposedSgemm(transA, transB, b.ld)) {
    gemmTransposed(m, n, k, static_cast<const float *>(a.data), a.ld,
                   static_cast<const float *>(b.data), b.ld, alpha, accumulate,
                   static_cast<float *>(c.data), c.ld);
    return;
  }
  // (fp32 dgrad tiles otherwise: on oneDNN's matmul where it runs brgemm
  // kernels for the shape.)
  if (c.elt == Elt::F32 && a.elt == Elt::F32 && !transA && transB && alpha == 1.0f &&
      matmulDgrad(m, n, k, static_cast<const float *>(a.data), a.ld,
                  static_cast<const float *>(b.data), b.ld, accumulate,
                  static_cast<float *>(c.data), c.ld))
    return;
  if (c.elt == Elt::F32) {
    gemm(transA, transB, m, n, k, a.data, a.ld, b.data, b.ld, a.elt, alpha,
         accumulate ? 1.0f : 0.0f, static_cast<float *>(c.data), c.ld);
    return;
  }

  // C is bf16: one GEMM per block of C into an fp32 scratch block, rounded
  // to bf16 once at the end.
  static thread_local Scratch threadScratch;
  Scratch &mem = scratch ? *scratch : threadScratch;
  float *cBuf = mem.floats(lineRound(std::min(m, kBlockM) * std::min(n, kBlockN)));
  for (int64_t i0 = 0; i0 < m; i0 += kBlockM) {
    const int64_t mb = std::min(kBlockM, m - i0);
    for (int64_t j0 = 0; j0 < n; j0 += kBlockN) {
      const int64_t nb = std::min(kBlockN, n - j0);
      if (accumulate)
        for (int64_t i = 0; i < mb; ++i)
          loadFloats(c.address(i0 + i, j0), c.elt, cBuf + i * nb, size_t(nb));
      const ConstMatrix pa = transA ? shifted(a, 0, i0) : shifted(a, i0, 0);
      const ConstMatrix pb = transB ? shifted(b, j0, 0) : shifted(b, 0, j0);
      gemm(transA, transB, mb, nb, k, pa.data, pa.ld, pb.data, pb.ld, a.elt, alpha,
           accumulate ? 1.0f : 0.0f, cBuf, nb);
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

/// An activation-form tile: C = addend + scale * A op(B) over the segment's
/// `rows` (clipped) and `cols`; op(B) = B, or B^T when `transB`.
void activationTile(ConstMatrix a, ConstMatrix b, bool transB, Matrix c, int64_t depth,
                    Segment segment, Range rows, Range cols, Scratch *scratch,
                    const Epilogue &epilogue, const void *packedB,
                    const tile::DecodedB *decodedB) {
  const Range r = clipToSegment(rows, segment);
  if (r.empty() || cols.empty())
    return;
  const int64_t first = segment.offset + r.begin;
  const Matrix out = shifted(c, first, cols.begin);
  const ConstMatrix addend =
      epilogue.addend.data ? shifted(epilogue.addend, first, cols.begin) : ConstMatrix{};
  // A decoded B is shifted in the decoder's coordinates; its data is not read.
  tile::DecodedB decodedCols;
  if (decodedB) {
    decodedCols = *decodedB;
    (transB ? decodedCols.rowOffset : decodedCols.colOffset) += cols.begin;
  }
  // On AMX tiles a bf16 output goes past the caches too (tile::gemm's
  // `stream`, where it writes C whole: no addend, not scaled), though the
  // next op reads it: its lines then are not read from memory first, nor do
  // they push the weight's panels out of L2, and the reader is often
  // another core (the qwen3 step's base GMMs 7-12% faster; the log,
  // 2026-11-27). On Zen 4's avx512_bf16 tile level (the steps 0.988-0.998x
  // the time, alternating in one process; the log, 2026-11-28): left as it
  // was there.
  // (U's own call, a lead product's, decides the same for U.)
  const auto streams = [&](Elt out) {
    return out == Elt::BF16 && a.elt == Elt::BF16 && tile::amx();
  };
  const bool streamOut = streams(c.elt);
  const ConstMatrix weight = decodedB ? b
                             : transB ? shifted(b, cols.begin, 0)
                                      : shifted(b, 0, cols.begin);
  const tile::DecodedB *decoded = decodedB ? &decodedCols : nullptr;
  if (!epilogue.lowV.data) {
    gemmTile(r.size(), cols.size(), depth, shifted(a, first, 0), false, weight, transB, out, false,
             scratch, epilogue.scale, streamOut, packedB, decoded, addend);
    return;
  }
  // A second, low-rank product: U op(V) over the same rows and columns.
  const ConstMatrix u = shifted(epilogue.lowU, first - epilogue.uFirstRow, 0);
  const ConstMatrix v = epilogue.lowTransV ? shifted(epilogue.lowV, cols.begin, 0)
                                           : shifted(epilogue.lowV, 0, cols.begin);
  const bool lead = epilogue.leadB.data != nullptr;
  const Matrix leadU = lead ? shifted(epilogue.leadU, first - epilogue.uFirstRow, 0) : Matrix{};
  if (packedTile(a.elt, b.elt) && u.elt == a.elt && v.elt == a.elt) {
    // moec's tile: in the same call (tile::LowRank), a lead product too.
    const tile::LowRank::Lead leadArgs{leadU.data,         epilogue.leadB.data,
                                       epilogue.leadB.ld,  epilogue.leadTransB,
                                       epilogue.leadScale, epilogue.leadPackedB};
    const tile::LowRank low{u.data,
                            u.ld,
                            v.data,
                            v.ld,
                            epilogue.lowTransV,
                            epilogue.lowDepth,
                            lead ? &leadArgs : nullptr};
    gemmTile(r.size(), cols.size(), depth, shifted(a, first, 0), false, weight, transB, out, false,
             scratch, 1.0f, streamOut, packedB, decoded, ConstMatrix{}, &low);
    return;
  }
  // A lead product: U by the call its own tile would make.
  if (lead)
    gemmTile(r.size(), epilogue.lowDepth, depth, shifted(a, first, 0), false, epilogue.leadB,
             epilogue.leadTransB, leadU, false, scratch, epilogue.leadScale, streams(leadU.elt),
             epilogue.leadPackedB);
  gemmTile(r.size(), cols.size(), depth, shifted(a, first, 0), false, weight, transB, out, false,
           scratch, 1.0f, false, packedB, decoded);
  gemmTile(r.size(), cols.size(), epilogue.lowDepth, u, false, v, epilogue.lowTransV, out, true,
           scratch);
}

} // namespace

void gmmForwardTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                    Range rows, Range cols, Scratch *scratch, const Epilogue &epilogue,
                    const void *packedB, const tile::DecodedB *decodedB) {
  activationTile(a, b, false, c, depth, segment, rows, cols, scratch, epilogue, packedB,
                 decodedB);
}

void gmmDgradTile(ConstMatrix a, ConstMatrix b, Matrix c, int64_t depth, Segment segment,
                  Range rows, Range cols, Scratch *scratch, const Epilogue &epilogue,
                  const void *packedB, const tile::DecodedB *decodedB) {
  activationTile(a, b, true, c, depth, segment, rows, cols, scratch, epilogue, packedB,
                 decodedB);
}

void gmmWgradTile(ConstMatrix a, ConstMatrix b, Matrix c, Segment segment, Range rows, Range cols,
                  bool accumulate, Scratch *scratch) {
  if (rows.empty() || cols.empty())
    return;
  const int64_t m = std::max<int64_t>(segment.rows, 0);
  gemmTile(rows.size(), cols.size(), m, shifted(a, segment.offset, rows.begin), true,
           shifted(b, segment.offset, cols.begin), false, shifted(c, rows.begin, cols.begin),
           accumulate, scratch, 1.0f, /*streamC=*/!accumulate);
}

} // namespace moec::cpu
