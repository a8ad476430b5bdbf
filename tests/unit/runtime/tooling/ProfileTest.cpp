//===- ProfileTest.cpp - The profile's search for slow task runs ----------===//

#include "runtime/tooling/Profile.h"

#include <catch2/catch.hpp>

using moec::tooling::SlowTask;
using moec::tooling::slowTasks;
using moec::tooling::TaskCost;

namespace {

std::vector<size_t> indices(const std::vector<SlowTask> &slow) {
  std::vector<size_t> out;
  for (const SlowTask &t : slow)
    out.push_back(t.index);
  return out;
}

} // namespace

TEST_CASE("runs at their op's rate are not slow, whatever their work", "[profile]") {
  // 1 ns a FLOP, works from 1e6 to 8e6: times 1 to 8 ms.
  std::vector<TaskCost> runs;
  for (int i = 1; i <= 8; ++i)
    runs.push_back({0, int64_t(i) * 1000000, double(i) * 1e6});
  CHECK(slowTasks(runs, 3, 500000).empty());
}

TEST_CASE("a run three times past its op's median time per unit of work is found", "[profile]") {
  std::vector<TaskCost> runs;
  for (int i = 0; i < 9; ++i)
    runs.push_back({0, 2000000, 2e6}); // 1 ns a FLOP
  runs.push_back({0, 8000000, 2e6});   // 4x: found
  runs.push_back({0, 5000000, 2e6});   // 2.5x: not
  runs.push_back({0, 24000000, 4e6});  // 6x its work's time: found, the larger excess
  const std::vector<SlowTask> slow = slowTasks(runs, 3, 500000);
  CHECK(indices(slow) == std::vector<size_t>{11, 9});
  REQUIRE(slow.size() == 2);
  CHECK(slow[0].expectedNs == Approx(4e6));
  CHECK(slow[1].expectedNs == Approx(2e6));
}

TEST_CASE("each op is judged by its own median", "[profile]") {
  std::vector<TaskCost> runs;
  for (int i = 0; i < 5; ++i) {
    runs.push_back({0, 1000000, 1e6}); // op 0: 1 ns a unit
    runs.push_back({1, 4000000, 1e6}); // op 1: 4 ns a unit, never slow by op 0's rate
  }
  CHECK(slowTasks(runs, 3, 500000).empty());
  runs.push_back({1, 16000000, 1e6}); // 4x op 1's rate
  CHECK(indices(slowTasks(runs, 3, 500000)) == std::vector<size_t>{10});
}

TEST_CASE("small excesses and runs without work are not reported", "[profile]") {
  std::vector<TaskCost> runs;
  for (int i = 0; i < 5; ++i)
    runs.push_back({0, 20000, 1e4}); // 20 us tasks
  runs.push_back({0, 200000, 1e4});  // 10x, but 0.18 ms past the median
  runs.push_back({0, 90000000, 0});  // no work: not judged
  CHECK(slowTasks(runs, 3, 500000).empty());
  CHECK(indices(slowTasks(runs, 3, 100000)) == std::vector<size_t>{5});
}

TEST_CASE("an op whose median run took no measurable time names no run", "[profile]") {
  // A clock too coarse for the op's runs: most read 0 ns. Every run would
  // be infinitely past that median; none is reported.
  std::vector<TaskCost> runs = {{0, 0, 1e6}, {0, 0, 1e6}, {0, 0, 1e6}, {0, 2000000, 1e6}};
  CHECK(slowTasks(runs, 3, 500000).empty());
}
