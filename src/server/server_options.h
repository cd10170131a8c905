// What `hearth serve` is told: the repository, devices, workers, limits and
// who may use shared memory. Apart from the Server so that what it runs (a
// worker's supervisor) need not know the Server.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hearth/device.h"

namespace hearth {

struct ServerOptions {
  std::string repository;
  // cpu, or cuda:N: KIND_GPU instances go to the GPUs their instance
  // groups list (each loaded once per GPU), to N where they list none.
  Device device;
  // > 0: the workers of each placement (per GPU, and on the host),
  // overriding every instance_group.count.
  int workers = 0;
  // For tests and CI, on machines without GPUs: > 0 makes GPU ordinals 0
  // to stand_in_gpus - 1 exist, each backed by host memory with a store of
  // its own ("hostN": <run dir>/store-hostN.sock, a memfd arena), so that
  // placement, per-device stores and workers, their metrics and the
  // handling of a failed device run for real without CUDA. `device` is then
  // the default GPU if it is cuda:N (else 0); nothing touches CUDA.
  int stand_in_gpus = 0;
  // Reader threads of each load into a device's store (0: the store's
  // automatic choice). The loads of a model's devices run at once, each
  // with this many.
  int load_threads = 0;
  std::string worker_path;  // the hearth-worker executable
  // The stores' sockets live here. Empty (the default): a new private
  // directory, $XDG_RUNTIME_DIR/hearth/serve-XXXXXX or /tmp/serve-XXXXXX,
  // removed at shutdown. Else this one, created 0700 if missing and refused
  // unless it is ours, not a symlink, and writable by nobody else.
  std::string run_dir;
  int exec_timeout_ms = 60000;  // a batch running longer kills its worker
  // A worker that has not said ready by then is killed (and restarted);
  // Start() waits at most this long for the models to come up.
  int ready_timeout_ms = 300000;
  // Triton's strict readiness: the server is ready only while every model of
  // the repository (but those unloaded) is served with a worker ready. Off:
  // ready while every served model has a worker ready, whatever failed.
  bool strict_readiness = true;
  // The users whose processes on this machine may register shared memory
  // (system and CUDA regions; server/shared_memory.h says what else is
  // checked). Unset: the server's own user. Empty: shared memory is off.
  std::optional<std::vector<uid_t>> shared_memory_users;
};

}  // namespace hearth
