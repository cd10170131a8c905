#include "http/server_core.h"

namespace hearth::rest {

HttpStats ServerCore::Stats() const {
  HttpStats s;
  s.draining = stopping.load();
  s.listening = listening.load();
  s.connections = connections.load();
  s.requests = busy.load();
  s.connection_limit = connection_limit.load();
  s.accept_paused = accept_paused.load();
  s.accept_errors = accept_errors.load();
  const BodyBudget::Snapshot b = budget.snapshot();
  s.inflight_body_bytes = b.held;
  s.inflight_body_bytes_peak = b.peak;
  s.inflight_body_bytes_limit = b.limit;
  s.budget_waiting = b.waiting;
  s.budget_waits = b.waits;
  s.head_timeouts = head_timeouts.load();
  s.body_timeouts = body_timeouts.load();
  s.idle_timeouts = idle_timeouts.load();
  s.write_timeouts = write_timeouts.load();
  s.connections_evicted = connections_evicted.load();
  s.streams = streams.load();
  s.stream_overflows = stream_overflows.load();
  return s;
}

}  // namespace hearth::rest
