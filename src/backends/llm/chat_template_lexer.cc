// The lexer of chat templates: jinja2 3.1's lexer.py in the environment
// transformers configures: trim_blocks (a block tag eats the newline after
// it), lstrip_blocks (a block or comment tag alone on its line eats the
// line's indentation), `-` and `+` whitespace control, raw blocks, and
// Python's string escapes.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {

Positions::Positions(std::string_view source) : source_(source) {
  line_starts_.push_back(0);
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\n') line_starts_.push_back(i + 1);
  }
}

int Positions::Line(size_t offset) const {
  return static_cast<int>(std::upper_bound(line_starts_.begin(), line_starts_.end(), offset) -
                          line_starts_.begin());
}

int Positions::Column(size_t offset) const {
  const size_t start = line_starts_[Line(offset) - 1];
  int column = 1;
  for (size_t i = start; i < offset && i < source_.size(); ++i) {
    if ((static_cast<unsigned char>(source_[i]) & 0xc0) != 0x80) ++column;
  }
  return column;
}

void Positions::FailAt(size_t offset, const std::string& message) const {
  Fail("line " + std::to_string(Line(offset)) + ", column " + std::to_string(Column(offset)) +
       ": " + message);
}

namespace {

bool IsSpaceAt(std::string_view s, size_t pos, size_t* next) {
  size_t p = pos;
  const char32_t cp = DecodeAt(s, p);
  if (!IsPySpace(cp)) return false;
  *next = p;
  return true;
}

size_t SkipSpaces(std::string_view s, size_t pos) {
  size_t next = pos;
  while (pos < s.size() && IsSpaceAt(s, pos, &next)) pos = next;
  return pos;
}

// text.rstrip(): the length of `text` without its trailing whitespace.
size_t RstripLength(std::string_view text) {
  const std::vector<size_t> offsets = CodepointOffsets(text);
  size_t end = text.size();
  for (size_t i = offsets.size() - 1; i > 0; --i) {
    size_t pos = offsets[i - 1];
    if (!IsPySpace(DecodeAt(text, pos))) break;
    end = offsets[i - 1];
  }
  return end;
}

bool AllSpaces(std::string_view text) {
  if (text.empty()) return false;
  return SkipSpaces(text, 0) == text.size();
}

bool IsNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}
bool IsNameChar(char c) { return IsNameStart(c) || (c >= '0' && c <= '9'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

class Lexer {
 public:
  Lexer(std::string_view source, const Positions& positions)
      : src_(source), positions_(positions) {}

  std::vector<Token> Run() {
    size_t pos = 0;
    while (pos < src_.size()) {
      const size_t tag = FindTagStart(pos);
      if (tag == std::string_view::npos) {
        EmitData(pos, src_.substr(pos));
        break;
      }
      const char kind = src_[tag + 1];
      size_t after = tag + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after++];
      size_t raw_body = 0;
      const bool raw = kind == '%' && MatchRawBegin(after, &raw_body);
      EmitData(pos, StripBefore(src_.substr(pos, tag - pos), sign, kind != '{'));
      line_starting_ = false;
      if (raw) {
        pos = LexRaw(raw_body);
      } else if (kind == '#') {
        pos = LexComment(tag, after);
      } else {
        pos = LexTag(tag, after, kind == '%');
      }
    }
    Token eof;
    eof.type = Tok::kEof;
    eof.offset = src_.size();
    tokens_.push_back(std::move(eof));
    return std::move(tokens_);
  }

 private:
  size_t FindTagStart(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string_view::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
        return i;
    }
    return std::string_view::npos;
  }

  // The text before a tag, after `-` (strip all whitespace) or lstrip_blocks
  // (strip the indentation of a line holding only the block tag).
  std::string_view StripBefore(std::string_view text, char sign, bool block_or_comment) const {
    if (sign == '-') return text.substr(0, RstripLength(text));
    if (sign != '+' && block_or_comment) {
      const size_t nl = text.rfind('\n');
      const size_t line_start = nl == std::string_view::npos ? 0 : nl + 1;
      if ((line_start > 0 || line_starting_) && AllSpaces(text.substr(line_start)))
        return text.substr(0, line_start);
    }
    return text;
  }

  void EmitData(size_t offset, std::string_view text) {
    if (text.empty()) return;
    Token t;
    t.type = Tok::kData;
    t.value = std::string(text);
    t.offset = offset;
    tokens_.push_back(std::move(t));
  }

  void Emit(Tok type, size_t offset, std::string value = {}) {
    Token t;
    t.type = type;
    t.offset = offset;
    t.value = std::move(value);
    tokens_.push_back(std::move(t));
  }

  // `{%[-+] raw [-]%}` at `after` (past the sign): where the raw text starts.
  bool MatchRawBegin(size_t after, size_t* body) const {
    size_t p = SkipSpaces(src_, after);
    if (src_.compare(p, 3, "raw") != 0) return false;
    p = SkipSpaces(src_, p + 3);
    if (src_.compare(p, 3, "-%}") == 0) {
      *body = SkipSpaces(src_, p + 3);
      return true;
    }
    if (src_.compare(p, 2, "%}") == 0) {
      *body = p + 2;
      return true;
    }
    return false;
  }

  size_t LexRaw(size_t body) {
    for (size_t i = src_.find("{%", body); i != std::string_view::npos;
         i = src_.find("{%", i + 1)) {
      size_t p = i + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      p = SkipSpaces(src_, p);
      if (src_.compare(p, 6, "endraw") != 0) continue;
      p = SkipSpaces(src_, p + 6);
      size_t end;
      if (src_.compare(p, 3, "+%}") == 0) {
        end = p + 3;
      } else if (src_.compare(p, 3, "-%}") == 0) {
        end = SkipSpaces(src_, p + 3);
      } else if (src_.compare(p, 2, "%}") == 0) {
        end = p + 2;
        if (end < src_.size() && src_[end] == '\n') ++end;
      } else {
        continue;
      }
      EmitData(body, StripBefore(src_.substr(body, i - body), sign, true));
      line_starting_ = end > 0 && src_[end - 1] == '\n';
      return end;
    }
    positions_.FailAt(body, "Missing end of raw directive");
  }

  size_t LexComment(size_t tag, size_t after) {
    const size_t close = src_.find("#}", after);
    if (close == std::string_view::npos) positions_.FailAt(tag, "Missing end of comment tag");
    size_t end = close + 2;
    const char sign = close > after ? src_[close - 1] : 0;
    if (sign == '-') {
      end = SkipSpaces(src_, end);
    } else if (sign != '+' && end < src_.size() && src_[end] == '\n') {
      ++end;  // trim_blocks
    }
    line_starting_ = src_[end - 1] == '\n';
    return end;
  }

  size_t LexTag(size_t tag, size_t after, bool block) {
    Emit(block ? Tok::kBlockBegin : Tok::kVarBegin, tag);
    std::vector<char> balance;
    size_t pos = after;
    while (true) {
      pos = SkipSpaces(src_, pos);
      if (pos >= src_.size()) {
        positions_.FailAt(tag, std::string("unexpected end of template, expected '") +
                                   (block ? "%}" : "}}") + "'");
      }
      if (balance.empty()) {
        size_t end = 0;
        if (block) {
          if (src_.compare(pos, 3, "+%}") == 0) {
            end = pos + 3;
          } else if (src_.compare(pos, 3, "-%}") == 0) {
            end = SkipSpaces(src_, pos + 3);
          } else if (src_.compare(pos, 2, "%}") == 0) {
            end = pos + 2;
            if (end < src_.size() && src_[end] == '\n') ++end;  // trim_blocks
          }
        } else {
          if (src_.compare(pos, 3, "-}}") == 0) {
            end = SkipSpaces(src_, pos + 3);
          } else if (src_.compare(pos, 2, "}}") == 0) {
            end = pos + 2;
          }
        }
        if (end != 0) {
          Emit(block ? Tok::kBlockEnd : Tok::kVarEnd, pos);
          line_starting_ = src_[end - 1] == '\n';
          return end;
        }
      }
      pos = LexOne(pos, balance);
    }
  }

  size_t LexOne(size_t pos, std::vector<char>& balance) {
    const char c = src_[pos];
    if (IsDigit(c)) return LexNumber(pos);
    if (IsNameStart(c)) {
      size_t end = pos;
      while (end < src_.size() && IsNameChar(src_[end])) ++end;
      Emit(Tok::kName, pos, std::string(src_.substr(pos, end - pos)));
      return end;
    }
    if (c == '\'' || c == '"') return LexString(pos);
    static const char* kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                 "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                 ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
    for (const char* op : kOps) {
      const size_t len = std::char_traits<char>::length(op);
      if (src_.compare(pos, len, op) != 0) continue;
      const std::string_view o(op, len);
      if (o == "{" || o == "(" || o == "[") {
        balance.push_back(o == "{" ? '}' : o == "(" ? ')' : ']');
      } else if (o == "}" || o == ")" || o == "]") {
        if (balance.empty()) positions_.FailAt(pos, "unexpected '" + std::string(o) + "'");
        const char expected = balance.back();
        balance.pop_back();
        if (expected != op[0]) {
          positions_.FailAt(pos, "unexpected '" + std::string(o) + "', expected '" +
                                     std::string(1, expected) + "'");
        }
      }
      Emit(Tok::kOp, pos, std::string(o));
      return pos + len;
    }
    size_t next = pos;
    const char32_t cp = DecodeAt(src_, next);
    std::string shown;
    AppendUtf8(shown, cp);
    positions_.FailAt(pos, "unexpected char '" + shown + "'");
  }

  // integer_re and float_re of jinja2's lexer: 42, 1_000, 0x1f, 0o17, 0b101,
  // 1.5, 1e3, 2.5E-3.
  size_t LexNumber(size_t pos) {
    auto digits = [&](size_t p, auto is_digit) {
      // (\d+_)*\d+ : digits with single underscores between them.
      size_t end = p;
      while (end < src_.size() && is_digit(src_[end])) {
        ++end;
        if (end + 1 < src_.size() && src_[end] == '_' && is_digit(src_[end + 1])) ++end;
      }
      return end;
    };
    auto dec = [](char c) { return IsDigit(c); };
    // Float: digits, then a fraction and/or an exponent.
    const bool after_dot = pos > 0 && src_[pos - 1] == '.';
    size_t int_end = digits(pos, dec);
    size_t end = int_end;
    bool is_float = false;
    if (!after_dot && end + 1 < src_.size() && src_[end] == '.' && IsDigit(src_[end + 1])) {
      end = digits(end + 1, dec);
      is_float = true;
    }
    if (!after_dot && end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t p = end + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && IsDigit(src_[p])) {
        end = digits(p, dec);
        is_float = true;
      }
    }
    std::string text;
    if (is_float) {
      for (size_t i = pos; i < end; ++i) {
        if (src_[i] != '_') text += src_[i];
      }
      Token t;
      t.type = Tok::kFloat;
      t.offset = pos;
      t.float_value = std::strtod(text.c_str(), nullptr);
      tokens_.push_back(std::move(t));
      return end;
    }
    int base = 10;
    size_t start = pos;
    if (src_[pos] == '0' && pos + 1 < src_.size()) {
      const char p = static_cast<char>(src_[pos + 1] | 0x20);
      if (p == 'x' || p == 'o' || p == 'b') {
        base = p == 'x' ? 16 : p == 'o' ? 8 : 2;
        start = pos + 2;
      }
    }
    if (base != 10) {
      // 0x(_?[\da-f])+
      end = start;
      while (end < src_.size()) {
        size_t p = end;
        if (src_[p] == '_') ++p;
        if (p >= src_.size()) break;
        const int v = HexValue(src_[p]);
        if (v < 0 || v >= base) break;
        end = p + 1;
      }
      if (end == start) {
        base = 10;  // a lone 0 followed by a name
        end = pos + 1;
        start = pos;
      }
    } else if (src_[pos] == '0') {
      // 0(_?0)*
      end = pos + 1;
      while (end < src_.size()) {
        size_t p = end;
        if (src_[p] == '_') ++p;
        if (p < src_.size() && src_[p] == '0') {
          end = p + 1;
        } else {
          break;
        }
      }
    } else {
      end = int_end;
    }
    uint64_t value = 0;
    for (size_t i = start; i < end; ++i) {
      if (src_[i] == '_') continue;
      const uint64_t d = static_cast<uint64_t>(HexValue(src_[i]));
      if (value > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - d) / base)
        positions_.FailAt(pos, "integer literal too large (integers are 64-bit)");
      value = value * base + d;
    }
    Token t;
    t.type = Tok::kInt;
    t.offset = pos;
    t.int_value = static_cast<int64_t>(value);
    tokens_.push_back(std::move(t));
    return end;
  }

  // A string literal with Python's escapes (jinja2 decodes them with
  // "unicode-escape").
  size_t LexString(size_t pos) {
    const char quote = src_[pos];
    std::string out;
    size_t p = pos + 1;
    while (true) {
      if (p >= src_.size())
        positions_.FailAt(pos, "unexpected char '" + std::string(1, quote) + "'");
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size())
        positions_.FailAt(pos, "unexpected char '" + std::string(1, quote) + "'");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case '\n':
          break;
        case '\\':
        case '\'':
        case '"':
          out += e;
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x':
        case 'u':
        case 'U': {
          const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int i = 0; i < n; ++i) {
            const int v = p + i < src_.size() ? HexValue(src_[p + i]) : -1;
            if (v < 0) {
              positions_.FailAt(p - 2, std::string("truncated \\") + e + " escape in a string");
            }
            cp = cp * 16 + static_cast<uint32_t>(v);
          }
          p += n;
          if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            positions_.FailAt(p - n - 2, "escape is not a Unicode scalar value");
          }
          AppendUtf8(out, cp);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++i)
              cp = cp * 8 + static_cast<uint32_t>(src_[p++] - '0');
            AppendUtf8(out, cp);
          } else if (e == 'N') {
            positions_.FailAt(p - 2, "\\N{...} escapes are not supported");
          } else {
            out += '\\';
            out += e;
          }
      }
    }
    Token t;
    t.type = Tok::kString;
    t.offset = pos;
    t.value = std::move(out);
    tokens_.push_back(std::move(t));
    return p + 1;
  }

  std::string_view src_;
  const Positions& positions_;
  std::vector<Token> tokens_;
  bool line_starting_ = true;
};

}  // namespace

std::vector<Token> Lex(std::string_view source, const Positions& positions) {
  Lexer lexer(source, positions);
  return lexer.Run();
}

}  // namespace hearth::llm::jinja
