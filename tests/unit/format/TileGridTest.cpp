//===- TileGridTest.cpp - Tile grids and rank-relative tiles --------------===//
//
// A task's tile is its place in its op's grid (tileCoord), peers and experts
// resolved relative to the loading rank, and the validator's checks of ops
// and their grids (tile counts, ranges, the 2^32 - 1 tile limit).
//
//===----------------------------------------------------------------------===//

#include "format/Crc32.h"
#include "format/TaskBinary.h"
#include "tests/unit/format/TaskBinaryTestSupport.h"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace moec::format;
using namespace moec::test;
using moec::Status;

namespace {

//===----------------------------------------------------------------------===//
// Tile grids
//===----------------------------------------------------------------------===//

TEST_CASE("tileCoord decodes a task's place in its op", "[task-binary][tiles]") {
  // 2 experts x 3 peers x 4 row tiles x 5 column tiles over 10 rows and 7
  // columns: rows split [0, 2) [2, 5) [5, 7) [7, 10), columns [0, 1) [1, 2)
  // [2, 4) [4, 5) [5, 7).
  TilingRecord tiling;
  tiling.experts = 2;
  tiling.peers = 3;
  tiling.rowTiles = 4;
  tiling.colTiles = 5;
  tiling.rows = 10;
  tiling.cols = 7;
  REQUIRE(tiling.tileCount() == 120);

  TileCoord first = tileCoord(tiling, 0);
  CHECK(first.expert == 0);
  CHECK(first.peer == 0);
  CHECK(first.rowTile == 0);
  CHECK(first.colTile == 0);
  CHECK(first.rowBegin == 0);
  CHECK(first.rowEnd == 2);
  CHECK(first.colBegin == 0);
  CHECK(first.colEnd == 1);

  // The column tile varies fastest, then the row tile, the peer, the expert.
  TileCoord c = tileCoord(tiling, 1);
  CHECK((c.expert == 0 && c.peer == 0 && c.rowTile == 0 && c.colTile == 1));
  CHECK((c.colBegin == 1 && c.colEnd == 2));
  c = tileCoord(tiling, 5);
  CHECK((c.expert == 0 && c.peer == 0 && c.rowTile == 1 && c.colTile == 0));
  CHECK((c.rowBegin == 2 && c.rowEnd == 5));
  c = tileCoord(tiling, 20);
  CHECK((c.expert == 0 && c.peer == 1 && c.rowTile == 0 && c.colTile == 0));
  c = tileCoord(tiling, 60);
  CHECK((c.expert == 1 && c.peer == 0 && c.rowTile == 0 && c.colTile == 0));
  c = tileCoord(tiling, 1 * 60 + 2 * 20 + 2 * 5 + 3);
  CHECK((c.expert == 1 && c.peer == 2 && c.rowTile == 2 && c.colTile == 3));
  CHECK((c.rowBegin == 5 && c.rowEnd == 7 && c.colBegin == 4 && c.colEnd == 5));

  // The last tile ends at the extents.
  TileCoord last = tileCoord(tiling, 119);
  CHECK(last.expert == 1);
  CHECK(last.peer == 2);
  CHECK(last.rowTile == 3);
  CHECK(last.colTile == 4);
  CHECK(last.rowBegin == 7);
  CHECK(last.rowEnd == 10);
  CHECK(last.colBegin == 5);
  CHECK(last.colEnd == 7);

  // Every index: the formulas of the format, and tiles that cover the
  // extents without gaps or overlaps.
  for (uint64_t i = 0; i < tiling.tileCount(); ++i) {
    INFO("tile " << i);
    TileCoord t = tileCoord(tiling, i);
    CHECK(t.colTile == i % 5);
    CHECK(t.rowTile == (i / 5) % 4);
    CHECK(t.peer == (i / 20) % 3);
    CHECK(t.expert == i / 60);
    CHECK(t.rowBegin == t.rowTile * 10 / 4);
    CHECK(t.rowEnd == (t.rowTile + 1) * 10 / 4);
    CHECK(t.colBegin == t.colTile * 7 / 5);
    CHECK(t.colEnd == (t.colTile + 1) * 7 / 5);
    CHECK(t.rowBegin < t.rowEnd);
    CHECK(t.colBegin < t.colEnd);
    if (t.rowTile + 1 < tiling.rowTiles)
      CHECK(tileCoord(tiling, i + 5).rowBegin == t.rowEnd);
    if (t.colTile + 1 < tiling.colTiles)
      CHECK(tileCoord(tiling, i + 1).colBegin == t.colEnd);
  }

  // tileBegin directly: i * extent / tiles.
  CHECK(tileBegin(0, 10, 4) == 0);
  CHECK(tileBegin(1, 10, 4) == 2);
  CHECK(tileBegin(3, 10, 4) == 7);
  CHECK(tileBegin(4, 10, 4) == 10);
  CHECK(tileBegin(3, 3, 3) == 3);

  // A single tile is the whole extent.
  TilingRecord one;
  one.rows = 1000;
  one.cols = 3;
  TileCoord whole = tileCoord(one, 0);
  CHECK((whole.expert == 0 && whole.peer == 0 && whole.rowTile == 0 && whole.colTile == 0));
  CHECK((whole.rowBegin == 0 && whole.rowEnd == 1000 && whole.colBegin == 0 && whole.colEnd == 3));

  // Large extents: the last of 3 row tiles of 2^40 rows ends at 2^40.
  TilingRecord large;
  large.rowTiles = 3;
  large.rows = uint64_t(1) << 40;
  CHECK(tileCoord(large, 2).rowEnd == uint64_t(1) << 40);
  CHECK(tileCoord(large, 1).rowBegin == (uint64_t(1) << 40) / 3);
}

TEST_CASE("each task is the tile of its place in its op", "[task-binary][tiles]") {
  const TaskProgram p = smallProgram();
  REQUIRE(validateTaskProgram(p).ok());
  for (uint32_t o = 0; o < p.ops.size(); ++o) {
    const OpRecord &op = p.ops[o];
    const TilingRecord &tiling = p.tilings[op.tiling];
    REQUIRE(tiling.tileCount() == op.taskCount);
    for (uint32_t k = 0; k < op.taskCount; ++k) {
      const TaskRecord &task = p.tasks[op.firstTask + k];
      CHECK(task.op == o);
      TileCoord tile = tileCoord(tiling, k);
      if (op.kind == OpKind::Dispatch) {
        // A put to the tile's peer signals the event on that peer.
        CHECK(tile.expert == k / 2);
        CHECK(tile.peer == k % 2);
        CHECK(p.signals[task.firstSignal].peerOffset == tile.peer);
        CHECK((tile.rowBegin == 0 && tile.rowEnd == 32 && tile.colEnd == 128));
      } else {
        CHECK(tile.expert == k / 2);
        CHECK(tile.peer == 0);
        CHECK(tile.colBegin == 256 * (k % 2));
        CHECK(tile.colEnd == 256 * (k % 2) + 256);
        CHECK((tile.rowBegin == 0 && tile.rowEnd == 128));
      }
    }
  }
}

TEST_CASE("peers and experts are resolved relative to the loading rank", "[task-binary]") {
  TaskProgram program = smallProgram();
  program.epRanks = 4;
  CHECK(program.peerRank(0, 1) == 1);
  CHECK(program.peerRank(3, 1) == 0);
  CHECK(program.peerRank(2, 3) == 1);
  CHECK(program.globalExpert(3, 1) == 7);
  CHECK_FALSE(program.isBackward());
  program.flags |= kFlagBackward;
  CHECK(program.isBackward());
}

TEST_CASE("ops and their tile grids", "[task-binary][errors][tiles]") {
  TaskProgram p = smallProgram();

  SECTION("a tiling for another op kind") {
    p.ops[0].tiling = 1;
    CHECK(contentError(p) ==
          "op 0 'dispatch': tiling 1 is for a gmm op, but the op is a dispatch op");
  }
  SECTION("ops of one kind may share a tiling") {
    // A second gmm op over the same grid (tasks 8..11, on a third cube core).
    OpRecord second = p.ops[1];
    second.name = p.addString("gate_proj");
    second.firstTask = 8;
    p.ops.push_back(second);
    for (uint32_t k = 0; k < 4; ++k) {
      TaskRecord task = p.tasks[4 + k];
      task.op = 2;
      task.firstSignal = 8;
      p.tasks.push_back(task);
      p.queueEntries.push_back(8 + k);
    }
    p.signals.push_back({1, 1, 0, 0});
    p.events[1].threshold = 8;
    p.queues.push_back({CoreKind::Cube, {}, 2, 8, 4});
    Status status = validateTaskProgram(p);
    INFO(status.message());
    CHECK(status.ok());
    CHECK(readOk(writeTaskBinary(p)) == p);
  }
  SECTION("a task count other than the grid's") {
    p.tilings[1].colTiles = 3;
    CHECK(contentError(p) ==
          "op 1 'up_proj': has 4 tasks, but its tiling 1 is a grid of 6 tiles (2 x 1 x 1 x 3)");
    p = smallProgram();
    p.ops[0].taskCount = 3;
    CHECK(contentError(p) ==
          "op 0 'dispatch': has 3 tasks, but its tiling 0 is a grid of 4 tiles (2 x 2 x 1 x 1)");
  }
  SECTION("experts: 1 or L") {
    p.tilings[1].experts = 3;
    CHECK(contentError(p) == "tiling 1: a grid of 3 experts; it must be 1 or the 2 local experts");
    p.tilings[1].experts = 0;
    CHECK(contentError(p) == "tiling 1: a grid of 0 experts; it must be 1 or the 2 local experts");
    // One expert: the op's 4 tasks are 1 x 1 x 1 x 4 tiles.
    p.tilings[1].experts = 1;
    p.tilings[1].colTiles = 4;
    CHECK(validateTaskProgram(p).ok());
    // With L = 1, only a grid of 1 expert will do.
    p = smallProgram();
    p.localExperts = 1;
    p.layer->experts = 2;
    p.layer->receiveCapacity = 64; // the worst case: 32 x 2 x min(2, 1)
    CHECK(contentError(p) == "tiling 0: a grid of 2 experts; it must be 1 or the 1 local experts");
  }
  SECTION("peers: 1 or R") {
    p.tilings[0].peers = 3;
    CHECK(contentError(p) == "tiling 0: a grid of 3 peers; it must be 1 or the 2 EP ranks");
    p.tilings[0].peers = 0;
    CHECK(contentError(p) == "tiling 0: a grid of 0 peers; it must be 1 or the 2 EP ranks");
    // One peer: the 4 dispatch tasks as 2 experts x 2 row tiles.
    p.tilings[0].peers = 1;
    p.tilings[0].rowTiles = 2;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("peer groups: 2 to R, of per-expert tiles that share out their rows") {
    p.tilings[1].peers = 2; // up_proj's 4 tasks: 2 experts x 2 groups x 1 x 1
    p.tilings[1].colTiles = 1;
    CHECK(contentError(p) == "tiling 1: 2 peer groups of a gmm need per-expert tiles that share "
                             "out their rows");
    p.tilings[1].flags |= kTilingShareRows;
    Status status = validateTaskProgram(p);
    INFO(status.message());
    CHECK(status.ok());
    p.tilings[1].peers = 4;
    p.tilings[1].experts = 1;
    CHECK(contentError(p) == "tiling 1: a grid of 4 peers; it must be 1 or the 2 EP ranks (or "
                             "peer groups, at most as many)");
  }
  SECTION("an empty grid") {
    p.tilings[1].rowTiles = 0;
    CHECK(contentError(p) == "tiling 1: a grid of 0 x 2 tiles is empty");
    p = smallProgram();
    p.tilings[0].colTiles = 0;
    CHECK(contentError(p) == "tiling 0: a grid of 1 x 0 tiles is empty");
  }
  SECTION("fewer rows or columns than tiles") {
    p.tilings[1].rows = 0;
    CHECK(contentError(p) == "tiling 1: 1 row tiles of 0 rows and 2 column tiles of 512 columns "
                             "leave a tile empty");
    p = smallProgram();
    p.tilings[1].cols = 1;
    CHECK(contentError(p) == "tiling 1: 1 row tiles of 128 rows and 2 column tiles of 1 columns "
                             "leave a tile empty");
    // As many as tiles: every tile has one.
    p = smallProgram();
    p.tilings[1].cols = 2;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("balanced rows are an estimate, not a bound") {
    // A weight-gradient GMM (depth 0) reduces over balancedRows rows, which
    // may be more than the rows (of the weight) it tiles.
    p.tilings[1].depth = 0;
    p.tilings[1].balancedRows = 4096;
    CHECK(validateTaskProgram(p).ok());
    p.tilings[0].balancedRows = 0;
    CHECK(validateTaskProgram(p).ok());
  }
  SECTION("a tiling's scale") {
    p.tilings[1].scale = 2.0f;
    CHECK(contentError(p) == "tiling 1: scale is set without the scale flag");
    p.tilings[1].flags |= kTilingScale;
    CHECK(validateTaskProgram(p).ok());
    p.tilings[1].scale = 0.0f;
    CHECK(contentError(p) == "tiling 1: scale 0 is not a finite nonzero number");
    p.tilings[1].scale = std::numeric_limits<float>::infinity();
    CHECK(contentError(p) == "tiling 1: scale inf is not a finite nonzero number");
  }
  SECTION("tile bounds that overflow 64 bits") {
    // tileBegin(2, rows, 2) = 2 * rows / 2 must not wrap.
    p.tilings[1].rowTiles = 2;
    p.tilings[1].colTiles = 1;
    p.tilings[1].rows = uint64_t(1) << 63;
    CHECK(contentError(p) == "tiling 1: 2 row tiles of 9223372036854775808 rows and 1 column tiles "
                             "of 512 columns overflow the 64-bit tile bounds");
    p.tilings[1].rows = (uint64_t(1) << 63) - 1;
    REQUIRE(validateTaskProgram(p).ok());
    CHECK(tileCoord(p.tilings[1], 1).rowEnd == p.tilings[1].rows);
    CHECK(tileCoord(p.tilings[1], 1).rowBegin < p.tilings[1].rows);
  }
  SECTION("a tiling no op uses is checked too") {
    TilingRecord unused = p.tilings[1];
    unused.rowTiles = 0;
    p.tilings.push_back(unused);
    CHECK(contentError(p) == "tiling 2: a grid of 0 x 2 tiles is empty");
    p.tilings.back() = p.tilings[1];
    p.tilings.back().opKind = OpKind(8);
    CHECK(contentError(p) == "tiling 2: op kind 8 is not an op kind (1..7)");
  }
}

TEST_CASE("a grid holds at most 2^32 - 1 tiles", "[task-binary][errors][tiles]") {
  SECTION("2^32 tiles") {
    TaskProgram p = bareProgram(1u << 16, 1u << 16);
    TilingRecord tiling;
    tiling.experts = 1u << 16;
    tiling.peers = 1u << 16; // peer groups of an activation GMM: rows shared out
    tiling.flags = kTilingShareRows;
    tiling.depth = 1;
    p.tilings.push_back(tiling);
    CHECK(contentError(p) == "tiling 0: a grid of 4294967296 tiles is above the 4294967295 a "
                             "binary holds");
    // One fewer expert: 2^32 - 2^16 tiles fit, and the op that uses them
    // must have as many tasks.
    p.localExperts = tiling.experts = p.tilings[0].experts = (1u << 16) - 1;
    p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, 0, 0, 0, 0});
    CHECK(contentError(p) ==
          "op 0 'gmm': has 0 tasks, but its tiling 0 is a grid of 4294901760 tiles (65535 x "
          "65536 x 1 x 1); only a lead product, computed in the tiles of a GMM that reads its "
          "output as its low-rank U, has none, and no GMM with tasks reads this op's so");
  }
  SECTION("a grid whose count wraps 64 bits to 0") {
    // 2^16 experts x 2^16 peers x 2^16 x 2^16 tiles: 2^64, which tileCount()
    // wraps to 0; an op of no tasks must not pass for it.
    TaskProgram p = bareProgram(1u << 16, 1u << 16);
    TilingRecord tiling;
    tiling.experts = tiling.peers = tiling.rowTiles = tiling.colTiles = 1u << 16;
    tiling.rows = tiling.cols = 1u << 16;
    p.tilings.push_back(tiling);
    p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, 0, 0, 0, 0});
    REQUIRE(tiling.tileCount() == 0);
    CHECK(contentError(p) == "tiling 0: a grid of 65536 x 65536 x 65536 x 65536 tiles is above "
                             "the 4294967295 a binary holds");
  }
  SECTION("a grid whose count wraps 64 bits to 1") {
    // 3935371 x 409891 x 7623851 x 3 = 2^65 + 1, which tileCount() wraps
    // to 1: an op of one task must not pass for it.
    const uint32_t experts = 3935371, peers = 409891, rowTiles = 7623851;
    TaskProgram p = bareProgram(peers, experts);
    TilingRecord tiling;
    tiling.experts = experts;
    tiling.peers = peers;
    tiling.rowTiles = rowTiles;
    tiling.colTiles = 3;
    tiling.rows = rowTiles;
    tiling.cols = 3;
    p.tilings.push_back(tiling);
    p.ops.push_back({p.addString("gmm"), OpKind::Gmm, {}, 0, 1, 0, 0});
    TaskRecord task;
    task.coreKind = CoreKind::Cube;
    p.tasks.push_back(task);
    p.queues.push_back({CoreKind::Cube, {}, 0, 0, 1});
    p.queueEntries.push_back(0);
    REQUIRE(tiling.tileCount() == 1);
    CHECK(contentError(p) == "tiling 0: a grid of 3935371 x 409891 x 7623851 x 3 tiles is above "
                             "the 4294967295 a binary holds");
    // The same program with a grid of one tile is valid.
    p.tilings[0].experts = p.tilings[0].peers = p.tilings[0].rowTiles = p.tilings[0].colTiles = 1;
    Status status = validateTaskProgram(p);
    INFO(status.message());
    CHECK(status.ok());
  }
}

TEST_CASE("a peer group's rows come from its source ranks", "[task-binary][tiles]") {
  // 5 EP ranks; an expert's segment holds 3, 0, 4, 2 and 5 rows from ranks
  // 0..4, so the rows from rank q start at starts[q].
  const uint32_t R = 5;
  const int64_t starts[R + 1] = {0, 3, 3, 7, 9, 14};
  TilingRecord tiling;
  tiling.opKind = OpKind::Swiglu;
  tiling.flags = kTilingShareRows;
  tiling.peers = 2; // offsets [0, 2) and [2, 5)
  tiling.rowTiles = 2;
  tiling.rows = 64;
  // On rank 0, group 0 holds the rows from ranks 4 and 0 (offsets 1 and 0
  // behind): 5 + 3 rows in two runs, rank 4's first; two tiles of 4 rows.
  TileRowRuns first = peerGroupRows(tiling, tileCoord(tiling, 0), 0, R, starts);
  REQUIRE(first.count == 1);
  CHECK((first.runs[0].begin == 9 && first.runs[0].end == 13));
  TileRowRuns second = peerGroupRows(tiling, tileCoord(tiling, 1), 0, R, starts);
  REQUIRE(second.count == 2);
  CHECK((second.runs[0].begin == 13 && second.runs[0].end == 14));
  CHECK((second.runs[1].begin == 0 && second.runs[1].end == 3));
  CHECK(second.size() == 4);
  // On rank 1, group 1 holds the rows from ranks 4, 3 and 2: one run.
  TileRowRuns later = peerGroupRows(tiling, tileCoord(tiling, 2), 1, R, starts);
  REQUIRE(later.count == 1);
  CHECK((later.runs[0].begin == 3 && later.runs[0].end == 8));
  // On every rank, the tiles of all groups hold each row of the segment
  // once, each from a group whose offsets include the row's source.
  tiling.rowTiles = 3;
  for (uint32_t rank = 0; rank < R; ++rank) {
    std::vector<int> seen(14, 0);
    for (uint64_t t = 0; t < tiling.tileCount(); ++t) {
      TileCoord tile = tileCoord(tiling, t);
      TileRowRuns runs = peerGroupRows(tiling, tile, rank, R, starts);
      for (uint32_t k = 0; k < runs.count; ++k)
        for (uint64_t row = runs.runs[k].begin; row < runs.runs[k].end; ++row) {
          ++seen[row];
          uint32_t source = 0;
          while (int64_t(row) >= starts[source + 1])
            ++source;
          const uint32_t offset = (rank + R - source) % R;
          INFO("rank " << rank << " row " << row << " from rank " << source);
          CHECK(peerGroupOf(offset, R, tiling.peers) == tile.peer);
        }
    }
    for (int count : seen)
      CHECK(count == 1);
  }
  // Without groups: the tile's share of the whole segment.
  tiling.peers = 1;
  TileRowRuns whole = peerGroupRows(tiling, tileCoord(tiling, 2), 3, R, starts);
  REQUIRE(whole.count == 1);
  CHECK((whole.runs[0].begin == 9 && whole.runs[0].end == 14));
}

TEST_CASE("a tile's rows: fixed and clipped, or shared out", "[task-binary][tiles]") {
  TilingRecord tiling;
  tiling.rowTiles = 4;
  tiling.rows = 1000;
  // Fixed rows: tile 1 is rows 250..500 of the bound, clipped to those there
  // are.
  TileCoord tile = tileCoord(tiling, 1);
  CHECK(tileRows(tiling, tile, 1000).begin == 250);
  CHECK(tileRows(tiling, tile, 1000).end == 500);
  CHECK(tileRows(tiling, tile, 300).end == 300);
  CHECK(tileRows(tiling, tile, 100).size() == 0);
  // Shared out: tile 1 of 4 takes its quarter of the rows there are, and
  // the four tiles cover them exactly whatever their number.
  tiling.flags = kTilingShareRows;
  CHECK(tileRows(tiling, tile, 100).begin == 25);
  CHECK(tileRows(tiling, tile, 100).end == 50);
  for (uint64_t present : {0, 1, 3, 7, 100, 1001, 5000}) {
    uint64_t next = 0;
    for (uint64_t i = 0; i < tiling.rowTiles; ++i) {
      TileRows rows = tileRows(tiling, tileCoord(tiling, i), present);
      CHECK(rows.begin == next);
      next = std::max(next, rows.end);
    }
    CHECK(next == present);
  }
}

} // namespace
