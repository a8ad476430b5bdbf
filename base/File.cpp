//===- File.cpp - Reading a whole file ---------------------------------------===//

#include "base/File.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include <sys/stat.h>

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

} // namespace moec
