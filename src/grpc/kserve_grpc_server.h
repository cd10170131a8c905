// GrpcServer: the KServe v2 gRPC front-end (inference.GRPCInferenceService,
// proto/grpc_service.proto) over an InferenceService, on grpc++'s callback
// API: no thread is held per call; calls wait for the service in reactors.
//
// RPCs (docs/grpc.md): ServerLive, ServerReady, ModelReady, ServerMetadata,
// ModelMetadata, ModelConfig, ModelStatistics, RepositoryIndex,
// RepositoryModelLoad and RepositoryModelUnload (run on a thread of the
// front-end's, since they wait for workers: gRPC's threads never block on
// them), SystemSharedMemoryRegister, SystemSharedMemoryUnregister and
// SystemSharedMemoryStatus, and their CudaSharedMemory* counterparts (a
// raw_handle of the 64 bytes of a CUDA IPC handle); ModelInfer (one
// request, one response; a decoupled model's responses joined as the
// service joins them; inputs and outputs inline or in registered system or
// CUDA shared memory, outputs optionally classified); ModelStreamInfer (each request of the stream
// is one Infer, answered in the order the answers come: a decoupled model's responses each as it
// comes, `triton_final_response` true on the last; a request's error in `error_message`, after
// which the stream goes on). LogSettings reads and changes this process's log settings
// (common/log_settings.h); TraceSetting answers that tracing is off (common/trace_settings.h).
//
// Limits (every resource a client can make the front-end hold):
// - message size: a received message over max_message_bytes is refused
//   with RESOURCE_EXHAUSTED by gRPC itself;
// - calls: at most max_inflight_calls ModelInfer and ModelStreamInfer calls
//   at once that are not answered yet (a call answered and still being sent
//   counts no longer: its request's bytes do, until gRPC is done with it),
//   and at most max_inflight_bytes of their requests held; past
//   either a ModelInfer is answered RESOURCE_EXHAUSTED (a stream's request
//   gets the same error in its error_message), never queued;
// - streams: HTTP/2 allows max_concurrent_streams calls per connection; one
//   stream has at most max_stream_requests requests in the service, and
//   reads no further request until one is answered (the client's writes then
//   wait on HTTP/2 flow control); responses waiting for a client that does
//   not read are at most max_stream_pending_bytes, past which the request
//   they belong to is stopped (its `on_response` returns false) and answered
//   with an error;
// - inputs in shared memory: their byte sizes count towards
//   max_inflight_bytes too (the service reads them into memory it holds
//   while the request runs);
// - repository control: loads and unloads run on the service's bounded
//   pool (InferenceService::LoadModel), which refuses past its limit
//   (RESOURCE_EXHAUSTED);
// - gRPC's own buffers: a ResourceQuota of max_inflight_bytes plus one
//   message, so that the byte budget above is met first;
// - compression: a ModelInfer or ModelStreamInfer message compressed with
//   gzip or deflate is measured as it is inflated and refused past
//   max_message_bytes (RESOURCE_EXHAUSTED) before anything of it is held;
//   gRPC itself inflates nothing (grpc 1.51 would inflate a message whole
//   before comparing it with the limit), so other RPCs must come uncompressed;
// - memory freed after a burst (a flood of streams holds about 17 KiB of
//   gRPC's call state each until they are done) is given back to the kernel
//   once the allocator holds more than heap_trim_bytes free;
// - streams opened and reset, and connections: grpc++ 1.51 bounds none of
//   them (and enforces max_concurrent_streams only on a client that
//   acknowledged its SETTINGS), so the port is an Http2Gate's, which relays
//   each connection to grpc++ and reads its frame headers: a connection
//   opening more than streams_per_second streams is paced, one with more
//   than 2 × max_concurrent_streams open or resetting more than
//   resets_per_second streams is closed, at most max_connections are open;
// - connections: keepalive pings find dead peers of open calls, a
//   connection without calls for idle_timeout is closed (GOAWAY), the
//   HTTP/2 preface must arrive within handshake_timeout.
// A cancelled call (the client went away, or its deadline passed) sets its
// requests' `cancelled`, so the server stops them.
//
// Ownership and threads: the server does not own `service`, which must
// outlive it. The service's methods are called from gRPC's threads
// concurrently, and Infer's `done` and `on_response` may be called from any
// thread. Start() and Stop() are not thread-safe with each other; stats() is
// thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "grpc/http2_gate.h"
#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

struct GrpcOptions {
  std::string host = "127.0.0.1";  // an address or a name that resolves to one
  uint16_t port = 8001;            // 0: pick a free port (port() tells which)
  // Largest message received; as REST's body limit.
  uint64_t max_message_bytes = uint64_t{64} << 20;
  uint64_t max_inflight_bytes = uint64_t{1} << 30;
  int max_inflight_calls = 1024;
  int max_concurrent_streams = 128;  // per connection
  int max_stream_requests = 64;      // per stream
  uint64_t max_stream_pending_bytes = uint64_t{64} << 20;
  std::chrono::milliseconds keepalive_time{60'000};  // ping a connection that has calls
  std::chrono::milliseconds keepalive_timeout{20'000};
  std::chrono::milliseconds idle_timeout{300'000};
  std::chrono::milliseconds handshake_timeout{10'000};
  // Stop(): how long calls in progress get before they are cancelled.
  std::chrono::milliseconds drain_timeout{20'000};
  // While serving, memory the allocator holds free past this is given back
  // to the kernel (checked every second; HeapTrimmer); 0: never.
  uint64_t heap_trim_bytes = uint64_t{64} << 20;
  // The port's own listener (Http2Gate): connections at once, and per
  // connection the streams it may open a second (beyond which it is paced)
  // and the streams it may reset a second (beyond which it is closed).
  int max_connections = 1024;
  double streams_per_second = 100000;
  double resets_per_second = 200;
  // The name ServerMetadata answers with; empty: the service's (ServerName()).
  std::string server_name;
};

// What the front-end holds now; thread-safe snapshots for tests.
struct GrpcStats {
  bool listening = false;
  bool draining = false;
  uint64_t inflight_calls = 0;    // ModelInfer and ModelStreamInfer calls not yet done
  uint64_t unanswered_calls = 0;  // of those, not yet answered (max_inflight_calls bounds them)
  uint64_t inflight_bytes = 0;    // of their requests, held
  uint64_t streams = 0;           // open ModelStreamInfer calls
  uint64_t stream_requests = 0;   // requests of streams in the service now
  uint64_t refused_calls = 0;     // calls or stream requests refused at a limit
  uint64_t stopped_requests = 0;  // stream requests stopped for an unread backlog
  uint64_t control_calls = 0;     // repository loads and unloads in progress
  Http2GateStats gate;            // connections, and those closed at a limit
};

class GrpcServer {
 public:
  // InvalidArgument for a null service or bad options. Binds nothing yet.
  static Result<std::unique_ptr<GrpcServer>> Create(InferenceService* service, GrpcOptions options);
  ~GrpcServer();  // Stop()s
  GrpcServer(const GrpcServer&) = delete;
  GrpcServer& operator=(const GrpcServer&) = delete;

  // Binds and listens, accepting nothing yet: clients that connect wait in
  // the backlog until Start. Unavailable when the address cannot be bound
  // (SO_REUSEPORT is off: a port in use is an error, as for REST);
  // FailedPrecondition when called twice or after Start. Optional: Start
  // binds if this was not called.
  Status Bind();
  // Binds (unless Bind did), listens and serves. Unavailable when the
  // address cannot be bound; FailedPrecondition when called twice.
  Status Start();
  // Drains, then stops: refuses new calls, lets calls in progress finish
  // (an open stream answers the requests it has read, then ends with
  // UNAVAILABLE "shutting down" instead of reading more), and cancels what
  // remains after drain_timeout. Returns once the service has called `done`
  // for every infer it was given and every repository load and unload it
  // was asked for has returned (no deadline: the service bounds them).
  // Idempotent.
  void Stop();
  // The bound port once Start() succeeded (the chosen one for port 0), else 0.
  uint16_t port() const;
  GrpcStats stats() const;

 private:
  class Impl;
  explicit GrpcServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
