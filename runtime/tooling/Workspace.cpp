//===- Workspace.cpp - The memory a layer's runtime holds, as a table -----===//

#include "runtime/tooling/Workspace.h"

#include <fmt/format.h>

namespace moec::tooling {

namespace {
double mib(uint64_t bytes) { return double(bytes) / double(1 << 20); }
} // namespace

WorkspaceTotals workspaceTotals(const rt::Context &context) {
  WorkspaceTotals t;
  t.allocated = context.workspaceBytes();
  for (const rt::WorkspaceSlot &w : context.workspace()) {
    t.itemized = true;
    t.resident += w.resident;
  }
  t.scratch = context.scratchBytes();
  t.packed = context.packedWeightBytes();
  return t;
}

std::string totalsText(const WorkspaceTotals &t) {
  if (!t.itemized)
    return fmt::format("{:.1f} MiB allocated", mib(t.allocated));
  std::string text =
      fmt::format("{:.1f} MiB allocated, {:.1f} MiB resident; kernel scratch {:.1f} MiB",
                  mib(t.allocated), mib(t.resident), mib(t.scratch));
  if (t.packed)
    text += fmt::format("; packed weights {:.1f} MiB", mib(t.packed));
  return text;
}

std::string workspaceText(const rt::Context &context) {
  const std::vector<rt::WorkspaceSlot> slots = context.workspace();
  const WorkspaceTotals t = workspaceTotals(context);
  std::string out = fmt::format("workspace of this process ({} rank{}): {}\n",
                                context.localRanks(), context.localRanks() == 1 ? "" : "s",
                                totalsText(t));
  if (slots.empty())
    return out + "  (no pass has run yet, or the backend does not itemize its workspace)\n";
  out += fmt::format("  {:<9} {:<20} {:>10} {:>10}  {}\n", "pass", "tensor", "MiB", "resident",
                     "held as");
  // Per pass: its activation slots, then its routing layout tensors as one
  // line.
  for (const char *pass : {"forward", "backward"}) {
    uint64_t bytes = 0, resident = 0;
    int small = 0;
    for (const rt::WorkspaceSlot &w : slots) {
      if (std::string(w.pass) != pass)
        continue;
      if (w.layout) {
        bytes += w.bytes;
        resident += w.resident;
        ++small;
        continue;
      }
      const std::string as = !w.over.empty() ? "written over " + w.over + " (no memory of its own)"
                             : w.borrowed    ? "in a dead forward slot (no memory of its own)"
                             : w.window      ? "window (peers put into it)"
                                             : "plain";
      const bool own = !w.borrowed && w.over.empty();
      out += fmt::format("  {:<9} {:<20} {:>10} {:>10}  {}\n", w.pass, w.name,
                         w.over.empty() ? fmt::format("{:.1f}", mib(w.bytes)) : std::string("-"),
                         own ? fmt::format("{:.1f}", mib(w.resident)) : std::string("-"), as);
    }
    if (small)
      out += fmt::format("  {:<9} {:<20} {:>10.1f} {:>10.1f}  {} routing layout tensors\n", pass,
                         "(layout)", mib(bytes), mib(resident), small);
  }
  out += "  Slots are allocated at their capacity; only the pages a pass writes are resident.\n";
  return out;
}

} // namespace moec::tooling
