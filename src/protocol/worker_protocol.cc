#include "protocol/worker_protocol.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string_view>
#include <tuple>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/datatype.h"

namespace hearth::control {
namespace {

constexpr size_t kHeaderBytes = 8;  // magic, kind

class Writer {
 public:
  explicit Writer(Kind kind) {
    U32(kMagic);
    U32(static_cast<uint32_t>(kind));
  }
  void U8(uint8_t v) { Raw(&v, 1); }
  void U32(uint32_t v) { Raw(&v, sizeof v); }
  void U64(uint64_t v) { Raw(&v, sizeof v); }
  void I64(int64_t v) { Raw(&v, sizeof v); }
  void Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void Dims(const std::vector<int64_t>& dims) {
    U32(static_cast<uint32_t>(dims.size()));
    for (int64_t d : dims) I64(d);
  }
  void Specs(const std::vector<TensorSpec>& specs) {
    U32(static_cast<uint32_t>(specs.size()));
    for (const TensorSpec& s : specs) {
      Str(s.name);
      U8(static_cast<uint8_t>(s.dtype));
      Dims(s.dims);
    }
  }
  void Tensors(const std::vector<SlotTensor>& tensors) {
    U32(static_cast<uint32_t>(tensors.size()));
    for (const SlotTensor& t : tensors) {
      U64(t.offset);
      U64(t.bytes);
      Dims(t.shape);
    }
  }
  const std::string& bytes() const { return b_; }

 private:
  void Raw(const void* p, size_t n) { b_.append(static_cast<const char*>(p), n); }
  std::string b_;
};

// Reads a packet front to back; the first fault sticks (ok() turns false)
// and every later read returns zeros, so decoders check once at the end.
class Reader {
 public:
  explicit Reader(std::string_view b) : rest_(b) {}
  uint8_t U8() { return Fixed<uint8_t>(); }
  uint32_t U32() { return Fixed<uint32_t>(); }
  uint64_t U64() { return Fixed<uint64_t>(); }
  int64_t I64() { return Fixed<int64_t>(); }
  std::string Str(size_t limit, const char* what) {
    const uint32_t n = U32();
    if (n > limit) return Fail(std::string(what) + " of " + std::to_string(n) + " bytes");
    if (n > rest_.size()) return Fail(std::string(what) + " runs past the end");
    std::string s(rest_.substr(0, n));
    rest_.remove_prefix(n);
    return s;
  }
  std::vector<int64_t> Dims() {
    const uint32_t n = U32();
    if (n > kMaxRank) {
      Fail("a shape of " + std::to_string(n) + " dimensions");
      return {};
    }
    std::vector<int64_t> dims;
    for (uint32_t i = 0; i < n && ok(); ++i) dims.push_back(I64());
    return dims;
  }
  std::vector<TensorSpec> Specs() {
    const uint32_t n = Count("tensor specs");
    std::vector<TensorSpec> specs;
    for (uint32_t i = 0; i < n && ok(); ++i) {
      TensorSpec s;
      s.name = Str(kMaxNameBytes, "a tensor name");
      const uint8_t dtype = U8();
      if (!IsDType(dtype)) Fail("unknown dtype " + std::to_string(dtype));
      s.dtype = static_cast<DType>(dtype);
      s.dims = Dims();
      specs.push_back(std::move(s));
    }
    return specs;
  }
  std::vector<SlotTensor> Tensors() {
    const uint32_t n = Count("slot tensors");
    std::vector<SlotTensor> tensors;
    for (uint32_t i = 0; i < n && ok(); ++i) {
      SlotTensor t;
      t.offset = U64();
      t.bytes = U64();
      t.shape = Dims();
      tensors.push_back(std::move(t));
    }
    return tensors;
  }
  uint32_t Count(const char* what) {
    const uint32_t n = U32();
    if (n > kMaxTensors) {
      Fail(std::to_string(n) + " " + what + ", over the limit of " + std::to_string(kMaxTensors));
      return 0;
    }
    return n;
  }
  bool ok() const { return error_.empty(); }
  Status Finish(const char* message) {
    if (ok() && !rest_.empty()) error_ = std::to_string(rest_.size()) + " bytes after the end";
    if (ok()) return Status::Ok();
    return InvalidArgument(std::string(message) + " message: " + error_);
  }

 private:
  template <typename T>
  T Fixed() {
    T v{};
    if (!ok()) return v;
    if (rest_.size() < sizeof v) {
      Fail("truncated");
      return v;
    }
    std::memcpy(&v, rest_.data(), sizeof v);
    rest_.remove_prefix(sizeof v);
    return v;
  }
  std::string Fail(std::string why) {
    if (ok()) error_ = std::move(why);
    rest_ = {};
    return {};
  }
  std::string_view rest_;
  std::string error_;
};

Status SendPacket(int fd, const std::string& b, size_t limit, const char* what) {
  if (b.size() > limit)
    return InvalidArgument(std::string(what) + " message of " + std::to_string(b.size()) +
                           " bytes is over the limit of " + std::to_string(limit));
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
    if (n == 0) return DeadlineExceeded("timeout");
    if (errno != EINTR) return ErrnoError("control poll", errno);
  }
}

// Sizes are checked before they are summed: every offset and size the
// protocol carries is below kMaxSlotBytes, so a sum of two cannot wrap.
Status CheckRange(uint64_t offset, uint64_t bytes, uint64_t lo, uint64_t hi,
                  const std::string& what) {
  if (offset >= kMaxSlotBytes || bytes >= kMaxSlotBytes || offset < lo || offset + bytes > hi)
    return InvalidArgument(what + ": bytes [" + std::to_string(offset) + ", +" +
                           std::to_string(bytes) + ") lie outside the slot's [" +
                           std::to_string(lo) + ", " + std::to_string(hi) + ")");
  return Status::Ok();
}

}  // namespace

Result<Message> ReceiveWith(int fd, int timeout_ms, int flags);

Status SendSetup(int fd, const Setup& m) {
  Writer w(Kind::kSetup);
  w.U32(static_cast<uint32_t>(m.max_batch_size));
  w.U32(static_cast<uint32_t>(m.parameters.size()));
  for (const auto& [k, v] : m.parameters) {
    w.Str(k);
    w.Str(v);
  }
  w.Specs(m.inputs);
  w.Specs(m.outputs);
  w.Str(m.config_json);
  w.Str(m.version_dir);
  w.U8(m.decoupled ? 1 : 0);
  return SendPacket(fd, w.bytes(), kMaxSetupBytes, "setup");
}

bool IsStartPhaseName(std::string_view name) {
  if (name.empty() || name.size() > kMaxStartPhaseNameBytes) return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
      return false;
  return true;
}

Status SendReady(int fd, const Ready& m) {
  Writer w(Kind::kReady);
  w.Specs(m.inputs);
  w.Specs(m.outputs);
  w.U64(m.device_memory_bytes);
  w.Str(m.text.substr(0, kMaxTextBytes));
  w.U8(m.device_addresses ? 1 : 0);
  if (m.phases.size() > kMaxStartPhases)
    return InvalidArgument("a ready message with " + std::to_string(m.phases.size()) +
                           " start phases, over the limit of " + std::to_string(kMaxStartPhases));
  w.U32(static_cast<uint32_t>(m.phases.size()));
  for (const StartPhase& p : m.phases) {
    if (!IsStartPhaseName(p.name))
      return InvalidArgument("start phase name '" + p.name.substr(0, 64) +
                             "' is not 1 to 32 characters of a-z, 0-9, '.', '_' and '-'");
    w.Str(p.name);
    w.U64(p.us);
  }
  w.U32(m.streams);
  w.U32(m.window);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "ready");
}

Status SendRun(int fd, const Run& m) {
  Writer w(Kind::kRun);
  w.U64(m.seq);
  w.I64(m.rows);
  w.U64(m.slot_bytes);
  w.Tensors(m.inputs);
  w.Tensors(m.outputs);
  w.U32(static_cast<uint32_t>(m.output_placed.size()));
  for (uint8_t p : m.output_placed) w.U8(p);
  w.U64(m.free_offset);
  if (m.parameters_json.size() > kMaxParametersBytes)
    return InvalidArgument("the request's parameters come to " +
                           std::to_string(m.parameters_json.size()) + " bytes, over the limit of " +
                           std::to_string(kMaxParametersBytes));
  w.Str(m.parameters_json);
  if (m.regions.size() > kMaxRunRegions || m.copies.size() > kMaxDeviceCopies)
    return InvalidArgument("a run with " + std::to_string(m.regions.size()) +
                           " CUDA shared-memory regions and " + std::to_string(m.copies.size()) +
                           " copies, over the limits of " + std::to_string(kMaxRunRegions) +
                           " and " + std::to_string(kMaxDeviceCopies));
  w.U32(static_cast<uint32_t>(m.regions.size()));
  for (const DeviceRegion& g : m.regions) {
    w.U64(g.id);
    if (g.name.size() > kMaxDeviceRegionNameBytes)
      return InvalidArgument("a region name of " + std::to_string(g.name.size()) + " bytes");
    w.Str(g.name);
    for (uint8_t b : g.handle) w.U8(b);
    w.U32(static_cast<uint32_t>(g.device));
    w.U64(g.byte_size);
  }
  w.U32(static_cast<uint32_t>(m.copies.size()));
  for (const DeviceCopy& c : m.copies) {
    w.U32(c.region);
    w.U8(c.output ? 1 : 0);
    w.U32(c.tensor);
    w.U64(c.offset);
    w.U64(c.bytes);
    w.U64(c.region_offset);
  }
  w.U8(m.compact ? 1 : 0);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "run");
}

Status SendDone(int fd, const Done& m) {
  Writer w(Kind::kDone);
  w.U64(m.seq);
  w.U32(m.status_code);
  // The end of an error (a Python traceback's last line) says the most.
  w.Str(m.text.size() > kMaxTextBytes ? m.text.substr(m.text.size() - kMaxTextBytes) : m.text);
  w.U8(m.retry_alone ? 1 : 0);
  w.U64(m.run_us);
  w.U64(m.room_needed);
  w.Tensors(m.outputs);
  w.U32(static_cast<uint32_t>(m.present.size()));
  for (uint8_t p : m.present) w.U8(p);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "done");
}

Status SendRing(int fd, const Ring& m) {
  Writer w(Kind::kRing);
  w.U64(m.offset);
  w.U64(m.bytes);
  w.U64(m.slot_bytes);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "ring");
}

Status SendOpen(int fd, const Open& m) {
  if (m.parameters_json.size() > kMaxParametersBytes)
    return InvalidArgument("the request's parameters come to " +
                           std::to_string(m.parameters_json.size()) + " bytes, over the limit of " +
                           std::to_string(kMaxParametersBytes));
  Writer w(Kind::kOpen);
  w.U64(m.id);
  w.Str(m.request_id.substr(0, kMaxNameBytes));
  w.U64(m.slot_bytes);
  w.Tensors(m.inputs);
  w.Str(m.parameters_json);
  w.Tensors({m.resume});
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "open");
}

Status SendResponse(int fd, const Response& m) {
  Writer w(Kind::kResponse);
  w.U64(m.id);
  w.U8(m.final ? 1 : 0);
  w.U32(m.status_code);
  w.Str(m.text.size() > kMaxTextBytes ? m.text.substr(m.text.size() - kMaxTextBytes) : m.text);
  w.Tensors(m.outputs);
  w.U32(static_cast<uint32_t>(m.present.size()));
  for (uint8_t p : m.present) w.U8(p);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "response");
}

Status SendCredit(int fd, const Credit& m) {
  Writer w(Kind::kCredit);
  w.U32(m.responses);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "credit");
}

Status SendCancel(int fd, std::span<const uint64_t> ids) {
  if (ids.empty() || ids.size() > kMaxCancelIds)
    return InvalidArgument("a cancel of " + std::to_string(ids.size()) + " requests (1 to " +
                           std::to_string(kMaxCancelIds) + ")");
  Writer w(Kind::kCancel);
  w.U32(static_cast<uint32_t>(ids.size()));
  for (uint64_t id : ids) w.U64(id);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "cancel");
}

Status SendRingGrow(int fd, const RingGrow& m) {
  Writer w(Kind::kRingGrow);
  w.U64(m.bytes);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "ring-grow");
}

Status SendEngineStats(int fd, const EngineStats& m) {
  Writer w(Kind::kEngineStats);
  w.U64(m.kv_blocks_used);
  w.U64(m.kv_blocks_total);
  w.U64(m.preemptions);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "engine-stats");
}

Status SendStart(int fd) {
  Writer w(Kind::kStart);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "start");
}

Status SendRelease(int fd, std::span<const uint64_t> ids) {
  if (ids.size() > kMaxReleaseIds)
    return InvalidArgument("a release of " + std::to_string(ids.size()) + " regions, over " +
                           std::to_string(kMaxReleaseIds));
  Writer w(Kind::kRelease);
  w.U32(static_cast<uint32_t>(ids.size()));
  for (uint64_t id : ids) w.U64(id);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "release");
}

Status SendRoom(int fd, const Room& m) {
  Writer w(Kind::kRoom);
  w.U64(m.seq);
  w.U64(m.slot_bytes);
  return SendPacket(fd, w.bytes(), kMaxMessageBytes, "room");
}

Result<Message> Receive(int fd, int timeout_ms) { return ReceiveWith(fd, timeout_ms, 0); }

Result<Setup> PeekSetup(int fd, int timeout_ms) {
  ASSIGN_OR_RETURN(Message m, ReceiveWith(fd, timeout_ms, MSG_PEEK));
  if (m.kind != Kind::kSetup) return InvalidArgument("the first control message is not the setup");
  return std::move(m.setup);
}

Result<Message> ReceiveWith(int fd, int timeout_ms, int flags) {
  RETURN_IF_ERROR(WaitReadable(fd, timeout_ms));
  // One buffer per thread for the largest packet: a batch's messages are
  // received without an allocation.
  thread_local const std::unique_ptr<char[]> storage(new char[kMaxSetupBytes]);
  ssize_t n;
  do {
    n = ::recv(fd, storage.get(), kMaxSetupBytes, MSG_TRUNC | flags);
  } while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno == ECONNRESET)) return Unavailable("control channel closed");
  if (n < 0) return ErrnoError("control receive", errno);
  if (static_cast<size_t>(n) > kMaxSetupBytes)
    return InvalidArgument("control message of " + std::to_string(n) +
                           " bytes is over the limit of " + std::to_string(kMaxSetupBytes));
  const std::string_view buf(storage.get(), static_cast<size_t>(n));
  Reader r(buf);
  if (buf.size() < kHeaderBytes || r.U32() != kMagic)
    return InvalidArgument("control message without the magic number");
  Message m;
  m.kind = static_cast<Kind>(r.U32());
  if (m.kind != Kind::kSetup && buf.size() > kMaxMessageBytes)
    return InvalidArgument("control message of " + std::to_string(buf.size()) +
                           " bytes is over the limit of " + std::to_string(kMaxMessageBytes));
  switch (m.kind) {
    case Kind::kSetup: {
      m.setup.max_batch_size = static_cast<int32_t>(r.U32());
      if (m.setup.max_batch_size < 0)
        return InvalidArgument("setup message: negative max_batch_size");
      const uint32_t count = r.U32();
      for (uint32_t i = 0; i < count && r.ok(); ++i) {
        std::string k = r.Str(kMaxSetupBytes, "a parameter name");
        std::string v = r.Str(kMaxSetupBytes, "a parameter value");
        m.setup.parameters[std::move(k)] = std::move(v);
      }
      m.setup.inputs = r.Specs();
      m.setup.outputs = r.Specs();
      m.setup.config_json = r.Str(kMaxSetupBytes, "the config");
      m.setup.version_dir = r.Str(4096, "the version directory");
      m.setup.decoupled = r.U8() != 0;
      RETURN_IF_ERROR(r.Finish("setup"));
      break;
    }
    case Kind::kReady:
      m.ready.inputs = r.Specs();
      m.ready.outputs = r.Specs();
      m.ready.device_memory_bytes = r.U64();
      m.ready.text = r.Str(kMaxTextBytes, "the text");
      m.ready.device_addresses = r.U8() != 0;
      if (const uint32_t phases = r.U32(); phases > kMaxStartPhases) {
        return InvalidArgument("ready message: " + std::to_string(phases) +
                               " start phases, over the limit of " +
                               std::to_string(kMaxStartPhases));
      } else {
        for (uint32_t i = 0; i < phases && r.ok(); ++i) {
          StartPhase p;
          p.name = r.Str(kMaxStartPhaseNameBytes, "a start phase's name");
          p.us = r.U64();
          if (r.ok() && !IsStartPhaseName(p.name))
            return InvalidArgument(
                "ready message: a start phase's name is not 1 to 32 "
                "characters of a-z, 0-9, '.', '_' and '-'");
          m.ready.phases.push_back(std::move(p));
        }
      }
      m.ready.streams = r.U32();
      m.ready.window = r.U32();
      RETURN_IF_ERROR(r.Finish("ready"));
      if (m.ready.streams < 1 || m.ready.streams > kMaxStreams || m.ready.window < 1 ||
          m.ready.window > kMaxWindow)
        return InvalidArgument("ready message: " + std::to_string(m.ready.streams) +
                               " streams and a window of " + std::to_string(m.ready.window) +
                               " (1 to " + std::to_string(kMaxStreams) + " and 1 to " +
                               std::to_string(kMaxWindow) + ")");
      break;
    case Kind::kRun: {
      m.run.seq = r.U64();
      m.run.rows = r.I64();
      m.run.slot_bytes = r.U64();
      m.run.inputs = r.Tensors();
      m.run.outputs = r.Tensors();
      const uint32_t placed = r.Count("placement flags");
      for (uint32_t i = 0; i < placed && r.ok(); ++i) m.run.output_placed.push_back(r.U8());
      m.run.free_offset = r.U64();
      m.run.parameters_json = r.Str(kMaxParametersBytes, "the request's parameters");
      const uint32_t regions = r.U32();
      if (regions > kMaxRunRegions) return InvalidArgument("run message: too many regions");
      for (uint32_t i = 0; i < regions && r.ok(); ++i) {
        DeviceRegion g;
        g.id = r.U64();
        g.name = r.Str(kMaxDeviceRegionNameBytes, "a region name");
        for (uint8_t& b : g.handle) b = r.U8();
        g.device = static_cast<int32_t>(r.U32());
        g.byte_size = r.U64();
        m.run.regions.push_back(g);
      }
      const uint32_t copies = r.U32();
      if (copies > kMaxDeviceCopies) return InvalidArgument("run message: too many copies");
      for (uint32_t i = 0; i < copies && r.ok(); ++i) {
        DeviceCopy c;
        c.region = r.U32();
        c.output = r.U8() != 0;
        c.tensor = r.U32();
        c.offset = r.U64();
        c.bytes = r.U64();
        c.region_offset = r.U64();
        m.run.copies.push_back(c);
      }
      m.run.compact = r.U8() != 0;
      RETURN_IF_ERROR(r.Finish("run"));
      if (m.run.output_placed.size() != m.run.outputs.size())
        return InvalidArgument("run message: placement flags for " +
                               std::to_string(m.run.output_placed.size()) + " of " +
                               std::to_string(m.run.outputs.size()) + " outputs");
      RETURN_IF_ERROR(CheckDeviceCopies(m.run));
      break;
    }
    case Kind::kDone: {
      m.done.seq = r.U64();
      m.done.status_code = r.U32();
      m.done.text = r.Str(kMaxTextBytes, "the error text");
      m.done.retry_alone = r.U8() != 0;
      m.done.run_us = r.U64();
      m.done.room_needed = r.U64();
      m.done.outputs = r.Tensors();
      const uint32_t present = r.Count("presence flags");
      for (uint32_t i = 0; i < present && r.ok(); ++i) m.done.present.push_back(r.U8());
      RETURN_IF_ERROR(r.Finish("done"));
      if (!m.done.present.empty() && m.done.present.size() != m.done.outputs.size())
        return InvalidArgument("done message: presence flags for " +
                               std::to_string(m.done.present.size()) + " of " +
                               std::to_string(m.done.outputs.size()) + " outputs");
      break;
    }
    case Kind::kRing:
      m.ring.offset = r.U64();
      m.ring.bytes = r.U64();
      m.ring.slot_bytes = r.U64();
      RETURN_IF_ERROR(r.Finish("ring"));
      if (m.ring.slot_bytes >= kMaxSlotBytes || m.ring.bytes == 0)
        return InvalidArgument("ring message: a ring of " + std::to_string(m.ring.bytes) +
                               " bytes in a slot of " + std::to_string(m.ring.slot_bytes));
      RETURN_IF_ERROR(
          CheckRange(m.ring.offset, m.ring.bytes, 0, m.ring.slot_bytes, "ring message"));
      break;
    case Kind::kOpen: {
      m.open.id = r.U64();
      m.open.request_id = r.Str(kMaxNameBytes, "the request's id");
      m.open.slot_bytes = r.U64();
      m.open.inputs = r.Tensors();
      m.open.parameters_json = r.Str(kMaxParametersBytes, "the request's parameters");
      std::vector<SlotTensor> resume = r.Tensors();
      RETURN_IF_ERROR(r.Finish("open"));
      if (resume.size() != 1) return InvalidArgument("open message: no resume tensor");
      m.open.resume = std::move(resume[0]);
      if (m.open.slot_bytes >= kMaxSlotBytes)
        return InvalidArgument("open message: a slot of " + std::to_string(m.open.slot_bytes) +
                               " bytes");
      const SlotTensor& t = m.open.resume;
      if (t.shape.size() != 1 || t.shape[0] < 0 ||
          static_cast<uint64_t>(t.shape[0]) > kMaxResumeTokens)
        return InvalidArgument("open message: resume tokens of shape " + ShapeString(t.shape) +
                               " (INT64 [n], n at most " + std::to_string(kMaxResumeTokens) + ")");
      RETURN_IF_ERROR(CheckSlotTensor(t, DType::kI64, 0, m.open.slot_bytes, nullptr,
                                      "open message: resume tokens"));
      break;
    }
    case Kind::kResponse: {
      m.response.id = r.U64();
      m.response.final = r.U8() != 0;
      m.response.status_code = r.U32();
      m.response.text = r.Str(kMaxTextBytes, "the error text");
      m.response.outputs = r.Tensors();
      const uint32_t present = r.Count("presence flags");
      for (uint32_t i = 0; i < present && r.ok(); ++i) m.response.present.push_back(r.U8());
      RETURN_IF_ERROR(r.Finish("response"));
      if (m.response.present.size() != m.response.outputs.size())
        return InvalidArgument("response message: presence flags for " +
                               std::to_string(m.response.present.size()) + " of " +
                               std::to_string(m.response.outputs.size()) + " outputs");
      if (m.response.status_code != 0 && !m.response.final)
        return InvalidArgument("response message: an error that is not final");
      break;
    }
    case Kind::kCredit:
      m.credit.responses = r.U32();
      RETURN_IF_ERROR(r.Finish("credit"));
      if (m.credit.responses == 0 || m.credit.responses > kMaxWindow)
        return InvalidArgument("credit message for " + std::to_string(m.credit.responses) +
                               " responses (1 to " + std::to_string(kMaxWindow) + ")");
      break;
    case Kind::kCancel: {
      const uint32_t ids = r.U32();
      if (ids == 0 || ids > kMaxCancelIds)
        return InvalidArgument("cancel message for " + std::to_string(ids) + " requests (1 to " +
                               std::to_string(kMaxCancelIds) + ")");
      for (uint32_t i = 0; i < ids && r.ok(); ++i) m.cancel.ids.push_back(r.U64());
      RETURN_IF_ERROR(r.Finish("cancel"));
      break;
    }
    case Kind::kRingGrow:
      m.ring_grow.bytes = r.U64();
      RETURN_IF_ERROR(r.Finish("ring-grow"));
      if (m.ring_grow.bytes == 0 || m.ring_grow.bytes >= kMaxSlotBytes)
        return InvalidArgument("ring-grow message for " + std::to_string(m.ring_grow.bytes) +
                               " bytes");
      break;
    case Kind::kEngineStats:
      m.engine_stats.kv_blocks_used = r.U64();
      m.engine_stats.kv_blocks_total = r.U64();
      m.engine_stats.preemptions = r.U64();
      RETURN_IF_ERROR(r.Finish("engine-stats"));
      if (m.engine_stats.kv_blocks_total > kMaxKvBlocks ||
          m.engine_stats.kv_blocks_used > m.engine_stats.kv_blocks_total)
        return InvalidArgument(
            "engine-stats message: " + std::to_string(m.engine_stats.kv_blocks_used) + " of " +
            std::to_string(m.engine_stats.kv_blocks_total) + " KV blocks");
      break;
    case Kind::kStart:
      RETURN_IF_ERROR(r.Finish("start"));
      break;
    case Kind::kRelease: {
      const uint32_t ids = r.U32();
      if (ids > kMaxReleaseIds) return InvalidArgument("release message: too many regions");
      for (uint32_t i = 0; i < ids && r.ok(); ++i) m.release.ids.push_back(r.U64());
      RETURN_IF_ERROR(r.Finish("release"));
      break;
    }
    case Kind::kRoom:
      m.room.seq = r.U64();
      m.room.slot_bytes = r.U64();
      RETURN_IF_ERROR(r.Finish("room"));
      break;
    default:
      return InvalidArgument("unknown control message kind " +
                             std::to_string(static_cast<uint32_t>(m.kind)));
  }
  return m;
}

Result<Message> ReceiveKind(int fd, int timeout_ms, std::initializer_list<Kind> kinds) {
  ASSIGN_OR_RETURN(Message m, Receive(fd, timeout_ms));
  for (Kind k : kinds)
    if (m.kind == k) return m;
  return InvalidArgument("unexpected control message of kind " +
                         std::to_string(static_cast<uint32_t>(m.kind)));
}

Result<std::optional<uint64_t>> FixedBytes(DType dtype, std::span<const int64_t> shape,
                                           const std::string& what) {
  if (dtype == DType::kBytes) return std::optional<uint64_t>();
  for (int64_t d : shape)
    if (d < 0) return std::optional<uint64_t>();
  ASSIGN_OR_RETURN(uint64_t bytes, ShapeBytes(dtype, shape, what));
  if (bytes >= kMaxSlotBytes)
    return InvalidArgument(what + ": " + std::to_string(bytes) + " bytes is past the slot's limit");
  return std::optional<uint64_t>(bytes);
}

Status CheckShape(const TensorSpec& spec, bool batching, int64_t rows,
                  std::span<const int64_t> shape, const std::string& what) {
  const size_t lead = batching ? 1 : 0;
  bool ok = shape.size() == spec.dims.size() + lead && (!batching || shape[0] == rows);
  for (size_t i = 0; ok && i < spec.dims.size(); ++i) {
    const int64_t got = shape[i + lead];
    ok = got >= 0 && (spec.dims[i] < 0 || spec.dims[i] == got);
  }
  if (ok) return Status::Ok();
  std::vector<int64_t> want;
  if (batching) want.push_back(rows);
  want.insert(want.end(), spec.dims.begin(), spec.dims.end());
  return InvalidArgument(what + " has shape " + ShapeString(shape) + " where " + Describe(spec) +
                         " takes " + ShapeString(want) + " (-1: any size)");
}

Status CheckDeviceCopies(const Run& run) {
  for (const DeviceRegion& g : run.regions)
    if (g.device < 0 || g.byte_size == 0 || g.byte_size >= kMaxSlotBytes)
      return InvalidArgument("run message: CUDA shared-memory region " + std::to_string(g.id) +
                             " on device " + std::to_string(g.device) + " of " +
                             std::to_string(g.byte_size) + " bytes");
  for (size_t i = 0; i < run.copies.size(); ++i) {
    const DeviceCopy& c = run.copies[i];
    const std::string what = "run message: device copy " + std::to_string(i);
    if (c.region >= run.regions.size())
      return InvalidArgument(what + " names region " + std::to_string(c.region) + " of " +
                             std::to_string(run.regions.size()));
    const std::vector<SlotTensor>& tensors = c.output ? run.outputs : run.inputs;
    if (c.tensor >= tensors.size() || (c.output && !run.output_placed[c.tensor]))
      return InvalidArgument(what + " names " + (c.output ? "output " : "input ") +
                             std::to_string(c.tensor) + ", which has no place in the slot");
    const SlotTensor& t = tensors[c.tensor];
    const uint64_t region_bytes = run.regions[c.region].byte_size;
    // Every term is below 2^62 once the first test passed: the sums are exact.
    if (c.bytes == 0 || c.bytes >= kMaxSlotBytes || c.offset > t.bytes ||
        c.bytes > t.bytes - c.offset || c.region_offset > region_bytes ||
        c.bytes > region_bytes - c.region_offset)
      return InvalidArgument(
          what + ": " + std::to_string(c.bytes) + " bytes at " + std::to_string(c.offset) +
          " of a tensor of " + std::to_string(t.bytes) + " and at " +
          std::to_string(c.region_offset) + " of a region of " + std::to_string(region_bytes));
  }
  // No two copies of one tensor overlap: by tensor, then offset.
  std::vector<const DeviceCopy*> sorted;
  sorted.reserve(run.copies.size());
  for (const DeviceCopy& c : run.copies) sorted.push_back(&c);
  std::sort(sorted.begin(), sorted.end(), [](const DeviceCopy* a, const DeviceCopy* b) {
    return std::tie(a->output, a->tensor, a->offset) < std::tie(b->output, b->tensor, b->offset);
  });
  for (size_t i = 1; i < sorted.size(); ++i) {
    const DeviceCopy& a = *sorted[i - 1];
    const DeviceCopy& b = *sorted[i];
    if (a.output == b.output && a.tensor == b.tensor && b.offset - a.offset < a.bytes)
      return InvalidArgument("run message: two device copies of " +
                             std::string(a.output ? "output " : "input ") +
                             std::to_string(a.tensor) + " overlap at " + std::to_string(b.offset));
  }
  return Status::Ok();
}

std::vector<uint64_t> SlotRooms(const Run& run, bool output) {
  const std::vector<SlotTensor>& tensors = output ? run.outputs : run.inputs;
  std::vector<uint64_t> room(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) room[i] = tensors[i].bytes;
  if (!run.compact) return room;
  // Checked copies do not overlap and lie inside their tensor: no wrap.
  for (const DeviceCopy& c : run.copies)
    if (c.output == output && c.tensor < room.size()) room[c.tensor] -= c.bytes;
  return room;
}

Status CheckSlotTensor(const SlotTensor& t, DType dtype, uint64_t lo, uint64_t hi,
                       const std::byte* data, const std::string& what,
                       std::optional<uint64_t> room) {
  if (room.has_value() && (*room > t.bytes || (dtype == DType::kBytes && *room != t.bytes)))
    return InvalidArgument(what + ": room for " + std::to_string(*room) + " of its " +
                           std::to_string(t.bytes) + " bytes in the slot");
  RETURN_IF_ERROR(CheckRange(t.offset, room.value_or(t.bytes), lo, hi, what));
  for (int64_t d : t.shape)
    if (d < 0) return InvalidArgument(what + ": negative dimension in " + ShapeString(t.shape));
  if (dtype == DType::kBytes) {
    ASSIGN_OR_RETURN(uint64_t count, ShapeElements(t.shape, what));
    if (data != nullptr)
      return ValidateBytesTensor(std::span(data + t.offset, t.bytes), count, what);
    return Status::Ok();
  }
  ASSIGN_OR_RETURN(std::optional<uint64_t> want, FixedBytes(dtype, t.shape, what));
  if (*want != t.bytes)
    return InvalidArgument(what + ": " + std::to_string(t.bytes) + " bytes where shape " +
                           ShapeString(t.shape) + " of " + std::string(DTypeName(dtype)) +
                           " needs " + std::to_string(*want));
  return Status::Ok();
}

}  // namespace hearth::control
