#include "http/json_values.h"

#include <cstring>
#include <limits>

namespace hearth::json_values {

std::string_view Trim(std::string_view text) {
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t' || text.back() == '\n' ||
                           text.back() == '\r')) {
    text.remove_suffix(1);
  }
  return text;
}

// The text of the value `value` is at (only the bracket of an array or object).
std::string_view Token(ondemand::value& value) { return Trim(value.raw_json_token()); }

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// RFC 8259's number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
bool IsJsonNumber(std::string_view s) {
  size_t i = 0;
  auto digits = [&] {
    const size_t start = i;
    while (i < s.size() && IsDigit(s[i])) ++i;
    return i > start;
  };
  if (i < s.size() && s[i] == '-') ++i;
  if (i < s.size() && s[i] == '0') {
    ++i;
  } else if (!digits()) {
    return false;
  }
  if (i < s.size() && s[i] == '.') {
    ++i;
    if (!digits()) return false;
  }
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (!digits()) return false;
  }
  return i == s.size();
}

// How messages show a value: its text, or [...] and {...}.
std::string Describe(ondemand::value& value) {
  const std::string_view token = Token(value);
  if (!token.empty() && token.front() == '[') return "[...]";
  if (!token.empty() && token.front() == '{') return "{...}";
  if (token.size() > 40) return std::string(token.substr(0, 37)) + "...";
  return std::string(token);
}

// Maps the error of a typed read (get_bool, get_uint64, ...) to
// INCORRECT_TYPE when the value is well-formed JSON that is not of that type
// or does not fit it; other errors are malformed JSON.
error_code TypeFault(ondemand::value& value, error_code error) {
  if (error == simdjson::NUMBER_OUT_OF_RANGE) return simdjson::INCORRECT_TYPE;
  // simdjson says NUMBER_ERROR for a number past a double's range (1e400) too.
  if (error == simdjson::NUMBER_ERROR && IsJsonNumber(Token(value))) {
    return simdjson::INCORRECT_TYPE;
  }
  return error;
}

// Reads a value it has no use for, checking that it is well-formed JSON.
error_code SkipChecked(ondemand::value& value, int depth) {
  if (depth >= kMaxJsonDepth) return simdjson::DEPTH_ERROR;
  ondemand::json_type type;
  if (error_code e = value.type().get(type)) return e;
  switch (type) {
    case ondemand::json_type::array: {
      ondemand::array array;
      if (error_code e = value.get_array().get(array)) return e;
      for (auto child : array) {
        ondemand::value element;
        if (error_code e = std::move(child).get(element)) return e;
        if (error_code e = SkipChecked(element, depth + 1)) return e;
      }
      return simdjson::SUCCESS;
    }
    case ondemand::json_type::object: {
      ondemand::object object;
      if (error_code e = value.get_object().get(object)) return e;
      for (auto child : object) {
        ondemand::field field;
        std::string_view key;
        if (error_code e = std::move(child).get(field)) return e;
        if (error_code e = field.unescaped_key().get(key)) return e;
        if (error_code e = SkipChecked(field.value(), depth + 1)) return e;
      }
      return simdjson::SUCCESS;
    }
    case ondemand::json_type::number:
      // Checked, not converted: a number past a double's range is still JSON.
      return IsJsonNumber(Token(value)) ? simdjson::SUCCESS : simdjson::NUMBER_ERROR;
    case ondemand::json_type::string: {
      std::string_view text;
      return value.get_string().get(text);
    }
    case ondemand::json_type::boolean: {
      bool flag = false;
      return value.get_bool().get(flag);
    }
    case ondemand::json_type::null: {
      bool null = false;
      if (error_code e = value.is_null().get(null)) return e;
      return null ? simdjson::SUCCESS : simdjson::N_ATOM_ERROR;
    }
  }
  return simdjson::TAPE_ERROR;
}

// Reads the whole document and says where it is malformed, if it is.
Status CheckJson(const char* json, size_t size, size_t capacity) {
  ondemand::parser parser;
  ondemand::document doc;
  error_code error = parser.iterate(json, size, capacity).get(doc);
  bool located = false;
  if (!error) {
    located = true;
    ondemand::json_type type;
    error = doc.type().get(type);
    if (!error && (type == ondemand::json_type::array || type == ondemand::json_type::object)) {
      ondemand::value root;
      error = doc.get_value().get(root);
      if (!error) error = SkipChecked(root, 0);
      const char* trailing = nullptr;
      if (!error && doc.current_location().get(trailing) == simdjson::SUCCESS) {
        error = simdjson::TRAILING_CONTENT;
      }
    } else if (!error) {
      // A scalar document: not a request, but JSON all the same.
      switch (type) {
        case ondemand::json_type::number: {
          double number = 0;
          error = doc.get_double().get(number);
          std::string_view token;
          if (error == simdjson::NUMBER_ERROR &&
              doc.raw_json_token().get(token) == simdjson::SUCCESS && IsJsonNumber(Trim(token))) {
            error = simdjson::SUCCESS;
          }
          break;
        }
        case ondemand::json_type::string: {
          std::string_view text;
          error = doc.get_string().get(text);
          break;
        }
        case ondemand::json_type::boolean: {
          bool flag = false;
          error = doc.get_bool().get(flag);
          break;
        }
        default: {
          bool null = false;
          error = doc.is_null().get(null);
          if (!error && !null) error = simdjson::N_ATOM_ERROR;
          break;
        }
      }
    }
  }
  if (!error) return Status::Ok();
  std::string where;
  const char* at = nullptr;
  if (located && doc.current_location().get(at) == simdjson::SUCCESS && at >= json &&
      at <= json + size) {
    where = " at byte " + std::to_string(at - json);
  }
  return InvalidArgument("invalid JSON in the request" + where + ": " +
                         simdjson::error_message(error));
}

Status Malformed(error_code error) {
  return InvalidArgument(std::string("invalid JSON in the request: ") +
                         simdjson::error_message(error));
}

}  // namespace hearth::json_values
