// backend: llm — the tokenizer: a Hugging Face tokenizer.json (as the
// `tokenizers` library writes it) read and run in C++, so that a worker
// turns a prompt into token ids and generated ids back into text without
// Python. It does what `tokenizers` does for the Llama family's BPE
// tokenizers and refuses, by name, every part it does not implement:
//
//   model           BPE: vocab, merges ("a b" strings or ["a", "b"] pairs),
//                   byte_fallback, unk_token, fuse_unk, ignore_merges
//                   (dropout 0 or null; no continuing_subword_prefix or
//                   end_of_word_suffix).
//   normalizer      NFC, Prepend, Replace (String pattern), Sequence of them.
//   pre_tokenizer   Split (Regex or String pattern, behavior Isolated, invert
//                   false), ByteLevel, Metaspace, Sequence of them.
//   post_processor  TemplateProcessing (its "single" template), ByteLevel
//                   (nothing for ids), Sequence of them.
//   decoder         ByteLevel; Metaspace; or a Sequence of per-token Replace
//                   (String) / Metaspace steps, then ByteFallback, Fuse and
//                   Strip(start n, stop 0) in that order.
//   added_tokens    matched in the text before the model, longest first
//                   (single_word, lstrip, rstrip, normalized, special).
//
// Llama 3 and Qwen2 (byte-level BPE), Llama 2 and Mistral (SentencePiece
// BPE with byte fallback, in both the Prepend/Replace and the Metaspace
// forms) are covered. truncation and padding are ignored: they are batch
// options of the Python API, not of a token sequence. Added tokens with
// normalized: true decode to their normalized form, as `tokenizers` 0.23
// does (0.22 and before gave their content). No cache of merged pieces:
// Encode takes no lock.
//
// Regular expressions are PCRE2's (UTF, UCP, JIT where available);
// `tokenizers` uses Oniguruma. \s and \S in a pattern are read as
// \p{White_Space} and \P{White_Space}, which is Oniguruma's \s (PCRE2's own
// \s also matches U+180E). Unicode tables: PCRE2 10.42 (Unicode 14) and
// utf8proc 2.8 (Unicode 15, NFC); characters assigned after those versions
// may be classified differently from `tokenizers`.
//
// Thread-safety: a Tokenizer is immutable once loaded; every const method
// may be called from any number of threads at once. A Detokenizer is used
// by one thread and must not outlive its Tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/status.h"

namespace hearth::llm {

namespace tokenizer_internal {
struct TokenizerData;
}

class Detokenizer;

class Tokenizer {
 public:
  // Reads and checks PATH (a tokenizer.json). NotFound when it does not
  // exist; InvalidArgument naming the file, the field and the value for
  // malformed JSON, a missing or mistyped field, a type this tokenizer does
  // not implement, a merge naming a token missing from the vocab, ids that
  // collide, are negative or past 2^24, an added token whose id is not the
  // one `tokenizers` would give it (it renumbers added tokens: its vocab id,
  // else the next after the vocab's count; real files agree).
  static Result<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // The same from the text; `name` is what messages call it.
  static Result<std::unique_ptr<Tokenizer>> Parse(std::string_view json, std::string_view name);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text`, as `tokenizers`' encode(text, add_special_tokens)
  // gives them. parse_special: whether special added tokens written in the
  // text ("<|eot_id|>") become their ids; when false they are encoded as
  // plain text and the BPE model makes no special id from them (where
  // `tokenizers` would let them), so a request's text cannot inject control
  // tokens; only an unk_token marked special can still stand for characters
  // the vocab cannot spell (never with byte_fallback). Added tokens that are
  // not special are matched either way.
  //
  // Any bytes are accepted: text that is not valid UTF-8 is first made
  // valid by replacing each maximal ill-formed subsequence with U+FFFD (as
  // Python's bytes.decode(errors="replace") does), then encoded. Errors
  // only from the regex engine (a match limit on pathological input:
  // ResourceExhausted) or from the normaliser.
  Result<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens,
                                      bool parse_special) const;

  // The first special added token that Encode(text, ..., parse_special =
  // true) would make of `text` (its content, "<|eot_id|>"); nullopt when
  // there is none: then the text encodes the same either way. For text a
  // request brings into a prompt that is otherwise encoded with its special
  // tokens parsed (a chat template's output).
  Result<std::optional<std::string>> FirstSpecialToken(std::string_view text) const;

  // The text of `ids`, as `tokenizers`' decode(ids, skip_special_tokens)
  // gives it (bytes that are not valid UTF-8 become U+FFFD as `tokenizers`
  // does). InvalidArgument naming the first id that is negative, at least
  // vocab_size() or a hole in the vocabulary.
  Result<std::string> Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // One more than the largest id of the vocab and the added tokens: every
  // id the tokenizer can produce or decode is below it.
  int32_t vocab_size() const;
  // The id of a token given as its vocab string ("<|eot_id|>", "Ġthe"):
  // added tokens first, then the model's vocab.
  std::optional<int32_t> TokenId(std::string_view token) const;
  // The vocab string of an id (not decoded); nullopt for an unknown id.
  std::optional<std::string_view> TokenText(int32_t id) const;
  // Whether `id` is an added token marked special (false for unknown ids).
  bool IsSpecial(int32_t id) const;

  // A detokenizer for one stream of generated ids.
  Detokenizer NewDetokenizer(bool skip_special_tokens) const;

 private:
  friend class Detokenizer;
  explicit Tokenizer(std::unique_ptr<tokenizer_internal::TokenizerData> data);
  std::unique_ptr<tokenizer_internal::TokenizerData> data_;
};

// Turns a stream of ids into text one id at a time. Push returns the text
// that is final once the id is added: never part of a UTF-8 character;
// bytes of byte-fallback tokens (<0xE4><0xBD><0xA0>) are held until the
// token after them shows that their group is complete, since `tokenizers`
// decodes each run of such bytes as one; the decoder's strip of a leading
// space applies at the stream's start only. Flush returns what is still held
// (an incomplete character as U+FFFD, as Decode would give it). For every
// prefix of a stream, the concatenation of what Push returned and Flush
// equals Tokenizer::Decode of that prefix.
//
// Thread-safety: one thread; the Tokenizer must outlive it.
class Detokenizer {
 public:
  Detokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);

  // The new final text after `id`. InvalidArgument for an id Decode would
  // refuse (the stream is unchanged then).
  Result<std::string> Push(int32_t id);
  // What is held, as final text; the stream then starts over (its next
  // Push is at the start again).
  std::string Flush();

 private:
  std::string Emit(std::string text);

  const tokenizer_internal::TokenizerData* data_;
  bool skip_special_;
  bool first_token_ = true;  // no token has reached the decoder yet
  size_t strip_left_ = 0;    // leading strip characters still to remove
  std::string pending_;      // bytes not yet final
};

}  // namespace hearth::llm
