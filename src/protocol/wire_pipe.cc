// The wire format's transport on Windows (protocol/wire.h): each frame of
// the protocol is one platform::Channel frame, after a u64 handle value.
//
// A handle value is only a number to the receiver: what it names in the
// receiver's process is whatever the sender made there with DuplicateHandle.
// So nothing here closes one; the caller that expects a handle (the attach
// client, of a checked store) takes it, and one that does not refuses the
// message without touching the value (it may name one of its own handles).
#include <cstring>

#include "platform/local_channel.h"
#include "protocol/wire.h"

namespace hearth::protocol {

Status Send(platform::Channel& channel, MessageType type, std::span<const std::byte> payload,
            uint64_t handle) {
  if (payload.size() > kMaxMessageBytes)
    return ResourceExhausted("message of " + std::to_string(payload.size()) +
                             " bytes exceeds the protocol limit");
  const auto frames = EncodeFrames(type, payload);
  std::vector<std::byte> framed;
  for (size_t i = 0; i < frames.size(); ++i) {
    const uint64_t h = i == 0 ? handle : 0;
    framed.resize(8 + frames[i].size());
    for (int b = 0; b < 8; ++b) framed[b] = std::byte((h >> (8 * b)) & 0xff);
    std::memcpy(framed.data() + 8, frames[i].data(), frames[i].size());
    RETURN_IF_ERROR(channel.Send(framed));
  }
  return Status::Ok();
}

Result<Message> Receive(platform::Channel& channel, uint32_t max_message_bytes) {
  FrameAssembler assembler;
  uint64_t first_handle = 0;
  for (bool first = true;; first = false) {
    ASSIGN_OR_RETURN(std::vector<std::byte> framed, channel.Receive(kMaxChannelFrame));
    if (framed.size() < 8 + kFrameHeaderBytes)
      return InvalidArgument("a frame of " + std::to_string(framed.size()) +
                             " bytes, shorter than a handle field and a frame header");
    uint64_t handle = 0;
    for (int b = 7; b >= 0; --b) handle = (handle << 8) | std::to_integer<uint64_t>(framed[b]);
    if (!first && handle != 0) return InvalidArgument("a handle sent with a continuation frame");
    if (first) {
      first_handle = handle;
      uint32_t total = 0;
      for (int b = 3; b >= 0; --b) total = (total << 8) | std::to_integer<uint32_t>(framed[16 + b]);
      if (total > max_message_bytes)
        return InvalidArgument("a message of " + std::to_string(total) +
                               " bytes, more than the limit of " +
                               std::to_string(max_message_bytes));
    }
    ASSIGN_OR_RETURN(const bool complete, assembler.Add(std::span(framed).subspan(8), UniqueFd()));
    if (complete) {
      Message m = assembler.TakeMessage();
      m.handle = first_handle;
      return m;
    }
  }
}

}  // namespace hearth::protocol
