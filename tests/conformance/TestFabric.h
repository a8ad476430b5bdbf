//===- TestFabric.h - The fabric the conformance suite runs on --*- C++ -*-===//
//
// RuntimeConformanceTest.cpp runs unchanged on every fabric. It gets its
// fabric through this one call, which has two implementations, chosen when
// the test is linked:
//
//   TestFabricInProcess.cpp  every rank in this process (runtime_test, and
//                            runtime_tsan_test, which links no MPI);
//   TestFabricMpi.cpp        one rank per process: the MPI fabric of the
//                            job the test binary was started in by mpirun
//                            (runtime_mpi_test runs it under mpirun -np 2,
//                            3 and 4). A case for another number of ranks
//                            than the job's is skipped.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_TESTS_CONFORMANCE_TESTFABRIC_H
#define MOEC_TESTS_CONFORMANCE_TESTFABRIC_H

#include "runtime/api/Runtime.h"
#include "runtime/comm/Fabric.h"

#include <memory>

namespace moec::test {

/// Returns the fabric for a case of `ranks` ranks (null: the in-process
/// default), and sets *runs to whether this fabric runs such a case.
std::shared_ptr<comm::Fabric> testFabric(uint32_t ranks, bool *runs);

/// "in-process" or "mpi".
const char *testFabricName();

/// Creates a context through the C API on this fabric: moec_context_create
/// in-process, moec_context_create_mpi (runtime/api/RuntimeMpi.h) under MPI.
moec_status_t testCContext(const moec_program *forward, const moec_program *backward,
                           uint32_t workers, double timeoutSeconds, moec_context **out);

} // namespace moec::test

#endif // MOEC_TESTS_CONFORMANCE_TESTFABRIC_H
