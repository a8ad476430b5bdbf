//===- CApi.cpp - The runtime's C API over the C++ one ---------------------===//
//
// The moec_* functions of moec_runtime.h: handles that own a Program or a
// Context, errors as moec_status_t (base/moec_status.h), and no exception
// crossing into C.
//
//===----------------------------------------------------------------------===//

#include "runtime/api/CApi.h"
#include "runtime/api/Group.h"
#include "runtime/api/Runtime.h"

#include "base/CStatus.h"
#include "base/Time.h"
#include "format/TaskBinary.h"
#include "runtime/backend/Registry.h"

#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <memory>
#include <string>

static_assert(int(MOEC_F32) == int(moec::DType::F32) && int(MOEC_BF16) == int(moec::DType::BF16) &&
                  int(MOEC_I32) == int(moec::DType::I32) && int(MOEC_I64) == int(moec::DType::I64),
              "moec_dtype mirrors moec::DType");


struct moec_program {
  std::shared_ptr<const moec::rt::Program> program;
};

struct moec_context {
  std::unique_ptr<moec::rt::Context> context;
};

namespace moec::rt::detail {

Status cTimeout(double seconds, const char *who, double *out) {
  if (Status s = checkTimeout(seconds, fmt::format("{}: timeout_seconds", who)); !s)
    return s;
  *out = timeoutOrDefault(seconds);
  return Status::success();
}

moec_status_t createCContext(const moec_program *forward, const moec_program *backward,
                             const ContextOptions &options, const char *who, moec_context **out) {
  if (!forward || !out)
    return toCStatus(Status::error(fmt::format("{}: null argument", who)));
  return guardedC([&] {
    auto context = std::make_unique<moec_context>();
    if (Status s = Context::create(forward->program, backward ? backward->program : nullptr,
                                   options, &context->context);
        !s)
      return s;
    *out = context.release();
    return Status::success();
  });
}

} // namespace moec::rt::detail

extern "C" {

const char *moec_runtime_version(uint32_t *binary_format) {
  if (binary_format)
    *binary_format = moec::format::kFormatVersion;
  return MOEC_VERSION_STRING;
}

moec_status_t moec_program_load(const char *path, moec_program **out) {
  if (!path || !out)
    return moec::toCStatus(moec::Status::error("moec_program_load: null argument"));
  return moec::guardedC([&] {
    auto program = std::make_unique<moec_program>();
    if (moec::Status s = moec::rt::Program::load(path, &program->program); !s)
      return s;
    *out = program.release();
    return moec::Status::success();
  });
}

void moec_program_free(moec_program *program) { delete program; }

moec_status_t moec_context_create(const moec_program *forward, const moec_program *backward,
                                  uint32_t workers, double timeout_seconds, moec_context **out) {
  return moec_context_create_on(forward, backward, workers, timeout_seconds, "cpu", out);
}

moec_status_t moec_context_create_on(const moec_program *forward, const moec_program *backward,
                                     uint32_t workers, double timeout_seconds, const char *backend,
                                     moec_context **out) {
  if (!backend)
    return moec::toCStatus(moec::Status::error("moec_context_create: null argument"));
  moec::rt::ContextOptions options;
  options.workers = workers;
  if (moec::Status s = moec::rt::detail::cTimeout(timeout_seconds, "moec_context_create",
                                                  &options.timeoutSeconds);
      !s)
    return moec::toCStatus(s);
  const moec::backend::BackendInfo *named = moec::backend::findBackend(std::string_view(backend));
  if (!named)
    return moec::toCStatus(moec::Status::error(
        fmt::format("moec_context_create: no backend is named '{}'; expected {}", backend,
                    moec::backend::backendNames())));
  options.backend = named->kind;
  return moec::rt::detail::createCContext(forward, backward, options, "moec_context_create", out);
}

void moec_context_free(moec_context *context) { delete context; }

moec_status_t moec_capacity_need(const moec_context *context, int64_t need[4]) {
  if (!context || !need)
    return moec::toCStatus(moec::Status::error("moec_capacity_need: null argument"));
  const moec::rt::CapacityNeed &n = context->context->capacityNeed();
  need[0] = n.rowsPerRank;
  need[1] = n.receivePerRank;
  need[2] = n.rowsPerExpert;
  need[3] = n.putRows;
  return MOEC_OK;
}

uint32_t moec_context_ranks(const moec_context *context) {
  return context ? context->context->ranks() : 0;
}

uint32_t moec_context_first_rank(const moec_context *context) {
  return context ? context->context->firstLocalRank() : 0;
}

uint32_t moec_context_local_ranks(const moec_context *context) {
  return context ? context->context->localRanks() : 0;
}

moec_status_t moec_set_routing(moec_context *context, uint32_t rank, const moec_tensor *topk_ids,
                               const moec_tensor *topk_weights) {
  if (!context || !topk_ids || !topk_weights)
    return moec::toCStatus(moec::Status::error("moec_set_routing: null argument"));
  return moec::guardedC(
      [&] { return context->context->setRouting(rank, *topk_ids, *topk_weights); });
}

moec_status_t moec_bind(moec_context *context, uint32_t rank, const char *name,
                        const moec_tensor *tensor) {
  if (!context || !name || !tensor)
    return moec::toCStatus(moec::Status::error("moec_bind: null argument"));
  return moec::guardedC([&] { return context->context->bind(rank, name, *tensor); });
}

#define MOEC_CONTEXT_CALL(fn, method)                                                              \
  moec_status_t fn(moec_context *context) {                                                        \
    if (!context)                                                                                  \
      return moec::toCStatus(moec::Status::error(#fn ": null context"));                           \
    return moec::guardedC([&] { return context->context->method(); });                             \
  }

MOEC_CONTEXT_CALL(moec_forward, forward)
MOEC_CONTEXT_CALL(moec_backward, backward)
MOEC_CONTEXT_CALL(moec_submit_forward, submitForward)
MOEC_CONTEXT_CALL(moec_submit_backward, submitBackward)
MOEC_CONTEXT_CALL(moec_wait, wait)

#undef MOEC_CONTEXT_CALL

} // extern "C"
