// backend: llm tokenizer — text before the model: UTF-8, PCRE2 regexes,
// normalizers and pre-tokenizers, each as `tokenizers` defines it.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "backends/llm/tokenizer_internal.h"

namespace hearth::llm::tokenizer_internal {
namespace {

// One step of UTF-8 at s[i]: a well-formed sequence (length 1..4), or the
// maximal ill-formed subpart there (valid = false), which is `truncated`
// when it is a well-formed prefix cut off by the end of s.
struct Utf8Step {
  size_t length;
  bool valid;
  bool truncated;
};

Utf8Step ScanUtf8(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {1, true, false};
  int need = 0;
  uint8_t lo = 0x80;
  uint8_t hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b == 0xE0) {
    need = 2;
    lo = 0xA0;
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 2;
  } else if (b == 0xED) {
    need = 2;
    hi = 0x9F;
  } else if (b == 0xF0) {
    need = 3;
    lo = 0x90;
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 3;
  } else if (b == 0xF4) {
    need = 3;
    hi = 0x8F;
  } else {
    return {1, false, false};
  }
  size_t j = i + 1;
  for (int k = 0; k < need; ++k, ++j) {
    if (j >= s.size()) return {j - i, false, true};
    const auto c = static_cast<uint8_t>(s[j]);
    if (c < lo || c > hi) return {j - i, false, false};
    lo = 0x80;
    hi = 0xBF;
  }
  return {static_cast<size_t>(need) + 1, true, false};
}

struct CodeDeleter {
  void operator()(pcre2_code* code) const noexcept { pcre2_code_free(code); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const noexcept { pcre2_match_data_free(data); }
};

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  const int n = pcre2_get_error_message(code, buffer, sizeof(buffer));
  return n < 0 ? "PCRE2 error " + std::to_string(code)
               : std::string(reinterpret_cast<const char*>(buffer), static_cast<size_t>(n));
}

// GPT-2's byte-to-unicode table: printable bytes map to themselves, the
// others to 256, 257, ... in byte order.
struct ByteLevelTables {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // code points 0..323
  ByteLevelTables() {
    to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteLevelTables& Tables() {
  static const ByteLevelTables tables;
  return tables;
}

void SplitByMatches(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                    std::vector<Piece>* out) {
  // Isolated: each match and each gap is a piece; empty ones are dropped.
  size_t prev = 0;
  auto emit = [&](size_t start, size_t end) {
    if (end > start) {
      out->push_back(Piece{piece.text.substr(start, end - start), piece.at_start && start == 0});
    }
  };
  for (const auto& [start, end] : matches) {
    emit(prev, start);
    emit(start, end);
    prev = end;
  }
  emit(prev, piece.text.size());
}

Status SplitStep(const PreTokenizerStep& step, std::vector<Piece>* pieces) {
  std::vector<Piece> out;
  out.reserve(pieces->size() * 2);
  std::vector<std::pair<size_t, size_t>> matches;
  for (Piece& piece : *pieces) {
    matches.clear();
    if (step.regex != nullptr) {
      RETURN_IF_ERROR(step.regex->FindAll(piece.text, &matches));
    } else {
      for (size_t at = piece.text.find(step.literal); at != std::string::npos;
           at = piece.text.find(step.literal, at + step.literal.size())) {
        matches.emplace_back(at, at + step.literal.size());
      }
    }
    SplitByMatches(piece, matches, &out);
  }
  *pieces = std::move(out);
  return Status::Ok();
}

const Regex& Gpt2Regex() {
  static const std::unique_ptr<Regex> regex = [] {
    auto compiled = Regex::Compile(kGpt2Pattern);
    if (!compiled.ok()) std::abort();  // a constant pattern: cannot fail
    return std::move(compiled).value();
  }();
  return *regex;
}

Status ByteLevelStep(const PreTokenizerStep& step, std::vector<Piece>* pieces) {
  std::vector<Piece> split;
  split.reserve(pieces->size());
  std::vector<std::pair<size_t, size_t>> matches;
  for (Piece& piece : *pieces) {
    if (step.add_prefix_space && (piece.text.empty() || piece.text[0] != ' ')) {
      piece.text.insert(0, 1, ' ');
    }
    if (step.use_regex) {
      matches.clear();
      RETURN_IF_ERROR(Gpt2Regex().FindAll(piece.text, &matches));
      SplitByMatches(piece, matches, &split);
    } else if (!piece.text.empty()) {
      split.push_back(std::move(piece));
    }
  }
  const ByteLevelTables& tables = Tables();
  for (Piece& piece : split) {
    std::string mapped;
    mapped.reserve(piece.text.size() * 2);
    for (const char c : piece.text) AppendCodePoint(tables.to_cp[static_cast<uint8_t>(c)], &mapped);
    piece.text = std::move(mapped);
  }
  *pieces = std::move(split);
  return Status::Ok();
}

void ReplaceAll(std::string* text, std::string_view from, std::string_view to) {
  if (from.empty() || text->find(from) == std::string::npos) return;
  std::string out;
  out.reserve(text->size() + text->size() / 4);
  size_t prev = 0;
  for (size_t at = text->find(from); at != std::string::npos; at = text->find(from, prev)) {
    out.append(*text, prev, at - prev);
    out.append(to);
    prev = at + from.size();
  }
  out.append(*text, prev, std::string::npos);
  *text = std::move(out);
}

Status MetaspaceStep(const PreTokenizerStep& step, std::vector<Piece>* pieces) {
  std::vector<Piece> out;
  out.reserve(pieces->size() * 4);
  const std::string& rep = step.replacement;
  for (Piece& piece : *pieces) {
    ReplaceAll(&piece.text, " ", rep);
    const bool starts = piece.text.compare(0, rep.size(), rep) == 0;
    if (!starts && (step.prepend_scheme == PrependScheme::kAlways ||
                    (step.prepend_scheme == PrependScheme::kFirst && piece.at_start))) {
      piece.text.insert(0, rep);
    }
    if (!step.split) {
      if (!piece.text.empty()) out.push_back(std::move(piece));
      continue;
    }
    // MergedWithNext: a piece starts at every replacement character.
    size_t start = 0;
    for (size_t at = piece.text.find(rep, rep.size()); at != std::string::npos;
         at = piece.text.find(rep, at + rep.size())) {
      if (at > start)
        out.push_back(Piece{piece.text.substr(start, at - start), piece.at_start && start == 0});
      start = at;
    }
    if (piece.text.size() > start) {
      out.push_back(Piece{piece.text.substr(start), piece.at_start && start == 0});
    }
  }
  *pieces = std::move(out);
  return Status::Ok();
}

bool IsAscii(std::string_view s) {
  for (const char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

Status Nfc(std::string* text) {
  if (IsAscii(*text)) return Status::Ok();
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text->data()),
                   static_cast<utf8proc_ssize_t>(text->size()), &out,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) {
    return InvalidArgument(std::string("NFC normalization failed: ") + utf8proc_errmsg(n));
  }
  text->assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------- UTF-8

bool IsValidUtf8(std::string_view bytes) {
  for (size_t i = 0; i < bytes.size();) {
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = ScanUtf8(bytes, i);
    if (!step.valid) return false;
    i += step.length;
  }
  return true;
}

void AppendUtf8Lossy(std::string_view bytes, std::string* out) {
  size_t run = 0;  // start of the well-formed run not yet appended
  for (size_t i = 0; i < bytes.size();) {
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = ScanUtf8(bytes, i);
    if (!step.valid) {
      out->append(bytes.substr(run, i - run));
      out->append(kReplacementChar);
      run = i + step.length;
    }
    i += step.length;
  }
  out->append(bytes.substr(run));
}

size_t CompleteUtf8Prefix(std::string_view bytes) {
  // An incomplete sequence is at most 3 bytes long: look at the last 3.
  const size_t from = bytes.size() > 3 ? bytes.size() - 3 : 0;
  for (size_t i = from; i < bytes.size(); ++i) {
    const auto b = static_cast<uint8_t>(bytes[i]);
    if (b < 0x80 || (b >= 0x80 && b <= 0xBF)) continue;  // not a lead byte
    const Utf8Step step = ScanUtf8(bytes, i);
    if (step.truncated) return i;
  }
  return bytes.size();
}

uint32_t NextCodePoint(std::string_view s, size_t* i) {
  const auto b = static_cast<uint8_t>(s[*i]);
  if (b < 0x80) {
    ++*i;
    return b;
  }
  const int n = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
  uint32_t cp = b & (0x7F >> n);
  for (int k = 1; k < n && *i + k < s.size(); ++k) {
    cp = (cp << 6) | (static_cast<uint8_t>(s[*i + k]) & 0x3F);
  }
  *i += n;
  return cp;
}

void AppendCodePoint(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsWhiteSpace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool IsWordChar(uint32_t cp) {
  static const std::unique_ptr<Regex> word = [] {
    auto compiled = Regex::Compile(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])");
    if (!compiled.ok()) std::abort();  // a constant pattern: cannot fail
    return std::move(compiled).value();
  }();
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  }
  std::string s;
  AppendCodePoint(cp, &s);
  std::vector<std::pair<size_t, size_t>> matches;
  return word->FindAll(s, &matches).ok() && !matches.empty();
}

// ---------------------------------------------------------------- regex

std::string RewriteWhiteSpaceClasses(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '\\' || i + 1 == pattern.size()) {
      out.push_back(pattern[i]);
      continue;
    }
    const char next = pattern[i + 1];
    if (next == 's') {
      out += "\\p{White_Space}";
    } else if (next == 'S') {
      out += "\\P{White_Space}";
    } else if (next == 'Q') {
      // \Q...\E quotes: copied as they are.
      const size_t end = pattern.find("\\E", i + 2);
      const size_t stop = end == std::string_view::npos ? pattern.size() : end + 2;
      out.append(pattern.substr(i, stop - i));
      i = stop - 1;
      continue;
    } else {
      out.push_back('\\');
      out.push_back(next);
    }
    ++i;
  }
  return out;
}

Result<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern) {
  const std::string rewritten = RewriteWhiteSpaceClasses(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  std::unique_ptr<pcre2_code, CodeDeleter> code(
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                    PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr));
  if (code == nullptr) {
    return InvalidArgument("regex /" + std::string(pattern) + "/ does not compile (PCRE2, at " +
                           std::to_string(offset) + " of /" + rewritten +
                           "/): " + Pcre2Message(error));
  }
  const bool jit = pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE) == 0;
  return std::unique_ptr<Regex>(new Regex(code.release(), jit));
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

Status Regex::FindAll(std::string_view text,
                      std::vector<std::pair<size_t, size_t>>* matches) const {
  auto* code = static_cast<pcre2_code*>(code_);
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create_from_pattern(code, nullptr));
  if (data == nullptr) return ResourceExhausted("regex: out of memory for match data");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  size_t last_end = std::string_view::npos;  // end of the last match recorded
  while (pos <= text.size()) {
    int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), pos, 0, data.get(), nullptr)
                  : PCRE2_ERROR_JIT_BADOPTION;
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_JIT_BADOPTION) {
      // The interpreter keeps its backtracking on the heap: slower, deeper.
      rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return ResourceExhausted("regex match failed: " + Pcre2Message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t start = ovector[0];
    const size_t end = ovector[1];
    if (start == end && end == last_end) {
      // An empty match right after the last match is not taken (as
      // Oniguruma's find_iter): go on one character later.
      if (pos >= text.size()) break;
      size_t next = pos;
      NextCodePoint(text, &next);
      pos = next;
      continue;
    }
    matches->emplace_back(start, end);
    last_end = end;
    pos = end;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- normalizers

Status Normalize(const std::vector<NormalizerStep>& steps, std::string* text) {
  for (const NormalizerStep& step : steps) {
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc:
        RETURN_IF_ERROR(Nfc(text));
        break;
      case NormalizerStep::Kind::kPrepend:
        if (!text->empty()) text->insert(0, step.content);
        break;
      case NormalizerStep::Kind::kReplace:
        ReplaceAll(text, step.pattern, step.content);
        break;
    }
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- pre-tokenizers

uint32_t ByteToCodePoint(uint8_t b) { return Tables().to_cp[b]; }

int CodePointToByte(uint32_t cp) {
  return cp < Tables().to_byte.size() ? Tables().to_byte[cp] : -1;
}

Status PreTokenize(const std::vector<PreTokenizerStep>& steps, std::vector<Piece>* pieces) {
  for (const PreTokenizerStep& step : steps) {
    switch (step.kind) {
      case PreTokenizerStep::Kind::kSplit:
        RETURN_IF_ERROR(SplitStep(step, pieces));
        break;
      case PreTokenizerStep::Kind::kByteLevel:
        RETURN_IF_ERROR(ByteLevelStep(step, pieces));
        break;
      case PreTokenizerStep::Kind::kMetaspace:
        RETURN_IF_ERROR(MetaspaceStep(step, pieces));
        break;
    }
  }
  std::erase_if(*pieces, [](const Piece& piece) { return piece.text.empty(); });
  return Status::Ok();
}

}  // namespace hearth::llm::tokenizer_internal
