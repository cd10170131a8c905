// The limits a store serves under: StoreOptions' with their automatic values
// resolved against the descriptor limit (RLIMIT_NOFILE) and their floors
// applied.
#pragma once

#include <chrono>
#include <cstddef>

#include "hearth/store.h"

namespace hearth::store {

struct StoreLimits {
  size_t max_connections = 0;
  size_t max_unread_fds = 0;
  size_t per_connection_fds = 0;
  size_t max_partial_bytes = 0;
  size_t max_queued_bytes = 0;
  size_t max_leases_per_connection = 0;
  std::chrono::milliseconds unread_timeout{0};
  std::chrono::milliseconds attach_wait_timeout{0};
  // How often waiting attaches and stalled connections are looked at.
  std::chrono::milliseconds wait_check_interval{1000};
};

// Logs the limits, and warns when they may need more descriptors than the
// process may open.
StoreLimits ResolveLimits(const StoreOptions& options);

}  // namespace hearth::store
