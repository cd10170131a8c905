#include "http/json_body.h"

#include <set>
#include <string>
#include <vector>

namespace hearth {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxJsonErrorChars = 200;

// Thrown by the parser callback to stop parsing; caught in ParseJsonBody.
struct NestingTooDeep {};
struct DuplicateKey {
  std::string key;
};

// Sees every key and every opening bracket as the parser reads them.
class Checker {
 public:
  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (frames_.size() == kMaxJsonBodyDepth) throw NestingTooDeep();
        frames_.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        frames_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!frames_.back().insert(key).second) throw DuplicateKey{key};
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  std::vector<std::set<std::string, std::less<>>> frames_;
};

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
std::string Reason(const Json::exception& e) {
  std::string what = e.what();
  if (const size_t tag = what.find("] ");
      what.rfind("[json.exception.", 0) == 0 && tag != std::string::npos) {
    what.erase(0, tag + 2);
  }
  if (what.size() > kMaxJsonErrorChars) what = what.substr(0, kMaxJsonErrorChars) + "...";
  return what;
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Past the string whose opening quote is at json[i]; the document is valid.
size_t SkipString(std::string_view json, size_t i) {
  for (++i; i < json.size(); ++i) {
    if (json[i] == '\\') {
      ++i;
    } else if (json[i] == '"') {
      return i + 1;
    }
  }
  return json.size();
}

// Past the value that starts at json[i]; the document is valid.
size_t SkipValue(std::string_view json, size_t i) {
  if (json[i] == '"') return SkipString(json, i);
  if (json[i] == '[' || json[i] == '{') {
    size_t depth = 0;
    while (i < json.size()) {
      const char c = json[i];
      if (c == '"') {
        i = SkipString(json, i);
        continue;
      }
      if (c == '[' || c == '{') ++depth;
      if (c == ']' || c == '}') {
        if (--depth == 0) return i + 1;
      }
      ++i;
    }
    return i;
  }
  // A number or a literal: up to the next delimiter.
  while (i < json.size() && json[i] != ',' && json[i] != '}' && json[i] != ']' &&
         !IsSpace(json[i])) {
    ++i;
  }
  return i;
}

size_t SkipSpace(std::string_view json, size_t i) {
  while (i < json.size() && IsSpace(json[i])) ++i;
  return i;
}

}  // namespace

Result<Json> ParseJsonBody(std::string_view body) {
  if (const size_t nul = body.find('\0'); nul != std::string_view::npos) {
    return InvalidArgument("invalid JSON in the request at byte " + std::to_string(nul) +
                           ": a NUL byte");
  }
  Checker checker;
  try {
    return Json::parse(body.begin(), body.end(), std::ref(checker));
  } catch (const Json::parse_error& e) {
    return InvalidArgument("invalid JSON in the request at byte " + std::to_string(e.byte) + ": " +
                           Reason(e));
  } catch (const Json::exception& e) {
    return InvalidArgument("invalid JSON in the request: " + Reason(e));
  } catch (const NestingTooDeep&) {
    return InvalidArgument("the request's JSON nests deeper than " +
                           std::to_string(kMaxJsonBodyDepth) + " levels");
  } catch (const DuplicateKey& duplicate) {
    // Quoted by dump(): the key is valid UTF-8, which the parser checked.
    return InvalidArgument(
        "the request's JSON has the key " +
        Json(duplicate.key).dump(-1, ' ', false, Json::error_handler_t::replace) +
        " twice in one object");
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory parsing the request's JSON");
  }
}

std::optional<std::string_view> TopLevelValueText(std::string_view json, std::string_view key) {
  size_t i = SkipSpace(json, 0);
  if (i >= json.size() || json[i] != '{') return std::nullopt;
  i = SkipSpace(json, i + 1);
  while (i < json.size() && json[i] == '"') {
    const size_t key_end = SkipString(json, i);
    const std::string_view raw_key = json.substr(i + 1, key_end - i - 2);
    bool match = raw_key == key;
    if (!match && raw_key.find('\\') != std::string_view::npos) {
      // Escaped: compared as the parser reads it.
      try {
        match = Json::parse(json.substr(i, key_end - i)).get<std::string>() == key;
      } catch (const std::exception&) {
        match = false;
      }
    }
    i = SkipSpace(json, key_end);
    if (i >= json.size() || json[i] != ':') return std::nullopt;
    const size_t value_start = SkipSpace(json, i + 1);
    if (value_start >= json.size()) return std::nullopt;
    const size_t value_end = SkipValue(json, value_start);
    if (match) return json.substr(value_start, value_end - value_start);
    i = SkipSpace(json, value_end);
    if (i >= json.size() || json[i] != ',') return std::nullopt;
    i = SkipSpace(json, i + 1);
  }
  return std::nullopt;
}

}  // namespace hearth
