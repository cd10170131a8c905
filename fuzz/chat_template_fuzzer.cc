// backend llm's chat template engine against any template source (a model
// directory's tokenizer_config.json or chat_template.jinja): Parse never
// crashes and refuses only with InvalidArgument; a template it accepts
// renders a chat (system, user, assistant with a tool call, tool, tools
// given) within tight limits or fails with InvalidArgument (an error the
// template raises) or ResourceExhausted (a limit), never a crash or a hang,
// and renders the same bytes twice.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <string_view>

#include "backends/llm/chat_template.h"
#include "nlohmann/json.hpp"

namespace {

using hearth::StatusCode;
using hearth::llm::ChatTemplate;
using hearth::llm::ChatTemplateOptions;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "chat_template_fuzzer: %s\n", what);
    std::abort();
  }
}

const nlohmann::ordered_json& Context() {
  static const nlohmann::ordered_json* context =
      new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
  "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich? 天気 🌦"},
    {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
      "function": {"name": "weather", "arguments": {"city": "Zürich", "days": 2}}}]},
    {"role": "tool", "content": "{\"t\": 3.5}", "name": "weather"},
    {"role": "assistant", "content": "3.5 °C."},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]}
  ],
  "tools": [{"type": "function", "function": {"name": "weather",
    "description": "Forecast", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}],
  "documents": null,
  "add_generation_prompt": true,
  "bos_token": "<s>",
  "eos_token": "</s>",
  "date_string": "26 Jul 2024"
})"));
  return *context;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  auto parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) {
    Require(parsed.status().code() == StatusCode::kInvalidArgument,
            "Parse failed with another code than InvalidArgument");
    Require(!parsed.status().message().empty(), "Parse failed without a message");
    return 0;
  }
  Require(parsed->source() == source, "the parsed template keeps another source");
  ChatTemplateOptions options;
  // Small enough that a template looping or growing strings ends quickly.
  options.limits.max_output_bytes = 1u << 20;
  options.limits.max_loop_iterations = 100'000;
  options.limits.max_depth = 64;
  options.now = [] {
    std::tm t{};
    t.tm_year = 124;
    t.tm_mon = 6;
    t.tm_mday = 26;
    return t;
  };
  const auto first = parsed->Render(Context(), options);
  if (first.ok()) {
    Require(first->size() <= options.limits.max_output_bytes, "a render past max_output_bytes");
  } else {
    const StatusCode code = first.status().code();
    Require(code == StatusCode::kInvalidArgument || code == StatusCode::kResourceExhausted,
            "Render failed with another code than InvalidArgument or ResourceExhausted");
  }
  const auto second = parsed->Render(Context(), options);
  Require(first.ok() == second.ok(), "two renders of one template disagree on failing");
  if (first.ok()) Require(*first == *second, "two renders of one template differ");
  return 0;
}
