//===- File.cpp - Reading and writing whole files ----------------------------===//

#include "base/File.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moec {

Status readWholeFile(const std::string &path, std::vector<uint8_t> *out) {
  std::unique_ptr<std::FILE, int (*)(std::FILE *)> file(std::fopen(path.c_str(), "rb"),
                                                        std::fclose);
  if (!file)
    return Status::error(path + ": cannot open: " + std::strerror(errno));
  struct stat info {};
  if (::fstat(::fileno(file.get()), &info) != 0)
    return Status::error(path + ": cannot stat: " + std::strerror(errno));
  if (S_ISDIR(info.st_mode))
    return Status::error(path + ": is a directory, not a file");
  std::vector<uint8_t> bytes;
  // A regular file's size is known; a pipe's is read to its end.
  if (S_ISREG(info.st_mode) && info.st_size > 0) {
    bytes.resize(size_t(info.st_size));
    bytes.resize(std::fread(bytes.data(), 1, bytes.size(), file.get()));
  }
  std::vector<uint8_t> buffer(size_t(1) << 16);
  size_t got;
  while ((got = std::fread(buffer.data(), 1, buffer.size(), file.get())) > 0)
    bytes.insert(bytes.end(), buffer.begin(), buffer.begin() + std::ptrdiff_t(got));
  if (std::ferror(file.get()))
    return Status::error(path + ": cannot read: " + std::strerror(errno));
  *out = std::move(bytes);
  return Status::success();
}

namespace {

/// The temporaries being written, for the signal handler: fixed storage (no
/// allocation in a handler). A slot is free, claimed (its path being
/// copied in), or live (the handler may remove its path).
enum SlotState : int { kFree, kClaimed, kLive };
struct TemporarySlot {
  std::atomic<int> state{kFree};
  char path[4096] = {};
};
std::array<TemporarySlot, 32> temporaries;

/// Registers `path` for removal on a signal; returns the slot, or -1 when
/// all are taken or the path is too long (the file is then written without
/// that protection).
int registerTemporary(const std::string &path) {
  if (path.size() >= sizeof(TemporarySlot::path))
    return -1;
  for (size_t i = 0; i < temporaries.size(); ++i) {
    int expected = kFree;
    if (!temporaries[i].state.compare_exchange_strong(expected, kClaimed))
      continue;
    std::memcpy(temporaries[i].path, path.c_str(), path.size() + 1);
    temporaries[i].state.store(kLive);
    return int(i);
  }
  return -1;
}

void unregisterTemporary(int slot) {
  if (slot >= 0)
    temporaries[size_t(slot)].state.store(kFree);
}

extern "C" void removeTemporariesAndDie(int signal) {
  for (TemporarySlot &slot : temporaries)
    if (slot.state.load() == kLive)
      ::unlink(slot.path);
  std::signal(signal, SIG_DFL);
  std::raise(signal);
}

bool writeAll(int fd, const void *data, size_t size) {
  const char *at = static_cast<const char *>(data);
  while (size > 0) {
    // Linux writes at most about 2 GiB at a time.
    ssize_t written = ::write(fd, at, std::min<size_t>(size, size_t(1) << 30));
    if (written < 0) {
      if (errno == EINTR)
        continue;
      return false;
    }
    at += written;
    size -= size_t(written);
  }
  return true;
}

} // namespace

Status writeFileAtomically(const std::string &path, std::initializer_list<ByteSpan> parts) {
  static std::atomic<uint64_t> counter{0};
  const std::string temporary =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  const int slot = registerTemporary(temporary);
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    const int code = errno;
    unregisterTemporary(slot);
    return Status::error(path + ": cannot open for writing: " + std::strerror(code));
  }
  bool written = true;
  for (const ByteSpan &part : parts)
    written = written && writeAll(fd, part.data, part.size);
  const int writeErrno = errno;
  const bool closed = ::close(fd) == 0;
  int code = written ? (closed ? 0 : errno) : writeErrno;
  if (code == 0 && std::rename(temporary.c_str(), path.c_str()) != 0)
    code = errno;
  if (code != 0)
    ::unlink(temporary.c_str());
  unregisterTemporary(slot);
  if (code != 0)
    return Status::error(path + ": cannot write: " + std::strerror(code));
  return Status::success();
}

void removeTemporariesOnSignal() {
  for (int signal : {SIGINT, SIGTERM, SIGHUP, SIGQUIT})
    std::signal(signal, removeTemporariesAndDie);
}

} // namespace moec
