// What the store keeps for one client connection: the socket, the peer's
// credentials, the message being assembled, the replies not sent yet, the
// descriptors the peer has not read, and the leases it holds.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "hearth/unique_fd.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "store/registry.h"

namespace hearth::store {

using Clock = std::chrono::steady_clock;

struct OutgoingFrame {
  std::vector<std::byte> bytes;
  UniqueFd fd;
};

// One client. Registered edge-triggered for input and output: `readable`
// remembers input the loop has not drained yet (it may stop reading a
// connection on purpose), and an output edge, which comes each time the peer
// reads a reply, is how the store learns that sent descriptors were taken.
struct Connection {
  uint64_t id = 0;
  UniqueFd fd;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  protocol::FrameAssembler assembler;
  size_t partial_charged = 0;  // assembler bytes counted in EventLoop::partial_bytes_
  std::deque<OutgoingFrame> out;
  size_t queued_bytes = 0;
  size_t queued_fds = 0;     // descriptors in `out`
  size_t in_flight_fds = 0;  // sent, not yet known to be read by the peer
  // An attach that waits for the store-wide descriptor cap; while it is set
  // nothing more is read from the connection.
  std::optional<protocol::AttachRequest> deferred;
  Clock::time_point deferred_since;
  // When the peer last took something the store holds for it (a reply sent
  // or a descriptor seen read), or when it began to hold something.
  Clock::time_point last_progress;
  // Why the store stopped reading this connection, counted once per pause.
  enum class Pause {
    kNone,
    kAttachWaits,
    kDescriptors,
    kQueuedBytes,
    kStoreQueuedBytes
  } paused = Pause::kNone;
  bool readable = true;
  bool hung_up = false;
  bool in_ready = false;
  std::vector<Lease> leases;
};

// The open connections by id.
using Connections = std::unordered_map<uint64_t, std::unique_ptr<Connection>>;

}  // namespace hearth::store
