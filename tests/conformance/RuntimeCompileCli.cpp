//===- RuntimeCompileCli.cpp - compileLayer by running `moec compile` -----===//
//
// Runs `$MOEC compile GRAPH --config CFG --granularity G -o OUT`, with OUT
// next to the config and moec's stderr in OUT.log, and loads OUT.
//
//===----------------------------------------------------------------------===//

#include "tests/conformance/RuntimeCompile.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

extern char **environ;

namespace moec::test {

Status compileLayer(const std::string &graphPath, const std::string &configPath,
                    const std::string &granularity, format::TaskProgram *out) {
  const char *moec = std::getenv("MOEC");
  if (!moec || !*moec)
    return Status::error("set MOEC to the moec binary to compile layers");
  const size_t slash = graphPath.find_last_of('/');
  std::string stem = graphPath.substr(slash == std::string::npos ? 0 : slash + 1);
  stem = stem.substr(0, stem.find('.'));
  const std::string output = configPath + "." + stem + ".moebin";
  std::vector<std::string> args = {moec,        "compile",  graphPath,
                                   "--config",  configPath, "--granularity",
                                   granularity, "-o",       output};
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
  return format::loadTaskBinaryFile(output, out);
}

} // namespace moec::test
