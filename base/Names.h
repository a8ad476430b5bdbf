//===- Names.h - Enum values and their names, as one table ------*- C++ -*-===//
//
// An enum's names live in one table of {value, name} pairs beside the enum,
// and every lookup (value to name for messages and dumps, name to value for
// parsers) reads that table, instead of a switch per direction that can
// drift from the other.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_NAMES_H
#define MOEC_BASE_NAMES_H

#include <cstddef>
#include <optional>
#include <string_view>

namespace moec {

/// One value of an enum and its name.
template <class E> struct Named {
  E value;
  const char *name;
};

/// The name of `value` in `table`, or `unknown` when the table lacks it.
template <class E, size_t N>
constexpr const char *nameIn(const Named<E> (&table)[N], E value,
                             const char *unknown = "unknown") {
  for (const Named<E> &n : table)
    if (n.value == value)
      return n.name;
  return unknown;
}

/// The value named `name` in `table`, or nothing.
template <class E, size_t N>
constexpr std::optional<E> valueIn(const Named<E> (&table)[N], std::string_view name) {
  for (const Named<E> &n : table)
    if (name == n.name)
      return n.value;
  return std::nullopt;
}

} // namespace moec

#endif // MOEC_BASE_NAMES_H
