#include "store/registry.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <utility>

namespace hearth::store {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

ModelVersion::~ModelVersion() {
  if (held == nullptr) return;
  held->arenas -= 1;
  held->bytes -= counted_bytes;
}

ModelSummary ModelVersion::Summary() const {
  ModelSummary s;
  s.name = name;
  s.version = version;
  s.device = manifest.device;
  s.path = path;
  s.arena_size = manifest.arena_size;
  s.tensor_count = static_cast<uint32_t>(manifest.tensors.size());
  for (const ManifestTensor& t : manifest.tensors) s.tensor_bytes += t.nbytes;
  s.checksum = manifest.checksum;
  s.attached = leases;
  s.loaded_at_ms = loaded_at_ms;
  return s;
}

const ModelVersion& Registry::Register(const std::string& name, const std::string& path,
                                       LoadedModel loaded) {
  auto v = std::make_shared<ModelVersion>();
  v->name = name;
  v->version = ++last_version_[name];
  v->path = path;
  v->fingerprint = std::move(loaded.fingerprint);
  v->arena = std::move(loaded.arena);
  v->manifest = std::move(loaded.manifest);
  v->manifest.model = name;
  v->manifest.version = v->version;
  v->loaded_at_ms = NowMs();
  v->held = held_;
  v->counted_bytes = v->manifest.arena_size;
  held_->arenas += 1;
  held_->bytes += v->counted_bytes;
  registry_[name][v->version] = v;
  all_versions_.push_back(v);
  return *v;
}

std::shared_ptr<ModelVersion> Registry::Find(const ModelRef& ref) const {
  auto it = registry_.find(ref.name);
  if (it == registry_.end() || it->second.empty()) return nullptr;
  if (ref.version == 0) return it->second.rbegin()->second;
  auto v = it->second.find(ref.version);
  return v == it->second.end() ? nullptr : v->second;
}

Result<uint32_t> Registry::Unload(const ModelRef& ref) {
  auto it = registry_.find(ref.name);
  if (it == registry_.end()) return NotFound("no model '" + ref.name + "' in this store");
  uint32_t removed = 0;
  for (auto v = it->second.begin(); v != it->second.end();) {
    if (ref.version == 0 || v->first == ref.version) {
      v->second->registered = false;
      spdlog::info("unloaded {}@{} ({} leases remain)", v->second->name, v->second->version,
                   v->second->leases);
      v = it->second.erase(v);
      ++removed;
    } else {
      ++v;
    }
  }
  if (it->second.empty()) registry_.erase(it);
  if (removed == 0) return NotFound("no model '" + ref.ToString() + "' in this store");
  PruneRetired();
  return removed;
}

std::vector<ModelSummary> Registry::Summaries() const {
  std::vector<ModelSummary> models;
  for (const auto& [name, versions] : registry_)
    for (const auto& [version, v] : versions) models.push_back(v->Summary());
  return models;
}

std::vector<std::shared_ptr<ModelVersion>> Registry::HeldVersions() {
  PruneRetired();
  std::vector<std::shared_ptr<ModelVersion>> held;
  for (const auto& w : all_versions_) {
    if (auto v = w.lock()) held.push_back(std::move(v));
  }
  return held;
}

void Registry::PruneRetired() {
  std::erase_if(all_versions_, [](const std::weak_ptr<ModelVersion>& w) { return w.expired(); });
}

void Registry::Clear() { registry_.clear(); }

}  // namespace hearth::store
