//===- Registry.h - The backends this build has, and what each lacks -*- C++ -*-===//
//
// Every backend registers itself (MOEC_REGISTER_BACKEND in its folder's
// Backend.cpp, run at static initialization; its Bazel library is
// `alwayslink`): its name, a line that says what it is, the features of
// the runtime it lacks, and the function that makes it. The runtime API
// makes a context's backend through the registry, and every caller that
// must refuse an option on some backend (the C API's and `moec run`'s
// backend names, the exchange, the op-by-op schedule, the conformance
// suite's cases) asks the registry instead of naming the backend.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_BACKEND_REGISTRY_H
#define MOEC_RUNTIME_BACKEND_REGISTRY_H

#include "base/Status.h"
#include "runtime/backend/Backend.h"
#include "runtime/backend/Kind.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moec::backend {

/// What a backend may lack; each is refused by name where it is asked for.
enum class Feature : uint8_t {
  MultiProcess,  ///< ranks in several processes (the MPI fabric, torchrun's)
  OpByOp,        ///< the op-by-op schedule (a barrier between ops)
  TaskTrace,     ///< a trace or profile of every task run
  PackedWeights, ///< the packed-weight store (ContextOptions::packWeights)
  Exchange,      ///< dispatch and combine as operations of their own (rt::Exchange)
  SlotItems,     ///< the workspace itemized slot by slot (Context::workspace)
};

/// What `feature` is, as a refusal names it: "the op-by-op schedule".
const char *featureName(Feature feature);

/// What the runtime gives a backend it makes.
struct BackendOptions {
  uint32_t workers = 1; ///< worker threads a context runs (a CPU's)
};

/// One backend of this build.
struct BackendInfo {
  Kind kind = Kind::Cpu;
  const char *name = ""; ///< "cpu": kindName(kind)
  const char *what = ""; ///< one line: where it runs the task program
  std::vector<Feature> lacks;
  std::function<std::unique_ptr<Backend>(const BackendOptions &)> create;

  bool has(Feature feature) const;
};

/// Adds `info` to the registry; returns true (for a static initializer).
bool registerBackend(BackendInfo info);

/// The registered backends, in Kind order.
std::vector<const BackendInfo *> registeredBackends();
/// The backend of `kind`, or null when this build has none.
const BackendInfo *findBackend(Kind kind);
/// The backend of `kind` into *out; an error naming the backends this build
/// has when it has none of that kind.
Status lookupBackend(Kind kind, const BackendInfo **out);
/// The backend named `name`, or null.
const BackendInfo *findBackend(std::string_view name);
/// "cpu or cuda": the registered backends' names, for a message.
std::string backendNames();
/// The registered backends that have `feature`, for a message: "cpu".
std::string backendsWith(Feature feature);

/// Success when the backend of `kind` has `feature`; else, e.g., "the
/// op-by-op schedule runs on the cpu backend only".
Status requireFeature(Kind kind, Feature feature);

} // namespace moec::backend

/// Registers a backend at static initialization: MOEC_REGISTER_BACKEND(cpu,
/// BackendInfo{...}) in the backend's own folder.
#define MOEC_REGISTER_BACKEND(id, ...)                                                             \
  [[maybe_unused]] static const bool moecBackendRegistered_##id =                                  \
      ::moec::backend::registerBackend(__VA_ARGS__)

#endif // MOEC_RUNTIME_BACKEND_REGISTRY_H
