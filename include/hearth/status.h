// Status and Result<T>: how every fallible call in hearth reports failure.
//
// A Status is either OK or carries a code and a message that names what went
// wrong (the file, the tensor, the field). Result<T> holds a value or a
// non-OK Status. Both are cheap to move and [[nodiscard]]. Exceptions never
// cross a module, process or C ABI boundary; these types do.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace hearth {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,   // the caller (or a file, or a peer) gave something malformed
  kNotFound,          // no such model, version, tensor or file
  kAlreadyExists,
  kPermissionDenied,  // peer credentials or file permissions refuse the request
  kUnavailable,       // a resource (GPU, driver, store) is not there
  kResourceExhausted, // out of memory, descriptors, or a size limit
  kFailedPrecondition,
  kInternal,          // a system call or driver call failed unexpectedly
  kUnimplemented,
  kDeadlineExceeded,  // a request's time ran out before it ran
  kDeviceLost,        // a sticky device fault: the process's GPU context is unusable
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "CODE: message", or "OK".
  std::string ToString() const;

  // Returns a copy whose message is "context: message"; OK stays OK.
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

Status InvalidArgument(std::string message);
Status NotFound(std::string message);
Status AlreadyExists(std::string message);
Status PermissionDenied(std::string message);
Status Unavailable(std::string message);
Status ResourceExhausted(std::string message);
Status FailedPrecondition(std::string message);
Status Internal(std::string message);
Status Unimplemented(std::string message);
Status DeadlineExceeded(std::string message);
Status DeviceLost(std::string message);
// Internal error with strerror(errnum) appended: "what: No such file or directory".
Status ErrnoError(std::string_view what, int errnum);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = Internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace hearth

#define HEARTH_CONCAT_INNER(a, b) a##b
#define HEARTH_CONCAT(a, b) HEARTH_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                       \
  do {                                              \
    ::hearth::Status hearth_status_ = (expr);       \
    if (!hearth_status_.ok()) return hearth_status_; \
  } while (0)

#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()

// ASSIGN_OR_RETURN(auto x, MakeX()); declares x or returns MakeX()'s error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(HEARTH_CONCAT(hearth_result_, __LINE__), lhs, expr)
