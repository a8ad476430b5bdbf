//===- Registry.cpp - The backends this build has --------------------------===//
//
// See Registry.h.
//
//===----------------------------------------------------------------------===//

#include "runtime/backend/Registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <mutex>

namespace moec::backend {

namespace {

struct Registry {
  std::mutex lock;
  std::vector<std::unique_ptr<BackendInfo>> backends; ///< in Kind order
};

Registry &registry() {
  static Registry r; // built on first use: registration runs at static initialization
  return r;
}

/// "a or b", "a, b or c".
std::string orList(const std::vector<std::string> &names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i)
    out += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return out;
}

} // namespace

const char *featureName(Feature feature) {
  switch (feature) {
  case Feature::MultiProcess:
    return "ranks in several processes";
  case Feature::OpByOp:
    return "the op-by-op schedule";
  case Feature::TaskTrace:
    return "a task trace or profile";
  case Feature::PackedWeights:
    return "the packed-weight store";
  case Feature::Exchange:
    return "an exchange";
  case Feature::SlotItems:
    return "the workspace slot by slot";
  }
  return "?";
}

bool BackendInfo::has(Feature feature) const {
  return std::find(lacks.begin(), lacks.end(), feature) == lacks.end();
}

bool registerBackend(BackendInfo info) {
  Registry &r = registry();
  const std::lock_guard<std::mutex> held(r.lock);
  const auto at = std::find_if(r.backends.begin(), r.backends.end(),
                               [&](const auto &b) { return b->kind >= info.kind; });
  if (at != r.backends.end() && (*at)->kind == info.kind)
    return true; // registered once (a library linked twice)
  r.backends.insert(at, std::make_unique<BackendInfo>(std::move(info)));
  return true;
}

std::vector<const BackendInfo *> registeredBackends() {
  Registry &r = registry();
  const std::lock_guard<std::mutex> held(r.lock);
  std::vector<const BackendInfo *> out;
  for (const auto &b : r.backends)
    out.push_back(b.get());
  return out;
}

const BackendInfo *findBackend(Kind kind) {
  for (const BackendInfo *b : registeredBackends())
    if (b->kind == kind)
      return b;
  return nullptr;
}

const BackendInfo *findBackend(std::string_view name) {
  for (const BackendInfo *b : registeredBackends())
    if (name == b->name)
      return b;
  return nullptr;
}

std::string backendNames() {
  std::vector<std::string> names;
  for (const BackendInfo *b : registeredBackends())
    names.push_back(b->name);
  return orList(names);
}

std::string backendsWith(Feature feature) {
  std::vector<std::string> names;
  for (const BackendInfo *b : registeredBackends())
    if (b->has(feature))
      names.push_back(b->name);
  return orList(names);
}

Status lookupBackend(Kind kind, const BackendInfo **out) {
  *out = findBackend(kind);
  if (!*out)
    return Status::error(
        fmt::format("this build has no {} backend (it has {})", kindName(kind), backendNames()));
  return Status::success();
}

Status requireFeature(Kind kind, Feature feature) {
  const BackendInfo *b = nullptr;
  if (Status s = lookupBackend(kind, &b); !s)
    return s;
  if (b->has(feature))
    return Status::success();
  const std::string with = backendsWith(feature);
  return Status::error(
      with.empty() ? fmt::format("{} runs on no backend of this build", featureName(feature))
                   : fmt::format("{} runs on the {} backend only", featureName(feature), with));
}

} // namespace moec::backend
