//===- FileTest.cpp - Tests for whole-file writes -------------------------===//

#include "base/File.h"

#include <catch2/catch.hpp>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
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
  // Over a directory: refused, the directory stays, no temporary is left.
  fs::create_directories(dir / "target");
  s = moec::writeFileAtomically((dir / "target").string(), {{"abc", 3}});
  REQUIRE_FALSE(s);
  CHECK(s.message() == (dir / "target").string() + ": is a directory, not a file");
  CHECK(fs::is_directory(dir / "target"));
  CHECK(namesIn(dir) == std::vector<std::string>{"target"});
}

TEST_CASE("a write through a symlink replaces the file it names, not the link", "[file]") {
  const fs::path dir = freshFolder("atomic-link");
  REQUIRE(moec::writeFileAtomically((dir / "real.txt").string(), {{"old", 3}}));
  fs::create_symlink("real.txt", dir / "link.txt");
  REQUIRE(moec::writeFileAtomically((dir / "link.txt").string(), {{"new!", 4}}));
  CHECK(fs::is_symlink(dir / "link.txt"));
  std::vector<uint8_t> bytes;
  REQUIRE(moec::readWholeFile((dir / "real.txt").string(), &bytes));
  CHECK(std::string(bytes.begin(), bytes.end()) == "new!");
  // A loop and a link to nothing are refused, and left as they are.
  fs::create_symlink("loop-b", dir / "loop-a");
  fs::create_symlink("loop-a", dir / "loop-b");
  moec::Status s = moec::writeFileAtomically((dir / "loop-a").string(), {{"x", 1}});
  CHECK(s.message() == (dir / "loop-a").string() + ": is a loop of symbolic links");
  fs::create_symlink("nowhere", dir / "dangling");
  s = moec::writeFileAtomically((dir / "dangling").string(), {{"x", 1}});
  CHECK(s.message() ==
        (dir / "dangling").string() + ": is a symbolic link to a file that does not exist");
  CHECK(fs::is_symlink(dir / "loop-a"));
  CHECK(fs::is_symlink(dir / "dangling"));
  CHECK_FALSE(fs::exists(dir / "nowhere"));
}

TEST_CASE("a FIFO or a device is written into, never replaced", "[file]") {
  const fs::path dir = freshFolder("atomic-fifo");
  const std::string fifo = (dir / "pipe").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // No reader: refused at once, not waited on.
  moec::Status s = moec::writeFileAtomically(fifo, {{"abc", 3}});
  CHECK(s.message() == fifo + ": cannot open for writing: a FIFO that no process reads");
  // With a reader: the bytes go through the FIFO, which stays one.
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  REQUIRE(reader >= 0);
  REQUIRE(moec::writeFileAtomically(fifo, {{"abc", 3}, {"de", 2}}));
  char got[8] = {};
  CHECK(::read(reader, got, sizeof got) == 5);
  CHECK(std::string(got) == "abcde");
  ::close(reader);
  struct stat info {};
  REQUIRE(::lstat(fifo.c_str(), &info) == 0);
  CHECK(S_ISFIFO(info.st_mode));
  CHECK(namesIn(dir) == std::vector<std::string>{"pipe"});
  // A character device: /dev/null takes the bytes and stays a device.
  REQUIRE(moec::writeFileAtomically("/dev/null", {{"abc", 3}}));
  REQUIRE(::stat("/dev/null", &info) == 0);
  CHECK(S_ISCHR(info.st_mode));
}

TEST_CASE("readWholeFile reads regular files only, and no more than its bound", "[file]") {
  const fs::path dir = freshFolder("read-bounds");
  std::vector<uint8_t> bytes;
  moec::Status s = moec::readWholeFile("/dev/zero", &bytes);
  CHECK(s.message() == "/dev/zero: is a character device, not a regular file");
  fs::create_symlink("/dev/urandom", dir / "random.bin");
  s = moec::readWholeFile((dir / "random.bin").string(), &bytes);
  CHECK(s.message() == (dir / "random.bin").string() + ": is a character device, not a regular file");
  const std::string fifo = (dir / "pipe").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  s = moec::readWholeFile(fifo, &bytes); // no writer: refused, not waited on
  CHECK(s.message() == fifo + ": is a FIFO, not a regular file");
  REQUIRE(moec::writeFileAtomically((dir / "ten.bin").string(), {{"0123456789", 10}}));
  s = moec::readWholeFile((dir / "ten.bin").string(), &bytes, 9);
  CHECK(s.message() == (dir / "ten.bin").string() +
                           ": holds 10 bytes, more than the 9 an input of this kind may hold");
  REQUIRE(moec::readWholeFile((dir / "ten.bin").string(), &bytes, 10));
  CHECK(bytes.size() == 10);
  // A kernel file states size 0 and is read to its end within the bound.
  std::string text;
  REQUIRE(moec::readTextFile("/proc/self/status", &text));
  CHECK(text.find("Name:") != std::string::npos);
  s = moec::readTextFile("/proc/self/status", &text, 16);
  CHECK(s.message() == "/proc/self/status: holds more bytes, more than the 16 an input of this "
                       "kind may hold");
  CHECK(moec::readWholeFile("", &bytes).message() == "an empty path names no file to read");
}

TEST_CASE("checkOutputPath refuses an output that is an input under any name", "[file]") {
  const fs::path dir = freshFolder("output-checks");
  const std::string input = (dir / "in.bin").string();
  REQUIRE(moec::writeFileAtomically(input, {{"x", 1}}));
  fs::create_hard_link(input, dir / "hard.bin");
  fs::create_symlink("in.bin", dir / "soft.bin");
  for (const fs::path &name : {dir / "in.bin", dir / "hard.bin", dir / "soft.bin"}) {
    moec::Status s = moec::checkOutputPath("-o", name.string(), {"other", input});
    CHECK(s.message() == "-o " + name.string() + ": is the same file as the input " + input +
                             "; writing it would destroy that input, so give another path");
  }
  CHECK(moec::checkOutputPath("-o", (dir / "new.bin").string(), {input}));
  CHECK(moec::checkOutputPath("-o", "-", {"-"}));
  CHECK(moec::checkOutputPath("-o", "", {input}).message() ==
        "-o: an empty path names no file to write");
  CHECK(moec::checkWritable((dir / "new.bin").string()));
  CHECK(moec::checkWritable((dir / "no-folder" / "new.bin").string()).message() ==
        (dir / "no-folder" / "new.bin").string() +
            ": cannot open for writing: No such file or directory");
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
