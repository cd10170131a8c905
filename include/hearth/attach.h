// Attaching to a store: a read-only view of one model version's tensors.
//
// An Attachment owns two things: the connection to the store (the lease: the
// store counts this process as a client while it is open) and the read-only
// mapping of the arena. Destroying it unmaps and closes both. Tensor pointers
// are valid while the Attachment lives. Attachment is thread-safe for reads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/arena.h"
#include "hearth/device.h"
#include "hearth/dtype.h"
#include "hearth/manifest.h"
#include "hearth/status.h"
#include "hearth/unique_fd.h"

#ifdef _WIN32
namespace hearth::platform {
class Channel;
}  // namespace hearth::platform
#endif

namespace hearth {

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // host pointer, or device address on CUDA
  uint64_t offset = 0;         // inside the arena
  uint64_t nbytes = 0;
  Device device;
};

class Attachment {
 public:
  ~Attachment();
  Attachment(const Attachment&) = delete;
  Attachment& operator=(const Attachment&) = delete;

  const Manifest& manifest() const { return manifest_; }
  const std::string& model() const { return manifest_.model; }
  uint64_t version() const { return manifest_.version; }
  Device device() const { return manifest_.device; }
  uint64_t checksum() const { return manifest_.checksum; }
  // Sorted by name.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* Find(std::string_view name) const;

  // Copies a tensor's bytes [offset, offset + out.size()) to host memory.
  Status CopyToHost(const TensorView& tensor, uint64_t offset, std::span<std::byte> out) const;
  // Recomputes the checksum (hearth/checksum.h) over the mapped bytes.
  Result<uint64_t> ComputeChecksum() const;

 private:
  friend class AttachClient;
#ifdef _WIN32
  // The pipe to the store (platform/local_channel.h) is the lease there.
  using Connection = std::unique_ptr<platform::Channel>;
#else
  using Connection = UniqueFd;
#endif
  Attachment(Connection connection, std::unique_ptr<ArenaMapping> mapping, Manifest manifest);

  Connection connection_;
  std::unique_ptr<ArenaMapping> mapping_;
  Manifest manifest_;
  std::vector<TensorView> tensors_;
};

// A store's answer to AttachClient::LoadOrReuse.
struct StoreLoad {
  ModelSummary model;
  bool reused = false;  // `model` is the version asked to reuse: nothing was read
};

struct AttachOptions {
  // The store's socket; empty: AttachClient::DefaultSocketPath().
  std::string socket_path;
  // Uids whose store this client trusts besides its own and root's (a store
  // run by another account). $HEARTH_STORE_UID (comma-separated uids) adds
  // to these for every client.
  // The uid a peer outside our user namespace reads as (the kernel's
  // overflow uid, usually 65534) is trusted only when listed here or there,
  // never because it is ours or root's: see AttachClient.
  std::vector<uint32_t> trusted_store_uids;
  // How long a request waits for the store's answer before failing with
  // DEADLINE_EXCEEDED (negative: for ever). Generous: a store answers at
  // once, except an attach that waits for the store's descriptor cap
  // (the store bounds that wait itself, 30 s by default) and a `load`,
  // which answers when the checkpoint is loaded.
  std::chrono::milliseconds receive_timeout = std::chrono::minutes(10);
};

// Talks to a store at one socket path. Each call opens its own connection;
// Attach keeps its connection as the lease. Thread-safe.
//
// On Windows (attach_client_windows.cc) the socket path is the store's pipe
// name (platform/local_channel.h; default $HEARTH_SOCKET, else "store"), and
// the store must run as this process's user: the pipe admits only it, and
// the client checks the server's process user before it sends anything.
// There is no list of other trusted users (trusted_store_uids and
// $HEARTH_STORE_UID are refused), and receive_timeout is not applied: a
// read waits until the store answers or closes.
//
// Before it sends a request or believes an answer, every connection checks
// who is listening (SO_PEERCRED): a store running as another uid than ours,
// root, or one trusted in AttachOptions / $HEARTH_STORE_UID is refused with
// PERMISSION_DENIED naming the socket, the peer's uid and its pid. A manifest
// checksum proves nothing on its own (an impostor computes its own); this
// check is what keeps another local user from serving us their weights. A
// store that reads as the overflow uid (/proc/sys/kernel/overflowuid: its
// real uid has no mapping in our user namespace, so it may be anyone) is
// refused unless that uid is listed explicitly, even if we run as that uid
// ourselves.
class AttachClient {
 public:
  explicit AttachClient(std::string socket_path);
  explicit AttachClient(AttachOptions options);

  // $HEARTH_SOCKET if set, else $XDG_RUNTIME_DIR/hearth/store.sock if
  // XDG_RUNTIME_DIR is set, else /tmp/hearth-<uid>/store.sock ($TMPDIR is
  // never used: a store under systemd and a shell must agree). On Windows:
  // $HEARTH_SOCKET if set, else "store".
  static std::string DefaultSocketPath();
  // The uids in $HEARTH_STORE_UID (empty if unset or set to ""); InvalidArgument
  // naming the variable if it is not a comma-separated list of uids.
  static Result<std::vector<uint32_t>> StoreUidsFromEnvironment();
#ifndef _WIN32
  // /proc/sys/kernel/overflowuid (65534 if it cannot be read).
  static uint32_t OverflowUid();
#endif

  const std::string& socket_path() const { return socket_path_; }
  // Ours and root are always trusted besides these.
  const std::vector<uint32_t>& trusted_store_uids() const { return trusted_uids_; }

  // Version 0 attaches the latest version.
  Result<std::unique_ptr<Attachment>> Attach(std::string_view model, uint64_t version = 0) const;
  Result<std::vector<ModelSummary>> ListModels() const;
  Result<StoreStatus> GetStatus() const;
  // Only a client with the store's own uid may load and unload.
  Result<ModelSummary> Load(std::string_view name, std::string_view path) const;
  // Loads `path` as a new version of `name`, unless version `reuse` of it
  // (0: none) is still held by the store, was read from this same path (the
  // string as given), and its files are unchanged since: the store opens them
  // and compares their fingerprint (Checkpoint::Fingerprint) with the one it
  // read them with. That version is then answered, `reused`, and nothing is
  // read. `reuse_only`: never load; FAILED_PRECONDITION when `reuse` cannot be
  // reused. A store of protocol 1.1 (no load-v2) is asked `load` instead,
  // which never reuses; with `reuse_only` the answer is FAILED_PRECONDITION.
  Result<StoreLoad> LoadOrReuse(std::string_view name, std::string_view path, uint64_t reuse,
                                bool reuse_only = false) const;
  // Version 0 unloads every version; returns how many were removed.
  Result<uint32_t> Unload(std::string_view model, uint64_t version = 0) const;

 private:
  // Whether this system lets a client trust the stores of `uids` (those of
  // AttachOptions and $HEARTH_STORE_UID): Linux does; Windows refuses any.
  static Status CheckTrustedStoreUids(const std::vector<uint32_t>& uids);
#ifndef _WIN32
  Result<UniqueFd> Connect() const;
  Status CheckStoreCredentials(int fd) const;
#endif
  std::string socket_path_;
  std::vector<uint32_t> trusted_uids_;
  std::chrono::milliseconds receive_timeout_;
  // A malformed $HEARTH_STORE_UID, or trusted uids this system refuses,
  // reported by every call.
  Status environment_;
};

}  // namespace hearth
