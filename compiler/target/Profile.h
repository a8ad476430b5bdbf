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
#include "compiler/config/Config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moec::target {

/// Which queues share the hardware that runs them.
enum class CoreSharing : uint8_t {
  None,  ///< every queue has its own core (Ascend: AIC and AIV cores)
  Rank,  ///< a rank's cube and vector queues share max(cube, vector) cores
         ///< (an H100 SM runs either kind of task, one at a time)
  Group, ///< every queue of every rank shares max(cube, vector) cores: the
         ///< CPU runtime, whose ranks are threads of one process
};

/// "none", "rank", "group".
const char *coreSharingName(CoreSharing sharing);

/// A device profile: what the cost model (Cost.h) and the simulation
/// (Simulate.h) know of a device.
struct TargetProfile {
  std::string name;
  uint32_t cubeCores = 1;   ///< logical cube cores per rank
  uint32_t vectorCores = 1; ///< logical vector cores per rank
  uint32_t tileM = 64;      ///< GMM kernel block sizes
  uint32_t tileN = 64;
  uint32_t tileK = 64;
  /// The granularity a cube core computes in: a GMM tile's M, N and K are
  /// rounded up to multiples of these (a 31-column tile on a 128-wide MMA
  /// costs 128 columns). 1: no rounding.
  uint32_t padM = 1, padN = 1, padK = 1;
  double cubeFlops = 1e9;     ///< fp32 matmul flop/s of one cube core
  double cubeFlopsBf16 = 1e9; ///< bf16 matmul flop/s of one cube core
  double memoryBytes = 1e10;  ///< bytes/s a cube core streams operands at (the roofline)
  double vectorBytes = 1e9;   ///< bytes/s (read + written) one vector core streams: a copy
  double vectorElems = 1e9;   ///< element reads + writes/s of one vector core's SwiGLU math
  double linkBytes = 1e9;     ///< bytes/s of one put to a peer rank
  double linkTotalBytes = 0;  ///< bytes/s all puts of a rank share; 0: no limit
  double taskOverhead = 1e-6; ///< seconds every task costs besides its work
  CoreSharing sharing = CoreSharing::None;
  /// The cube cores read their operands through a cache they share (an
  /// H100's or a 910B's L2): the GMM tiles that run at once and read the
  /// same operand panel load it from memory once between them.
  bool sharedCache = false;
  /// Where the rates come from: "" for estimates, or what measured them
  /// ("moec bench --calibrate on ...").
  std::string calibrated;
};

/// `n` rounded up to a multiple of `granule` (a profile's padM, padN or
/// padK; 0 counts as 1): what a cube core computes for `n`.
double paddedTo(double n, uint32_t granule);

/// The names of the built-in profiles: "cpu", "ascend-910b", "h100".
const std::vector<std::string> &builtinProfileNames();

/// Returns the built-in profile `name`. `cpu` has one cube and one vector
/// core per hardware thread of this machine. Fails for an unknown name, with
/// the list of known ones and the closest one.
Status builtinProfile(const std::string &name, TargetProfile *out);

/// Parses a profile from JSON text: {"name", "cube_cores", "vector_cores",
/// optional "tile_m", "tile_n", "tile_k", "pad_m", "pad_n", "pad_k",
/// "cube_tflops", "cube_tflops_bf16", "memory_gbps", "vector_gbps",
/// "vector_gelems",
/// "link_gbps", "link_total_gbps", "task_overhead_us", "core_sharing"
/// ("none", "rank", "group"), "calibrated" (a note)}. Rates not given are
/// the cpu profile's. `source` names the file in messages.
Status parseProfile(const std::string &text, const std::string &source, TargetProfile *out);

/// Returns `profile` as the JSON text parseProfile reads.
std::string profileJson(const TargetProfile &profile);

/// Resolves a --target argument: a built-in name, or else a path to a
/// profile JSON file (anything containing '/' or ending in ".json").
Status resolveProfile(const std::string &spec, TargetProfile *out);

/// Reads the model config at `configPath` once and resolves the target
/// `targetSpec` (as resolveProfile): *config gets the target's cube and
/// vector core counts where it sets none, *profile the target's profile.
/// What a compile and `moec check` start from.
Status loadConfigForTarget(const std::string &configPath, const std::string &targetSpec,
                           ModelConfig *config, TargetProfile *profile);

} // namespace moec::target

#endif // MOEC_COMPILER_TARGET_PROFILE_H
