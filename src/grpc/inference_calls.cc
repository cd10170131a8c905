#include "grpc/grpc_server_impl.h"

namespace hearth {

// ---- ModelInfer --------------------------------------------------------------

// One ModelInfer call. Owns itself: deleted in OnDone, which gRPC calls after
// Finish, and Finish comes only from the service's `done` (or before the
// service is called). The request, whose raw inputs the service borrows, is
// the call's and lives until then.
class GrpcServer::Impl::InferCall final : public grpc::ServerUnaryReactor {
 public:
  InferCall(Impl* server, const grpc::ByteBuffer* message, grpc::ByteBuffer* response)
      : server_(server), message_(message), response_(response) {}

  void Start() {
    if (Status admitted = server_->BeginCall(); !admitted.ok()) {
      return Finish(ToGrpcStatus(admitted));
    }
    admitted_ = true;
    // From here on every answer goes through Reply.
    Status read = server_->ReadRequest(*message_, &bytes_, &request_);
    // Read: the message's bytes go now rather than with the call. gRPC
    // created the buffer for this call and reads it no more.
    const_cast<grpc::ByteBuffer*>(message_)->Clear();
    if (!read.ok()) return Reply(ToGrpcStatus(read));
    Result<GrpcInferRequest> parsed = ParseModelInferRequest(request_, nullptr);
    if (!parsed.ok()) return Reply(ToGrpcStatus(parsed.status()));
    InferRequest& request = parsed->request;
    const uint64_t shared = SharedMemoryInputBytes(request);
    if (Status taken = server_->TakeBytes(shared); !taken.ok()) return Reply(ToGrpcStatus(taken));
    bytes_ += shared;
    outputs_ = request.outputs;
    request.cancelled = cancelled_;
    // `done` may run on any thread, even inside Infer; the outputs it gets
    // may be borrowed, so they are copied into the response right there.
    server_->service().Infer(std::move(request), [this](Result<InferResponse> result) {
      if (!result.ok()) return Reply(ToGrpcStatus(result.status()));
      ModelInferResponse response;
      if (Status encoded = EncodeModelInferResponse(*result, outputs_, &response); !encoded.ok()) {
        return Reply(ToGrpcStatus(encoded));
      }
      Result<grpc::ByteBuffer> wire = Serialized(response);
      if (!wire.ok()) return Reply(ToGrpcStatus(wire.status()));
      *response_ = std::move(*wire);
      Reply(grpc::Status::OK);
    });
  }

  void OnCancel() override { cancelled_->store(true); }

  void OnDone() override {
    if (bytes_ > 0) server_->GiveBytes(bytes_);
    if (admitted_) server_->EndCall();
    delete this;
  }

 private:
  void Reply(grpc::Status status) {
    server_->AnsweredCall();
    Finish(std::move(status));
  }

  Impl* const server_;
  const grpc::ByteBuffer* const message_;  // gRPC's, as received
  grpc::ByteBuffer* const response_;       // gRPC's, sent as it is
  ModelInferRequest request_;
  std::vector<RequestedOutput> outputs_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  bool admitted_ = false;
  uint64_t bytes_ = 0;
};

grpc::ServerUnaryReactor* GrpcServer::Impl::ModelInfer(grpc::CallbackServerContext*,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  auto* call = new InferCall(this, request, response);
  call->Start();
  return call;
}

// ---- ModelStreamInfer -----------------------------------------------------------

// One ModelStreamInfer call. Shared ownership: gRPC's hold (self_, dropped
// in OnDone) and each of its requests' (until the service has called their
// `done`), so that a `done` that finishes the stream can still unlock it.
// Every gRPC operation (StartRead, StartWrite, Finish) is started under mu_
// and none after Finish; gRPC never calls a reaction from inside them.
class GrpcServer::Impl::StreamCall final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
      public std::enable_shared_from_this<StreamCall> {
 public:
  static StreamCall* Open(Impl* server) {
    std::shared_ptr<StreamCall> call(new StreamCall(server));
    call->self_ = call;
    call->Begin();
    return call.get();
  }

  // Stop(): answer what has been read, read nothing more, then end.
  void Drain() {
    std::lock_guard lock(mu_);
    draining_ = true;
    MaybeFinishLocked();
  }

  void OnReadDone(bool ok) override {
    grpc::ByteBuffer message;
    bool unrun = false;
    {
      std::lock_guard lock(mu_);
      if (!ok) {
        reading_ = false;
        read_closed_ = true;  // the client is done writing, or gone
        MaybeFinishLocked();
        return;
      }
      if (cancelled_ || finished_) {
        reading_ = false;
        MaybeFinishLocked();
        return;
      }
      message.Swap(&read_buffer_);
      ++inflight_;  // the stream cannot finish before this request's end
      // Read as a drain began: answered, not run.
      unrun = draining_;
    }
    // The next read starts only once this request is in the service, so
    // that a stream's requests reach it in the order they were sent (a
    // sequence's steps depend on it): reading_ stays set until then, so
    // that an answer finishing meanwhile (OnFinal) starts no read.
    const std::shared_ptr<StreamCall> keep = shared_from_this();  // past the request's end
    Submit(message, unrun);
    std::lock_guard lock(mu_);
    reading_ = false;
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard lock(mu_);
    writing_ = false;
    pending_bytes_ -= writing_bytes_;
    writing_bytes_ = 0;
    current_.Clear();
    if (!ok) {
      CancelLocked();  // the client is gone: nothing more can be written
    } else {
      MaybeWriteLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard lock(mu_);
    CancelLocked();
    MaybeFinishLocked();
  }

  void OnDone() override {
    std::shared_ptr<StreamCall> self = std::move(self_);
    server_->RemoveStream(self);
    if (admitted_) server_->EndCall();
    // `self` may be the last owner: this object goes with it.
  }

 private:
  // One request of the stream, shared by its `on_response` and `done`.
  struct Request {
    std::shared_ptr<StreamCall> call;
    std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
    std::string model, version, id;
    std::vector<RequestedOutput> outputs;
    bool decoupled = false;
    bool empty_final = false;
    uint64_t bytes = 0;       // taken from the server's budget
    bool registered = false;  // in the stream's cancellation set
    Status failed;            // an earlier response could not be encoded
    bool overflowed = false;  // stopped: the client did not read
  };

  explicit StreamCall(Impl* server) : server_(server) {}

  void Begin() {
    std::lock_guard lock(mu_);
    if (Status admitted = server_->BeginCall(); !admitted.ok()) {
      finished_ = true;
      Finish(ToGrpcStatus(admitted));
      return;
    }
    admitted_ = true;
    server_->AddStream(shared_from_this());
    MaybeReadLocked();
  }

  // Reads and checks one request and hands it to the service (`unrun`:
  // answers it without running it); every failure before that is the
  // request's answer on the stream.
  void Submit(grpc::ByteBuffer& message, bool unrun) {
    auto request = std::make_shared<Request>();
    request->call = shared_from_this();
    auto proto = std::make_shared<ModelInferRequest>();
    Status read = server_->ReadRequest(message, &request->bytes, proto.get());
    message.Clear();
    request->model = proto->model_name();
    request->version = proto->model_version();
    request->id = proto->id();
    if (!read.ok()) return Complete(*request, std::move(read));
    if (unrun) {
      return Complete(*request,
                      Unavailable("the server is shutting down: the request was not run"));
    }
    // Views into `proto` share it: it lives as long as the service keeps them.
    Result<GrpcInferRequest> parsed = ParseModelInferRequest(*proto, proto);
    if (!parsed.ok()) return Complete(*request, parsed.status());
    InferRequest& infer = parsed->request;
    const uint64_t shared = SharedMemoryInputBytes(infer);
    if (Status taken = server_->TakeBytes(shared); !taken.ok()) {
      return Complete(*request, std::move(taken));
    }
    request->bytes += shared;
    // Whether its responses stream (the model's transaction policy) decides
    // how the stream ends them.
    const Result<hearth::ModelMetadata> metadata =
        server_->service().Metadata(infer.model, infer.version);
    if (!metadata.ok()) return Complete(*request, metadata.status());
    request->decoupled = metadata->decoupled;
    request->empty_final = parsed->empty_final_response;
    request->outputs = infer.outputs;
    infer.cancelled = request->cancelled;
    {
      std::lock_guard lock(mu_);
      if (cancelled_) request->cancelled->store(true);
      cancellations_.insert(request->cancelled);
      request->registered = true;
    }
    server_->CountStreamRequest(1);
    if (request->decoupled) {
      infer.on_response = [request](const InferResponse& response) {
        return request->call->OnPartial(*request, response);
      };
    }
    server_->service().Infer(std::move(infer), [request](Result<InferResponse> result) {
      request->call->OnFinal(*request, std::move(result));
    });
  }

  // A decoupled request's response before its last: written as it comes.
  // False stops the request: the stream is gone, the client does not read,
  // or the response cannot be encoded.
  bool OnPartial(Request& request, const InferResponse& response) {
    auto message = std::make_unique<ModelStreamInferResponse>();
    Status encoded =
        EncodeModelInferResponse(response, request.outputs, message->mutable_infer_response());
    if (!encoded.ok()) {
      request.failed = std::move(encoded);
      return false;
    }
    SetFinal(*message, false);
    Result<grpc::ByteBuffer> wire = Serialized(*message);
    if (!wire.ok()) {
      request.failed = wire.status();
      return false;
    }
    message.reset();
    std::lock_guard lock(mu_);
    if (cancelled_ || finished_) return false;
    if (wire->Length() > server_->options().max_stream_pending_bytes - pending_bytes_) {
      request.overflowed = true;
      server_->CountStoppedRequest();
      return false;
    }
    QueueLocked(std::move(*wire));
    return true;
  }

  // The request's end: its last response, or its error.
  void OnFinal(Request& request, Result<InferResponse> result) {
    server_->CountStreamRequest(-1);
    std::unique_ptr<ModelStreamInferResponse> message;
    if (!request.failed.ok()) {
      message = ErrorMessage(request, request.failed);
    } else if (request.overflowed) {
      message = ErrorMessage(
          request,
          ResourceExhausted("the request was stopped: its responses were not read (more than " +
                            std::to_string(server_->options().max_stream_pending_bytes) +
                            " bytes of the stream's responses were waiting for the client)"));
    } else if (!result.ok()) {
      message = ErrorMessage(request, result.status());
    } else if (!request.decoupled || !result->outputs.empty() || request.empty_final) {
      message = std::make_unique<ModelStreamInferResponse>();
      Status encoded =
          EncodeModelInferResponse(*result, request.outputs, message->mutable_infer_response());
      if (!encoded.ok()) {
        message = ErrorMessage(request, encoded);
      } else {
        SetFinal(*message, true);
      }
    }
    // else: a decoupled stream that ended without a last response, which
    // Triton's clients are told of only when they asked for it.
    Complete(request, std::move(message));
  }

  void Complete(Request& request, Status error) { Complete(request, ErrorMessage(request, error)); }

  void Complete(Request& request, std::unique_ptr<ModelStreamInferResponse> message) {
    if (request.bytes > 0) server_->GiveBytes(request.bytes);
    request.bytes = 0;
    std::optional<grpc::ByteBuffer> wire;
    if (message != nullptr) {
      Result<grpc::ByteBuffer> serialized = Serialized(*message);
      if (!serialized.ok()) serialized = Serialized(*ErrorMessage(request, serialized.status()));
      if (serialized.ok()) wire = std::move(*serialized);
      message.reset();
    }
    std::lock_guard lock(mu_);
    if (request.registered) cancellations_.erase(request.cancelled);
    request.registered = false;
    --inflight_;
    // The last answer of a request always goes out: one per request, and
    // the stream reads no more requests while it is behind.
    if (wire.has_value() && !cancelled_ && !finished_) QueueLocked(std::move(*wire));
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  static std::unique_ptr<ModelStreamInferResponse> ErrorMessage(const Request& request,
                                                                const Status& error) {
    auto message = std::make_unique<ModelStreamInferResponse>();
    message->set_error_message(error.message());
    // Which request failed, for clients that match answers by id.
    ModelInferResponse* response = message->mutable_infer_response();
    response->set_model_name(request.model);
    response->set_model_version(request.version);
    response->set_id(request.id);
    return message;
  }

  static void SetFinal(ModelStreamInferResponse& message, bool final) {
    (*message.mutable_infer_response()->mutable_parameters())[std::string(kFinalResponseParameter)]
        .set_bool_param(final);
  }

  void QueueLocked(grpc::ByteBuffer message) {
    pending_bytes_ += message.Length();
    queue_.push_back(std::move(message));
    MaybeWriteLocked();
  }

  void MaybeWriteLocked() {
    if (writing_ || queue_.empty() || finished_ || cancelled_) return;
    current_ = std::move(queue_.front());
    writing_bytes_ = current_.Length();
    queue_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  // Reads the next request unless the stream is at its limit of requests in
  // the service, or ending.
  void MaybeReadLocked() {
    if (reading_ || read_closed_ || cancelled_ || draining_ || finished_) return;
    if (inflight_ >= server_->options().max_stream_requests) return;
    reading_ = true;
    StartRead(&read_buffer_);
  }

  void CancelLocked() {
    cancelled_ = true;
    for (const auto& flag : cancellations_) flag->store(true);
    for (const grpc::ByteBuffer& message : queue_) pending_bytes_ -= message.Length();
    queue_.clear();
  }

  // Finishes once nothing is in the service or being written, and the
  // stream has a reason to end: cancelled, draining, or read to its end.
  void MaybeFinishLocked() {
    if (finished_ || writing_ || inflight_ > 0) return;
    grpc::Status status;
    if (cancelled_) {
      status = grpc::Status(grpc::StatusCode::CANCELLED, "the stream was cancelled");
    } else if (!queue_.empty()) {
      return;  // being written (cannot happen: MaybeWriteLocked starts it)
    } else if (draining_) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
    } else if (read_closed_) {
      status = grpc::Status::OK;
    } else {
      return;
    }
    finished_ = true;
    server_->AnsweredCall();
    Finish(std::move(status));
  }

  Impl* const server_;
  std::shared_ptr<StreamCall> self_;  // gRPC's reference, until OnDone
  bool admitted_ = false;             // counted by BeginCall (set once, in Begin)

  std::mutex mu_;
  grpc::ByteBuffer read_buffer_;  // the read in progress writes here
  bool reading_ = false;
  bool read_closed_ = false;
  bool writing_ = false;
  bool cancelled_ = false;  // the client is gone: nothing more is written
  bool draining_ = false;
  bool finished_ = false;
  int inflight_ = 0;  // requests read and not yet answered
  std::set<std::shared_ptr<std::atomic<bool>>> cancellations_;  // of those in the service
  std::deque<grpc::ByteBuffer> queue_;                          // responses in their wire form
  grpc::ByteBuffer current_;                                    // being written
  uint64_t writing_bytes_ = 0;
  uint64_t pending_bytes_ = 0;  // queued and being written
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GrpcServer::Impl::ModelStreamInfer(
    grpc::CallbackServerContext*) {
  return StreamCall::Open(this);
}

void GrpcServer::Impl::Drain(const std::vector<std::shared_ptr<StreamCall>>& streams) {
  for (const auto& stream : streams) stream->Drain();
}

}  // namespace hearth
