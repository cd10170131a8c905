#include "worker/control.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace hearth::control {
namespace {

constexpr size_t kHeader = 4 + 4 + 8 + 8 + 8 + 8 + 4 + 4;
constexpr size_t kMaxText = 4096;

template <typename T>
void Put(std::vector<char>& b, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  b.insert(b.end(), p, p + sizeof v);
}
template <typename T>
T Get(const char*& p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  p += sizeof v;
  return v;
}

}  // namespace

Status Send(int fd, const Message& m) {
  std::vector<char> b;
  const uint32_t text_len = static_cast<uint32_t>(std::min(m.text.size(), kMaxText));
  Put(b, kMagic);
  Put(b, static_cast<uint32_t>(m.kind));
  Put(b, m.seq);
  Put(b, m.batch);
  Put(b, m.device_memory_bytes);
  Put(b, m.run_us);
  Put(b, m.status_code);
  Put(b, text_len);
  b.insert(b.end(), m.text.data(), m.text.data() + text_len);
  for (;;) {
    if (::send(fd, b.data(), b.size(), MSG_NOSIGNAL) >= 0) return Status::Ok();
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET) return Unavailable("control channel closed");
    return ErrnoError("control send", errno);
  }
}

Result<Message> Receive(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    const int n = ::poll(&p, 1, timeout_ms);
    if (n > 0) break;
    if (n == 0) return FailedPrecondition("timeout");
    if (errno != EINTR) return ErrnoError("control poll", errno);
  }
  char buf[kHeader + kMaxText];
  ssize_t n;
  do {
    n = ::recv(fd, buf, sizeof buf, 0);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno == ECONNRESET)) return Unavailable("control channel closed");
  if (n < 0) return ErrnoError("control receive", errno);
  if (static_cast<size_t>(n) < kHeader) return InvalidArgument("short control message");
  const char* q = buf;
  if (Get<uint32_t>(q) != kMagic) return InvalidArgument("bad control message magic");
  Message m;
  m.kind = static_cast<Kind>(Get<uint32_t>(q));
  m.seq = Get<uint64_t>(q);
  m.batch = Get<int64_t>(q);
  m.device_memory_bytes = Get<uint64_t>(q);
  m.run_us = Get<uint64_t>(q);
  m.status_code = Get<uint32_t>(q);
  const uint32_t len = Get<uint32_t>(q);
  if (len != static_cast<size_t>(n) - kHeader) return InvalidArgument("control message length mismatch");
  if (m.kind != Kind::kReady && m.kind != Kind::kRun && m.kind != Kind::kDone)
    return InvalidArgument("unknown control message kind");
  m.text.assign(q, len);
  return m;
}

SlotLayout SlotLayout::Make(const std::vector<uint64_t>& in, const std::vector<uint64_t>& out,
                            int max_batch) {
  SlotLayout l;
  l.input_bytes_per_sample = in;
  l.output_bytes_per_sample = out;
  uint64_t off = 0;
  auto place = [&](uint64_t per_sample) {
    off = (off + 63) & ~uint64_t{63};
    const uint64_t at = off;
    off += per_sample * static_cast<uint64_t>(max_batch);
    return at;
  };
  for (uint64_t b : in) l.input_offsets.push_back(place(b));
  for (uint64_t b : out) l.output_offsets.push_back(place(b));
  l.total = (off + 4095) & ~uint64_t{4095};
  if (l.total == 0) l.total = 4096;
  return l;
}

}  // namespace hearth::control
