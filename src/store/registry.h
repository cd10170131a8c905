// The models a store serves: each loaded version's arena and manifest, the
// versions' numbers, and the leases clients hold on them.
//
// A version is shared by the registry (while registered) and by every lease
// on it; the arena goes when the last of them lets go. Unload takes versions
// out of the registry at once; an unloaded version whose leases have not
// ended is still held, and counted, until they do.
//
// Threading: the event loop's thread only (and Store::Create before it
// runs), except Held(), which any thread may call.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hearth/arena.h"
#include "hearth/manifest.h"
#include "hearth/status.h"
#include "hearth/store.h"
#include "store/loader.h"

namespace hearth::store {

// Milliseconds since the epoch: when a version was loaded, when a lease began.
int64_t NowMs();

// The arenas a store holds and their bytes (Store::HeldArenas), read from
// any thread. Shared with each ModelVersion, which takes itself off when
// its arena goes, whenever that is.
struct HeldCount {
  std::atomic<uint64_t> arenas{0}, bytes{0};
};

// One loaded version of a model. Shared by the registry (while registered)
// and by every lease on it; the arena goes when the last of them lets go.
struct ModelVersion {
  ModelVersion() = default;
  ModelVersion(const ModelVersion&) = delete;
  ModelVersion& operator=(const ModelVersion&) = delete;
  ~ModelVersion();
  std::shared_ptr<HeldCount> held;
  uint64_t counted_bytes = 0;
  std::string name;
  uint64_t version = 0;
  std::string path;
  // Of the files loaded (LoadedModel::fingerprint): a load-v2 of the same
  // path whose files still have it reuses this version.
  std::string fingerprint;
  std::unique_ptr<Arena> arena;
  Manifest manifest;
  int64_t loaded_at_ms = 0;
  bool registered = true;
  uint32_t leases = 0;

  ModelSummary Summary() const;
};

// A client's hold on a version, for as long as its connection has it
// (counted in ModelVersion::leases by whoever adds or drops one).
struct Lease {
  std::shared_ptr<ModelVersion> model;
  int64_t since_ms;
};

class Registry {
 public:
  // Registers `loaded` as the next version of `name` (one past the last
  // version of that name this store has registered, unloaded or not).
  const ModelVersion& Register(const std::string& name, const std::string& path,
                               LoadedModel loaded);

  // The version `ref` names, its newest registered one for version 0;
  // null if there is none.
  std::shared_ptr<ModelVersion> Find(const ModelRef& ref) const;

  // Takes out of the registry the version `ref` names, or every version of
  // the name for version 0; returns how many. Leases on them stay valid.
  Result<uint32_t> Unload(const ModelRef& ref);

  // The registered versions, by name and version.
  std::vector<ModelSummary> Summaries() const;

  // Every version whose arena is still held: the registered ones, and
  // unloaded ones whose last lease has not ended.
  std::vector<std::shared_ptr<ModelVersion>> HeldVersions();

  // Forgets versions whose arenas are gone.
  void PruneRetired();

  // Unregisters everything; arenas that leases hold go with the leases.
  void Clear();

  // Any thread.
  Store::Held Held() const { return {held_->arenas.load(), held_->bytes.load()}; }

 private:
  std::map<std::string, std::map<uint64_t, std::shared_ptr<ModelVersion>>> registry_;
  std::map<std::string, uint64_t> last_version_;
  std::vector<std::weak_ptr<ModelVersion>> all_versions_;
  const std::shared_ptr<HeldCount> held_ = std::make_shared<HeldCount>();
};

}  // namespace hearth::store
