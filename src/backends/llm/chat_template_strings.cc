// Python's str operations on UTF-8 strings, for the filters and methods of
// chat templates (chat_template_internal.h lists them). Indexes count code
// points; case changes are ASCII only.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {

std::vector<char32_t> Decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) out.push_back(DecodeAt(s, pos));
  return out;
}

std::string Encode(const std::vector<char32_t>& cps, size_t from, size_t to) {
  std::string out;
  to = std::min(to, cps.size());
  for (size_t i = from; i < to; ++i) AppendUtf8(out, cps[i]);
  return out;
}

std::string MapCase(const std::string& s, char32_t (*f)(char32_t)) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) AppendUtf8(out, f(DecodeAt(s, pos)));
  return out;
}

std::string Capitalize(const std::string& s) {
  std::vector<char32_t> cps = Decode(s);
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? ToUpper(cps[i]) : ToLower(cps[i]);
  return Encode(cps);
}

// str.title(): a cased character after an uncased one starts a word.
std::string PyTitle(const std::string& s) {
  std::vector<char32_t> cps = Decode(s);
  bool previous_cased = false;
  for (char32_t& c : cps) {
    if (IsCased(c)) {
      c = previous_cased ? ToLower(c) : ToUpper(c);
      previous_cased = true;
    } else {
      previous_cased = false;
    }
  }
  return Encode(cps);
}

// jinja2's title filter: words start after -, whitespace, (, {, [ or <.
std::string JinjaTitle(const std::string& s) {
  std::vector<char32_t> cps = Decode(s);
  bool word_start = true;
  for (char32_t& c : cps) {
    const bool separator = c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || IsPySpace(c);
    c = word_start ? ToUpper(c) : ToLower(c);
    word_start = separator;
  }
  return Encode(cps);
}

std::string Strip(const std::string& s, const std::optional<Value>& chars, bool left, bool right) {
  std::vector<char32_t> set;
  const bool whitespace = !chars || chars->is_none() || chars->is_undefined();
  if (!whitespace) {
    if (!chars->is_string()) Fail("strip arg must be None or str");
    set = Decode(chars->str());
  }
  auto strip = [&](char32_t c) {
    return whitespace ? IsPySpace(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  // Walks the UTF-8 from both ends, without decoding the middle.
  size_t from = 0;
  size_t to = s.size();
  while (left && from < to) {
    size_t next = from;
    if (!strip(DecodeAt(s, next))) break;
    from = next;
  }
  while (right && to > from) {
    size_t start = to - 1;
    while (start > from && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    size_t end = start;
    if (!strip(DecodeAt(s, end)) || end != to) break;
    to = start;
  }
  return s.substr(from, to - from);
}

Value StringList(std::vector<std::string> parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (std::string& p : parts) items.push_back(Value::String(std::move(p)));
  return Value::MakeList(std::move(items));
}

// str.split / str.rsplit.
std::vector<std::string> Split(const std::string& s, const std::optional<Value>& sep_v,
                               int64_t maxsplit, bool from_right) {
  if (maxsplit < 0) maxsplit = std::numeric_limits<int64_t>::max();
  std::vector<std::string> out;
  if (!sep_v || sep_v->is_none()) {
    const std::vector<char32_t> cps = Decode(s);
    const int64_t n = static_cast<int64_t>(cps.size());
    if (!from_right) {
      int64_t i = 0;
      while (maxsplit-- > 0) {
        while (i < n && IsPySpace(cps[i])) ++i;
        if (i == n) break;
        const int64_t j = i++;
        while (i < n && !IsPySpace(cps[i])) ++i;
        out.push_back(Encode(cps, j, i));
      }
      if (i < n) {
        while (i < n && IsPySpace(cps[i])) ++i;
        if (i != n) out.push_back(Encode(cps, i, n));
      }
    } else {
      int64_t i = n - 1;
      while (maxsplit-- > 0) {
        while (i >= 0 && IsPySpace(cps[i])) --i;
        if (i < 0) break;
        const int64_t j = i--;
        while (i >= 0 && !IsPySpace(cps[i])) --i;
        out.push_back(Encode(cps, i + 1, j + 1));
      }
      if (i >= 0) {
        while (i >= 0 && IsPySpace(cps[i])) --i;
        if (i >= 0) out.push_back(Encode(cps, 0, i + 1));
      }
      std::reverse(out.begin(), out.end());
    }
    return out;
  }
  if (!sep_v->is_string()) Fail("must be str or None, not " + TypeName(*sep_v));
  const std::string& sep = sep_v->str();
  if (sep.empty()) Fail("empty separator");
  if (!from_right) {
    size_t start = 0;
    while (maxsplit-- > 0) {
      const size_t at = s.find(sep, start);
      if (at == std::string::npos) break;
      out.push_back(s.substr(start, at - start));
      start = at + sep.size();
    }
    out.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    while (maxsplit-- > 0 && end >= sep.size()) {
      const size_t at = s.rfind(sep, end - sep.size());
      if (at == std::string::npos) break;
      out.push_back(s.substr(at + sep.size(), end - at - sep.size()));
      end = at;
    }
    out.push_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
  }
  return out;
}

namespace {

bool IsLineBreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

}  // namespace

std::vector<std::string> SplitLines(const std::string& s, bool keepends) {
  const std::vector<char32_t> cps = Decode(s);
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (!IsLineBreak(cps[i])) continue;
    size_t end = i + 1;
    if (cps[i] == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') end = i + 2;
    out.push_back(Encode(cps, start, keepends ? end : i));
    start = end;
    i = end - 1;
  }
  if (start < cps.size()) out.push_back(Encode(cps, start));
  return out;
}

std::string Replace(const std::string& s, const std::string& old_s, const std::string& new_s,
                    int64_t count, RenderState& state) {
  if (count < 0) count = std::numeric_limits<int64_t>::max();
  std::string out;
  if (old_s.empty()) {
    const std::vector<size_t> offsets = CodepointOffsets(s);
    for (size_t i = 0; i + 1 < offsets.size(); ++i) {
      if (count-- > 0) out += new_s;
      out.append(s, offsets[i], offsets[i + 1] - offsets[i]);
      state.CheckSize(out.size());
    }
    if (count > 0) out += new_s;
    state.CheckSize(out.size());
    return out;
  }
  size_t start = 0;
  while (count-- > 0) {
    const size_t at = s.find(old_s, start);
    if (at == std::string::npos) break;
    out.append(s, start, at - start);
    out += new_s;
    state.CheckSize(out.size());
    start = at + old_s.size();
  }
  out.append(s, start);
  state.CheckSize(out.size());
  return out;
}

int64_t CodepointIndex(const std::string& s, size_t byte_offset) {
  int64_t n = 0;
  for (size_t i = 0; i < byte_offset; ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xc0) != 0x80) ++n;
  }
  return n;
}

bool AffixMatch(const std::string& s, const Value& affix, bool prefix, std::string_view method) {
  auto one = [&](const Value& a) {
    if (!a.is_string()) {
      Fail(std::string(method) + " first arg must be str or a tuple of str, not " + TypeName(a));
    }
    const std::string& p = a.str();
    if (p.size() > s.size()) return false;
    return prefix ? s.compare(0, p.size(), p) == 0
                  : s.compare(s.size() - p.size(), p.size(), p) == 0;
  };
  if (affix.kind() == Kind::kList && affix.list().tuple) {
    for (const Value& a : affix.list().items) {
      if (one(a)) return true;
    }
    return false;
  }
  return one(affix);
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// jinja2's indent filter.
std::string Indent(const std::string& s, const Value& width, bool first, bool blank) {
  std::string indention;
  if (width.is_string()) {
    indention = width.str();
  } else if (IsIntLike(width)) {
    indention = std::string(static_cast<size_t>(std::max<int64_t>(0, width.integer())), ' ');
  } else {
    Fail("indent width must be an int or a string");
  }
  const std::vector<std::string> lines = SplitLines(s + "\n", false);
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) rv += "\n" + indention;
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      rv += "\n";
      if (!lines[i].empty()) rv += indention;
      rv += lines[i];
    }
  }
  if (first) rv = indention + rv;
  return rv;
}

// ---- numbers from strings, as Python's int() and float() read them

namespace {

std::string StripAscii(const std::string& s) { return Strip(s, std::nullopt, true, true); }

// Digits with single underscores between them; "" when malformed.
std::string WithoutUnderscores(std::string_view digits) {
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (digits[i] == '_') {
      if (i == 0 || i + 1 == digits.size() || digits[i + 1] == '_') return "";
      continue;
    }
    out += digits[i];
  }
  return out;
}

}  // namespace

std::optional<int64_t> ParsePyInt(const std::string& text, int base) {
  std::string s = StripAscii(text);
  bool negative = false;
  size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) negative = s[i++] == '-';
  auto prefix_base = [&](char c) { return c == 'x' ? 16 : c == 'o' ? 8 : c == 'b' ? 2 : 0; };
  if (i + 1 < s.size() && s[i] == '0') {
    const int b = prefix_base(static_cast<char>(s[i + 1] | 0x20));
    if (b != 0 && (base == 0 || base == b)) {
      base = b;
      i += 2;
      if (i < s.size() && s[i] == '_') ++i;
    }
  }
  if (base == 0) {
    base = 10;
    // Python refuses leading zeros in base 0 ("010"), except for zero itself.
    if (i + 1 < s.size() && s[i] == '0' && s.find_first_not_of("0_", i) != std::string::npos)
      return std::nullopt;
  }
  if (base < 2 || base > 36) return std::nullopt;
  const std::string digits = WithoutUnderscores(std::string_view(s).substr(i));
  if (digits.empty()) return std::nullopt;
  uint64_t value = 0;
  for (char c : digits) {
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'a' && c <= 'z' ? c - 'a' + 10
                  : c >= 'A' && c <= 'Z' ? c - 'A' + 10
                                         : 99;
    if (d >= base) return std::nullopt;
    if (value > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - d) / base)
      return std::nullopt;
    value = value * base + d;
  }
  return negative ? -static_cast<int64_t>(value) : static_cast<int64_t>(value);
}

std::optional<double> ParsePyFloat(const std::string& text) {
  std::string s = StripAscii(text);
  std::string lower = MapCase(s, ToLower);
  size_t i = (!lower.empty() && (lower[0] == '+' || lower[0] == '-')) ? 1 : 0;
  const std::string body = lower.substr(i);
  const double sign = (i == 1 && lower[0] == '-') ? -1.0 : 1.0;
  if (body == "inf" || body == "infinity") return sign * std::numeric_limits<double>::infinity();
  if (body == "nan") return std::numeric_limits<double>::quiet_NaN();
  // [digits][.digits][e[+-]digits], underscores only between digits.
  std::string cleaned = s.substr(0, i);
  size_t p = 0;
  auto digit_run = [&](bool required) {
    const size_t start = p;
    while (p < body.size() && ((body[p] >= '0' && body[p] <= '9') || body[p] == '_')) ++p;
    if (p == start) return !required;
    const std::string d = WithoutUnderscores(std::string_view(body).substr(start, p - start));
    if (d.empty()) return false;
    cleaned += d;
    return true;
  };
  const size_t int_start = p;
  if (!digit_run(false)) return std::nullopt;
  const bool had_int = p > int_start;
  if (p < body.size() && body[p] == '.') {
    cleaned += '.';
    ++p;
    const size_t frac_start = p;
    if (!digit_run(false)) return std::nullopt;
    if (!had_int && p == frac_start) return std::nullopt;
  } else if (!had_int) {
    return std::nullopt;
  }
  if (p < body.size() && body[p] == 'e') {
    cleaned += 'e';
    ++p;
    if (p < body.size() && (body[p] == '+' || body[p] == '-')) cleaned += body[p++];
    if (!digit_run(true) || p == 0) return std::nullopt;
  }
  if (p != body.size()) return std::nullopt;
  return std::strtod(cleaned.c_str(), nullptr);
}

}  // namespace hearth::llm::jinja
