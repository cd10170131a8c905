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

std::vector<std::byte> EncodeUnload(const UnloadRequest& r);
Result<UnloadRequest> DecodeUnload(std::span<const std::byte> payload);

std::vector<std::byte> EncodeUnloaded(uint32_t versions_removed);
Result<uint32_t> DecodeUnloaded(std::span<const std::byte> payload);

// Requests with no payload (list-models, status) must have an empty payload.
Status CheckEmpty(std::span<const std::byte> payload, const char* message_name);

}  // namespace hearth::protocol
