//===- LayerShape.h - The sizes of a compiled MoE-FFN layer -----*- C++ -*-===//
//
// The one description of a layer's sizes that the runtime, its backends, the
// tools and the framework op share: ranks, experts, H, I, S, K, the
// capacities a task binary was compiled for, and the element types. The
// runtime reads it from a binary (runtime/layer/Layer.h).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_FORMAT_LAYERSHAPE_H
#define MOEC_FORMAT_LAYERSHAPE_H

#include "base/DType.h"
#include "format/Capacity.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace moec {

/// How a layer's base weights w1 and w2 are stored. A format other than
/// Dense is frozen (it has no gradients) and has fp32 scales, for each
/// expert's matrix [rows, cols] as stored (runtime/cpu/Quant.h):
enum class WeightFormat : uint8_t {
  /// Values of the activations' dtype.
  Dense = 0,
  /// FP8 e4m3 codes with a scale per 128 x 128 block (runtime/cpu/Fp8.h).
  Fp8Block128 = 1,
  /// int8 codes with a scale per row (symmetric).
  Int8Channel = 2,
  /// 4-bit codes, two a byte, with a scale per group of
  /// LayerShape::weightGroup values along a row, and a zero point per
  /// group (LayerShape::weightZeroPoints) or the zero point 8.
  Int4Group = 3,
};

/// The sizes and capacities of a compiled layer, read from its binary.
struct LayerShape {
  bool backward = false;        ///< a backward pass
  /// R = P * T, all ranks: P expert-parallel ranks of T tensor-parallel
  /// ranks each (rank r: EP coordinate r / T, TP coordinate r % T).
  uint32_t ranks = 1;
  uint32_t tp = 1;              ///< T
  uint32_t localExperts = 1;    ///< L
  int64_t hidden = 0;           ///< H
  /// I of one rank (the halved intermediate size): an expert's
  /// intermediate size divided by T.
  int64_t inter = 0;
  int64_t tokens = 0;           ///< S the binary was compiled for (tokens per rank)
  int64_t topK = 0;             ///< K the binary was compiled for
  int64_t rowCapacity = 0;      ///< most (token, k) rows a rank routes: S * K
  int64_t receiveCapacity = 0;  ///< most rows a rank's experts receive in all
  int64_t expertCapacity = 0;   ///< most rows one expert receives
  int64_t putCapacity = 0;      ///< most rows one rank sends one expert
  /// The config's capacity_factor (the binary's layer record): what
  /// receiveCapacity follows from.
  double capacityFactor = 0;
  DType activations = DType::F32; ///< x, y, w1, w2, dy, dx
  DType weightGrads = DType::F32; ///< dw1, dw2
  bool accumulateWeightGrads = false; ///< dw1, dw2 are added to, not written
  /// A backward pass without weight gradients (the base weights are
  /// frozen): dx and dtopk_weights only.
  bool frozen = false;
  /// LoRA adapters on the experts (base weights frozen): bit 0 on w1 (the
  /// gate/up projection), bit 1 on w2 (the down projection); 0: none.
  uint8_t loraTargets = 0;
  int64_t loraRank = 0;    ///< r of the adapters
  float loraScaling = 0;   ///< their products' factor: lora_alpha / r
  /// The forward's dispatched rows travel as FP8 e4m3 with fp32 block
  /// scales (a quantize before the dispatch, a dequantize after it).
  bool fp8Dispatch = false;
  /// The base weights are stored with each expert's matrix transposed:
  /// w1 [L, 2I, H] (gate rows, then up) and w2 [L, H, I], the layout of
  /// Hugging Face's fused experts (gate_up_proj, down_proj). The forward
  /// GMMs read them transposed and the backward ones as they are; only a
  /// layer without base weight gradients (frozen, or LoRA) has it.
  bool weightsTransposed = false;
  /// The base weights' storage; a format other than Dense has scales
  /// (w1_scale, w2_scale) and no gradients.
  WeightFormat weightFormat = WeightFormat::Dense;
  /// Int4Group: the values per group (32, 64 or 128), and whether each
  /// group has a zero point of its own (else 8).
  int64_t weightGroup = 0;
  bool weightZeroPoints = false;

  /// The format's name: "dense", "fp8_block128", "int8", or "int4_g<group>"
  /// with "_zp" when the groups have zero points (MoeFFN's weight_format).
  std::string weightFormatName() const {
    switch (weightFormat) {
    case WeightFormat::Dense:
      break;
    case WeightFormat::Fp8Block128:
      return "fp8_block128";
    case WeightFormat::Int8Channel:
      return "int8";
    case WeightFormat::Int4Group:
      return "int4_g" + std::to_string(weightGroup) + (weightZeroPoints ? "_zp" : "");
    }
    return "dense";
  }
  /// The element type of w1 and w2.
  DType weightDType() const {
    switch (weightFormat) {
    case WeightFormat::Dense:
      break;
    case WeightFormat::Fp8Block128:
      return DType::F8E4M3;
    case WeightFormat::Int8Channel:
      return DType::I8;
    case WeightFormat::Int4Group:
      return DType::I4;
    }
    return activations;
  }
  /// The dims of a bound w1 or w2 of dims `w`: `w`, with the last halved
  /// (rounded up) for 4-bit codes, two a byte.
  std::vector<int64_t> storedDims(const std::array<int64_t, 3> &w) const {
    return {w[0], w[1], weightFormat == WeightFormat::Int4Group ? int4Bytes(w[2]) : w[2]};
  }
  /// The dims of the scales of a weight of dims `w` = [L, d1, d2] as
  /// stored: [L, ceil(d1 / 128), ceil(d2 / 128)] (FP8 blocks), [L, d1]
  /// (int8 rows), [L, d1, d2 / group] or [L, d1, d2 / group, 2] (int4
  /// groups, with zero points); none when dense.
  std::vector<int64_t> scaleDims(const std::array<int64_t, 3> &w) const {
    switch (weightFormat) {
    case WeightFormat::Dense:
      break;
    case WeightFormat::Fp8Block128:
      return {w[0], (w[1] + 127) / 128, (w[2] + 127) / 128};
    case WeightFormat::Int8Channel:
      return {w[0], w[1]};
    case WeightFormat::Int4Group:
      if (weightZeroPoints)
        return {w[0], w[1], w[2] / weightGroup, 2};
      return {w[0], w[1], w[2] / weightGroup};
    }
    return {};
  }

  /// What the capacities follow from (format/Capacity.h).
  format::CapacityInputs capacityInputs() const {
    return {tokens, topK, epRanks(), localExperts, capacityFactor};
  }

  /// P = R / T, the EP ranks.
  uint32_t epRanks() const { return ranks / tp; }
  /// E = P * L.
  uint32_t experts() const { return epRanks() * localExperts; }
  /// The dims of one rank's w1: [L, H, 2I], or [L, 2I, H] transposed.
  std::array<int64_t, 3> w1Dims() const {
    return weightsTransposed ? std::array<int64_t, 3>{localExperts, 2 * inter, hidden}
                             : std::array<int64_t, 3>{localExperts, hidden, 2 * inter};
  }
  /// The dims of one rank's w2: [L, I, H], or [L, H, I] transposed.
  std::array<int64_t, 3> w2Dims() const {
    return weightsTransposed ? std::array<int64_t, 3>{localExperts, hidden, inter}
                             : std::array<int64_t, 3>{localExperts, inter, hidden};
  }
};

} // namespace moec

#endif // MOEC_FORMAT_LAYERSHAPE_H
