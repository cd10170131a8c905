// Unicode, and what Python prints: str(), repr() and json.dumps for
// template values (chat_template_internal.h).
#include <charconv>
#include <cmath>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {

// ---- Unicode

char32_t DecodeAt(std::string_view s, size_t& pos) {
  const auto b0 = static_cast<unsigned char>(s[pos]);
  int len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xe ? 3 : (b0 >> 3) == 0x1e ? 4 : 0;
  if (len == 0 || pos + len > s.size()) {
    ++pos;  // malformed: one code point per byte
    return b0;
  }
  char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1f) : len == 3 ? (b0 & 0x0f) : (b0 & 0x07);
  for (int i = 1; i < len; ++i) {
    const auto b = static_cast<unsigned char>(s[pos + i]);
    if ((b & 0xc0) != 0x80) {
      ++pos;
      return b0;
    }
    cp = (cp << 6) | (b & 0x3f);
  }
  pos += len;
  return cp;
}

void AppendUtf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::vector<size_t> CodepointOffsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  for (size_t pos = 0; pos < s.size();) {
    offsets.push_back(pos);
    DecodeAt(s, pos);
  }
  offsets.push_back(s.size());
  return offsets;
}

// str.isspace() (and the \s of Python's re on str).
bool IsPySpace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

bool ValidUtf8(std::string_view s, size_t* bad_offset) {
  for (size_t pos = 0; pos < s.size();) {
    const auto b0 = static_cast<unsigned char>(s[pos]);
    size_t before = pos;
    char32_t cp = DecodeAt(s, pos);
    const size_t len = pos - before;
    // Stray or truncated bytes, surrogates, overlong forms.
    if ((b0 >= 0x80 && len == 1) || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff ||
        (len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) {
      if (bad_offset != nullptr) *bad_offset = before;
      return false;
    }
  }
  return true;
}

namespace {

// Characters repr() escapes beyond ASCII: the non-printable ones of the
// Latin-1, general punctuation and specials blocks (Python escapes every
// character of categories Cc, Cf, Cs, Co, Cn, Zl, Zp and Zs but space).
bool IsPyPrintable(char32_t cp) {
  if (cp < 0x20 || cp == 0x7f) return false;
  if (cp < 0x7f) return true;
  if (cp <= 0xa0 || cp == 0xad) return false;
  if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
      (cp >= 0x205f && cp <= 0x206f) || cp == 0x3000 || cp == 0xfeff ||
      (cp >= 0xfff9 && cp <= 0xfffb))
    return false;
  if ((cp >= 0xd800 && cp <= 0xf8ff) || (cp >= 0xf0000)) return false;  // surrogates, private use
  return true;
}

void AppendHex(std::string& out, uint32_t value, int digits) {
  static const char* kHex = "0123456789abcdef";
  for (int i = digits - 1; i >= 0; --i) out += kHex[(value >> (4 * i)) & 0xf];
}

std::string ReprString(const std::string& s) {
  char quote = '\'';
  if (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) quote = '"';
  std::string out(1, quote);
  for (size_t pos = 0; pos < s.size();) {
    size_t start = pos;
    char32_t cp = DecodeAt(s, pos);
    if (cp == static_cast<char32_t>(quote) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (IsPyPrintable(cp)) {
      out.append(s, start, pos - start);
    } else if (cp <= 0xff) {
      out += "\\x";
      AppendHex(out, cp, 2);
    } else if (cp <= 0xffff) {
      out += "\\u";
      AppendHex(out, cp, 4);
    } else {
      out += "\\U";
      AppendHex(out, cp, 8);
    }
  }
  out += quote;
  return out;
}

void AppendJsonString(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (size_t pos = 0; pos < s.size();) {
    size_t start = pos;
    char32_t cp = DecodeAt(s, pos);
    switch (cp) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (cp < 0x20) {
          out += "\\u";
          AppendHex(out, cp, 4);
        } else if (ensure_ascii && cp >= 0x7f) {
          if (cp == 0x7f) {
            out += static_cast<char>(cp);
          } else if (cp > 0xffff) {
            const uint32_t v = cp - 0x10000;
            out += "\\u";
            AppendHex(out, 0xd800 | (v >> 10), 4);
            out += "\\u";
            AppendHex(out, 0xdc00 | (v & 0x3ff), 4);
          } else {
            out += "\\u";
            AppendHex(out, cp, 4);
          }
        } else {
          out.append(s, start, pos - start);
        }
    }
  }
  out += '"';
}

void ToJsonInto(std::string& out, const Value& v, const JsonOptions& options, int level,
                RenderState& state) {
  RenderState::Nest nest(state);
  auto newline = [&](int at) {
    if (!options.indent) return;
    out += '\n';
    for (int i = 0; i < at; ++i) out += *options.indent;
  };
  switch (v.kind()) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += v.boolean() ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(v.integer());
      return;
    case Kind::kFloat: {
      const double d = v.number();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        out += PyFloatRepr(d);
      }
      return;
    }
    case Kind::kString:
      AppendJsonString(out, v.str(), options.ensure_ascii);
      state.CheckSize(out.size());
      return;
    case Kind::kList: {
      const List& list = v.list();
      if (list.items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      newline(level + 1);
      for (size_t i = 0; i < list.items.size(); ++i) {
        if (i > 0) {
          out += options.item_separator;
          newline(level + 1);
        }
        state.Tick();
        ToJsonInto(out, list.items[i], options, level + 1, state);
        state.CheckSize(out.size());
      }
      newline(level);
      out += ']';
      return;
    }
    case Kind::kDict: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& item : v.dict().items) items.push_back(&item);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (options.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out += '{';
      newline(level + 1);
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) {
          out += options.item_separator;
          newline(level + 1);
        }
        state.Tick();
        AppendJsonString(out, items[i]->first, options.ensure_ascii);
        out += options.key_separator;
        ToJsonInto(out, items[i]->second, options, level + 1, state);
        state.CheckSize(out.size());
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      Fail("Object of type " + TypeName(v) + " is not JSON serializable");
  }
}

void ReprInto(std::string& out, const Value& v, RenderState& state) {
  RenderState::Nest nest(state);
  switch (v.kind()) {
    case Kind::kUndefined:
      out += "Undefined";
      return;
    case Kind::kString:
      if (v.is_markup()) out += "Markup(";
      out += ReprString(v.str());
      if (v.is_markup()) out += ")";
      break;
    case Kind::kList: {
      const List& list = v.list();
      out += list.tuple ? '(' : '[';
      for (size_t i = 0; i < list.items.size(); ++i) {
        if (i > 0) out += ", ";
        state.Tick();
        ReprInto(out, list.items[i], state);
      }
      if (list.tuple && list.items.size() == 1) out += ',';
      out += list.tuple ? ')' : ']';
      break;
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      const Dict& dict = v.kind() == Kind::kDict ? v.dict() : v.ns().attrs;
      if (v.kind() == Kind::kNamespace) out += "<Namespace ";
      out += '{';
      for (size_t i = 0; i < dict.items.size(); ++i) {
        if (i > 0) out += ", ";
        state.Tick();
        out += ReprString(dict.items[i].first);
        out += ": ";
        ReprInto(out, dict.items[i].second, state);
      }
      out += '}';
      if (v.kind() == Kind::kNamespace) out += '>';
      break;
    }
    default:
      out += PyStr(v, state);
  }
  state.CheckSize(out.size());
}

}  // namespace

std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  std::string out;
  if (!sci.empty() && sci[0] == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits += c;
  }
  int exp = 0;
  std::from_chars(sci.data() + e_pos + 1 + (sci[e_pos + 1] == '+' ? 1 : 0), sci.data() + sci.size(),
                  exp);
  const int ndigits = static_cast<int>(digits.size());
  if (exp >= -4 && exp < 16) {
    const int decpt = exp + 1;
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= ndigits) {
      out += digits + std::string(decpt - ndigits, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (ndigits > 1) out += "." + digits.substr(1);
    out += exp < 0 ? "e-" : "e+";
    const int a = exp < 0 ? -exp : exp;
    if (a < 10) out += '0';
    out += std::to_string(a);
  }
  return out;
}

std::string PyStr(const Value& v, RenderState& state) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.boolean() ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.integer());
    case Kind::kFloat:
      return PyFloatRepr(v.number());
    case Kind::kString:
      return v.str();
    case Kind::kCallable:
      return v.fn().macro != nullptr ? "<Macro '" + v.fn().name + "'>"
                                     : "<function " + v.fn().name + ">";
    case Kind::kLoop: {
      const LoopState& loop = v.loop();
      return "<LoopContext " + std::to_string(loop.index0 + 1) + "/" +
             std::to_string(loop.items->items.size()) + ">";
    }
    default: {
      std::string out;
      ReprInto(out, v, state);
      return out;
    }
  }
}

std::string PyRepr(const Value& v, RenderState& state) {
  std::string out;
  ReprInto(out, v, state);
  return out;
}

std::string ToJson(const Value& v, const JsonOptions& options, RenderState& state) {
  std::string out;
  ToJsonInto(out, v, options, 0, state);
  return out;
}

}  // namespace hearth::llm::jinja
