// Feeds the store protocol's frame assembler arbitrary frames and every
// decoder every message it completes, and checks the promises of
// src/protocol/wire.h and messages.h on what they accept.
//
// Input: records of [u8 flags][u16 little-endian length][length bytes], each
// one received frame (SOCK_SEQPACKET keeps frames whole); flags bit 0: a
// descriptor came with the frame.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "hearth/arena.h"
#include "hearth/dtype.h"
#include "hearth/manifest.h"
#include "protocol/messages.h"
#include "protocol/wire.h"

namespace {

using namespace hearth;
using namespace hearth::protocol;

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "broken guarantee: %s\n", what);
    __builtin_trap();
  }
}

// Decoders fail with INVALID_ARGUMENT and a message, never otherwise.
void RequireRejection(const Status& s) {
  Require(s.code() == StatusCode::kInvalidArgument, "decoders fail with InvalidArgument");
  Require(!s.message().empty(), "a rejection says why");
}

uint32_t U32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | std::to_integer<uint32_t>(p[i]);
  return v;
}

void CheckManifest(const Manifest& m) {
  Require(ValidateManifest(m).ok(), "a decoded manifest validates");
  Require(!m.model.empty(), "manifest names its model");
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& t = m.tensors[i];
    Require(!t.name.empty(), "tensor name");
    Require(i == 0 || m.tensors[i - 1].name < t.name, "tensors sorted by unique name");
    Require(IsStoredDType(static_cast<int>(t.dtype)), "known dtype");
    Require(t.shape.size() <= 32, "at most 32 dimensions");
    const std::optional<uint64_t> bytes = TensorBytes(t.dtype, t.shape);
    Require(bytes && *bytes == t.nbytes, "nbytes == numel * dtype size");
    Require(t.offset % kArenaAlignment == 0, "aligned offset");
    Require(t.offset <= m.arena_size && t.nbytes <= m.arena_size - t.offset, "inside the arena");
  }
}

// Every decoder on every payload: what one accepts must keep its promises and
// encode back to what it read (or, where decoding normalises a field, to a
// fixed point).
void CheckDecoders(std::span<const std::byte> p) {
  {
    Status s = DecodeError(p);
    Require(!s.ok(), "an error message is never OK");
  }
  if (auto r = DecodeAttach(p); r.ok()) {
    Require(!r->model.name.empty(), "attach names a model");
    Require(EncodeAttach(*r) == std::vector<std::byte>(p.begin(), p.end()), "attach round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeManifest(p); r.ok()) {
    CheckManifest(*r);
    Require(EncodeManifest(*r) == std::vector<std::byte>(p.begin(), p.end()),
            "manifest round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeModelList(p); r.ok()) {
    Require(EncodeModelList(*r) == std::vector<std::byte>(p.begin(), p.end()),
            "model-list round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeStatus(p); r.ok()) {
    // `registered` reads any non-zero byte as true: encoding is a fixed point.
    const std::vector<std::byte> once = EncodeStatus(*r);
    auto again = DecodeStatus(once);
    Require(again.ok() && EncodeStatus(*again) == once, "status-reply round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeLoad(p); r.ok()) {
    Require(!r->name.empty() && r->name.find('@') == std::string::npos && !r->path.empty(),
            "load names a model and a path");
    Require(EncodeLoad(*r) == std::vector<std::byte>(p.begin(), p.end()), "load round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeLoaded(p); r.ok()) {
    Require(EncodeLoaded(*r) == std::vector<std::byte>(p.begin(), p.end()), "loaded round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeLoadV2(p); r.ok()) {
    Require(!r->name.empty() && r->name.find('@') == std::string::npos && !r->path.empty(),
            "load-v2 names a model and a path");
    Require(EncodeLoadV2(*r) == std::vector<std::byte>(p.begin(), p.end()), "load-v2 round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeLoadedV2(p); r.ok()) {
    Require(EncodeLoadedV2(*r) == std::vector<std::byte>(p.begin(), p.end()),
            "loaded-v2 round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeUnload(p); r.ok()) {
    Require(!r->model.name.empty(), "unload names a model");
    Require(EncodeUnload(*r) == std::vector<std::byte>(p.begin(), p.end()), "unload round trip");
  } else {
    RequireRejection(r.status());
  }
  if (auto r = DecodeUnloaded(p); r.ok()) {
    Require(EncodeUnloaded(*r) == std::vector<std::byte>(p.begin(), p.end()),
            "unloaded round trip");
  } else {
    RequireRejection(r.status());
  }
  Require(CheckEmpty(p, "x").ok() == p.empty(), "CheckEmpty accepts exactly the empty payload");
}

int DevNull() {
  static const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FrameAssembler assembler;
  size_t received = 0;  // payload bytes of the message in progress
  uint32_t declared = 0;
  uint16_t type = 0;
  bool first_had_fd = false;
  size_t at = 0;
  while (at + 3 <= size) {
    const bool with_fd = (data[at] & 1) != 0;
    const size_t len = data[at + 1] | (static_cast<size_t>(data[at + 2]) << 8);
    at += 3;
    if (len > size - at) break;
    const std::span<const std::byte> frame(reinterpret_cast<const std::byte*>(data + at), len);
    at += len;

    const bool was_started = assembler.in_progress();
    UniqueFd fd(with_fd ? ::fcntl(DevNull(), F_DUPFD_CLOEXEC, 0) : -1);
    Result<bool> r = assembler.Add(frame, std::move(fd));
    if (!r.ok()) {
      RequireRejection(r.status());
      Require(!assembler.in_progress() && assembler.allocated_bytes() == 0,
              "a broken message is dropped whole");
      received = 0;
      continue;
    }
    // Accepted: the header is whole and names a known type and a total in bounds.
    Require(frame.size() >= kFrameHeaderBytes, "accepted frames have a header");
    Require(frame.size() - kFrameHeaderBytes <= kMaxFramePayload, "frame payload in bounds");
    if (!was_started) {
      declared = U32(frame.data() + 8);
      type = static_cast<uint16_t>(std::to_integer<unsigned>(frame[6]) |
                                   (std::to_integer<unsigned>(frame[7]) << 8));
      received = 0;
      first_had_fd = with_fd;
    }
    received += frame.size() - kFrameHeaderBytes;
    Require(declared <= kMaxMessageBytes, "declared total in bounds");
    Require(IsKnownMessageType(type), "known message type");
    Require(received <= declared, "never more bytes than declared");
    Require(assembler.allocated_bytes() <= declared, "allocation never past the declared total");
    Require(assembler.allocated_bytes() <= 2 * received, "allocation follows what arrived");
    if (!*r) {
      Require(assembler.in_progress(), "an unfinished message is in progress");
      continue;
    }
    Message m = assembler.TakeMessage();
    Require(!assembler.in_progress() && assembler.allocated_bytes() == 0, "taken whole");
    Require(static_cast<uint16_t>(m.type) == type, "the message has its first frame's type");
    Require(m.payload.size() == declared, "a complete message has its declared size");
    Require(m.fd.valid() == first_had_fd, "the message carries its first frame's descriptor");
    CheckDecoders(m.payload);
    received = 0;
  }
  return 0;
}
