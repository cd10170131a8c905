#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/trusted_path.h"
#include "hearth/attach.h"
#include "protocol/messages.h"
#include "protocol/wire.h"

namespace hearth {

using protocol::MessageType;

// Not $TMPDIR: a store started by systemd (which sets no TMPDIR) and a
// user's shell (which often does) must find the same socket.
std::string AttachClient::DefaultSocketPath() {
  if (const char* s = std::getenv("HEARTH_SOCKET"); s != nullptr && *s != '\0') return s;
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && *x != '\0')
    return std::string(x) + "/hearth/store.sock";
  return "/tmp/hearth-" + std::to_string(::geteuid()) + "/store.sock";
}

uint32_t AttachClient::OverflowUid() {
  uint32_t uid = 65534;
  if (FILE* f = std::fopen("/proc/sys/kernel/overflowuid", "re")) {
    if (unsigned long v = 0; std::fscanf(f, "%lu", &v) == 1 && v < 0xffffffffu)
      uid = static_cast<uint32_t>(v);
    std::fclose(f);
  }
  return uid;
}

Result<std::vector<uint32_t>> AttachClient::StoreUidsFromEnvironment() {
  std::vector<uint32_t> uids;
  // Set but empty is unset: `hearth serve`'s workers inherit whatever
  // environment started the server, and `HEARTH_STORE_UID=` is how a shell
  // clears a variable for one command.
  const char* env = std::getenv("HEARTH_STORE_UID");
  if (env == nullptr || *env == '\0') return uids;
  const std::string_view text(env);
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string_view item = text.substr(start, comma - start);
    uint32_t uid = 0;
    auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), uid);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size() ||
        uid == static_cast<uint32_t>(-1))
      return InvalidArgument("HEARTH_STORE_UID='" + std::string(text) +
                             "' is not a comma-separated list of uids");
    uids.push_back(uid);
    start = comma + 1;
  }
  return uids;
}

// Any uid may be trusted here: CheckStoreCredentials holds each store to the list.
Status AttachClient::CheckTrustedStoreUids(const std::vector<uint32_t>& /*uids*/) {
  return Status::Ok();
}

// A peer that reads as the overflow uid is one whose real uid has no mapping
// in our user namespace: it could be anybody outside it, so neither "it is
// ours" (we may run as the overflow uid ourselves, e.g. `nobody`) nor root
// covers it; only a list that names the uid does.
Status AttachClient::CheckStoreCredentials(int fd) const {
  const std::string what = "the store at " + socket_path_;
  ASSIGN_OR_RETURN(PeerCredentials peer, GetPeerCredentials(fd));
  if (peer.uid == OverflowUid() &&
      std::find(trusted_uids_.begin(), trusted_uids_.end(), peer.uid) == trusted_uids_.end())
    return PermissionDenied(what + " runs as uid " + std::to_string(peer.uid) + " (pid " +
                            std::to_string(peer.pid) +
                            "), the kernel's overflow uid (an account this namespace cannot "
                            "see), which is trusted only when --store-uid / HEARTH_STORE_UID "
                            "names it; refusing it");
  return CheckPeerTrusted(fd, trusted_uids_, what);
}

Result<UniqueFd> AttachClient::Connect() const {
  RETURN_IF_ERROR(environment_);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.empty() || socket_path_.size() >= sizeof addr.sun_path)
    return InvalidArgument("socket path '" + socket_path_ + "' is empty or too long");
  std::memcpy(addr.sun_path, socket_path_.c_str(), socket_path_.size() + 1);
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd) return ErrnoError("socket", errno);
  for (;;) {
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      // The listener's credentials, as the kernel recorded them when it
      // called listen(2): checked before anything is sent or believed.
      RETURN_IF_ERROR(CheckStoreCredentials(fd.get()));
      return fd;
    }
    if (errno == EINTR) continue;
    const int err = errno;
    if (err == ENOENT || err == ECONNREFUSED)
      return Unavailable("no store is listening at " + socket_path_ + " (" + std::strerror(err) +
                         "); start one with `hearth store --socket " + socket_path_ + " ...`");
    return ErrnoError("connecting to the store at " + socket_path_, err);
  }
}

namespace {

// Receives the store's reply. A store that refuses a connection (a peer it
// does not allow, or one over its connection limit) answers and closes at
// once, possibly before the request arrived: the answer is then still there
// to read after the send failed, or after one "connection reset".
Result<protocol::Message> ReceiveReply(int fd, std::chrono::milliseconds timeout) {
  Result<protocol::Message> reply = protocol::ReceiveMessage(fd, timeout);
  if (!reply.ok() && reply.status().code() == StatusCode::kUnavailable &&
      reply.status().message().find("reset") != std::string::npos)
    reply = protocol::ReceiveMessage(fd, timeout);
  return reply;
}

// Sends a request and receives its reply; an error reply becomes the Status.
// A store that does not answer within `timeout` (negative: no bound) is
// DEADLINE_EXCEEDED, naming the socket.
Result<protocol::Message> Call(int fd, const std::string& socket, std::chrono::milliseconds timeout,
                               MessageType type, const std::vector<std::byte>& payload,
                               MessageType expected) {
  if (Status sent = protocol::SendMessage(fd, type, payload); !sent.ok()) {
    if (sent.code() != StatusCode::kUnavailable) return sent;
    // The store has closed: a peer that closed cannot make this block.
    Result<protocol::Message> last = ReceiveReply(fd, timeout);
    if (last.ok() && last->type == MessageType::kError) return protocol::DecodeError(last->payload);
    return Unavailable("the store closed the connection before answering");
  }
  Result<protocol::Message> reply = ReceiveReply(fd, timeout);
  if (!reply.ok()) {
    if (reply.status().code() == StatusCode::kDeadlineExceeded)
      return DeadlineExceeded(
          "the store at " + socket + " did not answer '" + protocol::MessageTypeName(type) +
          "' within " + std::to_string(timeout.count()) + " ms (AttachOptions::receive_timeout)");
    if (reply.status().code() == StatusCode::kUnavailable)
      return Unavailable("the store closed the connection before answering");
    return reply.status().WithContext("reply from the store");
  }
  if (reply->type == MessageType::kError) return protocol::DecodeError(reply->payload);
  if (reply->type != expected)
    return InvalidArgument(std::string("the store answered '") +
                           protocol::MessageTypeName(reply->type) + "' to '" +
                           protocol::MessageTypeName(type) + "'");
  if (reply->fd.valid() && expected != MessageType::kManifest)
    return InvalidArgument("the store sent an unexpected descriptor");
  return reply;
}

}  // namespace

Result<std::unique_ptr<Attachment>> AttachClient::Attach(std::string_view model,
                                                         uint64_t version) const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  protocol::AttachRequest req{ModelRef{std::string(model), version}};
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(fd.get(), socket_path_, receive_timeout_, MessageType::kAttach,
                        protocol::EncodeAttach(req), MessageType::kManifest));
  ASSIGN_OR_RETURN(Manifest manifest, protocol::DecodeManifest(reply.payload));
  if (!reply.fd.valid()) return InvalidArgument("the store's manifest came without a descriptor");
  if (manifest.model != model || (version != 0 && manifest.version != version))
    return InvalidArgument("the store answered with " + manifest.model + "@" +
                           std::to_string(manifest.version) + " for " +
                           ModelRef{std::string(model), version}.ToString());
  ASSIGN_OR_RETURN(std::unique_ptr<ArenaMapping> mapping,
                   ArenaMapping::Map(std::move(reply.fd), manifest.device, manifest.arena_size));
  return std::unique_ptr<Attachment>(
      new Attachment(std::move(fd), std::move(mapping), std::move(manifest)));
}

Result<std::vector<ModelSummary>> AttachClient::ListModels() const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(fd.get(), socket_path_, receive_timeout_, MessageType::kListModels, {},
                        MessageType::kModelList));
  return protocol::DecodeModelList(reply.payload);
}

// status-v2 first; a store of protocol 1.0 refuses the type as unknown (and
// closes), and is then asked `status` on a new connection.
Result<StoreStatus> AttachClient::GetStatus() const {
  {
    ASSIGN_OR_RETURN(UniqueFd fd, Connect());
    Result<protocol::Message> reply = Call(fd.get(), socket_path_, receive_timeout_,
                                           MessageType::kStatusV2, {}, MessageType::kStatusReplyV2);
    if (reply.ok()) return protocol::DecodeStatusV2(reply->payload);
    if (reply.status().code() != StatusCode::kInvalidArgument ||
        reply.status().message().find("unknown message type") == std::string::npos)
      return reply.status();
  }
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(fd.get(), socket_path_, receive_timeout_, MessageType::kStatus, {},
                        MessageType::kStatusReply));
  return protocol::DecodeStatus(reply.payload);
}

Result<ModelSummary> AttachClient::Load(std::string_view name, std::string_view path) const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  protocol::LoadRequest req{std::string(name), std::string(path)};
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(fd.get(), socket_path_, receive_timeout_, MessageType::kLoad,
                        protocol::EncodeLoad(req), MessageType::kLoaded));
  return protocol::DecodeLoaded(reply.payload);
}

// load-v2 first; a store of protocol 1.1 refuses the type as unknown (and
// closes), and is then asked `load` on a new connection.
Result<StoreLoad> AttachClient::LoadOrReuse(std::string_view name, std::string_view path,
                                            uint64_t reuse, bool reuse_only) const {
  protocol::LoadRequest req{std::string(name), std::string(path), reuse, reuse_only};
  {
    ASSIGN_OR_RETURN(UniqueFd fd, Connect());
    Result<protocol::Message> reply =
        Call(fd.get(), socket_path_, receive_timeout_, MessageType::kLoadV2,
             protocol::EncodeLoadV2(req), MessageType::kLoadedV2);
    if (reply.ok()) {
      ASSIGN_OR_RETURN(protocol::LoadedReply loaded, protocol::DecodeLoadedV2(reply->payload));
      if (loaded.model.name != name || (loaded.reused && loaded.model.version != reuse))
        return InvalidArgument("the store answered " + loaded.model.name + "@" +
                               std::to_string(loaded.model.version) +
                               (loaded.reused ? " reused" : "") + " to a load of " +
                               std::string(name) + " reusing version " + std::to_string(reuse));
      return StoreLoad{std::move(loaded.model), loaded.reused};
    }
    if (reply.status().code() != StatusCode::kInvalidArgument ||
        reply.status().message().find("unknown message type") == std::string::npos)
      return reply.status();
  }
  if (reuse_only)
    return FailedPrecondition("the store at " + socket_path_ +
                              " speaks store protocol 1.1: it cannot tell whether " +
                              std::string(path) + " is unchanged");
  ASSIGN_OR_RETURN(ModelSummary loaded, Load(name, path));
  return StoreLoad{std::move(loaded), false};
}

Result<uint32_t> AttachClient::Unload(std::string_view model, uint64_t version) const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  protocol::UnloadRequest req{ModelRef{std::string(model), version}};
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(fd.get(), socket_path_, receive_timeout_, MessageType::kUnload,
                        protocol::EncodeUnload(req), MessageType::kUnloaded));
  return protocol::DecodeUnloaded(reply.payload);
}

}  // namespace hearth
