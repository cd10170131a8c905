// The generate and OpenAI codecs and the strict JSON body parser, without
// sockets: the edges that the HTTP tests do not reach.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "common/bytes_tensor.h"
#include "http/generate.h"
#include "http/json_body.h"
#include "http/openai.h"
#include "server/request_admission.h"

namespace hearth {
namespace {

using json = nlohmann::json;

TEST(JsonBody, TopLevelValueTextIsTheValueAsWritten) {
  const std::string body =
      R"( { "a" : [1, {"messages": 2}], "m\u0065ssages" :  [ {"x":"}\"]"} ] , "z":null } )";
  ASSERT_TRUE(ParseJsonBody(body).ok());
  EXPECT_EQ(TopLevelValueText(body, "messages"), R"([ {"x":"}\"]"} ])");
  EXPECT_EQ(TopLevelValueText(body, "a"), R"([1, {"messages": 2}])");
  EXPECT_EQ(TopLevelValueText(body, "z"), "null");
  EXPECT_EQ(TopLevelValueText(body, "nope"), std::nullopt);
  EXPECT_EQ(TopLevelValueText(R"({"n":-1.5e3})", "n"), "-1.5e3");
  EXPECT_EQ(TopLevelValueText("[1]", "n"), std::nullopt);
}

TEST(JsonBody, RefusesWhatReadersWouldReadDifferently) {
  EXPECT_EQ(ParseJsonBody(std::string("{\"a\":1}\0{}", 10)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_NE(ParseJsonBody(R"({"a":{"b":1,"b":2}})").status().message().find("\"b\" twice"),
            std::string::npos);
  EXPECT_TRUE(ParseJsonBody(std::string(64, '[') + std::string(64, ']')).ok());
  EXPECT_FALSE(ParseJsonBody(std::string(65, '[') + std::string(65, ']')).ok());
  EXPECT_FALSE(ParseJsonBody("{} x").ok());
  EXPECT_FALSE(ParseJsonBody("").ok());
}

TEST(OpenAiCodec, NullFieldsCountAsNotGivenAndParametersKeepTheirValues) {
  std::string param;
  Result<OpenAiRequest> request = ParseOpenAiRequest(
      R"({"model":"m","prompt":"p","max_tokens":null,"n":null,"stream":null,"stop":"x",)"
      R"("temperature":0,"seed":-3,"user":"u-1","stream_options":{"include_usage":true}})",
      OpenAiEndpoint::kCompletions, &param);
  ASSERT_TRUE(request.ok()) << request.status().ToString();
  EXPECT_FALSE(request->stream);
  EXPECT_FALSE(request->max_tokens.has_value());
  EXPECT_EQ(json::parse(request->parameters_json),
            json::parse(R"({"stop":"x","temperature":0,"seed":-3})"));
  Result<OpenAiRequest> huge =
      ParseOpenAiRequest(R"({"model":"m","prompt":"p","max_tokens":18446744073709551615})",
                         OpenAiEndpoint::kCompletions, &param);
  EXPECT_FALSE(huge.ok());
  EXPECT_EQ(param, "max_tokens");
}

TEST(OpenAiCodec, ControlsTheModelMayNotHaveArePassedOnUnlessNeutralAndUnknownFieldsRefused) {
  std::string param;
  // Neutral values (what clients send when the user set nothing) are dropped.
  Result<OpenAiRequest> neutral = ParseOpenAiRequest(
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"logprobs":false,)"
      R"("presence_penalty":0,"frequency_penalty":0.0,"logit_bias":{},"best_of":1,"echo":false,)"
      R"("response_format":{"type":"text"},"tools":[],"tool_choice":"none","n":1,)"
      R"("ignore_eos":false,"skip_special_tokens":true,"modalities":["text"],"some_new_field":null,)"
      R"("prompt_cache_key":"k"})",
      OpenAiEndpoint::kChatCompletions, &param);
  ASSERT_TRUE(neutral.ok()) << neutral.status().ToString();
  EXPECT_EQ(neutral->parameters_json, "");
  // Others reach the model as sent, for it to use or refuse by name.
  Result<OpenAiRequest> set = ParseOpenAiRequest(
      R"({"model":"m","prompt":"p","top_k":5,"logprobs":2,"presence_penalty":0.5,)"
      R"("logit_bias":{"50256":-100},"echo":true,"min_p":0.1,"seed":18446744073709551615})",
      OpenAiEndpoint::kCompletions, &param);
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(json::parse(set->parameters_json),
            json::parse(R"({"seed":18446744073709551615,"top_k":5,"logprobs":2,)"
                        R"("presence_penalty":0.5,"logit_bias":{"50256":-100},"echo":true,)"
                        R"("min_p":0.1})"));
  // max_completion_tokens is chat's name for max_tokens.
  Result<OpenAiRequest> chat = ParseOpenAiRequest(
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":3})",
      OpenAiEndpoint::kChatCompletions, &param);
  ASSERT_TRUE(chat.ok()) << chat.status().ToString();
  EXPECT_EQ(chat->max_tokens, std::optional<int64_t>(3));
  EXPECT_EQ(json::parse(chat->parameters_json), json::parse(R"({"max_tokens":3})"));
  const std::vector<std::tuple<std::string, OpenAiEndpoint, std::string, std::string>> bad = {
      {R"({"model":"m","prompt":"p","temprature":1})", OpenAiEndpoint::kCompletions, "temprature",
       "unrecognized request argument supplied: \"temprature\""},
      {R"({"model":"m","prompt":"p","messages":[]})", OpenAiEndpoint::kCompletions, "messages",
       "unrecognized"},
      {R"({"model":"m","messages":[{"role":"user"}],"prompt":"p"})",
       OpenAiEndpoint::kChatCompletions, "prompt", "unrecognized"},
      {R"({"model":"m","messages":[{"role":"user"}],"max_tokens":2,"max_completion_tokens":3})",
       OpenAiEndpoint::kChatCompletions, "max_completion_tokens", "differ"},
      {R"({"model":"m","messages":[{"role":"user"}],"max_completion_tokens":0})",
       OpenAiEndpoint::kChatCompletions, "max_completion_tokens", "positive integer"},
      {R"({"model":"m","prompt":"p","seed":1.5})", OpenAiEndpoint::kCompletions, "seed", "integer"},
      // Chat's name for max_tokens is not the completions endpoint's.
      {R"({"model":"m","prompt":"p","max_completion_tokens":3})", OpenAiEndpoint::kCompletions,
       "max_completion_tokens", "unrecognized"},
  };
  for (const auto& [body, endpoint, field, message] : bad) {
    Result<OpenAiRequest> refused = ParseOpenAiRequest(body, endpoint, &param);
    ASSERT_FALSE(refused.ok()) << body;
    EXPECT_EQ(param, field) << body;
    EXPECT_NE(refused.status().message().find(message), std::string::npos)
        << body << ": " << refused.status().message();
  }
}

TEST(OpenAiCodec, AModelsRefusalNamesTheParameterItNames) {
  EXPECT_EQ(OpenAiErrorFor(InvalidArgument("parameter max_tokens: must be an integer"), "").param,
            "max_tokens");
  EXPECT_EQ(OpenAiErrorFor(InvalidArgument("messages[2].content holds \"<|eot_id|>\""), "").param,
            "messages");
  EXPECT_EQ(OpenAiErrorFor(InvalidArgument("the prompt has no token"), "").param, "");
  EXPECT_EQ(OpenAiErrorFor(InvalidArgument("parameter top_p: x"), "model").param, "model");
  // Only the message's start is read: the rest may quote the request.
  EXPECT_EQ(OpenAiErrorFor(InvalidArgument("messages[0].content[0] is a part of type "
                                           "'parameter top_k: x'"),
                           "")
                .param,
            "messages");
  EXPECT_EQ(OpenAiErrorFor(InvalidArgument("the prompt quotes parameter top_k: x"), "").param, "");
  EXPECT_EQ(OpenAiErrorFor(Internal("parameter top_p: x"), "").status, 500);
}

TEST(OpenAiCodec, AModelWithTheWrongKindOfTextInputOrOutputIsNamed) {
  OpenAiRequest request;
  request.model = "m";
  request.input = "p";
  ModelMetadata metadata;
  metadata.name = "m";
  metadata.inputs = {{"text_input", DType::kI32, {1}}};
  metadata.outputs = {{"text_output", DType::kBytes, {1}}};
  Result<InferRequest> wrong_input = OpenAiInferRequest(request, metadata, "id");
  EXPECT_NE(wrong_input.status().message().find(R"(input "text_input" is INT32)"),
            std::string::npos)
      << wrong_input.status().ToString();
  metadata.inputs = {{"text_input", DType::kBytes, {1}}};
  metadata.outputs = {{"tokens", DType::kI64, {-1}}};
  Result<InferRequest> no_output = OpenAiInferRequest(request, metadata, "id");
  EXPECT_NE(no_output.status().message().find(R"(no BYTES output "text_output")"),
            std::string::npos)
      << no_output.status().ToString();
  // Another input the endpoint cannot give.
  metadata.inputs = {{"text_input", DType::kBytes, {1}}, {"image", DType::kF32, {3}}};
  metadata.outputs = {{"text_output", DType::kBytes, {1}}};
  Result<InferRequest> missing = OpenAiInferRequest(request, metadata, "id");
  ASSERT_TRUE(missing.ok()) << missing.status().ToString();
  const Status refused = AdmitInferRequest(*missing, metadata);  // as the service does
  EXPECT_NE(refused.message().find(R"(missing input "image")"), std::string::npos)
      << refused.ToString();
}

TEST(OpenAiCodec, TextThatIsNotUtf8IsReplacedAndBadCountsAreInternal) {
  OpenAiRequest request;
  request.model = "m";
  OpenAiCompletion completion(request, "cmpl-1", 5);
  InferResponse response;
  std::vector<std::byte> bytes;
  ASSERT_TRUE(AppendBytesElement(bytes,
                                 "a\xff"
                                 "b",
                                 "t")
                  .ok());
  response.outputs.push_back({"text_output", DType::kBytes, {1}, bytes});
  Result<std::string> answer = completion.Answer(response);
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  EXPECT_EQ(json::parse(*answer)["choices"][0]["text"],
            "a\xef\xbf\xbd"
            "b");
  response.outputs.push_back({"completion_tokens", DType::kF32, {1}, std::vector<std::byte>(4)});
  EXPECT_EQ(completion.Answer(response).status().code(), StatusCode::kInternal);
}

TEST(GenerateCodec, OutputsThatClashWithTheResponsesOwnKeysAreLeftOut) {
  InferResponse response;
  response.model = "m";
  response.version = "1";
  std::vector<std::byte> bytes;
  ASSERT_TRUE(AppendBytesElement(bytes, "x", "t").ok());
  response.outputs.push_back({"id", DType::kBytes, {1}, bytes});
  response.outputs.push_back({"two", DType::kBytes, {2}, std::vector<std::byte>()});
  // "two" claims 2 elements but has none: the service's fault.
  EXPECT_EQ(GenerateResponseJson(response, "r").status().code(), StatusCode::kInternal);
  response.outputs.pop_back();
  Result<std::string> json_text = GenerateResponseJson(response, "r");
  ASSERT_TRUE(json_text.ok());
  EXPECT_EQ(json::parse(*json_text),
            json::parse(R"({"model_name":"m","model_version":"1","id":"r"})"));
}

}  // namespace
}  // namespace hearth
