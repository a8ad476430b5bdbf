//===- RunFolder.cpp - A run's folder: its files, its manifest, its lock --===//
//
// See LayerRun.h: RunFolder (a run's output folder, written whole or not at
// all, under a lock, with its manifest) and checkRunManifest.
//
//===----------------------------------------------------------------------===//

#include "runtime/tooling/LayerRun.h"

#include "base/File.h"
#include "format/Crc32.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace moec::tooling {

using format::DType;

namespace {

std::string crcText(const std::vector<uint8_t> &bytes) {
  return fmt::format("{:08x}", format::crc32(bytes.data(), bytes.size()));
}

} // namespace

/// Every name a run writes into its folder, inputs (of --random) and
/// outputs.
std::vector<std::string> runFolderFiles(bool backward, bool inputs, uint8_t loraTargets) {
  std::vector<std::string> names = {"y.npy"};
  if (backward) {
    names.insert(names.end(), {"dx.npy", "dtopk_weights.npy", "dw1.npy", "dw2.npy"});
    for (const LoraTensor &t : loraTensors(loraTargets, true))
      names.push_back(t.name() + ".npy");
  }
  if (inputs)
    for (const std::string &name : layerInputFiles(backward, loraTargets))
      names.push_back(name);
  names.push_back(kRunManifest);
  return names;
}

bool isRunFileName(const std::string &name) {
  const std::vector<std::string> all = runFolderFiles(true, true, 3);
  return std::find(all.begin(), all.end(), name) != all.end();
}

Status RunFolder::open(const std::string &dir, const std::vector<std::string> &writes,
                       const std::vector<std::string> &inputs, std::unique_ptr<RunFolder> *out) {
  if (dir.empty())
    return Status::error("--outputs: an empty path names no folder");
  std::unique_ptr<RunFolder> folder(new RunFolder());
  folder->dir = dir;
  std::error_code ec;
  struct stat link {};
  if (::lstat(dir.c_str(), &link) == 0 && S_ISLNK(link.st_mode) &&
      !std::filesystem::exists(dir, ec))
    return Status::error(fmt::format(
        "{}: cannot be the outputs folder: it is a symbolic link to nothing (or a loop)", dir));
  const bool existed = std::filesystem::exists(dir, ec);
  if (!existed && !std::filesystem::create_directories(dir, ec) && ec)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir, ec.message()));
  folder->created = !existed;
  folder->fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (folder->fd < 0)
    return Status::error(
        fmt::format("{}: cannot be the outputs folder: {}", dir, std::strerror(errno)));
  if (::flock(folder->fd, LOCK_EX | LOCK_NB) != 0)
    return Status::error(fmt::format(
        "{}: another moec run is writing this folder now; give this run another --outputs "
        "folder, or wait for that run to end",
        dir));
  // The folder is replaced whole at the end: it may hold a run's files
  // only, none of them an input of this run under another name.
  for (const std::filesystem::directory_entry &entry :
       std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string(), path = dir + "/" + name;
    struct stat info {};
    if (::lstat(path.c_str(), &info) != 0)
      continue;
    if (std::find(writes.begin(), writes.end(), name) != writes.end() && !S_ISREG(info.st_mode))
      return Status::error(fmt::format(
          "{}: is {}; the run writes {} as a file of the outputs folder, so move that away "
          "or give another --outputs folder",
          path, S_ISLNK(info.st_mode) ? "a symbolic link" : "not a regular file", name));
    for (const std::string &input : inputs)
      if (sameFile(path, input))
        return Status::error(fmt::format(
            "{}: is the input {}; the run would write over it, so give another --outputs folder",
            path, input));
    if (!isRunFileName(name))
      return Status::error(fmt::format(
          "{}: holds '{}', which no run writes; a run replaces its outputs folder whole (a new "
          "folder beside it, swapped in when every file is written), so give a folder of its "
          "own: new, empty, or one that a run wrote",
          dir, name));
  }
  if (ec)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir, ec.message()));
  // The new folder goes beside the real one (through a symbolic link).
  const std::filesystem::path real = std::filesystem::canonical(dir, ec);
  if (ec)
    return Status::error(fmt::format("{}: cannot be the outputs folder: {}", dir, ec.message()));
  folder->target = real.string();
  const std::string parent = real.parent_path().string(),
                    prefix = "." + real.filename().string() + ".moec-new.";
  removeStaleTemporaries(parent, prefix);
  folder->staging = parent + "/" + prefix + std::to_string(::getpid());
  std::filesystem::remove_all(folder->staging, ec);
  if (!std::filesystem::create_directory(folder->staging, ec))
    return Status::error(fmt::format("{}: cannot make the new outputs folder {} beside it: {}", dir,
                                     folder->staging,
                                     ec ? ec.message() : std::string("it exists")));
  *out = std::move(folder);
  return Status::success();
}

Status RunFolder::named(const Status &status) const {
  if (status || staging.empty())
    return status;
  std::string message = status.message();
  for (size_t at = message.find(staging); at != std::string::npos;
       at = message.find(staging, at + dir.size()))
    message.replace(at, staging.size(), dir);
  return Status::error(message, status.code());
}

RunFolder::~RunFolder() {
  std::error_code ec;
  if (!staging.empty()) // a failed run leaves the folder as it was
    std::filesystem::remove_all(staging, ec);
  if (created) // and none that it made
    std::filesystem::remove_all(dir, ec);
  if (fd >= 0)
    ::close(fd); // and the lock with it
}

Status RunFolder::finish(const std::vector<std::string> &files, const std::string &run,
                         const std::vector<std::string> &kept) {
  // Files of the folder that are this run's too (inputs read from it):
  // linked into the new folder, or copied where links cannot be made.
  for (const std::string &name : kept) {
    const std::string from = target + "/" + name, to = staging + "/" + name;
    std::error_code ec;
    std::filesystem::create_hard_link(from, to, ec);
    if (ec) {
      ec.clear();
      std::filesystem::copy_file(from, to, ec);
    }
    if (ec)
      return Status::error(
          fmt::format("{}: cannot carry it into the new outputs folder: {}", from, ec.message()));
  }
  nlohmann::ordered_json manifest;
  manifest["run"] = run;
  manifest["files"] = nlohmann::ordered_json::array();
  for (const std::string &name : files) {
    std::vector<uint8_t> bytes;
    if (Status s = readWholeFile(staging + "/" + name, &bytes); !s)
      return s;
    manifest["files"].push_back(
        {{"name", name}, {"bytes", bytes.size()}, {"crc32", crcText(bytes)}});
  }
  const std::string text = manifest.dump(2) + "\n";
  if (Status s = writeFileAtomically(staging + "/" + kRunManifest, {{text.data(), text.size()}});
      !s)
    return s;
  // Swapped in at once: a reader sees the earlier run's folder or this one,
  // never a mix; then the earlier one (now at the new folder's name) goes.
  if (::syscall(SYS_renameat2, AT_FDCWD, staging.c_str(), AT_FDCWD, target.c_str(),
                RENAME_EXCHANGE) != 0)
    return Status::error(fmt::format("{}: cannot put the new outputs folder in its place: {}", dir,
                                     std::strerror(errno)));
  if (int parent = ::open(std::filesystem::path(target).parent_path().c_str(),
                          O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      parent >= 0) {
    ::fsync(parent);
    ::close(parent);
  }
  created = false; // the run's folder now
  return Status::success();
}

Status checkRunManifest(const std::string &dir, std::optional<std::set<std::string>> *listed) {
  const std::string path = dir + "/" + kRunManifest;
  std::error_code ec;
  if (listed)
    listed->reset();
  if (!std::filesystem::is_directory(dir, ec))
    return Status::error(fmt::format("{}: {}", dir,
                                     std::filesystem::exists(dir, ec)
                                         ? "is not a folder; --inputs takes the folder of a run"
                                         : "no such folder"));
  if (!std::filesystem::exists(path, ec))
    return Status::error(fmt::format(
        "{}: has no {}, so it is not a folder that a moec run wrote whole (a run killed while "
        "it wrote, or files made by hand or by another tool); if you made it, say so with "
        "--hand-made (the files are then read as they are)",
        dir, kRunManifest));
  std::vector<uint8_t> text;
  if (Status s = readWholeFile(path, &text, kMaxTextBytes); !s)
    return s;
  std::set<std::string> names;
  const nlohmann::json manifest = nlohmann::json::parse(text.begin(), text.end(), nullptr, false);
  if (!manifest.is_object() || !manifest.contains("files") || !manifest["files"].is_array())
    return Status::error(path + ": not a run manifest (an object with a 'files' list)");
  for (const nlohmann::json &file : manifest["files"]) {
    if (!file.is_object() || !file.contains("name") || !file["name"].is_string() ||
        !file.contains("crc32") || !file["crc32"].is_string() || !file.contains("bytes") ||
        !file["bytes"].is_number_unsigned())
      return Status::error(path + ": a 'files' entry lacks its 'name', 'bytes' or 'crc32'");
    const std::string name = file["name"].get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      return Status::error(
          fmt::format("{}: lists '{}', which is not the name of a file in the folder", path, name));
    names.insert(name);
    std::vector<uint8_t> bytes;
    if (Status s = readWholeFile(dir + "/" + name, &bytes); !s)
      return s.withPrefix(path + " lists " + name + ", but ");
    if (bytes.size() != file["bytes"].get<uint64_t>())
      return Status::error(fmt::format(
          "{}/{}: holds {} bytes; {} says {}: the file was cut short or changed after its run; "
          "to use the files as they are, give --hand-made",
          dir, name, bytes.size(), kRunManifest, file["bytes"].get<uint64_t>()));
    if (crcText(bytes) != file["crc32"].get<std::string>())
      return Status::error(fmt::format(
          "{}/{}: does not match {} (CRC-32 {}, the manifest says {}): the folder mixes files of "
          "two runs, or one was changed after its run; to use the files as they are, give "
          "--hand-made",
          dir, name, kRunManifest, crcText(bytes), file["crc32"].get<std::string>()));
  }
  if (listed)
    *listed = std::move(names);
  return Status::success();
}

} // namespace moec::tooling
