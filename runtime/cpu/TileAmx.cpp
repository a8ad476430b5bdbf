//===- TileAmx.cpp - moec's bf16 tile on AMX tiles ------------------------===//
//
// tile::gemm for bf16 A and B on a CPU with AMX-BF16 (Tile.h's AMX
// paragraph says the order of the sums). It reads op(B) in the panels the
// AVX-512 micro-kernel reads (TilePack.h): a panel's 16 columns of 16 units
// are one B tile, rows 192 bytes apart, so a weight packed once (packB) is
// read as it lies.
//
// Tile registers: C in 0-3 (row tile r, column tile c: 2r + c), A in 4-5,
// B in 6-7; every register 16 rows of 64 bytes. A block of C is 32 x 32
// (two row tiles by two column tiles), summed 16 units a step over a depth
// chunk in the registers; its sums wait in memory (fp32, exact) between
// chunks and are written to C after the last.
//
//===----------------------------------------------------------------------===//

#include "runtime/cpu/TilePack.h"

#include "base/Env.h"
#include "runtime/cpu/Element.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#define MOEC_AMX_X86 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace moec::cpu::tile::detail {

namespace {

/// Units a tile step covers (one 64-byte row of an A tile, 16 rows of a B
/// tile) and rows of a tile.
constexpr int64_t kStep = 16;
constexpr int64_t kTileRows = 16;
/// Rows and column tiles of C per block.
constexpr int64_t kBlockRows = 2 * kTileRows;
/// Bytes of one tile.
constexpr size_t kTileBytes = 1024;
/// Whether gemmAmx reads op(A) = A (not transposed) as stored where it
/// can: a C of at most two column tiles (a LoRA adapter's rank-r product,
/// X A), where each A tile is read once per depth chunk, so packing A into
/// tiles first (a pass that writes and reads all of it again) buys nothing.
inline bool directA(int64_t n) { return n <= 32; }

/// Steps of a depth chunk: a row block's chunk of A (32 rows, 128 units:
/// 16 KiB) stays in L1 while the group's column tiles pass over it. (8
/// steps ran 5-15% faster than 16, 32 or the whole depth on the layer's
/// tiles: `gmm_bench --layer`.)
constexpr int64_t kChunkSteps = 8;
/// Steps of a depth chunk in the swapped form (gemmSwapped): a row block of
/// the weight read where it lies, its rows a multiple of 4 KiB apart at the
/// layer's widths, shares few L1 sets; a shorter chunk keeps more of it
/// there (4 steps ran level with 8 to 12% faster on the backward's dX
/// tiles: `gmm_bench --layer`).
constexpr int64_t kSwappedChunkSteps = 4;

size_t lines(size_t bytes) { return (bytes + 63) / 64 * 64; }

/// The working memory's parts, handed out one after the other in the order
/// a layout lists them.
struct Carve {
  char *at;
  template <typename T> T *take(size_t bytes) {
    T *part = reinterpret_cast<T *>(at);
    at += bytes;
    return part;
  }
};

/// Steps of a depth slab (bySlab): B's rows of one slab, packed for every
/// column, stay in L2 (256 bytes a column) while every block passes over
/// them.
constexpr int64_t kSlabSteps = 4;
/// The most bytes of sums bySlab keeps (every row and column of C, in
/// tiles), beside a slab and op(A) in the core's L2.
constexpr size_t kSlabSumsBytes = size_t(1) << 20;

/// Column tiles of a column group.
constexpr int64_t kGroupTiles = kGroup / 16;

/// Whether gemmAmx computes a product row block by row block over all of
/// C's columns: a depth of one tile step (a LoRA adapter's rank-deep
/// product onto the base output, C = base + s U B), whose time is C's
/// reading and writing. Its blocks then walk C's rows from start to end,
/// streams the hardware prefetcher follows, not one column group's part of
/// each row (384 bytes, a row of C apart) after another. B, one step deep,
/// is small: packed whole.
inline bool oneStep(int64_t k, bool decodedB) { return !decodedB && k <= 2 * kStep; }

/// Whether gemmAmx sums a LowRank's products in the registers after the
/// depth's, as further steps of the same blocks, so that C is rounded and
/// written once: where A's depth (k values) ends on a whole step, U's units
/// start a step of their own, and C gets the bits of the plain tile on the
/// concatenation [A | U] [op(B) ; op(V)]. Otherwise the LowRank is a second
/// call, adding onto C.
inline bool fusedLowRank(int64_t k) { return k % (2 * kStep) == 0; }

/// A fused LowRank's operands in the working memory (none without one), in
/// order: U in tiles for C's m rows (or V^T's, a row block's, in the
/// swapped form), V's panels whole for C's n columns (or U^T's), their last
/// step's units. Either form's rows and columns: the larger of each.
struct LowTilesLayout {
  size_t tiles = 0, panels = 0, tail = 0;
  LowTilesLayout(int64_t m, int64_t n, int64_t lowK) {
    if (lowK <= 0)
      return;
    const int64_t steps = ceilDiv(ceilDiv(lowK, 2), kStep), wide = std::max(m, n);
    tiles = size_t(ceilDiv(wide, kTileRows) * steps) * kTileBytes;
    panels = lines(packedBBytes(wide, lowK, true));
    tail = size_t(ceilDiv(wide, kPanel)) * kStep * kPanel * 4;
  }
  size_t total() const { return tiles + panels + tail; }
};

/// The working memory of both AMX forms, in order: B tiles' panels, their
/// last step's units, A in tiles, the sums of the depth chunks before the
/// last, two tiles of sums on their way to C, one panel's part of a decoded
/// B, a fused LowRank's operands (LowTiles); AmxLayout and SwappedLayout
/// size them, carve hands them out.
struct WorkLayout {
  size_t panels = 0, tail = 0, aTiles = 0, sums = 0, cStage = 0, decoded = 0, low = 0;
  size_t total() const { return panels + tail + aTiles + sums + cStage + decoded + low; }
  struct Parts {
    uint32_t *panels, *tail, *aTiles;
    float *sums, *cStage;
    uint16_t *decoded;
  };
  /// The parts before the LowRank's, taken from `carve` (in order: braced
  /// initializers run left to right), which then stands at the LowRank's.
  Parts carve(Carve &carve) const {
    return {carve.take<uint32_t>(panels), carve.take<uint32_t>(tail),
            carve.take<uint32_t>(aTiles), carve.take<float>(sums),
            carve.take<float>(cStage),    carve.take<uint16_t>(decoded)};
  }
};

/// The working memory of gemmAmx (WorkLayout): op(B)'s panels whole (packB's
/// layout; unused when B comes packed; a decoded B's or a transposed B's
/// as stored, one column group's; bySlab's slab and its sums of all of C),
/// the last step's units of a column group's panels (of every panel for a
/// one-step product: oneStep), op(A) in tiles, the sums of the depth
/// chunks before the last (m x a column group, in tiles), two tiles of
/// sums on their way to C, one panel's part of a decoded B, and a fused
/// LowRank's operands (LowTiles).
struct AmxLayout : WorkLayout {
  AmxLayout(int64_t m, int64_t n, int64_t k, bool decodedB, int64_t lowK = 0) {
    const int64_t units = ceilDiv(k, 2), steps = ceilDiv(units, kStep);
    const int64_t width = std::min(n, kGroup);
    panels = lines(packedBBytes(decodedB ? width : n, k, true));
    tail = size_t(ceilDiv(oneStep(k, decodedB) ? n : width, kPanel)) * kStep * kPanel * 4;
    aTiles = size_t(ceilDiv(m, kTileRows) * steps) * kTileBytes;
    sums = steps > kChunkSteps ? size_t(ceilDiv(m, kTileRows) * kGroupTiles) * kTileBytes : 0;
    cStage = 2 * kTileBytes;
    decoded = decodedB ? lines(std::max(decodedBytes(true), decodedBytes(false))) : 0;
    low = LowTilesLayout(m, n, lowK).total();
  }
};

/// The most bytes of op(A)^T's panels the swapped form (swapped) packs:
/// they stay in L2 while every row block of the weight passes over them.
constexpr size_t kSwappedPanelBytes = size_t(1) << 20;

/// Whether gemmAmx computes C as its transpose, C^T = B op(A)^T: a B stored
/// n x k (transB: a weight read transposed, the backward's dX = dY W^T, or
/// the forward of one stored [out, in]), read as stored, neither packed
/// beforehand nor decoded, with an op(A) = A of few rows (an expert's
/// tokens) and a C wider than two column tiles. B's rows are then the rows
/// of A tiles, read along the depth where they lie, and A's rows are packed
/// into panels once, so no copy of the weight is made (C's own form packs
/// a column group of B transposed before the group's products). A B
/// stored k x n, or packed beforehand, reads its panels as before.
inline bool swapped(int64_t m, int64_t n, int64_t k, bool transA, bool transB, bool packedB,
                    bool decodedB) {
  return transB && !transA && !packedB && !decodedB && !oneStep(k, false) && !directA(n) &&
         packedBBytes(m, k, true) <= kSwappedPanelBytes;
}

} // namespace

bool leadInTile(int64_t k, bool transA) { return !transA && fusedLowRank(k); }

namespace {

/// The working memory of the swapped form (WorkLayout): op(A)^T's panels
/// (packB's layout, every column: A's rows), their last step's units, the
/// edges of a row block of B in tiles (gemmSwapped), the sums of the depth chunks
/// before the last (a row block x a column group, in tiles), two tiles of
/// sums on their way to C, a fused LowRank's operands (LowTiles).
struct SwappedLayout : WorkLayout {
  SwappedLayout(int64_t m, int64_t k, int64_t lowK = 0) {
    const int64_t steps = ceilDiv(ceilDiv(k, 2), kStep);
    panels = lines(packedBBytes(m, k, true));
    tail = size_t(ceilDiv(m, kPanel)) * kStep * kPanel * 4;
    aTiles = size_t(2 * steps) * kTileBytes;
    sums = steps > kSwappedChunkSteps ? size_t(2 * kGroupTiles) * kTileBytes : 0;
    cStage = 2 * kTileBytes;
    low = LowTilesLayout(kBlockRows, m, lowK).total();
  }
};

} // namespace

size_t amxPackBytes(int64_t m, int64_t n, int64_t k, bool decodedB, int64_t lowK) {
  // A LowRank not fused (fusedLowRank) is a second call: the larger of the
  // two calls' needs.
  if (lowK > 0 && !fusedLowRank(k))
    return std::max(amxPackBytes(m, n, k, decodedB, 0), amxPackBytes(m, n, lowK, false, 0));
  // packBytes does not know transB: the larger of the forms a call of these
  // shapes may take.
  size_t bytes = AmxLayout(m, n, k, decodedB, lowK).total();
  if (swapped(m, n, k, false, true, false, decodedB))
    bytes = std::max(bytes, SwappedLayout(m, k, lowK).total());
  return bytes;
}

#ifdef MOEC_AMX_X86

#define MOEC_AMX_TARGET                                                                            \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace {

/// Asks the kernel for the AMX tile data state (Linux 5.16 and later):
/// without it the first tile instruction faults.
bool osGrantsAmx() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

/// The lanes [0, count) of a 16-lane vector.
inline __mmask16 firstLanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(count, 0)) - 1);
}

/// What every block of one gemmAmx call reads.
struct Operands {
  int64_t units, steps, fullSteps;
  /// A depth of k values: its units, steps, whole steps; B's panels the
  /// whole depth deep.
  explicit Operands(int64_t k)
      : units(ceilDiv(k, 2)), steps(ceilDiv(units, kStep)), fullSteps(units / kStep),
        panelUnits(units) {}
  // op(A) in tiles: row tile P, step s at packedA + (P * steps + s) * 256.
  const uint32_t *packedA;
  // With `direct` (a narrow C: directA), a row tile's whole steps are read
  // from A as stored (rows lda values apart, a step 32 values), the rest
  // from packedA: the rows past the last whole row tile, and the partial
  // last step (zero past the depth) of the others.
  const uint16_t *direct = nullptr;
  int64_t lda = 0, directRows = 0, directSteps = 0;
  // B of the column group: panels [q][panelUnits][kPanel] holding steps
  // firstStep.. (the whole depth, or a depth slab's: bySlab), and the last
  // step's units of each panel, zero past `units`, [q][kStep][kPanel].
  const uint32_t *panels;
  int64_t panelUnits = 0, firstStep = 0;
  const uint32_t *tail;
};

/// Where the row tile at rows i.. reads A at step s: in packedA (rows 64
/// bytes apart), or in A as stored (aStride).
inline const void *aTile(const Operands &x, int64_t i, int64_t s) {
  if (i < x.directRows && s < x.directSteps)
    return x.direct + i * x.lda + s * 2 * kStep;
  return x.packedA + ((i / kTileRows) * x.steps + s) * kStep * kTileRows;
}

/// The row stride in bytes of the A tile aTile gives.
inline int64_t aStride(const Operands &x, int64_t i, int64_t s) {
  return i < x.directRows && s < x.directSteps ? x.lda * 2 : 64;
}

/// Where column tile `c` of the group reads B at step s (rows 192 bytes
/// apart): its panel's 16 columns, or the tail's at the last, partial step.
inline const void *bTile(const Operands &x, int64_t c, int64_t s) {
  const int64_t q = c / 3, lane = (c % 3) * 16;
  if (s < x.fullSteps)
    return x.panels + (q * x.panelUnits + (s - x.firstStep) * kStep) * kPanel + lane;
  return x.tail + q * kStep * kPanel + lane;
}

/// The last step's units of `panelCount` panels from x.panels on, zero past
/// the depth, into `to`: a B tile reads 16 rows, and those past a panel's
/// depth are the next panel's.
void fillTails(const Operands &x, int64_t panelCount, uint32_t *to) {
  const int64_t first = x.fullSteps * kStep, count = x.units - first;
  const uint32_t *from = x.panels + (first - x.firstStep * kStep) * kPanel;
  for (int64_t q = 0; q < panelCount; ++q, to += kStep * kPanel) {
    std::memcpy(to, from + q * x.panelUnits * kPanel, size_t(count * kPanel) * 4);
    std::memset(to + count * kPanel, 0, size_t((kStep - count) * kPanel) * 4);
  }
}

/// The lines of a B packed beforehand that the next depth chunk reads,
/// fetched into L2 a few at each step of the current chunk's blocks. Its
/// first row block would otherwise wait on memory for each B tile (16 KiB
/// a block, at the tile's rate several times what memory gives a core);
/// spread this way the frozen layers' steps ran 8-11% faster on a 2-core
/// Xeon (docs/performance-log.md). Packed codes are fetched the same way,
/// the next column group's over this one's chunks (FP8 4-7%). (The
/// AVX-512 tile's walk, Tile.cpp's Prefetch handing each block a list of
/// lines, was tried here: 1.03x against this form's 1.09x, one process.)
///
/// The runs (a column group's panels) are walked side by side, a line of
/// each in turn, not one after the other: four streams in flight at once
/// rather than one, which memory serves faster (a core here reads 16 GB/s
/// from four streams, 13 from one). The frozen packed step ran 1.17x
/// faster so, LoRA on it 1.13x (docs/performance-log.md).
struct Ahead {
  /// `runs` runs of `runLines` lines, `stride` bytes apart from `base`.
  const char *base = nullptr;
  int64_t stride = 0, runs = 0, runLines = 0;
  int64_t next = 0, total = 0, perStep = 0;
  /// Where the next line lies: run `run`, `at` bytes into it.
  int64_t run = 0, at = 0;
  /// The next line: the i-th taken is line i / runs of run i % runs.
  const char *take() {
    const char *line = base + run * stride + at;
    if (++run == runs) {
      run = 0;
      at += 64;
    }
    ++next;
    return line;
  }
  /// Spreads the lines over `steps` steps of blocks.
  void spread(int64_t steps) {
    total = runs > 0 && runLines > 0 ? runs * runLines : 0;
    perStep = ceilDiv(total, std::max<int64_t>(steps, 1));
  }
};

/// Loads C's tile register `t` (0-3) from `at` (16 rows 64 bytes apart), or
/// with `store` stores it there. (The tile instructions name their
/// registers in the instruction: one case each.)
MOEC_AMX_TARGET inline void moveTile(int t, float *at, bool store) {
#define MOEC_AMX_MOVE(T)                                                                           \
  case T:                                                                                          \
    if (store)                                                                                     \
      _tile_stored(T, at, 64);                                                                     \
    else                                                                                           \
      _tile_loadd(T, at, 64);                                                                      \
    break;
  switch (t) {
    MOEC_AMX_MOVE(0)
    MOEC_AMX_MOVE(1)
    MOEC_AMX_MOVE(2)
    MOEC_AMX_MOVE(3)
  }
#undef MOEC_AMX_MOVE
}

/// Loads (or, with `store`, stores) C's tile registers of a block of RT x CT
/// tiles from `sums`: row tile r, column tile c at sums + (r * kGroupTiles +
/// c) * 256.
template <int RT, int CT> MOEC_AMX_TARGET inline void moveSums(float *sums, bool store) {
  constexpr int64_t kRowTile = kGroupTiles * 256;
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CT; ++c)
      moveTile(2 * r + c, sums + r * kRowTile + c * 256, store);
}

/// The sums of the block at rows i0.., column tiles c0.. of the group over
/// steps [s0, s1), added onto `sums` (moveSums' layout; null: onto zero;
/// with `onRegisters`, onto the sums in C's tile registers), left in C's
/// tile registers (RT row tiles, CT column tiles).
template <int RT, int CT>
MOEC_AMX_TARGET void block(const Operands &x, int64_t i0, int64_t c0, int64_t s0, int64_t s1,
                           float *sums, Ahead *ahead = nullptr, bool onRegisters = false) {
  if (sums)
    moveSums<RT, CT>(sums, false);
  else if (!onRegisters) {
    _tile_zero(0);
    if constexpr (CT == 2)
      _tile_zero(1);
    if constexpr (RT == 2) {
      _tile_zero(2);
      if constexpr (CT == 2)
        _tile_zero(3);
    }
  }
  constexpr int64_t kBStride = kPanel * 4;
  for (int64_t s = s0; s < s1; ++s) {
    if (ahead)
      for (int64_t j = 0; j < ahead->perStep && ahead->next < ahead->total; ++j)
        _mm_prefetch(ahead->take(), _MM_HINT_T1);
    _tile_loadd(4, aTile(x, i0, s), aStride(x, i0, s));
    _tile_loadd(6, bTile(x, c0, s), kBStride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, bTile(x, c0 + 1, s), kBStride);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, aTile(x, i0 + kTileRows, s), aStride(x, i0 + kTileRows, s));
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT == 2)
        _tile_dpbf16ps(3, 5, 7);
    }
  }
}

/// A fused LowRank's operands (fusedLowRank), as Operands of its depth: U
/// in tiles (C's rows; in the swapped form V^T's rows of a row block), and
/// V's panels whole with their last step's units (C's columns; in the
/// swapped form U^T's), each column group's found by forGroup.
struct LowTiles {
  int64_t k;
  Operands x;
  uint32_t *tiles = nullptr, *panels = nullptr, *tail = nullptr;
  explicit LowTiles(int64_t lowK) : k(lowK), x(lowK) {}
  /// Takes its parts of the working memory (LowTilesLayout(rows, columns,
  /// k)): the tiles, for the caller to fill, and op(V)'s panels for
  /// `columns` columns (k x columns: v(p, j), or v(j, p) when `transV`),
  /// packed there with their last step's units.
  void pack(Carve &carve, int64_t rows, int64_t columns, const void *v, int64_t ldv, bool transV) {
    const LowTilesLayout layout(rows, columns, k);
    tiles = carve.take<uint32_t>(layout.tiles);
    panels = carve.take<uint32_t>(layout.panels);
    tail = carve.take<uint32_t>(layout.tail);
    x.packedA = tiles;
    x.panels = panels;
    packB(columns, k, v, ldv, transV, true, panels);
    if (x.fullSteps < x.steps)
      fillTails(x, ceilDiv(columns, kPanel), tail);
  }
  /// Points x at the column group starting at column j0.
  void forGroup(int64_t j0) {
    x.panels = panels + (j0 / kPanel) * x.units * kPanel;
    x.tail = tail + (j0 / kPanel) * kStep * kPanel;
  }
};

/// block() on `rowTiles` x `colTiles` tiles (1 or 2 each) over steps
/// [s0, s1), onto the sums waiting at `blockSums` (moveSums' layout; from
/// zero at s0 = 0), left in C's tile registers, and before the last chunk
/// (`last` false) stored back there for the next; after the last, a fused
/// LowRank's steps (`low`) onto them.
MOEC_AMX_TARGET inline void sumBlock(const Operands &x, int rowTiles, int colTiles, int64_t i0,
                                     int64_t c0, int64_t s0, int64_t s1, float *blockSums,
                                     bool last, Ahead *ahead, const LowTiles *low = nullptr) {
  const auto run = [&](auto rows, auto cols) {
    block<rows(), cols()>(x, i0, c0, s0, s1, s0 > 0 ? blockSums : nullptr, ahead);
    if (!last)
      moveSums<rows(), cols()>(blockSums, true);
    else if (low)
      block<rows(), cols()>(low->x, i0, c0, 0, low->x.steps, nullptr, nullptr, true);
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (rowTiles == 2)
    colTiles == 2 ? run(Two(), Two()) : run(Two(), One());
  else
    colTiles == 2 ? run(One(), Two()) : run(One(), One());
}

/// What the block's sums become in C: gemm's `load`, `addScaled` and the
/// rounding to a bf16 C, per row of a 16 x 16 tile of sums in `stage`.
struct Epilogue {
  char *c;
  int64_t ldc;
  bool cBf16, load, stream;
  const AddScaled *scaled;

  /// Writes the sums of `stage` to C rows [i, i + rows), columns [j, j + cols).
  MOEC_AMX_TARGET void write(const float *stage, int64_t i, int64_t rows, int64_t j,
                             int64_t cols) const {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __mmask16 mask = firstLanes(cols);
    // Everything the rows read of this and of `scaled` in locals: the
    // stores to C go through char pointers, which may alias them as far as
    // the compiler knows, so it would read them again every row.
    const bool bf16 = cBf16, loadC = load, streamC = stream && cols == 16;
    const int64_t elt = bf16 ? 2 : 4, cStride = ldc * elt;
    char *at = c + (i * ldc + j) * elt;
    const bool scale = scaled != nullptr;
    const float alpha = scale ? scaled->alpha : 1.0f;
    const char *addend = scale && scaled->addend ? static_cast<const char *>(scaled->addend) +
                                                       (i * scaled->ld + j) * elt
                                                 : nullptr;
    const int64_t addendStride = addend ? scaled->ld * elt : 0;
    // Every row's C and addend read before any row is written (a LoRA
    // product onto a base output in L2 ran 6-14% faster): C's rows lie a
    // multiple of 512 bytes apart at the layer's widths, where a row's load
    // can wait behind the store of a row a few before it (4K aliasing).
    __m512 out[kTileRows];
    const char *from = at;
    for (int64_t row = 0; row < rows; ++row, from += cStride, addend += addendStride) {
      __m512 v = _mm512_load_ps(stage + row * 16);
      if (loadC)
        v = _mm512_add_round_ps(_mm512_maskz_loadu_ps(mask, reinterpret_cast<const float *>(from)),
                                v, kNearest);
      if (scale)
        v = scaleAdd16(v, alpha, addend, bf16, mask);
      out[row] = v;
    }
    for (int64_t row = 0; row < rows; ++row, at += cStride) {
      const __m512 v = out[row];
      if (bf16)
        _mm256_mask_storeu_epi16(at, mask, bf16Packed16(v));
      else if (streamC && (reinterpret_cast<uintptr_t>(at) & 63) == 0)
        _mm512_stream_ps(reinterpret_cast<float *>(at), v);
      else
        _mm512_mask_storeu_ps(reinterpret_cast<float *>(at), mask, v);
    }
  }

  /// Writes a bf16 C's rows [i, i + rows), columns [j, j + 32) from the two
  /// 16 x 16 tiles of sums at `stage` (columns j.. and j + 16..), without
  /// `load` or `scaled`: a row's 64 bytes with a non-temporal store where
  /// they are one line, else with a plain one. The bits of write().
  MOEC_AMX_TARGET void streamLines(const float *stage, int64_t i, int64_t rows, int64_t j) const {
    for (int64_t row = 0; row < rows; ++row) {
      const __m256i lo = bf16Packed16(_mm512_load_ps(stage + row * 16));
      const __m256i hi = bf16Packed16(_mm512_load_ps(stage + 256 + row * 16));
      const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      char *at = c + ((i + row) * ldc + j) * 2;
      if ((reinterpret_cast<uintptr_t>(at) & 63) == 0)
        _mm512_stream_si512(reinterpret_cast<__m512i *>(at), line);
      else
        _mm512_storeu_si512(at, line);
    }
  }
};

/// Packs op(A) = a^T (a stored k x m, bf16, row stride lda) into tiles:
/// row tile P, step s at dst + (P * steps + s) * 256 units, row i's 16 units
/// one after the other; zero past m and past the depth.
MOEC_AMX_TARGET void packATransposed(const uint16_t *a, int64_t lda, int64_t m, int64_t k,
                                     int64_t steps, uint32_t *dst) {
  for (int64_t i0 = 0; i0 < m; i0 += kTileRows) {
    const __mmask16 rowsMask = firstLanes(m - i0);
    for (int64_t s = 0; s < steps; ++s) {
      __m512i r[16];
      for (int64_t t = 0; t < kStep; ++t) {
        const int64_t p = 2 * (s * kStep + t);
        const __m512i lo =
            p < k ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rowsMask, a + p * lda + i0))
                  : _mm512_setzero_si512();
        const __m512i hi =
            p + 1 < k
                ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rowsMask, a + (p + 1) * lda + i0))
                : _mm512_setzero_si512();
        r[t] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      }
      transpose16(r);
      uint32_t *tileAt = dst + ((i0 / kTileRows) * steps + s) * kStep * kTileRows;
      for (int64_t row = 0; row < kTileRows; ++row)
        _mm512_store_si512(tileAt + row * kStep, r[row]);
    }
  }
}

/// Packs op(A) = a (stored m x k, bf16, row stride lda) into tiles, as
/// packATransposed lays them out: the rows from `fromRow` on whole, and
/// those before it from step `fromStep` on.
MOEC_AMX_TARGET void packARows(const uint16_t *a, int64_t lda, int64_t m, int64_t k, int64_t steps,
                               uint32_t *dst, int64_t fromRow = 0, int64_t fromStep = 0) {
  // Row by row, each read from its start to its end (streams the hardware
  // prefetcher follows), a tile's row at a time.
  const int64_t rowTiles = ceilDiv(m, kTileRows);
  for (int64_t i = 0; i < rowTiles * kTileRows; ++i) {
    uint32_t *rowAt = dst + (i / kTileRows) * steps * kStep * kTileRows + (i % kTileRows) * kStep;
    for (int64_t s = i < fromRow ? fromStep : 0; s < steps; ++s) {
      const int64_t p = 2 * kStep * s;
      const __mmask32 values =
          k - p >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (k - p)) - 1);
      const __m512i v =
          i < m ? _mm512_maskz_loadu_epi16(values, a + i * lda + p) : _mm512_setzero_si512();
      _mm512_store_si512(rowAt + s * kStep * kTileRows, v);
    }
  }
}

/// 64-byte aligned memory a thread keeps for its next call (a lead
/// product's operands), grown as asked.
struct ThreadBuffer {
  void *data = nullptr;
  size_t bytes = 0;
  ~ThreadBuffer() { std::free(data); }
  void *get(size_t size) {
    if (bytes < size) {
      std::free(data);
      data = std::aligned_alloc(64, lines(size));
      bytes = data ? lines(size) : 0;
      if (!data) {
        std::fprintf(stderr, "moec: out of memory for a lead product's operands\n");
        std::abort();
      }
    }
    return data;
  }
};

/// U's epilogue for a lead product: bf16 rows ldu apart, scaled as U's own
/// call scales them (`storage` holds the AddScaled).
inline Epilogue leadEpilogue(const LowRank::Lead &lead, int64_t ldu, AddScaled *storage) {
  return Epilogue{static_cast<char *>(lead.u), ldu, true, false, false, lead.scaled(storage)};
}

/// A LowRank's lead product in the swapped form (gemmSwapped): U^T =
/// scale * op(lead.b)^T op(A)^T, op(A)^T's columns the panels `x` holds (A's
/// m rows, packB's layout), op(lead.b)^T's r rows packed into one row tile
/// here; each 16 x 16 tile of U^T transposed through `stage` (512 floats)
/// and written to U's rows by U's epilogue. The same products in the same
/// order as U's own call (Tile.h's AMX paragraph), so the same bits.
MOEC_AMX_TARGET void leadProductSwapped(const Operands &x, int64_t m, int64_t k, int64_t r,
                                        int64_t ldu, const LowRank::Lead &lead, float *stage) {
  static thread_local ThreadBuffer tiles;
  uint32_t *rows = static_cast<uint32_t *>(tiles.get(size_t(x.steps) * kTileBytes));
  const uint16_t *l = static_cast<const uint16_t *>(lead.b);
  if (lead.transB) // stored r x k: op(b)^T's rows as they lie
    packARows(l, lead.ldb, r, k, x.steps, rows);
  else
    packATransposed(l, lead.ldb, r, k, x.steps, rows);
  Operands ux = x;
  ux.packedA = rows;
  ux.direct = nullptr;
  ux.directRows = ux.directSteps = 0;
  AddScaled scaled;
  const Epilogue out = leadEpilogue(lead, ldu, &scaled);
  for (int64_t c = 0; c < ceilDiv(m, kTileRows); ++c) {
    block<1, 1>(ux, 0, c, 0, ux.steps, nullptr);
    moveTile(0, stage, true);
    for (int64_t i = 0; i < kTileRows; ++i)
      for (int64_t j = 0; j < kTileRows; ++j)
        stage[256 + i * 16 + j] = stage[j * 16 + i];
    out.write(stage + 256, c * kTileRows, std::min(kTileRows, m - c * kTileRows), 0, r);
  }
}

/// The swapped form of gemmAmx (swapped(): C = A B^T as C^T = B A^T).
/// B's rows are the A tiles' rows, read where they lie, 32 at a time (a row
/// block: 32 columns of C), the next row block's lines fetched into L2 over
/// this one's blocks, four runs side by side where the rows lie one after
/// the other (as Ahead says, four streams are served faster than one, or
/// than 32 rows'); A's rows are the B tiles' columns, packed once into
/// panels. Each block's sums are C^T's, transposed 16 x 16 on their way to
/// C. A tile dot product multiplies its two operands' values pairwise, so
/// each element of C is the same sum of the same products in the same
/// depth order as in C's own form: the same bits.
MOEC_AMX_TARGET void gemmSwapped(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda,
                                 const uint16_t *b, int64_t ldb, const Epilogue &epilogue,
                                 void *pack, const LowRank *lowRank) {
  const int64_t lowK = lowRank ? lowRank->k : 0;
  const SwappedLayout layout(m, k, lowK);
  Carve carve{static_cast<char *>(pack)};
  const WorkLayout::Parts parts = layout.carve(carve);
  uint32_t *panels = parts.panels, *tail = parts.tail, *edges = parts.aTiles;
  float *sums = parts.sums, *cStage = parts.cStage;
  LowTiles low(lowK);
  Operands x(k);
  x.packedA = edges;
  x.lda = ldb;
  x.directSteps = k / (2 * kStep);
  const int64_t panelStride = x.units * kPanel;
  // A's rows as op(B)'s columns: packB's panels of a B stored n x k.
  packB(m, k, a, lda, true, true, panels);
  x.panels = panels;
  x.tail = tail;
  if (x.fullSteps < x.steps)
    fillTails(x, ceilDiv(m, kPanel), tail);
  // A fused LowRank, as its transpose: V^T's rows (a row block's at a time)
  // in tiles, U's rows as op(V)'s columns; a lead product's U first, from
  // A's panels just made.
  if (lowRank) {
    if (lowRank->lead)
      leadProductSwapped(x, m, k, lowK, lowRank->ldu, *lowRank->lead, cStage);
    low.pack(carve, kBlockRows, m, lowRank->u, lowRank->ldu, true);
  }
  const bool streamLines = epilogue.cBf16 && epilogue.stream && !epilogue.load && !epilogue.scaled;
  const int64_t blockSteps = ceilDiv(ceilDiv(m, 16), 2) * x.steps;
  constexpr int64_t kRuns = 4;
  for (int64_t r0 = 0; r0 < n; r0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, n - r0);
    const int rowTiles = rows > kTileRows ? 2 : 1;
    // The row block's whole tiles where they lie; its edges (rows past the
    // last whole row tile, the partial last step) packed, zero past B.
    x.direct = b + r0 * ldb;
    x.directRows = rows / kTileRows * kTileRows;
    packARows(x.direct, ldb, rows, k, x.steps, edges, x.directRows, x.directSteps);
    if (lowRank) {
      const uint16_t *v = static_cast<const uint16_t *>(lowRank->v);
      if (lowRank->transV)
        packARows(v + r0 * lowRank->ldv, lowRank->ldv, rows, lowK, low.x.steps, low.tiles);
      else
        packATransposed(v + r0, lowRank->ldv, rows, lowK, low.x.steps, low.tiles);
    }
    Ahead ahead;
    if (r0 + kBlockRows < n) {
      ahead.base = reinterpret_cast<const char *>(b + (r0 + kBlockRows) * ldb);
      ahead.stride = ldb * 2;
      ahead.runs = std::min(kBlockRows, n - r0 - kBlockRows);
      ahead.runLines = ceilDiv(k * 2, 64);
      if (ldb == k && ahead.runs == kBlockRows) {
        ahead.runs = kRuns;
        ahead.stride *= kBlockRows / kRuns;
        ahead.runLines = ceilDiv(k * 2 * (kBlockRows / kRuns), 64);
      }
    }
    ahead.spread(blockSteps);
    for (int64_t j0 = 0; j0 < m; j0 += kGroup) {
      const int64_t nb = std::min(kGroup, m - j0), colTiles = ceilDiv(nb, 16);
      x.panels = panels + (j0 / kPanel) * panelStride;
      x.tail = tail + (j0 / kPanel) * kStep * kPanel;
      if (lowRank)
        low.forGroup(j0);
      for (int64_t s0 = 0; s0 < x.steps; s0 += kSwappedChunkSteps) {
        const int64_t s1 = std::min(x.steps, s0 + kSwappedChunkSteps);
        const bool last = s1 == x.steps;
        for (int64_t c0 = 0; c0 < colTiles; c0 += 2) {
          const int colTilesHere = colTiles - c0 > 1 ? 2 : 1;
          sumBlock(x, rowTiles, colTilesHere, 0, c0, s0, s1, sums + c0 * 256, last,
                   ahead.total ? &ahead : nullptr, lowRank ? &low : nullptr);
          if (!last)
            continue;
          // Tile (r, ct) holds C^T's rows r0 + 16 r.. (C's columns) and
          // columns j0 + 16 (c0 + ct).. (C's rows): each transposed into
          // the stage, the two row tiles' side by side (C's 32 columns).
          for (int ct = 0; ct < colTilesHere; ++ct) {
            const int64_t i = j0 + 16 * (c0 + ct), cRows = std::min<int64_t>(16, m - i);
            for (int r = 0; r < rowTiles; ++r) {
              float *stage = cStage + r * 256;
              moveTile(2 * r + ct, stage, true);
              __m512i v[16];
              for (int row = 0; row < 16; ++row)
                v[row] = _mm512_load_si512(stage + row * 16);
              transpose16(v);
              for (int row = 0; row < 16; ++row)
                _mm512_store_si512(stage + row * 16, v[row]);
            }
            if (streamLines && rows == kBlockRows) {
              epilogue.streamLines(cStage, i, cRows, r0);
              continue;
            }
            for (int r = 0; r < rowTiles; ++r)
              epilogue.write(cStage + r * 256, i, cRows, r0 + 16 * r,
                             std::min<int64_t>(16, rows - 16 * r));
          }
        }
      }
    }
  }
}

} // namespace

} // namespace moec::cpu::tile::detail

namespace moec::cpu::tile {

bool amx() {
  static const bool on = envAutoOrOff("MOEC_AMX") && __builtin_cpu_supports("amx-tile") &&
                         __builtin_cpu_supports("amx-bf16") && available(true) &&
                         detail::osGrantsAmx();
  return on;
}

} // namespace moec::cpu::tile

namespace moec::cpu::tile::detail {

MOEC_AMX_TARGET void configureAmxTiles() {
  struct alignas(64) {
    uint8_t palette = 1, startRow = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  static_assert(kTileRows == 16 && kStep * 4 == 64, "a register is 16 rows of 64 bytes");
  _tile_loadconfig(&config);
}

namespace {

/// A LowRank's lead product in the tile (LowRank::Lead, leadInTile): U =
/// scale * op(A) op(lead.b) for rows [0, m), from op(A)'s tiles `x` (as the
/// product reads them), written to lead.u through `epilogueStage` (a
/// tile's sums). Each element is the sum, from zero, of its tile steps in
/// depth order, rounded once, as gemm's own call on these operands has it.
MOEC_AMX_TARGET void leadProduct(const Operands &x, int64_t m, int64_t k, int64_t r, int64_t ldu,
                                 const LowRank::Lead &lead, float *epilogueStage) {
  // op(lead.b)'s one panel: packed beforehand, else packed here (k x r
  // values, 192 KiB at k 2048, kept by the thread for its next call).
  static thread_local ThreadBuffer own;
  const uint32_t *panel = static_cast<const uint32_t *>(lead.packedB);
  if (!panel) {
    void *to = own.get(packedBBytes(r, k, true));
    // packB writes every unit of the r columns; the panel's other lanes
    // feed only columns past r, which are not written.
    packB(r, k, lead.b, lead.ldb, lead.transB, true, to);
    panel = static_cast<const uint32_t *>(to);
  }
  alignas(64) uint32_t tail[kStep * kPanel];
  Operands ux = x;
  ux.panels = panel;
  ux.panelUnits = x.units;
  ux.firstStep = 0;
  ux.tail = tail;
  if (ux.fullSteps < ux.steps)
    fillTails(ux, 1, tail);
  AddScaled scaled;
  const Epilogue out = leadEpilogue(lead, ldu, &scaled);
  for (int64_t i0 = 0; i0 < m; i0 += kBlockRows) {
    const bool two = m - i0 > kTileRows;
    if (two)
      block<2, 1>(ux, i0, 0, 0, ux.steps, nullptr);
    else
      block<1, 1>(ux, i0, 0, 0, ux.steps, nullptr);
    moveTile(0, epilogueStage, true);
    out.write(epilogueStage, i0, std::min(kTileRows, m - i0), 0, r);
    if (two) {
      moveTile(2, epilogueStage, true);
      out.write(epilogueStage, i0 + kTileRows, std::min(kTileRows, m - i0 - kTileRows), 0, r);
    }
  }
}

} // namespace

MOEC_AMX_TARGET void gemmAmx(int64_t m, int64_t n, int64_t k, const void *a, int64_t lda,
                             bool transA, const void *b, int64_t ldb, bool transB, void *c,
                             int64_t ldc, bool cBf16, bool load, void *pack, bool stream,
                             const void *packedB, const DecodedB *decodedB,
                             const AddScaled *addScaled, const LowRank *lowRank) {
  // A LowRank that does not start a step of its own: a second call, adding
  // onto C, which reads C back (so the first does not stream it past the
  // caches; the second, an AddScaled, writes it through them).
  if (lowRank && !fusedLowRank(k)) {
    gemmAmx(m, n, k, a, lda, transA, b, ldb, transB, c, ldc, cBf16, load, pack, false, packedB,
            decodedB, addScaled, nullptr);
    const AddScaled onto{1.0f, c, ldc};
    gemmAmx(m, n, lowRank->k, lowRank->u, lowRank->ldu, false, lowRank->v, lowRank->ldv,
            lowRank->transV, c, ldc, cBf16, false, pack, false, nullptr, nullptr, &onto, nullptr);
    return;
  }
  const Epilogue epilogue{static_cast<char *>(c), ldc, cBf16, load, stream, addScaled};
  if (swapped(m, n, k, transA, transB, packedB != nullptr, decodedB != nullptr)) {
    configureAmxTiles();
    gemmSwapped(m, n, k, static_cast<const uint16_t *>(a), lda, static_cast<const uint16_t *>(b),
                ldb, epilogue, pack, lowRank);
    _tile_release();
    if (stream)
      _mm_sfence();
    return;
  }
  constexpr int64_t chunk = kChunkSteps;
  const int64_t lowK = lowRank ? lowRank->k : 0;
  const AmxLayout layout(m, n, k, decodedB != nullptr, lowK);
  Carve carve{static_cast<char *>(pack)};
  const WorkLayout::Parts parts = layout.carve(carve);
  uint32_t *panels = parts.panels, *tail = parts.tail, *packedA = parts.aTiles;
  float *sums = parts.sums, *cStage = parts.cStage;
  uint16_t *decoded = parts.decoded;
  LowTiles low(lowK);
  if (lowRank)
    low.pack(carve, m, n, lowRank->v, lowRank->ldv, lowRank->transV);

  Operands x(k);
  x.packedA = packedA;
  x.tail = tail;
  // Panels (packB's layout) lie this many units apart.
  const int64_t panelStride = x.units * kPanel;
  configureAmxTiles();
  // op(A) into tiles once for every column group: a tile's rows then lie
  // 64 bytes apart, not a row of A apart (a multiple of 4 KiB for the
  // layer's widths, on one set of the L1 cache).
  if (transA)
    packATransposed(static_cast<const uint16_t *>(a), lda, m, k, x.steps, packedA);
  else if (directA(n)) {
    x.direct = static_cast<const uint16_t *>(a);
    x.lda = lda;
    x.directRows = m / kTileRows * kTileRows;
    x.directSteps = k / (2 * kStep);
    packARows(x.direct, lda, m, k, x.steps, packedA, x.directRows, x.directSteps);
  } else
    packARows(static_cast<const uint16_t *>(a), lda, m, k, x.steps, packedA);
  // A lead product (tile::gemm hands it here where leadInTile): U from the
  // tiles of op(A) just made, then U into the low-rank product's tiles.
  if (lowRank) {
    if (lowRank->lead)
      leadProduct(x, m, k, lowK, lowRank->ldu, *lowRank->lead, cStage);
    packARows(static_cast<const uint16_t *>(lowRank->u), lowRank->ldu, m, lowK, low.x.steps,
              low.tiles);
  }
  // The forms of B, each read by the products from `x.panels`:
  // - packed beforehand (packB): read where it lies;
  // - as stored, not transposed: a depth slab at a time for every column,
  //   into panels that stay in L2 (bySlab, below), or, where C's sums do
  //   not fit beside a slab, packed whole, once, into the panels packB makes
  //   (either way B's rows read from start to end: packed a column group at
  //   a time, B's rows were read in pieces of a group's width and the
  //   packing took more time than the products).
  // - as stored, transposed (B's rows are op(B)'s columns): a column
  //   group's rows lie together, so each group is packed just before its
  //   products, into panels that stay in L2;
  // - decoded: a column group at a time, a panel and a depth block at a
  //   time through `decoded` (in L1), into the group's panels (in L2) just
  //   before its products.
  const auto decodeGroup = [&](int64_t j0, int64_t nb) {
    const int64_t depth = 2 * kBlockUnits;
    for (int64_t c0 = j0; c0 < j0 + nb; c0 += kPanel) {
      uint32_t *panel = panels + ((c0 - j0) / kPanel) * panelStride;
      for (int64_t p0 = 0; p0 < k; p0 += depth)
        decodePanel(*decodedB, transB, c0, std::min<int64_t>(kPanel, j0 + nb - c0), p0,
                    std::min(k, p0 + depth), panel + (p0 / 2) * kPanel, decoded);
    }
  };
  const bool shallow = oneStep(k, decodedB != nullptr);
  const bool packByGroup = !decodedB && !packedB && transB && !shallow;
  // A B as stored, not transposed, deeper than a slab, where C's sums fit
  // beside a slab in L2: packed a depth slab at a time (B's rows read from
  // start to end, as packB reads them), and every column group's blocks
  // pass over the slab while it is in L2; the sums of every block wait in
  // `slabSums` between slabs. Packed whole, B would go to memory and back
  // (6 MiB for up_proj), before the products read it once more.
  const int64_t groups = ceilDiv(n, kGroup);
  const size_t slabBytes = lines(size_t(ceilDiv(n, kPanel) * kSlabSteps * kStep * kPanel) * 4);
  const size_t groupSumsFloats = size_t(ceilDiv(m, kTileRows) * kGroupTiles) * 256;
  const size_t slabSumsBytes = size_t(groups) * groupSumsFloats * 4;
  const bool bySlab = !decodedB && !packedB && !transB && !shallow && x.steps > kSlabSteps &&
                      slabSumsBytes <= kSlabSumsBytes && slabBytes + slabSumsBytes <= layout.panels;
  if (!decodedB && !packedB && !packByGroup && !bySlab) {
    packB(n, k, b, ldb, transB, true, panels);
    packedB = panels;
  }
  // The blocks of rows i0.. (kBlockRows) over the group at j0 (nb wide),
  // depth chunk [s0, s1): their sums wait in `groupSums` (`sums`, or the
  // group's part of bySlab's) before the last chunk, which writes them to C.
  float *groupSums = sums;
  Ahead ahead;
  const auto rowBlock = [&](int64_t i0, int64_t j0, int64_t nb, int64_t s0, int64_t s1) {
    const int64_t colTiles = ceilDiv(nb, 16);
    if (lowRank)
      low.forGroup(j0);
    const int rowTiles = m - i0 > kTileRows ? 2 : 1;
    for (int64_t c0 = 0; c0 < colTiles; c0 += 2) {
      const int colTilesHere = colTiles - c0 > 1 ? 2 : 1;
      const bool last = s1 == x.steps;
      sumBlock(x, rowTiles, colTilesHere, i0, c0, s0, s1,
               groupSums + ((i0 / kTileRows) * kGroupTiles + c0) * 256, last,
               ahead.total ? &ahead : nullptr, lowRank ? &low : nullptr);
      if (!last)
        continue;
      // A streamed bf16 C: a row of the block's two column tiles is one
      // 64-byte line, written whole around the caches.
      if (cBf16 && stream && !load && !addScaled && nb - 16 * c0 >= 32) {
        for (int r = 0; r < rowTiles; ++r) {
          moveTile(2 * r, cStage, true);
          moveTile(2 * r + 1, cStage + 256, true);
          const int64_t i = i0 + r * kTileRows;
          epilogue.streamLines(cStage, i, std::min(kTileRows, m - i), j0 + 16 * c0);
        }
        continue;
      }
      for (int r = 0; r < rowTiles; ++r)
        for (int ct = 0; ct < colTilesHere; ++ct) {
          moveTile(2 * r + ct, cStage, true);
          const int64_t i = i0 + r * kTileRows, j = 16 * (c0 + ct);
          epilogue.write(cStage, i, std::min(kTileRows, m - i), j0 + j,
                         std::min<int64_t>(16, nb - j));
        }
    }
  };
  if (shallow) {
    // One step: row block by row block, each over every column group.
    x.panels = static_cast<const uint32_t *>(packedB);
    if (x.fullSteps < x.steps)
      fillTails(x, ceilDiv(n, kPanel), tail);
    for (int64_t i0 = 0; i0 < m; i0 += kBlockRows)
      for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
        x.panels = static_cast<const uint32_t *>(packedB) + (j0 / kPanel) * panelStride;
        x.tail = tail + (j0 / kPanel) * kStep * kPanel;
        rowBlock(i0, j0, std::min(kGroup, n - j0), 0, x.steps);
      }
  }
  if (bySlab) {
    uint32_t *slab = panels;
    float *slabSums = reinterpret_cast<float *>(reinterpret_cast<char *>(panels) + slabBytes);
    x.panelUnits = kSlabSteps * kStep;
    for (int64_t s0 = 0; s0 < x.steps; s0 += kSlabSteps) {
      const int64_t s1 = std::min(x.steps, s0 + kSlabSteps);
      packRows(b, ldb, s0 * 2 * kStep, std::min(k, s1 * 2 * kStep), n, true, slab, kPanel, kPanel,
               x.panelUnits * kPanel);
      x.firstStep = s0;
      for (int64_t j0 = 0; j0 < n; j0 += kGroup) {
        const int64_t nb = std::min(kGroup, n - j0);
        x.panels = slab + (j0 / kPanel) * x.panelUnits * kPanel;
        if (s1 == x.steps && x.fullSteps < x.steps)
          fillTails(x, ceilDiv(nb, kPanel), tail);
        groupSums = slabSums + size_t(j0 / kGroup) * groupSumsFloats;
        for (int64_t i0 = 0; i0 < m; i0 += kBlockRows)
          rowBlock(i0, j0, nb, s0, s1);
      }
    }
  }
  for (int64_t j0 = 0; j0 < n && !shallow && !bySlab; j0 += kGroup) {
    const int64_t nb = std::min(kGroup, n - j0);
    if (decodedB)
      decodeGroup(j0, nb);
    else if (packByGroup)
      packTransposed(static_cast<const uint16_t *>(b) + j0 * ldb, ldb, nb, 0, k, true, panels,
                     panelStride);
    x.panels = decodedB || packByGroup
                   ? panels
                   : static_cast<const uint32_t *>(packedB) + (j0 / kPanel) * panelStride;
    if (x.fullSteps < x.steps)
      fillTails(x, ceilDiv(nb, kPanel), tail);
    // Per depth chunk, each row block of A (its chunk in L1) passes over
    // the group's columns; the sums of a chunk before the last wait in
    // `sums`, the last chunk's go to C.
    for (int64_t s0 = 0; s0 < x.steps; s0 += chunk) {
      const int64_t s1 = std::min(x.steps, s0 + chunk);
      // What this chunk's blocks fetch for later ones (Ahead).
      ahead = Ahead();
      const int64_t blockSteps = ceilDiv(m, kBlockRows) * ceilDiv(ceilDiv(nb, 16), 2) * (s1 - s0);
      if (packedB && !decodedB && !packByGroup) {
        // B packed beforehand: the next chunk, this group's steps from s1
        // on or the next group's first (a partial last step's tail is
        // copied, not read there).
        int64_t g = j0, a0 = s1;
        if (s1 >= x.fullSteps) {
          g = j0 + kGroup;
          a0 = 0;
        }
        const int64_t a1 = std::min(x.fullSteps, a0 + chunk);
        if (g < n && a1 > a0) {
          ahead.base =
              reinterpret_cast<const char *>(static_cast<const uint32_t *>(packedB) +
                                             (g / kPanel) * panelStride + a0 * kStep * kPanel);
          ahead.stride = panelStride * 4;
          ahead.runs = ceilDiv(std::min(kGroup, n - g), kPanel);
          ahead.runLines = (a1 - a0) * kStep * kPanel * 4 / 64;
        }
      } else if (decodedB && decodedB->panel && decodedB->codes && j0 + kGroup < n) {
        // Packed codes (decodeGroup decodes a group's whole depth before
        // its products): this chunk's share of the next group's codes.
        const DecodedB &d = *decodedB;
        const int64_t g = j0 + kGroup;
        ahead.base = reinterpret_cast<const char *>(d.codes) + (g / kPanel) * d.codesLd;
        ahead.stride = d.codesLd;
        ahead.runs = ceilDiv(std::min(kGroup, n - g), kPanel);
        const int64_t lines = ceilDiv(x.units * d.unitBytes, 64);
        const int64_t share = ceilDiv(lines, ceilDiv(x.steps, chunk)), first = (s0 / chunk) * share;
        ahead.base += first * 64;
        ahead.runLines = std::min(share, lines - first);
      }
      ahead.spread(blockSteps);
      for (int64_t i0 = 0; i0 < m; i0 += kBlockRows)
        rowBlock(i0, j0, nb, s0, s1);
    }
  }
  _tile_release();
  // The streamed stores reach memory before anything the caller stores
  // after this (the event that says the tile is done).
  if (stream)
    _mm_sfence();
}

#else // !MOEC_AMX_X86

} // namespace moec::cpu::tile::detail

namespace moec::cpu::tile {
bool amx() { return false; }
} // namespace moec::cpu::tile

namespace moec::cpu::tile::detail {

void gemmAmx(int64_t, int64_t, int64_t, const void *, int64_t, bool, const void *, int64_t, bool,
             void *, int64_t, bool, bool, void *, bool, const void *, const DecodedB *,
             const AddScaled *, const LowRank *) {
  std::fprintf(stderr, "moec: the AMX tile was called on a CPU without it\n");
  std::abort();
}

#endif // MOEC_AMX_X86

} // namespace moec::cpu::tile::detail
