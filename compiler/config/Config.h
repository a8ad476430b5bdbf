//===- Config.h - Model and parallel config of an MoE-FFN layer -*- C++ -*-===//
//
// The config of one MoE-FFN layer (model shape, expert/tensor parallelism,
// tokens per rank, element type, core counts), loaded from JSON, together
// with the task-split values derived from it and the symbol bindings that
// graph descriptions evaluate their expressions against.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_COMPILER_CONFIG_CONFIG_H
#define MOEC_COMPILER_CONFIG_CONFIG_H

#include "compiler/support/Expr.h"

#include "base/DType.h"
#include "format/TaskBinary.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>
#include <string_view>

namespace moec {

// The config's spellings of a dtype ("fp32", "bf16"): configDTypeName and
// parseDType, in base/DType.h's table.

/// The model/parallel config of an MoE-FFN layer.
struct ModelConfig {
  // Required keys.
  int64_t hiddenSize = 0;       ///< "hidden_size": H.
  int64_t intermediateSize = 0; ///< "intermediate_size": I (SwiGLU-halved).
  int64_t numExperts = 0;       ///< "num_experts": E.
  int64_t topK = 0;             ///< "top_k": K.
  int64_t ep = 0;               ///< "ep": expert parallelism P (experts split P ways).
  /// "tp": expert tensor parallelism T: each expert's intermediate size is
  /// split over T ranks ([ep, tp] mesh of P * T ranks; w1's gate and up
  /// columns column-parallel, w2's rows row-parallel).
  int64_t tp = 0;
  int64_t seqSize = 0;          ///< "seq_size": tokens per EP rank S (its TP ranks share them).
  DType dtype = DType::BF16;    ///< "dtype": "fp32" | "bf16".
  // Optional keys.
  int64_t numCubeCores = 0;   ///< "num_cube_cores"; 0: the target profile's count.
  int64_t numVectorCores = 0; ///< "num_vector_cores"; 0: the target profile's count.
  std::string name;            ///< "name": free text.
  /// "capacity_factor": the rows a rank's experts can receive in all, as a
  /// multiple of the balanced load per_rank_seq (at most the worst case,
  /// see format/Capacity.h). Default 2.
  double capacityFactor = 2.0;
  /// "main_grad": weight gradients accumulate into fp32 buffers the caller
  /// keeps across micro-batches (C += AᵀB inside the weight-gradient GMMs,
  /// Megatron's gradient_accumulation_fusion). Default false.
  bool mainGrad = false;
  /// "lora_rank": the rank r of LoRA adapters on the experts (the graph's
  /// `lora_rank` symbol); 0: unset (a graph with adapters then fails to
  /// resolve).
  int64_t loraRank = 0;
  /// "lora_alpha": the adapters' alpha; their products are scaled by
  /// lora_alpha / lora_rank (PEFT's `scaling`). 0: unset, which means
  /// lora_alpha = lora_rank (a scaling of 1).
  double loraAlpha = 0;
  /// "dispatch_dtype": the type the dispatched token rows travel in:
  /// "fp8_e4m3" quantizes them (one fp32 scale per 128 values) before the
  /// put and dequantizes them on arrival (the graph's quantizable dispatch
  /// ops, moe-quantize-dispatch); unset or the config's "dtype": rows
  /// travel in the compute dtype. Default false.
  bool fp8Dispatch = false;
  /// "weight_group": the values per group of int4 base weights (the
  /// graph's `weight_group` symbol: 32, 64 or 128, which the gmm's
  /// verifier checks); 0: unset (a graph that uses it then fails to
  /// resolve).
  int64_t weightGroup = 0;
};

/// The task-split values derived from a config.
struct TaskSplitValue {
  int64_t allExpertNum;        ///< E.
  int64_t singleRankExpertNum; ///< E / ep.
  int64_t seqAll;              ///< seq_size * ep * top_k.
  int64_t perExpertSeq;        ///< seq_all / top_k.
  int64_t perRankSeq;          ///< seq_all / ep.
  int64_t perExpertSeqToOther; ///< seq_all / (ep * top_k).
};

/// Parses a config from JSON text and validates it with validateConfig().
/// `source` names the file in messages. On failure returns false and sets
/// *error to "SOURCE:LINE:COL: message" for malformed JSON and to
/// "SOURCE: message" otherwise; *out is then unspecified.
bool parseConfig(std::string_view text, const std::string &source,
                 ModelConfig *out, std::string *error);

/// Reads the file at `path` and parses it with parseConfig(). Fails with
/// "cannot read 'PATH': <strerror>" when the file cannot be read.
bool loadConfig(const std::string &path, ModelConfig *out, std::string *error);

/// Checks the values of `c`: every count positive, num_experts a multiple of
/// ep, intermediate_size a multiple of tp, top_k at most num_experts, and
/// seq_size * ep * top_k within int64 (every derived TaskSplitValue field is
/// then an exact integer). On failure returns false and sets *error to
/// "SOURCE: message".
bool validateConfig(const ModelConfig &c, const std::string &source,
                    std::string *error);

/// Returns the task-split values of a config that passed validateConfig().
TaskSplitValue deriveTaskSplitValue(const ModelConfig &c);

/// The config's values its capacities follow from (format/Capacity.h: the
/// compiler sizes the dynamic tensors with receiveCapacityRows of these).
format::CapacityInputs capacityInputs(const ModelConfig &c);

/// The layer record a program compiled from `c` carries (the config's
/// values, and the capacities they give).
format::LayerRecord layerRecord(const ModelConfig &c);

/// Notes a tool prints for a valid config whose meaning a reader may
/// mistake: for tp > 1, that tp splits the experts' intermediate size (an
/// older meaning divided the tokens). Each is "SOURCE: note".
std::vector<std::string> configNotes(const ModelConfig &c, const std::string &source);

/// Sets num_cube_cores and num_vector_cores where the config leaves them
/// unset (0) to a target's core counts. A config that sets them pins the
/// schedule's logical core counts whatever the target.
void setDefaultCoreCounts(ModelConfig *c, int64_t cubeCores, int64_t vectorCores);

/// lora_alpha / lora_rank (lora_alpha defaulting to lora_rank), the factor
/// a gmm with scale "lora_scaling" applies; 0 without lora_rank.
double loraScaling(const ModelConfig &c);

/// Returns every symbol a graph description may use, with its value: the
/// config keys (hidden_size, intermediate_size, num_experts, top_k, ep, tp,
/// seq_size, num_cube_cores and num_vector_cores when set, dtype_size), local_intermediate_size
/// (intermediate_size / tp: the columns of an expert one TP rank holds) and the derived
/// values (single_rank_expert_num, seq_all, per_expert_seq, per_rank_seq,
/// per_expert_seq_to_other). The config must have passed validateConfig().
Bindings configBindings(const ModelConfig &c);

/// The derived symbols as expressions over the config keys, in dependency
/// order (later ones may use earlier ones): the definitions configBindings()
/// evaluates, for comparing symbolic dims before a config is bound.
const std::vector<std::pair<std::string, std::string>> &derivedSymbolDefinitions();

/// The seed's TaskSplitValue fields by their seed names.
nlohmann::ordered_json taskSplitValueToJson(const TaskSplitValue &v);

/// Serialises `c` to JSON with every key, optional ones included.
nlohmann::json configToJson(const ModelConfig &c);

} // namespace moec

#endif // MOEC_COMPILER_CONFIG_CONFIG_H
