// The state the listener, the sessions and the endpoints' handlers share.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "http/body_budget.h"
#include "http/http_server.h"
#include "server/inference_api.h"

namespace hearth::rest {

class Session;

// State the sessions share with the server. Owned by the Listener, which
// outlives every handler that runs (Stop() joins the I/O threads first).
struct ServerCore {
  ServerCore(InferenceService* service_in, HttpOptions options_in)
      : service(service_in),
        options(std::move(options_in)),
        body_limit(std::min(options.max_body_bytes, options.max_inflight_bytes)),
        budget(options.max_inflight_bytes) {}

  // Wakes Stop() when what it waits for may have changed. Only while
  // stopping, so that the request path takes no lock for it: the flag and
  // the counters are sequentially consistent, so either the session sees
  // `stopping` or Stop() sees the session's change. (Called on I/O threads,
  // which Stop() joins before anything is destroyed.)
  void Changed() {
    if (!stopping.load()) return;
    std::lock_guard lock(mutex);
    changed.notify_all();
  }

  HttpStats Stats() const;

  InferenceService* const service;
  const HttpOptions options;
  const uint64_t body_limit;  // the largest body answered with anything but 413
  BodyBudget budget;

  std::atomic<bool> stopping{false};
  // False once the acceptor is closed: closing sessions stop waking it.
  std::atomic<bool> accepting{true};
  std::atomic<bool> accept_paused{false};
  std::atomic<bool> listening{false};
  std::atomic<uint64_t> connection_limit{0};
  std::atomic<uint64_t> connections{0};
  // Sessions between the first byte of a request and its response written.
  std::atomic<uint64_t> busy{0};
  std::atomic<uint64_t> accept_errors{0};
  std::atomic<uint64_t> head_timeouts{0};
  std::atomic<uint64_t> body_timeouts{0};
  std::atomic<uint64_t> idle_timeouts{0};
  std::atomic<uint64_t> write_timeouts{0};
  std::atomic<uint64_t> connections_evicted{0};
  std::atomic<uint64_t> streams{0};           // event streams whose head is sent, not yet ended
  std::atomic<uint64_t> stream_overflows{0};  // streams stopped for a client that fell behind
  // Posts Listener::ResumeAccepting onto the acceptor's strand; set before Start
  // runs any handler.
  std::function<void()> wake_acceptor;

  std::mutex mutex;
  std::condition_variable changed;
  uint64_t in_flight = 0;  // infers given to the service whose `done` has not returned

  // Every open session, for Stop() to reach them.
  std::mutex sessions_mutex;
  std::unordered_map<uint64_t, std::weak_ptr<Session>> sessions;
  std::atomic<uint64_t> next_session{1};
};

// Counts one infer as in flight from the moment it is given to the service
// until its `done` has handed the response to the connection's strand: Stop()
// keeps the I/O context alive until then.
class InFlightInfer {
 public:
  explicit InFlightInfer(ServerCore* core) : core_(core) {
    std::lock_guard lock(core_->mutex);
    ++core_->in_flight;
  }
  // Notifies under the lock: once in_flight is 0, Stop() may return and
  // destroy the condition variable, and this may run on the service's thread.
  ~InFlightInfer() {
    std::lock_guard lock(core_->mutex);
    --core_->in_flight;
    core_->changed.notify_all();
  }
  InFlightInfer(const InFlightInfer&) = delete;
  InFlightInfer& operator=(const InFlightInfer&) = delete;

 private:
  ServerCore* core_;
};

}  // namespace hearth::rest
