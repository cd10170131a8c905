#include <string>
#include <utility>
#include <vector>

#include "http/endpoints.h"
#include "http/kserve_codec.h"
#include "http/server_core.h"
#include "http/session.h"
#include "http/triton_json.h"
#include "http/workers_json.h"

namespace hearth::rest {
namespace {

Response HealthResponse(bool ok, unsigned version, bool keep_alive) {
  return MakeResponse(ok ? http::status::ok : http::status::service_unavailable, version,
                      keep_alive, "", "");
}

std::string HttpMetricsText(const HttpStats& s) {
  std::string out;
  auto metric = [&out](const char* name, const char* type, const char* help, uint64_t value) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" +
           name + " " + std::to_string(value) + "\n";
  };
  metric("hearth_http_connections", "gauge", "Open HTTP connections.", s.connections);
  metric("hearth_http_requests", "gauge",
         "Requests being received, run or answered (from a head's first byte to the response "
         "written).",
         s.requests);
  metric("hearth_http_connection_limit", "gauge",
         "Connections served at once (--max-connections, lowered to fit the descriptor limit).",
         s.connection_limit);
  metric("hearth_http_accept_paused", "gauge",
         "1 while accepting is paused: at the connection limit or after an accept error.",
         s.accept_paused ? 1 : 0);
  metric("hearth_http_accept_errors_total", "counter",
         "Accepts that failed for want of descriptors or memory.", s.accept_errors);
  metric("hearth_http_connections_evicted_total", "counter",
         "Silent or idle connections closed at the connection limit to accept waiting ones.",
         s.connections_evicted);
  metric("hearth_http_streams", "gauge",
         "Server-sent event streams being written (generate_stream, OpenAI stream: true).",
         s.streams);
  metric("hearth_http_stream_overflows_total", "counter",
         "Streams stopped because their client did not read them fast enough.", s.stream_overflows);
  metric("hearth_http_inflight_body_bytes", "gauge",
         "Request body bytes held across all connections.", s.inflight_body_bytes);
  metric("hearth_http_inflight_body_bytes_peak", "gauge",
         "The most request body bytes held at once since the start.", s.inflight_body_bytes_peak);
  metric("hearth_http_inflight_body_bytes_limit", "gauge",
         "The request body bytes held across all connections may not exceed this "
         "(--max-inflight-bytes).",
         s.inflight_body_bytes_limit);
  metric("hearth_http_body_budget_waiting", "gauge",
         "Connections waiting for request body bytes to be freed.", s.budget_waiting);
  metric("hearth_http_body_budget_waits_total", "counter",
         "Times a connection waited for request body bytes to be freed.", s.budget_waits);
  out +=
      "# HELP hearth_http_timeouts_total Connections closed for being too slow.\n"
      "# TYPE hearth_http_timeouts_total counter\n";
  const std::pair<const char*, uint64_t> phases[] = {{"head", s.head_timeouts},
                                                     {"body", s.body_timeouts},
                                                     {"idle", s.idle_timeouts},
                                                     {"write", s.write_timeouts}};
  for (const auto& [phase, value] : phases) {
    out += std::string("hearth_http_timeouts_total{phase=\"") + phase + "\"} " +
           std::to_string(value) + "\n";
  }
  return out;
}

}  // namespace

void ServeLive(Session& session, const Request& request) {
  return session.Send(
      HealthResponse(session.core()->service->Live(), request.version(), request.keep_alive()));
}

void ServeReady(Session& session, const Request& request) {
  return session.Send(
      HealthResponse(session.core()->service->Ready(), request.version(), request.keep_alive()));
}

void ServeServerMetadata(Session& session, const Request& request) {
  const ServerCore& core = *session.core();
  const InferenceService& service = *core.service;
  const std::string name =
      core.options.server_name.empty() ? service.ServerName() : core.options.server_name;
  return session.Send(MakeResponse(
      http::status::ok, request.version(), request.keep_alive(),
      ServerMetadataJson(name, service.ServerVersion(), service.Extensions()), "application/json"));
}

void ServeModelMetadata(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<ModelMetadata> metadata = session.core()->service->Metadata(route.model, route.version);
  if (!metadata.ok()) return session.Send(StatusResponse(metadata.status(), version, keep_alive));
  return session.Send(MakeResponse(http::status::ok, version, keep_alive,
                                   ModelMetadataJson(*metadata), "application/json"));
}

void ServeModelReady(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<bool> ready = session.core()->service->ModelReady(route.model, route.version);
  if (!ready.ok()) return session.Send(StatusResponse(ready.status(), version, keep_alive));
  return session.Send(HealthResponse(*ready, version, keep_alive));
}

void ServeModelConfig(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<std::string> config = session.core()->service->ModelConfigJson(route.model, route.version);
  if (!config.ok()) return session.Send(StatusResponse(config.status(), version, keep_alive));
  return session.Send(
      MakeResponse(http::status::ok, version, keep_alive, std::move(*config), "application/json"));
}

void ServeModelStatistics(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<std::vector<ModelStatistics>> stats =
      session.core()->service->Statistics(route.model, route.version);
  if (!stats.ok()) return session.Send(StatusResponse(stats.status(), version, keep_alive));
  return session.Send(MakeResponse(http::status::ok, version, keep_alive,
                                   ModelStatisticsJson(*stats), "application/json"));
}

void ServeMetrics(Session& session, const Request& request) {
  const ServerCore& core = *session.core();
  return session.Send(MakeResponse(http::status::ok, request.version(), request.keep_alive(),
                                   core.service->MetricsText() + HttpMetricsText(core.Stats()),
                                   "text/plain; version=0.0.4"));
}

void ServeWorkers(Session& session, const Request& request) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  Result<std::vector<ModelWorkers>> workers = session.core()->service->Workers();
  if (!workers.ok()) return session.Send(StatusResponse(workers.status(), version, keep_alive));
  return session.Send(MakeResponse(http::status::ok, version, keep_alive, WorkersJson(*workers),
                                   "application/json"));
}

}  // namespace hearth::rest
