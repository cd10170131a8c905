#include "backends/llm/llm_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "backends/llm/chat_template.h"
#include "backends/llm/llm_scheduler.h"
#include "backends/llm/stop_strings.h"
#include "backends/llm/tokenizer.h"
#include "common/model_parameters.h"
#include "nlohmann/json.hpp"

namespace hearth::llm {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxStops = 16;
constexpr size_t kMaxStopBytes = 256;
// Levels of objects and lists within one chat message (tool calls and
// their arguments are a few).
constexpr int kMaxMessageDepth = 32;

constexpr std::string_view kTextInput = "text_input";
constexpr std::string_view kMessagesInput = "messages";

enum class Out { kText, kTokenIds, kPromptTokens, kCompletionTokens, kFinishReason };

struct KnownOutput {
  std::string_view name;
  Out kind;
  DType dtype;
  std::vector<int64_t> dims;
};

const std::vector<KnownOutput>& KnownOutputs() {
  static const std::vector<KnownOutput> known = {
      {"text_output", Out::kText, DType::kBytes, {1}},
      {"token_ids", Out::kTokenIds, DType::kI64, {-1}},
      {"prompt_tokens", Out::kPromptTokens, DType::kI64, {1}},
      {"completion_tokens", Out::kCompletionTokens, DType::kI64, {1}},
      {"finish_reason", Out::kFinishReason, DType::kBytes, {1}},
  };
  return known;
}

// ---- the config's parameters ------------------------------------------------

Result<std::optional<int64_t>> IntParameter(const EngineOptions& options, const char* name,
                                            int64_t low, int64_t high) {
  auto it = options.parameters.find(name);
  if (it == options.parameters.end()) return std::optional<int64_t>();
  const std::string& text = it->second;
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v < low || v > high)
    return InvalidArgument("parameters." + std::string(name) + ": '" + text.substr(0, 64) +
                           "' is not an integer from " + std::to_string(low) + " to " +
                           std::to_string(high));
  return std::optional<int64_t>(v);
}

Result<std::optional<double>> FractionParameter(const EngineOptions& options, const char* name) {
  auto it = options.parameters.find(name);
  if (it == options.parameters.end()) return std::optional<double>();
  const std::string& text = it->second;
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !(v > 0.0 && v < 1.0))
    return InvalidArgument("parameters." + std::string(name) + ": '" + text.substr(0, 64) +
                           "' is not a number between 0 and 1");
  return std::optional<double>(v);
}

// One of `choices` (the first is said first in the error).
Result<std::optional<std::string>> ChoiceParameter(const EngineOptions& options, const char* name,
                                                   std::initializer_list<const char*> choices) {
  auto it = options.parameters.find(name);
  if (it == options.parameters.end()) return std::optional<std::string>();
  std::string listed;
  for (const char* c : choices) {
    if (it->second == c) return std::optional<std::string>(it->second);
    listed += (listed.empty() ? "" : ", ") + std::string(c);
  }
  return InvalidArgument("parameters." + std::string(name) + ": '" + it->second.substr(0, 64) +
                         "' is none of " + listed);
}

// ---- chat messages ------------------------------------------------------------

std::string AsciiCase(std::string s, bool upper) {
  for (char& c : s) {
    if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  }
  return s;
}

std::string ReplaceAll(const std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  std::string out;
  size_t at = 0;
  for (size_t found; (found = s.find(from, at)) != std::string::npos; at = found + from.size())
    out.append(s, at, found - at).append(to);
  return out.append(s, at, std::string::npos);
}

// A Jinja string literal at text[*i] ('...' or "...", with \\, \', \", \n, \r
// and \t escapes); *i moves past it. nullopt when there is none.
std::optional<std::string> StringLiteral(std::string_view text, size_t* i) {
  if (*i >= text.size() || (text[*i] != '\'' && text[*i] != '"')) return std::nullopt;
  const char quote = text[(*i)++];
  std::string out;
  while (*i < text.size() && text[*i] != quote) {
    char c = text[(*i)++];
    if (c == '\\' && *i < text.size()) {
      const char e = text[(*i)++];
      c = e == 'n' ? '\n' : e == 'r' ? '\r' : e == 't' ? '\t' : e;
    }
    out += c;
  }
  if (*i >= text.size()) return std::nullopt;
  ++*i;
  return out;
}

// The (from, to) of every replace('from', 'to') in a template's source
// whose arguments are both string literals (the filter and the method).
std::vector<std::pair<std::string, std::string>> LiteralReplaces(std::string_view source) {
  std::vector<std::pair<std::string, std::string>> out;
  const auto skip_space = [&](size_t* i) {
    while (*i < source.size() && (source[*i] == ' ' || source[*i] == '\n' || source[*i] == '\t'))
      ++*i;
  };
  for (size_t at = source.find("replace("); at != std::string_view::npos;
       at = source.find("replace(", at + 1)) {
    size_t i = at + 8;
    skip_space(&i);
    std::optional<std::string> from = StringLiteral(source, &i);
    skip_space(&i);
    if (!from.has_value() || i >= source.size() || source[i] != ',') continue;
    ++i;
    skip_space(&i);
    std::optional<std::string> to = StringLiteral(source, &i);
    if (to.has_value() && out.size() < 64) out.emplace_back(std::move(*from), std::move(*to));
  }
  return out;
}

// ---- a request's parameters -------------------------------------------------

struct RequestParameters {
  int64_t max_tokens = 16;
  bool max_tokens_given = false;  // else the default, cut to the room the prompt leaves
  SamplingParams sampling;
  bool seeded = false;
  std::vector<std::string> stops;
};

// A temperature below this draws as 0 (greedy), as vLLM's does: dividing a
// logit by it could overflow float32 (1e-45 would make every logit inf).
constexpr float kGreedyBelow = 1e-5f;

// The sampling controls as the executors take them: a temperature below
// kGreedyBelow is 0; a top_p that float32 rounds to 0 (0 included: the most
// likely token alone) is the smallest normal float, which keeps that token
// alone just the same.
SamplingParams Normalized(SamplingParams p) {
  if (p.temperature < kGreedyBelow) p.temperature = 0.0f;
  p.top_p = std::max(p.top_p, std::numeric_limits<float>::min());
  return p;
}

Status BadParameter(const std::string& name, const std::string& why) {
  return InvalidArgument("parameter " + name + ": " + why);
}

Result<RequestParameters> ParseRequestParameters(std::string_view text,
                                                 const RequestParameters& defaults,
                                                 int64_t max_positions, int64_t vocab) {
  RequestParameters p = defaults;
  if (text.empty()) return p;
  const Json doc = Json::parse(text, nullptr, false);
  if (!doc.is_object()) return InvalidArgument("the request's parameters are not a JSON object");
  // Controls this engine does not implement (the OpenAI endpoints pass
  // them on when a request sets them): refused, never ignored.
  for (const char* unsupported : {"repetition_penalty",
                                  "frequency_penalty",
                                  "presence_penalty",
                                  "min_p",
                                  "logprobs",
                                  "top_logprobs",
                                  "best_of",
                                  "logit_bias",
                                  "min_tokens",
                                  "echo",
                                  "suffix",
                                  "response_format",
                                  "tools",
                                  "tool_choice",
                                  "functions",
                                  "function_call",
                                  "reasoning_effort",
                                  "modalities",
                                  "prediction",
                                  "verbosity",
                                  "web_search_options",
                                  "ignore_eos",
                                  "stop_token_ids",
                                  "include_stop_str_in_output",
                                  "skip_special_tokens",
                                  "spaces_between_special_tokens",
                                  "add_generation_prompt",
                                  "continue_final_message",
                                  "chat_template_kwargs",
                                  "prompt_logprobs",
                                  "guided_json",
                                  "guided_regex",
                                  "guided_choice",
                                  "guided_grammar"}) {
    auto it = doc.find(unsupported);
    if (it != doc.end() && !it->is_null())
      return BadParameter(unsupported, "is not supported by backend llm");
  }
  if (auto it = doc.find("n");
      it != doc.end() && !it->is_null() && !(it->is_number_integer() && it->get<int64_t>() == 1))
    return BadParameter("n", "only 1 is supported");
  const auto number = [&](const char* name) -> const Json* {
    auto it = doc.find(name);
    return it == doc.end() || it->is_null() ? nullptr : &*it;
  };
  if (const Json* v = number("max_tokens")) {
    if (!v->is_number_integer() || v->get<int64_t>() < 1 || v->get<int64_t>() > max_positions)
      return BadParameter("max_tokens", "must be an integer from 1 to " +
                                            std::to_string(max_positions) + ", not " +
                                            v->dump().substr(0, 64));
    p.max_tokens = v->get<int64_t>();
    p.max_tokens_given = true;
  }
  if (const Json* v = number("temperature")) {
    if (!v->is_number() || v->is_boolean() ||
        !(v->get<double>() >= 0.0 && v->get<double>() <= 100.0))
      return BadParameter("temperature",
                          "must be a number from 0 to 100, not " + v->dump().substr(0, 64));
    p.sampling.temperature = static_cast<float>(v->get<double>());
  }
  if (const Json* v = number("top_p")) {
    if (!v->is_number() || v->is_boolean() || !(v->get<double>() >= 0.0 && v->get<double>() <= 1.0))
      return BadParameter("top_p", "must be a number from 0 to 1, not " + v->dump().substr(0, 64));
    p.sampling.top_p = static_cast<float>(v->get<double>());
  }
  if (const Json* v = number("top_k")) {
    if (!v->is_number_integer() || v->get<int64_t>() < -1 || v->get<int64_t>() > vocab)
      return BadParameter("top_k", "must be an integer from -1 (all) to " + std::to_string(vocab) +
                                       ", not " + v->dump().substr(0, 64));
    p.sampling.top_k = static_cast<int32_t>(std::max<int64_t>(0, v->get<int64_t>()));
  }
  if (const Json* v = number("seed")) {
    if (!v->is_number_integer())
      return BadParameter("seed", "must be an integer, not " + v->dump().substr(0, 64));
    p.sampling.seed =
        v->is_number_unsigned() ? v->get<uint64_t>() : static_cast<uint64_t>(v->get<int64_t>());
    p.seeded = true;
  }
  if (const Json* v = number("stop")) {
    std::vector<std::string> stops;
    if (v->is_string()) {
      stops.push_back(v->get<std::string>());
    } else if (v->is_array() && v->size() <= kMaxStops) {
      for (const Json& s : *v) {
        if (!s.is_string()) return BadParameter("stop", "a list of strings only");
        stops.push_back(s.get<std::string>());
      }
    } else {
      return BadParameter("stop", "must be a string or a list of at most " +
                                      std::to_string(kMaxStops) + " strings");
    }
    for (const std::string& s : stops)
      if (s.empty() || s.size() > kMaxStopBytes)
        return BadParameter("stop",
                            "each must be 1 to " + std::to_string(kMaxStopBytes) + " bytes");
    p.stops = std::move(stops);
  }
  p.sampling = Normalized(p.sampling);
  return p;
}

// ---- the engine ---------------------------------------------------------------

// A stream's text side: detokenizer, stop strings, what the next response carries.
struct Stream {
  std::unique_ptr<Detokenizer> detokenizer;
  StopStrings stops;
  std::vector<int64_t> since;  // tokens drawn since the last response
  std::string text;            // text for the next response
  std::string finish;          // "stop" or "length" once over
  int64_t prompt_tokens = 0;
  int64_t generated = 0;  // resumed ones included
  int64_t max_tokens = 1;
};

struct Setup {
  ModelConfig config;
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;
  ChatTemplateConfig prompting;  // tokenizer_config.json's template and special tokens
  std::set<int32_t> eos_ids;
  std::vector<IoSpec> inputs, outputs;
  std::vector<Out> output_kinds;
  int text_input = -1, messages_input = -1;
  // Whether the text of a special token in a message is read as that
  // token (parameters.special_text_in_messages: parse) or refused.
  bool parse_special_in_messages = false;
  // The replace('a', 'b') calls of the chat templates, with literal
  // arguments: a message's text is checked with them applied too.
  std::vector<std::pair<std::string, std::string>> template_replaces;
  RequestParameters defaults;
  bool batching = false;
};

class LlmEngine final : public Engine {
 public:
  LlmEngine(Setup setup, std::unique_ptr<Executor> executor, std::unique_ptr<Scheduler> scheduler,
            uint32_t capacity)
      : s_(std::move(setup)),
        executor_(std::move(executor)),
        scheduler_(std::move(scheduler)),
        capacity_(capacity) {}

  const std::vector<IoSpec>& inputs() const override { return s_.inputs; }
  const std::vector<IoSpec>& outputs() const override { return s_.outputs; }
  uint32_t capacity() const override { return capacity_; }
  uint64_t device_memory_bytes() const override { return executor_->device_memory_bytes(); }
  bool busy() const override { return scheduler_->busy() || !ending_.empty() || launched_ >= 0; }
  EngineCounters counters() const override {
    return {static_cast<uint64_t>(scheduler_->blocks_used()),
            static_cast<uint64_t>(scheduler_->limits().num_blocks), scheduler_->preemptions()};
  }

  void Cancel(uint64_t id) override {
    scheduler_->Remove(id);
    streams_.erase(id);
    ending_.erase(std::remove(ending_.begin(), ending_.end(), id), ending_.end());
  }

  Status Add(uint64_t id, const EngineRequest& r) override {
    if (streams_.count(id) != 0)
      return InvalidArgument("request " + std::to_string(id) + " is held");
    if (streams_.size() >= capacity_)
      return ResourceExhausted("the engine holds " + std::to_string(capacity_) +
                               " streams already");
    ASSIGN_OR_RETURN(RequestParameters p, ParseRequestParameters(r.parameters_json, s_.defaults,
                                                                 scheduler_->limits().max_positions,
                                                                 s_.config.vocab_size));
    if (p.sampling.temperature > 0 && !p.seeded) p.sampling.seed = random_();
    ASSIGN_OR_RETURN(std::vector<int32_t> prompt, Prompt(r));
    if (prompt.empty()) return InvalidArgument("the prompt has no token");
    if (!p.max_tokens_given) {
      const int64_t positions = scheduler_->limits().max_positions;
      const int64_t room = positions - static_cast<int64_t>(prompt.size());
      if (room < 1)
        return InvalidArgument("the prompt's " + std::to_string(prompt.size()) +
                               " tokens fill the model's " + std::to_string(positions) +
                               " positions: none is left to generate");
      p.max_tokens = std::min(p.max_tokens, room);
    }
    for (int32_t t : prompt)
      if (t < 0 || t >= s_.config.vocab_size)
        return InvalidArgument("the prompt holds token " + std::to_string(t) +
                               ", outside the model's vocabulary of " +
                               std::to_string(s_.config.vocab_size));

    auto seq = std::make_unique<Sequence>();
    seq->id = id;
    seq->tokens = prompt;
    seq->prompt_length = prompt.size();
    seq->sampling = p.sampling;
    seq->max_tokens = p.max_tokens;
    Stream stream;
    stream.detokenizer = std::make_unique<Detokenizer>(*s_.tokenizer, /*skip_special_tokens=*/true);
    stream.stops = StopStrings(p.stops);
    stream.prompt_tokens = static_cast<int64_t>(prompt.size());
    stream.max_tokens = p.max_tokens;

    // A resumed stream: its client has these tokens' text already. They go
    // through the detokenizer and the stop strings (which hold back what
    // was not sent) without being sent again.
    for (int64_t t : r.resume) {
      if (t < 0 || t >= s_.config.vocab_size)
        return InvalidArgument("resume token " + std::to_string(t) +
                               " is outside the model's vocabulary of " +
                               std::to_string(s_.config.vocab_size));
      if (!stream.finish.empty())
        return InvalidArgument("the resumed tokens go on after the stream had ended");
      seq->tokens.push_back(static_cast<int32_t>(t));
      RETURN_IF_ERROR(Accept(stream, static_cast<int32_t>(t)));
    }
    stream.text.clear();
    stream.since.clear();
    if (!stream.finish.empty()) {
      // Nothing left to draw: the last response carries what was held back.
      Finish(stream);
      streams_.emplace(id, std::move(stream));
      ending_.push_back(id);
      return Status::Ok();
    }
    RETURN_IF_ERROR(scheduler_->Add(std::move(seq)));
    streams_.emplace(id, std::move(stream));
    return Status::Ok();
  }

  Status Step(ResponseSink& sink) override {
    for (uint64_t id : std::exchange(ending_, {})) {
      auto it = streams_.find(id);
      if (it == streams_.end()) continue;
      RETURN_IF_ERROR(Send(sink, id, it->second, true));
      streams_.erase(id);
    }
    // One step launched and not collected at most between calls: it is
    // collected here, after the step after it is launched (PlanAfter: it
    // feeds the tokens this one draws from the device), so that the device
    // computes that one while the host answers this one's streams. Where
    // PlanAfter cannot plan it (a decode with no block), Plan does once
    // this one is collected.
    if (launched_ < 0) {
      if (!scheduler_->Plan(steps_[0])) return Status::Ok();
      RETURN_IF_ERROR(Launch(0));
    }
    const int current = launched_;
    PlannedStep& step = steps_[current];
    PlannedStep& after = steps_[1 - current];
    launched_ = -1;
    if (overlap_ && scheduler_->PlanAfter(step, after)) RETURN_IF_ERROR(Launch(1 - current));
    next_.assign(step.ids.size(), -1);
    if (Status collected = executor_->Collect(next_); !collected.ok()) {
      launched_ = -1;  // the executor dropped what it had launched
      return collected;
    }
    scheduler_->Commit(step, next_);
    for (size_t i = 0; i < step.ids.size(); ++i) {
      if (step.sample[i] == 0 || scheduler_->Live(step, i) == nullptr) continue;
      const uint64_t id = step.ids[i];
      auto it = streams_.find(id);
      if (it == streams_.end()) continue;
      Stream& stream = it->second;
      if (next_[i] < 0 || next_[i] >= s_.config.vocab_size) {
        RETURN_IF_ERROR(sink.End(id, true,
                                 Internal("the executor drew token " + std::to_string(next_[i]) +
                                          ", outside the vocabulary"))
                            .status());
        Drop(id);
        continue;
      }
      if (Status accepted = Accept(stream, next_[i]); !accepted.ok()) {
        RETURN_IF_ERROR(sink.End(id, true, accepted).status());
        Drop(id);
        continue;
      }
      const bool final = !stream.finish.empty();
      if (final) Finish(stream);
      ASSIGN_OR_RETURN(const bool sent, SendResult(sink, id, stream, final));
      if (final || !sent) Drop(id);
    }
    return Status::Ok();
  }

 private:
  Result<std::vector<int32_t>> Prompt(const EngineRequest& r) {
    const auto element = [&](int index) -> Result<std::string_view> {
      const EngineInput& in = r.inputs[static_cast<size_t>(index)];
      // One BYTES element: a 4-byte little-endian length, then the bytes.
      if (in.bytes.size() < 4)
        return InvalidArgument("input " + s_.inputs[index].name + " is empty");
      uint32_t n = 0;
      std::memcpy(&n, in.bytes.data(), 4);
      if (in.bytes.size() != 4 + static_cast<size_t>(n))
        return InvalidArgument("input " + s_.inputs[index].name + " must hold one element");
      return std::string_view(reinterpret_cast<const char*>(in.bytes.data()) + 4, n);
    };
    if (r.inputs.size() != s_.inputs.size())
      return InvalidArgument("the request has " + std::to_string(r.inputs.size()) +
                             " inputs; the model takes " + std::to_string(s_.inputs.size()));
    const auto present = [&](int index) {
      return index >= 0 && !(r.inputs[static_cast<size_t>(index)].bytes.empty() &&
                             r.inputs[static_cast<size_t>(index)].shape.empty());
    };
    if (present(s_.text_input) == present(s_.messages_input))
      return InvalidArgument(present(s_.text_input)
                                 ? "give text_input or messages, not both"
                                 : "give text_input (a prompt) or messages (a chat)");
    std::optional<std::string_view> messages;
    if (present(s_.messages_input)) {
      ASSIGN_OR_RETURN(messages, element(s_.messages_input));
    }
    if (messages.has_value()) {
      const ChatTemplate* chat = s_.prompting.Select(/*has_tools=*/false);
      if (chat == nullptr)
        return FailedPrecondition(
            "the checkpoint has no chat template (tokenizer_config.json has no chat_template)");
      nlohmann::ordered_json listed = nlohmann::ordered_json::parse(*messages, nullptr, false);
      if (!listed.is_array() || listed.empty())
        return InvalidArgument("messages must be a non-empty JSON list");
      RETURN_IF_ERROR(CheckMessages(listed));
      nlohmann::ordered_json context = s_.prompting.SpecialTokens();
      context["messages"] = std::move(listed);
      context["tools"] = nullptr;
      context["documents"] = nullptr;
      context["add_generation_prompt"] = true;
      auto text = chat->Render(context);
      if (!text.ok())
        return Status(text.status().code(), "the chat template: " + text.status().message());
      // The template writes the special tokens itself.
      return s_.tokenizer->Encode(*text, /*add_special_tokens=*/false, /*parse_special=*/true);
    }
    ASSIGN_OR_RETURN(const std::string_view text, element(s_.text_input));
    if (text.size() > static_cast<size_t>(scheduler_->limits().max_positions) * 64)
      return InvalidArgument("text_input of " + std::to_string(text.size()) +
                             " bytes is longer than the model's " +
                             std::to_string(scheduler_->limits().max_positions) +
                             " positions could hold (at most 64 bytes a token)");
    return s_.tokenizer->Encode(text, /*add_special_tokens=*/true, /*parse_special=*/true);
  }

  // Readies an OpenAI messages list for a text-only chat template, in
  // place: a content given as a list of text parts becomes their texts
  // joined by newlines (as vLLM gives them to such templates); a null
  // content (an assistant's turn with tool calls) becomes empty. Refused,
  // naming the message: a part that is not text, a content of another
  // type, and (unless the model parses them) the text of a special token
  // in any string of a message, which the template's output, encoded with
  // its special tokens parsed, would turn into that token: a user could
  // otherwise end their turn and write another role's.
  Status CheckMessages(nlohmann::ordered_json& messages) const {
    for (size_t i = 0; i < messages.size(); ++i) {
      nlohmann::ordered_json& message = messages[i];
      const std::string where = "messages[" + std::to_string(i) + "]";
      if (!message.is_object()) return InvalidArgument(where + " must be an object");
      auto content = message.find("content");
      if (content != message.end()) {
        if (content->is_null()) {
          *content = "";
        } else if (content->is_array()) {
          std::string joined;
          for (size_t j = 0; j < content->size(); ++j) {
            const nlohmann::ordered_json& part = (*content)[j];
            const std::string at = where + ".content[" + std::to_string(j) + "]";
            if (!part.is_object()) return InvalidArgument(at + " must be an object");
            auto type = part.find("type");
            auto text = part.find("text");
            if (type == part.end() || !type->is_string())
              return InvalidArgument(at + " needs a string 'type'");
            if (*type != "text")
              return InvalidArgument(at + " is a part of type '" +
                                     type->get<std::string>().substr(0, 64) +
                                     "': backend llm takes text parts only");
            if (text == part.end() || !text->is_string())
              return InvalidArgument(at + " needs a string 'text'");
            if (j > 0) joined += '\n';
            joined += text->get<std::string>();
          }
          *content = std::move(joined);
        } else if (!content->is_string()) {
          return InvalidArgument(where + ".content must be a string, a list of text parts or null");
        }
      }
      if (!s_.parse_special_in_messages) RETURN_IF_ERROR(RefuseSpecialText(message, where, 0));
    }
    return Status::Ok();
  }

  // InvalidArgument when a string in `value` (keys included) holds the text
  // of a special token, or when it nests deeper than a message needs. The
  // text is checked as sent and as the template's filters could make it:
  // in ASCII lower and upper case (lower, upper), and with the template's
  // literal replace()s applied, each alone and all in turn.
  Status RefuseSpecialText(const nlohmann::ordered_json& value, const std::string& where,
                           int depth) const {
    if (depth > kMaxMessageDepth)
      return InvalidArgument(where + " nests deeper than " + std::to_string(kMaxMessageDepth) +
                             " levels");
    const auto check = [&](const std::string& text, const std::string& at) -> Status {
      std::optional<std::string> special;
      for (const std::string& cased : {text, AsciiCase(text, false), AsciiCase(text, true)}) {
        std::vector<std::string> variants = {cased};
        std::string all = cased;
        for (const auto& [from, to] : s_.template_replaces) {
          variants.push_back(ReplaceAll(cased, from, to));
          all = ReplaceAll(all, from, to);
        }
        variants.push_back(std::move(all));
        for (const std::string& variant : variants) {
          ASSIGN_OR_RETURN(special, s_.tokenizer->FirstSpecialToken(variant));
          if (special.has_value()) break;
        }
        if (special.has_value()) break;
      }
      if (!special.has_value()) return Status::Ok();
      return InvalidArgument(at + " holds \"" + special->substr(0, 64) +
                             "\", the text of a special token, which the chat template's output "
                             "would read as that token (the model's "
                             "parameters.special_text_in_messages: parse allows it)");
    };
    if (value.is_string()) return check(value.get<std::string>(), where);
    if (value.is_object()) {
      for (auto it = value.begin(); it != value.end(); ++it) {
        RETURN_IF_ERROR(check(it.key(), where));
        RETURN_IF_ERROR(
            RefuseSpecialText(it.value(), where + "." + it.key().substr(0, 64), depth + 1));
      }
    } else if (value.is_array()) {
      for (size_t i = 0; i < value.size(); ++i)
        RETURN_IF_ERROR(
            RefuseSpecialText(value[i], where + "[" + std::to_string(i) + "]", depth + 1));
    }
    return Status::Ok();
  }

  // Takes the stream's next token. An error (a token the tokenizer cannot
  // decode) is the stream's.
  Status Accept(Stream& stream, int32_t token) {
    stream.since.push_back(token);
    ++stream.generated;
    if (s_.eos_ids.count(token) != 0) {
      stream.finish = "stop";
    } else {
      // An id past the tokenizer's vocabulary (models whose embeddings have
      // padding rows) has no text, as transformers' decode gives it none.
      std::string piece;
      if (s_.tokenizer->TokenText(token).has_value()) {
        ASSIGN_OR_RETURN(piece, stream.detokenizer->Push(token));
      }
      stream.text += stream.stops.Push(piece);
      if (stream.stops.stopped()) stream.finish = "stop";
    }
    if (stream.finish.empty() && stream.generated >= stream.max_tokens) stream.finish = "length";
    return Status::Ok();
  }

  // The text held back, for the last response.
  static void Finish(Stream& stream) {
    if (stream.stops.stopped()) return;
    stream.text += stream.stops.Push(stream.detokenizer->Flush());
    stream.text += stream.stops.Flush();
  }

  void Drop(uint64_t id) {
    scheduler_->Remove(id);
    streams_.erase(id);
  }

  Status Send(ResponseSink& sink, uint64_t id, Stream& stream, bool final) {
    return SendResult(sink, id, stream, final).status();
  }

  // One response; false when the request was cancelled meanwhile.
  Result<bool> SendResult(ResponseSink& sink, uint64_t id, Stream& stream, bool final) {
    std::vector<int64_t> shape;
    const auto with_batch = [&](std::initializer_list<int64_t> dims) {
      shape.clear();
      if (s_.batching) shape.push_back(1);
      shape.insert(shape.end(), dims);
      return std::span<const int64_t>(shape);
    };
    const auto bytes_output = [&](size_t i, std::string_view text) -> Status {
      ASSIGN_OR_RETURN(std::byte * room, sink.Output(id, i, with_batch({1}), 4 + text.size()));
      const uint32_t n = static_cast<uint32_t>(text.size());
      std::memcpy(room, &n, 4);
      if (!text.empty()) std::memcpy(room + 4, text.data(), text.size());
      return Status::Ok();
    };
    const auto int_output = [&](size_t i, int64_t v) -> Status {
      ASSIGN_OR_RETURN(std::byte * room, sink.Output(id, i, with_batch({1}), 8));
      std::memcpy(room, &v, 8);
      return Status::Ok();
    };
    for (size_t i = 0; i < s_.output_kinds.size(); ++i) {
      switch (s_.output_kinds[i]) {
        case Out::kText:
          RETURN_IF_ERROR(bytes_output(i, stream.text));
          break;
        case Out::kTokenIds: {
          const int64_t n = static_cast<int64_t>(stream.since.size());
          ASSIGN_OR_RETURN(std::byte * room,
                           sink.Output(id, i, with_batch({n}), static_cast<uint64_t>(n) * 8));
          if (n > 0) std::memcpy(room, stream.since.data(), static_cast<size_t>(n) * 8);
          break;
        }
        case Out::kPromptTokens:
          if (final) RETURN_IF_ERROR(int_output(i, stream.prompt_tokens));
          break;
        case Out::kCompletionTokens:
          if (final) RETURN_IF_ERROR(int_output(i, stream.generated));
          break;
        case Out::kFinishReason:
          if (final) RETURN_IF_ERROR(bytes_output(i, stream.finish));
          break;
      }
    }
    stream.text.clear();
    stream.since.clear();
    return sink.End(id, final);
  }

  Setup s_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<Scheduler> scheduler_;
  uint32_t capacity_;
  std::map<uint64_t, Stream> streams_;
  std::vector<uint64_t> ending_;
  // Launches steps_[i] on the executor.
  Status Launch(int i) {
    const Status launched = executor_->Launch(steps_[i].batch());
    if (launched.ok()) launched_ = i;
    return launched;
  }

  // Two steps' storage: the one launched and not collected (launched_, -1:
  // none) and the one planned after it.
  PlannedStep steps_[2];
  int launched_ = -1;
  // HEARTH_LLM_OVERLAP=0: each step collected before the next is planned
  // (to measure what the overlap gives).
  const bool overlap_ = [] {
    const char* v = std::getenv("HEARTH_LLM_OVERLAP");
    return v == nullptr || std::string_view(v) != "0";
  }();
  std::vector<int32_t> next_;
  std::mt19937_64 random_{std::random_device{}()};
};

// The inputs and outputs: the config's when it lists them (each one the
// engine knows, with its type), else text_input and all five outputs.
Status ChooseSignature(const EngineOptions& options, Setup& s) {
  if (options.inputs.empty()) {
    s.inputs = {{std::string(kTextInput), DType::kBytes, {1}}};
  } else {
    for (const IoSpec& in : options.inputs) {
      if ((in.name != kTextInput && in.name != kMessagesInput) || in.dtype != DType::kBytes ||
          in.dims != std::vector<int64_t>{1})
        return InvalidArgument("input " + Describe(in) +
                               ": backend llm takes text_input and messages, TYPE_STRING dims [1]");
    }
    s.inputs = options.inputs;
  }
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    if (s.inputs[i].name == kTextInput) s.text_input = static_cast<int>(i);
    if (s.inputs[i].name == kMessagesInput) s.messages_input = static_cast<int>(i);
  }
  if (options.outputs.empty()) {
    for (const KnownOutput& k : KnownOutputs()) {
      s.outputs.push_back({std::string(k.name), k.dtype, k.dims});
      s.output_kinds.push_back(k.kind);
    }
    return Status::Ok();
  }
  for (const IoSpec& out : options.outputs) {
    const KnownOutput* known = nullptr;
    for (const KnownOutput& k : KnownOutputs())
      if (k.name == out.name) known = &k;
    if (known == nullptr || known->dtype != out.dtype || known->dims != out.dims) {
      std::string names;
      for (const KnownOutput& k : KnownOutputs())
        names += (names.empty() ? "" : ", ") + Describe({std::string(k.name), k.dtype, k.dims});
      return InvalidArgument("output " + Describe(out) + ": backend llm gives " + names);
    }
    s.outputs.push_back(out);
    s.output_kinds.push_back(known->kind);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Engine>> CreateLlmEngine(const std::vector<TensorView>& weights,
                                                const EngineOptions& options, bool on_gpu,
                                                const ExecutorFactory& make_executor) {
  namespace fs = std::filesystem;
  if (options.version_dir.empty())
    return FailedPrecondition("backend llm needs the model's version directory");
  const fs::path dir(options.version_dir);
  Setup s;
  s.batching = options.batching;
  ASSIGN_OR_RETURN(s.config, ReadModelConfig(options.version_dir));
  // What the config reading decided, for the worker's log (its stderr).
  for (const std::string& note : s.config.notes)
    std::fprintf(stderr, "backend llm: %s: %s\n", (dir / "config.json").c_str(), note.c_str());
  ASSIGN_OR_RETURN(s.weights, BindWeights(s.config, weights));
  RETURN_IF_ERROR(ChooseSignature(options, s));

  // tokenizer.json and tokenizer_config.json are read on a second thread
  // while the executor is made (on a GPU: cuBLASLt, the GEMM plans, the KV
  // pool): neither needs the other, and a Llama 3 tokenizer takes ~60 ms,
  // which a replacement worker would otherwise add to its start. The
  // future's destructor waits for the thread on every return below.
  const fs::path tokenizer_config = dir / "tokenizer_config.json";
  struct TextSide {
    std::unique_ptr<Tokenizer> tokenizer;
    ChatTemplateConfig prompting;
  };
  const auto read_text_side = [&dir, &tokenizer_config]() -> Result<TextSide> {
    TextSide t;
    ASSIGN_OR_RETURN(t.tokenizer, Tokenizer::Load((dir / "tokenizer.json").string()));
    std::error_code ec;
    if (fs::exists(tokenizer_config, ec)) {
      ASSIGN_OR_RETURN(t.prompting, ReadTokenizerConfig(tokenizer_config.string()));
    }
    return t;
  };
  std::future<Result<TextSide>> text_side;
  try {
    text_side = std::async(std::launch::async, read_text_side);
  } catch (const std::system_error&) {
    // No thread to be had (the user's process limit): read them in turn.
    text_side = std::async(std::launch::deferred, read_text_side);
  }

  // The config's parameters: the engine's, and those the server reads for
  // every model (server/model_config.cc). Another name is a typo or a
  // parameter of another backend: refused, never ignored.
  static constexpr std::string_view kParameters[] = {
      "block_size",        "max_tokens_per_step", "max_positions", "kv_cache_bytes",
      "kv_cache_fraction", "default_max_tokens",  "gemm_engine",   "special_text_in_messages"};
  for (const auto& [name, value] : options.parameters) {
    const auto known = [&name](const auto& names) {
      return std::find(std::begin(names), std::end(names), name) != std::end(names);
    };
    if (known(kParameters) || IsServerModelParameter(name)) continue;
    std::string listed;
    for (std::string_view n : kParameters) listed += (listed.empty() ? "" : ", ") + std::string(n);
    return InvalidArgument("parameters." + name.substr(0, 64) +
                           ": backend llm has no such parameter (its own are " + listed + ")");
  }

  // The engine's limits, from the config's parameters.
  ASSIGN_OR_RETURN(auto block_size, IntParameter(options, "block_size", 1, 1024));
  ASSIGN_OR_RETURN(auto step_tokens, IntParameter(options, "max_tokens_per_step", 1, 1 << 20));
  ASSIGN_OR_RETURN(auto positions,
                   IntParameter(options, "max_positions", 2, s.config.max_positions));
  ASSIGN_OR_RETURN(auto pool_bytes, IntParameter(options, "kv_cache_bytes", 1, int64_t{1} << 50));
  ASSIGN_OR_RETURN(auto pool_fraction, FractionParameter(options, "kv_cache_fraction"));
  ASSIGN_OR_RETURN(auto default_max_tokens,
                   IntParameter(options, "default_max_tokens", 1, s.config.max_positions));
  if (pool_bytes.has_value() && pool_fraction.has_value())
    return InvalidArgument("parameters: give kv_cache_bytes or kv_cache_fraction, not both");
  const int32_t max_seqs = static_cast<int32_t>(std::max<uint32_t>(1, options.max_streams));
  ExecutorOptions eo;
  eo.max_seqs = max_seqs;
  eo.max_tokens_per_step =
      static_cast<int32_t>(std::max<int64_t>(step_tokens.value_or(2048), max_seqs));
  eo.block_size = static_cast<int32_t>(block_size.value_or(16));
  eo.max_positions = static_cast<int32_t>(positions.value_or(s.config.max_positions));
  if (pool_bytes.has_value())
    eo.kv_pool_bytes = static_cast<uint64_t>(*pool_bytes);
  else if (pool_fraction.has_value())
    eo.kv_pool_fraction = *pool_fraction;
  else if (on_gpu)
    eo.kv_pool_fraction = 0.5;
  else
    eo.kv_pool_bytes = uint64_t{64} << 20;
  if (pool_fraction.has_value() && !on_gpu)
    return InvalidArgument(
        "parameters.kv_cache_fraction is for a GPU; on the CPU give "
        "kv_cache_bytes");
  ASSIGN_OR_RETURN(auto special_text,
                   ChoiceParameter(options, "special_text_in_messages", {"refuse", "parse"}));
  s.parse_special_in_messages = special_text == std::optional<std::string>("parse");
  ASSIGN_OR_RETURN(auto gemms,
                   ChoiceParameter(options, "gemm_engine", {"timed", "cublaslt", "hearth"}));
  if (gemms.has_value()) {
    if (!on_gpu) return InvalidArgument("parameters.gemm_engine is for a GPU");
    eo.gemms = *gemms == "cublaslt" ? ExecutorOptions::Gemms::kCublasLt
               : *gemms == "hearth" ? ExecutorOptions::Gemms::kHearth
                                    : ExecutorOptions::Gemms::kTimed;
  }

  s.defaults.max_tokens = std::min<int64_t>(default_max_tokens.value_or(16), eo.max_positions);
  s.defaults.sampling.temperature = s.config.default_temperature;
  s.defaults.sampling.top_p = s.config.default_top_p;
  s.defaults.sampling.top_k = s.config.default_top_k;
  s.defaults.sampling = Normalized(s.defaults.sampling);

  Result<std::unique_ptr<Executor>> made = make_executor(s.config, s.weights, eo);
  // A file's error first, as when the files were read before the executor.
  Result<TextSide> text = text_side.get();
  if (!text.ok()) return text.status();
  s.tokenizer = std::move(text->tokenizer);
  s.prompting = std::move(text->prompting);
  if (s.prompting.chat_template.has_value())
    s.template_replaces = LiteralReplaces(s.prompting.chat_template->source());
  for (const auto& [name, named] : s.prompting.named_templates)
    for (auto& pair : LiteralReplaces(named.source()))
      s.template_replaces.push_back(std::move(pair));
  if (s.messages_input >= 0 && s.prompting.Select(false) == nullptr && !options.inputs.empty() &&
      s.text_input < 0)
    return FailedPrecondition("input messages needs a chat template, and " +
                              tokenizer_config.string() + " has none");
  if (!made.ok()) return made.status();
  std::unique_ptr<Executor> executor = std::move(*made);
  // transformers' generate stops at the tokenizer's EOS too.
  if (s.prompting.eos_token.has_value())
    if (std::optional<int32_t> id = s.tokenizer->TokenId(*s.prompting.eos_token))
      s.eos_ids.insert(*id);
  for (int64_t id : s.config.eos_token_ids) s.eos_ids.insert(static_cast<int32_t>(id));
  SchedulerLimits limits;
  limits.block_size = executor->block_size();
  limits.num_blocks = executor->num_blocks();
  limits.max_seqs = max_seqs;
  limits.max_tokens_per_step = eo.max_tokens_per_step;
  limits.max_positions = eo.max_positions;
  ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> scheduler, Scheduler::Create(limits));
  return std::unique_ptr<Engine>(new LlmEngine(
      std::move(s), std::move(executor), std::move(scheduler), static_cast<uint32_t>(max_seqs)));
}

}  // namespace hearth::llm
