#include "worker/control.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

#include "common/checked_size.h"

namespace hearth::control {
namespace {

constexpr size_t kHeader = 4 + 4 + 8 + 8 + 8 + 8 + 4 + 4;
constexpr size_t kMaxText = 4096;
constexpr uint64_t kSizeLimit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

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

// The fixed header, then `text` (at most `text_limit` bytes of it).
std::vector<char> Encode(const Message& m, size_t text_limit) {
  std::vector<char> b;
  const uint32_t text_len = static_cast<uint32_t>(std::min(m.text.size(), text_limit));
  b.reserve(kHeader + text_len);
  Put(b, kMagic);
  Put(b, static_cast<uint32_t>(m.kind));
  Put(b, m.seq);
  Put(b, m.batch);
  Put(b, m.device_memory_bytes);
  Put(b, m.run_us);
  Put(b, m.status_code);
  Put(b, text_len);
  b.insert(b.end(), m.text.data(), m.text.data() + text_len);
  return b;
}

Status SendPacket(int fd, const std::vector<char>& b) {
  for (;;) {
    if (::send(fd, b.data(), b.size(), MSG_NOSIGNAL) >= 0) return Status::Ok();
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET) return Unavailable("control channel closed");
    return ErrnoError("control send", errno);
  }
}

Status WaitReadable(int fd, int timeout_ms) {
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    const int n = ::poll(&p, 1, timeout_ms);
    if (n > 0) return Status::Ok();
    if (n == 0) return FailedPrecondition("timeout");
    if (errno != EINTR) return ErrnoError("control poll", errno);
  }
}

// One packet into buf[0, capacity); its real length, which MSG_TRUNC reports
// even when the packet did not fit (then it is an error).
Result<size_t> ReceivePacket(int fd, char* buf, size_t capacity) {
  ssize_t n;
  do {
    n = ::recv(fd, buf, capacity, MSG_TRUNC);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno == ECONNRESET)) return Unavailable("control channel closed");
  if (n < 0) return ErrnoError("control receive", errno);
  if (static_cast<size_t>(n) > capacity)
    return InvalidArgument("control message of " + std::to_string(n) +
                           " bytes is over the limit of " + std::to_string(capacity));
  return static_cast<size_t>(n);
}

Result<Message> Decode(const char* buf, size_t n) {
  if (n < kHeader) return InvalidArgument("short control message");
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
  if (len != n - kHeader) return InvalidArgument("control message length mismatch");
  m.text.assign(q, len);
  return m;
}

}  // namespace

Status Send(int fd, const Message& m) { return SendPacket(fd, Encode(m, kMaxText)); }

Result<Message> Receive(int fd, int timeout_ms) {
  RETURN_IF_ERROR(WaitReadable(fd, timeout_ms));
  char buf[kHeader + kMaxText];
  ASSIGN_OR_RETURN(size_t n, ReceivePacket(fd, buf, sizeof buf));
  ASSIGN_OR_RETURN(Message m, Decode(buf, n));
  if (m.kind != Kind::kReady && m.kind != Kind::kRun && m.kind != Kind::kDone)
    return InvalidArgument("unknown control message kind");
  return m;
}

Status SendParameters(int fd, const std::map<std::string, std::string>& parameters) {
  Message m;
  m.kind = Kind::kParameters;
  uint64_t bytes = 4;
  for (const auto& [k, v] : parameters) bytes += 8 + k.size() + v.size();
  if (bytes > kMaxParametersPayload)
    return InvalidArgument("parameters: " + std::to_string(parameters.size()) +
                           " parameters encode to " + std::to_string(bytes) +
                           " bytes, over the limit of " + std::to_string(kMaxParametersPayload));
  auto put32 = [&](uint32_t v) { m.text.append(reinterpret_cast<const char*>(&v), sizeof v); };
  m.text.reserve(bytes);
  put32(static_cast<uint32_t>(parameters.size()));
  for (const auto& [k, v] : parameters) {
    put32(static_cast<uint32_t>(k.size()));
    m.text += k;
    put32(static_cast<uint32_t>(v.size()));
    m.text += v;
  }
  return SendPacket(fd, Encode(m, kMaxParametersPayload));
}

Result<std::map<std::string, std::string>> ReceiveParameters(int fd, int timeout_ms) {
  RETURN_IF_ERROR(WaitReadable(fd, timeout_ms));
  std::vector<char> buf(kHeader + kMaxParametersPayload);
  ASSIGN_OR_RETURN(size_t n, ReceivePacket(fd, buf.data(), buf.size()));
  ASSIGN_OR_RETURN(Message m, Decode(buf.data(), n));
  if (m.kind != Kind::kParameters)
    return InvalidArgument("expected the parameters message first, got kind " +
                           std::to_string(static_cast<uint32_t>(m.kind)));
  std::string_view rest = m.text;
  auto take32 = [&](uint32_t* v) {
    if (rest.size() < sizeof *v) return false;
    std::memcpy(v, rest.data(), sizeof *v);
    rest.remove_prefix(sizeof *v);
    return true;
  };
  auto take = [&](std::string* s) {
    uint32_t len;
    if (!take32(&len) || len > rest.size()) return false;
    s->assign(rest.substr(0, len));
    rest.remove_prefix(len);
    return true;
  };
  uint32_t count;
  if (!take32(&count)) return InvalidArgument("parameters message: no count");
  std::map<std::string, std::string> parameters;
  for (uint32_t i = 0; i < count; ++i) {
    std::string k, v;
    if (!take(&k) || !take(&v))
      return InvalidArgument("parameters message: parameter " + std::to_string(i) + " of " +
                             std::to_string(count) + " runs past the end of the message");
    parameters[std::move(k)] = std::move(v);
  }
  if (!rest.empty()) return InvalidArgument("parameters message: bytes after the last parameter");
  return parameters;
}

Result<SlotLayout> SlotLayout::Make(const std::vector<SlotTensor>& in,
                                    const std::vector<SlotTensor>& out, int max_batch) {
  if (max_batch < 1)
    return InvalidArgument("slot: max_batch " + std::to_string(max_batch) + " is below 1");
  SlotLayout l;
  uint64_t off = 0;
  auto place = [&](const SlotTensor& t, const char* what, std::vector<uint64_t>* offsets,
                   std::vector<uint64_t>* per_sample) -> Status {
    const std::string name = std::string(what) + " '" + t.name + "'";
    ASSIGN_OR_RETURN(uint64_t bytes,
                     CountBytes(t.bytes_per_sample, static_cast<uint64_t>(max_batch),
                                name + " for a batch of " + std::to_string(max_batch)));
    const auto at = CheckedAlignUp(off, 64);
    const auto end = at ? CheckedAdd(*at, bytes) : std::nullopt;
    if (!end || *end > kSizeLimit)
      return InvalidArgument("slot: " + name + " of " + std::to_string(bytes) +
                             " bytes at offset " + std::to_string(off) +
                             " would end past 2^63 bytes");
    offsets->push_back(*at);
    per_sample->push_back(t.bytes_per_sample);
    off = *end;
    return Status::Ok();
  };
  for (const SlotTensor& t : in)
    RETURN_IF_ERROR(place(t, "input", &l.input_offsets, &l.input_bytes_per_sample));
  for (const SlotTensor& t : out)
    RETURN_IF_ERROR(place(t, "output", &l.output_offsets, &l.output_bytes_per_sample));
  const auto total = CheckedAlignUp(off, 4096);
  if (!total || *total > kSizeLimit)
    return InvalidArgument("slot: " + std::to_string(off) + " bytes round past 2^63");
  l.total = *total == 0 ? 4096 : *total;
  return l;
}

}  // namespace hearth::control
