// backend: llm — chat templates: the Jinja2 `chat_template` a Hugging Face
// checkpoint carries in tokenizer_config.json, rendered the way transformers'
// apply_chat_template renders it, without Python.
//
// The language is the subset of Jinja2 that chat templates use, rendered
// byte for byte as jinja2 3.1 renders it in the environment transformers
// builds (src/transformers/utils/chat_template_utils.py,
// _compile_jinja_template):
//
//   ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//                                 extensions=[AssistantTracker, loopcontrols])
//   filters["tojson"]  = json.dumps(x, ensure_ascii=False, indent=None,
//                                   separators=None, sort_keys=False)
//   globals["raise_exception"] = raise TemplateError(message)
//   globals["strftime_now"]    = datetime.now().strftime(format)
//
// Supported: {{ }}, {% %}, {# #}, whitespace control (-, +), raw blocks;
// if/elif/else, for (tuple targets, `if` filter, `else`, `loop.*`, break,
// continue), set (names, tuples, namespace attributes, set blocks), macro,
// with, filter blocks, {% generation %} (rendered as its body); literals
// (strings with Python escapes, numbers, lists, tuples, dicts), the
// operators of jinja2 (and/or/not, in/not in, comparisons in chains, + - * /
// // % **, ~, x if c else y), subscripts and slices, attribute access;
// filters (abs capitalize count d default dictsort e escape first float
// indent int items join last length list lower map max min reject rejectattr
// replace reverse round safe select selectattr sort string sum title tojson
// trim unique upper wordcount), tests (boolean callable defined divisibleby
// eq/equalto/== even false filter float ge gt in integer iterable le lower lt
// mapping ne none number odd sameas sequence string test true undefined
// upper), the str methods strip/lstrip/rstrip split/rsplit splitlines
// startswith/endswith upper/lower/title/capitalize replace find/rfind/index
// count join is*, the dict methods items/keys/values/get, loop.cycle, and
// the globals range (at most 100000 items, as the sandbox), dict, namespace,
// raise_exception and strftime_now. Strings made by |safe or |escape are
// markupsafe's Markup: adding a plain string to one HTML-escapes the plain
// string, as in Python. A template using a filter or test outside the subset
// fails to parse, naming it. Undefined values behave as jinja2's default
// Undefined: they print as nothing, are false, iterate as empty, and are an
// error where a value is needed (arithmetic, attributes, tojson).
//
// Known differences from jinja2 on CPython, none of which the chat templates
// of Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 or ChatML meet: integers are
// 64-bit (overflow is an error); upper/lower/title/capitalize change ASCII
// letters only; repr() of non-ASCII strings escapes a fixed set of
// non-printable characters; map/select/reject/items and
// dict.items()/keys()/values() give lists (jinja2 gives generators and views,
// which print differently and fail only when consumed); a subscript of a
// literal number is an error (jinja2 folds it to an undefined value); a filter
// or test outside the subset fails the parse even inside an `if` (jinja2 fails
// only if that branch runs); dict literal keys are strings only. `str % args`
// formatting, str.format, recursive loops, call blocks, includes and template
// inheritance are not supported: they fail the parse or the render.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hearth/status.h"

namespace hearth::llm {

namespace jinja {
struct Program;
}

// What one render may spend. The template comes from the model directory but
// the messages from a client: every one of these is reachable by a request.
// Exceeding one fails the render with ResourceExhausted naming the limit.
struct ChatTemplateLimits {
  // The rendered prompt, and any single string the template builds.
  size_t max_output_bytes = 16u << 20;
  // Loop iterations, and the per-item steps of filters and list building,
  // over the whole render.
  int64_t max_loop_iterations = 10'000'000;
  // Nesting of statements, expressions and macro calls (recursion included),
  // and of the context's JSON.
  int max_depth = 256;
};

struct ChatTemplateOptions {
  ChatTemplateLimits limits;
  // The local time strftime_now() formats; unset: now (localtime_r), as
  // transformers' datetime.now(). Tests set it.
  std::function<std::tm()> now;
};

// A parsed chat template. Immutable and cheap to copy (copies share the
// parsed program); Render may run on many threads at once.
class ChatTemplate {
 public:
  // Largest template source accepted, and deepest nesting of blocks and
  // expressions the parser follows.
  static constexpr size_t kMaxSourceBytes = 1u << 20;
  static constexpr int kMaxParseDepth = 200;

  // InvalidArgument "line L, column C: what" for a syntax error, a filter or
  // test outside the subset, or a source that is not UTF-8.
  static Result<ChatTemplate> Parse(std::string_view source);

  // Renders with `context` as the template's variables. transformers passes
  // messages, tools (null when none), documents (null), add_generation_prompt,
  // the tokenizer's special tokens (bos_token, eos_token, ...; see
  // ChatTemplateConfig::SpecialTokens) and any extra template kwargs
  // (date_string, builtin_tools, ...). Objects are ordered_json because
  // Python dicts keep their order and tojson prints them in it.
  //
  // InvalidArgument for an error the template raises: raise_exception's
  // message exactly, or jinja2's message for a runtime error ("'x' is
  // undefined", type errors), prefixed with "chat template line L: ".
  // ResourceExhausted when a ChatTemplateLimits limit is reached.
  Result<std::string> Render(const nlohmann::ordered_json& context,
                             const ChatTemplateOptions& options = {}) const;

  const std::string& source() const { return *source_; }

 private:
  ChatTemplate(std::shared_ptr<const jinja::Program> program,
               std::shared_ptr<const std::string> source)
      : program_(std::move(program)), source_(std::move(source)) {}
  std::shared_ptr<const jinja::Program> program_;
  std::shared_ptr<const std::string> source_;
};

// What tokenizer_config.json says about prompting.
struct ChatTemplateConfig {
  // The template transformers uses by default: "chat_template" when it is a
  // string, the entry named "default" when it is a list of {name, template}
  // (or the only entry). Unset when the checkpoint has none.
  std::optional<ChatTemplate> chat_template;
  // Every template of a list, by name ("default", "tool_use", "rag", ...).
  std::map<std::string, ChatTemplate> named_templates;
  // Where the template came from: "tokenizer_config.json" or the
  // chat_template.jinja beside it.
  std::string template_file;

  // Special tokens as strings (a {"content": ...} object gives its content);
  // unset when absent or null.
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::optional<std::string> unk_token;
  std::optional<std::string> pad_token;
  // Whether the tokenizer adds BOS/EOS when encoding; unset when the file
  // does not say (the tokenizer class's default applies).
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;

  // The template transformers picks: "tool_use" when tools are given and the
  // list has one, else chat_template. Null when the checkpoint has none.
  const ChatTemplate* Select(bool has_tools) const;
  // {"bos_token": ..., "eos_token": ..., "unk_token": ..., "pad_token": ...}
  // for the tokens that are set, as transformers adds them to the context.
  nlohmann::ordered_json SpecialTokens() const;
};

// Reads tokenizer_config.json at `path`. A chat_template.jinja in the same
// directory replaces the config's template(s), as in transformers (which
// saves templates there since 4.50). NotFound when the file is missing; InvalidArgument
// naming the file and the field for malformed JSON, fields of the wrong
// type, or a template that fails to parse ("tokenizer_config.json:
// chat_template: line 3, column 9: unexpected '}'").
Result<ChatTemplateConfig> ReadTokenizerConfig(const std::string& path);
// The same from the file's text; `file_name` names it in errors. No
// chat_template.jinja fallback.
Result<ChatTemplateConfig> ParseTokenizerConfig(std::string_view json_text,
                                                std::string_view file_name);

}  // namespace hearth::llm
