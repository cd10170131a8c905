#include "store/limits.h"

#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <algorithm>

namespace hearth::store {
namespace {

using std::chrono::milliseconds;

// Descriptors kept out of the automatic limits for the store itself (stdio,
// epoll, eventfds, the listener and its directory, arenas, checkpoint files).
constexpr size_t kDescriptorReserve = 64;
constexpr size_t kMaxAutomaticConnections = 4096;

size_t DescriptorLimit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return size_t{1} << 20;
  return static_cast<size_t>(rl.rlim_cur);
}

}  // namespace

StoreLimits ResolveLimits(const StoreOptions& options) {
  StoreLimits l;
  const size_t limit = DescriptorLimit();
  const size_t reserve = std::min(kDescriptorReserve, limit / 4);
  const size_t available = limit > reserve ? limit - reserve : 1;
  l.per_connection_fds = std::max<size_t>(1, options.max_unread_descriptors_per_connection);
  l.max_connections = options.max_connections > 0
                          ? options.max_connections
                          : std::clamp<size_t>(available / 2, 1, kMaxAutomaticConnections);
  l.max_unread_fds =
      options.max_unread_descriptors > 0
          ? options.max_unread_descriptors
          : std::max<size_t>(
                1, std::min(available > l.max_connections ? available - l.max_connections : 1,
                            l.max_connections * l.per_connection_fds));
  l.max_partial_bytes = options.max_partial_bytes;
  l.max_queued_bytes = std::max<size_t>(1, options.max_queued_bytes);
  l.max_leases_per_connection = std::max<size_t>(1, options.max_leases_per_connection);
  l.unread_timeout = std::max(options.unread_timeout, milliseconds(1));
  l.attach_wait_timeout = std::max(options.attach_wait_timeout, milliseconds(1));
  l.wait_check_interval = std::clamp(std::min(l.unread_timeout, l.attach_wait_timeout) / 4,
                                     milliseconds(5), milliseconds(1000));
  spdlog::info(
      "limits: {} connections, {} unread descriptors ({} per connection), {} bytes of "
      "unfinished messages, {} bytes of queued replies, {} leases per connection; unread for "
      "{} ms closes a connection while others wait, an attach waits {} ms at most; descriptor "
      "limit {}",
      l.max_connections, l.max_unread_fds, l.per_connection_fds, l.max_partial_bytes,
      l.max_queued_bytes, l.max_leases_per_connection, l.unread_timeout.count(),
      l.attach_wait_timeout.count(), limit);
  if (l.max_connections + l.max_unread_fds + reserve > limit)
    spdlog::warn(
        "{} connections and {} unread descriptors may need more than the descriptor limit of "
        "{}; accepts will back off when it is reached",
        l.max_connections, l.max_unread_fds, limit);
  return l;
}

}  // namespace hearth::store
