// The weight store: owns each model version's arena and hands read-only
// descriptors of it to attaching processes over a Unix socket.
//
// Protocol: docs/protocol.md. The connection is the lease: the store counts a
// client's attachments while its connection is open and ends them when it
// closes, for whatever reason (a crash included). An unloaded version leaves
// the registry at once; its arena lives until its last lease ends (and, for
// memory the kernel or driver still sees mapped, until the last mapping goes).
//
// Threading: Run() is the event loop and must be called from one thread;
// Stop() may be called from any thread or a signal handler.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hearth/device.h"
#include "hearth/status.h"

namespace hearth {

struct StoreOptions {
  std::string socket_path;
  mode_t socket_mode = 0660;
  // Peers allowed besides the store's own uid (and root).
  std::vector<uid_t> allow_uids;
  std::vector<gid_t> allow_gids;
  Device device;
  // Loaded before Run() accepts anything: (name, checkpoint path).
  std::vector<std::pair<std::string, std::string>> models;
  // Reader threads for loading; 0 = automatic.
  int load_threads = 0;
  // Show loading progress on stderr when it is a terminal.
  bool show_progress = true;
};

class Store {
 public:
  // Loads every model in options.models, then binds the socket (creating its
  // directory 0750 if missing). Fails if another store answers at the path;
  // a stale socket file is replaced.
  static Result<std::unique_ptr<Store>> Create(StoreOptions options);
  ~Store();

  // Serves until Stop(); removes the socket file before returning.
  Status Run();
  // Async-signal-safe.
  void Stop();

 private:
  class Impl;
  explicit Store(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
