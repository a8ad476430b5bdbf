//===- Env.h - The environment variables moec reads --------------*- C++ -*-===//
//
// One rule for every MOEC_* variable (and the few others the runtime reads):
// unset and empty are the same, the default; a value in a message is shown
// as the user gave it, cut to 200 characters, control characters escaped.
// The torch op's Python side follows the same rule (moec_torch.checks).
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_ENV_H
#define MOEC_BASE_ENV_H

#include <cstdio>
#include <cstdlib>
#include <string>

namespace moec {

/// The value of environment variable `name`, or null when it is unset or
/// empty.
inline const char *envValue(const char *name) {
  const char *value = std::getenv(name);
  return value && *value ? value : nullptr;
}

/// NAME='value' for a message: at most 200 characters of the value (then
/// "... (N characters)"), control characters as \xNN.
inline std::string envShown(const char *name, const char *value) {
  constexpr size_t kShown = 200;
  std::string text = std::string(name) + "='";
  size_t n = 0;
  for (; value[n] && n < kShown; ++n) {
    const unsigned char c = static_cast<unsigned char>(value[n]);
    if (c < 0x20 || c == 0x7f) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", c);
      text += escaped;
    } else {
      text += char(c);
    }
  }
  text += "'";
  if (value[n]) {
    size_t total = n;
    while (value[total])
      ++total;
    text += "... (" + std::to_string(total) + " characters)";
  }
  return text;
}

/// Whether a switch of two values, `auto` (the default) and `off`, allows
/// what it switches: false for "off"; any other value than "auto" prints a
/// warning to stderr and means auto.
inline bool envAutoOrOff(const char *name) {
  const char *value = envValue(name);
  if (value && std::string(value) == "off")
    return false;
  if (value && std::string(value) != "auto")
    std::fprintf(stderr, "moec: %s is neither 'auto' nor 'off'; using 'auto'\n",
                 envShown(name, value).c_str());
  return true;
}

} // namespace moec

#endif // MOEC_BASE_ENV_H
