// The store <-> client wire format (documented in docs/protocol.md).
//
// Transport: an AF_UNIX SOCK_SEQPACKET connection. A message is one or more
// frames; each frame is a 16-byte header followed by up to kMaxFramePayload
// bytes of payload:
//
//   u32 magic ("HRTH" = 0x48545248 little-endian)  u16 version  u16 type
//   u32 total payload bytes of the message          u32 offset of this frame's payload
//
// A descriptor (SCM_RIGHTS) may travel with a message's first frame only.
// Integers are little-endian; strings are u32 length + bytes.
//
// On Windows the transport is a platform::Channel (a per-user named pipe,
// platform/local_channel.h): each frame above is one channel frame, after a
// u64 handle value (0: none). Only a message's first frame may carry one: a
// section handle the sender has already duplicated into the receiver's
// process (SCM_RIGHTS does that step on Linux).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

#ifdef _WIN32
namespace hearth::platform {
class Channel;
}  // namespace hearth::platform
#endif

namespace hearth::protocol {

inline constexpr uint32_t kMagic = 0x48545248;
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 16;
inline constexpr size_t kMaxFramePayload = 32 * 1024;
inline constexpr size_t kMaxMessageBytes = 16u << 20;
inline constexpr size_t kMaxStringBytes = 1u << 20;

enum class MessageType : uint16_t {
  kError = 1,
  kListModels = 2,
  kModelList = 3,
  kAttach = 4,
  kManifest = 5,
  kStatus = 6,
  kStatusReply = 7,
  kLoad = 8,
  kLoaded = 9,
  kUnload = 10,
  kUnloaded = 11,
  // Since store protocol 1.1: status with the total lease count and the
  // store's counters. A store of 1.0 refuses the type; clients then ask `status`.
  kStatusV2 = 12,
  kStatusReplyV2 = 13,
  // Since store protocol 1.2: load, reusing a version the store holds if
  // its files are unchanged. A store of 1.1 refuses the type; clients then
  // ask `load` (which never reuses).
  kLoadV2 = 14,
  kLoadedV2 = 15,
};
const char* MessageTypeName(MessageType type);
bool IsKnownMessageType(uint16_t type);

struct Message {
  MessageType type = MessageType::kError;
  std::vector<std::byte> payload;
  UniqueFd fd;  // received with SCM_RIGHTS, if any
#ifdef _WIN32
  uint64_t handle = 0;  // a handle value valid in this process, if any (0: none)
#endif
};

// Appends little-endian fields to a payload.
class PayloadWriter {
 public:
  void U8(uint8_t v) { Raw(&v, 1); }
  void U16(uint16_t v);
  void U32(uint32_t v);
  void U64(uint64_t v);
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(std::string_view s);
  std::vector<std::byte> Take() { return std::move(bytes_); }

 private:
  void Raw(const void* p, size_t n);
  std::vector<std::byte> bytes_;
};

// Reads fields back, bounds-checked: after the first overrun every read
// returns zero and status() names the field that did not fit.
class PayloadReader {
 public:
  explicit PayloadReader(std::span<const std::byte> bytes) : bytes_(bytes) {}
  uint8_t U8(const char* field);
  uint16_t U16(const char* field);
  uint32_t U32(const char* field);
  uint64_t U64(const char* field);
  int32_t I32(const char* field) { return static_cast<int32_t>(U32(field)); }
  int64_t I64(const char* field) { return static_cast<int64_t>(U64(field)); }
  std::string Str(const char* field);
  // A count of items each at least `min_item_bytes` long; fails if they cannot fit.
  uint32_t Count(const char* field, size_t min_item_bytes);
  // OK if nothing overran and every byte was consumed.
  Status Finish(std::string_view message_name) const;
  const Status& status() const { return status_; }
  // Marks the message malformed (keeps the first error).
  void Fail(std::string what) {
    if (status_.ok()) status_ = InvalidArgument(std::move(what));
  }

 private:
  bool Take(void* out, size_t n, const char* field);
  std::span<const std::byte> bytes_;
  size_t pos_ = 0;
  Status status_;
};

#ifdef _WIN32
// The transport on Windows (wire_pipe.cc). A channel frame is 8 bytes of
// handle value and one frame of the protocol.
inline constexpr uint32_t kMaxChannelFrame = 8 + kFrameHeaderBytes + kMaxFramePayload;
// Sends one message; `handle` (0: none) rides with its first frame.
// (Not SendMessage: windows.h makes that name a macro.)
Status Send(platform::Channel& channel, MessageType type, std::span<const std::byte> payload,
            uint64_t handle = 0);
// Receives channel frames until a whole message has arrived. A channel frame
// over kMaxChannelFrame, a bad header, a message declaring more than
// `max_message_bytes`, or a handle on a later frame fails with
// InvalidArgument naming it (the channel is then no longer usable); a peer
// that closed gives Unavailable.
Result<Message> Receive(platform::Channel& channel, uint32_t max_message_bytes = kMaxMessageBytes);
#else
// Sends one message (as many frames as it needs). `pass_fd` >= 0 travels with
// the first frame. Blocking; EINTR is retried; MSG_NOSIGNAL. A peer that has
// closed gives Unavailable (its last words may still be there to receive).
Status SendMessage(int socket, MessageType type, std::span<const std::byte> payload,
                   int pass_fd = -1);

// One sendmsg(2) of one frame, with `pass_fd` (>= 0) attached by SCM_RIGHTS;
// MSG_NOSIGNAL is added to `flags`. Returns what sendmsg returns (errno set).
ssize_t SendFrameOnce(int socket, std::span<const std::byte> frame, int pass_fd, int flags);
#endif

// Splits a message into frames, for senders that queue them (the store).
std::vector<std::vector<std::byte>> EncodeFrames(MessageType type,
                                                 std::span<const std::byte> payload);

// Reassembles frames into messages and checks every header.
//
// Memory grows with the bytes that really arrived, never with the total a
// first frame declares: a peer that announces 16 MiB and sends 32 KiB costs
// about 32 KiB. allocated_bytes() lets a caller charge an unfinished message
// against a budget shared by many peers.
class FrameAssembler {
 public:
  // Feeds one received frame. Returns true when a message is complete (then
  // TakeMessage()), false if more frames are needed, or an error that names
  // what is wrong with the frame (the message in progress is then dropped).
  Result<bool> Add(std::span<const std::byte> frame, UniqueFd fd);
  Message TakeMessage();

  // Whether a message has started and not yet completed.
  bool in_progress() const { return started_; }
  // Heap bytes held for the message in progress (or the completed one not
  // yet taken): at most twice the payload bytes received, and never more
  // than the declared total.
  size_t allocated_bytes() const { return message_.payload.capacity(); }

 private:
  Result<bool> AddChecked(std::span<const std::byte> frame, UniqueFd fd);

  Message message_;
  bool started_ = false;
  uint32_t total_ = 0;
};

#ifndef _WIN32
// Receives one frame (non-blocking sockets return Unavailable("would block")
// via *would_block). A peer that closed gives Unavailable "connection closed",
// or "connection reset" if it closed with input of ours unread (what it sent
// before closing can then still be received).
// The frame buffer must be kFrameHeaderBytes + kMaxFramePayload long; a larger
// frame is an error.
Result<size_t> ReceiveFrame(int socket, std::span<std::byte> buffer, UniqueFd* fd,
                            bool* would_block);

// Blocking: receives frames until a whole message has arrived. With a
// non-negative timeout, DEADLINE_EXCEEDED if the whole message has not
// arrived within it.
Result<Message> ReceiveMessage(int socket,
                               std::chrono::milliseconds timeout = std::chrono::milliseconds(-1));
#endif

}  // namespace hearth::protocol
