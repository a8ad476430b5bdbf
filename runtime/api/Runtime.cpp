//===- Runtime.cpp - The moec runtime: programs and contexts ---------------===//
//
// The API half of a pass: programs, contexts, bindings, the routing checks
// and the order of a pass; a backend (runtime/backend: the CPU's or the
// CUDA one) does the rest. The C API over it is CApi.cpp. A pass of a
// context:
//
//   prepare  check the routing and the bound tensors of every local rank,
//            then exchange through the fabric what each rank found (its
//            per-expert row counts, or its error), so that every rank of
//            the group knows every rank's counts, and every rank stops with
//            the same message when one rank's input is wrong; check the
//            capacities of all ranks (nothing is written before all checks
//            pass); fill the layout tensors; gather the rows to send
//   tasks    the backend runs the task program on the local ranks
//   finish   reduce the returned rows into y (or dx), and dtopk_weights
//
// This file is the public face (tensors, programs, the Context's methods);
// ContextPasses.cpp runs a pass, ContextImpl.h holds a context's state.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/ContextImpl.h"

namespace moec::rt {

//===----------------------------------------------------------------------===//
// Tensors
//===----------------------------------------------------------------------===//

Tensor makeTensor(void *data, DType dtype, const std::vector<int64_t> &dims) {
  Tensor t{};
  t.data = data;
  t.dtype = moec_dtype(dtype);
  for (int64_t d : dims)
    if (t.ndim < MOEC_MAX_DIMS)
      t.dims[t.ndim++] = d;
  return t;
}

Tensor makeTensor(void *data, DType dtype, std::initializer_list<int64_t> dims) {
  return makeTensor(data, dtype, std::vector<int64_t>(dims));
}

std::string shapeString(const Tensor &tensor) {
  std::vector<int64_t> dims(tensor.dims, tensor.dims + std::clamp(tensor.ndim, 0, MOEC_MAX_DIMS));
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

//===----------------------------------------------------------------------===//
// Program
//===----------------------------------------------------------------------===//


Program::Program(std::unique_ptr<Impl> impl) : body(std::move(impl)) {}
Program::~Program() = default;
const TaskProgram &Program::tasks() const { return body->program; }
const LayerShape &Program::shape() const { return body->plan.shape; }
const std::string &Program::source() const { return body->source; }
uint32_t Program::checksum() const { return body->checksum; }

Status Program::create(TaskProgram program, std::shared_ptr<const Program> *out) {
  if (Status s = format::validateTaskProgram(program); !s)
    return s;
  auto impl = std::make_unique<Impl>();
  if (Status s = analyzeLayer(program, &impl->plan); !s)
    return s;
  const std::vector<uint8_t> bytes = format::writeTaskBinary(program);
  impl->checksum = format::crc32(bytes.data(), bytes.size());
  impl->source = "a program in memory";
  impl->program = std::move(program);
  *out = std::shared_ptr<const Program>(new Program(std::move(impl)));
  return Status::success();
}

Status Program::load(const std::string &path, std::shared_ptr<const Program> *out) {
  TaskProgram program;
  if (Status s = format::loadTaskBinaryFile(path, &program); !s)
    return s;
  std::shared_ptr<const Program> loaded;
  if (Status s = create(std::move(program), &loaded); !s)
    return s.withPrefix(path + ": ");
  const_cast<Impl &>(loaded->impl()).source = path;
  *out = std::move(loaded);
  return Status::success();
}

//===----------------------------------------------------------------------===//
// Context: the public face
//===----------------------------------------------------------------------===//

Context::Context(std::unique_ptr<Impl> impl) : body(std::move(impl)) {}

Context::~Context() {
  if (body && body->inFlight)
    body->submitted.join();
}

Status Context::create(std::shared_ptr<const Program> forward,
                       std::shared_ptr<const Program> backward, const ContextOptions &options,
                       std::unique_ptr<Context> *out) {
  if (!forward)
    return Status::error("a context needs a forward program");
  for (const Program *p : {forward.get(), backward.get()})
    if (p && p->impl().plan.kind != PlanKind::Layer)
      return Status::error(fmt::format(
          "{}: the binary is the {} alone (a graph of one {} op), not a layer pass: run it "
          "with an Exchange (moec_torch.Exchange)",
          p->source(), p->impl().plan.kind == PlanKind::Dispatch ? "dispatch" : "combine",
          p->impl().plan.kind == PlanKind::Dispatch ? "dispatch" : "combine"));
  if (forward->shape().backward)
    return Status::error("the forward program is a backward pass");
  if (backward)
    if (Status s = checkPassesMatch(forward->impl().plan, backward->impl().plan); !s)
      return s;
  auto impl = std::make_unique<Impl>();
  if (Status s = impl->initialize(forward->shape(), options, forward->source()); !s)
    return s;
  const uint32_t R = forward->shape().ranks;
  impl->bound.assign(R, std::array<Tensor, kBindingCount>{});
  impl->fwdProgram = std::move(forward);
  impl->bwdProgram = std::move(backward);
  if (!impl->fabric->allLocal())
    if (Status s = impl->fingerprint(); !s)
      return s;
  const auto createPass = [&](const Program &program, std::unique_ptr<backend::Pass> *pass) {
    backend::PassOptions po = impl->passOptions();
    po.packWeights = po.packWeights && (!program.shape().backward || options.packBackward);
    return impl->backend->createPass(program.tasks(), program.impl().plan, po, pass);
  };
  if (Status s = createPass(*impl->fwdProgram, &impl->fwd); !s)
    return s;
  if (impl->bwdProgram)
    if (Status s = createPass(*impl->bwdProgram, &impl->bwd); !s)
      return s;
  out->reset(new Context(std::move(impl)));
  return Status::success();
}

const LayerShape &Context::shape() const { return body->shape(); }
const format::LayerRecord &Context::layerRecord() const { return body->fwd->plan().record; }
const LayerShape *Context::backwardShape() const {
  return body->bwd ? &body->bwd->plan().shape : nullptr;
}
uint32_t Context::ranks() const { return body->ranks(); }
uint32_t Context::workers() const { return body->workerCount; }
double Context::timeoutSeconds() const { return body->options.timeoutSeconds; }
uint32_t Context::firstLocalRank() const { return body->firstLocal(); }
uint32_t Context::localRanks() const { return body->fabric->localRanks(); }
bool Context::outOfStep() const { return !body->broken.empty(); }
comm::Fabric &Context::fabric() const { return *body->fabric; }
const CapacityNeed &Context::capacityNeed() const { return body->need; }
const PassTimes &Context::forwardTimes() const { return body->fwdTimes; }

std::shared_ptr<const Program> Context::program(TracedPass which) const {
  if (which == TracedPass::Last)
    which = body->lastWasBackward ? TracedPass::Backward : TracedPass::Forward;
  return which == TracedPass::Backward ? body->bwdProgram : body->fwdProgram;
}

const std::vector<int64_t> &Context::routedRows(uint32_t rank) const {
  static const std::vector<int64_t> none;
  return rank < body->routes.size() ? body->routes[rank].layout.counts : none;
}
const PassTimes &Context::backwardTimes() const { return body->bwdTimes; }
size_t Context::workspaceBytes() const {
  return body->fwd->workspaceBytes() + (body->bwd ? body->bwd->workspaceBytes() : 0);
}
std::vector<WorkspaceSlot> Context::workspace() const {
  std::vector<WorkspaceSlot> out;
  for (const backend::Pass *pass : {body->fwd.get(), body->bwd.get()}) {
    if (!pass)
      continue;
    for (const backend::SlotMemory &m : pass->workspace()) {
      WorkspaceSlot w;
      w.pass = pass->plan().shape.backward ? "backward" : "forward";
      w.name = std::string(pass->tasks().name(pass->tasks().slots[m.slot].name));
      w.bytes = m.bytes;
      w.resident = m.resident;
      w.window = m.window;
      w.borrowed = m.borrowed;
      if (m.over != kNoSlot)
        w.over = std::string(pass->tasks().name(pass->tasks().slots[m.over].name));
      w.layout = m.layout;
      out.push_back(std::move(w));
    }
  }
  return out;
}
size_t Context::scratchBytes() const { return body->backend->scratchBytes(); }
size_t Context::packedWeightBytes() const {
  return body->fwd->packedWeightBytes() + (body->bwd ? body->bwd->packedWeightBytes() : 0);
}
Status Context::weightChanged(std::string_view name) {
  static const std::array<Binding, 6> weights{kW1, kW2, kLoraA1, kLoraB1, kLoraA2, kLoraB2};
  const auto *found = std::find_if(weights.begin(), weights.end(),
                                   [&](Binding b) { return name == kBindingNames[b]; });
  if (found == weights.end())
    return Status::error(fmt::format("weightChanged: '{}' is not a weight; expected one of w1, "
                                     "w2, lora_a1, lora_b1, lora_a2, lora_b2",
                                     name));
  if (*found == kW1 || *found == kW2) // its scales are read again
    for (auto &good : body->scalesFoundGood)
      good[*found == kW1 ? 0 : 1] = nullptr;
  for (backend::Pass *pass : {body->fwd.get(), body->bwd.get()}) {
    if (!pass)
      continue;
    const LayerPlan &plan = pass->plan();
    const Binding b = *found;
    const uint32_t slot = b == kW1 ? plan.w1
                          : b == kW2 ? plan.w2
                          : b == kLoraA1 || b == kLoraA2 ? plan.lora[adapterTarget(b)].a
                                                         : plan.lora[adapterTarget(b)].b;
    if (slot != kNoSlot)
      pass->weightChanged(slot);
  }
  return Status::success();
}
size_t Context::workspaceToAllocate() const {
  return body->fwd->workspaceNeeded() + (body->bwd ? body->bwd->workspaceNeeded() : 0);
}
uint64_t Context::passesEnded() const { return body->passes.load(); }
double Context::passShare() const {
  const int stage = body->stage.load();
  const backend::Pass *pass = body->running.load();
  return stage == 0 ? 0.0 : stage == 1 && pass ? pass->tasksShare() : 1.0;
}

Status Context::setRouting(uint32_t rank, const Tensor &topkIds, const Tensor &topkWeights) {
  if (Status s = body->idle(); !s)
    return s;
  return body->setRouting(rank, topkIds, topkWeights);
}

Status Context::bind(uint32_t rank, std::string_view name, const Tensor &tensor) {
  if (Status s = body->idle(); !s)
    return s;
  if (Status s = body->localRank(rank); !s)
    return s;
  const auto *found = std::find(std::begin(kBindingNames), std::end(kBindingNames), name);
  if (found == std::end(kBindingNames))
    return Status::error(fmt::format("rank {}: no tensor is named '{}'; expected one of {}", rank,
                                     name, fmt::join(kBindingNames, ", ")));
  const Binding b = Binding(found - std::begin(kBindingNames));
  const bool backwardOnly =
      b == kDy || b == kDx || b == kDtopk || b == kDw1 || b == kDw2 || isAdapterGrad(b);
  if (isAdapter(b) && !(shape().loraTargets >> adapterTarget(b) & 1))
    return Status::error(fmt::format("rank {}: '{}' is a LoRA adapter on w{}, and this "
                                     "context's programs have none there",
                                     rank, name, adapterTarget(b) + 1));
  if (backwardOnly && !body->bwd)
    return Status::error(fmt::format("rank {}: '{}' is a backward tensor, and this context has "
                                     "no backward program",
                                     rank, name));
  if ((b == kW1Scale || b == kW2Scale) && shape().weightFormat == WeightFormat::Dense)
    return Status::error(fmt::format("rank {}: '{}' is the scales of quantized weights, and "
                                     "this context's weights are dense",
                                     rank, name));
  if ((b == kDw1 || b == kDw2) && body->bwd->plan().shape.frozen)
    return Status::error(fmt::format("rank {}: '{}' is a weight gradient, and this context's "
                                     "backward program has none (frozen weights)",
                                     rank, name));
  if (tensor.ndim < 1 || tensor.ndim > MOEC_MAX_DIMS)
    return Status::error(fmt::format("rank {}: '{}' has {} dims", rank, name, tensor.ndim));
  for (int32_t i = 0; i < tensor.ndim; ++i)
    if (tensor.dims[i] < 0)
      return Status::error(
          fmt::format("rank {}: '{}' has a negative dim: {}", rank, name, shapeString(tensor)));
  const DType want = bindingDType(b, shape(), body->bwd ? &body->bwd->plan().shape : nullptr);
  if (DType(tensor.dtype) != want)
    return Status::error(fmt::format("rank {}: '{}' is {}; expected {}", rank, name,
                                     format::dtypeName(DType(tensor.dtype)),
                                     format::dtypeName(want)));
  if (!tensor.data && elementCount(tensor) > 0)
    return Status::error(fmt::format("rank {}: '{}' has no data", rank, name));
  body->bound[rank][b] = tensor;
  return Status::success();
}

Status Context::forward() {
  if (Status s = body->idle(); !s)
    return s;
  return body->tracked(&Impl::forward);
}

Status Context::backward() {
  if (Status s = body->idle(); !s)
    return s;
  return body->tracked(&Impl::backward);
}

namespace {

/// Runs `pass` of `impl` on a thread of its own, for wait() to join.
template <typename Impl, typename Pass> Status submitPass(Impl *impl, Pass pass) {
  if (Status s = impl->idle(); !s)
    return s;
  try {
    impl->submitted =
        std::thread([impl, pass] { impl->submittedResult = impl->tracked(pass); });
  } catch (const std::system_error &error) {
    return Status::error(std::string("cannot start the thread of a submitted pass: ") +
                         error.what());
  }
  impl->inFlight = true;
  return Status::success();
}

} // namespace

Status Context::submitForward() { return submitPass(body.get(), &Impl::forward); }

Status Context::submitBackward() { return submitPass(body.get(), &Impl::backward); }

Status Context::wait() {
  if (!body->inFlight)
    return Status::error("no pass was submitted");
  body->submitted.join();
  body->inFlight = false;
  return body->submittedResult;
}

const trace::Trace &Context::trace(TracedPass which) const {
  if (which == TracedPass::Last)
    which = body->lastWasBackward ? TracedPass::Backward : TracedPass::Forward;
  return which == TracedPass::Backward ? body->bwdTrace : body->fwdTrace;
}

Status Context::writeTrace(const std::string &path, TracedPass which) const {
  if (Status s = body->idle(); !s)
    return s;
  if (!body->options.trace)
    return Status::error("tracing is off (ContextOptions::trace)");
  if (which == TracedPass::Last)
    which = body->lastWasBackward ? TracedPass::Backward : TracedPass::Forward;
  const bool backward = which == TracedPass::Backward;
  const trace::Trace &trace = backward ? body->bwdTrace : body->fwdTrace;
  if (trace.empty())
    return Status::error(fmt::format("no {} pass has run to the end yet",
                                     backward ? "backward" : "forward"));
  const Program &program = backward ? *body->bwdProgram : *body->fwdProgram;
  comm::Fabric &fabric = *body->fabric;
  if (fabric.allLocal())
    return trace::writeChromeTrace(program.impl().program, trace, path, program.source());
  trace::Trace all;
  if (Status s = gatherTrace(fabric, trace, backward ? body->bwdOrigin : body->fwdOrigin,
                             body->options.timeoutSeconds, &all);
      !s)
    return s.withPrefix("gathering the trace of every rank: ");
  if (fabric.firstLocal() != 0)
    return Status::success();
  return trace::writeChromeTrace(program.impl().program, all, path, program.source());
}

} // namespace moec::rt
