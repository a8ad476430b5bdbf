//===- RuntimeCompileDriver.cpp - compileLayer through compiler/driver ----===//

#include "tests/conformance/RuntimeCompile.h"

#include "compiler/driver/Compile.h"

namespace moec::test {

Status compileLayer(const std::string &graphPath, const std::string &configPath,
                    const std::string &granularity, format::TaskProgram *out) {
  driver::CompileOptions options;
  options.configPath = configPath;
  const auto parsed = lower::parseGranularity(granularity);
  if (!parsed)
    return Status::error("no granularity is named '" + granularity + "'");
  options.granularity = *parsed;
  driver::CompileResult result;
  if (Status s = driver::compileGraphFile(graphPath, options, &result); !s)
    return s.withPrefix(graphPath + ": ");
  *out = std::move(result.program);
  return Status::success();
}

} // namespace moec::test
