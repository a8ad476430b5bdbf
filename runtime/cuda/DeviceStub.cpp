//===- DeviceStub.cpp - The device side where the CUDA toolkit is missing ---===//
//
// Linked instead of Device.cu when nvcc was not found at build time
// (build_device.sh): every call says so, and the CUDA backend refuses to
// start with that message.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/Device.h"

namespace moec::cuda::device {

namespace {
const char *const kMissing = "moec was built without the CUDA toolkit (no /usr/local/cuda/bin/nvcc "
                             "at build time)";
} // namespace

bool built() { return false; }
Error probe(Info *) { return kMissing; }
Error allocate(size_t, void **) { return kMissing; }
void release(void *) {}
Error copy(void *, const void *, size_t) { return kMissing; }
Error upload(void *, const void *, size_t) { return kMissing; }
bool isDevice(const void *) { return false; }
Error run(const Program &, double, RunResult *) { return kMissing; }
Error gatherRows(const void *, uint32_t, const int64_t *, int64_t, const float *, void *, uint32_t,
                 int64_t, int64_t, int64_t) {
  return kMissing;
}
Error combineRows(const void *, uint32_t, int64_t, const int64_t *, const float *, int64_t, void *,
                  uint32_t, int64_t, int64_t) {
  return kMissing;
}
Error combineWeightGrad(const void *, uint32_t, const void *, uint32_t, int64_t, const int64_t *,
                        int64_t, int64_t, int64_t, float *) {
  return kMissing;
}
Error findBadScales(const ScaleSpan *, int, void *, int64_t *, float *) { return kMissing; }
Error decodeWeight(const DecodeSpec &, const void *, const float *, void *) { return kMissing; }
Error benchGemm(const GemmBenchCase &, GemmBenchResult *) { return kMissing; }
Error checkDecodeBits(int64_t *) { return kMissing; }
Error benchDecode(double *) { return kMissing; }

} // namespace moec::cuda::device
