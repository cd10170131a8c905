// The HTTP messages the front-end reads and writes (Beast's, with string
// bodies), and the responses its parts answer with: KServe's error body
// {"error": "..."} and OpenAI's.
#pragma once

#include <boost/beast/http.hpp>
#include <string>
#include <string_view>

#include "hearth/status.h"
#include "http/openai.h"

namespace hearth::rest {

namespace beast = boost::beast;
namespace http = beast::http;

using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

// With `Server: hearth`, Content-Type `content_type` (none when empty) and
// Content-Length.
Response MakeResponse(http::status status, unsigned version, bool keep_alive, std::string body,
                      std::string_view content_type);

// {"error": message}; a 503 says Retry-After: 1.
Response ErrorResponse(int status, std::string_view message, unsigned version, bool keep_alive);

// ErrorResponse with the HTTP status that `status`'s code maps to.
Response StatusResponse(const Status& status, unsigned version, bool keep_alive);

// OpenAI's error body; a 503 says Retry-After: 1.
Response OpenAiErrorResponse(const OpenAiError& error, unsigned version, bool keep_alive);

// 200 with an empty body, or `status`'s error.
Response EmptyOrError(const Status& status, unsigned version, bool keep_alive);

// An invalid_request_error of the front-end's own (a wrong method, a body too large).
OpenAiError OpenAiRequestError(int status, std::string message);

}  // namespace hearth::rest
