#include "http/openai.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <iterator>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <random>
#include <utility>

#include "common/bytes_tensor.h"
#include "http/json_body.h"
#include "http/kserve_codec.h"
#include "http/kserve_codec_internal.h"
#include "http/sse.h"

namespace hearth {
namespace {

using Json = nlohmann::json;
// Keys in the order OpenAI's documentation shows them.
using Ordered = nlohmann::ordered_json;
using kserve::Quote;

// Model outputs may hold any bytes: text that is not UTF-8 is written with
// U+FFFD in its place (this is text for people, unlike KServe's BYTES).
std::string Dump(const Ordered& value) {
  return value.dump(-1, ' ', false, Ordered::error_handler_t::replace);
}

const TensorMetadata* Find(const std::vector<TensorMetadata>& tensors, std::string_view name) {
  for (const TensorMetadata& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

const InferTensor* FindOutput(const InferResponse& response, std::string_view name) {
  for (const InferTensor& output : response.outputs) {
    if (output.name == name) return &output;
  }
  return nullptr;
}

std::string EndpointPath(OpenAiEndpoint endpoint) {
  return endpoint == OpenAiEndpoint::kCompletions ? "/v1/completions" : "/v1/chat/completions";
}

// The body's field `name`: absent or null gives nullptr.
const Json* Field(const Json& doc, const char* name) {
  const auto it = doc.find(name);
  if (it == doc.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer that fits int64_t; nullopt for anything else.
std::optional<int64_t> IntegerOf(const Json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  return std::nullopt;
}

// Fields a request may set that change what the model generates, beyond
// those read below: passed on to the model's parameters under their own
// names when set to anything but their neutral value (what OpenAI's clients
// send when the user set nothing), so that the model uses or refuses them
// (backend llm refuses all but top_k by name). vLLM's sampling extras too.
struct PassedOn {
  const char* name;
  bool (*neutral)(const Json&);
};

bool IsFalse(const Json& v) { return v.is_boolean() && !v.get<bool>(); }
bool IsZero(const Json& v) { return v.is_number() && v.get<double>() == 0.0; }
bool IsOne(const Json& v) { return v.is_number() && v.get<double>() == 1.0; }
bool IsEmpty(const Json& v) {
  return (v.is_object() || v.is_array() || v.is_string()) && v.empty();
}
bool IsTextFormat(const Json& v) {
  return v.is_object() && v.size() == 1 && v.contains("type") && v["type"] == "text";
}
bool IsTrue(const Json& v) { return v.is_boolean() && v.get<bool>(); }
bool IsNone(const Json& v) { return v == "none"; }
bool IsTextOnly(const Json& v) { return v == Json::array({"text"}); }
bool IsMedium(const Json& v) { return v == "medium"; }
bool Never(const Json&) { return false; }

constexpr PassedOn kPassedOn[] = {
    {"top_k", Never},
    {"logprobs", IsFalse},
    {"top_logprobs", IsZero},
    {"best_of", IsOne},
    {"logit_bias", IsEmpty},
    {"presence_penalty", IsZero},
    {"frequency_penalty", IsZero},
    {"echo", IsFalse},
    {"suffix", IsEmpty},
    {"response_format", IsTextFormat},
    {"tools", IsEmpty},
    {"tool_choice", IsNone},
    {"functions", IsEmpty},
    {"function_call", IsNone},
    {"reasoning_effort", Never},
    {"modalities", IsTextOnly},
    {"prediction", Never},
    {"verbosity", IsMedium},
    {"web_search_options", Never},
    {"min_p", IsZero},
    {"repetition_penalty", IsOne},
    {"min_tokens", IsZero},
    {"ignore_eos", IsFalse},
    {"stop_token_ids", IsEmpty},
    {"include_stop_str_in_output", IsFalse},
    {"skip_special_tokens", IsTrue},
    {"spaces_between_special_tokens", IsTrue},
    {"add_generation_prompt", IsTrue},
    {"continue_final_message", IsFalse},
    {"chat_template_kwargs", IsEmpty},
    {"prompt_logprobs", IsZero},
    {"guided_json", Never},
    {"guided_regex", Never},
    {"guided_choice", Never},
    {"guided_grammar", Never},
};

// Fields that change nothing a model computes: read (stream_options) or
// taken and not used, as OpenAI's own service does not use them to answer.
// (Identifiers for its caching and abuse monitoring among them.)
constexpr const char* kNoEffect[] = {"user",
                                     "metadata",
                                     "store",
                                     "service_tier",
                                     "parallel_tool_calls",
                                     "stream_options",
                                     "prompt_cache_key",
                                     "safety_identifier"};

Result<OpenAiRequest> Parse(std::string_view body, OpenAiEndpoint endpoint, std::string* param) {
  ASSIGN_OR_RETURN(const Json doc, ParseJsonBody(body));
  if (!doc.is_object()) {
    return InvalidArgument(std::string("the request must be a JSON object, got ") +
                           doc.type_name());
  }
  OpenAiRequest request;
  request.endpoint = endpoint;
  auto bad = [&](const char* field, std::string message) {
    *param = field;
    return InvalidArgument(std::move(message));
  };

  const Json* model = Field(doc, "model");
  if (model == nullptr) return bad("model", "'model' is required");
  if (!model->is_string()) return bad("model", "'model' must be a string");
  request.model = model->get<std::string>();

  if (endpoint == OpenAiEndpoint::kCompletions) {
    const Json* prompt = Field(doc, "prompt");
    if (prompt == nullptr) return bad("prompt", "'prompt' is required");
    if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
      prompt = &(*prompt)[0];
    }
    if (!prompt->is_string()) {
      return bad("prompt", "'prompt' must be a string (or a list of one string)");
    }
    request.input = prompt->get<std::string>();
  } else {
    const Json* messages = Field(doc, "messages");
    if (messages == nullptr) return bad("messages", "'messages' is required");
    if (!messages->is_array() || messages->empty()) {
      return bad("messages", "'messages' must be a non-empty list of messages");
    }
    for (size_t i = 0; i < messages->size(); ++i) {
      const Json& message = (*messages)[i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!message.is_object()) return bad("messages", where + " must be an object");
      const auto role = message.find("role");
      if (role == message.end() || !role->is_string()) {
        return bad("messages", where + " needs a string 'role'");
      }
    }
    const std::optional<std::string_view> text = TopLevelValueText(body, "messages");
    if (!text.has_value()) return Internal("the messages' text was not found in the body");
    request.input = std::string(*text);
  }

  if (const Json* stream = Field(doc, "stream")) {
    if (!stream->is_boolean()) return bad("stream", "'stream' must be true or false");
    request.stream = stream->get<bool>();
  }
  if (const Json* n = Field(doc, "n")) {
    if (IntegerOf(*n) != std::optional<int64_t>(1)) {
      return bad("n", "only 'n': 1 is supported (one choice per request)");
    }
  }

  Ordered parameters = Ordered::object();
  // max_completion_tokens: the chat API's newer name for max_tokens.
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    if (endpoint == OpenAiEndpoint::kCompletions && name != std::string_view("max_tokens")) break;
    const Json* max_tokens = Field(doc, name);
    if (max_tokens == nullptr) continue;
    const std::optional<int64_t> value = IntegerOf(*max_tokens);
    if (!value.has_value() || *value < 1) {
      return bad(name, "'" + std::string(name) + "' must be a positive integer");
    }
    if (request.max_tokens.has_value() && request.max_tokens != value) {
      return bad(name, "'max_tokens' and 'max_completion_tokens' differ; give one");
    }
    request.max_tokens = value;
    parameters["max_tokens"] = *max_tokens;
  }
  if (const Json* temperature = Field(doc, "temperature")) {
    if (!temperature->is_number() || temperature->get<double>() < 0) {
      return bad("temperature", "'temperature' must be a number, at least 0");
    }
    parameters["temperature"] = *temperature;
  }
  if (const Json* top_p = Field(doc, "top_p")) {
    if (!top_p->is_number() || top_p->get<double>() < 0 || top_p->get<double>() > 1) {
      return bad("top_p", "'top_p' must be a number from 0 to 1");
    }
    parameters["top_p"] = *top_p;
  }
  if (const Json* stop = Field(doc, "stop")) {
    bool ok = stop->is_string() || stop->is_array();
    if (stop->is_array()) {
      for (const Json& element : *stop) ok = ok && element.is_string();
    }
    if (!ok) return bad("stop", "'stop' must be a string or a list of strings");
    parameters["stop"] = *stop;
  }
  if (const Json* seed = Field(doc, "seed")) {
    if (!seed->is_number_integer()) return bad("seed", "'seed' must be an integer");
    parameters["seed"] = *seed;
  }
  for (const PassedOn& field : kPassedOn) {
    const Json* value = Field(doc, field.name);
    if (value != nullptr && !field.neutral(*value)) parameters[field.name] = *value;
  }
  // A field of no name above is refused, as OpenAI's service does: a typo
  // or a control this server does not have must not pass unnoticed.
  const bool chat = endpoint == OpenAiEndpoint::kChatCompletions;
  // What the code above reads, for this endpoint.
  const char* const read[] = {chat ? "messages" : "prompt",
                              chat ? "max_completion_tokens" : "max_tokens",
                              "model",
                              "stream",
                              "n",
                              "max_tokens",
                              "temperature",
                              "top_p",
                              "stop",
                              "seed"};
  for (const auto& item : doc.items()) {
    const std::string& key = item.key();
    if (item.value().is_null()) continue;  // not given
    const auto named = [&key](const char* name) { return key == name; };
    if (std::any_of(std::begin(read), std::end(read), named) ||
        std::any_of(std::begin(kNoEffect), std::end(kNoEffect), named) ||
        std::any_of(std::begin(kPassedOn), std::end(kPassedOn),
                    [&key](const PassedOn& p) { return key == p.name; })) {
      continue;
    }
    *param = key.substr(0, 64);
    return InvalidArgument("unrecognized request argument supplied: " + Quote(*param));
  }
  if (!parameters.empty()) request.parameters_json = Dump(parameters);
  return request;
}

// The first element of an integer output; Internal for another datatype.
Result<std::optional<int64_t>> Count(const InferResponse& response, std::string_view name) {
  const InferTensor* output = FindOutput(response, name);
  if (output == nullptr) return std::optional<int64_t>();
  ASSIGN_OR_RETURN(const uint64_t count, kserve::CheckOutputTensor(*output));
  if (output->dtype != DType::kI64 && output->dtype != DType::kI32) {
    return Internal("output " + Quote(name) + " must be INT64, not " +
                    kserve::DatatypeString(output->dtype));
  }
  if (count == 0) return std::optional<int64_t>();
  if (output->dtype == DType::kI32) {
    int32_t value = 0;
    std::memcpy(&value, output->data.data(), sizeof(value));
    return std::optional<int64_t>(value);
  }
  int64_t value = 0;
  std::memcpy(&value, output->data.data(), sizeof(value));
  return std::optional<int64_t>(value);
}

// The elements of a BYTES output joined; nullopt when there is none.
Result<std::optional<std::string>> Text(const InferResponse& response, std::string_view name) {
  const InferTensor* output = FindOutput(response, name);
  if (output == nullptr) return std::optional<std::string>();
  ASSIGN_OR_RETURN(const uint64_t count, kserve::CheckOutputTensor(*output));
  (void)count;
  if (output->dtype != DType::kBytes) {
    return Internal("output " + Quote(name) + " must be BYTES, not " +
                    kserve::DatatypeString(output->dtype));
  }
  std::string text;
  for (std::string_view element : BytesElements(output->data.bytes())) text += element;
  return std::optional<std::string>(std::move(text));
}

// The field a model's refusal names: backend llm's messages begin
// "parameter NAME:" or "messages[i]". Empty when it names none (the rest of
// a message may quote the request, so only its start is read).
std::string ParamNamed(std::string_view message) {
  if (message.starts_with("messages[")) return "messages";
  if (!message.starts_with("parameter ")) return "";
  const size_t start = 10;
  size_t end = start;
  while (end < message.size() &&
         (std::isalnum(static_cast<unsigned char>(message[end])) != 0 || message[end] == '_'))
    ++end;
  if (end > start && end < message.size() && message[end] == ':')
    return std::string(message.substr(start, end - start));
  return "";
}

}  // namespace

std::string OpenAiErrorJson(const OpenAiError& error) {
  Ordered body = {{"message", error.message},
                  {"type", error.type},
                  {"param", error.param.empty() ? Ordered() : Ordered(error.param)},
                  {"code", error.code.empty() ? Ordered() : Ordered(error.code)}};
  return Dump(Ordered{{"error", std::move(body)}});
}

OpenAiError OpenAiErrorFor(const Status& status, std::string_view param) {
  OpenAiError error;
  error.message = status.message();
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kFailedPrecondition:
      error.status = 400;
      error.param = param.empty() ? ParamNamed(status.message()) : std::string(param);
      break;
    case StatusCode::kNotFound:
      error.status = 404;
      error.param = "model";
      error.code = "model_not_found";
      break;
    default:
      error.status = HttpStatusFor(status.code());
      if (error.status < 500) error.status = 500;
      error.type = "server_error";
      break;
  }
  return error;
}

Result<OpenAiRequest> ParseOpenAiRequest(std::string_view body, OpenAiEndpoint endpoint,
                                         std::string* param) {
  param->clear();
  try {
    return Parse(body, endpoint, param);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the request");
  } catch (const Json::exception& e) {
    // Every read above checks the type first; this is a broken invariant
    // reported as the request's fault rather than crashing the thread.
    return InvalidArgument(std::string("cannot read the request: ") + e.what());
  }
}

Result<InferRequest> OpenAiInferRequest(const OpenAiRequest& request, const ModelMetadata& metadata,
                                        std::string id) {
  const std::string_view input_name =
      request.endpoint == OpenAiEndpoint::kCompletions ? kPromptInput : kMessagesInput;
  const std::string model = Quote(metadata.name);
  const std::string path = EndpointPath(request.endpoint);
  const TensorMetadata* input = Find(metadata.inputs, input_name);
  if (input == nullptr) {
    return InvalidArgument("model " + model + " has no input " + Quote(input_name) + ", which " +
                           path + " needs");
  }
  if (input->dtype != DType::kBytes) {
    return InvalidArgument("model " + model + "'s input " + Quote(input_name) + " is " +
                           kserve::DatatypeString(input->dtype) + ", but " + path +
                           " gives it text (BYTES)");
  }
  const TensorMetadata* output = Find(metadata.outputs, kTextOutput);
  if (output == nullptr || output->dtype != DType::kBytes) {
    return InvalidArgument("model " + model + " has no BYTES output " + Quote(kTextOutput) +
                           ", which " + path + " needs");
  }
  try {
    InferRequest infer;
    infer.model = metadata.name;
    infer.id = std::move(id);
    InferTensor tensor;
    tensor.name = std::string(input_name);
    tensor.dtype = DType::kBytes;
    tensor.shape =
        metadata.max_batch_size > 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{1};
    std::vector<std::byte> bytes;
    RETURN_IF_ERROR(AppendBytesElement(bytes, request.input, kserve::InputLabel(input_name)));
    tensor.data = std::move(bytes);
    infer.inputs.push_back(std::move(tensor));
    infer.parameters_json = request.parameters_json;
    return infer;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory building the request");
  }
}

std::string NewCompletionId(OpenAiEndpoint endpoint) {
  thread_local std::mt19937_64 random{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id = endpoint == OpenAiEndpoint::kCompletions ? "cmpl-" : "chatcmpl-";
  for (int i = 0; i < 24; ++i) id += kHex[random() & 0xf];
  return id;
}

OpenAiCompletion::OpenAiCompletion(const OpenAiRequest& request, std::string id, int64_t created)
    : endpoint_(request.endpoint),
      model_(request.model),
      id_(std::move(id)),
      created_(created),
      max_tokens_(request.max_tokens) {}

Result<std::string> OpenAiCompletion::Take(const InferResponse& response) {
  ASSIGN_OR_RETURN(std::optional<int64_t> prompt, Count(response, kPromptTokensOutput));
  ASSIGN_OR_RETURN(std::optional<int64_t> completion, Count(response, kCompletionTokensOutput));
  ASSIGN_OR_RETURN(std::optional<std::string> finish, Text(response, kFinishReasonOutput));
  ASSIGN_OR_RETURN(std::optional<std::string> text, Text(response, kTextOutput));
  if (prompt.has_value()) prompt_tokens_ = prompt;
  if (completion.has_value()) completion_tokens_ = completion;
  if (finish.has_value() && !finish->empty()) finish_reason_ = std::move(finish);
  return text.has_value() ? std::move(*text) : std::string();
}

std::string OpenAiCompletion::FinishReason() const {
  if (finish_reason_.has_value()) return *finish_reason_;
  if (max_tokens_.has_value() && completion_tokens_.has_value() &&
      *completion_tokens_ >= *max_tokens_) {
    return "length";
  }
  return "stop";
}

namespace {

Ordered Usage(std::optional<int64_t> prompt, std::optional<int64_t> completion) {
  const int64_t p = prompt.value_or(0);
  const int64_t c = completion.value_or(0);
  return Ordered{{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
}

}  // namespace

Result<std::string> OpenAiCompletion::Answer(const InferResponse& response) {
  try {
    ASSIGN_OR_RETURN(std::string text, Take(response));
    const bool chat = endpoint_ == OpenAiEndpoint::kChatCompletions;
    Ordered choice = {{"index", 0}};
    if (chat) {
      choice["message"] = Ordered{{"role", "assistant"}, {"content", std::move(text)}};
    } else {
      choice["text"] = std::move(text);
    }
    choice["finish_reason"] = FinishReason();
    if (!chat) choice["logprobs"] = nullptr;
    const Ordered body = {{"id", id_},
                          {"object", chat ? "chat.completion" : "text_completion"},
                          {"created", created_},
                          {"model", model_},
                          {"choices", Ordered::array({std::move(choice)})},
                          {"usage", Usage(prompt_tokens_, completion_tokens_)}};
    return Dump(body);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
}

std::string OpenAiCompletion::Chunk(std::string_view text, bool role,
                                    const std::string* finish) const {
  const bool chat = endpoint_ == OpenAiEndpoint::kChatCompletions;
  Ordered choice = {{"index", 0}};
  if (chat) {
    Ordered delta = Ordered::object();
    if (role) delta["role"] = "assistant";
    if (!text.empty()) delta["content"] = std::string(text);
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = std::string(text);
  }
  choice["finish_reason"] = finish != nullptr ? Ordered(*finish) : Ordered();
  Ordered chunk = {{"id", id_},
                   {"object", chat ? "chat.completion.chunk" : "text_completion"},
                   {"created", created_},
                   {"model", model_},
                   {"choices", Ordered::array({std::move(choice)})}};
  if (finish != nullptr && (prompt_tokens_.has_value() || completion_tokens_.has_value())) {
    chunk["usage"] = Usage(prompt_tokens_, completion_tokens_);
  }
  return SseEvent(Dump(chunk));
}

Result<std::string> OpenAiCompletion::StreamEvents(const InferResponse& response) {
  try {
    ASSIGN_OR_RETURN(const std::string text, Take(response));
    std::string events;
    if (endpoint_ == OpenAiEndpoint::kChatCompletions && !role_sent_) {
      role_sent_ = true;
      events += Chunk("", true, nullptr);
    }
    if (!text.empty()) events += Chunk(text, false, nullptr);
    return events;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
}

Result<std::string> OpenAiCompletion::StreamEnd(const InferResponse& response) {
  try {
    ASSIGN_OR_RETURN(std::string events, StreamEvents(response));
    const std::string finish = FinishReason();
    events += Chunk("", false, &finish);
    AppendSseEvent(events, "[DONE]");
    return events;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
}

std::string OpenAiCompletion::StreamError(const OpenAiError& error) {
  return SseEvent(OpenAiErrorJson(error));
}

std::string OpenAiModelListJson(const std::vector<std::string>& names) {
  Ordered data = Ordered::array();
  for (const std::string& name : names) {
    data.push_back({{"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "hearth"}});
  }
  return Dump(Ordered{{"object", "list"}, {"data", std::move(data)}});
}

}  // namespace hearth
