//===- Pass.cpp - One pass of a layer binary on an NVIDIA GPU ---------------===//
//
// See Pass.h. The host half: the program's tables turned into the device's
// records (Device.h) and uploaded once, the workspace, staging of host
// tensors, the layout tensors (computed on the host, as for the CPU, and
// copied up), and the watchdog's report in the program's names.
//
//===----------------------------------------------------------------------===//

#include "runtime/cuda/Pass.h"

#include "runtime/cuda/Device.h"

#include "base/Env.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <utility>

namespace moec::cuda {

using format::OpKind;

namespace {

using Clock = std::chrono::steady_clock;

Status check(const device::Error &error, std::string_view what = {}) {
  if (error.empty())
    return Status::success();
  return Status::error(what.empty() ? error : fmt::format("{}: {}", what, error));
}

/// Bytes of a slot's buffer at its capacity (4-bit codes two a byte along
/// the last dim).
size_t slotSize(const format::SlotRecord &slot) {
  const uint64_t elements = backend::slotElements(slot);
  if (slot.dtype == DType::I4) {
    const uint64_t last = slot.rank ? slot.dims[slot.rank - 1] : 1;
    return size_t(elements / std::max<uint64_t>(last, 1) * uint64_t(int4Bytes(int64_t(last))));
  }
  return size_t(elements) * dtypeSize(slot.dtype);
}

template <typename T> size_t bytesOf(const std::vector<T> &v) { return v.size() * sizeof(T); }

/// The fields of a GMM's Op that read a quantized weight `w` [L, rows,
/// cols] (as stored) and its scales (LayerShape::scaleDims; the layer
/// reader checked their dims).
void describeQuantized(const LayerShape &shape, const format::SlotRecord &w, device::Op *d) {
  const std::array<int64_t, 3> one{1, int64_t(w.dims[1]), int64_t(w.dims[2])};
  const std::vector<int64_t> stored = shape.storedDims(one), scaleDims = shape.scaleDims(one);
  d->quant = uint32_t(shape.weightFormat);
  d->expertStride = stored[1] * stored[2]; // bytes
  d->ldb = one[2];                         // values
  d->scaleStride = 1;
  for (int64_t dim : scaleDims)
    d->scaleStride *= dim;
  d->scaleLd = scaleDims.size() >= 3 ? scaleDims[2] : 1;
  d->groupShift = 0;
  while (shape.weightGroup > (int64_t(1) << d->groupShift))
    ++d->groupShift;
  d->zeroPoints = shape.weightFormat == WeightFormat::Int4Group && shape.weightZeroPoints;
}

/// The bytes of a weight's decoded values (one rank's).
size_t decodedBytes(const device::DecodeSpec &spec) {
  return size_t(spec.experts * spec.rows * spec.cols) * dtypeSize(DType(spec.type));
}

/// Whether quantized weights are decoded whole before the tasks
/// (MOEC_CUDA_DECODE=whole, the default) or as the tiles load them
/// (=tiles); another value is named on stderr, once, and the default taken
/// (read once a process, as MOEC_GEMM is).
bool decodeWholeFirst() {
  static const bool whole = [] {
    const char *value = envValue("MOEC_CUDA_DECODE");
    if (!value || std::strcmp(value, "whole") == 0)
      return true;
    if (std::strcmp(value, "tiles") == 0)
      return false;
    std::fprintf(stderr, "moec: %s is none of 'whole', 'tiles'; using 'whole'\n",
                 envShown("MOEC_CUDA_DECODE", value).c_str());
    return true;
  }();
  return whole;
}

} // namespace

void Pass::decodeWhole(const LayerShape &shape, const format::SlotRecord &w, device::Op *d) {
  uint32_t index = 0;
  while (index < decodes.size() && decodes[index].weight != d->b)
    ++index;
  if (index == decodes.size()) {
    Decode decode;
    decode.weight = d->b;
    decode.scales = d->scales;
    device::DecodeSpec &spec = decode.spec;
    spec.quant = d->quant;
    spec.type = uint32_t(shape.activations);
    spec.experts = int64_t(w.dims[0]);
    spec.rows = int64_t(w.dims[1]);
    spec.cols = int64_t(w.dims[2]);
    spec.expertBytes = d->expertStride;
    spec.scaleStride = d->scaleStride;
    spec.scaleLd = d->scaleLd;
    spec.groupShift = d->groupShift;
    spec.zeroPoints = d->zeroPoints != 0;
    decode.out.resize(program->epRanks);
    decodes.push_back(std::move(decode));
  }
  // The tiles read the decoded values as a dense weight of the same
  // stored form: [rows, cols] an expert, cols a row (ldb).
  d->b = uint32_t(program->slots.size() + index);
  d->quant = 0;
  d->expertStride = int64_t(w.dims[1] * w.dims[2]);
}

namespace {

/// The name a kept weight goes by in the store: its role (w1, w2), the
/// same in the forward and the backward binary.
std::string keptName(const format::TaskProgram &program, const rt::LayerPlan &plan, uint32_t slot) {
  return slot == plan.w1   ? "w1"
         : slot == plan.w2 ? "w2"
                           : std::string(program.name(program.slots[slot].name));
}

bool sameSpec(const device::DecodeSpec &a, const device::DecodeSpec &b) {
  return std::tie(a.quant, a.type, a.experts, a.rows, a.cols, a.expertBytes, a.scaleStride,
                  a.scaleLd, a.groupShift, a.zeroPoints) ==
         std::tie(b.quant, b.type, b.experts, b.rows, b.cols, b.expertBytes, b.scaleStride,
                  b.scaleLd, b.groupShift, b.zeroPoints);
}

} // namespace

Pass::Store::~Store() {
  for (Kept &k : kept)
    device::release(k.out.memory);
}

const Pass::Kept *Pass::Store::find(const std::string &name, uint32_t rank,
                                    const device::DecodeSpec &spec) const {
  for (const Kept &k : kept)
    if (k.name == name && k.rank == rank && sameSpec(k.spec, spec))
      return &k;
  return nullptr;
}

Pass::Kept &Pass::Store::at(const std::string &name, uint32_t rank,
                            const device::DecodeSpec &spec) {
  if (const Kept *k = find(name, rank, spec))
    return const_cast<Kept &>(*k);
  Kept k;
  k.name = name;
  k.rank = rank;
  k.spec = spec;
  kept.push_back(k);
  return kept.back();
}

const void *Pass::boundTo(uint32_t r, uint32_t slot) const {
  return staged[r][slot].host ? staged[r][slot].host : data[r][slot];
}

Status Pass::decoded(Decode &d, uint32_t r, void **values) {
  Buffer *out = &d.out[r];
  Kept *kept = nullptr;
  if (store) {
    kept = &store->at(keptName(*program, *layer, d.weight), r, d.spec);
    out = &kept->out;
    if (kept->fresh && kept->codes == boundTo(r, d.weight) &&
        kept->scales == boundTo(r, d.scales)) {
      *values = out->memory;
      return Status::success();
    }
  }
  const std::string what =
      fmt::format("'{}' of rank {}", program->name(program->slots[d.weight].name), r);
  if (!out->memory) {
    const size_t bytes = decodedBytes(d.spec);
    if (Status s = check(device::allocate(bytes, &out->memory), "the decoded values of " + what);
        !s)
      return s;
    out->bytes = bytes;
    if (kept) {
      store->bytes += bytes; // freed with the store
    } else {
      owned.push_back(*out);
      ownedBytes += bytes;
    }
  }
  if (Status s =
          check(device::decodeWeight(d.spec, data[r][d.weight],
                                     static_cast<const float *>(data[r][d.scales]), out->memory),
                "decoding " + what);
      !s)
    return s;
  if (kept) {
    kept->fresh = true;
    kept->codes = boundTo(r, d.weight);
    kept->scales = boundTo(r, d.scales);
  }
  *values = out->memory;
  return Status::success();
}

void Pass::weightChanged(uint32_t slot) {
  if (!store)
    return;
  for (const Decode &d : decodes)
    if (d.weight == slot || d.scales == slot)
      for (Kept &k : store->kept)
        if (k.name == keptName(*program, *layer, d.weight))
          k.fresh = false;
}

size_t Pass::packedWeightBytes() const { return store && !storeShared ? store->bytes : 0; }

struct Pass::Tables {
  device::Program program;
  Buffer records; ///< ops, tasks, waits, signals, queues, entries, slots
  Buffer dataTable, counters;
};

Status describeDevice(std::string *out) {
  if (!device::built())
    return Status::error(device::Error("moec was built without the CUDA toolkit "
                                       "(no /usr/local/cuda/bin/nvcc at build time)"));
  device::Info info;
  if (Status s = check(device::probe(&info)); !s)
    return s;
  *out = fmt::format("{}, {} SMs, compute {}.{}, driver {}.{}, runtime {}.{}", info.name,
                     info.multiprocessors, info.major, info.minor, info.driverVersion / 1000,
                     info.driverVersion % 1000 / 10, info.runtimeVersion / 1000,
                     info.runtimeVersion % 1000 / 10);
  return Status::success();
}

Pass::~Pass() {
  for (Buffer &b : owned)
    device::release(b.memory);
  device::release(scaleCheck.memory);
  for (auto &rank : staged)
    for (Staged &s : rank)
      device::release(s.device.memory);
  for (auto *list : {&ownRouting.order, &ownRouting.position, &ownRouting.weights, &rows, &results})
    for (Buffer &b : *list)
      device::release(b.memory);
  if (device) {
    device::release(device->records.memory);
    device::release(device->dataTable.memory);
    device::release(device->counters.memory);
  }
}

Status Pass::create(const format::TaskProgram &program, const rt::LayerPlan &plan,
                    const backend::PassOptions &options, std::unique_ptr<Pass> *out) {
  const bool decodeFirst = decodeWholeFirst();
  if (!options.fabric || !options.fabric->allLocal())
    return Status::error("the cuda backend runs every rank of the EP group in one process on "
                         "one GPU; it does not run under MPI");
  if (options.trace)
    return Status::error("the cuda backend records no task trace (the cpu backend does)");
  if (plan.shape.tp > 1)
    return Status::error(fmt::format(
        "the cuda backend has no expert tensor parallelism (the binary has {} TP ranks); "
        "run it on the cpu backend",
        plan.shape.tp));
  if (plan.shape.fp8Dispatch)
    return Status::error("the cuda backend has no FP8 dispatch (no quantize or dequantize "
                         "kernels); compile without \"dispatch_dtype\": \"fp8_e4m3\", or run "
                         "on the cpu backend");
  for (const format::OpRecord &op : program.ops)
    if (program.tilings[op.tiling].lowRank())
      return Status::error(fmt::format(
          "op '{}' adds a LoRA adapter's rank-r product inside its base's GMM (compiled for "
          "the '{}' target), which the cuda backend does not run; compile for a cuda target "
          "(h100), which keeps it a GMM of its own, or run on the cpu backend",
          program.name(op.name), program.name(program.target)));
  std::string gpu;
  if (Status s = describeDevice(&gpu); !s)
    return s.withPrefix("the cuda backend: ");
  for (const format::OpRecord &op : program.ops)
    if (format::hasPeerGroups(program.tilings[op.tiling]))
      return Status::error(fmt::format(
          "op '{}' cuts its experts' rows into {} groups by source rank, which the cuda "
          "backend does not run; compile with --peer-groups 1, or run on the cpu backend",
          program.name(op.name), program.tilings[op.tiling].peers));
  std::unique_ptr<Pass> pass(new Pass());
  pass->program = &program;
  pass->layer = &plan;
  pass->options = options;
  if (options.packWeights && decodeFirst)
    pass->store = std::make_shared<Store>();
  const uint32_t R = program.epRanks;
  const size_t S = program.slots.size();
  pass->data.assign(R, std::vector<void *>(S, nullptr));
  pass->staged.resize(R);
  for (auto &rank : pass->staged)
    rank.resize(S);
  pass->isOutput.assign(S, false);
  pass->layoutHost.assign(R, std::vector<std::vector<uint8_t>>(S));
  for (auto *list : {&pass->ownRouting.order, &pass->ownRouting.position, &pass->ownRouting.weights,
                     &pass->rows, &pass->results})
    list->resize(R);

  // The records the kernel reads.
  std::vector<device::Op> ops;
  for (const format::OpRecord &op : program.ops) {
    const format::TilingRecord &t = program.tilings[op.tiling];
    device::Op d;
    d.kind = uint32_t(op.kind);
    d.wgrad = op.kind == OpKind::Gmm && t.depth == 0;
    d.transposeB = (t.flags & format::kTilingTransposeB) != 0;
    d.accumulate = (t.flags & format::kTilingAccumulate) != 0;
    d.shareRows = (t.flags & format::kTilingShareRows) != 0;
    d.experts = t.experts;
    d.peers = t.peers;
    d.rowTiles = t.rowTiles;
    d.colTiles = t.colTiles;
    d.rows = t.rows;
    d.cols = t.cols;
    d.depth = t.depth;
    d.a = t.inputSlots[0];
    d.b = t.inputSlots[1];
    d.c = t.outputSlot;
    if (op.kind == OpKind::Gmm && !d.wgrad)
      d.addend = backend::addendSlot(program, op);
    d.scales = op.kind == OpKind::Gmm ? backend::weightScalesSlot(program, op) : format::kNone;
    d.firstTask = op.firstTask;
    d.scale = (t.flags & format::kTilingScale) ? t.scale : 1.0f;
    d.ldb = t.ldb;
    if (op.kind == OpKind::Gmm) {
      const format::SlotRecord &w = program.slots[d.wgrad ? t.outputSlot : t.inputSlots[1]];
      d.expertStride = int64_t(w.dims[1] * w.dims[2]);
      if (d.scales != format::kNone) {
        describeQuantized(plan.shape, w, &d);
        if (decodeFirst)
          pass->decodeWhole(plan.shape, w, &d);
      }
    }
    d.ldc = t.ldc;
    const bool combine = op.kind == OpKind::Combine;
    d.sizeSlot = combine ? plan.cSize : plan.dSize;
    d.srcOffsetSlot = combine ? plan.cSrcOffset : plan.dSrcOffset;
    d.targetOffsetSlot = combine ? plan.cTargetOffset : plan.dTargetOffset;
    if (format::isPut(op.kind)) {
      const format::SlotRecord &from = program.slots[d.b], &to = program.slots[d.c];
      if (from.dtype != to.dtype)
        return Status::error(fmt::format("op '{}': a put from {} rows to {} rows",
                                         program.name(op.name), dtypeName(from.dtype),
                                         dtypeName(to.dtype)));
    }
    pass->isOutput[t.outputSlot] = true;
    ops.push_back(d);
  }
  std::vector<device::Task> tasks;
  for (const format::TaskRecord &t : program.tasks)
    tasks.push_back({t.op, t.firstWait, t.waitCount, t.firstSignal, t.signalCount});
  std::vector<device::Wait> waits;
  for (const format::WaitRecord &w : program.waits)
    waits.push_back({w.event, w.threshold});
  std::vector<device::Signal> signals;
  for (const format::SignalRecord &s : program.signals)
    signals.push_back({s.event, s.increment, s.peerOffset});
  std::vector<device::Queue> queues;
  for (const format::QueueRecord &q : program.queues)
    queues.push_back({q.firstEntry, q.entryCount});
  std::vector<device::Slot> slots;
  for (const format::SlotRecord &s : program.slots)
    slots.push_back({uint32_t(s.dtype), s.rank >= 2 ? int64_t(s.dims[1]) : 1});
  for (const Decode &d : pass->decodes)
    slots.push_back({d.spec.type, d.spec.cols});
  const size_t tableSlots = slots.size();

  // One upload: each array 16-byte aligned in one buffer.
  std::vector<uint8_t> blob;
  const auto place = [&](const void *from, size_t bytes) {
    const size_t at = (blob.size() + 15) / 16 * 16;
    blob.resize(at + bytes);
    if (bytes)
      std::memcpy(blob.data() + at, from, bytes);
    return at;
  };
  const size_t opsAt = place(ops.data(), bytesOf(ops));
  const size_t tasksAt = place(tasks.data(), bytesOf(tasks));
  const size_t waitsAt = place(waits.data(), bytesOf(waits));
  const size_t signalsAt = place(signals.data(), bytesOf(signals));
  const size_t queuesAt = place(queues.data(), bytesOf(queues));
  const size_t entriesAt = place(program.queueEntries.data(), bytesOf(program.queueEntries));
  const size_t slotsAt = place(slots.data(), bytesOf(slots));
  pass->device = std::make_unique<Tables>();
  Tables &d = *pass->device;
  if (Status s = check(device::allocate(blob.size(), &d.records.memory), "the program's tables");
      !s)
    return s;
  if (Status s = check(device::copy(d.records.memory, blob.data(), blob.size())); !s)
    return s;
  if (Status s =
          check(device::allocate(size_t(R) * tableSlots * sizeof(void *), &d.dataTable.memory));
      !s)
    return s;
  if (Status s = check(device::allocate(
          std::max<size_t>(1, size_t(R) * program.events.size()) * sizeof(uint32_t),
          &d.counters.memory));
      !s)
    return s;
  const auto at = [&](size_t offset) { return static_cast<char *>(d.records.memory) + offset; };
  device::Program &p = d.program;
  p.ranks = R;
  p.localExperts = program.localExperts;
  p.slots = uint32_t(tableSlots);
  p.events = uint32_t(program.events.size());
  p.queues = uint32_t(program.queues.size());
  p.inter = plan.shape.inter;
  p.glist = plan.glist;
  p.ops = reinterpret_cast<const device::Op *>(at(opsAt));
  p.tasks = reinterpret_cast<const device::Task *>(at(tasksAt));
  p.waits = reinterpret_cast<const device::Wait *>(at(waitsAt));
  p.signals = reinterpret_cast<const device::Signal *>(at(signalsAt));
  p.queues_ = reinterpret_cast<const device::Queue *>(at(queuesAt));
  p.entries = reinterpret_cast<const uint32_t *>(at(entriesAt));
  p.slotInfo = reinterpret_cast<const device::Slot *>(at(slotsAt));
  p.data = static_cast<void *const *>(d.dataTable.memory);
  p.counters = static_cast<uint32_t *>(d.counters.memory);
  *out = std::move(pass);
  return Status::success();
}

uint64_t Pass::workspaceNeeded() const {
  uint64_t bytes =
      allocated ? 0 : backend::workspaceBytes(*program, *layer, program->epRanks, slotSize);
  // The decoded weights, allocated at the first run: the pass's own, or the
  // store's where it has none of the weight yet (before a backward pass's
  // first run, an upper bound: it will read what its forward pass keeps).
  for (const Decode &d : decodes)
    for (uint32_t r = 0; r < d.out.size(); ++r) {
      const Kept *kept =
          store ? store->find(keptName(*program, *layer, d.weight), r, d.spec) : nullptr;
      bytes += d.out[r].memory || (kept && kept->out.memory) ? 0 : decodedBytes(d.spec);
    }
  return bytes;
}

Status Pass::grow(Buffer *buffer, size_t bytes) {
  if (buffer->bytes >= bytes && buffer->memory)
    return Status::success();
  device::release(buffer->memory);
  *buffer = Buffer();
  if (Status s = check(device::allocate(bytes, &buffer->memory)); !s)
    return s;
  buffer->bytes = bytes;
  return Status::success();
}

Status Pass::allocate() {
  if (allocated)
    return Status::success();
  const std::vector<uint32_t> caller = layer->boundSlots();
  for (uint32_t slot = 0; slot < program->slots.size(); ++slot) {
    if (std::find(caller.begin(), caller.end(), slot) != caller.end())
      continue;
    const size_t bytes = slotSize(program->slots[slot]);
    for (uint32_t r = 0; r < program->epRanks; ++r) {
      Buffer b;
      if (Status s = check(device::allocate(bytes, &b.memory),
                           fmt::format("slot '{}' of rank {}",
                                       program->name(program->slots[slot].name), r));
          !s)
        return s;
      b.bytes = bytes;
      owned.push_back(b);
      data[r][slot] = b.memory;
      ownedBytes += bytes;
    }
  }
  allocated = true;
  return Status::success();
}

void Pass::bindSlot(uint32_t rank, uint32_t slot, void *memory) {
  Staged &s = staged[rank][slot];
  if (memory == nullptr || device::isDevice(memory)) {
    s.host = nullptr;
    data[rank][slot] = memory;
    return;
  }
  // A host tensor: staged through device memory (allocated in runTasks,
  // where an error can be returned).
  s.host = memory;
  s.bytes = slotSize(program->slots[slot]);
  s.output = isOutput[slot];
  data[rank][slot] = nullptr;
}

Status Pass::findBadScales(std::vector<backend::ScaleCheck> &checks) const {
  // Host tensors (staged) are read where they are; the others in one go.
  std::vector<backend::ScaleCheck *> onDevice;
  std::vector<device::ScaleSpan> spans;
  for (backend::ScaleCheck &c : checks) {
    c.index = -1;
    if (c.count > 0 && device::isDevice(c.scales)) {
      spans.push_back({c.scales, c.count, c.pairs});
      onDevice.push_back(&c);
    } else {
      backend::findBadScaleOnHost(c);
    }
  }
  if (spans.empty())
    return Status::success();
  if (Status s = grow(&scaleCheck, spans.size() * sizeof(uint64_t)); !s)
    return s;
  std::vector<int64_t> index(spans.size());
  std::vector<float> value(spans.size());
  if (Status s = check(device::findBadScales(spans.data(), int(spans.size()), scaleCheck.memory,
                                             index.data(), value.data()));
      !s)
    return s;
  for (size_t i = 0; i < spans.size(); ++i) {
    onDevice[i]->index = index[i];
    onDevice[i]->value = value[i];
  }
  return Status::success();
}

Status Pass::onDevice(const void *memory, size_t bytes, Buffer *staging, const void **out) {
  if (device::isDevice(memory)) {
    *out = memory;
    return Status::success();
  }
  if (Status s = grow(staging, bytes); !s)
    return s;
  if (Status s = check(device::copy(staging->memory, memory, bytes)); !s)
    return s;
  *out = staging->memory;
  return Status::success();
}

Status Pass::writeOut(void *out, size_t bytes, Buffer *staging,
                      const std::function<device::Error(void *)> &write) {
  if (device::isDevice(out))
    return check(write(out));
  if (Status s = grow(staging, bytes); !s)
    return s;
  if (Status s = check(write(staging->memory)); !s)
    return s;
  return check(device::copy(out, staging->memory, bytes));
}

namespace {

/// MOEC_CUDA_PROFILE=1: the passes print where their time went.
bool profiling() {
  const char *profile = envValue("MOEC_CUDA_PROFILE");
  return profile && *profile == '1';
}

double msSince(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

} // namespace

void Pass::borrowFrom(const backend::Pass &forward) {
  // A backward pass runs on the routing of its forward pass's last
  // fillLayout (the runtime routes only in forward passes), and reads the
  // weights its forward pass keeps decoded (the packed-weight store).
  if (forward.kind() != backend::Kind::Cuda)
    return;
  const Pass &from = static_cast<const Pass &>(forward);
  routing = &from.ownRouting;
  if (from.store && !decodes.empty() && store != from.store) {
    store = from.store;
    storeShared = true;
  }
}

Status Pass::fillLayout(const std::vector<backend::RankRoute> &routes) {
  const rt::LayerPlan &plan = *layer;
  const Clock::time_point began = Clock::now();
  double filled = 0;
  size_t uploaded = 0;
  for (uint32_t slot : plan.layoutSlots())
    for (uint32_t r = 0; r < program->epRanks; ++r)
      layoutHost[r][slot].assign(slotSize(program->slots[slot]), 0);
  backend::fillLayoutTensors(*program, plan, routes, 0, program->epRanks,
                             [&](uint32_t rank, uint32_t slot) -> void * {
                               return layoutHost[rank][slot].data();
                             });
  filled = msSince(began);
  for (uint32_t r = 0; r < program->epRanks; ++r) {
    for (uint32_t slot = 0; slot < program->slots.size(); ++slot) {
      if (layoutHost[r][slot].empty())
        continue;
      uploaded += layoutHost[r][slot].size();
      if (Status s = check(
              device::upload(data[r][slot], layoutHost[r][slot].data(), layoutHost[r][slot].size()),
              "the layout tensors");
          !s)
        return s;
    }
    if (routing != &ownRouting)
      continue; // the forward pass's, of the same routing
    const rt::RoutingLayout &layout = routes[r].layout;
    const size_t ids = layout.order.size() * sizeof(int64_t);
    const size_t topk = routes[r].weights.size() * sizeof(float);
    Routing &own = ownRouting;
    for (const auto &[buffer, bytes] :
         {std::pair{&own.order[r], ids}, {&own.position[r], ids}, {&own.weights[r], topk}})
      if (Status s = grow(buffer, bytes); !s)
        return s;
    for (const auto &[buffer, from, bytes] :
         {std::tuple<Buffer *, const void *, size_t>{&own.order[r], layout.order.data(), ids},
          {&own.position[r], layout.position.data(), ids},
          {&own.weights[r], routes[r].weights.data(), topk}})
      if (Status s = check(device::upload(buffer->memory, from, bytes)); !s)
        return s;
    uploaded += 2 * ids + topk;
  }
  if (profiling())
    std::fprintf(stderr,
                 "moec cuda: %s pass: routing layout filled on the host in %.3f ms, %.1f MB "
                 "of it uploaded in %.3f ms\n",
                 program->isBackward() ? "backward" : "forward", filled, uploaded / 1e6,
                 msSince(began) - filled);
  return Status::success();
}

Status Pass::gatherSendRows(const std::vector<backend::RankRoute> &routes,
                            const std::vector<const void *> &source, bool weighted) {
  const rt::LayerPlan &plan = *layer;
  const DType act = plan.shape.activations;
  const int64_t H = plan.shape.hidden;
  const format::SlotRecord &src = program->slots[plan.src];
  for (uint32_t r = 0; r < program->epRanks; ++r) {
    const backend::RankRoute &route = routes[r];
    const void *from = nullptr;
    if (Status s = onDevice(source[r], size_t(route.tokens * H) * dtypeSize(act), &rows[r], &from);
        !s)
      return s;
    if (Status s = check(device::gatherRows(
            from, uint32_t(act), static_cast<const int64_t *>(routing->order[r].memory), route.topK,
            weighted ? static_cast<const float *>(routing->weights[r].memory) : nullptr,
            data[r][plan.src], uint32_t(src.dtype), int64_t(src.dims[1]), route.tokens * route.topK,
            H));
        !s)
      return s;
  }
  return Status::success();
}

Status Pass::runTasks() {
  const Clock::time_point t0 = Clock::now();
  tasksStart = t0;
  const uint32_t R = program->epRanks;
  const size_t S = program->slots.size();
  // Host tensors in; the data table up.
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t slot = 0; slot < S; ++slot) {
      Staged &s = staged[r][slot];
      if (!s.host)
        continue;
      if (Status st = grow(&s.device, s.bytes); !st)
        return st;
      if (Status st = check(device::copy(s.device.memory, s.host, s.bytes),
                            fmt::format("staging slot '{}' of rank {}",
                                        program->name(program->slots[slot].name), r));
          !st)
        return st;
      data[r][slot] = s.device.memory;
    }
  std::vector<void *> table;
  for (uint32_t r = 0; r < R; ++r) {
    for (uint32_t slot = 0; slot < S; ++slot) {
      if (!data[r][slot])
        return Status::error(fmt::format("rank {}: slot '{}' has no memory (not bound)", r,
                                         program->name(program->slots[slot].name)));
      table.push_back(data[r][slot]);
    }
    for (Decode &d : decodes) {
      void *values = nullptr;
      if (Status s = decoded(d, r, &values); !s)
        return s;
      table.push_back(values);
    }
  }
  if (Status s = check(device::upload(device->dataTable.memory, table.data(), bytesOf(table))); !s)
    return s;

  device::RunResult result;
  if (Status s = check(device::run(device->program, options.timeoutSeconds, &result)); !s)
    return s;
  if (profiling()) {
    // Where the blocks' time went: each op's tasks, and finding no ready queue.
    std::string text = fmt::format("moec cuda: {} pass: kernel {:.3f} ms on {} blocks; "
                                   "block-ms per op:",
                                   program->isBackward() ? "backward" : "forward",
                                   result.seconds * 1e3, result.blocks);
    for (size_t op = 0; op < program->ops.size() && op < result.opSeconds.size(); ++op)
      text += fmt::format(" {} {:.1f}", program->name(program->ops[op].name),
                          result.opSeconds[op] * 1e3);
    std::fprintf(stderr, "%s; idle %.1f\n", text.c_str(), result.idleSeconds * 1e3);
  }
  if (result.watchdog) {
    std::string where;
    for (const device::Stuck &at : result.stuck) {
      const format::QueueRecord &queue = program->queues[at.queue];
      const format::TaskRecord &task = program->tasks[at.task];
      where += fmt::format("{}rank {}, {} core {}, task {} (op '{}') waits for event {} '{}' "
                           "(value {}, needs {})",
                           where.empty() ? "" : "; ", at.rank,
                           format::coreKindName(queue.coreKind), queue.coreIndex, at.task,
                           program->name(program->ops[task.op].name), at.event,
                           program->name(program->events[at.event].name), at.value,
                           at.threshold);
    }
    return Status::error(fmt::format(
        "watchdog: no task completed for {} s on the GPU ({} of {} task runs completed): {}",
        options.timeoutSeconds, result.tasksRun, uint64_t(program->tasks.size()) * R,
        where.empty() ? "no queue's head waits (a task never ended)" : where));
  }
  // Outputs the program wrote into host tensors go back.
  for (uint32_t r = 0; r < R; ++r)
    for (uint32_t slot = 0; slot < S; ++slot) {
      const Staged &s = staged[r][slot];
      if (s.host && s.output)
        if (Status st = check(device::copy(const_cast<void *>(s.host), s.device.memory, s.bytes));
            !st)
          return st;
    }
  taskTime = std::chrono::duration<double>(Clock::now() - t0).count();
  return Status::success();
}

Status Pass::combine(const std::vector<backend::RankRoute> &routes, const std::vector<void *> &out,
                     bool weighted) {
  const rt::LayerPlan &plan = *layer;
  const DType act = plan.shape.activations;
  const int64_t H = plan.shape.hidden;
  const format::SlotRecord &returned = program->slots[plan.returned];
  for (uint32_t r = 0; r < program->epRanks; ++r) {
    const backend::RankRoute &route = routes[r];
    if (Status s = writeOut(
            out[r], size_t(route.tokens * H) * dtypeSize(act), &results[r],
            [&](void *to) {
              return device::combineRows(
                  data[r][plan.returned], uint32_t(returned.dtype), int64_t(returned.dims[1]),
                  static_cast<const int64_t *>(routing->position[r].memory),
                  weighted ? static_cast<const float *>(routing->weights[r].memory) : nullptr,
                  route.topK, to, uint32_t(act), route.tokens, H);
            });
        !s)
      return s;
  }
  return Status::success();
}

Status Pass::topkWeightGrad(const backend::Pass &forward,
                            const std::vector<backend::RankRoute> &routes,
                            const std::vector<const void *> &dy, const std::vector<float *> &out) {
  if (forward.kind() != backend::Kind::Cuda)
    return Status::error("the top-k weight gradient needs the forward pass on the GPU too");
  const rt::LayerPlan &saved = forward.plan();
  const DType act = layer->shape.activations;
  const int64_t H = layer->shape.hidden;
  const format::SlotRecord &returned = forward.tasks().slots[saved.returned];
  for (uint32_t r = 0; r < program->epRanks; ++r) {
    const backend::RankRoute &route = routes[r];
    const void *grad = nullptr;
    // dy was staged by gatherSendRows when it is host memory.
    if (Status s = onDevice(dy[r], size_t(route.tokens * H) * dtypeSize(act), &rows[r], &grad);
        !s)
      return s;
    if (Status s = writeOut(out[r], size_t(route.tokens * route.topK) * sizeof(float), &results[r],
                            [&](void *to) {
                              return device::combineWeightGrad(
                                  grad, uint32_t(act), forward.slot(r, saved.returned),
                                  uint32_t(returned.dtype), int64_t(returned.dims[1]),
                                  static_cast<const int64_t *>(routing->position[r].memory),
                                  route.topK, route.tokens, H, static_cast<float *>(to));
                            });
        !s)
      return s;
  }
  return Status::success();
}

} // namespace moec::cuda
