#include "protocol/wire.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace hearth::protocol {

const char* MessageTypeName(MessageType type) {
  switch (type) {
    case MessageType::kError:
      return "error";
    case MessageType::kListModels:
      return "list-models";
    case MessageType::kModelList:
      return "model-list";
    case MessageType::kAttach:
      return "attach";
    case MessageType::kManifest:
      return "manifest";
    case MessageType::kStatus:
      return "status";
    case MessageType::kStatusReply:
      return "status-reply";
    case MessageType::kLoad:
      return "load";
    case MessageType::kLoaded:
      return "loaded";
    case MessageType::kUnload:
      return "unload";
    case MessageType::kUnloaded:
      return "unloaded";
    case MessageType::kStatusV2:
      return "status-v2";
    case MessageType::kStatusReplyV2:
      return "status-reply-v2";
    case MessageType::kLoadV2:
      return "load-v2";
    case MessageType::kLoadedV2:
      return "loaded-v2";
  }
  return "unknown";
}

bool IsKnownMessageType(uint16_t type) {
  return type >= static_cast<uint16_t>(MessageType::kError) &&
         type <= static_cast<uint16_t>(MessageType::kLoadedV2);
}

void PayloadWriter::Raw(const void* p, size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  bytes_.insert(bytes_.end(), b, b + n);
}
void PayloadWriter::U16(uint16_t v) {
  unsigned char b[2] = {static_cast<unsigned char>(v), static_cast<unsigned char>(v >> 8)};
  Raw(b, 2);
}
void PayloadWriter::U32(uint32_t v) {
  unsigned char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  Raw(b, 4);
}
void PayloadWriter::U64(uint64_t v) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
  Raw(b, 8);
}
void PayloadWriter::Str(std::string_view s) {
  U32(static_cast<uint32_t>(s.size()));
  Raw(s.data(), s.size());
}

bool PayloadReader::Take(void* out, size_t n, const char* field) {
  if (!status_.ok()) {
    std::memset(out, 0, n);
    return false;
  }
  if (bytes_.size() - pos_ < n) {
    status_ =
        InvalidArgument(std::string("field '") + field + "' runs past the end of the message");
    std::memset(out, 0, n);
    return false;
  }
  std::memcpy(out, bytes_.data() + pos_, n);
  pos_ += n;
  return true;
}

uint8_t PayloadReader::U8(const char* field) {
  uint8_t v;
  Take(&v, 1, field);
  return v;
}
uint16_t PayloadReader::U16(const char* field) {
  unsigned char b[2];
  Take(b, 2, field);
  return static_cast<uint16_t>(b[0] | (b[1] << 8));
}
uint32_t PayloadReader::U32(const char* field) {
  unsigned char b[4];
  Take(b, 4, field);
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}
uint64_t PayloadReader::U64(const char* field) {
  unsigned char b[8];
  Take(b, 8, field);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}
std::string PayloadReader::Str(const char* field) {
  const uint32_t n = U32(field);
  if (!status_.ok()) return {};
  if (n > kMaxStringBytes || bytes_.size() - pos_ < n) {
    status_ = InvalidArgument(std::string("string '") + field + "' of " + std::to_string(n) +
                              " bytes does not fit the message");
    return {};
  }
  std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
  pos_ += n;
  return s;
}
uint32_t PayloadReader::Count(const char* field, size_t min_item_bytes) {
  const uint32_t n = U32(field);
  if (status_.ok() && min_item_bytes > 0 && n > (bytes_.size() - pos_) / min_item_bytes) {
    status_ = InvalidArgument(std::string("count '") + field + "' = " + std::to_string(n) +
                              " is more than the message can hold");
    return 0;
  }
  return n;
}
Status PayloadReader::Finish(std::string_view message_name) const {
  if (!status_.ok()) return status_.WithContext(std::string(message_name) + " message");
  if (pos_ != bytes_.size())
    return InvalidArgument(std::string(message_name) + " message has " +
                           std::to_string(bytes_.size() - pos_) + " trailing bytes");
  return Status::Ok();
}

namespace {

void PutU16(std::byte* p, uint16_t v) {
  p[0] = std::byte(v & 0xff);
  p[1] = std::byte(v >> 8);
}
void PutU32(std::byte* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = std::byte((v >> (8 * i)) & 0xff);
}
uint16_t GetU16(const std::byte* p) {
  return static_cast<uint16_t>(std::to_integer<unsigned>(p[0]) |
                               (std::to_integer<unsigned>(p[1]) << 8));
}
uint32_t GetU32(const std::byte* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | std::to_integer<uint32_t>(p[i]);
  return v;
}

}  // namespace

std::vector<std::vector<std::byte>> EncodeFrames(MessageType type,
                                                 std::span<const std::byte> payload) {
  std::vector<std::vector<std::byte>> frames;
  size_t offset = 0;
  do {
    const size_t n = std::min(kMaxFramePayload, payload.size() - offset);
    std::vector<std::byte> frame(kFrameHeaderBytes + n);
    PutU32(frame.data(), kMagic);
    PutU16(frame.data() + 4, kVersion);
    PutU16(frame.data() + 6, static_cast<uint16_t>(type));
    PutU32(frame.data() + 8, static_cast<uint32_t>(payload.size()));
    PutU32(frame.data() + 12, static_cast<uint32_t>(offset));
    if (n > 0) std::memcpy(frame.data() + kFrameHeaderBytes, payload.data() + offset, n);
    frames.push_back(std::move(frame));
    offset += n;
  } while (offset < payload.size());
  return frames;
}

Result<bool> FrameAssembler::Add(std::span<const std::byte> frame, UniqueFd fd) {
  Result<bool> r = AddChecked(frame, std::move(fd));
  if (!r.ok()) {
    // Nothing of a broken message is kept: the caller's budget sees it freed.
    message_ = Message{};
    started_ = false;
    total_ = 0;
  }
  return r;
}

Result<bool> FrameAssembler::AddChecked(std::span<const std::byte> frame, UniqueFd fd) {
  if (frame.size() < kFrameHeaderBytes)
    return InvalidArgument("truncated frame: " + std::to_string(frame.size()) +
                           " bytes, shorter than the 16-byte header");
  const uint32_t magic = GetU32(frame.data());
  const uint16_t version = GetU16(frame.data() + 4);
  const uint16_t type = GetU16(frame.data() + 6);
  const uint32_t total = GetU32(frame.data() + 8);
  const uint32_t offset = GetU32(frame.data() + 12);
  const size_t n = frame.size() - kFrameHeaderBytes;
  if (magic != kMagic) return InvalidArgument("bad magic: not a hearth protocol frame");
  if (version != kVersion)
    return InvalidArgument("protocol version " + std::to_string(version) +
                           " is not supported (this side speaks version " +
                           std::to_string(kVersion) + ")");
  if (!IsKnownMessageType(type))
    return InvalidArgument("unknown message type " + std::to_string(type));
  if (total > kMaxMessageBytes)
    return InvalidArgument("message of " + std::to_string(total) + " bytes exceeds the limit of " +
                           std::to_string(kMaxMessageBytes));
  if (n > kMaxFramePayload) return InvalidArgument("frame payload exceeds the frame limit");
  if (!started_) {
    if (offset != 0) return InvalidArgument("first frame of a message must start at offset 0");
    message_ = Message{};
    message_.type = static_cast<MessageType>(type);
    message_.fd = std::move(fd);
    total_ = total;
    started_ = true;
  } else {
    if (fd.valid()) return InvalidArgument("descriptor sent with a continuation frame");
    if (static_cast<MessageType>(type) != message_.type || total != total_ ||
        offset != message_.payload.size())
      return InvalidArgument("continuation frame does not continue the message in progress");
  }
  if (n > total_ - message_.payload.size())
    return InvalidArgument("frame carries more bytes than its message's declared length");
  if (n == 0 && message_.payload.size() < total_)
    return InvalidArgument("empty continuation frame");
  std::vector<std::byte>& payload = message_.payload;
  if (payload.capacity() - payload.size() < n) {
    // Doubling keeps appends amortised O(1); the declared total caps it, so a
    // complete message costs no more than its size.
    const size_t want = std::max(payload.size() + n, 2 * payload.capacity());
    payload.reserve(std::min<size_t>(want, total_));
  }
  payload.insert(payload.end(), frame.begin() + kFrameHeaderBytes, frame.end());
  return message_.payload.size() == total_;
}

Message FrameAssembler::TakeMessage() {
  started_ = false;
  total_ = 0;
  Message m = std::move(message_);
  message_ = Message{};
  return m;
}

}  // namespace hearth::protocol
