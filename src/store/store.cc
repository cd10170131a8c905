#include "hearth/store.h"

#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "hearth/arena.h"
#include "hearth/manifest.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "store/loader.h"

namespace hearth {
namespace {

using protocol::MessageType;

constexpr size_t kMaxConnections = 4096;
constexpr size_t kMaxQueuedBytesPerConnection = 64u << 20;
constexpr int kMaxFramesPerWakeup = 64;

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One loaded version of a model. Shared by the registry (while registered)
// and by every lease on it; the arena goes when the last of them lets go.
struct ModelVersion {
  std::string name;
  uint64_t version = 0;
  std::string path;
  std::unique_ptr<Arena> arena;
  Manifest manifest;
  int64_t loaded_at_ms = 0;
  bool registered = true;
  uint32_t leases = 0;

  ModelSummary Summary() const {
    ModelSummary s;
    s.name = name;
    s.version = version;
    s.device = manifest.device;
    s.path = path;
    s.arena_size = manifest.arena_size;
    s.tensor_count = static_cast<uint32_t>(manifest.tensors.size());
    for (const ManifestTensor& t : manifest.tensors) s.tensor_bytes += t.nbytes;
    s.checksum = manifest.checksum;
    s.attached = leases;
    s.loaded_at_ms = loaded_at_ms;
    return s;
  }
};

struct Lease {
  std::shared_ptr<ModelVersion> model;
  int64_t since_ms;
};

struct OutgoingFrame {
  std::vector<std::byte> bytes;
  UniqueFd fd;
};

struct Connection {
  uint64_t id = 0;
  UniqueFd fd;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  protocol::FrameAssembler assembler;
  std::deque<OutgoingFrame> out;
  size_t queued_bytes = 0;
  bool want_write = false;
  std::vector<Lease> leases;
  Status refusal;  // not OK: answer the first request with this, then close
};

struct LoadDone {
  uint64_t connection_id;
  std::string name;
  std::string path;
  Result<LoadedModel> result;
};

Status CreateSocketDirectory(const std::filesystem::path& dir) {
  if (dir.empty()) return Status::Ok();
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) return Status::Ok();
  RETURN_IF_ERROR(CreateSocketDirectory(dir.parent_path()));
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST)
    return ErrnoError("creating socket directory " + dir.string(), errno);
  return Status::Ok();
}

// Binds a listening SOCK_SEQPACKET socket at `path`, replacing a stale socket
// file but refusing to take over from a store that still answers.
Result<UniqueFd> Listen(const std::string& path, mode_t mode) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path)
    return InvalidArgument("socket path '" + path + "' is empty or longer than " +
                           std::to_string(sizeof addr.sun_path - 1) + " bytes");
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  RETURN_IF_ERROR(CreateSocketDirectory(std::filesystem::path(path).parent_path()));

  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return AlreadyExists("socket path " + path + " exists and is not a socket");
    UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (probe && ::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0)
      return AlreadyExists("another store is serving at " + path);
    spdlog::info("removing stale socket {}", path);
    ::unlink(path.c_str());
  }

  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return ErrnoError("socket", errno);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return ErrnoError("bind " + path, errno);
  if (::chmod(path.c_str(), mode) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return ErrnoError("chmod " + path, err);
  }
  if (::listen(fd.get(), 128) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return ErrnoError("listen " + path, err);
  }
  return fd;
}

}  // namespace

class Store::Impl {
 public:
  explicit Impl(StoreOptions options) : options_(std::move(options)) {}

  ~Impl() {
    for (std::thread& t : load_threads_) t.join();
  }

  Status Init() {
    stop_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    load_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    epoll_.Reset(::epoll_create1(EPOLL_CLOEXEC));
    if (!stop_fd_ || !load_fd_ || !epoll_) return ErrnoError("creating the event loop", errno);
    for (const auto& [name, path] : options_.models) {
      if (name.empty() || name.find('@') != std::string::npos)
        return InvalidArgument("model name '" + name + "' is empty or contains '@'");
      LoadOptions load;
      load.threads = options_.load_threads;
      if (options_.show_progress) load.progress = TerminalProgress(name);
      Result<LoadedModel> loaded = LoadCheckpoint(path, options_.device, load);
      if (!loaded.ok()) return loaded.status();
      const auto& v = Register(name, path, std::move(loaded).value());
      spdlog::info("loaded {}@{} from {}: {} tensors, {:.1f} MiB on {} in {:.2f} s ({:.2f} GB/s)",
                   v.name, v.version, path, v.manifest.tensors.size(),
                   static_cast<double>(v.manifest.arena_size) / (1 << 20),
                   options_.device.ToString(), seconds_of_last_load_,
                   seconds_of_last_load_ > 0
                       ? static_cast<double>(v.manifest.arena_size) / seconds_of_last_load_ / 1e9
                       : 0.0);
    }
    ASSIGN_OR_RETURN(listen_, Listen(options_.socket_path, options_.socket_mode));
    socket_bound_ = true;
    RETURN_IF_ERROR(Watch(listen_.get(), EPOLLIN, kListenTag));
    RETURN_IF_ERROR(Watch(stop_fd_.get(), EPOLLIN, kStopTag));
    RETURN_IF_ERROR(Watch(load_fd_.get(), EPOLLIN, kLoadTag));
    return Status::Ok();
  }

  Status Run() {
    std::vector<epoll_event> events(64);
    while (!stopping_) {
      const int n = ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError("epoll_wait", errno);
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t tag = events[i].data.u64;
        if (tag == kStopTag) {
          stopping_ = true;
        } else if (tag == kListenTag) {
          AcceptAll();
        } else if (tag == kLoadTag) {
          FinishLoads();
        } else {
          OnConnection(tag, events[i].events);
        }
      }
    }
    Shutdown();
    return Status::Ok();
  }

  void Stop() {
    const uint64_t one = 1;
    // write(2) is async-signal-safe; nothing to do if it fails (already signalled).
    [[maybe_unused]] ssize_t n = ::write(stop_fd_.get(), &one, sizeof one);
  }

 private:
  static constexpr uint64_t kStopTag = 1, kListenTag = 2, kLoadTag = 3, kFirstConnection = 16;

  Status Watch(int fd, uint32_t events, uint64_t tag) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) return ErrnoError("epoll_ctl", errno);
    return Status::Ok();
  }

  const ModelVersion& Register(const std::string& name, const std::string& path,
                               LoadedModel loaded) {
    auto v = std::make_shared<ModelVersion>();
    v->name = name;
    v->version = ++last_version_[name];
    v->path = path;
    v->arena = std::move(loaded.arena);
    v->manifest = std::move(loaded.manifest);
    v->manifest.model = name;
    v->manifest.version = v->version;
    v->loaded_at_ms = NowMs();
    seconds_of_last_load_ = loaded.seconds;
    registry_[name][v->version] = v;
    all_versions_.push_back(v);
    return *v;
  }

  std::shared_ptr<ModelVersion> Find(const ModelRef& ref) const {
    auto it = registry_.find(ref.name);
    if (it == registry_.end() || it->second.empty()) return nullptr;
    if (ref.version == 0) return it->second.rbegin()->second;
    auto v = it->second.find(ref.version);
    return v == it->second.end() ? nullptr : v->second;
  }

  bool Authorized(uid_t uid, gid_t gid) const {
    if (uid == ::geteuid() || uid == 0) return true;
    if (std::find(options_.allow_uids.begin(), options_.allow_uids.end(), uid) !=
        options_.allow_uids.end())
      return true;
    return std::find(options_.allow_gids.begin(), options_.allow_gids.end(), gid) !=
           options_.allow_gids.end();
  }

  void AcceptAll() {
    for (;;) {
      UniqueFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) spdlog::warn("accept: {}", std::strerror(errno));
        return;
      }
      ucred cred{};
      socklen_t len = sizeof cred;
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        spdlog::warn("SO_PEERCRED: {}", std::strerror(errno));
        continue;
      }
      // A refused peer is answered when its first request arrives: closing at
      // once would reset the connection and lose the error before it is read.
      Status refusal;
      if (!Authorized(cred.uid, cred.gid)) {
        spdlog::warn("refused connection from pid {} uid {} gid {}: not allowed by --allow-uid/--allow-gid",
                     cred.pid, cred.uid, cred.gid);
        refusal = PermissionDenied("uid " + std::to_string(cred.uid) + " gid " +
                                   std::to_string(cred.gid) + " may not use this store");
      } else if (connections_.size() >= kMaxConnections) {
        spdlog::warn("refused connection from pid {}: {} connections open", cred.pid,
                     connections_.size());
        refusal = ResourceExhausted("the store has too many open connections");
      }
      auto conn = std::make_unique<Connection>();
      conn->id = next_connection_id_++;
      conn->pid = cred.pid;
      conn->uid = cred.uid;
      conn->gid = cred.gid;
      conn->fd = std::move(fd);
      conn->refusal = std::move(refusal);
      if (Status s = Watch(conn->fd.get(), EPOLLIN, conn->id); !s.ok()) {
        spdlog::warn("{}", s.ToString());
        continue;
      }
      spdlog::debug("connection {} from pid {} uid {}", conn->id, conn->pid, conn->uid);
      connections_.emplace(conn->id, std::move(conn));
    }
  }

  // Best effort: one error message on a socket about to be closed.
  static void SendAndForget(int fd, const Status& status) {
    const auto payload = protocol::EncodeError(status);
    for (const auto& frame : protocol::EncodeFrames(MessageType::kError, payload)) {
      if (::send(fd, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL) < 0) return;
    }
  }

  void OnConnection(uint64_t id, uint32_t events) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& c = *it->second;
    if (events & EPOLLOUT) {
      if (!Flush(c)) return Close(id);
    }
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
      for (int i = 0; i < kMaxFramesPerWakeup; ++i) {
        UniqueFd fd;
        bool would_block = false;
        Result<size_t> n = protocol::ReceiveFrame(c.fd.get(), frame_buffer_, &fd, &would_block);
        if (!n.ok()) {
          if (n.status().code() == StatusCode::kUnavailable) return Close(id);
          return Reject(id, n.status());
        }
        if (would_block) break;
        if (!c.refusal.ok()) return Reject(id, c.refusal);
        Result<bool> complete = c.assembler.Add(std::span(frame_buffer_.data(), *n), std::move(fd));
        if (!complete.ok()) return Reject(id, complete.status());
        if (*complete) {
          protocol::Message message = c.assembler.TakeMessage();
          if (message.fd.valid()) return Reject(id, InvalidArgument("clients may not send descriptors"));
          if (Status s = Handle(c, message); !s.ok()) return Reject(id, s);
          if (connections_.find(id) == connections_.end()) return;
        }
      }
      if (!Flush(c)) return Close(id);
    }
  }

  // A protocol violation or a refused peer: tell it why, log it, drop the connection.
  void Reject(uint64_t id, Status why) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    if (it->second->refusal.ok())
      spdlog::warn("closing connection from pid {}: {}", it->second->pid, why.message());
    Flush(*it->second);
    SendAndForget(it->second->fd.get(), why);
    Close(id);
  }

  void Close(uint64_t id) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& c = *it->second;
    for (Lease& lease : c.leases) {
      --lease.model->leases;
      spdlog::debug("lease on {}@{} by pid {} ended", lease.model->name, lease.model->version, c.pid);
    }
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    connections_.erase(it);
    PruneRetired();
  }

  void PruneRetired() {
    std::erase_if(all_versions_, [](const std::weak_ptr<ModelVersion>& w) { return w.expired(); });
  }

  void Queue(Connection& c, MessageType type, const std::vector<std::byte>& payload,
             UniqueFd fd = UniqueFd()) {
    auto frames = protocol::EncodeFrames(type, payload);
    for (size_t i = 0; i < frames.size(); ++i) {
      c.queued_bytes += frames[i].size();
      c.out.push_back({std::move(frames[i]), i == 0 ? std::move(fd) : UniqueFd()});
    }
  }

  void QueueError(Connection& c, const Status& status) {
    Queue(c, MessageType::kError, protocol::EncodeError(status));
  }

  // Sends what the socket takes now; false if the connection is broken or
  // its reader has fallen too far behind.
  bool Flush(Connection& c) {
    while (!c.out.empty()) {
      OutgoingFrame& f = c.out.front();
      const ssize_t n = protocol::SendFrameOnce(c.fd.get(), f.bytes, f.fd.get(), MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return false;
      }
      c.queued_bytes -= f.bytes.size();
      c.out.pop_front();
    }
    if (c.queued_bytes > kMaxQueuedBytesPerConnection) {
      spdlog::warn("pid {} is not reading its replies; closing its connection", c.pid);
      return false;
    }
    const bool want = !c.out.empty();
    if (want != c.want_write) {
      epoll_event ev{};
      ev.events = EPOLLIN | (want ? EPOLLOUT : 0u);
      ev.data.u64 = c.id;
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
      c.want_write = want;
    }
    return true;
  }

  // Answers one complete message. A non-OK return is a protocol violation
  // (the connection is dropped); request-level failures are answered with an
  // error message and return OK.
  Status Handle(Connection& c, const protocol::Message& m) {
    switch (m.type) {
      case MessageType::kListModels: {
        RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "list-models"));
        std::vector<ModelSummary> models;
        for (const auto& [name, versions] : registry_)
          for (const auto& [version, v] : versions) models.push_back(v->Summary());
        Queue(c, MessageType::kModelList, protocol::EncodeModelList(models));
        return Status::Ok();
      }
      case MessageType::kAttach: {
        ASSIGN_OR_RETURN(protocol::AttachRequest req, protocol::DecodeAttach(m.payload));
        std::shared_ptr<ModelVersion> v = Find(req.model);
        if (!v) {
          QueueError(c, NotFound("no model '" + req.model.ToString() + "' in this store"));
          return Status::Ok();
        }
        Result<UniqueFd> fd = v->arena->Export();
        if (!fd.ok()) {
          spdlog::error("exporting {}@{}: {}", v->name, v->version, fd.status().ToString());
          QueueError(c, fd.status());
          return Status::Ok();
        }
        Queue(c, MessageType::kManifest, protocol::EncodeManifest(v->manifest), std::move(*fd));
        ++v->leases;
        c.leases.push_back({v, NowMs()});
        spdlog::debug("pid {} attached {}@{}", c.pid, v->name, v->version);
        return Status::Ok();
      }
      case MessageType::kStatus: {
        RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "status"));
        Queue(c, MessageType::kStatusReply, protocol::EncodeStatus(CollectStatus()));
        return Status::Ok();
      }
      case MessageType::kLoad: {
        ASSIGN_OR_RETURN(protocol::LoadRequest req, protocol::DecodeLoad(m.payload));
        if (c.uid != ::geteuid()) {
          spdlog::warn("refused load of {} by pid {} uid {}: only uid {} may load", req.name,
                       c.pid, c.uid, ::geteuid());
          QueueError(c, PermissionDenied("only the store's own uid may load models"));
          return Status::Ok();
        }
        StartLoad(c.id, std::move(req));
        return Status::Ok();
      }
      case MessageType::kUnload: {
        ASSIGN_OR_RETURN(protocol::UnloadRequest req, protocol::DecodeUnload(m.payload));
        if (c.uid != ::geteuid()) {
          spdlog::warn("refused unload of {} by pid {} uid {}: only uid {} may unload",
                       req.model.ToString(), c.pid, c.uid, ::geteuid());
          QueueError(c, PermissionDenied("only the store's own uid may unload models"));
          return Status::Ok();
        }
        Result<uint32_t> removed = Unload(req.model);
        if (!removed.ok()) {
          QueueError(c, removed.status());
        } else {
          Queue(c, MessageType::kUnloaded, protocol::EncodeUnloaded(*removed));
        }
        return Status::Ok();
      }
      default:
        return InvalidArgument(std::string("a client may not send a '") +
                               protocol::MessageTypeName(m.type) + "' message");
    }
  }

  Result<uint32_t> Unload(const ModelRef& ref) {
    auto it = registry_.find(ref.name);
    if (it == registry_.end()) return NotFound("no model '" + ref.name + "' in this store");
    uint32_t removed = 0;
    for (auto v = it->second.begin(); v != it->second.end();) {
      if (ref.version == 0 || v->first == ref.version) {
        v->second->registered = false;
        spdlog::info("unloaded {}@{} ({} leases remain)", v->second->name, v->second->version,
                     v->second->leases);
        v = it->second.erase(v);
        ++removed;
      } else {
        ++v;
      }
    }
    if (it->second.empty()) registry_.erase(it);
    if (removed == 0) return NotFound("no model '" + ref.ToString() + "' in this store");
    PruneRetired();
    return removed;
  }

  StoreStatus CollectStatus() {
    StoreStatus s;
    s.pid = ::getpid();
    s.device = options_.device;
    s.connections = static_cast<uint32_t>(connections_.size());
    for (const auto& [id, c] : connections_) {
      for (const Lease& l : c->leases)
        s.leases.push_back({c->pid, c->uid, c->gid, l.model->name, l.model->version, l.since_ms});
    }
    PruneRetired();
    for (const auto& w : all_versions_) {
      if (auto v = w.lock()) {
        s.arenas.push_back({v->name, v->version, v->manifest.device, v->arena->allocation_size(),
                            v->registered, v->leases});
      }
    }
    return s;
  }

  void StartLoad(uint64_t connection_id, protocol::LoadRequest req) {
    spdlog::info("loading {} from {}", req.name, req.path);
    const Device device = options_.device;
    const int threads = options_.load_threads;
    load_threads_.emplace_back([this, connection_id, req = std::move(req), device, threads] {
      LoadOptions load;
      load.threads = threads;
      Result<LoadedModel> result = LoadCheckpoint(req.path, device, load);
      {
        std::lock_guard lock(loads_mu_);
        loads_done_.push_back({connection_id, req.name, req.path, std::move(result)});
      }
      const uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(load_fd_.get(), &one, sizeof one);
    });
  }

  void FinishLoads() {
    uint64_t count;
    [[maybe_unused]] ssize_t n = ::read(load_fd_.get(), &count, sizeof count);
    std::vector<LoadDone> done;
    {
      std::lock_guard lock(loads_mu_);
      done.swap(loads_done_);
    }
    for (LoadDone& d : done) {
      auto conn = connections_.find(d.connection_id);
      if (!d.result.ok()) {
        spdlog::error("load of {} failed: {}", d.name, d.result.status().ToString());
        if (conn != connections_.end()) QueueError(*conn->second, d.result.status());
      } else {
        const ModelVersion& v = Register(d.name, d.path, std::move(d.result).value());
        spdlog::info("loaded {}@{} from {} in {:.2f} s", v.name, v.version, v.path,
                     seconds_of_last_load_);
        if (conn != connections_.end())
          Queue(*conn->second, MessageType::kLoaded, protocol::EncodeLoaded(v.Summary()));
      }
      if (conn != connections_.end() && !Flush(*conn->second)) Close(d.connection_id);
    }
  }

  void Shutdown() {
    spdlog::info("store shutting down");
    if (socket_bound_) ::unlink(options_.socket_path.c_str());
    socket_bound_ = false;
    listen_.Reset();
    connections_.clear();
    registry_.clear();
  }

 public:
  void UnlinkSocket() {
    if (socket_bound_) ::unlink(options_.socket_path.c_str());
    socket_bound_ = false;
  }

 private:
  StoreOptions options_;
  UniqueFd epoll_, stop_fd_, load_fd_, listen_;
  bool socket_bound_ = false;
  bool stopping_ = false;
  uint64_t next_connection_id_ = kFirstConnection;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::map<std::string, std::map<uint64_t, std::shared_ptr<ModelVersion>>> registry_;
  std::map<std::string, uint64_t> last_version_;
  std::vector<std::weak_ptr<ModelVersion>> all_versions_;
  double seconds_of_last_load_ = 0;
  std::vector<std::byte> frame_buffer_ =
      std::vector<std::byte>(protocol::kFrameHeaderBytes + protocol::kMaxFramePayload + 1);

  std::mutex loads_mu_;
  std::vector<LoadDone> loads_done_;
  std::vector<std::thread> load_threads_;
};

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() {
  if (impl_) impl_->UnlinkSocket();
}

Result<std::unique_ptr<Store>> Store::Create(StoreOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

Status Store::Run() { return impl_->Run(); }

void Store::Stop() { impl_->Stop(); }

}  // namespace hearth
