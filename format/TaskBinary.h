//===- TaskBinary.h - The moec task binary: layout, writer, reader -*- C++ -*-===//
//
// A task binary holds a compiled program for one pass (forward or backward)
// of the MoE-FFN layer, for a mesh of R = P x T ranks: P expert-parallel
// (EP) ranks, each of T tensor-parallel (TP) ranks that split every expert's
// intermediate size (rank r has EP coordinate r / T and TP coordinate
// r % T). Every rank loads the same file and runs the same tables; what
// depends on the rank is written relative to the loading rank (a signal's
// peer is the rank `peerOffset` EP ranks further, with the same TP
// coordinate; a tiling descriptor's expert is a local expert index).
//
// The file is little-endian and sized by its content:
//
//   FileHeader      64 bytes at offset 0
//   SectionEntry[]  the section table (24 bytes an entry), 8-byte aligned
//   sections        flat arrays of fixed-size records, each 8-byte aligned
//
// Records refer to each other by u32 index into another section, and to
// ranges of another section by (first, count), so a file of 10^5 tasks is a
// handful of flat arrays. The records below are the file's bytes: each one has
// a static_assert'ed size, alignment and field offsets, and its layout in a
// comment beside it. docs/binary-format.md describes the format in full.
//
// The writer (used by the compiler) and the reader (used by the runtime and
// `moec dump`) both live here, so the layout is defined once. This library
// does not depend on MLIR or LLVM.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_FORMAT_TASKBINARY_H
#define MOEC_FORMAT_TASKBINARY_H

#include "base/DType.h"
#include "base/Status.h"
#include "format/Capacity.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moec::format {

//===----------------------------------------------------------------------===//
// Constants and enums
//===----------------------------------------------------------------------===//

/// The first 8 bytes of every task binary.
inline constexpr char kMagic[8] = {'M', 'O', 'E', 'C', 'B', 'I', 'N', '\0'};

/// The format version this code writes and the only one it reads. Version 2
/// added the layer section (LayerRecord); version 3 a GMM's second,
/// low-rank product (TilingRecord::lowRankSlots); version 4 lead products
/// (leadOp: a GMM with no tasks, computed inside another's).
inline constexpr uint32_t kFormatVersion = 4;

/// The value of an optional u32 index that names nothing.
inline constexpr uint32_t kNone = 0xFFFFFFFFu;

/// The most records a section holds, and the most tiles a grid has: indices
/// are u32.
inline constexpr uint64_t kMaxRecords = 0xFFFFFFFFu;

/// Every section, and the section table, starts at a multiple of this.
inline constexpr uint32_t kSectionAlignment = 8;

/// The largest tensor rank a slot can describe.
inline constexpr uint32_t kMaxTensorRank = 4;

/// The most input slots a tiling descriptor names.
inline constexpr uint32_t kMaxTilingInputs = 4;

/// Bits of FileHeader::flags.
enum FileFlag : uint32_t {
  kFlagBackward = 1u << 0, ///< the program is a backward pass
  kFlagBf16 = 1u << 1,     ///< activations are stored as bf16 (else f32)
  kFlagNotes = 1u << 2,    ///< the header's `notes` names the compiler's notes
  kKnownFileFlags = kFlagBackward | kFlagBf16 | kFlagNotes,
};

/// Element type of a tensor slot or a tiling descriptor (base/DType.h).
using moec::DType;

/// The op a task belongs to, and the op a tiling descriptor is for.
enum class OpKind : uint8_t {
  Dispatch = 1,
  Combine = 2,
  Gmm = 3,
  Swiglu = 4,
  SwigluGrad = 5,
  Quantize = 6,   ///< rows to fp8 rows with block scales (before a dispatch)
  Dequantize = 7, ///< fp8 rows back to the compute dtype (after a dispatch)
};

/// The kind of core that runs a task or owns a queue.
enum class CoreKind : uint8_t { Cube = 1, Vector = 2 };

/// What increments an event counter.
enum class EventKind : uint8_t {
  Local = 1,     ///< signals of tasks on the same rank only
  CrossRank = 2, ///< also signals that peers send with their puts
  Terminate = 3, ///< signalled by local tasks and peers' puts; reaching its
                 ///< threshold ends the pass on that rank
};

/// Bits of SlotRecord::flags.
enum SlotFlag : uint8_t {
  kSlotList = 1u << 0,    ///< a tensor list (dim 0 counts its elements)
  kSlotDynamic = 1u << 1, ///< dim 0 varies at run time, up to capacityRows
  kKnownSlotFlags = kSlotList | kSlotDynamic,
};

/// Bits of TilingRecord::flags.
enum TilingFlag : uint8_t {
  kTilingTransposeA = 1u << 0, ///< A is stored transposed (K x M)
  kTilingTransposeB = 1u << 1, ///< B is stored transposed (N x K)
  kTilingAccumulate = 1u << 2, ///< C += result instead of C = result
  kTilingScale = 1u << 3,      ///< the product is multiplied by TilingRecord::scale
  /// A combine whose rows are partial sums over the TP ranks: each tile is
  /// put to all T TP ranks of its peer (into the returned rows of block t,
  /// t the putting rank's TP coordinate), and its signals reach all T.
  kTilingReduceTp = 1u << 4,
  /// Row tiles cut the rows there are, not a fixed bound: row tile i of n
  /// rows covers [i*n/rowTiles, (i+1)*n/rowTiles), n known at run time (the
  /// local expert's segment, or for a put the rows sent to the peer). Every
  /// tile gets its share whatever the routing; `rows` stays the bound.
  /// Not on a weight-gradient GMM, which tiles its result (see tileRows()).
  kTilingShareRows = 1u << 5,
  /// An activation GMM whose weight B is stored quantized: input 3 is its
  /// fp32 scales, and B's slot dtype with their dims says the format, for
  /// B's [G, rows, cols] as stored (LayerShape's WeightFormat):
  ///  - F8E4M3 codes, scales [G, ceil(rows / 128), ceil(cols / 128)]: one
  ///    per 128 x 128 block (DeepSeek-V3's weight and weight_scale_inv);
  ///    value = code x scale;
  ///  - I8 codes, scales [G, rows]: one per row (an output channel of a
  ///    weight stored [out, in]); value = code x scale;
  ///  - I4 codes (two a byte), scales [G, rows, cols / g] for groups of g
  ///    (32, 64 or 128) along a row, value = (code - 8) x scale; or
  ///    [G, rows, cols / g, 2], (scale, zero point) pairs, value = (code -
  ///    zero) x scale.
  kTilingQuantizedB = 1u << 6,
  /// The low-rank product's V is stored transposed ([G, N, r]; see
  /// TilingRecord::lowRankSlots).
  kTilingLowRankTransposeB = 1u << 7,
  kKnownTilingFlags = kTilingTransposeA | kTilingTransposeB | kTilingAccumulate | kTilingScale |
                      kTilingReduceTp | kTilingShareRows | kTilingQuantizedB |
                      kTilingLowRankTransposeB,
};

/// The kind of a section; each kind appears exactly once in a version-2 file.
enum class SectionKind : uint32_t {
  Strings = 1,      ///< bytes: NUL-terminated names
  Slots = 2,        ///< SlotRecord
  Ops = 3,          ///< OpRecord
  Tilings = 4,      ///< TilingRecord
  Events = 5,       ///< EventRecord
  Tasks = 6,        ///< TaskRecord
  Waits = 7,        ///< WaitRecord
  Signals = 8,      ///< SignalRecord
  Queues = 9,       ///< QueueRecord
  QueueEntries = 10, ///< uint32_t task index
  Layer = 11,        ///< LayerRecord: none, or one
};

/// The number of section kinds (and of sections in a version-2 file).
inline constexpr uint32_t kSectionKindCount = 11;

/// Returns the name of a section kind as error messages spell it ("tasks",
/// "queue entries"), or "unknown" for a value outside the enum.
const char *sectionKindName(SectionKind kind);

using moec::dtypeName;

/// Returns "dispatch", "combine", "gmm", "swiglu" or "swiglu_grad", or
/// "unknown".
const char *opKindName(OpKind kind);

/// Returns "cube" or "vector", or "unknown".
const char *coreKindName(CoreKind kind);

/// Returns "local", "cross-rank" or "terminate", or "unknown".
const char *eventKindName(EventKind kind);

using moec::dtypeSize;

//===----------------------------------------------------------------------===//
// Records (the file's bytes; every reserved field is zero)
//===----------------------------------------------------------------------===//

/// The file header, at offset 0.
///
///   offset size field
///    0     8    magic               "MOECBIN\0"
///    8     4    version             kFormatVersion
///   12     4    flags               FileFlag bits; others zero
///   16     8    fileSize            size of the whole file in bytes
///   24     4    crc32               CRC-32 of the file with this field zero
///   28     4    epRanks             P, the EP ranks (>= 1)
///   32     4    localExperts        L, experts per rank
///   36     4    sectionCount        entries in the section table (10)
///   40     8    sectionTableOffset  offset of SectionEntry[sectionCount]
///   48     4    target              string offset of the target profile's name
///   52     4    tpRanks             T, the TP ranks of each EP rank (>= 1; 0 in
///                                   files written before the field: read as 1)
///   56     4    notes               with kFlagNotes, string offset of what the
///                                   compiler says of its choices (the automatic
///                                   splits it tried), else zero
///   60     4    reserved            zero
struct FileHeader {
  char magic[8] = {};
  uint32_t version = 0;
  uint32_t flags = 0;
  uint64_t fileSize = 0;
  uint32_t crc32 = 0;
  uint32_t epRanks = 0;
  uint32_t localExperts = 0;
  uint32_t sectionCount = 0;
  uint64_t sectionTableOffset = 0;
  uint32_t target = 0;
  uint32_t tpRanks = 0;
  uint32_t notes = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(FileHeader) == 64 && alignof(FileHeader) == 8, "FileHeader layout");
static_assert(offsetof(FileHeader, crc32) == 24 && offsetof(FileHeader, epRanks) == 28 &&
                  offsetof(FileHeader, sectionTableOffset) == 40,
              "FileHeader layout");

/// One entry of the section table.
///
///   offset size field
///    0     4    kind        SectionKind
///    4     4    recordSize  bytes per record (must be the size below)
///    8     8    offset      file offset, a multiple of 8, past the header
///   16     8    count       number of records (bytes, for strings)
struct SectionEntry {
  uint32_t kind = 0;
  uint32_t recordSize = 0;
  uint64_t offset = 0;
  uint64_t count = 0;
};
static_assert(sizeof(SectionEntry) == 24 && alignof(SectionEntry) == 8, "SectionEntry layout");
static_assert(offsetof(SectionEntry, offset) == 8 && offsetof(SectionEntry, count) == 16,
              "SectionEntry layout");

/// A tensor slot: one entry of the runtime's parameter array.
///
///   offset size field
///    0     4    name          string offset
///    4     4    param         position in the runtime's parameter array
///                             (the graph's slot); unique
///    8     1    dtype         DType
///    9     1    flags         SlotFlag bits
///   10     1    rank          number of dims, 0..4
///   11     1    reserved0     zero
///   12     4    reserved1     zero
///   16    32    dims[4]       u64 dims; dims[i] is zero for i >= rank
///   48     8    capacityRows  dynamic tensors: the most rows of dim 0 the
///                             binary serves; zero otherwise
struct SlotRecord {
  uint32_t name = 0;
  uint32_t param = 0;
  DType dtype = DType::F32;
  uint8_t flags = 0;
  uint8_t rank = 0;
  uint8_t reserved0 = 0;
  uint32_t reserved1 = 0;
  uint64_t dims[kMaxTensorRank] = {};
  uint64_t capacityRows = 0;
};
static_assert(sizeof(SlotRecord) == 56 && alignof(SlotRecord) == 8, "SlotRecord layout");
static_assert(offsetof(SlotRecord, dtype) == 8 && offsetof(SlotRecord, dims) == 16 &&
                  offsetof(SlotRecord, capacityRows) == 48,
              "SlotRecord layout");

/// An op of the layer; its tasks are tasks[firstTask, firstTask + taskCount),
/// each of them names this op, and they are the tiles of its tiling's grid in
/// grid order (taskCount equals the grid's tile count).
///
///   offset size field
///    0     4    name         string offset
///    4     1    kind         OpKind
///    5     3    reserved[3]  zero
///    8     4    firstTask    index into tasks
///   12     4    taskCount
///   16     4    tiling       index into tilings
///   20     4    reserved2    zero
struct OpRecord {
  uint32_t name = 0;
  OpKind kind = OpKind::Dispatch;
  uint8_t reserved[3] = {};
  uint32_t firstTask = 0;
  uint32_t taskCount = 0;
  uint32_t tiling = 0;
  uint32_t reserved2 = 0;
};
static_assert(sizeof(OpRecord) == 24 && alignof(OpRecord) == 4, "OpRecord layout");
static_assert(offsetof(OpRecord, kind) == 4 && offsetof(OpRecord, firstTask) == 8 &&
                  offsetof(OpRecord, tiling) == 16,
              "OpRecord layout");

/// A tiling descriptor: how an op's work is cut into tiles. An op's tasks are
/// the cells of a grid, experts x peers x rowTiles x colTiles, numbered in
/// that order (colTile fastest): task t of the op (t counted from the op's
/// firstTask) is the tile
///
///   colTile = t % colTiles
///   rowTile = (t / colTiles) % rowTiles
///   peer    = (t / (colTiles * rowTiles)) % peers
///   expert  = t / (colTiles * rowTiles * peers)
///
/// Row tile i covers rows [i*rows/rowTiles, (i+1)*rows/rowTiles) and column
/// tile j columns [j*cols/colTiles, (j+1)*cols/colTiles) of the tile's output
/// (tileCoord() computes both). For a per-expert op (experts == L), rows are
/// rows of the local expert's segment, which the runtime finds from the
/// routing and clips the tile to; for a put (dispatch, combine; peers == P),
/// rows are rows of the segment sent to the rank `peer` EP ranks further
/// (TaskProgram::peerRank). A per-expert op that is not a put may also have
/// peers == G in 2..R (peer groups; needs kTilingShareRows, not a weight
/// gradient): its tiles of group g hold the rows of the expert's segment
/// that came from the EP ranks (rank - p) mod R for p in
/// [g*R/G, (g+1)*R/G) (the dispatch tiles of those peer offsets put them),
/// and its row tiles share out those rows (peerGroupRows()). `depth` is the
/// reduction length of a matmul: K of an activation GMM, or 0 for a weight-
/// gradient GMM, which reduces over the expert's (dynamic) rows.
/// `balancedRows` is what the compiler expects a segment to hold when routing
/// is balanced (for a weight-gradient GMM: the rows it reduces over); it only
/// feeds cost estimates (scheduling, `moec dump`).
///
///   offset size field
///    0     1    opKind         OpKind; equals the kind of the op that uses it
///    1     1    dtype          DType of A, B and C
///    2     1    flags          TilingFlag bits
///    3     1    inputCount     inputs used, 0..4
///    4     4    experts        grid: 1, or L for a per-expert op
///    8     4    peers          grid: 1, or R for a put, or G (2..R) peer
///                              groups of a per-expert op
///   12     4    rowTiles       grid: >= 1
///   16     4    colTiles       grid: >= 1
///   20     4    outputSlot     index into slots
///   24     8    rows           rows tiled (per expert, per peer); >= rowTiles
///   32     8    cols           columns tiled; >= colTiles
///   40     8    depth          reduction length of a GMM, else 0
///   48     4    tileM          M/N/K block sizes of the kernel
///   52     4    tileN
///   56     4    tileK
///   60     4    lda            leading strides (elements) of A, B, C
///   64     4    ldb
///   68     4    ldc
///   72    16    inputSlots[4]  indices into slots, in the op's operand order;
///                              kNone past inputCount
///   88     4    balancedRows   rows a segment has under balanced routing
///                              (cost estimates only)
///   92     4    scale          f32: the product's factor with kTilingScale
///                              (finite, nonzero), else zero
///   96     8    lowRankSlots[2] indices into slots: U and V of a second
///                              product, or kNone, kNone
///
/// A GMM of the activation form (depth > 0) with inputCount 4 adds its
/// fourth input, a tensor of the output's shape, to the product:
/// C = D + scale * A B (a LoRA adapter's product onto the base projection).
///
/// An activation GMM with lowRankSlots adds a second product over a depth
/// of its own to the first: C = A op(B) + U op(V), U [M, r] rows as A's (a
/// LoRA adapter's rank-r rows, its scale already in them), V the expert's
/// [r, N], or [N, r] with kTilingLowRankTransposeB (the adapter's second
/// weight, dense, of A's dtype). The compiler fuses a LoRA adapter's second
/// GMM into its base's this way (moe-fuse-low-rank) for targets that want
/// it; such a GMM has no addend and no scale (its inputs 3, when present,
/// are quantized weights' scales). The sums of both products meet in one
/// fp32 accumulator, rounded once where moec's AVX-512 tile runs it.
struct TilingRecord {
  OpKind opKind = OpKind::Gmm;
  DType dtype = DType::F32;
  uint8_t flags = 0;
  uint8_t inputCount = 0;
  uint32_t experts = 1;
  uint32_t peers = 1;
  uint32_t rowTiles = 1;
  uint32_t colTiles = 1;
  uint32_t outputSlot = 0;
  uint64_t rows = 1;
  uint64_t cols = 1;
  uint64_t depth = 0;
  uint32_t tileM = 0;
  uint32_t tileN = 0;
  uint32_t tileK = 0;
  uint32_t lda = 0;
  uint32_t ldb = 0;
  uint32_t ldc = 0;
  uint32_t inputSlots[kMaxTilingInputs] = {kNone, kNone, kNone, kNone};
  uint32_t balancedRows = 0;
  float scale = 0;
  uint32_t lowRankSlots[2] = {kNone, kNone};

  /// The number of tiles (tasks) of the grid.
  uint64_t tileCount() const { return uint64_t(experts) * peers * rowTiles * colTiles; }
  /// Whether the GMM adds a second, low-rank product (lowRankSlots).
  bool lowRank() const { return lowRankSlots[0] != kNone; }
};
static_assert(sizeof(TilingRecord) == 104 && alignof(TilingRecord) == 8, "TilingRecord layout");
static_assert(offsetof(TilingRecord, experts) == 4 && offsetof(TilingRecord, outputSlot) == 20 &&
                  offsetof(TilingRecord, rows) == 24 && offsetof(TilingRecord, tileM) == 48 &&
                  offsetof(TilingRecord, lda) == 60 && offsetof(TilingRecord, inputSlots) == 72 &&
                  offsetof(TilingRecord, balancedRows) == 88 &&
                  offsetof(TilingRecord, lowRankSlots) == 96,
              "TilingRecord layout");

/// One tile of a grid: its cell and its row and column ranges.
struct TileCoord {
  uint32_t expert = 0;
  uint32_t peer = 0;
  uint32_t rowTile = 0;
  uint32_t colTile = 0;
  uint64_t rowBegin = 0, rowEnd = 0; ///< rows [rowBegin, rowEnd)
  uint64_t colBegin = 0, colEnd = 0; ///< columns [colBegin, colEnd)
};

/// Returns tile `index` (< tiling.tileCount()) of the grid of `tiling`.
TileCoord tileCoord(const TilingRecord &tiling, uint64_t index);

/// Returns the first row (or column) of tile `i` when `extent` rows are cut
/// into `tiles` tiles: i * extent / tiles. Tile i ends where tile i+1 begins.
inline uint64_t tileBegin(uint64_t i, uint64_t extent, uint64_t tiles) {
  return i * extent / tiles;
}

/// The rows [begin, end) tile `tile` of `tiling` works on when the rows it
/// cuts (the local expert's segment, or for a put the rows sent to the
/// peer) hold `present` rows: its fixed rows clipped to them, or with
/// kTilingShareRows its share of them. Empty when begin >= end.
struct TileRows {
  uint64_t begin = 0, end = 0;
  uint64_t size() const { return end > begin ? end - begin : 0; }
};
inline TileRows tileRows(const TilingRecord &tiling, const TileCoord &tile, uint64_t present) {
  if (tiling.flags & kTilingShareRows)
    return {tileBegin(tile.rowTile, present, tiling.rowTiles),
            tileBegin(uint64_t(tile.rowTile) + 1, present, tiling.rowTiles)};
  return {tile.rowBegin, tile.rowEnd < present ? tile.rowEnd : present};
}

/// True for the ops whose tiles put rows into a peer's memory.
inline bool isPut(OpKind kind) { return kind == OpKind::Dispatch || kind == OpKind::Combine; }

/// True when the tiles of `tiling` are cut by peer groups: a per-expert op
/// that is not a put, with peers > 1 (see TilingRecord).
inline bool hasPeerGroups(const TilingRecord &tiling) {
  return tiling.peers > 1 && !isPut(tiling.opKind);
}

/// True when a GMM's fourth input is an addend its product is added onto
/// (a LoRA adapter's second product onto its base's output), C read as
/// well as written; a quantized B's fourth input is its scales
/// (kTilingQuantizedB).
inline bool hasAddend(const TilingRecord &tiling) {
  return tiling.inputCount == 4 && !(tiling.flags & kTilingQuantizedB);
}

/// The peer group of a put's peer offset `peer` for a grid of `groups`
/// groups over `ranks` EP ranks: the g with g*R/G <= peer < (g+1)*R/G.
inline uint32_t peerGroupOf(uint32_t peer, uint32_t ranks, uint32_t groups) {
  return uint32_t(((uint64_t(peer) + 1) * groups - 1) / ranks);
}

/// The rows of a tile of a per-expert op, as up to two runs of the
/// expert's segment (in the segment's order).
struct TileRowRuns {
  TileRows runs[2];
  uint32_t count = 0;
  uint64_t size() const {
    return count == 0 ? 0 : runs[0].size() + (count > 1 ? runs[1].size() : 0);
  }
};

/// The rows tile `tile` of a per-expert op works on, on EP rank `epRank` of
/// `epRanks`, when `sourceStart[q]` (q = 0..R) is the first row of the
/// expert's segment that came from EP rank q (the segment holds them by
/// source rank; sourceStart[R] is its size). Without peer groups: the
/// tileRows() of the whole segment. With them: the tile's share of its
/// group's rows, which come from a cyclic range of source ranks, so from up
/// to two runs of the segment.
TileRowRuns peerGroupRows(const TilingRecord &tiling, const TileCoord &tile, uint32_t epRank,
                          uint32_t epRanks, const int64_t *sourceStart);

/// An event: a monotone counter, one per rank, zero at the start of a pass.
/// threshold is its final value: the sum of the increments of every signal
/// that names it, counted once per task that carries the signal.
///
///   offset size field
///    0     4    name         string offset
///    4     1    kind         EventKind
///    5     3    reserved[3]  zero
///    8     4    op           index of the op whose tasks signal it, or kNone
///   12     4    threshold    final value of the counter
struct EventRecord {
  uint32_t name = 0;
  EventKind kind = EventKind::Local;
  uint8_t reserved[3] = {};
  uint32_t op = kNone;
  uint32_t threshold = 0;
};
static_assert(sizeof(EventRecord) == 16 && alignof(EventRecord) == 4, "EventRecord layout");
static_assert(offsetof(EventRecord, kind) == 4 && offsetof(EventRecord, op) == 8 &&
                  offsetof(EventRecord, threshold) == 12,
              "EventRecord layout");

/// A task: waits for waits[firstWait, +waitCount) in order, runs its tile,
/// then sends signals[firstSignal, +signalCount). Its tile is its place in
/// its op's task range (see TilingRecord). Tasks may share wait and signal
/// ranges.
///
///   offset size field
///    0     4    op           index into ops
///    4     4    firstWait    index into waits
///    8     4    waitCount
///   12     4    firstSignal  index into signals
///   16     4    signalCount
///   20     1    coreKind     CoreKind; equals the kind of its queue
///   21     3    reserved[3]  zero
struct TaskRecord {
  uint32_t op = 0;
  uint32_t firstWait = 0;
  uint32_t waitCount = 0;
  uint32_t firstSignal = 0;
  uint32_t signalCount = 0;
  CoreKind coreKind = CoreKind::Vector;
  uint8_t reserved[3] = {};
};
static_assert(sizeof(TaskRecord) == 24 && alignof(TaskRecord) == 4, "TaskRecord layout");
static_assert(offsetof(TaskRecord, firstWait) == 4 && offsetof(TaskRecord, firstSignal) == 12 &&
                  offsetof(TaskRecord, coreKind) == 20,
              "TaskRecord layout");

/// A wait edge: the task blocks until the loading rank's copy of `event`
/// reaches `threshold` (at most the event's final value).
///
///   offset size field
///    0     4    event      index into events
///    4     4    threshold
struct WaitRecord {
  uint32_t event = 0;
  uint32_t threshold = 0;
};
static_assert(sizeof(WaitRecord) == 8 && alignof(WaitRecord) == 4, "WaitRecord layout");

/// A signal: adds `increment` to `event` on the rank `peerOffset` EP ranks
/// further (TaskProgram::peerRank; a combine with kTilingReduceTp: on each of
/// that EP rank's T TP ranks).
/// peerOffset 0 is the loading rank itself; a nonzero one is a peer, reached
/// with the task's put, and needs a cross-rank or terminate event.
///
///   offset size field
///    0     4    event       index into events
///    4     4    increment
///    8     4    peerOffset  0..P-1
///   12     4    reserved    zero
struct SignalRecord {
  uint32_t event = 0;
  uint32_t increment = 0;
  uint32_t peerOffset = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(SignalRecord) == 16 && alignof(SignalRecord) == 4, "SignalRecord layout");
static_assert(offsetof(SignalRecord, peerOffset) == 8, "SignalRecord layout");

/// An in-order queue of one logical core: it runs the tasks named by
/// queueEntries[firstEntry, +entryCount) one after another.
/// (coreKind, coreIndex) is unique, and every task is in exactly one queue.
///
///   offset size field
///    0     1    coreKind     CoreKind
///    1     3    reserved[3]  zero
///    4     4    coreIndex    index among the cores of that kind
///    8     4    firstEntry   index into queueEntries
///   12     4    entryCount
struct QueueRecord {
  CoreKind coreKind = CoreKind::Vector;
  uint8_t reserved[3] = {};
  uint32_t coreIndex = 0;
  uint32_t firstEntry = 0;
  uint32_t entryCount = 0;
};
static_assert(sizeof(QueueRecord) == 16 && alignof(QueueRecord) == 4, "QueueRecord layout");
static_assert(offsetof(QueueRecord, coreIndex) == 4 && offsetof(QueueRecord, firstEntry) == 8,
              "QueueRecord layout");

/// Bits of LayerRecord::flags.
enum LayerFlag : uint8_t {
  /// "main_grad": a backward's weight gradients are added to fp32 buffers
  /// the caller keeps across micro-batches, not written.
  kLayerMainGrad = 1u << 0,
  kKnownLayerFlags = kLayerMainGrad,
};

/// The layer a program computes, as its config asked for it: the compiler
/// writes one into every program it compiles from a config (the layer
/// section holds it), and runtime/layer checks the program's slots and
/// tilings against it and takes what they cannot say from it (the capacity
/// factor, the experts E, LoRA's alpha). A hand-made task program that is
/// no layer's has none. P, T and L are the header's.
///
///   offset size field
///    0     8    hidden           H ("hidden_size")
///    8     8    intermediate     I of one expert ("intermediate_size"); a
///                                rank holds I / T of it
///   16     8    seqSize          S ("seq_size"): tokens of one rank
///   24     8    topK             K ("top_k")
///   32     8    experts          E ("num_experts"); P * L
///   40     8    rowCapacity      the rows a rank routes: S * K
///   48     8    receiveCapacity  the rows one rank's experts hold in all:
///                                format/Capacity.h's receiveCapacityRows
///   56     8    capacityFactor   f64 ("capacity_factor"), 1 to 1024
///   64     8    loraAlpha        f64 ("lora_alpha"); 0: unset (= lora_rank)
///   72     4    loraRank         r ("lora_rank"); 0: unset
///   76     4    weightGroup      ("weight_group"): values per group of int4
///                                base weights; 0: unset
///   80     1    dtype            DType of the activations ("dtype"): F32, BF16
///   81     1    dispatchDtype    DType the dispatched rows travel in
///                                ("dispatch_dtype"): dtype, or F8E4M3
///   82     1    flags            LayerFlag bits
///   83     5    reserved[5]      zero
struct LayerRecord {
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t seqSize = 0;
  int64_t topK = 0;
  int64_t experts = 0;
  int64_t rowCapacity = 0;
  int64_t receiveCapacity = 0;
  double capacityFactor = 0;
  double loraAlpha = 0;
  uint32_t loraRank = 0;
  uint32_t weightGroup = 0;
  DType dtype = DType::F32;
  DType dispatchDtype = DType::F32;
  uint8_t flags = 0;
  uint8_t reserved[5] = {};

  bool mainGrad() const { return (flags & kLayerMainGrad) != 0; }
  /// LoRA's scaling, lora_alpha / lora_rank (PEFT's `scaling`): 1 when
  /// alpha is unset, 0 without a rank.
  double loraScaling() const {
    return loraRank == 0 ? 0.0 : (loraAlpha > 0 ? loraAlpha : double(loraRank)) / double(loraRank);
  }
};
static_assert(sizeof(LayerRecord) == 88 && alignof(LayerRecord) == 8, "LayerRecord layout");
static_assert(offsetof(LayerRecord, capacityFactor) == 56 && offsetof(LayerRecord, loraRank) == 72 &&
                  offsetof(LayerRecord, dtype) == 80 && offsetof(LayerRecord, reserved) == 83,
              "LayerRecord layout");

/// The layer record as a JSON object in the config's keys ("hidden_size",
/// "capacity_factor", "dispatch_dtype", ...; with "row_capacity" and
/// "receive_capacity"): what `moec dump --json` and the torch op show.
std::string layerRecordJson(const LayerRecord &layer);

/// What a layer record's capacities follow from, on P EP ranks of L experts.
CapacityInputs capacityInputs(const LayerRecord &layer, uint32_t epRanks, uint32_t localExperts);

/// Records compare equal when all their bytes (reserved ones included) do.
bool operator==(const SlotRecord &a, const SlotRecord &b);
bool operator==(const OpRecord &a, const OpRecord &b);
bool operator==(const TilingRecord &a, const TilingRecord &b);
bool operator==(const EventRecord &a, const EventRecord &b);
bool operator==(const TaskRecord &a, const TaskRecord &b);
bool operator==(const WaitRecord &a, const WaitRecord &b);
bool operator==(const SignalRecord &a, const SignalRecord &b);
bool operator==(const QueueRecord &a, const QueueRecord &b);
bool operator==(const LayerRecord &a, const LayerRecord &b);

//===----------------------------------------------------------------------===//
// The in-memory program
//===----------------------------------------------------------------------===//

/// A task binary in memory: the header's values and one vector per section.
/// The compiler fills one and writes it; the reader fills one from a file.
struct TaskProgram {
  uint32_t flags = 0;        ///< FileFlag bits
  uint32_t epRanks = 1;      ///< P
  uint32_t tpRanks = 1;      ///< T
  uint32_t localExperts = 0; ///< L
  uint32_t target = 0;       ///< string offset of the target profile's name
  uint32_t notes = 0;        ///< with kFlagNotes: string offset of the compiler's notes
  std::string strings;       ///< NUL-terminated names, referred to by offset
  std::vector<SlotRecord> slots;
  std::vector<OpRecord> ops;
  std::vector<TilingRecord> tilings;
  std::vector<EventRecord> events;
  std::vector<TaskRecord> tasks;
  std::vector<WaitRecord> waits;
  std::vector<SignalRecord> signals;
  std::vector<QueueRecord> queues;
  std::vector<uint32_t> queueEntries; ///< task indices
  /// The layer record (the layer section's one record), or none.
  std::optional<LayerRecord> layer;

  /// Appends `text` and a NUL to the strings and returns its offset. `text`
  /// should not contain a NUL (the name would end there).
  uint32_t addString(std::string_view text);

  /// Returns the name at string offset `offset`, or "" when the offset is out
  /// of range or its name is not NUL-terminated (which a program that passed
  /// validateTaskProgram never has).
  std::string_view name(uint32_t offset) const;

  /// Returns true when the program is a backward pass.
  bool isBackward() const { return (flags & kFlagBackward) != 0; }

  /// R = P * T, the ranks that run the program.
  uint32_t ranks() const { return epRanks * tpRanks; }
  /// The EP coordinate of `rank`: rank / T.
  uint32_t epOf(uint32_t rank) const { return rank / tpRanks; }
  /// The TP coordinate of `rank`: rank % T.
  uint32_t tpOf(uint32_t rank) const { return rank % tpRanks; }

  /// Returns the rank a signal with `peerOffset` reaches from `rank`: the
  /// one `peerOffset` EP ranks further, with the same TP coordinate,
  /// ((epOf(rank) + peerOffset) % P) * T + tpOf(rank). `rank` must be below
  /// R and `peerOffset` below P.
  uint32_t peerRank(uint32_t rank, uint32_t peerOffset) const {
    return uint32_t((uint64_t(epOf(rank)) + peerOffset) % epRanks) * tpRanks + tpOf(rank);
  }

  /// Ranks first .. first + count - 1.
  struct RankRange {
    uint32_t first = 0, count = 1;
  };

  /// Returns the ranks a signal (and the put) with `peerOffset` of a task of
  /// op `op` reaches from `rank`: peerRank() alone, or when the op fans out
  /// (fansOut()) the T TP ranks of that EP rank.
  RankRange signalRanks(uint32_t op, uint32_t rank, uint32_t peerOffset) const;

  /// The inverse of signalRanks(): the ranks whose signal with `peerOffset`
  /// of a task of op `op` reaches `rank`.
  RankRange signalSources(uint32_t op, uint32_t rank, uint32_t peerOffset) const;

  /// True when the tasks of op `op` fan out to all T > 1 TP ranks of their
  /// peer: a combine with kTilingReduceTp, with T > 1. (With T = 1 the flag
  /// changes nothing.)
  bool fansOut(uint32_t op) const;

  /// Returns the global index of local expert `expert` on `rank`:
  /// epOf(rank) * L + expert.
  uint64_t globalExpert(uint32_t rank, uint32_t expert) const {
    return uint64_t(epOf(rank)) * localExperts + expert;
  }
};

/// A task's tile as one rank runs it: its grid cell and ranges, and its
/// rank-relative fields resolved to global ones.
struct RankTile {
  TileCoord coord;
  /// The global expert whose rows the tile holds: for a dispatch tile, an
  /// expert of the rank the rows go to; for any other per-expert tile, one
  /// of `rank`'s own. Equals coord.expert for a grid of one expert that
  /// covers the whole op (with L > 1), whose expert field says nothing.
  uint64_t expert = 0;
  /// For a put (a grid with peers == P), the rank its rows go to:
  /// peerRank(rank, coord.peer); else `rank`. (A combine that reduces over
  /// TP puts them to that rank's T TP ranks.)
  uint32_t peerRank = 0;
};

/// Returns task `task`'s tile as rank `rank` runs it. `task` and `rank`
/// must be in range.
RankTile rankTile(const TaskProgram &program, uint32_t task, uint32_t rank);

/// The depth of a GMM's low-rank product (U's columns, r), or 0 without one.
inline uint64_t lowRankDepth(const TaskProgram &program, const TilingRecord &tiling) {
  return tiling.lowRank() ? program.slots[tiling.lowRankSlots[0]].dims[1] : 0;
}

/// The lead product of op `host`: the GMM whose tiles `host`'s own tasks
/// compute, or kNone. A GMM with no tasks of its own (taskCount 0) is one:
/// it writes U, the low-rank rows of a GMM with a low-rank product (its
/// lowRankSlots[0]), from that GMM's own A over the same rows, and that
/// GMM's tiles, one per row tile, compute their rows of U first, write
/// them, and then add U op(V) (a LoRA adapter's first product, U = s X A,
/// inside its base's: the tile reads X once). The lead's grid is the
/// host's rows in one column tile; where the host has several column
/// tiles, the first of each row writes U and the others compute their own
/// copy. Events that would name lead tile i name host tile i * colTiles
/// (the host's), which signals once U is written too. Validate checks the
/// pairing (one host, the same rows, A and group list).
inline uint32_t leadOp(const TaskProgram &program, uint32_t host) {
  const TilingRecord &t = program.tilings[program.ops[host].tiling];
  if (!t.lowRank())
    return kNone;
  for (uint32_t i = 0; i < program.ops.size(); ++i) {
    const OpRecord &op = program.ops[i];
    if (op.taskCount == 0 && op.kind == OpKind::Gmm && op.tiling < program.tilings.size() &&
        program.tilings[op.tiling].outputSlot == t.lowRankSlots[0])
      return i;
  }
  return kNone;
}

/// The op whose tasks compute lead product `lead` (leadOp's inverse), or
/// kNone where `lead` is none.
inline uint32_t leadHost(const TaskProgram &program, uint32_t lead) {
  if (program.ops[lead].taskCount != 0)
    return kNone;
  for (uint32_t i = 0; i < program.ops.size(); ++i)
    if (i != lead && program.ops[i].tiling < program.tilings.size() && leadOp(program, i) == lead)
      return i;
  return kNone;
}

/// Programs compare equal when their header values and sections do.
bool operator==(const TaskProgram &a, const TaskProgram &b);

/// Returns true when the programs differ.
inline bool operator!=(const TaskProgram &a, const TaskProgram &b) { return !(a == b); }

//===----------------------------------------------------------------------===//
// Writer and reader
//===----------------------------------------------------------------------===//

/// Options of readTaskBinary.
struct ReadOptions {
  /// Compare the header's CRC-32 with the content's. Only fuzzing and tools
  /// that inspect damaged files turn this off.
  bool verifyChecksum = true;
};

/// Checks everything the reader checks about a program's content: header
/// values (flags, R), string offsets, enum values, reserved fields, every
/// index and range (slots, tilings, events, tasks, waits, signals, queue
/// entries), the consistency of ops, tasks, queues and tilings, event
/// thresholds, and that every task is in exactly one queue. Also checks that
/// each section has fewer than 2^32 records (indices are u32). Returns an
/// error naming the first problem found, e.g. "task 17: wait 2 names event
/// 900, but the binary has 512 events".
Status validateTaskProgram(const TaskProgram &program);

/// Returns the task binary of `program`: header, section table, then the ten
/// sections in SectionKind order, each 8-byte aligned, zero padding between
/// them, and the CRC-32 filled in. The same program always gives the same
/// bytes. It does not validate: call validateTaskProgram first (or use
/// writeTaskBinaryFile), since a reader refuses an invalid program.
std::vector<uint8_t> writeTaskBinary(const TaskProgram &program);

/// Validates `program` and writes its task binary to the file `path`.
/// Errors name the path; nothing is written when validation fails.
Status writeTaskBinaryFile(const TaskProgram &program, const std::string &path);

/// Reads the task binary of `size` bytes at `data` (any alignment) into
/// *out. Validates everything before returning: magic, version, file size,
/// checksum, header fields, the section table (kinds, record sizes, bounds,
/// alignment, overlaps, overflow), then the content as validateTaskProgram
/// does. On error, returns a message that says what and where (e.g.
/// "truncated: section 'tasks' (offset 4096, 24000 bytes) ends past the end
/// of the 20480-byte file") and leaves *out unchanged.
Status readTaskBinary(const uint8_t *data, size_t size, TaskProgram *out);

/// readTaskBinary with options.
Status readTaskBinary(const uint8_t *data, size_t size, TaskProgram *out,
                      const ReadOptions &options);

/// Reads the file `path` and then does as readTaskBinary. Errors start with
/// the path, e.g. "fwd.moebin: bad checksum: ...".
Status loadTaskBinaryFile(const std::string &path, TaskProgram *out);

/// Returns the CRC-32 that a file's header should hold: that of the `size`
/// bytes at `data` with the header's crc32 field (bytes 24..27) taken as
/// zero. `size` must be at least sizeof(FileHeader).
uint32_t taskBinaryChecksum(const uint8_t *data, size_t size);

} // namespace moec::format

#endif // MOEC_FORMAT_TASKBINARY_H
