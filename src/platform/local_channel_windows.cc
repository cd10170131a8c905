// Named pipes with checked peers (local_channel.h).
#include <windows.h>
// after windows.h, which it needs
#include <sddl.h>

#include <array>
#include <cstring>
#include <utility>

#include "platform/local_channel.h"
#include "platform/windows_error.h"

namespace hearth::platform {
namespace {

constexpr DWORD kPipeBuffer = 64 * 1024;
// How long Connect waits for a busy pipe's next instance, in all.
constexpr DWORD kConnectWaitMs = 10000;

bool NameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// The peer must run as this process's user.
Status CheckPeer(uint32_t pid, const char* role) {
  ASSIGN_OR_RETURN(const std::string ours, CurrentUser());
  Result<std::string> theirs = ProcessUser(pid);
  if (!theirs.ok())
    return PermissionDenied(std::string("the pipe's ") + role + " (process " + std::to_string(pid) +
                            ") cannot be identified: " + theirs.status().message());
  if (*theirs != ours)
    return PermissionDenied(std::string("the pipe's ") + role + " (process " + std::to_string(pid) +
                            ") runs as " + *theirs + ", not as " + ours);
  return Status::Ok();
}

}  // namespace

Result<std::string> PipePath(std::string_view name) {
  if (name.empty() || name.size() > 64)
    return InvalidArgument("a pipe name has 1 to 64 characters, not " +
                           std::to_string(name.size()));
  for (char c : name)
    if (!NameChar(c))
      return InvalidArgument("a pipe name is made of [A-Za-z0-9._-]: '" + std::string(name) + "'");
  ASSIGN_OR_RETURN(const std::string user, CurrentUser());
  return "\\\\.\\pipe\\hearth-" + user + "-" + std::string(name);
}

// ---- Channel

Channel::Channel(Channel&& other) noexcept
    : pipe_(std::exchange(other.pipe_, kNoHandle)), peer_pid_(other.peer_pid_) {}

Channel& Channel::operator=(Channel&& other) noexcept {
  if (this != &other) {
    CloseHandle(pipe_);
    pipe_ = std::exchange(other.pipe_, kNoHandle);
    peer_pid_ = other.peer_pid_;
  }
  return *this;
}

Channel::~Channel() { CloseHandle(pipe_); }

Status Channel::Send(std::span<const std::byte> frame) {
  if (frame.size() > 0x7fffffffu)
    return InvalidArgument("a frame of " + std::to_string(frame.size()) + " bytes is too large");
  const auto n = static_cast<uint32_t>(frame.size());
  const std::array<unsigned char, 4> length = {
      static_cast<unsigned char>(n), static_cast<unsigned char>(n >> 8),
      static_cast<unsigned char>(n >> 16), static_cast<unsigned char>(n >> 24)};
  const auto write = [&](const void* p, size_t bytes) -> Status {
    const auto* at = static_cast<const char*>(p);
    while (bytes > 0) {
      DWORD written = 0;
      const DWORD chunk = static_cast<DWORD>(bytes < kPipeBuffer ? bytes : kPipeBuffer);
      if (!::WriteFile(pipe_, at, chunk, &written, nullptr) || written == 0)
        return Unavailable(LastError("writing to the pipe"));
      at += written;
      bytes -= written;
    }
    return Status::Ok();
  };
  RETURN_IF_ERROR(write(length.data(), length.size()));
  return write(frame.data(), frame.size());
}

Status Channel::ReadExactly(std::byte* p, size_t n) {
  while (n > 0) {
    DWORD got = 0;
    const DWORD chunk = static_cast<DWORD>(n < kPipeBuffer ? n : kPipeBuffer);
    if (!::ReadFile(pipe_, p, chunk, &got, nullptr) || got == 0)
      return Unavailable(LastError("reading from the pipe"));
    p += got;
    n -= got;
  }
  return Status::Ok();
}

Result<std::vector<std::byte>> Channel::Receive(uint32_t max_bytes) {
  std::array<std::byte, 4> length{};
  RETURN_IF_ERROR(ReadExactly(length.data(), length.size()));
  const uint32_t n = static_cast<uint32_t>(length[0]) | static_cast<uint32_t>(length[1]) << 8 |
                     static_cast<uint32_t>(length[2]) << 16 |
                     static_cast<uint32_t>(length[3]) << 24;
  if (n > max_bytes) {
    CloseHandle(pipe_);  // the rest of the stream cannot be framed any more
    pipe_ = kNoHandle;
    return InvalidArgument("a frame of " + std::to_string(n) + " bytes, more than the limit of " +
                           std::to_string(max_bytes));
  }
  std::vector<std::byte> frame(n);
  RETURN_IF_ERROR(ReadExactly(frame.data(), n));
  return frame;
}

// ---- Listener

Result<Listener> Listener::Listen(std::string_view name) {
  ASSIGN_OR_RETURN(std::string path, PipePath(name));
  Listener l(std::move(path), kNoHandle);
  RETURN_IF_ERROR(l.MakeInstance(/*first=*/true));
  return l;
}

Status Listener::MakeInstance(bool first) {
  // FILE_FLAG_FIRST_PIPE_INSTANCE below is the guard against a name taken
  // first; asking whether any instance answers is a second one, for
  // systems that do not honour the flag (Wine).
  if (first && (::WaitNamedPipeA(path_.c_str(), 1) || ::GetLastError() != ERROR_FILE_NOT_FOUND))
    return FailedPrecondition("the pipe " + path_ +
                              " exists already (another store, or an impostor)");
  ASSIGN_OR_RETURN(const std::string user, CurrentUser());
  const std::string sddl = "D:P(A;;GA;;;" + user + ")";
  PSECURITY_DESCRIPTOR descriptor = nullptr;
  if (!::ConvertStringSecurityDescriptorToSecurityDescriptorA(sddl.c_str(), SDDL_REVISION_1,
                                                              &descriptor, nullptr))
    return Internal(LastError("ConvertStringSecurityDescriptorToSecurityDescriptorA"));
  SECURITY_ATTRIBUTES attributes{sizeof(attributes), descriptor, FALSE};
  const HANDLE pipe = ::CreateNamedPipeA(
      path_.c_str(), PIPE_ACCESS_DUPLEX | (first ? FILE_FLAG_FIRST_PIPE_INSTANCE : 0),
      PIPE_TYPE_BYTE | PIPE_READMODE_BYTE | PIPE_WAIT | PIPE_REJECT_REMOTE_CLIENTS,
      PIPE_UNLIMITED_INSTANCES, kPipeBuffer, kPipeBuffer, 0, &attributes);
  const DWORD error = ::GetLastError();
  ::LocalFree(descriptor);
  if (pipe == INVALID_HANDLE_VALUE) {
    ::SetLastError(error);
    if (first && (error == ERROR_ACCESS_DENIED || error == ERROR_PIPE_BUSY))
      return FailedPrecondition(
          LastError("the pipe " + path_ + " exists already (another store, or an impostor)"));
    return Internal(LastError("CreateNamedPipeA " + path_));
  }
  next_ = pipe;
  return Status::Ok();
}

Listener::Listener(Listener&& other) noexcept
    : path_(std::move(other.path_)), next_(std::exchange(other.next_, kNoHandle)) {}

Listener& Listener::operator=(Listener&& other) noexcept {
  if (this != &other) {
    CloseHandle(next_);
    path_ = std::move(other.path_);
    next_ = std::exchange(other.next_, kNoHandle);
  }
  return *this;
}

Listener::~Listener() { CloseHandle(next_); }

Result<Channel> Listener::Accept() {
  if (next_ == kNoHandle) RETURN_IF_ERROR(MakeInstance(/*first=*/false));
  if (!::ConnectNamedPipe(next_, nullptr) && ::GetLastError() != ERROR_PIPE_CONNECTED)
    return Unavailable(LastError("ConnectNamedPipe " + path_));
  const HANDLE connected = std::exchange(next_, kNoHandle);
  ULONG pid = 0;
  Status checked = ::GetNamedPipeClientProcessId(connected, &pid)
                       ? CheckPeer(static_cast<uint32_t>(pid), "client")
                       : Unavailable(LastError("GetNamedPipeClientProcessId"));
  // The next client's instance before this one is answered.
  const Status next = MakeInstance(/*first=*/false);
  if (!checked.ok()) {
    ::DisconnectNamedPipe(connected);
    ::CloseHandle(connected);
    return checked;
  }
  RETURN_IF_ERROR(next);
  return Channel(connected, static_cast<uint32_t>(pid));
}

// ---- Connect

Result<Channel> Connect(std::string_view name) {
  ASSIGN_OR_RETURN(const std::string path, PipePath(name));
  HANDLE pipe = INVALID_HANDLE_VALUE;
  const DWORD deadline = ::GetTickCount() + kConnectWaitMs;
  for (;;) {
    // Identification only: the server may learn who we are, never act as us.
    pipe = ::CreateFileA(path.c_str(), GENERIC_READ | GENERIC_WRITE, 0, nullptr, OPEN_EXISTING,
                         SECURITY_SQOS_PRESENT | SECURITY_IDENTIFICATION, nullptr);
    if (pipe != INVALID_HANDLE_VALUE) break;
    if (::GetLastError() != ERROR_PIPE_BUSY || ::GetTickCount() >= deadline)
      return Unavailable(LastError("connecting to " + path));
    ::WaitNamedPipeA(path.c_str(), 1000);
  }
  ULONG pid = 0;
  Status checked = ::GetNamedPipeServerProcessId(pipe, &pid)
                       ? CheckPeer(static_cast<uint32_t>(pid), "server")
                       : Unavailable(LastError("GetNamedPipeServerProcessId"));
  if (!checked.ok()) {
    ::CloseHandle(pipe);
    return checked;
  }
  return Channel(pipe, static_cast<uint32_t>(pid));
}

}  // namespace hearth::platform
