#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/trusted_path.h"
#include "hearth/attach.h"
#include "hearth/checksum.h"
#include "protocol/messages.h"
#include "protocol/wire.h"

namespace hearth {

using protocol::MessageType;

Attachment::Attachment(UniqueFd connection, std::unique_ptr<ArenaMapping> mapping,
                       Manifest manifest)
    : connection_(std::move(connection)),
      mapping_(std::move(mapping)),
      manifest_(std::move(manifest)) {
  const auto* base = static_cast<const std::byte*>(mapping_->data());
  tensors_.reserve(manifest_.tensors.size());
  for (const ManifestTensor& t : manifest_.tensors) {
    tensors_.push_back(
        {t.name, t.dtype, t.shape, base + t.offset, t.offset, t.nbytes, manifest_.device});
  }
}

// The mapping goes before the lease: the store must never see a client
// detached while it still maps the arena.
Attachment::~Attachment() {
  mapping_.reset();
  connection_.Reset();
}

const TensorView* Attachment::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorView& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

Status Attachment::CopyToHost(const TensorView& tensor, uint64_t offset,
                              std::span<std::byte> out) const {
  if (offset > tensor.nbytes || out.size() > tensor.nbytes - offset)
    return InvalidArgument("tensor '" + tensor.name + "': range past its " +
                           std::to_string(tensor.nbytes) + " bytes");
  return mapping_->CopyToHost(tensor.offset + offset, out);
}

Result<uint64_t> Attachment::ComputeChecksum() const {
  std::vector<uint64_t> digests;
  std::vector<std::byte> staging;
  for (const TensorView& t : tensors_) {
    for (uint64_t off = 0; off < t.nbytes; off += kChecksumBlockBytes) {
      const uint64_t len = std::min(kChecksumBlockBytes, t.nbytes - off);
      if (t.device.is_cuda()) {
        staging.resize(len);
        RETURN_IF_ERROR(CopyToHost(t, off, staging));
        digests.push_back(BlockDigest(staging));
      } else {
        digests.push_back(BlockDigest(std::span(static_cast<const std::byte*>(t.data) + off, len)));
      }
    }
  }
  return CombineBlockDigests(digests);
}

AttachClient::AttachClient(std::string socket_path)
    : AttachClient(AttachOptions{std::move(socket_path), {}}) {}

AttachClient::AttachClient(AttachOptions options)
    : socket_path_(options.socket_path.empty() ? DefaultSocketPath()
                                               : std::move(options.socket_path)),
      trusted_uids_(std::move(options.trusted_store_uids)) {
  Result<std::vector<uint32_t>> env = StoreUidsFromEnvironment();
  if (env.ok()) {
    trusted_uids_.insert(trusted_uids_.end(), env->begin(), env->end());
  } else {
    environment_ = env.status();
  }
}

std::string AttachClient::DefaultSocketPath() {
  if (const char* s = std::getenv("HEARTH_SOCKET"); s != nullptr && *s != '\0') return s;
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && *x != '\0')
    return std::string(x) + "/hearth/store.sock";
  std::string tmp = "/tmp";
  if (const char* t = std::getenv("TMPDIR"); t != nullptr && t[0] == '/') {
    tmp = t;
    while (tmp.size() > 1 && tmp.back() == '/') tmp.pop_back();
  }
  return tmp + "/hearth-" + std::to_string(::geteuid()) + "/store.sock";
}

Result<std::vector<uint32_t>> AttachClient::StoreUidsFromEnvironment() {
  std::vector<uint32_t> uids;
  const char* env = std::getenv("HEARTH_STORE_UID");
  if (env == nullptr) return uids;
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
      RETURN_IF_ERROR(CheckPeerTrusted(fd.get(), trusted_uids_, "the store at " + socket_path_));
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
Result<protocol::Message> ReceiveReply(int fd) {
  Result<protocol::Message> reply = protocol::ReceiveMessage(fd);
  if (!reply.ok() && reply.status().code() == StatusCode::kUnavailable &&
      reply.status().message().find("reset") != std::string::npos)
    reply = protocol::ReceiveMessage(fd);
  return reply;
}

// Sends a request and receives its reply; an error reply becomes the Status.
Result<protocol::Message> Call(int fd, MessageType type, const std::vector<std::byte>& payload,
                               MessageType expected) {
  if (Status sent = protocol::SendMessage(fd, type, payload); !sent.ok()) {
    if (sent.code() != StatusCode::kUnavailable) return sent;
    // The store has closed: a peer that closed cannot make this block.
    Result<protocol::Message> last = ReceiveReply(fd);
    if (last.ok() && last->type == MessageType::kError) return protocol::DecodeError(last->payload);
    return Unavailable("the store closed the connection before answering");
  }
  Result<protocol::Message> reply = ReceiveReply(fd);
  if (!reply.ok()) {
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
  ASSIGN_OR_RETURN(
      protocol::Message reply,
      Call(fd.get(), MessageType::kAttach, protocol::EncodeAttach(req), MessageType::kManifest));
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
                   Call(fd.get(), MessageType::kListModels, {}, MessageType::kModelList));
  return protocol::DecodeModelList(reply.payload);
}

Result<StoreStatus> AttachClient::GetStatus() const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(fd.get(), MessageType::kStatus, {}, MessageType::kStatusReply));
  return protocol::DecodeStatus(reply.payload);
}

Result<ModelSummary> AttachClient::Load(std::string_view name, std::string_view path) const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  protocol::LoadRequest req{std::string(name), std::string(path)};
  ASSIGN_OR_RETURN(protocol::Message reply, Call(fd.get(), MessageType::kLoad,
                                                 protocol::EncodeLoad(req), MessageType::kLoaded));
  return protocol::DecodeLoaded(reply.payload);
}

Result<uint32_t> AttachClient::Unload(std::string_view model, uint64_t version) const {
  ASSIGN_OR_RETURN(UniqueFd fd, Connect());
  protocol::UnloadRequest req{ModelRef{std::string(model), version}};
  ASSIGN_OR_RETURN(
      protocol::Message reply,
      Call(fd.get(), MessageType::kUnload, protocol::EncodeUnload(req), MessageType::kUnloaded));
  return protocol::DecodeUnloaded(reply.payload);
}

}  // namespace hearth
