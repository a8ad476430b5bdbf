//===- File.cpp - Reading and writing whole files ----------------------------===//

#include "base/File.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <string>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace moec {

namespace {

/// What a file of this mode is, for a message: "a character device".
const char *kindOfFile(mode_t mode) {
  if (S_ISDIR(mode))
    return "a directory";
  if (S_ISCHR(mode))
    return "a character device";
  if (S_ISBLK(mode))
    return "a block device";
  if (S_ISFIFO(mode))
    return "a FIFO";
  if (S_ISSOCK(mode))
    return "a socket";
  return "not a regular file";
}

/// Closes a file descriptor at the end of a scope.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0)
      ::close(fd);
  }
};

/// Reads the regular file at `path` into `*out` (a byte vector or a string):
/// all of it, refusing more than `maxBytes`, or with `head` its first
/// `maxBytes` bytes, setting *fileSize to the size the file states.
template <typename Bytes>
Status readInto(const std::string &path, Bytes *out, uint64_t maxBytes, bool head = false,
                uint64_t *fileSize = nullptr) {
  if (path.empty())
    return Status::error("an empty path names no file to read");
  // "-" is standard input, whatever it is (a pipe is read to its end, within
  // the bound). Anything else opens only as a regular file. O_NONBLOCK:
  // opening a FIFO that no process writes returns at once, to be refused
  // below, instead of waiting for a writer.
  const bool standardInput = path == "-";
  const int fd = standardInput ? 0 : ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  const std::string name = standardInput ? std::string("standard input") : path;
  if (fd < 0) {
    const int code = errno;
    struct stat info {};
    if (::stat(path.c_str(), &info) == 0 && !S_ISREG(info.st_mode) && !S_ISDIR(info.st_mode))
      return Status::error(path + ": is " + kindOfFile(info.st_mode) + ", not a regular file");
    return Status::error(path + ": cannot open: " + std::strerror(code));
  }
  FdCloser closer{standardInput ? -1 : fd};
  struct stat info {};
  if (::fstat(fd, &info) != 0)
    return Status::error(name + ": cannot stat: " + std::strerror(errno));
  if (S_ISDIR(info.st_mode))
    return Status::error(name + ": is a directory, not a file");
  if (!S_ISREG(info.st_mode) && !standardInput)
    return Status::error(path + ": is " + kindOfFile(info.st_mode) + ", not a regular file");
  if (!S_ISREG(info.st_mode))
    info.st_size = 0;
  if (fileSize)
    *fileSize = uint64_t(info.st_size);
  if (head)
    info.st_size = std::min<off_t>(info.st_size, off_t(maxBytes));
  auto tooLarge = [&](uint64_t bytes) {
    return Status::error(name + ": holds " + (bytes > 0 ? std::to_string(bytes) : "more") +
                         " bytes, more than the " + std::to_string(maxBytes) +
                         " an input of this kind may hold");
  };
  if (uint64_t(info.st_size) > maxBytes)
    return tooLarge(uint64_t(info.st_size));
  Bytes bytes;
  size_t have = 0;
  try {
    // The size a regular file states; one that grows, or a kernel file that
    // states 0, is read on in steps up to the bound.
    bytes.resize(size_t(info.st_size));
    while (true) {
      if (have == bytes.size()) {
        if (have >= maxBytes) {
          if (head)
            break;
          char extra;
          ssize_t more;
          while ((more = ::read(fd, &extra, 1)) < 0 && errno == EINTR) {
          }
          if (more > 0)
            return tooLarge(0); // more than the bound, by how much is not read
          break;
        }
        bytes.resize(size_t(std::min<uint64_t>(maxBytes, std::max<uint64_t>(have * 2, 1 << 16))));
      }
      const ssize_t got = ::read(fd, &bytes[have], bytes.size() - have);
      if (got < 0) {
        if (errno == EINTR)
          continue;
        return Status::error(name + ": cannot read: " + std::strerror(errno));
      }
      if (got == 0)
        break;
      have += size_t(got);
    }
    bytes.resize(have);
  } catch (const std::bad_alloc &) {
    return Status::error(name + ": cannot hold its " + std::to_string(info.st_size) +
                         " bytes in memory");
  }
  *out = std::move(bytes);
  return Status::success();
}

} // namespace

Status readWholeFile(const std::string &path, std::vector<uint8_t> *out, uint64_t maxBytes) {
  return readInto(path, out, maxBytes);
}

Status readTextFile(const std::string &path, std::string *out, uint64_t maxBytes) {
  return readInto(path, out, maxBytes);
}

Status readFileHead(const std::string &path, uint64_t maxBytes, std::vector<uint8_t> *out,
                    uint64_t *fileSize) {
  return readInto(path, out, maxBytes, /*head=*/true, fileSize);
}

bool sameFile(const std::string &a, const std::string &b) {
  struct stat first {}, second {};
  return !a.empty() && !b.empty() && ::stat(a.c_str(), &first) == 0 &&
         ::stat(b.c_str(), &second) == 0 && first.st_dev == second.st_dev &&
         first.st_ino == second.st_ino;
}

Status checkOutputPath(const std::string &what, const std::string &path,
                       const std::vector<std::string> &inputs) {
  if (path.empty())
    return Status::error(what + ": an empty path names no file to write");
  struct stat info {};
  if (path == "-") {
    // Standard output redirected onto an input (`>> graph.json`).
    struct stat out {}, in {};
    if (::fstat(1, &out) == 0 && S_ISREG(out.st_mode))
      for (const std::string &input : inputs)
        if (input != "-" && ::stat(input.c_str(), &in) == 0 && in.st_dev == out.st_dev &&
            in.st_ino == out.st_ino)
          return Status::error("standard output is the input " + input +
                               "; writing it would change that input, so redirect it elsewhere");
    return Status::success();
  }
  // Writing into a device or a FIFO changes no input file.
  if (::stat(path.c_str(), &info) == 0 && (S_ISCHR(info.st_mode) || S_ISFIFO(info.st_mode)))
    return Status::success();
  for (const std::string &input : inputs)
    if (input != "-" && sameFile(path, input))
      return Status::error(what + " " + path + ": is the same file as the input " + input +
                           "; writing it would destroy that input, so give another path");
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

namespace {

/// Writes `parts` into the character device or FIFO at `path`, which is not
/// replaced: it is a stream, not a file to swap.
Status writeInto(const std::string &path, std::initializer_list<ByteSpan> parts) {
  // O_NONBLOCK: a FIFO that no process reads is refused (ENXIO) instead of
  // waited on; the writes then block as usual.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int code = errno;
    return Status::error(path + ": cannot open for writing: " +
                         (code == ENXIO ? std::string("a FIFO that no process reads")
                                        : std::string(std::strerror(code))));
  }
  FdCloser closer{fd};
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  for (const ByteSpan &part : parts)
    if (!writeAll(fd, part.data, part.size))
      return Status::error(path + ": cannot write: " + std::strerror(errno));
  return Status::success();
}

/// Where writeFileAtomically puts the file named by `path`: `path` itself,
/// or the file a symlink there names; `*stream` is set for a device or FIFO.
Status resolveOutput(const std::string &path, std::string *target, bool *stream) {
  *target = path;
  *stream = false;
  if (path.empty())
    return Status::error("an empty path names no file to write");
  struct stat link {};
  if (::lstat(path.c_str(), &link) != 0)
    return Status::success(); // a new file (or a folder missing: open says so)
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    const int code = errno;
    if (code == ELOOP)
      return Status::error(path + ": is a loop of symbolic links");
    if (code == ENOENT && S_ISLNK(link.st_mode))
      return Status::error(path + ": is a symbolic link to a file that does not exist");
    return Status::error(path + ": cannot stat: " + std::strerror(code));
  }
  if (S_ISCHR(info.st_mode) || S_ISFIFO(info.st_mode)) {
    *stream = true;
    return Status::success();
  }
  if (S_ISDIR(info.st_mode))
    return Status::error(path + ": is a directory, not a file");
  if (!S_ISREG(info.st_mode))
    return Status::error(path + ": is " + kindOfFile(info.st_mode) + ", not a file to write");
  if (S_ISLNK(link.st_mode)) {
    std::unique_ptr<char, void (*)(void *)> real(::realpath(path.c_str(), nullptr), std::free);
    if (!real)
      return Status::error(path + ": cannot resolve its symbolic link: " + std::strerror(errno));
    *target = real.get();
  }
  return Status::success();
}

} // namespace

Status checkWritable(const std::string &path) {
  if (path == "-")
    return Status::success();
  std::string target;
  bool stream = false;
  if (Status s = resolveOutput(path, &target, &stream); !s)
    return s;
  if (stream)
    return Status::success();
  const size_t slash = target.find_last_of('/');
  const std::string folder =
      slash == std::string::npos ? "." : slash == 0 ? "/" : target.substr(0, slash);
  struct stat info {};
  int code = 0;
  if (::stat(folder.c_str(), &info) != 0)
    code = errno;
  else if (!S_ISDIR(info.st_mode))
    code = ENOTDIR;
  if (code == 0) {
    // What the write will do, tried now: a temporary beside the target,
    // removed at once (a folder the kernel does not let files into, a name
    // too long, a read-only file system all fail here).
    const std::string probe = target + ".tmp." + std::to_string(::getpid()) + ".probe";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      code = errno;
    } else {
      ::close(fd);
      ::unlink(probe.c_str());
    }
  }
  if (code != 0)
    return Status::error(path + ": cannot open for writing: " + std::strerror(code));
  return Status::success();
}

void removeStaleTemporaries(const std::string &dir, const std::string &prefix) {
  std::unique_ptr<DIR, int (*)(DIR *)> folder(::opendir(dir.c_str()), ::closedir);
  if (!folder)
    return;
  std::vector<std::string> stale;
  while (const dirent *entry = ::readdir(folder.get())) {
    const std::string name = entry->d_name;
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0)
      continue;
    char *end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (end == name.c_str() + prefix.size() || pid <= 0 || pid == long(::getpid()))
      continue;
    if (::kill(pid_t(pid), 0) != 0 && errno == ESRCH)
      stale.push_back(dir + "/" + name);
  }
  for (const std::string &path : stale) {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
}

Status writeFileAtomically(const std::string &path, std::initializer_list<ByteSpan> parts) {
  std::string target;
  bool stream = false;
  if (Status s = resolveOutput(path, &target, &stream); !s)
    return s;
  if (stream)
    return writeInto(path, parts);
  {
    const std::filesystem::path t(target);
    removeStaleTemporaries(t.has_parent_path() ? t.parent_path().string() : ".",
                           t.filename().string() + ".tmp.");
  }
  static std::atomic<uint64_t> counter{0};
  const std::string temporary =
      target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
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
  int writeErrno = errno;
  // On disk before the rename: a crash leaves the old file or the new one.
  if (written && ::fdatasync(fd) != 0 && errno != EINVAL && errno != EROFS)
    written = false, writeErrno = errno;
  const bool closed = ::close(fd) == 0;
  int code = written ? (closed ? 0 : errno) : writeErrno;
  if (code == 0 && std::rename(temporary.c_str(), target.c_str()) != 0)
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
  // A file past the process's size limit: the write fails (EFBIG) and is
  // reported, and its temporary removed, instead of the signal ending the
  // process with the temporary left behind.
  std::signal(SIGXFSZ, SIG_IGN);
}

} // namespace moec
