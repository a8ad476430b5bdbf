//===- MoeOps.cpp - The MoE-FFN layer as PyTorch custom ops -------------===//
//
// Registers, with TORCH_LIBRARY, a custom class torch.classes.moec.Layer that
// owns a runtime context (moec::rt) for a forward and a backward task binary
// of one MoE-FFN layer on an EP group of R ranks, and two ops over it. The
// ranks are threads of this process (fabric "inproc"), or one rank per
// process under mpirun (fabric "mpi"); the ops take the tensors of the ranks
// this process runs, P of them (R in process, 1 under MPI):
//
//   moec::forward(Layer layer, Tensor x, Tensor topk_ids, Tensor topk_weights,
//                 Tensor w1, Tensor w2) -> (Tensor y, int step)
//   moec::backward(Layer layer, int step, Tensor x, Tensor topk_ids,
//                  Tensor topk_weights, Tensor w1, Tensor w2, Tensor dy,
//                  Tensor? main_grad1, Tensor? main_grad2)
//       -> (Tensor dx, Tensor dtopk_weights, Tensor? dw1, Tensor? dw2)
//
// dw1 and dw2 are None for a frozen layer (a backward binary without the
// weight-gradient GMMs), and for a main-grad layer (a backward binary that
// accumulates its weight gradients), which adds them to main_grad1 and
// main_grad2 (fp32, shaped like w1 and w2, kept by the caller across
// micro-batches) instead.
//
// Shapes carry this process's ranks first: x, y, dy, dx [P, S, H]; topk_ids
// and topk_weights [P, S, K]; w1 [P*L, H, 2I]; w2 [P*L, I, H], or w1
// [P*L, 2I, H] and w2 [P*L, H, I] for binaries with transposed weights (in process,
// P*L = E, the global tensors of `moec run`). Rank r's slices are views into
// them (rank r owns experts r*L .. r*L+L-1), so nothing is copied on the way
// in. The runtime keeps what backward needs from the last forward
// pass; `step` names that pass, and a backward whose step is no longer the
// last one reruns forward on its saved inputs first (e.g. two forward calls
// of one module before one backward).
//
// Every check of the runtime (dtypes, shapes, expert ids, capacities) fails
// with its message as a c10::Error, which Python sees as a RuntimeError.
//
// And the safetensors header checker for moec_torch.safetensors:
//
//   moec::safetensors_read_header(int fd, int file_bytes) -> str
//   moec::safetensors_parse_header(Tensor header, int data_bytes) -> str
//
// return a header, checked, as normalized JSON (tensors in offset order,
// metadata), or fail with the checker's message. And the FP8 block
// quantizer of frozen weights (runtime/cpu/Fp8.h) for moec_torch.quant:
//
//   moec::quantize_fp8_blocks(Tensor w) -> (Tensor codes, Tensor scales)
//
// w float32 [N, R, C] -> codes uint8 [N, R, C], scales float32
// [N, ceil(R / 128), ceil(C / 128)]. And whether this build has the
// fabrics' test hooks (runtime/comm/Hooks.h; bazel test builds them in),
// for the tests that use them:
//
//   moec::test_hooks_built() -> bool
//
// This file holds the ops and the registration; the classes are Layer.h and
// Exchange.h, a context's slot and buffer pool Slot.h, what they share
// Common.h, and the fabric over a torch.distributed group GroupFabric.h.
//
//===----------------------------------------------------------------------===//

#include "ops/torch/csrc/Exchange.h"
#include "ops/torch/csrc/Layer.h"
#include "runtime/comm/Hooks.h"
#include "runtime/cpu/Fp8.h"
#include "runtime/tooling/Safetensors.h"

#include <torch/library.h>

#include <tuple>
#include <vector>

namespace moec::torchop {
namespace {

std::tuple<at::Tensor, int64_t> forwardOp(const c10::intrusive_ptr<Layer> &layer,
                                          const at::Tensor &x, const at::Tensor &ids,
                                          const at::Tensor &weights, const at::Tensor &w1,
                                          const at::Tensor &w2,
                                          const std::vector<at::Tensor> &adapters) {
  return layer->forward(x, ids, weights, w1, w2, adapters);
}

Layer::Gradients backwardOp(const c10::intrusive_ptr<Layer> &layer, int64_t step,
                            const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights,
                            const at::Tensor &w1, const at::Tensor &w2, const at::Tensor &dy,
                            const c10::optional<at::Tensor> &mainGrad1,
                            const c10::optional<at::Tensor> &mainGrad2,
                            const std::vector<at::Tensor> &adapters) {
  return layer->backward(step, x, ids, weights, w1, w2, dy, mainGrad1, mainGrad2, adapters);
}

/// Frees every MPI layer's context in creation order, then finalizes MPI if
/// moec initialized it. Collective under MPI: every rank calls it once, at
/// the end.
void finalizeMpiOp() {
  {
    std::lock_guard<std::mutex> lock(mpiSlotsMutex);
    for (const std::shared_ptr<Slot> &slot : mpiSlots) {
      slot->sameProcess("layer");
      std::lock_guard<std::mutex> passLock(slot->mutex);
      slot->context.reset();
      slot->exchange.reset();
    }
    mpiSlots.clear();
  }
  moec::comm::finalizeMpi();
}

/// Ends the process-group fabrics (moec::torchop::closeGroupFabrics).
/// Collective over each group: every rank calls it once, at the end.
void closeGroupsOp(double seconds) { moec::torchop::closeGroupFabrics(seconds); }

/// A pass timeout's least, most and default seconds (base/Time.h), which
/// the Python package checks and defaults with.
bool testHooksBuiltOp() { return moec::comm::testHooksBuilt(); }

std::vector<double> timeoutLimitsOp() {
  return {moec::kTimeoutMinSeconds, moec::kTimeoutMaxSeconds, moec::kDefaultTimeoutSeconds};
}

/// The header of the open safetensors file `fd` of `file_bytes` bytes,
/// checked (moec::safetensors::readHeader), as normalized JSON for
/// moec_torch.safetensors, which maps the data area itself; the checker's
/// message as a RuntimeError.
std::string safetensorsReadHeaderOp(int64_t fd, int64_t fileBytes) {
  TORCH_CHECK(fd >= 0 && fd <= std::numeric_limits<int>::max() && fileBytes >= 0,
              "moec: safetensors_read_header takes an open file and its size");
  moec::safetensors::Header header;
  uint64_t dataStart = 0;
  moec::Status status =
      moec::safetensors::readHeader(int(fd), uint64_t(fileBytes), &header, &dataStart);
  TORCH_CHECK(status.ok(), status.message());
  return moec::safetensors::headerToJson(header);
}

/// FP8 codes and 128 x 128 block scales of each matrix of `w` [N, R, C].
std::tuple<at::Tensor, at::Tensor> quantizeFp8BlocksOp(const at::Tensor &w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 3,
              "moec: quantize_fp8_blocks takes a float32 CPU tensor [N, R, C]");
  const at::Tensor in = w.contiguous();
  const int64_t n = in.size(0), rows = in.size(1), cols = in.size(2);
  const int64_t B = moec::cpu::kFp8WeightBlock, rb = (rows + B - 1) / B, cb = (cols + B - 1) / B;
  at::Tensor codes = at::empty({n, rows, cols}, in.options().dtype(at::kByte));
  at::Tensor scales = at::empty({n, rb, cb}, in.options());
  for (int64_t i = 0; i < n; ++i)
    moec::cpu::quantizeBlocks(in.data_ptr<float>() + i * rows * cols, cols, rows, cols,
                              codes.data_ptr<uint8_t>() + i * rows * cols,
                              scales.data_ptr<float>() + i * rb * cb);
  return {codes, scales};
}

/// The header bytes `header` (uint8) checked against a data area of
/// `data_bytes`, as safetensorsReadHeaderOp returns them.
std::string safetensorsParseHeaderOp(const at::Tensor &header, int64_t dataBytes) {
  TORCH_CHECK(header.device().is_cpu() && header.scalar_type() == at::kByte && header.dim() == 1 &&
                  header.is_contiguous() && dataBytes >= 0,
              "moec: safetensors_parse_header takes the header as a 1-d uint8 CPU tensor and "
              "the size of the data area");
  moec::safetensors::Header out;
  moec::Status status = moec::safetensors::parseHeader(
      std::string_view(reinterpret_cast<const char *>(header.data_ptr<uint8_t>()),
                       size_t(header.numel())),
      uint64_t(dataBytes), &out);
  TORCH_CHECK(status.ok(), status.message());
  return moec::safetensors::headerToJson(out);
}

} // namespace
} // namespace moec::torchop

using namespace moec::torchop; // the classes and ops registered below

TORCH_LIBRARY(moec, m) {
  m.class_<Layer>("Layer")
      .def(torch::init<std::string, std::string, int64_t, double, std::string, bool, std::string,
                       int64_t, double>())
      .def("info", &Layer::info)
      .def("weights_changed", &Layer::weightsChanged)
      .def("write_trace", &Layer::writeTrace)
      .def("capacity_need", &Layer::capacityNeed)
      .def("layer_record", &Layer::layerRecord)
      .def("capacity_advice", &Layer::capacityAdvice)
      .def("agree", &Layer::agree)
      .def("all_gather", &Layer::allGather)
      .def("times", &Layer::times)
      .def("profile", &Layer::profile)
      .def("workspace", &Layer::workspace)
      .def("submit_forward", &Layer::submitForward)
      .def("submit_backward", &Layer::submitBackward)
      .def("wait_forward", &Layer::waitForward)
      .def("wait_backward", &Layer::waitBackward)
      .def("discard", &Layer::discard)
      .def("ready", &Layer::ready)
      .def("pending", &Layer::pending);
  m.class_<Exchange>("Exchange")
      .def(torch::init<std::string, std::string, int64_t, double, std::string, int64_t, double>())
      .def("info", &Exchange::info)
      .def("dispatch", &Exchange::dispatch)
      .def("combine", &Exchange::combine)
      .def("dispatch_backward", &Exchange::dispatchBackward)
      .def("combine_backward", &Exchange::combineBackward)
      .def("times", &Exchange::times);
  m.def("forward(__torch__.torch.classes.moec.Layer layer, Tensor x, Tensor topk_ids, "
        "Tensor topk_weights, Tensor w1, Tensor w2, Tensor[] adapters) -> (Tensor, int)",
        forwardOp);
  m.def("backward(__torch__.torch.classes.moec.Layer layer, int step, Tensor x, "
        "Tensor topk_ids, Tensor topk_weights, Tensor w1, Tensor w2, Tensor dy, "
        "Tensor? main_grad1, Tensor? main_grad2, Tensor[] adapters) -> "
        "(Tensor, Tensor, Tensor?, Tensor?, Tensor[])",
        backwardOp);
  m.def("finalize_mpi() -> ()", finalizeMpiOp);
  m.def("close_groups(float seconds) -> ()", closeGroupsOp);
  m.def("timeout_limits() -> float[]", timeoutLimitsOp);
  m.def("safetensors_read_header(int fd, int file_bytes) -> str", safetensorsReadHeaderOp);
  m.def("safetensors_parse_header(Tensor header, int data_bytes) -> str", safetensorsParseHeaderOp);
  m.def("quantize_fp8_blocks(Tensor w) -> (Tensor, Tensor)", quantizeFp8BlocksOp);
  m.def("test_hooks_built() -> bool", testHooksBuiltOp);
}
