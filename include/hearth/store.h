// The weight store: owns each model version's arena and hands read-only
// descriptors of it to attaching processes over a Unix socket.
//
// Protocol: docs/protocol.md. The connection is the lease: the store counts a
// client's attachments while its connection is open and ends them when it
// closes, for whatever reason (a crash included). An unloaded version leaves
// the registry at once; its arena lives until its last lease ends (and, for
// memory the kernel or driver still sees mapped, until the last mapping goes).
//
// The socket lives in a directory the store trusts (ours, not a symlink, not
// writable by group or others; see common/trusted_path.h); a directory that
// fails the check is refused with an error naming it, its owner and its mode.
//
// Limits: every resource a client can make the store hold is bounded by the
// options below (connections, leases, descriptors exported but not yet read,
// bytes of unfinished messages and of queued replies, how long a client may
// leave them unread while others wait); see docs/protocol.md for what a
// client sees. The status reply (status-v2) reports the store's counters of
// what it held and refused.
//
// Threading: Run() is the event loop and must be called from one thread;
// Stop() may be called from any thread or a signal handler.
//
// On Windows (store_windows.cc, docs/windows.md) the store listens on a
// per-user named pipe (platform/local_channel.h) whose name, 1 to 64 of
// [A-Za-z0-9._-], is socket_path; each client is served by a thread of its
// own, at most max_connections of them, and an attach's answer carries a
// section handle duplicated into the client's process with read access
// only. Only host arenas are served there; the per-connection descriptor
// and queue limits have nothing to bound (nothing is queued in the store),
// and a client's message is at most max_partial_bytes / max_connections.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hearth/device.h"
#include "hearth/status.h"

namespace hearth {

struct StoreOptions {
  std::string socket_path;  // on Windows, the pipe's name
#ifndef _WIN32
  mode_t socket_mode = 0660;
  // Peers allowed besides the store's own uid (and root).
  std::vector<uid_t> allow_uids;
  std::vector<gid_t> allow_gids;
#endif
  Device device;
  // Loaded before Run() accepts anything: (name, checkpoint path).
  std::vector<std::pair<std::string, std::string>> models;
  // Reader threads for loading; 0 = automatic.
  int load_threads = 0;
  // Show loading progress on stderr when it is a terminal.
  bool show_progress = true;

  // Connections served at once. A connection past it is answered
  // RESOURCE_EXHAUSTED and closed at once. 0 = automatic: half of what the
  // descriptor limit (RLIMIT_NOFILE) leaves after a reserve of 64, at most 4096
  // (on Windows: 64).
  size_t max_connections = 0;
  // Exported descriptors a peer has not read yet (queued in the store, or
  // sent and still in its socket). At this many the store stops reading the
  // connection's requests until the peer reads its answers (backpressure).
  size_t max_unread_descriptors_per_connection = 4;
  // The same across all connections: at the cap, attach requests wait (their
  // connections are not read) until descriptors are read. 0 = automatic: what
  // the descriptor limit leaves after the reserve and max_connections.
  size_t max_unread_descriptors = 0;
  // Heap bytes of unfinished messages across all connections. A peer whose
  // frame takes the total past it gets RESOURCE_EXHAUSTED and is closed.
  size_t max_partial_bytes = size_t{64} << 20;
  // Leases (successful attaches) one connection may hold; an attach past it
  // is answered RESOURCE_EXHAUSTED. AttachClient uses one per connection.
  size_t max_leases_per_connection = 1024;
  // Bytes of replies queued in the store across all connections (besides the
  // 1 MiB per connection). At it, no connection's requests are read until
  // peers have read enough.
  size_t max_queued_bytes = size_t{64} << 20;
  // While attaches wait for max_unread_descriptors, or reads wait for
  // max_queued_bytes, a connection whose peer has read nothing of what it
  // holds (descriptors, queued replies) for this long is closed, with a log
  // line saying why: a client that never reads cannot starve the others.
  std::chrono::milliseconds unread_timeout = std::chrono::seconds(10);
  // An attach that has waited this long for max_unread_descriptors is
  // answered RESOURCE_EXHAUSTED.
  std::chrono::milliseconds attach_wait_timeout = std::chrono::seconds(30);
  // Leases listed in a status reply; the reply counts all of them.
  size_t max_status_leases = 1024;

  // Set (a signal handler may do it) to stop Create() while it loads
  // `models`: the load in progress stops between two blocks and Create()
  // fails with kUnavailable saying it was interrupted; no socket is left.
  const std::atomic<bool>* cancel = nullptr;
};

// A store's device as `hearth store --device` and hearth.attach(device=)
// name it: "cpu", "cuda" (cuda:0), "cuda:N", or "hostN", host memory
// standing in for GPU N (a store of its own on a machine without GPUs, for
// tests and CI: hearth serve --stand-in-gpus places GPU N's instances there).
struct StoreDevice {
  std::string name;  // canonical: "cpu", "cuda:N", "hostN"
  Device memory;     // where the arenas are: the host for cpu and hostN
  friend bool operator==(const StoreDevice&, const StoreDevice&) = default;
};
Result<StoreDevice> ParseStoreDevice(std::string_view text);
// A comma-separated list of them, each at most once, at most kMaxStoreDevices.
inline constexpr size_t kMaxStoreDevices = 64;
Result<std::vector<StoreDevice>> ParseStoreDevices(std::string_view list);

// The socket of one device's store among several: `base` with "-NAME"
// (the device's name without its ':') before a final ".sock", or after it:
// ("/run/h/store.sock", "cuda:1") -> "/run/h/store-cuda1.sock". hearth
// serve's stores are <run dir>/store-cpu.sock, store-cuda0.sock, ...;
// `hearth store --device cuda:0,cuda:1 --socket S` binds one per device so.
std::string DeviceSocketPath(std::string_view base, std::string_view device_name);

class Store {
 public:
  // Checks (and creates, 0750, if missing) the socket's directory, loads
  // every model in options.models, then binds the socket. Fails if another
  // store answers at the path or the path is something other than a socket;
  // a stale socket file is replaced atomically.
  static Result<std::unique_ptr<Store>> Create(StoreOptions options);
  ~Store();

  // Serves until Stop(); removes the socket file before returning.
  Status Run();
  // Async-signal-safe.
  void Stop();
  // Makes every load asked for over the socket fail with kUnavailable: one
  // running stops between two blocks, one waiting its turn (and any asked
  // for later) is answered so without reading the file. For an owner that
  // is shutting down and must not wait out a large checkpoint. Any thread.
  void CancelLoads();

  // What this store holds now: its arenas (registered versions, and
  // unloaded ones whose last lease has not ended) and their bytes, counted
  // by the store itself. Any thread.
  struct Held {
    uint64_t arenas = 0;
    uint64_t bytes = 0;
  };
  Held HeldArenas() const;

 private:
  class Impl;
  explicit Store(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
