// The wire format's transport on Linux (protocol/wire.h): frames over an
// AF_UNIX SOCK_SEQPACKET socket, a descriptor riding with SCM_RIGHTS. The
// frames themselves (EncodeFrames, FrameAssembler) are wire.cc's, for every
// system.
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/checked_size.h"
#include "protocol/wire.h"

namespace hearth::protocol {

ssize_t SendFrameOnce(int socket, std::span<const std::byte> frame, int pass_fd, int flags) {
  iovec iov{const_cast<std::byte*>(frame.data()), frame.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (pass_fd >= 0) {
    std::memset(control, 0, sizeof control);
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  }
  return ::sendmsg(socket, &msg, flags | MSG_NOSIGNAL);
}

namespace {

Status SendFrame(int socket, std::span<const std::byte> frame, int pass_fd) {
  for (;;) {
    if (SendFrameOnce(socket, frame, pass_fd, 0) >= 0) return Status::Ok();
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET)
      return Unavailable(std::string("send: the peer closed the connection (") +
                         std::strerror(errno) + ")");
    return ErrnoError("send", errno);
  }
}

}  // namespace

Status SendMessage(int socket, MessageType type, std::span<const std::byte> payload, int pass_fd) {
  if (payload.size() > kMaxMessageBytes)
    return ResourceExhausted("message of " + std::to_string(payload.size()) +
                             " bytes exceeds the protocol limit");
  const auto frames = EncodeFrames(type, payload);
  for (size_t i = 0; i < frames.size(); ++i) {
    RETURN_IF_ERROR(SendFrame(socket, frames[i], i == 0 ? pass_fd : -1));
  }
  return Status::Ok();
}

Result<size_t> ReceiveFrame(int socket, std::span<std::byte> buffer, UniqueFd* fd,
                            bool* would_block) {
  *would_block = false;
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for a few descriptors: a peer that sends more than one gets them all closed.
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  for (;;) {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n >= 0) break;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      *would_block = true;
      return size_t{0};
    }
    if (errno == ECONNRESET) return Unavailable("connection reset by the peer");
    return ErrnoError("receive", errno);
  }
  std::vector<UniqueFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int f;
        std::memcpy(&f, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.emplace_back(f);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) return InvalidArgument("too many descriptors in one frame");
  if (msg.msg_flags & MSG_TRUNC)
    return InvalidArgument("frame larger than " + std::to_string(buffer.size()) + " bytes");
  if (n == 0 && fds.empty()) return Unavailable("connection closed");
  if (fds.size() > 1) return InvalidArgument("more than one descriptor in one frame");
  if (fds.size() == 1) *fd = std::move(fds[0]);
  return static_cast<size_t>(n);
}

Result<Message> ReceiveMessage(int socket, std::chrono::milliseconds timeout) {
  std::vector<std::byte> buffer(kFrameHeaderBytes + kMaxFramePayload + 1);
  FrameAssembler assembler;
  using Clock = std::chrono::steady_clock;
  const bool bounded = timeout.count() >= 0;
  const Clock::time_point deadline =
      bounded
          ? SaturatingDeadline<Clock>(
                Clock::now(),
                static_cast<uint64_t>(std::min<int64_t>(timeout.count(), int64_t{1} << 40)) * 1000)
          : Clock::time_point::max();
  for (;;) {
    UniqueFd fd;
    bool would_block = false;
    ASSIGN_OR_RETURN(size_t n, ReceiveFrame(socket, buffer, &fd, &would_block));
    if (would_block) {
      int wait_ms = -1;
      if (bounded) {
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0)
          return DeadlineExceeded("no complete message within " + std::to_string(timeout.count()) +
                                  " ms");
        wait_ms = static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
      }
      pollfd p{socket, POLLIN, 0};
      if (::poll(&p, 1, wait_ms) < 0 && errno != EINTR) return ErrnoError("poll", errno);
      continue;
    }
    ASSIGN_OR_RETURN(bool done, assembler.Add(std::span(buffer.data(), n), std::move(fd)));
    if (done) return assembler.TakeMessage();
  }
}

}  // namespace hearth::protocol
