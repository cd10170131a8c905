// A local channel between the store and its clients on Windows: a named pipe
// per user, whose both ends check that the other is the same user, as
// SO_PEERCRED lets the Unix socket's ends do on Linux (common/trusted_path.h;
// the Linux store and attach client keep their socket code for now).
//
//   - The pipe is \\.\pipe\hearth-<user SID>-<name>, created with
//     FILE_FLAG_FIRST_PIPE_INSTANCE (a name someone else created first is
//     refused: no squatting), PIPE_REJECT_REMOTE_CLIENTS, and a security
//     descriptor that admits only this user.
//   - The listener checks each client: GetNamedPipeClientProcessId, then
//     that process's token user; a client of another user is dropped.
//   - A client checks the server the same way (GetNamedPipeServerProcessId)
//     before it trusts anything it says, so that an impostor pipe of
//     another user is refused.
//   - Messages are frames: a 4-byte little-endian length, then that many
//     bytes, at most the receiver's limit; a frame over it fails the
//     channel, naming it.
//
// Thread-safety: one thread per Channel and per Listener.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"
#include "platform/identity.h"
#include "platform/section.h"

namespace hearth::platform {

// \\.\pipe\hearth-<user>-<name>; `name` of 1 to 64 of [A-Za-z0-9._-].
Result<std::string> PipePath(std::string_view name);

class Channel {
 public:
  Channel(Channel&& other) noexcept;
  Channel& operator=(Channel&& other) noexcept;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  ~Channel();

  Status Send(std::span<const std::byte> frame);
  // The next frame, of at most `max_bytes`.
  Result<std::vector<std::byte>> Receive(uint32_t max_bytes);
  // The peer's process id, from the kernel (never from the peer's words).
  uint32_t peer_pid() const { return peer_pid_; }

 private:
  friend class Listener;
  friend Result<Channel> Connect(std::string_view name);
  Channel(NativeHandle pipe, uint32_t peer_pid) : pipe_(pipe), peer_pid_(peer_pid) {}
  Status ReadExactly(std::byte* p, size_t n);

  NativeHandle pipe_ = kNoHandle;
  uint32_t peer_pid_ = 0;
};

class Listener {
 public:
  // Creates the pipe's first instance; FailedPrecondition naming the pipe
  // when another process holds the name already.
  static Result<Listener> Listen(std::string_view name);
  Listener(Listener&& other) noexcept;
  Listener& operator=(Listener&& other) noexcept;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  ~Listener();

  // Waits for the next client and checks its user: PermissionDenied (and
  // the client dropped) for another user's.
  Result<Channel> Accept();

 private:
  Listener(std::string path, NativeHandle next) : path_(std::move(path)), next_(next) {}
  Status MakeInstance(bool first);

  std::string path_;
  NativeHandle next_ = kNoHandle;  // the instance the next client connects to
};

// Connects to the listener of `name` and checks that it runs as this user.
Result<Channel> Connect(std::string_view name);

}  // namespace hearth::platform
