// AttachClient on Windows (hearth/attach.h): the store's per-user named pipe
// (platform/local_channel.h, which checks that the store runs as our user
// before anything is sent), the protocol's messages over it
// (protocol/wire.h), and an attach's section handle, which the store has
// duplicated into this process with read access only, mapped read-only.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "hearth/attach.h"
#include "platform/local_channel.h"
#include "protocol/messages.h"
#include "protocol/wire.h"

namespace hearth {

using protocol::MessageType;

std::string AttachClient::DefaultSocketPath() {
  if (const char* s = std::getenv("HEARTH_SOCKET"); s != nullptr && *s != '\0') return s;
  return "store";
}

Result<std::vector<uint32_t>> AttachClient::StoreUidsFromEnvironment() {
  const char* env = std::getenv("HEARTH_STORE_UID");
  if (env == nullptr || *env == '\0') return std::vector<uint32_t>{};
  return InvalidArgument("HEARTH_STORE_UID='" + std::string(env) +
                         "' is not supported on Windows: the store must run as this user");
}

Status AttachClient::CheckTrustedStoreUids(const std::vector<uint32_t>& uids) {
  if (uids.empty()) return Status::Ok();
  return InvalidArgument(
      "trusted store uids are not supported on Windows: the store must run as this user");
}

namespace {

// Connects (checking the store's user), sends one request and receives its
// reply; an error reply becomes the Status. A handle comes only with a
// manifest: with any other reply it is refused, and left alone (see
// protocol/wire_pipe.cc).
Result<protocol::Message> Call(platform::Channel& channel, const std::string& name,
                               MessageType type, const std::vector<std::byte>& payload,
                               MessageType expected) {
  if (Status sent = protocol::Send(channel, type, payload); !sent.ok())
    return sent.WithContext("sending '" + std::string(protocol::MessageTypeName(type)) +
                            "' to the store " + name);
  Result<protocol::Message> reply = protocol::Receive(channel);
  if (!reply.ok()) {
    if (reply.status().code() == StatusCode::kUnavailable)
      return Unavailable("the store " + name + " closed the connection before answering");
    return reply.status().WithContext("reply from the store");
  }
  if (reply->handle != 0 && expected != MessageType::kManifest)
    return InvalidArgument("the store sent an unexpected handle");
  if (reply->type == MessageType::kError) return protocol::DecodeError(reply->payload);
  if (reply->type != expected)
    return InvalidArgument(std::string("the store answered '") +
                           protocol::MessageTypeName(reply->type) + "' to '" +
                           protocol::MessageTypeName(type) + "'");
  return reply;
}

Result<platform::Channel> ConnectTo(const std::string& name, const Status& environment) {
  RETURN_IF_ERROR(environment);
  Result<platform::Channel> c = platform::Connect(name);
  if (!c.ok() && c.status().code() == StatusCode::kUnavailable)
    return Unavailable(c.status().message() + "; start one with `hearth store --socket " + name +
                       " ...`");
  return c;
}

}  // namespace

Result<std::unique_ptr<Attachment>> AttachClient::Attach(std::string_view model,
                                                         uint64_t version) const {
  ASSIGN_OR_RETURN(platform::Channel channel, ConnectTo(socket_path_, environment_));
  protocol::AttachRequest req{ModelRef{std::string(model), version}};
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(channel, socket_path_, MessageType::kAttach, protocol::EncodeAttach(req),
                        MessageType::kManifest));
  if (reply.handle == 0) return InvalidArgument("the store's manifest came without a handle");
  // From here the handle is ours (the checked store made it in this
  // process): every path below closes it, MapHandle included.
  Result<Manifest> manifest = protocol::DecodeManifest(reply.payload);
  Status checked = manifest.ok() ? Status::Ok() : manifest.status();
  if (checked.ok() && (manifest->model != model || (version != 0 && manifest->version != version)))
    checked = InvalidArgument("the store answered with " + manifest->model + "@" +
                              std::to_string(manifest->version) + " for " +
                              ModelRef{std::string(model), version}.ToString());
  if (!checked.ok()) {
    platform::CloseHandle(
        reinterpret_cast<platform::NativeHandle>(static_cast<uintptr_t>(reply.handle)));
    return checked;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ArenaMapping> mapping,
                   ArenaMapping::MapHandle(reply.handle, manifest->device, manifest->arena_size));
  return std::unique_ptr<Attachment>(
      new Attachment(std::make_unique<platform::Channel>(std::move(channel)), std::move(mapping),
                     std::move(manifest).value()));
}

Result<std::vector<ModelSummary>> AttachClient::ListModels() const {
  ASSIGN_OR_RETURN(platform::Channel channel, ConnectTo(socket_path_, environment_));
  ASSIGN_OR_RETURN(protocol::Message reply, Call(channel, socket_path_, MessageType::kListModels,
                                                 {}, MessageType::kModelList));
  return protocol::DecodeModelList(reply.payload);
}

Result<StoreStatus> AttachClient::GetStatus() const {
  ASSIGN_OR_RETURN(platform::Channel channel, ConnectTo(socket_path_, environment_));
  ASSIGN_OR_RETURN(protocol::Message reply, Call(channel, socket_path_, MessageType::kStatusV2, {},
                                                 MessageType::kStatusReplyV2));
  return protocol::DecodeStatusV2(reply.payload);
}

Result<ModelSummary> AttachClient::Load(std::string_view name, std::string_view path) const {
  ASSIGN_OR_RETURN(platform::Channel channel, ConnectTo(socket_path_, environment_));
  protocol::LoadRequest req{std::string(name), std::string(path)};
  ASSIGN_OR_RETURN(protocol::Message reply, Call(channel, socket_path_, MessageType::kLoad,
                                                 protocol::EncodeLoad(req), MessageType::kLoaded));
  return protocol::DecodeLoaded(reply.payload);
}

// A store on Windows speaks load-v2 from its start: no fallback to `load`.
Result<StoreLoad> AttachClient::LoadOrReuse(std::string_view name, std::string_view path,
                                            uint64_t reuse, bool reuse_only) const {
  ASSIGN_OR_RETURN(platform::Channel channel, ConnectTo(socket_path_, environment_));
  protocol::LoadRequest req{std::string(name), std::string(path), reuse, reuse_only};
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(channel, socket_path_, MessageType::kLoadV2, protocol::EncodeLoadV2(req),
                        MessageType::kLoadedV2));
  ASSIGN_OR_RETURN(protocol::LoadedReply loaded, protocol::DecodeLoadedV2(reply.payload));
  if (loaded.model.name != name || (loaded.reused && loaded.model.version != reuse))
    return InvalidArgument("the store answered " + loaded.model.name + "@" +
                           std::to_string(loaded.model.version) + (loaded.reused ? " reused" : "") +
                           " to a load of " + std::string(name) + " reusing version " +
                           std::to_string(reuse));
  return StoreLoad{std::move(loaded.model), loaded.reused};
}

Result<uint32_t> AttachClient::Unload(std::string_view model, uint64_t version) const {
  ASSIGN_OR_RETURN(platform::Channel channel, ConnectTo(socket_path_, environment_));
  protocol::UnloadRequest req{ModelRef{std::string(model), version}};
  ASSIGN_OR_RETURN(protocol::Message reply,
                   Call(channel, socket_path_, MessageType::kUnload, protocol::EncodeUnload(req),
                        MessageType::kUnloaded));
  return protocol::DecodeUnloaded(reply.payload);
}

}  // namespace hearth
