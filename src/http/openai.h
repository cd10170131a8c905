// The OpenAI-compatible endpoints: POST /v1/completions, POST
// /v1/chat/completions and GET /v1/models. Their bodies, the fixed mapping
// onto a model's inputs, outputs and parameters (docs/generate.md), their
// answers whole or as server-sent events, and OpenAI's error format.
//
// Pure: no sockets, no service. The functions are thread-safe and never
// throw; an OpenAiCompletion is used by one thread at a time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

enum class OpenAiEndpoint { kCompletions, kChatCompletions };

// The names the mapping uses.
inline constexpr std::string_view kPromptInput = "text_input";
inline constexpr std::string_view kMessagesInput = "messages";
inline constexpr std::string_view kTextOutput = "text_output";
inline constexpr std::string_view kPromptTokensOutput = "prompt_tokens";
inline constexpr std::string_view kCompletionTokensOutput = "completion_tokens";
inline constexpr std::string_view kFinishReasonOutput = "finish_reason";

// An error as OpenAI writes it: the HTTP status, and the body
// {"error": {"message", "type", "param", "code"}} (empty param or code: null).
struct OpenAiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
};
std::string OpenAiErrorJson(const OpenAiError& error);
// The error for a failed Status: 400 (InvalidArgument, FailedPrecondition)
// as invalid_request_error about `param`; 404 (NotFound) with code
// model_not_found, about "model"; 503 (Unavailable, ResourceExhausted),
// 504 (DeadlineExceeded) and 500 (anything else) as server_error.
OpenAiError OpenAiErrorFor(const Status& status, std::string_view param = "");

// What a request asks for, read before its model is looked up.
struct OpenAiRequest {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  std::string model;
  bool stream = false;
  std::optional<int64_t> max_tokens;
  // The input's one element: the prompt (completions), or the text of the
  // messages list exactly as the body has it (chat).
  std::string input;
  // {"max_tokens", "temperature", "top_p", "stop", "seed"}: those given
  // (not null), with their values as sent; empty when none is.
  std::string parameters_json;
};

// Parses a completions or chat body. `model` (a string) is required; so is
// `prompt` (a string, or a list of one string) for completions, and
// `messages` (a non-empty list of objects, each with a string "role") for
// chat. `stream` is a boolean, `max_tokens` a positive integer,
// `temperature` a number >= 0, `top_p` a number in [0, 1], `stop` a string
// or a list of strings, `seed` an integer, `n` 1 if given; a field that is
// null counts as not given, and fields not named here are ignored (OpenAI's
// clients send many). InvalidArgument otherwise, with `*param` set to the
// field at fault (left empty for a body that is not JSON).
Result<OpenAiRequest> ParseOpenAiRequest(std::string_view body, OpenAiEndpoint endpoint,
                                         std::string* param);

// The request for the model `metadata` describes: its input (text_input
// for completions, messages for chat) as one BYTES element of shape [1], or
// [1, 1] when the model batches, and the parameters. The model must have
// that input and a BYTES output text_output: InvalidArgument naming what it
// lacks otherwise (the service checks the rest: server/request_admission.h).
// The request's id is `id`.
Result<InferRequest> OpenAiInferRequest(const OpenAiRequest& request, const ModelMetadata& metadata,
                                        std::string id);

// A new id for a completion: "cmpl-" or "chatcmpl-" and 24 random hex digits.
std::string NewCompletionId(OpenAiEndpoint endpoint);

// One completion's answer, built from its responses as they come: the text
// of text_output (each response's elements joined, in order), the latest
// prompt_tokens and completion_tokens the model gave (INT64 or INT32, first
// element: a running count or one given at the end), and its finish_reason
// (BYTES), else "length" when completion_tokens reached max_tokens and
// "stop" otherwise. The methods read the responses' outputs, which may be
// borrowed: call them inside `done` or on_response. Internal when an output
// of those names has the wrong datatype or malformed bytes.
class OpenAiCompletion {
 public:
  OpenAiCompletion(const OpenAiRequest& request, std::string id, int64_t created);

  // Not streamed: the whole answer to the (joined) response.
  Result<std::string> Answer(const InferResponse& response);

  // Streamed, as server-sent events: those for a response before the last
  // (chat: the role chunk before anything else; then a chunk of the
  // response's text, none for an empty one) ...
  Result<std::string> StreamEvents(const InferResponse& response);
  // ... those for the last one: its text, then the chunk with the
  // finish_reason (and usage, when the model gave a token count), then
  // `data: [DONE]` ...
  Result<std::string> StreamEnd(const InferResponse& response);
  // ... or, when the stream breaks, an event carrying the error (then the
  // stream ends, without [DONE]).
  static std::string StreamError(const OpenAiError& error);

 private:
  // Remembers the counts and finish_reason; the response's text.
  Result<std::string> Take(const InferResponse& response);
  std::string FinishReason() const;
  std::string Chunk(std::string_view text, bool role, const std::string* finish) const;

  OpenAiEndpoint endpoint_;
  std::string model_;
  std::string id_;
  int64_t created_;
  std::optional<int64_t> max_tokens_;
  std::optional<int64_t> prompt_tokens_;
  std::optional<int64_t> completion_tokens_;
  std::optional<std::string> finish_reason_;
  bool role_sent_ = false;
};

// {"object": "list", "data": [{"id", "object": "model", "created": 0,
// "owned_by": "hearth"}, ...]}
std::string OpenAiModelListJson(const std::vector<std::string>& names);

}  // namespace hearth
