//===- RuntimeCompileCli.cpp - compileLayer by running `moec compile` -----===//
//
// Runs `$MOEC compile GRAPH --config CFG --granularity G -o OUT`, with OUT
// next to the config and moec's stderr in OUT.log, and loads OUT. For the
// cuda backend (MOEC_TEST_BACKEND=cuda), as its users compile: --target h100
// (which keeps a LoRA adapter's GMMs their own, where the cpu target fuses
// them into the base's, which the cuda tiles do not run) and --peer-groups 1
// (it runs no peer-group tiles); the config's core counts still decide the
// queues. MOEC_TEST_COMPILE_FOR=cuda compiles so on any backend, to fill
// MOEC_BINARY_CACHE for a GPU machine from a run on the CPU.
//
//===----------------------------------------------------------------------===//

#include "tests/conformance/RuntimeCompile.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

extern char **environ;

namespace moec::test {

namespace {

/// The file of a compiled layer in the folder MOEC_BINARY_CACHE: named by
/// an FNV-1a hash of the graph's name, the config's text, the granularity
/// and the extra options. Empty without the variable.
std::string cachedPath(const std::string &graphPath, const std::string &configPath,
                       const std::string &granularity, const std::string &extra) {
  const char *dir = std::getenv("MOEC_BINARY_CACHE");
  if (!dir || !*dir)
    return {};
  std::ostringstream config;
  config << std::ifstream(configPath).rdbuf();
  uint64_t hash = 1469598103934665603ull;
  for (const std::string &part : {graphPath, config.str(), granularity, extra})
    for (char ch : part + '\0') {
      hash ^= uint8_t(ch);
      hash *= 1099511628211ull;
    }
  char name[40];
  std::snprintf(name, sizeof name, "%016llx.moebin", static_cast<unsigned long long>(hash));
  return std::string(dir) + "/" + name;
}

/// Whether layers are compiled as the cuda backend runs them.
bool forCuda() {
  for (const char *name : {"MOEC_TEST_BACKEND", "MOEC_TEST_COMPILE_FOR"})
    if (const char *value = std::getenv(name); value && std::strcmp(value, "cuda") == 0)
      return true;
  return false;
}

} // namespace

Status compileLayer(const std::string &graphPath, const std::string &configPath,
                    const std::string &granularity, format::TaskProgram *out) {
  // MOEC_BINARY_CACHE: compiled layers are kept there, and taken from there
  // when present (so the suite can run where no moec binary can).
  const std::string extra = forCuda() ? "--target h100 --peer-groups 1" : "";
  const std::string cached = cachedPath(graphPath, configPath, granularity, extra);
  if (!cached.empty() && std::ifstream(cached).good())
    return format::loadTaskBinaryFile(cached, out);
  const char *moec = std::getenv("MOEC");
  if (!moec || !*moec)
    return Status::error(cached.empty() ? "set MOEC to the moec binary to compile layers"
                                        : "set MOEC to the moec binary to compile layers (" +
                                              cached + " is not in the cache)");
  const size_t slash = graphPath.find_last_of('/');
  std::string stem = graphPath.substr(slash == std::string::npos ? 0 : slash + 1);
  stem = stem.substr(0, stem.find('.'));
  const std::string output = configPath + "." + stem + ".moebin";
  std::vector<std::string> args = {moec,        "compile",  graphPath,
                                   "--config",  configPath, "--granularity",
                                   granularity, "-o",       output};
  if (forCuda())
    args.insert(args.end() - 2, {"--target", "h100", "--peer-groups", "1"});
  std::vector<char *> argv;
  for (std::string &a : args)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = output + ".log";
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int err = posix_spawn(&pid, moec, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err)
    return Status::error(std::string("cannot run ") + moec + ": " + std::strerror(err));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR)
      return Status::error(std::string("waitpid: ") + std::strerror(errno));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::ostringstream text;
    text << std::ifstream(log).rdbuf();
    return Status::error(graphPath + ": moec compile failed: " + text.str());
  }
  if (!cached.empty()) {
    std::ifstream from(output, std::ios::binary);
    std::ofstream to(cached, std::ios::binary);
    to << from.rdbuf();
    if (!to)
      return Status::error("cannot write " + cached);
  }
  return format::loadTaskBinaryFile(output, out);
}

} // namespace moec::test
