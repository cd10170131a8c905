#include "grpc/request_message.h"

#include <google/protobuf/message.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <array>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/compression.h"

namespace hearth {
namespace {

constexpr std::string_view kSubject = "the request message";

// The message's first two bytes (fewer for a shorter one).
std::string FirstBytes(const grpc::ByteBuffer& message) {
  std::string head;
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return head;
  for (const grpc::Slice& slice : slices) {
    const auto* begin = reinterpret_cast<const char*>(slice.begin());
    head.append(begin, std::min<size_t>(slice.size(), 2 - head.size()));
    if (head.size() == 2) break;
  }
  return head;
}

// The coding a message is compressed in, known by its first bytes.
std::optional<BodyCoding> CompressedAs(std::string_view head) {
  if (head.size() < 2) return std::nullopt;
  const auto b0 = static_cast<unsigned char>(head[0]);
  const auto b1 = static_cast<unsigned char>(head[1]);
  if (b0 == 0x1f && b1 == 0x8b) return BodyCoding::kGzip;
  // zlib (RFC 1950): method 8 (deflate), a window of at most 32 KiB, and a
  // check that makes the first two bytes a multiple of 31.
  if ((b0 & 0x0f) == 8 && (b0 >> 4) <= 7 && ((b0 << 8) | b1) % 31 == 0) {
    return BodyCoding::kDeflate;
  }
  return std::nullopt;
}

Status NotA(const google::protobuf::Message& out) {
  return InvalidArgument(std::string(kSubject) + " is not a valid " + out.GetTypeName());
}

Status ReadAsItIs(const grpc::ByteBuffer& message, const TakeBytes& take, uint64_t* held,
                  google::protobuf::Message* out) {
  const uint64_t size = message.Length();
  if (Status taken = take(size); !taken.ok()) return taken;
  *held += size;
  grpc::ByteBuffer shared(message);  // the same slices, counted
  grpc::ProtoBufferReader reader(&shared);
  if (!reader.status().ok() || !out->ParseFromZeroCopyStream(&reader)) return NotA(*out);
  return Status::Ok();
}

}  // namespace

Status ReadRequestMessage(const grpc::ByteBuffer& message, uint64_t limit, const TakeBytes& take,
                          const std::function<void(uint64_t)>& give, uint64_t* held,
                          google::protobuf::Message* out) {
  const std::optional<BodyCoding> coding = CompressedAs(FirstBytes(message));
  if (!coding.has_value()) return ReadAsItIs(message, take, held, out);
  const char* name = *coding == BodyCoding::kGzip ? "gzip" : "deflate";
  grpc::Slice flat;
  if (!message.DumpToSingleSlice(&flat).ok()) {
    return ResourceExhausted("out of memory reading " + std::string(kSubject));
  }
  const std::string_view compressed(reinterpret_cast<const char*>(flat.begin()), flat.size());
  // Measured first, keeping nothing.
  Result<uint64_t> size = InflatedSize(compressed, *coding, limit, kSubject);
  if (!size.ok()) {
    if (size.status().code() == StatusCode::kResourceExhausted) {
      return ResourceExhausted(std::string(kSubject) + " (" + name +
                               ") inflates past the limit of " + std::to_string(limit) + " bytes");
    }
    // A message that only began like zlib's header.
    if (*coding == BodyCoding::kDeflate) return ReadAsItIs(message, take, held, out);
    return size.status();
  }
  // The inflated bytes and the protobuf read from them, both held at once.
  if (Status taken = take(2 * *size); !taken.ok()) return taken;
  *held += 2 * *size;
  {
    Result<std::string> inflated = Inflate(compressed, *coding, *size, 0, kSubject);
    if (!inflated.ok()) return inflated.status();
    try {
      if (!out->ParseFromString(*inflated)) return NotA(*out);
    } catch (const std::bad_alloc&) {
      return ResourceExhausted("out of memory reading " + std::string(kSubject));
    }
  }
  give(*size);
  *held -= *size;
  return Status::Ok();
}

}  // namespace hearth
