// Payloads of each message type; see docs/protocol.md for the byte layouts.
// Decoders check every length and count and that nothing is left over.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "hearth/manifest.h"
#include "hearth/status.h"
#include "protocol/wire.h"

namespace hearth::protocol {

struct AttachRequest {
  ModelRef model;
};
struct LoadRequest {
  std::string name;
  std::string path;
  // load-v2 only (since 1.2). Version of `name` to answer instead of loading,
  // if the store still holds it, read from this same `path`, and the files
  // there are unchanged since (0: none; load).
  uint64_t reuse_version = 0;
  // load-v2 only: load nothing; answer FAILED_PRECONDITION unless
  // reuse_version is reused. Needs a reuse_version.
  bool reuse_only = false;
};
// The answer to load-v2: the version, and whether it is the one the
// request named for reuse (nothing was read) or was loaded for it.
struct LoadedReply {
  ModelSummary model;
  bool reused = false;
};
struct UnloadRequest {
  ModelRef model;  // version 0: every version of the model
};

std::vector<std::byte> EncodeError(const Status& status);
// The Status the peer sent (never OK).
Status DecodeError(std::span<const std::byte> payload);

std::vector<std::byte> EncodeAttach(const AttachRequest& r);
Result<AttachRequest> DecodeAttach(std::span<const std::byte> payload);

std::vector<std::byte> EncodeManifest(const Manifest& m);
// Decodes and runs ValidateManifest.
Result<Manifest> DecodeManifest(std::span<const std::byte> payload);

std::vector<std::byte> EncodeModelList(const std::vector<ModelSummary>& models);
Result<std::vector<ModelSummary>> DecodeModelList(std::span<const std::byte> payload);

// status-reply (protocol 1.0: no lease_total, no counters) and
// status-reply-v2 (the same, then `u64 lease_total` and the counters).
std::vector<std::byte> EncodeStatus(const StoreStatus& s);
Result<StoreStatus> DecodeStatus(std::span<const std::byte> payload);
std::vector<std::byte> EncodeStatusV2(const StoreStatus& s);
Result<StoreStatus> DecodeStatusV2(std::span<const std::byte> payload);

std::vector<std::byte> EncodeLoad(const LoadRequest& r);
Result<LoadRequest> DecodeLoad(std::span<const std::byte> payload);

std::vector<std::byte> EncodeLoaded(const ModelSummary& m);
Result<ModelSummary> DecodeLoaded(std::span<const std::byte> payload);

// load-v2: `str name, str path, u64 reuse_version, u8 flags` (bit 0:
// reuse_only; the other bits must be 0). Checked as `load` is, and
// reuse_only needs a reuse_version.
std::vector<std::byte> EncodeLoadV2(const LoadRequest& r);
Result<LoadRequest> DecodeLoadV2(std::span<const std::byte> payload);

// loaded-v2: a model summary, then `u8 reused` (0 or 1).
std::vector<std::byte> EncodeLoadedV2(const LoadedReply& r);
Result<LoadedReply> DecodeLoadedV2(std::span<const std::byte> payload);

std::vector<std::byte> EncodeUnload(const UnloadRequest& r);
Result<UnloadRequest> DecodeUnload(std::span<const std::byte> payload);

std::vector<std::byte> EncodeUnloaded(uint32_t versions_removed);
Result<uint32_t> DecodeUnloaded(std::span<const std::byte> payload);

// Requests with no payload (list-models, status) must have an empty payload.
Status CheckEmpty(std::span<const std::byte> payload, const char* message_name);

}  // namespace hearth::protocol
