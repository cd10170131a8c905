// Compression with zlib: gzip and deflate (zlib's format, as HTTP's and
// gRPC's "deflate" are and as tritonclient sends it). HTTP's Content-Encoding
// of request bodies and Accept-Encoding for responses; inflation within a
// limit for request bodies and gRPC messages alike. Pure functions,
// thread-safe, never throw. `subject` names what is inflated in errors
// ("the request body is not valid gzip data: ...").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "hearth/status.h"

namespace hearth {

enum class BodyCoding { kIdentity, kGzip, kDeflate };

// The request's Content-Encoding; nullopt for one not supported (one coding
// only, case-insensitive; empty or "identity" is kIdentity).
std::optional<BodyCoding> ParseContentEncoding(std::string_view value);

// The coding to answer in for an Accept-Encoding header: gzip when it is
// accepted, else deflate, else identity ("q=0" refuses a coding).
BodyCoding ChooseResponseCoding(std::string_view accept_encoding);

// The size `body` inflates to, without keeping the bytes, so that it can
// be checked (and budgeted) before it is held. ResourceExhausted when it is
// over `limit`, InvalidArgument for a body that is not valid `coding` data.
Result<uint64_t> InflatedSize(std::string_view body, BodyCoding coding, uint64_t limit,
                              std::string_view subject = "the request body");

// Inflates `body`, whose InflatedSize is `size`, into a string with
// capacity for `padding` bytes more.
Result<std::string> Inflate(std::string_view body, BodyCoding coding, uint64_t size, size_t padding,
                            std::string_view subject = "the request body");

// Compresses `body` in `coding` (not kIdentity).
Result<std::string> Deflate(std::string_view body, BodyCoding coding);

}  // namespace hearth
