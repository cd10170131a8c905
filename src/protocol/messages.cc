#include "protocol/messages.h"

namespace hearth::protocol {
namespace {

constexpr size_t kMaxDims = 32;

void PutDevice(PayloadWriter& w, const Device& d) {
  w.U8(static_cast<uint8_t>(d.kind));
  w.I32(d.index);
}
Device GetDevice(PayloadReader& r) {
  Device d;
  const uint8_t kind = r.U8("device.kind");
  d.index = r.I32("device.index");
  if (kind > 1 || d.index < 0)
    r.Fail("device kind " + std::to_string(kind) + " index " + std::to_string(d.index) +
           " is not a device");
  d.kind = kind == 1 ? DeviceKind::kCuda : DeviceKind::kHost;
  return d;
}

void PutSummary(PayloadWriter& w, const ModelSummary& m) {
  w.Str(m.name);
  w.U64(m.version);
  PutDevice(w, m.device);
  w.Str(m.path);
  w.U64(m.arena_size);
  w.U32(m.tensor_count);
  w.U64(m.tensor_bytes);
  w.U64(m.checksum);
  w.U32(m.attached);
  w.I64(m.loaded_at_ms);
}
ModelSummary GetSummary(PayloadReader& r) {
  ModelSummary m;
  m.name = r.Str("name");
  m.version = r.U64("version");
  m.device = GetDevice(r);
  m.path = r.Str("path");
  m.arena_size = r.U64("arena_size");
  m.tensor_count = r.U32("tensor_count");
  m.tensor_bytes = r.U64("tensor_bytes");
  m.checksum = r.U64("checksum");
  m.attached = r.U32("attached");
  m.loaded_at_ms = r.I64("loaded_at_ms");
  return m;
}
// Smallest encoding of a summary: empty strings, fixed fields.
constexpr size_t kMinSummaryBytes = 4 + 8 + 5 + 4 + 8 + 4 + 8 + 8 + 4 + 8;

}  // namespace

std::vector<std::byte> EncodeError(const Status& status) {
  PayloadWriter w;
  w.U16(static_cast<uint16_t>(status.code()));
  w.Str(status.message());
  return w.Take();
}

Status DecodeError(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  uint16_t code = r.U16("code");
  std::string message = r.Str("message");
  if (Status s = r.Finish("error"); !s.ok()) return s;
  if (code == 0 || code > static_cast<uint16_t>(StatusCode::kDeviceLost))
    code = static_cast<uint16_t>(StatusCode::kInternal);
  return Status(static_cast<StatusCode>(code), std::move(message));
}

std::vector<std::byte> EncodeAttach(const AttachRequest& req) {
  PayloadWriter w;
  w.Str(req.model.name);
  w.U64(req.model.version);
  return w.Take();
}

Result<AttachRequest> DecodeAttach(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  AttachRequest req;
  req.model.name = r.Str("model");
  req.model.version = r.U64("version");
  RETURN_IF_ERROR(r.Finish("attach"));
  if (req.model.name.empty()) return InvalidArgument("attach message: empty model name");
  return req;
}

std::vector<std::byte> EncodeManifest(const Manifest& m) {
  PayloadWriter w;
  w.Str(m.model);
  w.U64(m.version);
  PutDevice(w, m.device);
  w.U64(m.arena_size);
  w.U64(m.checksum);
  w.U32(static_cast<uint32_t>(m.tensors.size()));
  for (const ManifestTensor& t : m.tensors) {
    w.Str(t.name);
    w.U8(static_cast<uint8_t>(t.dtype));
    w.U8(static_cast<uint8_t>(t.shape.size()));
    for (int64_t d : t.shape) w.I64(d);
    w.U64(t.offset);
    w.U64(t.nbytes);
  }
  return w.Take();
}

Result<Manifest> DecodeManifest(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  Manifest m;
  m.model = r.Str("model");
  m.version = r.U64("version");
  m.device = GetDevice(r);
  m.arena_size = r.U64("arena_size");
  m.checksum = r.U64("checksum");
  const uint32_t n = r.Count("tensor_count", 4 + 1 + 1 + 8 + 8);
  m.tensors.reserve(n);
  for (uint32_t i = 0; i < n && r.status().ok(); ++i) {
    ManifestTensor t;
    t.name = r.Str("tensor.name");
    const uint8_t dtype = r.U8("tensor.dtype");
    const uint8_t ndim = r.U8("tensor.ndim");
    if (!IsStoredDType(dtype))
      return InvalidArgument("manifest message: tensor '" + t.name + "' has unknown dtype " +
                             std::to_string(dtype));
    if (ndim > kMaxDims)
      return InvalidArgument("manifest message: tensor '" + t.name + "' has " +
                             std::to_string(ndim) + " dimensions (at most 32)");
    t.dtype = static_cast<DType>(dtype);
    for (uint8_t d = 0; d < ndim; ++d) t.shape.push_back(r.I64("tensor.dim"));
    t.offset = r.U64("tensor.offset");
    t.nbytes = r.U64("tensor.nbytes");
    m.tensors.push_back(std::move(t));
  }
  RETURN_IF_ERROR(r.Finish("manifest"));
  RETURN_IF_ERROR(ValidateManifest(m));
  return m;
}

std::vector<std::byte> EncodeModelList(const std::vector<ModelSummary>& models) {
  PayloadWriter w;
  w.U32(static_cast<uint32_t>(models.size()));
  for (const ModelSummary& m : models) PutSummary(w, m);
  return w.Take();
}

Result<std::vector<ModelSummary>> DecodeModelList(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  const uint32_t n = r.Count("model_count", kMinSummaryBytes);
  std::vector<ModelSummary> models;
  for (uint32_t i = 0; i < n && r.status().ok(); ++i) models.push_back(GetSummary(r));
  RETURN_IF_ERROR(r.Finish("model-list"));
  return models;
}

namespace {

void PutStatus(PayloadWriter& w, const StoreStatus& s) {
  w.I32(s.pid);
  PutDevice(w, s.device);
  w.U32(s.connections);
  w.U32(static_cast<uint32_t>(s.leases.size()));
  for (const LeaseInfo& l : s.leases) {
    w.I32(l.pid);
    w.U32(l.uid);
    w.U32(l.gid);
    w.Str(l.model);
    w.U64(l.version);
    w.I64(l.since_ms);
  }
  w.U32(static_cast<uint32_t>(s.arenas.size()));
  for (const ArenaInfo& a : s.arenas) {
    w.Str(a.model);
    w.U64(a.version);
    PutDevice(w, a.device);
    w.U64(a.bytes);
    w.U8(a.registered ? 1 : 0);
    w.U32(a.attached);
  }
}

StoreStatus GetStatus(PayloadReader& r) {
  StoreStatus s;
  s.pid = r.I32("pid");
  s.device = GetDevice(r);
  s.connections = r.U32("connections");
  const uint32_t leases = r.Count("lease_count", 4 + 4 + 4 + 4 + 8 + 8);
  for (uint32_t i = 0; i < leases && r.status().ok(); ++i) {
    LeaseInfo l;
    l.pid = r.I32("lease.pid");
    l.uid = r.U32("lease.uid");
    l.gid = r.U32("lease.gid");
    l.model = r.Str("lease.model");
    l.version = r.U64("lease.version");
    l.since_ms = r.I64("lease.since_ms");
    s.leases.push_back(std::move(l));
  }
  const uint32_t arenas = r.Count("arena_count", 4 + 8 + 5 + 8 + 1 + 4);
  for (uint32_t i = 0; i < arenas && r.status().ok(); ++i) {
    ArenaInfo a;
    a.model = r.Str("arena.model");
    a.version = r.U64("arena.version");
    a.device = GetDevice(r);
    a.bytes = r.U64("arena.bytes");
    a.registered = r.U8("arena.registered") != 0;
    a.attached = r.U32("arena.attached");
    s.arenas.push_back(std::move(a));
  }
  return s;
}

}  // namespace

std::vector<std::byte> EncodeStatus(const StoreStatus& s) {
  PayloadWriter w;
  PutStatus(w, s);
  return w.Take();
}

Result<StoreStatus> DecodeStatus(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  StoreStatus s = GetStatus(r);
  RETURN_IF_ERROR(r.Finish("status-reply"));
  s.lease_total = s.leases.size();
  return s;
}

std::vector<std::byte> EncodeStatusV2(const StoreStatus& s) {
  PayloadWriter w;
  PutStatus(w, s);
  w.U64(s.lease_total);
  w.U32(static_cast<uint32_t>(s.counters.size()));
  for (const auto& [name, value] : s.counters) {
    w.Str(name);
    w.U64(value);
  }
  return w.Take();
}

Result<StoreStatus> DecodeStatusV2(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  StoreStatus s = GetStatus(r);
  s.lease_total = r.U64("lease_total");
  const uint32_t n = r.Count("counter_count", 4 + 8);
  for (uint32_t i = 0; i < n && r.status().ok(); ++i) {
    std::string name = r.Str("counter.name");
    const uint64_t value = r.U64("counter.value");
    if (r.status().ok() && !s.counters.emplace(std::move(name), value).second)
      return InvalidArgument("status-reply-v2 message: a counter is named twice");
  }
  RETURN_IF_ERROR(r.Finish("status-reply-v2"));
  if (s.lease_total < s.leases.size())
    return InvalidArgument("status-reply-v2 message: lease_total " + std::to_string(s.lease_total) +
                           " is less than the " + std::to_string(s.leases.size()) +
                           " leases listed");
  return s;
}

std::vector<std::byte> EncodeLoad(const LoadRequest& req) {
  PayloadWriter w;
  w.Str(req.name);
  w.Str(req.path);
  return w.Take();
}

namespace {

Status CheckLoad(const LoadRequest& req, std::string_view message_name) {
  if (req.name.empty() || req.name.find('@') != std::string::npos)
    return InvalidArgument(std::string(message_name) + " message: model name '" + req.name +
                           "' is empty or contains '@'");
  if (req.path.empty()) return InvalidArgument(std::string(message_name) + " message: empty path");
  return Status::Ok();
}

constexpr uint8_t kReuseOnly = 1;

}  // namespace

Result<LoadRequest> DecodeLoad(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  LoadRequest req;
  req.name = r.Str("name");
  req.path = r.Str("path");
  RETURN_IF_ERROR(r.Finish("load"));
  RETURN_IF_ERROR(CheckLoad(req, "load"));
  return req;
}

std::vector<std::byte> EncodeLoadV2(const LoadRequest& req) {
  PayloadWriter w;
  w.Str(req.name);
  w.Str(req.path);
  w.U64(req.reuse_version);
  w.U8(req.reuse_only ? kReuseOnly : 0);
  return w.Take();
}

Result<LoadRequest> DecodeLoadV2(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  LoadRequest req;
  req.name = r.Str("name");
  req.path = r.Str("path");
  req.reuse_version = r.U64("reuse_version");
  const uint8_t flags = r.U8("flags");
  RETURN_IF_ERROR(r.Finish("load-v2"));
  RETURN_IF_ERROR(CheckLoad(req, "load-v2"));
  if ((flags & ~kReuseOnly) != 0)
    return InvalidArgument("load-v2 message: unknown flags " + std::to_string(flags) +
                           " (only bit 0, reuse_only, is defined)");
  req.reuse_only = (flags & kReuseOnly) != 0;
  if (req.reuse_only && req.reuse_version == 0)
    return InvalidArgument("load-v2 message: reuse_only without a reuse_version");
  return req;
}

std::vector<std::byte> EncodeLoaded(const ModelSummary& m) {
  PayloadWriter w;
  PutSummary(w, m);
  return w.Take();
}

Result<ModelSummary> DecodeLoaded(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  ModelSummary m = GetSummary(r);
  RETURN_IF_ERROR(r.Finish("loaded"));
  return m;
}

std::vector<std::byte> EncodeLoadedV2(const LoadedReply& reply) {
  PayloadWriter w;
  PutSummary(w, reply.model);
  w.U8(reply.reused ? 1 : 0);
  return w.Take();
}

Result<LoadedReply> DecodeLoadedV2(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  LoadedReply reply;
  reply.model = GetSummary(r);
  const uint8_t reused = r.U8("reused");
  RETURN_IF_ERROR(r.Finish("loaded-v2"));
  if (reused > 1)
    return InvalidArgument("loaded-v2 message: reused is " + std::to_string(reused) +
                           ", not 0 or 1");
  reply.reused = reused == 1;
  return reply;
}

std::vector<std::byte> EncodeUnload(const UnloadRequest& req) {
  PayloadWriter w;
  w.Str(req.model.name);
  w.U64(req.model.version);
  return w.Take();
}

Result<UnloadRequest> DecodeUnload(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  UnloadRequest req;
  req.model.name = r.Str("model");
  req.model.version = r.U64("version");
  RETURN_IF_ERROR(r.Finish("unload"));
  if (req.model.name.empty()) return InvalidArgument("unload message: empty model name");
  return req;
}

std::vector<std::byte> EncodeUnloaded(uint32_t versions_removed) {
  PayloadWriter w;
  w.U32(versions_removed);
  return w.Take();
}

Result<uint32_t> DecodeUnloaded(std::span<const std::byte> payload) {
  PayloadReader r(payload);
  const uint32_t n = r.U32("versions_removed");
  RETURN_IF_ERROR(r.Finish("unloaded"));
  return n;
}

Status CheckEmpty(std::span<const std::byte> payload, const char* message_name) {
  if (!payload.empty())
    return InvalidArgument(std::string(message_name) + " message must be empty, has " +
                           std::to_string(payload.size()) + " bytes");
  return Status::Ok();
}

}  // namespace hearth::protocol
