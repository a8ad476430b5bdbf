//===- GpuProbe.cpp - Is there a GPU for the cuda backend? ------------------===//
//
// Prints the GPU the cuda backend would run on and exits 0, or prints why
// there is none and exits 1.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/Pass.h"

#include <cstdio>

int main() {
  std::string gpu;
  if (moec::Status s = moec::cuda::describeDevice(&gpu); !s) {
    std::printf("%s\n", s.message().c_str());
    return 1;
  }
  std::printf("%s\n", gpu.c_str());
  return 0;
}
