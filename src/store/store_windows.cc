// The public Store on Windows (hearth/store.h): a per-user named pipe, a
// thread per client. The registry, the loader, the protocol's messages and
// the manifest are the Linux store's; only the transport differs: there is
// no event loop, since a pipe's client is served by blocking reads in its
// own thread, and an attach's handle is duplicated straight into the
// client's process (nothing is queued in the store).
//
// Limits: at most max_connections clients at once (one past it is answered
// RESOURCE_EXHAUSTED and closed), each message at most
// max_partial_bytes / max_connections bytes (so that all of them together
// stay within max_partial_bytes), each frame at most the protocol's, each
// connection at most max_leases_per_connection leases. A client that breaks
// the protocol is dropped alone.
#include <spdlog/spdlog.h>
#include <windows.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hearth/arena.h"
#include "hearth/checkpoint.h"
#include "hearth/store.h"
#include "platform/local_channel.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "store/loader.h"
#include "store/registry.h"

namespace hearth {

namespace {

constexpr size_t kAutomaticMaxConnections = 64;

// What the store shares with its clients' threads: they hold it, so that a
// thread still serving when Run() returns never outlives what it uses.
struct Shared {
  StoreOptions options;
  size_t max_connections = 0;
  uint32_t max_message_bytes = 0;
  std::mutex mu;  // guards everything below
  store::Registry registry;
  std::map<uint64_t, std::pair<uint32_t, std::vector<store::Lease>>> clients;  // id -> pid, leases
  std::map<std::string, uint64_t> counters;
  std::mutex load_mu;  // one load at a time
  std::atomic<bool> cancel_loads{false};
};

Status Answer(platform::Channel& c, protocol::MessageType type, std::vector<std::byte> payload,
              uint64_t handle = 0) {
  return protocol::Send(c, type, payload, handle);
}

Status AnswerError(platform::Channel& c, const Status& error) {
  return Answer(c, protocol::MessageType::kError, protocol::EncodeError(error));
}

StoreStatus Report(Shared& s) {
  StoreStatus st;
  st.pid = static_cast<int32_t>(::GetCurrentProcessId());
  st.device = s.options.device;
  st.connections = static_cast<uint32_t>(s.clients.size());
  for (const auto& [id, client] : s.clients) {
    st.lease_total += client.second.size();
    for (const store::Lease& l : client.second) {
      if (st.leases.size() >= s.options.max_status_leases) break;
      st.leases.push_back(
          {static_cast<int32_t>(client.first), 0, 0, l.model->name, l.model->version, l.since_ms});
    }
  }
  st.counters = s.counters;
  for (const auto& v : s.registry.HeldVersions())
    st.arenas.push_back({v->name, v->version, v->manifest.device, v->arena->allocation_size(),
                         v->registered, v->leases});
  return st;
}

// Loads (or reuses) what a load or load-v2 asks for; `s.load_mu` is held.
Result<protocol::LoadedReply> Load(Shared& s, const protocol::LoadRequest& req) {
  std::string reuse_fingerprint;
  if (req.reuse_version != 0) {
    std::lock_guard lock(s.mu);
    std::shared_ptr<store::ModelVersion> v = s.registry.Find({req.name, req.reuse_version});
    if (v != nullptr && v->path == req.path) {
      reuse_fingerprint = v->fingerprint;
    } else if (req.reuse_only) {
      const std::string ref = req.name + "@" + std::to_string(req.reuse_version);
      return FailedPrecondition(v == nullptr ? "no model '" + ref + "' in this store to reuse"
                                             : ref + " was loaded from " + v->path + ", not " +
                                                   req.path + " (reuse_only: nothing loaded)");
    }
  }
  if (s.cancel_loads.load()) return Unavailable("the store is stopping: nothing is loaded");
  ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(req.path));
  if (!reuse_fingerprint.empty() && checkpoint.Fingerprint() == reuse_fingerprint) {
    std::lock_guard lock(s.mu);
    std::shared_ptr<store::ModelVersion> v = s.registry.Find({req.name, req.reuse_version});
    if (v != nullptr && v->fingerprint == reuse_fingerprint) {
      ++s.counters["loads_reused"];
      return protocol::LoadedReply{v->Summary(), true};
    }
    if (req.reuse_only)
      return FailedPrecondition(req.name + "@" + std::to_string(req.reuse_version) +
                                " was unloaded while its files were compared (reuse_only: "
                                "nothing loaded)");
  } else if (req.reuse_only) {
    return FailedPrecondition(req.path + " has changed since version " +
                              std::to_string(req.reuse_version) + " of " + req.name +
                              " was loaded from it (reuse_only: nothing loaded)");
  }
  spdlog::info("loading {} from {}", req.name, req.path);
  LoadOptions options;
  options.threads = s.options.load_threads;
  options.cancel = &s.cancel_loads;
  ASSIGN_OR_RETURN(LoadedModel loaded, LoadCheckpoint(checkpoint, s.options.device, options));
  std::lock_guard lock(s.mu);
  const store::ModelVersion& v = s.registry.Register(req.name, req.path, std::move(loaded));
  spdlog::info("loaded {}@{} from {}", v.name, v.version, v.path);
  return protocol::LoadedReply{v.Summary(), false};
}

// Answers one request. A non-OK return is a protocol violation: the client
// is dropped.
Status Handle(Shared& s, uint64_t id, platform::Channel& c, const protocol::Message& m) {
  using protocol::MessageType;
  switch (m.type) {
    case MessageType::kListModels: {
      RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "list-models"));
      std::vector<ModelSummary> models;
      {
        std::lock_guard lock(s.mu);
        models = s.registry.Summaries();
      }
      return Answer(c, MessageType::kModelList, protocol::EncodeModelList(models));
    }
    case MessageType::kAttach: {
      ASSIGN_OR_RETURN(protocol::AttachRequest req, protocol::DecodeAttach(m.payload));
      std::unique_lock lock(s.mu);
      std::shared_ptr<store::ModelVersion> v = s.registry.Find(req.model);
      auto& leases = s.clients[id].second;
      if (!v)
        return AnswerError(c, NotFound("no model '" + req.model.ToString() + "' in this store"));
      if (leases.size() >= s.options.max_leases_per_connection) {
        ++s.counters["lease_refusals"];
        return AnswerError(
            c, ResourceExhausted("this connection holds " + std::to_string(leases.size()) +
                                 " leases, the store's limit per connection "
                                 "(max_leases_per_connection); attach on a new connection"));
      }
      Result<uint64_t> handle = v->arena->ExportTo(c.peer_pid());
      if (!handle.ok()) {
        spdlog::error("exporting {}@{} to pid {}: {}", v->name, v->version, c.peer_pid(),
                      handle.status().ToString());
        return AnswerError(c, handle.status());
      }
      ++v->leases;
      leases.push_back({v, store::NowMs()});
      const Manifest manifest = v->manifest;
      lock.unlock();
      spdlog::debug("pid {} attached {}@{}", c.peer_pid(), manifest.model, manifest.version);
      return Answer(c, MessageType::kManifest, protocol::EncodeManifest(manifest), *handle);
    }
    case MessageType::kStatus:
    case MessageType::kStatusV2: {
      const bool v2 = m.type == MessageType::kStatusV2;
      RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, v2 ? "status-v2" : "status"));
      StoreStatus report;
      {
        std::lock_guard lock(s.mu);
        report = Report(s);
      }
      return v2 ? Answer(c, MessageType::kStatusReplyV2, protocol::EncodeStatusV2(report))
                : Answer(c, MessageType::kStatusReply, protocol::EncodeStatus(report));
    }
    case MessageType::kLoad:
    case MessageType::kLoadV2: {
      const bool v2 = m.type == MessageType::kLoadV2;
      ASSIGN_OR_RETURN(protocol::LoadRequest req,
                       v2 ? protocol::DecodeLoadV2(m.payload) : protocol::DecodeLoad(m.payload));
      if (req.name.empty() || req.name.find('@') != std::string::npos)
        return AnswerError(
            c, InvalidArgument("model name '" + req.name + "' is empty or contains '@'"));
      Result<protocol::LoadedReply> loaded = [&] {
        std::lock_guard lock(s.load_mu);
        return Load(s, req);
      }();
      if (!loaded.ok()) {
        spdlog::error("load of {} failed: {}", req.name, loaded.status().ToString());
        return AnswerError(c, loaded.status());
      }
      return v2 ? Answer(c, MessageType::kLoadedV2, protocol::EncodeLoadedV2(*loaded))
                : Answer(c, MessageType::kLoaded, protocol::EncodeLoaded(loaded->model));
    }
    case MessageType::kUnload: {
      ASSIGN_OR_RETURN(protocol::UnloadRequest req, protocol::DecodeUnload(m.payload));
      Result<uint32_t> removed = [&] {
        std::lock_guard lock(s.mu);
        return s.registry.Unload(req.model);
      }();
      if (!removed.ok()) return AnswerError(c, removed.status());
      return Answer(c, MessageType::kUnloaded, protocol::EncodeUnloaded(*removed));
    }
    default:
      return InvalidArgument(std::string("a client may not send a '") +
                             protocol::MessageTypeName(m.type) + "' message");
  }
}

// A client's thread: its requests one after another until it closes or
// breaks the protocol; then its leases end.
void Serve(std::shared_ptr<Shared> s, uint64_t id, platform::Channel c) {
  for (;;) {
    Result<protocol::Message> m = protocol::Receive(c, s->max_message_bytes);
    Status status = m.ok() ? Status::Ok() : m.status();
    if (m.ok() && m->handle != 0)
      status =
          InvalidArgument("a client may not send a handle");  // nor is it closed: see wire_pipe.cc
    if (status.ok()) status = Handle(*s, id, c, *m);
    if (!status.ok()) {
      if (status.code() != StatusCode::kUnavailable) {
        spdlog::warn("dropping the client pid {}: {}", c.peer_pid(), status.ToString());
        {
          std::lock_guard lock(s->mu);
          ++s->counters["protocol_errors"];
        }
        (void)AnswerError(c, status);  // its channel may be unusable already
      }
      break;
    }
  }
  std::lock_guard lock(s->mu);
  auto it = s->clients.find(id);
  for (store::Lease& l : it->second.second) --l.model->leases;
  s->clients.erase(it);
  s->registry.PruneRetired();
}

}  // namespace

class Store::Impl {
 public:
  explicit Impl(StoreOptions options) : shared_(std::make_shared<Shared>()) {
    shared_->options = std::move(options);
    const StoreOptions& o = shared_->options;
    shared_->max_connections = o.max_connections > 0 ? o.max_connections : kAutomaticMaxConnections;
    const size_t per_client = o.max_partial_bytes / shared_->max_connections;
    shared_->max_message_bytes = static_cast<uint32_t>(
        std::clamp<size_t>(per_client, 64 * 1024, protocol::kMaxMessageBytes));
  }

  Status Init() {
    const StoreOptions& o = shared_->options;
    // A CUDA store without a usable driver fails here, before its pipe
    // exists, saying why (no nvcuda.dll, no device).
    std::string no_cuda;
    if (o.device.kind == DeviceKind::kCuda && !CudaAvailable(&no_cuda))
      return Unavailable("a store on " + o.device.ToString() + " needs CUDA: " + no_cuda);
    // The pipe is made before loading, so that a name taken already (by
    // another store, or an impostor) fails at once, and is ours from then
    // on; a client that connects while the store loads waits for its
    // answer until Run() serves it.
    ASSIGN_OR_RETURN(platform::Listener listener, platform::Listener::Listen(o.socket_path));
    listener_ = std::make_unique<platform::Listener>(std::move(listener));
    for (const auto& [name, path] : o.models) {
      if (name.empty() || name.find('@') != std::string::npos)
        return InvalidArgument("model name '" + name + "' is empty or contains '@'");
      LoadOptions load;
      load.threads = o.load_threads;
      load.cancel = o.cancel;
      if (o.show_progress) load.progress = TerminalProgress(name);
      spdlog::info("loading {} from {}", name, path);
      ASSIGN_OR_RETURN(LoadedModel loaded, LoadCheckpoint(path, o.device, load));
      const auto& v = shared_->registry.Register(name, path, std::move(loaded));
      spdlog::info("loaded {}@{} from {}: {} tensors, {:.1f} MiB", v.name, v.version, path,
                   v.manifest.tensors.size(),
                   static_cast<double>(v.manifest.arena_size) / (1 << 20));
    }
    if (o.cancel != nullptr && o.cancel->load())
      return Unavailable("interrupted while loading: the store is stopping");
    return Status::Ok();
  }

  Status Run() {
    uint64_t next_id = 1;
    while (!stopping_.load()) {
      Result<platform::Channel> c = listener_->Accept();
      if (stopping_.load()) break;
      if (!c.ok()) {
        // A client of another user, or one gone before it was checked.
        spdlog::warn("refused a client: {}", c.status().ToString());
        std::lock_guard lock(shared_->mu);
        ++shared_->counters["connections_refused"];
        continue;
      }
      const uint64_t id = next_id++;
      {
        std::lock_guard lock(shared_->mu);
        if (shared_->clients.size() >= shared_->max_connections) {
          ++shared_->counters["connections_refused"];
          (void)AnswerError(
              *c, ResourceExhausted("the store serves " + std::to_string(shared_->max_connections) +
                                    " connections, its limit (max_connections)"));
          continue;
        }
        shared_->clients[id].first = c->peer_pid();
        ++shared_->counters["connections_accepted"];
      }
      std::thread(Serve, shared_, id, std::move(c).value()).detach();
    }
    spdlog::info("store shutting down");
    shared_->cancel_loads.store(true);
    listener_.reset();
    std::lock_guard lock(shared_->mu);
    shared_->registry.Clear();
    return Status::Ok();
  }

  // Wakes Accept() with a connection of our own, which is then dropped.
  void Stop() {
    if (stopping_.exchange(true)) return;
    (void)platform::Connect(shared_->options.socket_path);
  }
  void CancelLoads() { shared_->cancel_loads.store(true); }
  Store::Held HeldArenas() const { return shared_->registry.Held(); }

 private:
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<platform::Listener> listener_;
  std::atomic<bool> stopping_{false};
};

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() = default;

Result<std::unique_ptr<Store>> Store::Create(StoreOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Status Store::Run() { return impl_->Run(); }
void Store::Stop() { impl_->Stop(); }
void Store::CancelLoads() { impl_->CancelLoads(); }
Store::Held Store::HeldArenas() const { return impl_->HeldArenas(); }

}  // namespace hearth
