//===- RunOptions.cpp - moec run's options, checked -----------------------===//
//
// See RunOptions.h.
//
//===----------------------------------------------------------------------===//

#include "tools/moec/RunOptions.h"

#include "base/Time.h"
#include "runtime/backend/Registry.h"
#include "runtime/comm/Mpi.h"
#include "runtime/tooling/LayerRun.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

namespace moec::cli {

using tooling::isRunFileName;
using tooling::kRunManifest;
using tooling::layerInputFiles;

const CommandSpec kRunSpec = {
    "run",
    "moec run FWD.moebin [BWD.moebin] [--ranks R] (--inputs DIR | --random SEED) --outputs DIR "
    "[--hand-made] [--verify] [--verify-sample N] [--fabric inproc|mpi] [--backend cpu|cuda] "
    "[--op-by-op] [--local-puts] [--pack-weights | --pack-forward-weights] [--timeout SECONDS] "
    "[--trace FILE] [--profile] "
    "[--workspace] [--threads N] [--repeat N] [--warmup N] [--hot-share F] [--progress | "
    "--no-progress]",
    "Runs the MoE-FFN layer of a forward task binary, and of a backward one when\n"
    "given, on the R ranks of its EP group with the CPU runtime (or, with\n"
    "--backend cuda, on one NVIDIA GPU): every rank's\n"
    "queues run on a pool of worker threads, events between tiles let the puts of\n"
    "one tile overlap the matmuls of another. Prints the schedule and the time of\n"
    "each pass.\n"
    "\n"
    "The ranks are threads of this process (the in-process fabric), or, started\n"
    "by mpirun, one process per rank (the MPI fabric: shared memory between\n"
    "ranks of a host, two-sided messages between hosts, on OpenMPI's defaults):\n"
    "each process runs its rank on its slice of the inputs, which must be the\n"
    "same on every host (refused otherwise), and the\n"
    "process of rank 0 collects the outputs, writes them and verifies them. The\n"
    "outputs are the same, bit for bit, as with the in-process fabric:\n"
    "\n"
    "  mpirun -np 2 moec run fwd.moebin bwd.moebin --inputs DIR --outputs OUT --verify\n"
    "\n"
    "As root, mpirun needs --allow-run-as-root; with more ranks than cores, also\n"
    "--oversubscribe (and --threads 1 keeps the processes from crowding each\n"
    "other). An error on any rank ends the whole job (MPI_Abort) with that\n"
    "rank's message; a rank that stops answering is named by the others'\n"
    "watchdog (60 s).\n"
    "\n"
    "inputs (.npy, float32 even for bf16 binaries; converted at the edges):\n"
    "  x [R,S,H]  topk_ids [R,S,K] (int32 or int64)  topk_weights [R,S,K]\n"
    "  w1 [E,H,2I]  w2 [E,I,H]  and dy [R,S,H] with a backward binary\n"
    "  (a binary of the *_transposed graphs, whose weights are stored [E,2I,H] and\n"
    "  [E,H,I], takes the same files and transposes them when it binds); a binary\n"
    "  with LoRA adapters (the *_lora* graphs) also lora_a1 [E,H,r], lora_b1\n"
    "  [E,r,2I] on w1 and lora_a2 [E,I,r], lora_b2 [E,r,H] on w2\n"
    "outputs (.npy, float32): y [R,S,H]; with a backward binary also dx [R,S,H],\n"
    "  dtopk_weights [R,S,K], dw1 [E,H,2I], dw2 [E,I,H] (none for a frozen layer's\n"
    "  backward binary; with adapters their gradients dlora_a1 .. dlora_b2)\n"
    "\n"
    "options:\n"
    "  --ranks R        all ranks, which must be the binary's (its config's\n"
    "                   ep x tp): the default; under mpirun, the number of processes\n"
    "  --fabric F       inproc (ranks as threads) or mpi (ranks as processes);\n"
    "                   default: mpi when started by mpirun, else inproc\n"
    "  --inputs DIR     read the inputs from DIR, a folder a run wrote: its\n"
    "                   manifest.json must list every file with its size and\n"
    "                   CRC-32 (a folder without one is refused)\n"
    "  --hand-made      with --inputs: the folder was made by hand or another tool\n"
    "                   (no manifest, or files changed since): read as it is\n"
    "  --random SEED    make random inputs (S and K as compiled, uniform routing\n"
    "                   unless --hot-share) and write them to the outputs folder\n"
    "                   too, so that the run can be replayed with --inputs\n"
    "  --outputs DIR    where the outputs go (created if missing): the run writes a\n"
    "                   new folder beside DIR and swaps it in when every file and\n"
    "                   manifest.json (the files with sizes and CRC-32s) is\n"
    "                   written, so DIR holds one run's files, never a mix; DIR\n"
    "                   may hold a run's files only\n"
    "  --verify         run the reference layer (plain loops, in double) on the\n"
    "                   same inputs and print each output's max absolute and\n"
    "                   relative error; exit 1 when one is above tolerance\n"
    "                   (1e-4 for f32, 5e-2 for bf16, relative to the output's scale);\n"
    "                   refused before the run when the reference would not fit in\n"
    "                   memory (then use --verify-sample)\n"
    "  --verify-sample N  verify N random tokens instead of the whole layer: their\n"
    "                   y, dx and dtopk_weights, and for each expert they route to\n"
    "                   one random intermediate unit's weight gradients (a row of\n"
    "                   dw2, the gate and up columns of dw1), computed from every\n"
    "                   row that expert received; memory grows with N, not the\n"
    "                   layer (implies --verify); with LoRA adapters also those\n"
    "                   units' columns of dlora_b1 and rows of dlora_a2 (not\n"
    "                   dlora_a1, dlora_b2: they need each row's every unit)\n"
    "  --backend B      cpu (worker threads; the default) or cuda: every rank on\n"
    "                   one NVIDIA GPU, the task program as one persistent kernel\n"
    "                   (thread blocks run the queues, events are counters in\n"
    "                   device memory); inputs and outputs stay .npy files on the\n"
    "                   host. Not under MPI, and no --trace, --profile or\n"
    "                   --op-by-op\n"
    "  --pack-weights   keep the weights packed in the GEMM tile's layout, each\n"
    "                   packed by the first tile that reads it (the torch op's\n"
    "                   pack_weights=True); without it every tile packs\n"
    "                   the part it reads. The same bits either way. On cuda:\n"
    "                   quantized weights kept decoded from pass to pass, not\n"
    "                   decoded again each pass\n"
    "  --pack-forward-weights\n"
    "                   --pack-weights for the forward pass only: the backward\n"
    "                   reads the weights as stored (pack_weights=\"forward\";\n"
    "                   on AMX tiles about half the packed bytes)\n"
    "  --op-by-op       run the same tasks one op at a time, with a barrier over\n"
    "                   all ranks between ops (the baseline fusion is measured\n"
    "                   against)\n"
    "  --local-puts     under MPI, a measurement mode: puts copy their rows into\n"
    "                   the sender's own memory instead of the peer's (signals\n"
    "                   still cross); the pass time against a normal run is the\n"
    "                   exposed communication. The outputs are wrong, so no\n"
    "                   --verify and no output files\n"
    "  --timeout S      the watchdog: a pass (or, under MPI, a wait for another\n"
    "                   rank) that makes no progress for S seconds stops with an\n"
    "                   error naming what it waited for (0.001 to 1000000, default\n"
    "                   60); under MPI rank 0 then prints the report of every rank\n"
    "  --trace FILE     write a Chrome/Perfetto trace of the last timed forward pass\n"
    "                   to FILE (and of the backward pass to FILE with '.bwd' before\n"
    "                   its extension): tasks with their tiles and time off their\n"
    "                   cores, waits naming their event, signal arrows, and the\n"
    "                   prepare/tasks/finish phases;\n"
    "                   under MPI rank 0 writes one trace of every rank, with\n"
    "                   arrows across processes and hosts\n"
    "  --profile        print where the last timed passes' time went: per op its\n"
    "                   busy time, FLOPs or bytes, rate per core and share of one\n"
    "                   core's measured peak; per worker its busy and idle time\n"
    "                   and its time off its core in task runs (the OS ran\n"
    "                   something else there); the task runs 3x or more their\n"
    "                   op's median time for their work (stalled), each with its\n"
    "                   time off its core; the waits of parked cores by event\n"
    "                   and signalling rank;\n"
    "                   the prepare, tasks and finish phases (under MPI: rank 0's\n"
    "                   process)\n"
    "  --workspace      print the workspace slot by slot: each pass's tensors at\n"
    "                   their capacity, the pages resident after the run, the\n"
    "                   backward slots kept in dead forward ones, kernel scratch\n"
    "                   (the report always prints the totals)\n"
    "  --threads N      worker threads, 1 to 4096 (default: the hardware threads)\n"
    "  --repeat N       run the passes N times and report the best time (default 1)\n"
    "  --warmup N       run the passes N times more before those, untimed and not\n"
    "                   traced (default 1: a first pass pays for first touches of\n"
    "                   memory and the GEMM libraries' first calls; 0 times it)\n"
    "  --hot-share F    with --random: the share of tokens whose first expert is\n"
    "                   expert 0 (skewed routing); default 0\n"
    "  --progress       print progress (phases, a bar, an ETA) on stderr even when it\n"
    "                   is not a terminal (a line per phase, and every 5 s); on a\n"
    "                   terminal it is on by default\n"
    "  --no-progress    no progress output\n",
    {"--ranks", "--inputs", "--random", "--outputs", "--trace", "--threads", "--repeat", "--warmup",
     "--hot-share", "--fabric", "--timeout", "--verify-sample", "--backend"},
    {"--verify", "--op-by-op", "--local-puts", "--progress", "--no-progress", "--profile",
     "--workspace", "--pack-weights", "--pack-forward-weights", "--hand-made"},
    1,
    2,
    {"--trace"}};

namespace {

bool parseCount(const std::string &text, uint64_t max, uint64_t *out) {
  if (text.empty() || text.size() > 19 ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return false;
  *out = std::stoull(text);
  return *out <= max;
}

} // namespace

int usage(const char *message) {
  std::fprintf(stderr, "moec run: %s\nusage: %s\n(see 'moec run --help')\n", message,
               kRunSpec.usage);
  return kUsage;
}

/// The options that decide what a run computes and how, as text: under MPI
/// every rank must be given the same. Left out: the binaries (the context
/// compares the layers the ranks run), what only one process acts on or
/// that may differ by host (--threads, --timeout, progress, the outputs
/// folder, the inputs folder and seed, which checkSameInputs compares by
/// content, and --trace's path, compared by presence), and --repeat: ranks
/// that run different numbers of passes end in the watchdog's report, which
/// names the rank that stopped early.
std::string runOptionsText(const Args &args) {
  std::string text;
  for (const auto &[flag, value] : args.values)
    if (flag != "--threads" && flag != "--timeout" && flag != "--outputs" && flag != "--inputs" &&
        flag != "--random" && flag != "--repeat")
      text += flag + (flag == "--trace" ? std::string() : " " + value) + " ";
  for (const auto &[flag, on] : args.switches)
    if (on && flag != "--progress" && flag != "--no-progress")
      text += flag + " ";
  if (!text.empty())
    text.pop_back();
  return text.empty() ? "(none)" : text;
}

std::string tracePath(const std::string &path, const char *suffix) {
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + suffix + p.extension().string())).string();
}

/// Checks `args`' options into *o; returns kOk, or the usage error's code
/// after printing it.
int parseRunOptions(const Args &args, RunOptions *o) {
  const std::string fabricName =
      args.value("--fabric").value_or(comm::launchedByMpi() ? "mpi" : "inproc");
  if (fabricName != "inproc" && fabricName != "mpi")
    return usage("--fabric must be inproc or mpi");
  if (fabricName == "inproc" && comm::launcherSize() > 1)
    return usage(fmt::format("--fabric inproc runs every rank in this process, but mpirun started "
                             "{} processes: each would run the whole layer on its own; leave "
                             "--fabric out (mpi is the default under mpirun)",
                             comm::launcherSize())
                     .c_str());
  o->mpi = fabricName == "mpi";
  const bool mpi = o->mpi;
  o->localPuts = args.has("--local-puts");
  const bool localPuts = o->localPuts;
  if (localPuts && !mpi)
    return usage("--local-puts needs the MPI fabric (run under mpirun)");
  uint64_t &sampleTokens = o->sampleTokens;
  if (auto n = args.value("--verify-sample");
      n && (!parseCount(*n, uint64_t(1) << 40, &sampleTokens) || sampleTokens == 0))
    return usage("--verify-sample must be a positive number of tokens");
  o->verify = args.has("--verify") || sampleTokens > 0;
  const bool verify = o->verify;
  if (localPuts && verify)
    return usage("--local-puts makes the outputs wrong; it cannot be verified");
  if (args.has("--progress") && args.has("--no-progress"))
    return usage("--progress and --no-progress exclude each other");
  if (args.has("--pack-weights") && args.has("--pack-forward-weights"))
    return usage("--pack-weights and --pack-forward-weights exclude each other");
  if (args.has("--hand-made") && !args.value("--inputs"))
    return usage("--hand-made says how the --inputs folder was made; it needs --inputs DIR");
  if (!args.value("--outputs"))
    return usage("missing --outputs DIR");
  if (args.value("--inputs").has_value() == args.value("--random").has_value())
    return usage("give exactly one of --inputs DIR and --random SEED");
  uint64_t &ranks = o->ranks, &threads = o->threads, &repeat = o->repeat, &warmup = o->warmup,
           &seed = o->seed;
  if (auto r = args.value("--ranks"); r && (!parseCount(*r, 1u << 16, &ranks) || ranks == 0))
    return usage("--ranks must be a positive integer");
  if (auto t = args.value("--threads"); t && (!parseCount(*t, 4096, &threads) || threads == 0))
    return usage("--threads must be an integer from 1 to 4096");
  if (auto r = args.value("--repeat"); r && (!parseCount(*r, 1000000, &repeat) || repeat == 0))
    return usage("--repeat must be a positive integer");
  if (auto w = args.value("--warmup"); w && !parseCount(*w, 1000000, &warmup))
    return usage("--warmup must be a number of passes, 0 or more");
  if (auto s = args.value("--random");
      s && !parseCount(*s, std::numeric_limits<uint64_t>::max() / 2, &seed))
    return usage("--random SEED must be a non-negative integer");
  double &timeout = o->timeout;
  if (auto t = args.value("--timeout")) {
    char *end = nullptr;
    timeout = std::strtod(t->c_str(), &end);
    // base/Time.h's range, the one every API checks against.
    if (t->empty() || *end != '\0' || !timeoutInRange(timeout))
      return usage(fmt::format("--timeout must be a number of seconds from {} to {}",
                               kTimeoutMinSeconds, kTimeoutMaxSeconds)
                       .c_str());
  }
  backend::Kind &backendKind = o->backend;
  if (auto b = args.value("--backend")) {
    const backend::BackendInfo *named = backend::findBackend(*b);
    if (!named)
      return usage(fmt::format("--backend must be {}", backend::backendNames()).c_str());
    backendKind = named->kind;
    // What the named backend lacks, refused by the option that asks for it.
    using backend::Feature;
    const std::pair<bool, std::pair<Feature, std::string>> asked[] = {
        {mpi,
         {Feature::MultiProcess,
          fmt::format("--backend {} runs every rank in one process; it does not run under MPI",
                      named->name)}},
        {args.has("--op-by-op"), {Feature::OpByOp, "--op-by-op runs"}},
        {args.value("--trace") || args.has("--profile"),
         {Feature::TaskTrace, "--trace and --profile run"}},
        {args.has("--pack-weights") || args.has("--pack-forward-weights"),
         {Feature::PackedWeights,
          args.has("--pack-weights") ? "--pack-weights runs" : "--pack-forward-weights runs"}}};
    for (const auto &[wanted, what] : asked)
      if (wanted && !named->has(what.first))
        return usage((what.first == Feature::MultiProcess
                          ? what.second
                          : fmt::format("{} on the {} backend only", what.second,
                                        backend::backendsWith(what.first)))
                         .c_str());
  }
  double &hotShare = o->hotShare;
  if (auto h = args.value("--hot-share")) {
    if (!args.value("--random"))
      return usage("--hot-share needs --random");
    char *end = nullptr;
    hotShare = std::strtod(h->c_str(), &end);
    if (h->empty() || *end != '\0' || !(hotShare >= 0 && hotShare <= 1))
      return usage("--hot-share must be a number in [0, 1]");
  }

  return kOk;
}

/// The folders and trace paths of `moec run` against each other: no empty
/// folder, no output over an input, no trace among the run's own files.
int checkRunPaths(const Args &args) {
  for (const char *flag : {"--outputs", "--inputs"})
    if (args.value(flag) && args.value(flag)->empty())
      return usage(fmt::format("{} needs a folder; the path given is empty", flag).c_str());
  {
    // The files of the inputs folder are inputs too, and a backward trace
    // goes to a second path.
    std::vector<std::string> inputFiles;
    if (auto dir = args.value("--inputs")) {
      for (const std::string &name : layerInputFiles(true, 3)) // any adapters'
        inputFiles.push_back(*dir + "/" + name);
      inputFiles.push_back(*dir + "/" + kRunManifest);
    }
    std::vector<std::pair<std::string, std::string>> traces;
    if (auto trace = args.value("--trace"); trace && args.positional.size() == 2)
      traces.push_back({"--trace (its backward pass)", tracePath(*trace, ".bwd")});
    if (int code = checkOutputs(kRunSpec, args, inputFiles, traces); code != kOk)
      return code;
    // Nor is a trace one of the files the run writes into its folder.
    if (auto trace = args.value("--trace"); trace && args.value("--outputs")) {
      std::error_code ec;
      const std::filesystem::path folder =
          std::filesystem::weakly_canonical(*args.value("--outputs"), ec);
      traces.push_back({"--trace", *trace});
      for (const auto &[what, path] : traces) {
        const std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
        if (p.parent_path() == folder && isRunFileName(p.filename().string()))
          return usage(fmt::format("{} {}: is a file the run writes into its --outputs folder; "
                                   "give the trace another path",
                                   what, path)
                           .c_str());
      }
    }
  }
  return kOk;
}

} // namespace moec::cli
