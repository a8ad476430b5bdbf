//===- Cli.cpp - the argument library of the moec commands ----------------===//

#include "tools/moec/Cli.h"

#include "base/File.h"

#include <cstdio>

namespace moec::cli {

std::optional<std::string> Args::value(const std::string &flag) const {
  auto it = values.find(flag);
  if (it == values.end())
    return std::nullopt;
  return it->second;
}

static bool contains(const std::vector<std::string> &v, const std::string &s) {
  for (const std::string &e : v)
    if (e == s)
      return true;
  return false;
}

std::optional<Args> parseArgs(const CommandSpec &spec, int argc, char **argv, int first) {
  Args args;
  auto usageError = [&](const std::string &msg) -> std::optional<Args> {
    std::fprintf(stderr, "moec %s: %s\nusage: %s\n(see 'moec %s --help')\n", spec.name,
                 msg.c_str(), spec.usage, spec.name);
    return std::nullopt;
  };
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      args.help = true;
      return args;
    }
    if (a.size() > 1 && a[0] == '-') {
      std::string flag = a, value;
      bool inlineValue = false;
      if (auto eq = a.find('='); eq != std::string::npos && a.rfind("--", 0) == 0) {
        flag = a.substr(0, eq);
        value = a.substr(eq + 1);
        inlineValue = true;
      }
      if (contains(spec.valueFlags, flag)) {
        if (!inlineValue) {
          if (i + 1 >= argc)
            return usageError("option '" + flag + "' needs a value");
          value = argv[++i];
        }
        args.values[flag] = value;
      } else if (contains(spec.switchFlags, flag) && !inlineValue) {
        args.switches[flag] = true;
      } else {
        return usageError("unknown option '" + a + "'");
      }
      continue;
    }
    args.positional.push_back(a);
  }
  if (args.positional.size() < spec.minPositional)
    return usageError("missing argument");
  if (args.positional.size() > spec.maxPositional)
    return usageError("unexpected argument '" + args.positional.back() + "'");
  return args;
}

int checkOutputs(const CommandSpec &spec, const Args &args,
                 const std::vector<std::string> &moreInputs,
                 const std::vector<std::pair<std::string, std::string>> &moreOutputs) {
  const auto usageError = [&](const std::string &message) {
    std::fprintf(stderr, "moec %s: %s\n", spec.name, message.c_str());
    return int(kUsage);
  };
  std::vector<std::string> inputs = args.positional;
  for (size_t i = 0; i < args.positional.size(); ++i)
    if (args.positional[i].empty())
      return usageError("argument " + std::to_string(i + 1) +
                        " is an empty path, which names no file");
  for (const std::string &flag : spec.inputFlags)
    if (std::optional<std::string> path = args.value(flag)) {
      if (path->empty())
        return usageError(flag + " needs a path; the path given is empty");
      inputs.push_back(*path);
    }
  inputs.insert(inputs.end(), moreInputs.begin(), moreInputs.end());
  std::vector<std::pair<std::string, std::string>> outputs;
  for (const std::string &flag : spec.outputFlags)
    if (std::optional<std::string> path = args.value(flag))
      outputs.push_back({flag, *path});
  outputs.insert(outputs.end(), moreOutputs.begin(), moreOutputs.end());
  // Standard output carries every command's report or result.
  outputs.push_back({"standard output", "-"});
  for (const auto &[what, path] : outputs) {
    if (Status s = checkOutputPath(what, path, inputs); !s)
      return usageError(s.message());
    if (Status s = checkWritable(path); !s) {
      std::fprintf(stderr, "moec %s: %s %s\n", spec.name, what.c_str(), s.message().c_str());
      return kError;
    }
  }
  return kOk;
}

void printHelp(const CommandSpec &spec) {
  std::printf("usage: %s\n\n%s", spec.usage, spec.help);
}

bool writeOutput(const std::string &path, const std::string &content) {
  if (path == "-") {
    // A failed write to standard output is reported when the command ends
    // (main checks the stream).
    std::fwrite(content.data(), 1, content.size(), stdout);
    return true;
  }
  if (Status s = writeFileAtomically(path, {{content.data(), content.size()}}); !s) {
    std::fprintf(stderr, "error: %s\n", s.message().c_str());
    return false;
  }
  return true;
}

} // namespace moec::cli
