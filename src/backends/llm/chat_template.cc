#include "backends/llm/chat_template.h"

#include <fstream>
#include <new>
#include <sstream>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm {
namespace {

Status FromError(const jinja::TemplateError& e) { return Status(e.code, e.message); }

Result<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path + ": cannot open");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Internal(path + ": read failed");
  return text.str();
}

std::string BaseName(std::string_view path) {
  const size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

// A special token: a string, {"content": "..."} (AddedToken), or null.
Result<std::optional<std::string>> TokenField(const nlohmann::ordered_json& config,
                                              std::string_view file, const char* field) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object()) {
    const auto content = it->find("content");
    if (content != it->end() && content->is_string()) {
      return std::optional<std::string>(content->get<std::string>());
    }
  }
  return InvalidArgument(std::string(file) + ": \"" + field +
                         "\" must be a string, an object with a string \"content\", or null");
}

Result<std::optional<bool>> BoolField(const nlohmann::ordered_json& config, std::string_view file,
                                      const char* field) {
  const auto it = config.find(field);
  if (it == config.end() || it->is_null()) return std::optional<bool>();
  if (!it->is_boolean()) {
    return InvalidArgument(std::string(file) + ": \"" + field + "\" must be true or false, got " +
                           it->dump());
  }
  return std::optional<bool>(it->get<bool>());
}

Result<ChatTemplate> ParseNamed(std::string_view source, std::string_view file,
                                std::string_view what) {
  Result<ChatTemplate> parsed = ChatTemplate::Parse(source);
  if (!parsed.ok()) {
    return InvalidArgument(std::string(file) + ": " + std::string(what) + ": " +
                           parsed.status().message());
  }
  return parsed;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  if (source.size() > kMaxSourceBytes) {
    return InvalidArgument("template of " + std::to_string(source.size()) +
                           " bytes is larger than the " + std::to_string(kMaxSourceBytes) +
                           " bytes accepted");
  }
  size_t bad = 0;
  if (!jinja::ValidUtf8(source, &bad)) {
    size_t line = 1;
    for (size_t i = 0; i < bad; ++i) line += source[i] == '\n' ? 1 : 0;
    return InvalidArgument("line " + std::to_string(line) + ": the template is not valid UTF-8");
  }
  try {
    std::shared_ptr<const jinja::Program> program = jinja::ParseProgram(source);
    return ChatTemplate(std::move(program), std::make_shared<const std::string>(source));
  } catch (const jinja::TemplateError& e) {
    return FromError(e);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the chat template");
  }
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context,
                                         const ChatTemplateOptions& options) const {
  jinja::RenderState state(options);
  try {
    return jinja::RenderProgram(*program_, context, state);
  } catch (const jinja::TemplateError& e) {
    return FromError(e);
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory rendering the chat template");
  } catch (const std::exception& e) {
    // nlohmann::json accessors on a context of the wrong shape.
    return InvalidArgument(std::string("chat template context: ") + e.what());
  }
}

const ChatTemplate* ChatTemplateConfig::Select(bool has_tools) const {
  if (has_tools) {
    const auto it = named_templates.find("tool_use");
    if (it != named_templates.end()) return &it->second;
  }
  return chat_template ? &*chat_template : nullptr;
}

nlohmann::ordered_json ChatTemplateConfig::SpecialTokens() const {
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  if (bos_token) tokens["bos_token"] = *bos_token;
  if (eos_token) tokens["eos_token"] = *eos_token;
  if (unk_token) tokens["unk_token"] = *unk_token;
  if (pad_token) tokens["pad_token"] = *pad_token;
  return tokens;
}

Result<ChatTemplateConfig> ParseTokenizerConfig(std::string_view json_text,
                                                std::string_view file_name) {
  const std::string file(file_name);
  nlohmann::ordered_json config;
  try {
    config = nlohmann::ordered_json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgument(file + ": malformed JSON: " + e.what());
  }
  if (!config.is_object()) return InvalidArgument(file + ": expected a JSON object");

  ChatTemplateConfig out;
  ASSIGN_OR_RETURN(out.bos_token, TokenField(config, file, "bos_token"));
  ASSIGN_OR_RETURN(out.eos_token, TokenField(config, file, "eos_token"));
  ASSIGN_OR_RETURN(out.unk_token, TokenField(config, file, "unk_token"));
  ASSIGN_OR_RETURN(out.pad_token, TokenField(config, file, "pad_token"));
  ASSIGN_OR_RETURN(out.add_bos_token, BoolField(config, file, "add_bos_token"));
  ASSIGN_OR_RETURN(out.add_eos_token, BoolField(config, file, "add_eos_token"));

  const auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return out;
  out.template_file = BaseName(file);
  if (it->is_string()) {
    ASSIGN_OR_RETURN(ChatTemplate parsed,
                     ParseNamed(it->get_ref<const std::string&>(), file, "chat_template"));
    out.chat_template = std::move(parsed);
    return out;
  }
  if (!it->is_array()) {
    return InvalidArgument(file + ": \"chat_template\" must be a string or a list of " +
                           "{\"name\", \"template\"} objects");
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& entry = (*it)[i];
    const std::string where = "chat_template[" + std::to_string(i) + "]";
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("template") || !entry["template"].is_string()) {
      return InvalidArgument(file + ": " + where +
                             " must be an object with string \"name\" and \"template\"");
    }
    const std::string name = entry["name"].get<std::string>();
    ASSIGN_OR_RETURN(ChatTemplate parsed,
                     ParseNamed(entry["template"].get_ref<const std::string&>(), file,
                                "chat_template \"" + name + "\""));
    if (!out.named_templates.emplace(name, std::move(parsed)).second) {
      return InvalidArgument(file + ": " + where + ": a second template named \"" + name + "\"");
    }
  }
  const auto def = out.named_templates.find("default");
  if (def != out.named_templates.end()) {
    out.chat_template = def->second;
  } else if (out.named_templates.size() == 1) {
    out.chat_template = out.named_templates.begin()->second;
  }
  return out;
}

Result<ChatTemplateConfig> ReadTokenizerConfig(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  ASSIGN_OR_RETURN(ChatTemplateConfig config, ParseTokenizerConfig(text, path));
  // transformers reads chat_template.jinja beside the config and lets it
  // replace whatever template the config holds.
  const size_t slash = path.rfind('/');
  const std::string jinja_path =
      (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
      "chat_template.jinja";
  std::ifstream probe(jinja_path, std::ios::binary);
  if (!probe) return config;
  ASSIGN_OR_RETURN(std::string source, ReadWholeFile(jinja_path));
  ASSIGN_OR_RETURN(ChatTemplate parsed, ParseNamed(source, jinja_path, "template"));
  config.chat_template = std::move(parsed);
  config.named_templates.clear();
  config.template_file = "chat_template.jinja";
  return config;
}

}  // namespace hearth::llm
