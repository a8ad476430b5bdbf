//===- Profile.h - Device profiles: cores, kernel blocks, rates -*- C++ -*-===//
//
// A target profile says what a task binary is scheduled for: how many cube
// (matrix) and vector (element-wise, communication) cores each rank has, the
// kernel block sizes a GMM tile is computed in, and the rates the cost model
// uses to order and balance queues. Built-in profiles are `cpu` (this
// machine), `ascend-910b` and `h100`; a JSON file gives any other.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_TARGET_PROFILE_H
#define MOEC_COMPILER_TARGET_PROFILE_H

#include "base/Status.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moec::target {

/// A device profile.
struct TargetProfile {
  std::string name;
  uint32_t cubeCores = 1;   ///< logical cube cores per rank
  uint32_t vectorCores = 1; ///< logical vector cores per rank
  uint32_t tileM = 64;      ///< GMM kernel block sizes
  uint32_t tileN = 64;
  uint32_t tileK = 64;
  double cubeFlops = 1e9;     ///< matmul flop/s of one cube core
  double vectorBytes = 1e9;   ///< element-wise bytes/s (read + written) of one vector core
  double linkBytes = 1e9;     ///< bytes/s of one put to a peer rank
  double taskOverhead = 1e-6; ///< seconds every task costs besides its work
};

/// The names of the built-in profiles: "cpu", "ascend-910b", "h100".
const std::vector<std::string> &builtinProfileNames();

/// Returns the built-in profile `name`. `cpu` has one cube and one vector
/// core per hardware thread of this machine. Fails for an unknown name, with
/// the list of known ones and the closest one.
Status builtinProfile(const std::string &name, TargetProfile *out);

/// Parses a profile from JSON text: {"name", "cube_cores", "vector_cores",
/// optional "tile_m", "tile_n", "tile_k", "cube_tflops", "vector_gbps",
/// "link_gbps", "task_overhead_us"}. `source` names the file in messages.
Status parseProfile(const std::string &text, const std::string &source, TargetProfile *out);

/// Resolves a --target argument: a built-in name, or else a path to a
/// profile JSON file (anything containing '/' or ending in ".json").
Status resolveProfile(const std::string &spec, TargetProfile *out);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_PROFILE_H
