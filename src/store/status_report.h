// The store's status reply (status and status-v2, docs/protocol.md): its
// connections and the leases they hold, the arenas it holds, and its counters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "hearth/device.h"
#include "hearth/manifest.h"
#include "store/connection.h"
#include "store/registry.h"

namespace hearth::store {

// At most max_leases leases listed (the oldest connections' first is not
// promised: connections are in no order); lease_total counts all. `counters`
// are the store's counters with its current totals.
StoreStatus CollectStatus(const Device& device, size_t max_leases, const Connections& connections,
                          Registry& registry, std::map<std::string, uint64_t> counters);

}  // namespace hearth::store
