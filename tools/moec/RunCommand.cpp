//===- RunCommand.cpp - moec run --------------------------------------------===//
//
// Runs a forward binary (and a backward one) on R in-process ranks with the
// CPU runtime, on inputs from .npy files or made at random, and writes the
// outputs as .npy; optionally checks them against the reference layer.
//
//===----------------------------------------------------------------------===//

#include "base/File.h"
#include "base/Memory.h"
#include "base/Time.h"
#include "format/Capacity.h"
#include "format/Crc32.h"
#include "format/TaskBinary.h"
#include "runtime/api/Runtime.h"
#include "runtime/backend/Registry.h"
#include "runtime/comm/Mpi.h"
#include "runtime/tooling/LayerRun.h"
#include "runtime/tooling/Profile.h"
#include "runtime/tooling/Workspace.h"
#include "tools/moec/Cli.h"
#include "tools/moec/Commands.h"
#include "tools/moec/Progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>


namespace moec::cli {

using namespace moec::tooling;

const CommandSpec kRunSpec = {
    "run",
    "moec run FWD.moebin [BWD.moebin] [--ranks R] (--inputs DIR | --random SEED) --outputs DIR "
    "[--hand-made] [--verify] [--verify-sample N] [--fabric inproc|mpi] [--backend cpu|cuda] [--op-by-op] [--local-puts] [--pack-weights] [--timeout SECONDS] [--trace FILE] [--profile] [--workspace] [--threads N] [--repeat N] [--warmup N] [--hot-share F] [--progress | --no-progress]",
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
    "  [E,H,I], takes the same files and transposes them when it binds)\n"
    "outputs (.npy, float32): y [R,S,H]; with a backward binary also dx [R,S,H],\n"
    "  dtopk_weights [R,S,K], dw1 [E,H,2I], dw2 [E,I,H] (none for a frozen layer's\n"
    "  backward binary)\n"
    "\n"
    "options:\n"
    "  --ranks R        all ranks: the binary's (its config's ep x tp);\n"
    "                   under mpirun, the number of processes (the default there)\n"
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
    "                   layer (implies --verify)\n"
    "  --backend B      cpu (worker threads; the default) or cuda: every rank on\n"
    "                   one NVIDIA GPU, the task program as one persistent kernel\n"
    "                   (thread blocks run the queues, events are counters in\n"
    "                   device memory); inputs and outputs stay .npy files on the\n"
    "                   host. Not under MPI, and no --trace, --profile,\n"
    "                   --op-by-op or --pack-weights\n"
    "  --pack-weights   keep the weights packed in the GEMM tile's layout, each\n"
    "                   packed by the first tile that reads it (the torch op's\n"
    "                   pack_weights=True); without it every tile packs\n"
    "                   the part it reads. The same bits either way\n"
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
    "                   its extension): tasks with their tiles, waits naming their\n"
    "                   event, signal arrows, and the prepare/tasks/finish phases;\n"
    "                   under MPI rank 0 writes one trace of every rank, with\n"
    "                   arrows across processes and hosts\n"
    "  --profile        print where the last timed passes' time went: per op its\n"
    "                   busy time, FLOPs or bytes, rate per core and share of one\n"
    "                   core's measured peak; per worker its busy and idle time;\n"
    "                   the waits of parked cores by event and signalling rank;\n"
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
     "--workspace", "--pack-weights", "--hand-made"},
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

int usage(const char *message) {
  std::fprintf(stderr, "moec run: %s\nusage: %s\n(see 'moec run --help')\n", message,
               kRunSpec.usage);
  return kUsage;
}

/// Set once the MPI fabric exists: an error then ends the whole job, after
/// rank 0 gathered every rank's report (bounded by reportSeconds).
comm::Fabric *jobFabric = nullptr;
double reportSeconds = 10;

/// The outputs folder while the run holds it: released (and removed when
/// the run made it and wrote nothing) before an error ends the job.
std::unique_ptr<RunFolder> runFolder;

int fail(const Status &status) {
  Progress::abandonCurrent();
  runFolder.reset();
  if (jobFabric) {
    // Rank 0 prints its error and the report of every rank; another rank
    // prints its own only where rank 0 did not take it.
    const uint32_t rank = jobFabric->firstLocal();
    if (rank == 0) {
      std::fprintf(stderr, "error: [process of rank 0] %s\n", status.message().c_str());
      std::fflush(stderr);
    }
    const std::string report = jobFabric->stopJob(status.message(), reportSeconds);
    if (rank != 0 && !report.empty())
      std::fprintf(stderr, "error: [process of rank %u] %s\n", rank, status.message().c_str());
    std::fprintf(stderr, "%s", report.c_str());
    std::fflush(stderr);
    comm::abortMpi(kError);
  }
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return kError;
}

/// Under MPI every process reads (or makes) the inputs of all ranks; they
/// must be the same everywhere (a host with another copy of the folder
/// would run another layer, or overrun its buffers). Each process sends the
/// shape and a CRC-32 of each input to every other, and each refuses a
/// difference, naming the ranks and the input.
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
    if (flag != "--threads" && flag != "--timeout" && flag != "--outputs" &&
        flag != "--inputs" && flag != "--random" && flag != "--repeat")
      text += flag + (flag == "--trace" ? std::string() : " " + value) + " ";
  for (const auto &[flag, on] : args.switches)
    if (on && flag != "--progress" && flag != "--no-progress")
      text += flag + " ";
  if (!text.empty())
    text.pop_back();
  return text.empty() ? "(none)" : text;
}

/// Refuses a job whose ranks were started with other options, naming both
/// ranks and their options; before anything else is exchanged, so that no
/// rank waits in a step another rank does not take.
Status checkSameOptions(comm::Fabric &fabric, const std::string &options,
                        double timeoutSeconds) {
  struct Fingerprint {
    uint32_t crc;
    char text[508]; // the start of the options, for the message
  };
  Fingerprint mine{format::crc32(reinterpret_cast<const uint8_t *>(options.data()), options.size()),
                   {}};
  std::memcpy(mine.text, options.data(), std::min(options.size(), sizeof mine.text - 1));
  std::vector<Fingerprint> all(fabric.ranks());
  if (Status s = fabric.exchange(&mine, sizeof mine, all.data(), timeoutSeconds); !s)
    return s.withPrefix("comparing the options of the ranks: ");
  const uint32_t me = fabric.firstLocal();
  for (uint32_t p = 0; p < fabric.ranks(); ++p)
    if (p != me && all[p].crc != mine.crc)
      return Status::error(fmt::format(
          "rank {} was started with other options than rank {}: '{}' against '{}' (every rank "
          "of the job needs the same options; only --threads, --timeout, --repeat, --outputs "
          "and the progress options may differ)",
          p, me, std::string(all[p].text, strnlen(all[p].text, sizeof all[p].text)), options));
  return Status::success();
}

/// Refuses a job whose ranks read other inputs (shapes and CRC-32s), naming
/// both ranks and what differs.
Status checkSameInputs(comm::Fabric &fabric, const LayerData &data, double timeoutSeconds) {
  struct Fingerprint {
    int64_t shape[6];
    uint32_t crc[6];
  };
  const auto crcOf = [](const auto &values) {
    return format::crc32(reinterpret_cast<const uint8_t *>(values.data()),
                         values.size() * sizeof(values[0]));
  };
  static const char *const kNames[6] = {"x.npy", "topk_ids.npy", "topk_weights.npy",
                                        "w1.npy", "w2.npy", "dy.npy"};
  Fingerprint mine{{data.ranks, data.tokens, data.topK, data.experts, data.hidden, data.inter},
                   {crcOf(data.x), crcOf(data.ids), crcOf(data.weights), crcOf(data.w1),
                    crcOf(data.w2), crcOf(data.dy)}};
  std::vector<Fingerprint> all(fabric.ranks());
  if (Status s = fabric.exchange(&mine, sizeof mine, all.data(), timeoutSeconds); !s)
    return s.withPrefix("comparing the inputs of the ranks: ");
  const uint32_t me = fabric.firstLocal();
  for (uint32_t p = 0; p < fabric.ranks(); ++p) {
    if (p == me)
      continue;
    const Fingerprint &theirs = all[p];
    if (std::memcmp(mine.shape, theirs.shape, sizeof mine.shape) != 0)
      return Status::error(fmt::format(
          "rank {} read inputs of another shape than rank {}: R {}, S {}, K {}, E {}, H {}, I {} "
          "against R {}, S {}, K {}, E {}, H {}, I {} (every rank needs the same input folder "
          "and the same --random seed)",
          p, me, theirs.shape[0], theirs.shape[1], theirs.shape[2], theirs.shape[3],
          theirs.shape[4], theirs.shape[5], mine.shape[0], mine.shape[1], mine.shape[2],
          mine.shape[3], mine.shape[4], mine.shape[5]));
    for (int i = 0; i < 6; ++i)
      if (mine.crc[i] != theirs.crc[i])
        return Status::error(fmt::format(
            "rank {} read another {} than rank {} (CRC-32 {:08x} against {:08x}; every rank "
            "needs the same input folder, or the same --random seed and --hot-share)",
            p, kNames[i], me, theirs.crc[i], mine.crc[i]));
  }
  return Status::success();
}

std::string tracePath(const std::string &path, const char *suffix) {
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + suffix + p.extension().string())).string();
}

std::string describe(const rt::LayerShape &s) {
  return fmt::format("{} ranks{} x {} local experts, H {}, I {}, {}{}", s.ranks,
                     s.tp > 1 ? fmt::format(" ({} EP x {} TP)", s.epRanks(), s.tp) : "",
                     s.localExperts, s.hidden,
                     s.tp > 1 ? fmt::format("{} ({} per TP rank)", s.inter * s.tp, s.inter)
                              : fmt::format("{}", s.inter),
                     format::dtypeName(s.activations),
                     s.fp8Dispatch ? ", FP8 dispatch" : "");
}

void printSchedule(const char *pass, const format::TaskProgram &p) {
  uint32_t cube = 0, vector = 0;
  for (const format::QueueRecord &q : p.queues)
    (q.coreKind == format::CoreKind::Cube ? cube : vector)++;
  std::printf("  %-8s %zu ops, %zu tasks, %zu events on %u cube + %u vector queues per rank "
              "(target '%s')\n",
              pass, p.ops.size(), p.tasks.size(), p.events.size(), cube, vector,
              std::string(p.name(p.target)).c_str());
}

/// Prints a line for every tensor of `data` with NaN or infinite values, per
/// rank (or per expert for the weights): they pass through the layer
/// silently, so the run says where they are.
void reportNonFinite(const LayerData &d, bool backward, bool outputs) {
  const int64_t R = d.ranks, L = d.experts / std::max<int64_t>(1, d.ranks);
  const auto scan = [&](const char *name, const std::vector<float> &values, int64_t parts,
                        const char *part) {
    if (values.empty() || parts <= 0)
      return;
    const size_t per = values.size() / size_t(parts);
    for (int64_t p = 0; p < parts; ++p) {
      int64_t bad = 0;
      for (size_t i = size_t(p) * per; i < size_t(p + 1) * per; ++i)
        bad += !std::isfinite(values[i]);
      if (bad)
        std::printf("non-finite: %s of %s %lld: %lld NaN/inf value%s\n", name, part, (long long)p,
                    (long long)bad, bad == 1 ? "" : "s");
    }
  };
  if (!outputs) {
    scan("x", d.x, R, "rank");
    scan("topk_weights", d.weights, R, "rank");
    scan("w1", d.w1, R * L, "expert");
    scan("w2", d.w2, R * L, "expert");
    if (backward)
      scan("dy", d.dy, R, "rank");
    return;
  }
  scan("y", d.y, R, "rank");
  if (backward) {
    scan("dx", d.dx, R, "rank");
    scan("dtopk_weights", d.dtopk, R, "rank");
    scan("dw1", d.dw1, R * L, "expert");
    scan("dw2", d.dw2, R * L, "expert");
  }
}

/// What to change in the config for a routing the binary has no room for.
std::string capacityHint(const rt::LayerShape &shape, const rt::CapacityNeed &need) {
  std::string hint = fmt::format(
      "the routing needs: {} rows routed by the fullest rank (the binary: {}), {} rows received "
      "by the experts of the fullest rank (the binary: {})",
      need.rowsPerRank, shape.rowCapacity, need.receivePerRank, shape.receiveCapacity);
  // What the config the binary was compiled from (its layer record) must
  // change.
  const format::CapacityAdvice advice = format::adviseCapacity(
      shape.capacityInputs(), need.rowsPerRank, need.receivePerRank, /*headroom=*/false);
  if (!advice.fits)
    return hint + fmt::format("; no config of this layer holds it (seq_size is at most {} and "
                              "capacity_factor at most {}): route fewer rows to one rank",
                              format::kMaxSeqSize, format::kMaxCapacityFactor);
  if (advice.seqSize > shape.tokens)
    hint += fmt::format("; compile with \"seq_size\" at least {} (tokens per rank)",
                        advice.seqSize);
  if (need.receivePerRank > shape.receiveCapacity)
    hint += fmt::format("; compile with \"capacity_factor\": {:.2f} or more in the config",
                        advice.capacityFactor);
  return hint;
}

void printTimes(const char *pass, const rt::PassTimes &t, uint64_t repeat) {
  std::printf("  %-8s %9.3f ms   prepare %.3f (checks %.3f)  tasks %.3f  finish %.3f%s\n", pass,
              t.total() * 1e3, t.prepare * 1e3, t.checks * 1e3, t.tasks * 1e3, t.finish * 1e3,
              repeat > 1 ? fmt::format("   (best of {})", repeat).c_str() : "");
}

} // namespace

/// The options of `moec run` past the files it reads and writes, checked.
struct RunOptions {
  bool mpi = false;           ///< --fabric mpi (the default under mpirun)
  bool localPuts = false;     ///< --local-puts
  bool verify = false;        ///< --verify, or --verify-sample
  uint64_t sampleTokens = 0;  ///< --verify-sample
  uint64_t ranks = 0, threads = 0, repeat = 1, warmup = 1, seed = 0;
  double timeout = kDefaultTimeoutSeconds;
  backend::Kind backend = backend::Kind::Cpu;
  double hotShare = 0;        ///< --hot-share
};

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
  if (!args.value("--ranks") && !mpi)
    return usage("missing --ranks R");
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
    // Below a millisecond the watchdog's clock cannot tell it from none.
    if (t->empty() || *end != '\0' || !(timeout >= 1e-3 && timeout <= 1e6))
      return usage("--timeout must be a number of seconds from 0.001 to 1000000");
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
        {args.has("--pack-weights"), {Feature::PackedWeights, "--pack-weights runs"}}};
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

int runRun(int argc, char **argv, int first) {
  std::optional<Args> parsed = parseArgs(kRunSpec, argc, argv, first);
  if (!parsed)
    return kUsage;
  const Args &args = *parsed;
  if (args.help) {
    printHelp(kRunSpec);
    return kOk;
  }
  for (const char *flag : {"--outputs", "--inputs"})
    if (args.value(flag) && args.value(flag)->empty())
      return usage(fmt::format("{} needs a folder; the path given is empty", flag).c_str());
  {
    // The files of the inputs folder are inputs too, and a backward trace
    // goes to a second path.
    std::vector<std::string> inputFiles;
    if (auto dir = args.value("--inputs")) {
      for (const std::string &name : layerInputFiles(true))
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
  // Every line of the report goes out as it is printed, so a run that is
  // killed (out of memory, a job's time limit) keeps the times it measured.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  RunOptions o;
  if (int code = parseRunOptions(args, &o); code != kOk)
    return code;
  const bool mpi = o.mpi, localPuts = o.localPuts, verify = o.verify;
  const uint64_t sampleTokens = o.sampleTokens, repeat = o.repeat, warmup = o.warmup,
                 seed = o.seed, threads = o.threads;
  uint64_t ranks = o.ranks;
  const double timeout = o.timeout, hotShare = o.hotShare;
  const backend::Kind backendKind = o.backend;

  std::shared_ptr<comm::Fabric> fabric;
  if (mpi) {
    comm::MpiOptions mpiOptions;
    mpiOptions.localPuts = localPuts;
    mpiOptions.timeoutSeconds = timeout;
    if (Status s = comm::createMpiFabric(&fabric, mpiOptions); !s)
      return fail(s);
    jobFabric = fabric.get();
    reportSeconds = timeout > 0 ? std::min(timeout, 10.0) : 10.0;
    if (ranks == 0)
      ranks = fabric->ranks();
    else if (ranks != fabric->ranks())
      return fail(Status::error(fmt::format("--ranks {}, but mpirun started {} processes", ranks,
                                            fabric->ranks())));
    if (Status s = checkSameOptions(*fabric, runOptionsText(args), timeout); !s)
      return fail(s);
  }
  // Under MPI only the process of rank 0 prints the report and writes files.
  const bool report = !fabric || fabric->firstLocal() == 0;
  Progress progress("moec run",
                    report ? progressMode(args.has("--progress"), args.has("--no-progress"))
                           : Progress::Mode::Never);
  progress.begin("load");

  std::shared_ptr<const rt::Program> fwd, bwd;
  if (Status s = rt::Program::load(args.positional[0], &fwd); !s)
    return fail(s);
  if (fwd->shape().backward)
    return fail(Status::error(args.positional[0] +
                              ": is a backward binary; give the forward binary first"));
  const bool backward = args.positional.size() == 2;
  if (backward) {
    if (Status s = rt::Program::load(args.positional[1], &bwd); !s)
      return fail(s);
    if (!bwd->shape().backward)
      return fail(Status::error(args.positional[1] + ": is a forward binary, not a backward one"));
  }
  const rt::LayerShape &shape = fwd->shape();
  if (fabric && ranks != shape.ranks)
    return fail(Status::error(fmt::format(
        "mpirun started {} processes, but {} was compiled for {} ranks (its config's ep x tp); "
        "one binary serves exactly its ranks: run it with mpirun -np {}",
        ranks, args.positional[0], shape.ranks, shape.ranks)));
  if (ranks != shape.ranks)
    return fail(Status::error(fmt::format(
        "--ranks {}, but {} was compiled for {} ranks (its config's ep x tp); one binary serves "
        "exactly its ranks",
        ranks, args.positional[0], shape.ranks)));

  rt::ContextOptions options;
  options.workers = uint32_t(threads);
  options.trace = args.value("--trace").has_value() || args.has("--profile");
  options.packWeights = args.has("--pack-weights");
  options.fabric = fabric;
  options.timeoutSeconds = timeout;
  options.backend = backendKind;
  if (args.has("--op-by-op"))
    options.schedule = rt::Schedule::OpByOp;
  std::unique_ptr<rt::Context> context;
  if (Status s = rt::Context::create(fwd, bwd, options, &context); !s)
    return fail(s);

  // The layer's tensors, as fp32 arrays and again in the binary's storage
  // type, and the whole reference layer of --verify, checked against the
  // machine before any is allocated.
  {
    const double R = shape.ranks, S = double(shape.rowCapacity) / double(std::max<int64_t>(1, shape.topK)),
                 K = shape.topK, E = shape.experts(), H = shape.hidden, I = shape.inter;
    const double perCopy = 4 * ((backward ? 4 : 2) * R * S * H + (backward ? 2 : 1) * 3 * E * H * I) +
                           16 * R * S * K;
    const double workspace = double(context->workspaceToAllocate());
    const double needed = 2 * perCopy + workspace;
    const MemoryLimit limit = memoryLimit();
    if (!limit.error.empty())
      return fail(Status::error(limit.error));
    const double memory = double(limit.bytes);
    if (memory > 0 && needed > memory)
      return fail(Status::error(fmt::format(
          "the layer needs {} in this process ({} of tensors, twice: as fp32 arrays and in the "
          "binary's storage type; {} of workspace); {} {}",
          memoryText(needed), memoryText(perCopy), memoryText(workspace), limit.source,
          memoryText(memory))));
    const double reference = verifyBytes(shape, backward);
    if (report && verify && sampleTokens == 0 && memory > 0 && needed + reference > memory)
      return fail(Status::error(fmt::format(
          "--verify runs the whole reference layer in double: {} on top of the run's {}, and "
          "{} {}; use --verify-sample N to check N random tokens and the weight-gradient units "
          "they touch",
          memoryText(reference), memoryText(needed), limit.source, memoryText(memory))));
  }

  LayerData data;
  const std::string outputs = *args.value("--outputs");
  progress.begin("inputs");
  if (auto dir = args.value("--inputs")) {
    if (Status s = readLayerInputs(*dir, shape, backward, args.has("--hand-made"), &data); !s)
      return fail(s);
  } else {
    RandomOptions random;
    random.seed = seed;
    random.hotShare = hotShare;
    random.bf16 = shape.activations == format::DType::BF16;
    if (shape.topK == 0)
      return fail(Status::error("cannot tell S and K from the binary; use --inputs"));
    randomLayerData(shape, random, &data);
    if (!backward)
      data.dy.clear();
  }
  // Quantized weights: the values the layer computes with, which the
  // inputs written and the reference then hold.
  if (Status s = roundWeightsToFormat(shape, &data); !s)
    return fail(s);
  if (fabric)
    if (Status s = checkSameInputs(*fabric, data, timeout); !s)
      return fail(s);
  // The folder stops being an earlier run's before this run writes to it,
  // and no other run writes it meanwhile.
  if (report && !localPuts)
    if (Status s = RunFolder::open(outputs, runFolderFiles(backward, args.value("--random").has_value()),
                                   args.positional, &runFolder);
        !s)
      return fail(s);

  progress.end();
  if (report) {
    std::printf("moec run: %s%s, %s, S %lld, top-%lld, %u worker threads%s\n",
                args.positional[0].c_str(), backward ? (" + " + args.positional[1]).c_str() : "",
                describe(shape).c_str(), (long long)data.tokens, (long long)data.topK,
                context->workers(),
                fabric ? fmt::format(" per process, {} MPI processes", fabric->ranks()).c_str()
                       : " (in-process ranks)");
    std::printf("schedule: %s%s\n", args.has("--op-by-op") ? "op by op" : "fused",
                localPuts ? ", puts into local memory (--local-puts)" : "");
    printSchedule("forward", fwd->tasks());
    if (backward)
      printSchedule("backward", bwd->tasks());
  }

  if (report)
    reportNonFinite(data, backward, false);
  LayerRun run;
  progress.begin("bind");
  if (Status s = run.bind(*context, data); !s)
    return fail(s);
  // Steps: passes, each counted by the share of its task runs done.
  const uint64_t passesBefore = context->passesEnded();
  progress.begin(backward ? "passes (forward + backward)" : "passes",
                 double((warmup + repeat) * (backward ? 2 : 1)), [&context, passesBefore] {
                   const double share = context->passShare();
                   return double(context->passesEnded() - passesBefore) + (share < 1 ? share : 0);
                 });
  rt::PassTimes bestFwd, bestBwd;
  bestFwd.prepare = bestBwd.prepare = std::numeric_limits<double>::infinity();
  for (uint64_t i = 0; i < warmup + repeat; ++i) {
    if (Status s = run.run(*context, backward, &data); !s) {
      if (s.code() == StatusCode::OverCapacity)
        return fail(Status::error(s.message() + "\n" + capacityHint(shape, context->capacityNeed())));
      return fail(s);
    }
    if (i < warmup)
      continue;
    if (context->forwardTimes().total() < bestFwd.total())
      bestFwd = context->forwardTimes();
    if (backward && context->backwardTimes().total() < bestBwd.total())
      bestBwd = context->backwardTimes();
  }
  progress.end();
  if (report) {
    reportNonFinite(data, backward, true);
    std::printf("time (wall, %s%s):\n", fabric ? "the process of rank 0" : "all ranks",
                warmup ? fmt::format("; after {} untimed warm-up pass{}", warmup,
                                     warmup == 1 ? "" : "es")
                             .c_str()
                       : "; the first pass is cold");
    printTimes("forward", bestFwd, repeat);
    if (backward)
      printTimes("backward", bestBwd, repeat);
    // What the puts moved between ranks (the last pass of each kind).
    const rt::PassTimes &f = context->forwardTimes(), &b = context->backwardTimes();
    const auto bytes = [](uint64_t n) {
      return fmt::format("{} ({} B)", memoryText(double(n)), n);
    };
    std::printf("  bytes between ranks: forward dispatch %s, combine %s",
                bytes(f.dispatchBytes).c_str(), bytes(f.combineBytes).c_str());
    if (backward)
      std::printf("; backward dispatch %s, combine %s", bytes(b.dispatchBytes).c_str(),
                  bytes(b.combineBytes).c_str());
    std::printf("\n");
    std::printf("  workspace %s%s\n",
                tooling::totalsText(tooling::workspaceTotals(*context)).c_str(),
                fabric ? " (per process)" : "");
    if (args.has("--workspace"))
      std::printf("%s", tooling::workspaceText(*context).c_str());
  }

  if (report && args.has("--profile")) {
    // The peaks are measured now, with the passes over and the workers idle.
    const tooling::Peaks peaks = tooling::measurePeaks(0.3);
    for (const rt::TracedPass pass : {rt::TracedPass::Forward, rt::TracedPass::Backward}) {
      if (pass == rt::TracedPass::Backward && !backward)
        continue;
      std::string text;
      if (Status s = tooling::profileText(*context, pass, peaks, &text); !s)
        return fail(s);
      std::printf("\nprofile of the last %s", text.c_str());
    }
  }

  if (auto option = args.value("--trace")) {
    // The last timed forward and backward passes, as they ran; under MPI
    // every rank's, in one file that rank 0 writes.
    const std::string &trace = *option;
    if (backward)
      if (Status s = context->writeTrace(tracePath(trace, ".bwd"), moec::rt::TracedPass::Backward); !s)
        return fail(s);
    if (Status s = context->writeTrace(trace, moec::rt::TracedPass::Forward); !s)
      return fail(s);
  }

  if (fabric) {
    // Every rank meets before the collectives that free the MPI resources
    // (bounded: a rank that runs more passes, or stopped, is reported). The
    // MPI resources go before MPI does; only rank 0 goes on.
    if (Status s = fabric->finish(timeout); !s)
      return fail(s.withPrefix("at the end of the job: "));
    context.reset();
    options.fabric.reset();
    jobFabric = nullptr;
    fabric.reset();
    comm::finalizeMpi();
    if (!report)
      return kOk;
  }

  if (localPuts) {
    std::printf("outputs: none (--local-puts)\n");
    return kOk;
  }
  std::vector<std::string> written;
  progress.begin("write outputs");
  if (args.value("--random"))
    if (Status s = writeLayerInputs(runFolder->path(), data, backward, &written); !s)
      return fail(runFolder->named(s));
  if (Status s = writeLayerOutputs(runFolder->path(), data, backward, &written); !s)
    return fail(runFolder->named(s));
  // Inputs read from the outputs folder are this run's files too.
  std::vector<std::string> kept;
  if (auto inputs = args.value("--inputs"); inputs && sameFile(*inputs, outputs))
    for (const std::string &name : layerInputFiles(backward))
      kept.push_back(name), written.push_back(name);
  std::string command = "moec run";
  for (int i = first; i < argc; ++i)
    command += std::string(" ") + argv[i];
  if (Status s = runFolder->finish(written, command, kept); !s)
    return fail(runFolder->named(s));
  runFolder.reset();
  progress.end();
  std::printf("outputs: %s/{y%s}.npy\n", outputs.c_str(),
              !backward            ? ""
              : data.dw1.empty() ? ",dx,dtopk_weights"
                                 : ",dx,dtopk_weights,dw1,dw2");

  if (!verify)
    return kOk;
  std::vector<OutputError> errors;
  VerifyOptions verifyOptions;
  verifyOptions.backward = backward;
  verifyOptions.bf16 = shape.activations == format::DType::BF16;
  verifyOptions.fp8Dispatch = shape.fp8Dispatch;
  verifyOptions.sampleTokens = int64_t(sampleTokens);
  verifyOptions.seed = seed + 1;
  verifyOptions.progress = [&progress](double done) { progress.update(done); };
  SampleSummary sample;
  progress.begin(sampleTokens ? "verify (sample)" : "verify", 1);
  if (Status s = verifyLayer(data, verifyOptions, &errors, &sample); !s)
    return fail(s);
  progress.end();
  if (sampleTokens)
    std::printf("verify %lld random token%s of %lld%s against the reference (plain loops in "
                "double):\n",
                (long long)sample.tokens, sample.tokens == 1 ? "" : "s",
                (long long)(data.ranks * data.tokens),
                sample.units ? fmt::format(", and {} expert unit{} of the weight gradients",
                                           sample.units, sample.units == 1 ? "" : "s")
                                   .c_str()
                             : "");
  else
    std::printf("verify against the reference (plain loops in double):\n");
  std::printf("  %-14s %12s %12s %10s\n", "output", "max abs err", "max rel err", "tolerance");
  bool ok = true;
  for (const OutputError &e : errors) {
    std::printf("  %-14s %12.3e %12.3e %10.0e  %s%s\n", e.name.c_str(), e.maxAbs, e.maxRel,
                e.tolerance, e.ok() ? "ok" : "FAILED",
                e.nonFinite || e.mismatched
                    ? fmt::format("  ({} NaN/inf in the output, {} not as the reference)",
                                  e.nonFinite, e.mismatched)
                          .c_str()
                    : "");
    ok = ok && e.ok();
  }
  std::printf("verify: %s\n", ok ? "passed" : "FAILED");
  return ok ? kOk : kError;
}

} // namespace moec::cli
