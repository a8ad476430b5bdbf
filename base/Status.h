//===- Status.h - Success or an error message ------------------*- C++ -*-===//
//
// The result type of the runtime's fallible calls: success, or an error with
// a message for a person. Results travel through out-parameters, so a call
// looks like `Status status = readTaskBinary(data, size, &program);`. Nothing
// in the runtime exits or aborts on bad input; it returns a Status.
//
//===----------------------------------------------------------------------===//

#ifndef MOEC_BASE_STATUS_H
#define MOEC_BASE_STATUS_H

#include <cstdint>
#include <string>
#include <utility>

namespace moec {

/// What kind of error a Status is, for a caller that acts on it.
enum class StatusCode : uint8_t {
  Ok = 0,
  Error = 1,        ///< anything else: the message says what
  OverCapacity = 2, ///< a routing needs more rows than the binary was compiled
                    ///< for (the runtime's Context::capacityNeed() says how many)
};

/// Success, or an error that carries a message. A default-constructed Status
/// is a success.
class [[nodiscard]] Status {
public:
  /// Creates a success.
  Status() = default;

  /// Returns a success.
  static Status success() { return Status(); }

  /// Returns an error whose message is `message` (which should not be empty;
  /// an empty message is replaced by "unknown error").
  static Status error(std::string message, StatusCode code = StatusCode::Error) {
    Status status;
    status.kind = code == StatusCode::Ok ? StatusCode::Error : code;
    status.text = message.empty() ? std::string("unknown error") : std::move(message);
    return status;
  }

  /// Returns true for a success.
  bool ok() const { return kind == StatusCode::Ok; }

  /// Returns the kind of error (StatusCode::Ok for a success).
  StatusCode code() const { return kind; }

  /// Returns true for a success, so that `if (!status)` tests for an error.
  explicit operator bool() const { return ok(); }

  /// Returns the error message; empty for a success.
  const std::string &message() const { return text; }

  /// Returns an error whose message is `prefix` followed by this error's
  /// message, e.g. a file name and ": "; a success is returned unchanged.
  Status withPrefix(const std::string &prefix) const {
    return ok() ? *this : error(prefix + text, kind);
  }

private:
  StatusCode kind = StatusCode::Ok;
  std::string text;
};

} // namespace moec

#endif // MOEC_BASE_STATUS_H
