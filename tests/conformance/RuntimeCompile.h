//===- RuntimeCompile.h - Fresh layer binaries for the runtime tests -*- C++ -*-===//
//
// RuntimeTest.cpp compiles the binaries it runs on the fly, as `moec compile`
// does. It gets them through this one call, which has two implementations,
// chosen when the test is linked:
//
//   RuntimeCompileDriver.cpp  in process, through compiler/driver (the
//                             runtime_test target);
//   RuntimeCompileCli.cpp     by running the moec binary named by the
//                             environment variable MOEC, so that the test
//                             links no MLIR and can be built with
//                             ThreadSanitizer outside Bazel
//                             (runtime_tsan_test).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TESTS_CONFORMANCE_RUNTIMECOMPILE_H
#define MOEC_TESTS_CONFORMANCE_RUNTIMECOMPILE_H

#include "base/Status.h"
#include "format/TaskBinary.h"

#include <string>

namespace moec::test {

/// Compiles the graph at `graphPath` for the config at `configPath` for the
/// cpu target with event granularity `granularity` ("per-tile-range" or
/// "per-expert"), as `moec compile` does, into *out.
Status compileLayer(const std::string &graphPath, const std::string &configPath,
                    const std::string &granularity, format::TaskProgram *out);

} // namespace moec::test

#endif // MOEC_TESTS_CONFORMANCE_RUNTIMECOMPILE_H
