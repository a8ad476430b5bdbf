//===- DeviceTest.cpp - The cuda backend's device side, on its own --------===//
//
// Cases of runtime/cuda/Device.h that the conformance suite does not reach
// through a layer, run where there is a GPU (gpu_suite's [gpu] cases;
// elsewhere each says it was skipped):
//   - device::findBadScales (quantized weights' scales in device memory)
//     against backend::goodScale, the one predicate the host check uses:
//     every span's first bad float, spans of every length, more spans than
//     one launch takes;
//   - the tiles' vector decode of quantized weights against the decode of
//     one value at a time, every code (device::checkDecodeBits).
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/Device.h"
#include "runtime/backend/Pass.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace {
namespace device = moec::cuda::device;

/// Whether there is a GPU; says so where there is none.
bool haveGpu(const char *what) {
  device::Info info;
  if (device::probe(&info).empty())
    return true;
  WARN("no GPU here: " << what << " is not run");
  return false;
}

/// The index of the first float of `v` goodScale refuses, or -1.
int64_t firstBad(const std::vector<float> &v, bool pairs) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!moec::backend::goodScale(v[i], pairs && i % 2 == 1))
      return int64_t(i);
  return -1;
}
} // namespace

TEST_CASE("scales in device memory are checked on the GPU as the host checks them", "[gpu]") {
  if (!haveGpu("device::findBadScales"))
    return;
  const float inf = std::numeric_limits<float>::infinity();
  const float bads[] = {0.0f, -0.0f, -1.0f, std::nanf(""), inf, -inf, 16.0f, 15.5f};
  std::mt19937 rng(7);
  // More spans than one launch takes, lengths 0 .. 5000, pairs or not; most
  // hold one or two bad floats at random places, some none.
  const int spans = 2 * device::kScaleSpansALaunch + 5;
  std::vector<std::vector<float>> host(spans);
  std::vector<bool> pairs(spans);
  std::vector<device::ScaleSpan> list;
  std::vector<void *> memory;
  for (int s = 0; s < spans; ++s) {
    const int64_t lengths[] = {0, 1, 2, 37, 256, 1000, 5000};
    const int64_t n = lengths[s % 7];
    pairs[s] = s % 3 == 0 && n % 2 == 0;
    std::vector<float> &v = host[s];
    v.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i)
      v[i] = pairs[s] && i % 2 ? float(rng() % 16) : 1e-3f * float(1 + rng() % 1000);
    for (int k = 0; k < int(s % 4 == 3 ? 0 : 1 + s % 2) && n > 0; ++k)
      v[rng() % n] = bads[rng() % 8];
    void *d = nullptr;
    REQUIRE(device::allocate(std::max<size_t>(4, v.size() * 4), &d).empty());
    REQUIRE(device::copy(d, v.data(), v.size() * 4).empty());
    memory.push_back(d);
    list.push_back({static_cast<const float *>(d), n, bool(pairs[s])});
  }
  void *scratch = nullptr;
  REQUIRE(device::allocate(8 * spans, &scratch).empty());
  std::vector<int64_t> index(spans, -7);
  std::vector<float> value(spans, 0.0f);
  REQUIRE(device::findBadScales(list.data(), spans, scratch, index.data(), value.data()).empty());
  int found = 0;
  for (int s = 0; s < spans; ++s) {
    INFO("span " << s << " of " << host[s].size() << (pairs[s] ? " (pairs)" : ""));
    const int64_t want = firstBad(host[s], pairs[s]);
    CHECK(index[s] == want);
    if (want >= 0) {
      ++found;
      const float v = host[s][size_t(want)];
      CHECK((std::isnan(v) ? std::isnan(value[s]) : value[s] == v));
    }
  }
  CHECK(found > spans / 3); // the draw holds bad floats in 66 of the 133 spans
  for (void *d : memory)
    device::release(d);
  device::release(scratch);
}

TEST_CASE("the tiles' vector decode of quantized weights gives the bits of the decode of one "
          "value at a time, every code",
          "[gpu]") {
  if (!haveGpu("device::checkDecodeBits"))
    return;
  int64_t mismatches[3] = {-1, -1, -1};
  REQUIRE(device::checkDecodeBits(mismatches).empty());
  CHECK(mismatches[0] == 0); // FP8
  CHECK(mismatches[1] == 0); // int8
  CHECK(mismatches[2] == 0); // int4
}
