// The event loop's answers to requests: listing, attaching, status, loading
// (or reusing what is loaded) and unloading models.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <utility>

#include "store/event_loop.h"
#include "store/status_report.h"

namespace hearth::store {

using protocol::MessageType;

// Answers one complete message. A non-OK return is a protocol violation
// (the connection is dropped); request-level failures are answered with an
// error message and return OK.
Status EventLoop::Handle(Connection& c, const protocol::Message& m) {
  switch (m.type) {
    case MessageType::kListModels: {
      RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "list-models"));
      Queue(c, MessageType::kModelList, protocol::EncodeModelList(registry_->Summaries()));
      return Status::Ok();
    }
    case MessageType::kAttach: {
      ASSIGN_OR_RETURN(protocol::AttachRequest req, protocol::DecodeAttach(m.payload));
      HandleAttach(c, req);
      return Status::Ok();
    }
    case MessageType::kStatus: {
      RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "status"));
      Queue(c, MessageType::kStatusReply, protocol::EncodeStatus(Report()));
      return Status::Ok();
    }
    case MessageType::kStatusV2: {
      RETURN_IF_ERROR(protocol::CheckEmpty(m.payload, "status-v2"));
      Queue(c, MessageType::kStatusReplyV2, protocol::EncodeStatusV2(Report()));
      return Status::Ok();
    }
    case MessageType::kLoad: {
      ASSIGN_OR_RETURN(protocol::LoadRequest req, protocol::DecodeLoad(m.payload));
      HandleLoad(c, LoadJob{std::move(req), /*v2=*/false, {}});
      return Status::Ok();
    }
    case MessageType::kLoadV2: {
      ASSIGN_OR_RETURN(protocol::LoadRequest req, protocol::DecodeLoadV2(m.payload));
      HandleLoad(c, LoadJob{std::move(req), /*v2=*/true, {}});
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
      Result<uint32_t> removed = registry_->Unload(req.model);
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

void EventLoop::HandleAttach(Connection& c, const protocol::AttachRequest& req) {
  std::shared_ptr<ModelVersion> v = registry_->Find(req.model);
  if (!v) {
    QueueError(c, NotFound("no model '" + req.model.ToString() + "' in this store"));
    return;
  }
  if (c.leases.size() >= limits_.max_leases_per_connection) {
    ++counters_["lease_refusals"];
    QueueError(c, ResourceExhausted("this connection holds " + std::to_string(c.leases.size()) +
                                    " leases, the store's limit per connection "
                                    "(max_leases_per_connection); attach on a new connection"));
    return;
  }
  if (unread_fds_ >= limits_.max_unread_fds) {
    // Not an error: the answer waits, and the connection is not read
    // meanwhile, until peers have read enough of the descriptors sent or
    // the wait runs past attach_wait_timeout.
    if (uint64_t dropped; cap_log_.Allow(&dropped))
      spdlog::warn(
          "{} descriptors sent are not read yet, the limit; attach of {} by pid {} waits{}",
          unread_fds_, req.model.ToString(), c.pid, Dropped(dropped));
    ++counters_["attaches_deferred"];
    c.deferred = req;
    c.deferred_since = Clock::now();
    deferred_.push_back(c.id);
    return;
  }
  Result<UniqueFd> fd = v->arena->Export();
  if (!fd.ok()) {
    spdlog::error("exporting {}@{}: {}", v->name, v->version, fd.status().ToString());
    QueueError(c, fd.status());
    return;
  }
  Queue(c, MessageType::kManifest, protocol::EncodeManifest(v->manifest), std::move(*fd));
  ++v->leases;
  c.leases.push_back({v, NowMs()});
  spdlog::debug("pid {} attached {}@{}", c.pid, v->name, v->version);
}

// load and load-v2. The version a load-v2 names for reuse is looked up
// here, on the loop's thread: its fingerprint goes with the job, which
// compares it with the files' as it opens them.
void EventLoop::HandleLoad(Connection& c, LoadJob job) {
  const protocol::LoadRequest& req = job.request;
  if (c.uid != ::geteuid()) {
    spdlog::warn("refused load of {} by pid {} uid {}: only uid {} may load", req.name, c.pid,
                 c.uid, ::geteuid());
    QueueError(c, PermissionDenied("only the store's own uid may load models"));
    return;
  }
  if (req.reuse_version != 0) {
    const ModelRef ref{req.name, req.reuse_version};
    std::shared_ptr<ModelVersion> v = registry_->Find(ref);
    if (v != nullptr && v->path == req.path) {
      job.reuse_fingerprint = v->fingerprint;
    } else if (req.reuse_only) {
      QueueError(c, FailedPrecondition(
                        v == nullptr ? "no model '" + ref.ToString() + "' in this store to reuse"
                                     : ref.ToString() + " was loaded from " + v->path + ", not " +
                                           req.path + " (reuse_only: nothing loaded)"));
      return;
    }
  }
  if (Status s = loads_.Submit(c.id, std::move(job)); !s.ok()) QueueError(c, s);
}

void EventLoop::FinishLoads() {
  for (LoadDone& d : loads_.TakeFinished()) {
    Connection* conn = FindConnection(d.connection_id);
    const protocol::LoadRequest& req = d.job.request;
    if (d.unchanged) {
      // Unless the version was unloaded while the files were looked at.
      std::shared_ptr<ModelVersion> v = registry_->Find({req.name, req.reuse_version});
      if (v != nullptr && v->fingerprint == d.job.reuse_fingerprint) {
        spdlog::info("{}@{}: the files at {} are unchanged; reused", v->name, v->version, v->path);
        ++counters_["loads_reused"];
        if (conn != nullptr)
          Queue(*conn, MessageType::kLoadedV2, protocol::EncodeLoadedV2({v->Summary(), true}));
      } else if (conn != nullptr) {
        const std::string gone = req.name + "@" + std::to_string(req.reuse_version) +
                                 " was unloaded while its files were compared";
        if (req.reuse_only) {
          QueueError(*conn, FailedPrecondition(gone + " (reuse_only: nothing loaded)"));
        } else {
          spdlog::info("{}; loading {} again", gone, req.path);
          d.job.reuse_fingerprint.clear();
          if (Status s = loads_.Submit(d.connection_id, std::move(d.job)); !s.ok())
            QueueError(*conn, s);
        }
      }
    } else if (!d.status.ok()) {
      // reuse_only's FAILED_PRECONDITION is an answer (the files changed), not a failure.
      if (req.reuse_only && d.status.code() == StatusCode::kFailedPrecondition)
        spdlog::info("{}", d.status.message());
      else
        spdlog::error("load of {} failed: {}", req.name, d.status.ToString());
      if (conn != nullptr) QueueError(*conn, d.status);
    } else {
      const double seconds = d.loaded.seconds;
      const ModelVersion& v = registry_->Register(req.name, req.path, std::move(d.loaded));
      spdlog::info("loaded {}@{} from {} in {:.2f} s", v.name, v.version, v.path, seconds);
      if (conn != nullptr) {
        if (d.job.v2)
          Queue(*conn, MessageType::kLoadedV2, protocol::EncodeLoadedV2({v.Summary(), false}));
        else
          Queue(*conn, MessageType::kLoaded, protocol::EncodeLoaded(v.Summary()));
      }
    }
    if (conn != nullptr) MarkReady(*conn);
  }
  // Start what waited, skipping loads whose client has gone.
  loads_.StartWaiting([this](uint64_t id) { return FindConnection(id) != nullptr; });
}

StoreStatus EventLoop::Report() {
  std::map<std::string, uint64_t> counters = counters_;
  counters["unread_descriptors"] = unread_fds_;
  counters["queued_bytes"] = queued_bytes_;
  counters["partial_bytes"] = partial_bytes_;
  counters["attaches_waiting"] = deferred_.size();
  return CollectStatus(options_.device, options_.max_status_leases, connections_, *registry_,
                       std::move(counters));
}

}  // namespace hearth::store
