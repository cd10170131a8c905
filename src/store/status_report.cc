#include "store/status_report.h"

#include <unistd.h>

#include <utility>

namespace hearth::store {

StoreStatus CollectStatus(const Device& device, size_t max_leases, const Connections& connections,
                          Registry& registry, std::map<std::string, uint64_t> counters) {
  StoreStatus s;
  s.pid = ::getpid();
  s.device = device;
  s.connections = static_cast<uint32_t>(connections.size());
  for (const auto& [id, c] : connections) {
    s.lease_total += c->leases.size();
    for (const Lease& l : c->leases) {
      if (s.leases.size() >= max_leases) break;
      s.leases.push_back({c->pid, c->uid, c->gid, l.model->name, l.model->version, l.since_ms});
    }
  }
  s.counters = std::move(counters);
  for (const auto& v : registry.HeldVersions())
    s.arenas.push_back({v->name, v->version, v->manifest.device, v->arena->allocation_size(),
                        v->registered, v->leases});
  return s;
}

}  // namespace hearth::store
