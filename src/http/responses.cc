#include "http/responses.h"

#include <utility>

#include "http/kserve_codec.h"

namespace hearth::rest {

Response MakeResponse(http::status status, unsigned version, bool keep_alive, std::string body,
                      std::string_view content_type) {
  Response response(status, version);
  response.set(http::field::server, "hearth");
  if (!content_type.empty()) response.set(http::field::content_type, content_type);
  response.keep_alive(keep_alive);
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

Response ErrorResponse(int status, std::string_view message, unsigned version, bool keep_alive) {
  Response response = MakeResponse(static_cast<http::status>(status), version, keep_alive,
                                   ErrorJson(message), "application/json");
  if (status == 503) response.set(http::field::retry_after, "1");
  return response;
}

Response StatusResponse(const Status& status, unsigned version, bool keep_alive) {
  return ErrorResponse(HttpStatusFor(status.code()), status.message(), version, keep_alive);
}

Response OpenAiErrorResponse(const OpenAiError& error, unsigned version, bool keep_alive) {
  Response response = MakeResponse(static_cast<http::status>(error.status), version, keep_alive,
                                   OpenAiErrorJson(error), "application/json");
  if (error.status == 503) response.set(http::field::retry_after, "1");
  return response;
}

Response EmptyOrError(const Status& status, unsigned version, bool keep_alive) {
  if (!status.ok()) return StatusResponse(status, version, keep_alive);
  return MakeResponse(http::status::ok, version, keep_alive, "", "");
}

OpenAiError OpenAiRequestError(int status, std::string message) {
  OpenAiError error;
  error.status = status;
  error.message = std::move(message);
  return error;
}

}  // namespace hearth::rest
