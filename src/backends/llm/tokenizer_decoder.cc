// backend: llm tokenizer — ids back to text: `tokenizers`' decoder chain
// (decoders/*.rs, the Metaspace and ByteLevel decoders) over a whole list,
// and the per-token form a stream applies.
#include <string>
#include <vector>

#include "backends/llm/tokenizer_internal.h"

namespace hearth::llm::tokenizer_internal {
namespace {

void ReplaceAllIn(std::string* text, std::string_view from, std::string_view to) {
  if (from.empty() || text->find(from) == std::string::npos) return;
  std::string out;
  size_t prev = 0;
  for (size_t at = text->find(from); at != std::string::npos; at = text->find(from, prev)) {
    out.append(*text, prev, at - prev);
    out.append(to);
    prev = at + from.size();
  }
  out.append(*text, prev, std::string::npos);
  *text = std::move(out);
}

// Metaspace's decode of one token: the replacement character becomes a
// space, or nothing in the first token when the scheme prepends one.
std::string MetaspaceToken(const DecoderStep& step, std::string_view token, bool first) {
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    if (token.compare(i, step.replacement.size(), step.replacement) == 0) {
      if (!(first && step.strip_first)) out.push_back(' ');
      i += step.replacement.size();
    } else {
      out.push_back(token[i++]);
    }
  }
  return out;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A byte-fallback group: its text when it is valid UTF-8, else one U+FFFD
// per byte (ByteFallback's rule, unlike from_utf8_lossy's).
void AppendByteGroup(std::string_view bytes, std::string* out) {
  if (IsValidUtf8(bytes)) {
    out->append(bytes);
  } else {
    for (size_t i = 0; i < bytes.size(); ++i) out->append(kReplacementChar);
  }
}

}  // namespace

int ByteFallbackValue(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  // Rust's u8::from_str_radix, which also takes a leading '+'.
  if (token[3] == '+') {
    const int low = HexDigit(token[4]);
    return low;
  }
  const int high = HexDigit(token[3]);
  const int low = HexDigit(token[4]);
  return high < 0 || low < 0 ? -1 : high * 16 + low;
}

void AppendByteLevelBytes(std::string_view token, std::string* out) {
  const size_t mark = out->size();
  for (size_t i = 0; i < token.size();) {
    const int b = CodePointToByte(NextCodePoint(token, &i));
    if (b < 0) {
      // A character outside the byte map: the token's own bytes, as they are.
      out->resize(mark);
      out->append(token);
      return;
    }
    out->push_back(static_cast<char>(b));
  }
}

std::string DecodeChain(const std::vector<DecoderStep>& steps, std::vector<std::string> tokens) {
  for (const DecoderStep& step : steps) {
    switch (step.kind) {
      case DecoderStep::Kind::kByteLevel: {
        std::string bytes;
        for (const std::string& token : tokens) AppendByteLevelBytes(token, &bytes);
        std::string text;
        AppendUtf8Lossy(bytes, &text);
        tokens.assign(1, std::move(text));
        break;
      }
      case DecoderStep::Kind::kReplace:
        for (std::string& token : tokens) ReplaceAllIn(&token, step.pattern, step.content);
        break;
      case DecoderStep::Kind::kByteFallback: {
        std::vector<std::string> out;
        out.reserve(tokens.size());
        std::string group;
        for (std::string& token : tokens) {
          const int b = ByteFallbackValue(token);
          if (b >= 0) {
            group.push_back(static_cast<char>(b));
            continue;
          }
          if (!group.empty()) {
            out.emplace_back();
            AppendByteGroup(group, &out.back());
            group.clear();
          }
          out.push_back(std::move(token));
        }
        if (!group.empty()) {
          out.emplace_back();
          AppendByteGroup(group, &out.back());
        }
        tokens = std::move(out);
        break;
      }
      case DecoderStep::Kind::kFuse: {
        std::string fused;
        for (const std::string& token : tokens) fused += token;
        tokens.assign(1, std::move(fused));
        break;
      }
      case DecoderStep::Kind::kStrip:
        for (std::string& token : tokens) {
          size_t cut = 0;
          for (size_t n = 0;
               n < step.start && token.compare(cut, step.content.size(), step.content) == 0; ++n) {
            cut += step.content.size();
          }
          token.erase(0, cut);
        }
        break;
      case DecoderStep::Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          tokens[i] = MetaspaceToken(step, tokens[i], i == 0);
        }
        break;
    }
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

Result<StreamDecoder> MakeStreamDecoder(const std::vector<DecoderStep>& steps,
                                        std::string_view where) {
  StreamDecoder decoder;
  if (steps.size() == 1 && steps[0].kind == DecoderStep::Kind::kByteLevel) {
    decoder.byte_level = true;
    return decoder;
  }
  // Otherwise: per-token steps, then ByteFallback, Fuse and Strip, in that
  // order; a token-by-token stream gives the same text for those.
  enum Phase { kPerToken, kAfterByteFallback, kAfterFuse, kAfterStrip } phase = kPerToken;
  const auto refuse = [&](size_t i, std::string_view why) {
    return InvalidArgument(std::string(where) + ".decoders[" + std::to_string(i) +
                           "]: " + std::string(why));
  };
  for (size_t i = 0; i < steps.size(); ++i) {
    const DecoderStep& step = steps[i];
    switch (step.kind) {
      case DecoderStep::Kind::kByteLevel:
        return refuse(i, "ByteLevel is supported only as the whole decoder");
      case DecoderStep::Kind::kReplace:
      case DecoderStep::Kind::kMetaspace:
        if (phase != kPerToken) {
          return refuse(i,
                        "Replace and Metaspace are supported only before ByteFallback, "
                        "Fuse and Strip");
        }
        decoder.per_token.push_back(step);
        break;
      case DecoderStep::Kind::kByteFallback:
        if (phase != kPerToken)
          return refuse(i,
                        "ByteFallback is supported only before Fuse "
                        "and Strip, once");
        decoder.byte_fallback = true;
        phase = kAfterByteFallback;
        break;
      case DecoderStep::Kind::kFuse:
        if (phase == kAfterStrip) return refuse(i, "Fuse after Strip is not supported");
        phase = kAfterFuse;
        break;
      case DecoderStep::Kind::kStrip:
        if (phase != kAfterFuse) {
          return refuse(i,
                        "Strip is supported only once, after Fuse (it would strip every "
                        "token)");
        }
        decoder.strip_char = step.content;
        decoder.strip_start = step.start;
        phase = kAfterStrip;
        break;
    }
  }
  return decoder;
}

std::string StreamTokenText(const StreamDecoder& decoder, std::string_view token, bool first) {
  std::string text(token);
  for (const DecoderStep& step : decoder.per_token) {
    if (step.kind == DecoderStep::Kind::kReplace) {
      ReplaceAllIn(&text, step.pattern, step.content);
    } else {
      text = MetaspaceToken(step, text, first);
    }
  }
  return text;
}

}  // namespace hearth::llm::tokenizer_internal
