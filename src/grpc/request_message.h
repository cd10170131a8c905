// A request message as gRPC received it, read into its protobuf: inflated
// here when compressed, within a limit, never whole first.
//
// gRPC is told not to inflate (grpc.per_message_decompression off): grpc 1.51
// inflates a compressed message whole and only then compares it with the
// message limit, so 1 MB of gzip on the wire held 1 GB. Its bytes therefore
// arrive as they were sent. A compressed message is known by its first bytes,
// which no message of the KServe protocol begins with: gzip's magic (1f 8b,
// which would be a field with wire type 7, which does not exist) or a zlib
// header (what gRPC calls deflate). Such a message is inflated twice: once
// keeping nothing, to measure it (past `limit` it is refused), then, once its
// bytes are taken from the caller's budget, into the protobuf. A message that
// only looks like zlib and does not inflate is read as it is.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <functional>

#include "hearth/status.h"

namespace google::protobuf {
class Message;
}

namespace hearth {

// Takes bytes from the caller's budget (ResourceExhausted past it).
using TakeBytes = std::function<Status(uint64_t)>;

// Reads `message` into `out`. Every byte count `take` accepts is added to
// `*held` (the caller gives them back when the request is done, whatever this
// returns). What is held: the message's size for one sent as it is; for a
// compressed one, twice its inflated size while it is read (the inflated
// bytes and the protobuf), then the protobuf's (`*held` says which).
// ResourceExhausted for a message that inflates past `limit` bytes or that
// the budget refuses; InvalidArgument for one that is not valid gzip, or not
// a protobuf of `out`'s type.
Status ReadRequestMessage(const grpc::ByteBuffer& message, uint64_t limit, const TakeBytes& take,
                          const std::function<void(uint64_t)>& give, uint64_t* held,
                          google::protobuf::Message* out);

}  // namespace hearth
