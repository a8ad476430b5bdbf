//===- Common.h - What the torch ops share -----------------------*- C++ -*-===//
//
// Failed statuses as c10::Errors, torch's dtypes in the runtime's words, the
// checks of the tensors the ops take, rank slices of them, the sizes a layer
// reports, and a context's options with its fabric.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_OPS_TORCH_CSRC_COMMON_H
#define MOEC_OPS_TORCH_CSRC_COMMON_H

#include "base/Time.h"
#include "ops/torch/csrc/GroupFabric.h"
#include "runtime/api/Runtime.h"
#include "runtime/comm/Hooks.h"
#include "runtime/comm/Mpi.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace moec::torchop {

using moec::DType;

/// Throws a c10::Error carrying a failed status's message.
/// An over-capacity error starts with "moec over capacity: ", so that the
/// Python side can grow the layer's capacity and run the step again.
inline void check(const moec::Status &status, const char *what) {
  TORCH_CHECK(status.code() != moec::StatusCode::OverCapacity,
              "moec over capacity: ", status.message());
  TORCH_CHECK(status.ok(), "moec ", what, ": ", status.message());
}

/// torch's scalar types in the runtime's words ("f32", "i64"), which its
/// messages use, and the runtime dtype each is bound as (the codes of
/// quantized weights are bound as bytes, never through this table).
struct TorchType {
  at::ScalarType type;
  const char *name;
  std::optional<DType> dtype;
};
inline const TorchType kTorchTypes[] = {
    {at::kFloat, "f32", DType::F32},    {at::kBFloat16, "bf16", DType::BF16},
    {at::kInt, "i32", DType::I32},      {at::kLong, "i64", DType::I64},
    {at::kDouble, "f64", std::nullopt}, {at::kHalf, "f16", std::nullopt},
    {at::kShort, "i16", std::nullopt},  {at::kChar, "i8", std::nullopt},
    {at::kByte, "u8", std::nullopt},    {at::kBool, "bool", std::nullopt},
};

inline at::ScalarType torchType(DType dtype) {
  for (const TorchType &t : kTorchTypes)
    if (t.dtype == dtype)
      return t.type;
  TORCH_CHECK(false, "moec: no torch type for dtype ", dtypeName(dtype));
  return at::kFloat;
}

/// A torch dtype in the runtime's words; torch's name for one without a
/// short name.
inline std::string dtypeName(at::ScalarType type) {
  for (const TorchType &t : kTorchTypes)
    if (t.type == type)
      return t.name;
  return c10::toString(type);
}

/// The dtypes a tensor named `name` may have, for a message.
const char *acceptedDTypes(const std::string &name) {
  if (name == "topk_ids")
    return "i32 or i64";
  if (name == "topk_weights" || name == "dtopk_weights")
    return "f32";
  return "f32 or bf16";
}

inline DType moecType(const at::Tensor &t, const char *name) {
  for (const TorchType &k : kTorchTypes)
    if (k.type == t.scalar_type() && k.dtype)
      return *k.dtype;
  TORCH_CHECK(false, "moec: '", name, "' is ", dtypeName(t.scalar_type()), "; expected ",
              acceptedDTypes(name));
  return DType::F32;
}

/// The routing's dtypes, checked before anything else looks at them, in the
/// words of the runtime's own routing checks.
inline void expectRoutingDTypes(const at::Tensor &ids, const at::Tensor &weights) {
  TORCH_CHECK(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong, "moec: topk_ids is ",
              dtypeName(ids.scalar_type()), "; expected i32 or i64");
  TORCH_CHECK(weights.scalar_type() == at::kFloat, "moec: topk_weights is ",
              dtypeName(weights.scalar_type()), "; expected f32");
}

/// The routing against x [P, S, H]: one row of expert ids and of weights
/// per token of x, and as many weights as ids; the tensor that disagrees is
/// the one named.
inline void expectRoutingFor(const at::Tensor &x, const at::Tensor &ids,
                             const at::Tensor &weights) {
  for (const auto &[t, name] : {std::pair{&ids, "topk_ids"}, std::pair{&weights, "topk_weights"}})
    TORCH_CHECK(t->size(1) == x.size(1), "moec: '", name, "' has shape ", t->sizes(), ", but x ",
                x.sizes(), " has ", x.size(1), " tokens a rank: ", name,
                " needs one row per token of x");
  TORCH_CHECK(weights.size(2) == ids.size(2), "moec: 'topk_weights' has shape ", weights.sizes(),
              ", but topk_ids ", ids.sizes(), " routes each token to ", ids.size(2),
              " experts: topk_weights needs one weight per expert id");
}

/// Checks that `t` (x, a weight, an adapter, expert rows) has the layer's
/// dtype `want`.
inline void expectLayerDType(const at::Tensor &t, const char *name, DType want) {
  TORCH_CHECK(t.scalar_type() == torchType(want), "moec: '", name, "' is ",
              dtypeName(t.scalar_type()), "; expected ", dtypeName(torchType(want)),
              ", the layer's dtype");
}

/// Rank r's part of `t` (the r-th of `parts` equal slices along dim 0) as a
/// runtime tensor of the remaining dims (dim 0 divided by `parts` when
/// `keepDim0`).
/// `codes` is the dtype of the layer's quantized weights (w1, w2), whose
/// codes are int8 or uint8 tensors.
inline moec::rt::Tensor slice(const at::Tensor &t, const char *name, int64_t parts, int64_t r,
                              bool keepDim0, DType codes = DType::F8E4M3) {
  moec::rt::Tensor out{};
  // uint8 holds FP8 e4m3 codes (torch 1.13 has no float8 type) or 4-bit
  // codes two a byte; int8 holds int8 codes.
  const bool bytes = t.scalar_type() == (codes == DType::I8 ? at::kChar : at::kByte);
  out.dtype = moec_dtype(bytes ? codes : moecType(t, name));
  const int64_t per = t.size(0) / parts;
  if (keepDim0) {
    out.ndim = int32_t(t.dim());
    out.dims[0] = per;
    for (int64_t i = 1; i < t.dim(); ++i)
      out.dims[i] = t.size(i);
  } else {
    out.ndim = int32_t(t.dim() - 1);
    for (int64_t i = 1; i < t.dim(); ++i)
      out.dims[i - 1] = t.size(i);
  }
  const int64_t rowElements = t.numel() / std::max<int64_t>(1, t.size(0));
  out.data = static_cast<char *>(t.data_ptr()) + r * per * rowElements * t.element_size();
  return out;
}

/// Checks what the runtime cannot see from a raw pointer: CPU, a contiguous
/// layout (made so by the caller), and the leading dim split over ranks.
inline void expectInput(const at::Tensor &t, const char *name, int64_t dims, int64_t leading,
                        const char *leadingName) {
  TORCH_CHECK(t.defined(), "moec: '", name, "' is undefined");
  TORCH_CHECK(t.device().is_cpu(), "moec: '", name, "' is on ", t.device(),
              "; the moec runtime runs on the CPU");
  TORCH_CHECK(t.dim() == dims, "moec: '", name, "' has shape ", t.sizes(), "; expected ", dims,
              " dims");
  TORCH_CHECK(t.size(0) == leading, "moec: '", name, "' has shape ", t.sizes(),
              "; expected dim 0 to be ", leadingName, " = ", leading);
}
/// The most worker threads a layer starts.
inline constexpr int64_t kMaxWorkers = 1024;

/// The sizes a layer and an exchange report to the Python side.
c10::Dict<std::string, int64_t> shapeInfo(const moec::rt::LayerShape &s, uint32_t firstRank,
                                          uint32_t localRanks) {
  c10::Dict<std::string, int64_t> d;
  d.insert("ranks", s.ranks);
  d.insert("tp", s.tp);
  d.insert("first_rank", firstRank);
  d.insert("local_ranks", localRanks);
  d.insert("local_experts", s.localExperts);
  d.insert("experts", s.experts());
  d.insert("hidden", s.hidden);
  d.insert("tokens", s.tokens);
  d.insert("top_k", s.topK);
  d.insert("receive_capacity", s.receiveCapacity);
  d.insert("bf16", s.activations == DType::BF16);
  return d;
}

/// The fabric of a context or an exchange and what it runs over: "inproc",
/// "mpi", or "group" with a torch.distributed group's c10d::ProcessGroup
/// (`group`, from moec_process_group, a reference this takes over) and
/// that group's timeout.
struct FabricChoice {
  std::string name;
  int64_t group = 0;
  double groupTimeoutSeconds = 0;
};

/// The options of a context or an exchange, checked, with its fabric.
inline moec::rt::ContextOptions contextOptions(int64_t workers, double timeoutSeconds,
                                               const FabricChoice &fabric) {
  // Taken over first, so that no check below leaks the reference.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  if (fabric.group != 0)
    group = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim(
        reinterpret_cast<c10d::ProcessGroup *>(fabric.group));
  TORCH_CHECK(workers >= 0 && workers <= kMaxWorkers,
              "moec: workers must be 0 (the hardware "
              "threads) to ",
              kMaxWorkers, ", got ", workers);
  TORCH_CHECK(moec::timeoutInRange(timeoutSeconds), "moec: timeout_seconds must be from ",
              moec::kTimeoutMinSeconds, " to ", moec::kTimeoutMaxSeconds, " seconds, got ",
              timeoutSeconds);
  TORCH_CHECK(fabric.name == "inproc" || fabric.name == "mpi" || fabric.name == "group",
              "moec: fabric must be 'inproc', 'mpi' or 'group', got '", fabric.name, "'");
  TORCH_CHECK((fabric.name == "group") == bool(group),
              "moec: the fabric 'group' takes a process group, and only it");
  moec::rt::ContextOptions options;
  options.workers = uint32_t(workers);
  options.timeoutSeconds = timeoutSeconds;
  if (fabric.name == "mpi") {
    moec::comm::MpiOptions mpi;
    mpi.timeoutSeconds = timeoutSeconds;
    mpi.localPuts = moec::comm::localPutsRequested(); // a measurement mode
    check(moec::comm::createMpiFabric(&options.fabric, mpi), "MPI fabric");
  } else if (fabric.name == "group") {
    TORCH_CHECK(std::isfinite(fabric.groupTimeoutSeconds) && fabric.groupTimeoutSeconds > 0,
                "moec: the process group's timeout must be positive, got ",
                fabric.groupTimeoutSeconds);
    check(moec::torchop::groupFabric(group, timeoutSeconds, fabric.groupTimeoutSeconds,
                                     &options.fabric),
          "process-group fabric");
  }
  return options;
}

} // namespace moec::torchop

#endif // MOEC_OPS_TORCH_CSRC_COMMON_H
