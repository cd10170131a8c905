// Engines: the models of a decoupled config (model_transaction_policy:
// {decoupled: true}) that run inside hearth-worker. Where a Backend answers
// a batch with one set of outputs, an Engine holds requests (streams) and
// answers each with any number of responses: hearth-worker hands it every
// request the server opens (Add) and drops those the server ends (Cancel),
// and calls Step while it is busy; each Step advances every request it holds
// by one step (one forward for all of them together, in a generation
// engine) and emits their responses through a ResponseSink.
//
// A backend kind (backends/registry.h) provides a Backend, an Engine or
// both; a decoupled model whose kind provides no engine fails at start.
//
// Thread-safety: one thread uses an Engine and the sinks it is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "backends/backend.h"

namespace hearth {

struct EngineOptions : BackendOptions {
  // The requests the worker will hold at once (the config's
  // parameters.max_streams); the engine's capacity() must be at least this.
  uint32_t max_streams = 1;
};

// One input of a request: its bytes (KServe's form for BYTES) and its full
// shape, with the leading 1 when the config batches.
struct EngineInput {
  std::span<const std::byte> bytes;
  std::span<const int64_t> shape;
};

// A request as Add receives it. Every view stays valid until the request's
// final response was sent through a sink, or until Cancel(id): the engine
// keeps views, not copies.
struct EngineRequest {
  std::span<const EngineInput> inputs;  // in inputs() order
  std::string_view parameters_json;     // a JSON object's text, or empty
  // A stream that resumes after its worker died: the token ids its client
  // already has (the token_ids outputs of every response sent, in order).
  // The engine goes on after them; empty for a new stream.
  std::span<const int64_t> resume;
};

// Where an engine's responses go. A response is built for one request at a
// time: room for any of its outputs (each at most once), written in place,
// then End. The room is the response's own place in the worker's response
// ring (WorkerSession::StreamOutput): nothing is copied after the engine
// writes it. Outputs given no room are absent from the response.
class ResponseSink {
 public:
  virtual ~ResponseSink() = default;

  // Room for output i of the response being built for request `id`: its
  // full shape (the leading 1 when the config batches) and its bytes
  // (for BYTES the serialised size; for other types what the shape needs).
  // Valid until End for that response. An error (a shape or size the
  // output cannot have, a response for another request still being built,
  // the worker's channel to the server broken) ends the worker: Step
  // returns it.
  virtual Result<std::byte*> Output(uint64_t id, size_t i, std::span<const int64_t> shape,
                                    uint64_t bytes) = 0;

  // Sends the response: `final` ends the request; an error `status` ends it
  // too, its outputs not sent. True: sent. False: `id` is not open (it was
  // cancelled): nothing was sent, and the engine should drop it. After a
  // final response (or an error) the engine holds the request no more and
  // its views are gone. An error ends the worker, as for Output.
  virtual Result<bool> End(uint64_t id, bool final, const Status& status = Status::Ok()) = 0;
};

// What an engine holds now, for the server's metrics: the blocks of its KV
// cache in use and in all, and the streams it has preempted (given their
// cache back, to go on later) in its life. Zero where it has none.
struct EngineCounters {
  uint64_t kv_blocks_used = 0;
  uint64_t kv_blocks_total = 0;
  uint64_t preemptions = 0;
  bool operator==(const EngineCounters&) const = default;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // Per request, as a Backend's per sample: no batch dimension (the shapes
  // in requests and responses have a leading 1 when the config batches);
  // -1 where a dimension varies.
  virtual const std::vector<IoSpec>& inputs() const = 0;
  virtual const std::vector<IoSpec>& outputs() const = 0;
  // The requests it holds at once; Add is never called with more open.
  virtual uint32_t capacity() const = 0;
  // Device memory this engine allocated itself (caches, workspaces).
  virtual uint64_t device_memory_bytes() const = 0;

  // A new request, `id` never used before in this engine's life. An error
  // is this request's (bad inputs or parameters): the worker ends it with
  // that error and the engine holds nothing of it.
  virtual Status Add(uint64_t id, const EngineRequest& request) = 0;
  // The request is over (its client went away, its deadline passed): drop
  // it without another response. Ids it does not hold are ignored.
  virtual void Cancel(uint64_t id) = 0;
  // One step for every request it holds: zero or more responses through
  // `sink`; a request that fails alone ends with its error (sink.End with
  // a status). An error returned is every request's (the worker ends each
  // the engine holds with it, and cancels them), unless it is the sink's
  // own error passed on; DeviceLost: the process's CUDA context is gone and
  // the worker exits. A Step leaves no response half built.
  virtual Status Step(ResponseSink& sink) = 0;
  // It holds requests that need a Step.
  virtual bool busy() const = 0;
  virtual EngineCounters counters() const { return {}; }
};

// Builds the engine of `kind` (through the registry, as CreateBackend) on
// the weights' device. The weights must outlive the engine.
// FailedPrecondition naming the kind when it provides no engine.
Result<std::unique_ptr<Engine>> CreateEngine(std::string_view kind,
                                             const std::vector<TensorView>& weights, Device device,
                                             const EngineOptions& options);

// The built-in engine "count", the reference of this interface and the
// engine of tests. It needs no weights (it ignores whatever the version
// holds). Input "n" INT64 [1] (1 <= n <= 2^20); parameters: "start" (an
// integer, or one as a string; 0 by default), others ignored. Each step
// sends every request one response, output "token_ids" INT64 [-1] = [the
// next number], counting start, start + 1, ..., start + n - 1; the last is
// final. A resumed request checks that the tokens its client has are the
// first of that count and goes on after them. capacity() is
// options.max_streams, or parameters.capacity (for tests of a smaller one).
Result<std::unique_ptr<Engine>> CreateCountEngine(const EngineOptions& options);

}  // namespace hearth
