//===- Workspace.h - The memory a layer's runtime holds, as a table -*- C++ -*-===//
//
// What `moec run` and the torch op's MoeFFN.workspace() print: the
// workspace of each pass slot by slot (allocated at the slot's capacity,
// and resident: the pages the passes have written so far), the slots a
// backward pass keeps in the forward pass's dead ones, and the kernels'
// scratch.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_RUNTIME_TOOLING_WORKSPACE_H
#define MOEC_RUNTIME_TOOLING_WORKSPACE_H

#include "runtime/api/Runtime.h"

#include <string>

namespace moec::tooling {

/// Totals of a context's workspace now.
struct WorkspaceTotals {
  uint64_t allocated = 0; ///< own slots at capacity (Context::workspaceBytes)
  uint64_t resident = 0;  ///< of those, in memory (when itemized)
  uint64_t scratch = 0;   ///< the CPU kernels' scratch
  uint64_t packed = 0;    ///< the packed weights (ContextOptions::packWeights)
  bool itemized = false;  ///< the backend lists its slots (the CPU backend does)
};
WorkspaceTotals workspaceTotals(const rt::Context &context);

/// "12.0 MiB allocated, 8.0 MiB resident; kernel scratch 1.0 MiB", or only
/// the bytes allocated where the backend does not itemize its workspace.
std::string totalsText(const WorkspaceTotals &totals);

/// The table: one line per slot (pass, tensor, MiB allocated, MiB resident,
/// what it is), then the totals.
std::string workspaceText(const rt::Context &context);

} // namespace moec::tooling

#endif // MOEC_RUNTIME_TOOLING_WORKSPACE_H
