#include "grpc/grpc_server_impl.h"

namespace hearth {

grpc::ServerUnaryReactor* GrpcServer::Impl::RunControl(
    grpc::CallbackServerContext* context,
    const std::function<void(std::function<void(Status)>)>& start) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      reactor->Finish(ToGrpcStatus(Unavailable("the server is shutting down")));
      return reactor;
    }
    ++control_calls_;
  }
  // The reactor stays valid until Finish: gRPC calls OnDone only after it,
  // and Stop() waits for OnDone.
  start([this, reactor](Status status) {
    {
      std::lock_guard lock(mu_);
      --control_calls_;
    }
    reactor->Finish(ToGrpcStatus(status));
  });
  return reactor;
}

// ---- start and stop ------------------------------------------------------------

Status GrpcServer::Impl::Bind() {
  std::lock_guard lock(mu_);
  if (listening_ != nullptr || started_)
    return FailedPrecondition("the gRPC server is bound already");
  return ListenLocked();
}

Status GrpcServer::Impl::ListenLocked() {
  // The gate owns the port: grpc++ gets each connection as a socketpair.
  Http2GateLimits limits;
  limits.max_connections = options_.max_connections;
  limits.max_open_streams = 2 * options_.max_concurrent_streams;
  limits.streams_per_second = options_.streams_per_second;
  // A new connection may open as many streams at once as it may keep open.
  limits.stream_burst = std::min<double>(options_.streams_per_second, limits.max_open_streams);
  limits.max_total_open_streams = 4 * options_.max_inflight_calls;
  limits.resets_per_second = options_.resets_per_second;
  limits.reset_burst = std::max(1.0, 2 * options_.resets_per_second);
  limits.total_resets_per_second = 5 * options_.resets_per_second;
  limits.handshake_timeout = options_.handshake_timeout;
  Result<std::unique_ptr<Http2Gate>> gate =
      Http2Gate::Listen(options_.host, options_.port, limits,
                        [this](int fd) { grpc::AddInsecureChannelFromFd(server_.get(), fd); });
  if (!gate.ok()) return gate.status();
  listening_ = std::move(*gate);
  return Status::Ok();
}

Status GrpcServer::Impl::Start() {
  std::lock_guard lock(mu_);
  if (started_) return FailedPrecondition("the gRPC server was started already");
  started_ = true;
  if (listening_ == nullptr) RETURN_IF_ERROR(ListenLocked());
  grpc::ServerBuilder builder;
  builder.RegisterService(this);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  // grpc 1.51 inflates a compressed message whole and only then compares it
  // with the limit above: 1 MB of gzip on the wire held 1 GB until refused.
  // So gRPC inflates nothing: the inference RPCs inflate their messages
  // within the limit themselves (request_message.h). The limit above is the
  // compressed size's. The other RPCs' messages are small, and any of them
  // sent compressed fails to parse (INTERNAL) without being inflated.
  builder.AddChannelArgument(GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION, 0);
  // Room for one message more than the front-end's byte budget: under
  // pressure gRPC resets streams (ENHANCE_YOUR_CALM), held ones too, so the
  // budget, which refuses with a clear error, must be reached first.
  grpc::ResourceQuota quota("hearth-grpc");
  quota.Resize(static_cast<size_t>(options_.max_inflight_bytes + options_.max_message_bytes));
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(options_.keepalive_time.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(options_.keepalive_timeout.count()));
  // Clients may keep idle connections alive with pings every 10 s or more
  // (tritonclient's keepalive options); more often is answered with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(options_.idle_timeout.count()));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(options_.handshake_timeout.count()));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) return Unavailable("gRPC: the server could not be started");
  gate_ = std::move(listening_);
  bound_port_ = gate_->port();
  gate_->Start();
  if (options_.heap_trim_bytes > 0) {
    trimmer_ = std::make_unique<HeapTrimmer>(options_.heap_trim_bytes, std::chrono::seconds(1));
  }
  return Status::Ok();
}

void GrpcServer::Impl::Stop() {
  std::vector<std::shared_ptr<StreamCall>> streams;
  {
    std::lock_guard lock(mu_);
    if (stopped_ || server_ == nullptr) {
      stopped_ = true;
      return;
    }
    stopping_ = true;
    streams.assign(streams_.begin(), streams_.end());
  }
  Drain(streams);
  streams.clear();
  gate_->StopAccepting();
  // New calls are refused from here on; calls in progress get until the
  // deadline, then gRPC cancels them (their requests' `cancelled` is set).
  server_->Shutdown(std::chrono::system_clock::now() + options_.drain_timeout);
  {
    std::unique_lock lock(mu_);
    idle_.wait(lock, [this] { return inflight_calls_ == 0; });
  }
  server_->Wait();
  std::lock_guard lock(mu_);
  server_.reset();
  gate_.reset();  // closes what connections remain
  trimmer_.reset();
  stopped_ = true;
  bound_port_ = 0;
}

// ---- GrpcServer ------------------------------------------------------------------

Result<std::unique_ptr<GrpcServer>> GrpcServer::Create(InferenceService* service,
                                                       GrpcOptions options) {
  if (service == nullptr) return InvalidArgument("the gRPC server needs a service");
  if (options.host.empty()) return InvalidArgument("the gRPC server needs a host");
  constexpr uint64_t kIntMax = static_cast<uint64_t>(std::numeric_limits<int>::max());
  if (options.max_message_bytes == 0 || options.max_message_bytes > kIntMax) {
    return InvalidArgument("the gRPC message limit must be in [1, " + std::to_string(kIntMax) +
                           "] bytes");
  }
  if (options.max_inflight_bytes < options.max_message_bytes) {
    return InvalidArgument("the gRPC in-flight byte limit must hold at least one message of " +
                           std::to_string(options.max_message_bytes) + " bytes");
  }
  if (options.max_inflight_calls < 1 || options.max_concurrent_streams < 1 ||
      options.max_stream_requests < 1 || options.max_stream_pending_bytes == 0) {
    return InvalidArgument("the gRPC call, stream and pending-byte limits must be positive");
  }
  if (options.max_connections < 1 || !(options.streams_per_second > 0) ||
      !(options.resets_per_second > 0)) {
    return InvalidArgument(
        "the gRPC connection limit and the stream and reset rates must be positive");
  }
  for (const auto& [name, value] : {std::pair{"keepalive_time", options.keepalive_time},
                                    std::pair{"keepalive_timeout", options.keepalive_timeout},
                                    std::pair{"idle_timeout", options.idle_timeout},
                                    std::pair{"handshake_timeout", options.handshake_timeout}}) {
    if (value.count() < 1 || value.count() > static_cast<int64_t>(kIntMax)) {
      return InvalidArgument(std::string("the gRPC ") + name + " must be in [1, " +
                             std::to_string(kIntMax) + "] ms");
    }
  }
  if (options.drain_timeout.count() < 0) {
    return InvalidArgument("the gRPC drain timeout must not be negative");
  }
  return std::unique_ptr<GrpcServer>(
      new GrpcServer(std::make_unique<Impl>(service, std::move(options))));
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcServer::~GrpcServer() { Stop(); }
Status GrpcServer::Bind() { return impl_->Bind(); }
Status GrpcServer::Start() { return impl_->Start(); }
void GrpcServer::Stop() { impl_->Stop(); }
uint16_t GrpcServer::port() const { return impl_->port(); }
GrpcStats GrpcServer::stats() const { return impl_->stats(); }

}  // namespace hearth
