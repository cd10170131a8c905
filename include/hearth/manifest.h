// What a store says about the models it holds: the manifest an attach gets,
// and the summaries `list` and `status` answer with. Shared by the store, the
// wire protocol and the attach client.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/device.h"
#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

// Every tensor starts at a multiple of this inside its arena (a manifest
// that says otherwise is refused).
inline constexpr uint64_t kArenaAlignment = 256;

struct ManifestTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // inside the arena, a multiple of kArenaAlignment
  uint64_t nbytes = 0;
};

// One model version as an attached process sees it.
struct Manifest {
  std::string model;
  uint64_t version = 0;
  Device device;
  uint64_t arena_size = 0;
  uint64_t checksum = 0;                // see hearth/checksum.h
  std::vector<ManifestTensor> tensors;  // sorted by name
};

// Checks everything a peer could get wrong: names non-empty, unique and
// sorted; dtype and shape consistent with nbytes; every tensor aligned and
// inside the arena. An attach client runs this before it maps anything.
Status ValidateManifest(const Manifest& manifest);

// "NAME" or "NAME@VERSION" (VERSION a positive integer); version 0 means latest.
struct ModelRef {
  std::string name;
  uint64_t version = 0;
  static Result<ModelRef> Parse(std::string_view text);
  std::string ToString() const;
};

struct ModelSummary {
  std::string name;
  uint64_t version = 0;
  Device device;
  std::string path;  // the checkpoint it was loaded from
  uint64_t arena_size = 0;
  uint32_t tensor_count = 0;
  uint64_t tensor_bytes = 0;
  uint64_t checksum = 0;
  uint32_t attached = 0;     // open leases
  int64_t loaded_at_ms = 0;  // Unix time
};

// One attachment (lease) held by a connected client.
struct LeaseInfo {
  int32_t pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
  std::string model;
  uint64_t version = 0;
  int64_t since_ms = 0;  // Unix time
};

// An arena the store still owns: registered, or unloaded but still attached.
struct ArenaInfo {
  std::string model;
  uint64_t version = 0;
  Device device;
  uint64_t bytes = 0;
  bool registered = true;
  uint32_t attached = 0;
};

struct StoreStatus {
  int32_t pid = 0;
  Device device;
  uint32_t connections = 0;
  // At most the store's max_status_leases of them; lease_total counts all.
  std::vector<LeaseInfo> leases;
  std::vector<ArenaInfo> arenas;
  // From a store of protocol 1.1 (status-v2); from an older one, leases.size().
  uint64_t lease_total = 0;
  // The store's counters by name (docs/protocol.md lists them); empty from a
  // store of protocol 1.0.
  std::map<std::string, uint64_t> counters;
};

}  // namespace hearth
