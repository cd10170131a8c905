#include <string>

#include "common/log_settings.h"
#include "common/trace_settings.h"
#include "http/endpoints.h"
#include "http/server_core.h"
#include "http/session.h"
#include "http/triton_json.h"

namespace hearth::rest {

void ServeLogging(Session& session, const Request& request) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  if (request.method() == http::verb::post) {
    Result<LogSettingsUpdate> update = ParseLogSettingsBody(request.body());
    if (!update.ok()) return session.Send(StatusResponse(update.status(), version, keep_alive));
    if (Status applied = UpdateLogSettings(*update); !applied.ok()) {
      return session.Send(StatusResponse(applied, version, keep_alive));
    }
  }
  return session.Send(MakeResponse(http::status::ok, version, keep_alive,
                                   LogSettingsJson(CurrentLogSettings()), "application/json"));
}

void ServeTraceSetting(Session& session, const Request& request, const Route& route) {
  const unsigned version = request.version();
  const bool keep_alive = request.keep_alive();
  if (!route.model.empty()) {
    // A model's settings: those of the server, for a model it knows.
    Result<ModelMetadata> metadata = session.core()->service->Metadata(route.model, route.version);
    if (!metadata.ok() && metadata.status().code() == StatusCode::kNotFound) {
      return session.Send(StatusResponse(metadata.status(), version, keep_alive));
    }
  }
  if (request.method() == http::verb::post) {
    if (Status valid = CheckTraceSettingsBody(request.body()); !valid.ok()) {
      return session.Send(StatusResponse(valid, version, keep_alive));
    }
  }
  return session.Send(MakeResponse(http::status::ok, version, keep_alive,
                                   TraceSettingsJson(CurrentTraceSettings()), "application/json"));
}

}  // namespace hearth::rest
