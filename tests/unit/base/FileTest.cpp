//===- FileTest.cpp - Tests for whole-file writes -------------------------===//

#include "base/File.h"

#include <catch2/catch.hpp>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;

namespace {

/// A fresh empty folder under the test's temporary directory.
fs::path freshFolder(const std::string &name) {
  const char *root = std::getenv("TEST_TMPDIR");
  fs::path dir = fs::path(root ? root : fs::temp_directory_path().string()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::vector<std::string> namesIn(const fs::path &dir) {
  std::vector<std::string> names;
  for (const auto &entry : fs::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  return names;
}

} // namespace

TEST_CASE("writeFileAtomically writes its parts and leaves nothing else", "[file]") {
  const fs::path dir = freshFolder("atomic");
  const std::string path = (dir / "out.bin").string();
  REQUIRE(moec::writeFileAtomically(path, {{"abc", 3}, {"", 0}, {"de", 2}}));
  std::vector<uint8_t> bytes;
  REQUIRE(moec::readWholeFile(path, &bytes));
  CHECK(std::string(bytes.begin(), bytes.end()) == "abcde");
  // A second write replaces the first whole.
  REQUIRE(moec::writeFileAtomically(path, {{"xy", 2}}));
  REQUIRE(moec::readWholeFile(path, &bytes));
  CHECK(std::string(bytes.begin(), bytes.end()) == "xy");
  CHECK(namesIn(dir) == std::vector<std::string>{"out.bin"});
}

TEST_CASE("a failed write names the path and leaves the old file", "[file]") {
  const fs::path dir = freshFolder("atomic-fail");
  const std::string missing = (dir / "no-such-folder" / "out.bin").string();
  moec::Status s = moec::writeFileAtomically(missing, {{"abc", 3}});
  REQUIRE_FALSE(s);
  CHECK(s.message().rfind(missing + ": cannot open for writing: ", 0) == 0);
  // Over a directory: rename fails, the directory stays, no temporary is left.
  fs::create_directories(dir / "target");
  s = moec::writeFileAtomically((dir / "target").string(), {{"abc", 3}});
  REQUIRE_FALSE(s);
  CHECK(s.message().find("cannot write") != std::string::npos);
  CHECK(fs::is_directory(dir / "target"));
  CHECK(namesIn(dir) == std::vector<std::string>{"target"});
}

TEST_CASE("a signal during a write removes the temporary", "[file]") {
  const fs::path dir = freshFolder("atomic-signal");
  const std::string path = (dir / "big.bin").string();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // 1 GiB from one 64 MiB buffer: long enough to be caught mid-write.
    moec::removeTemporariesOnSignal();
    std::vector<char> chunk(size_t(64) << 20, 'x');
    const moec::ByteSpan part{chunk.data(), chunk.size()};
    moec::writeFileAtomically(path, {part, part, part, part, part, part, part, part, part,
                                     part, part, part, part, part, part, part});
    ::_exit(0);
  }
  bool sawTemporary = false;
  for (int i = 0; i < 2000000 && !sawTemporary; ++i)
    for (const std::string &name : namesIn(dir))
      sawTemporary = sawTemporary || name.find("big.bin.tmp.") == 0;
  ::kill(child, SIGTERM);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(sawTemporary);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
  CHECK(namesIn(dir).empty());
}
