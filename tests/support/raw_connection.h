// Test support: a store connection below the attach client, for sending
// what a real client never would (malformed frames, requests it never reads
// the answers to, messages it never finishes).
#pragma once

#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "protocol/messages.h"
#include "protocol/wire.h"

namespace hearth::testing {

class RawConnection {
 public:
  // `nonblocking`: the connect (and later I/O) does not wait; a store whose
  // backlog is full then leaves connected() false instead of blocking.
  explicit RawConnection(const std::string& path, bool nonblocking = false) {
    fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~RawConnection() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  // 0, or the errno of a failed sendmsg.
  int TrySend(const std::vector<std::byte>& bytes, int flags = 0, int pass_fd = -1) {
    return protocol::SendFrameOnce(fd_, bytes, pass_fd, flags) >= 0 ? 0 : errno;
  }
  void SendRaw(const std::vector<std::byte>& bytes, int pass_fd = -1) {
    ASSERT_EQ(TrySend(bytes, 0, pass_fd), 0) << std::strerror(errno);
  }

  // The error the store sent, then checks that the connection is closed.
  // A store that closes while input of ours is still unread makes the first
  // read fail with ECONNRESET; what it sent before closing comes after that.
  std::string ExpectErrorAndClose() {
    auto m = protocol::ReceiveMessage(fd_);
    if (!m.ok() && m.status().message().find("reset") != std::string::npos)
      m = protocol::ReceiveMessage(fd_);
    if (!m.ok()) return "no reply: " + m.status().ToString();
    if (m->type != protocol::MessageType::kError) return "reply was not an error";
    const std::string message = protocol::DecodeError(m->payload).message();
    char b;
    const ssize_t n = ::recv(fd_, &b, 1, 0);
    if (n != 0) return "connection still open after: " + message;
    return message;
  }

  // Bytes the store has sent that this side has not read (SIOCINQ of a
  // SOCK_SEQPACKET socket counts every queued record).
  size_t UnreadBytes() const {
    int n = 0;
    return ::ioctl(fd_, SIOCINQ, &n) == 0 ? static_cast<size_t>(n) : 0;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// One frame with the given header fields and `payload_bytes` zero bytes.
inline std::vector<std::byte> Frame(uint32_t magic, uint16_t version, uint16_t type, uint32_t total,
                                    uint32_t offset, size_t payload_bytes) {
  std::vector<std::byte> f(16 + payload_bytes, std::byte{0});
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) f[at + i] = std::byte((v >> (8 * i)) & 0xff);
  };
  put32(0, magic);
  f[4] = std::byte(version & 0xff);
  f[5] = std::byte(version >> 8);
  f[6] = std::byte(type & 0xff);
  f[7] = std::byte(type >> 8);
  put32(8, total);
  put32(12, offset);
  return f;
}

// The single frame of an attach request for `model`.
inline std::vector<std::byte> AttachFrame(const std::string& model) {
  protocol::AttachRequest req{ModelRef{model, 0}};
  return protocol::EncodeFrames(protocol::MessageType::kAttach, protocol::EncodeAttach(req))[0];
}

}  // namespace hearth::testing
