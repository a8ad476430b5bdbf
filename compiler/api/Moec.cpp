//===- Moec.cpp - The compiler and the dump tool as a C library -----------===//

#include "compiler/api/moec.h"

#include "base/CStatus.h"
#include "base/File.h"
#include "compiler/driver/Compile.h"
#include "compiler/inspect/Dump.h"
#include "format/TaskBinary.h"
#include "runtime/trace/Trace.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <optional>
#include <string>

using namespace moec;

namespace {

/// A malloc'ed copy of `text`, for the caller to moec_free (std::bad_alloc,
/// which guardedC reports, if there is no memory for it).
char *copyOut(const std::string &text) {
  char *out = static_cast<char *>(std::malloc(text.size() + 1));
  if (!out)
    throw std::bad_alloc();
  std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

std::optional<std::string> optionalString(const char *text) {
  return text ? std::optional<std::string>(text) : std::nullopt;
}

/// Loads `binary` and analyzes it with `target` (or its own).
Status analyze(const char *binary, const char *target, bool trace, format::TaskProgram *program,
               inspect::Analysis *analysis) {
  if (!binary)
    return Status::error("no binary given");
  if (Status status = format::loadTaskBinaryFile(binary, program); !status)
    return status;
  return inspect::analyzeBinary(*program, optionalString(target), trace, binary, analysis);
}

} // namespace

extern "C" moec_status_t moec_compile(const char *graph, const char *config, const char *target,
                                      const char *granularity, const char *out, char **summary) {
  if (summary)
    *summary = nullptr;
  return guardedC([&]() -> Status {
    if (!graph || !config || !out)
      return Status::error("moec_compile needs a graph, a config and an output path");
    driver::CompileOptions options;
    options.configPath = config;
    options.target = target ? target : "cpu";
    std::optional<lower::Granularity> g =
        lower::parseGranularity(granularity ? granularity : "per-tile-range");
    if (!g)
      return Status::error(fmt::format(
          "unknown granularity '{}' (expected per-tile-range or per-expert)", granularity));
    options.granularity = *g;
    driver::CompileResult result;
    if (Status status = driver::compileGraphFile(graph, options, &result); !status)
      return status;
    std::vector<uint8_t> bytes = format::writeTaskBinary(result.program);
    // The summary is made before the file, so that a failure leaves neither.
    char *text = summary ? copyOut(fmt::format(
                               "{}: {}, {} ops, {} tasks, {} events, {} bytes; estimated {:.3f} "
                               "ms per pass on {}",
                               out, result.graphName, result.program.ops.size(),
                               result.program.tasks.size(), result.program.events.size(),
                               bytes.size(), result.estimate.makespan * 1e3, result.profile.name))
                         : nullptr;
    if (Status status = writeFileAtomically(out, {{bytes.data(), bytes.size()}}); !status) {
      std::free(text);
      return status;
    }
    if (summary)
      *summary = text;
    return Status::success();
  });
}

extern "C" moec_status_t moec_dump_json(const char *binary, const char *target, int rank,
                                        char **json) {
  if (json)
    *json = nullptr;
  return guardedC([&]() -> Status {
    format::TaskProgram program;
    inspect::Analysis analysis;
    if (Status status = analyze(binary, target, false, &program, &analysis); !status)
      return status;
    inspect::DumpOptions options;
    if (rank >= 0)
      options.rank = uint32_t(rank);
    if (Status status = inspect::checkDumpOptions(program, options); !status)
      return status.withPrefix(fmt::format("{}: ", binary));
    if (json)
      *json = copyOut(inspect::dumpJson(program, inspect::factsOf(program, binary), options, analysis)
                          .dump());
    return Status::success();
  });
}

extern "C" moec_status_t moec_simulate_trace(const char *binary, const char *target,
                                             const char *out) {
  return guardedC([&]() -> Status {
    if (!out)
      return Status::error("moec_simulate_trace needs an output path");
    format::TaskProgram program;
    inspect::Analysis analysis;
    if (Status status = analyze(binary, target, true, &program, &analysis); !status)
      return status;
    if (!analysis.run.ok())
      return analysis.run.status.withPrefix(fmt::format("{}: ", binary));
    return trace::writeChromeTrace(program, analysis.run.trace, out, binary);
  });
}

extern "C" moec_status_t moec_capacity_advice(const char *config, long long rows_per_rank,
                                              long long receive_per_rank, int headroom,
                                              char **advice) {
  if (advice)
    *advice = nullptr;
  return guardedC([&]() -> Status {
    if (!config)
      return Status::error("moec_capacity_advice needs a config");
    if (rows_per_rank < 0 || receive_per_rank < 0)
      return Status::error(fmt::format("moec_capacity_advice: row counts must not be negative, "
                                       "got {} and {}",
                                       rows_per_rank, receive_per_rank));
    ModelConfig parsed;
    std::string message;
    if (!parseConfig(config, "the config", &parsed, &message))
      return Status::error(message);
    const format::CapacityAdvice a =
        format::adviseCapacity(capacityInputs(parsed), rows_per_rank, receive_per_rank, headroom);
    if (advice)
      *advice = copyOut(fmt::format(
          "{{\"seq_size\": {}, \"capacity_factor\": {}, \"row_capacity\": {}, "
          "\"receive_capacity\": {}, \"fits\": {}}}",
          a.seqSize, a.capacityFactor, a.rowCapacity, a.receiveCapacity, a.fits));
    return Status::success();
  });
}

extern "C" moec_status_t moec_config_check(const char *config) {
  return guardedC([&]() -> Status {
    if (!config)
      return Status::error("moec_config_check needs a config");
    ModelConfig parsed;
    std::string message;
    if (!parseConfig(config, "the config", &parsed, &message))
      return Status::error(message);
    return Status::success();
  });
}

extern "C" const char *moec_compiler_version(unsigned *binary_format) {
  if (binary_format)
    *binary_format = moec::format::kFormatVersion;
  return MOEC_VERSION_STRING;
}

void moec_free(char *text) { std::free(text); }
