// backend: llm tokenizer — reading tokenizer.json (simdjson's DOM) into
// TokenizerData, checking every field that changes what Encode or Decode
// gives and refusing, by name, what is not implemented.
#include <simdjson.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/llm/tokenizer_internal.h"

namespace hearth::llm::tokenizer_internal {
namespace {

namespace dom = simdjson::dom;

// Ids past this are refused: a table is sized by the largest id.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// A string for a message: quoted, control bytes escaped, cut at 60 bytes
// (on a character boundary).
std::string Quote(std::string_view s) {
  std::string out = "\"";
  size_t n = std::min<size_t>(s.size(), 60);
  while (n < s.size() && n > 0 && (static_cast<uint8_t>(s[n]) & 0xC0) == 0x80) --n;
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<uint8_t>(s[i]);
    if (c < 0x20 || c == '"' || c == '\\' || c == 0x7F) {
      char buffer[8];
      std::snprintf(buffer, sizeof(buffer), "\\x%02X", c);
      out += buffer;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  if (n < s.size()) out += "...";
  return out + "\"";
}

const char* TypeName(dom::element_type type) {
  switch (type) {
    case dom::element_type::ARRAY:
      return "an array";
    case dom::element_type::OBJECT:
      return "an object";
    case dom::element_type::INT64:
    case dom::element_type::UINT64:
      return "an integer";
    case dom::element_type::DOUBLE:
      return "a number";
    case dom::element_type::STRING:
      return "a string";
    case dom::element_type::BOOL:
      return "a boolean";
    case dom::element_type::NULL_VALUE:
      return "null";
  }
  return "a value";
}

// Reads typed values at JSON paths, with messages naming the file and path.
class Reader {
 public:
  explicit Reader(std::string_view name) : name_(name) {}

  Status Error(std::string_view path, std::string_view what) const {
    return InvalidArgument(name_ + ": " + std::string(path) + ": " + std::string(what));
  }
  Status Unsupported(std::string_view path, std::string_view type,
                     std::string_view supported) const {
    return Error(path, "type " + Quote(type) +
                           " is not supported (supported: " + std::string(supported) + ")");
  }

  // The field, or nullopt when absent or null.
  static std::optional<dom::element> Optional(dom::object object, std::string_view key) {
    dom::element value;
    if (object.at_key(key).get(value) != simdjson::SUCCESS || value.is_null()) {
      return std::nullopt;
    }
    return value;
  }
  Result<dom::element> Required(dom::object object, std::string_view path,
                                std::string_view key) const {
    std::optional<dom::element> value = Optional(object, key);
    if (!value) return Error(Join(path, key), "missing");
    return *value;
  }

  Result<dom::object> Object(dom::element value, std::string_view path) const {
    dom::object object;
    if (value.get(object) != simdjson::SUCCESS) return Mistyped(value, path, "an object");
    return object;
  }
  Result<dom::array> Array(dom::element value, std::string_view path) const {
    dom::array array;
    if (value.get(array) != simdjson::SUCCESS) return Mistyped(value, path, "an array");
    return array;
  }
  Result<std::string_view> String(dom::element value, std::string_view path) const {
    std::string_view s;
    if (value.get(s) != simdjson::SUCCESS) return Mistyped(value, path, "a string");
    return s;
  }
  Result<bool> Bool(dom::element value, std::string_view path) const {
    bool b = false;
    if (value.get(b) != simdjson::SUCCESS) return Mistyped(value, path, "a boolean");
    return b;
  }
  Result<int64_t> Int(dom::element value, std::string_view path) const {
    int64_t i = 0;
    if (value.get(i) != simdjson::SUCCESS) return Mistyped(value, path, "an integer");
    return i;
  }

  // Optional typed fields with a default.
  Result<bool> BoolOr(dom::object object, std::string_view path, std::string_view key,
                      bool fallback) const {
    std::optional<dom::element> value = Optional(object, key);
    return value ? Bool(*value, Join(path, key)) : Result<bool>(fallback);
  }
  Result<std::string_view> StringField(dom::object object, std::string_view path,
                                       std::string_view key) const {
    ASSIGN_OR_RETURN(dom::element value, Required(object, path, key));
    return String(value, Join(path, key));
  }
  // A field holding one character (Metaspace's replacement, Strip's content).
  Result<std::string> CharField(dom::object object, std::string_view path,
                                std::string_view key) const {
    ASSIGN_OR_RETURN(std::string_view s, StringField(object, path, key));
    size_t i = 0;
    if (!s.empty()) NextCodePoint(s, &i);
    if (s.empty() || i != s.size()) {
      return Error(Join(path, key), Quote(s) + " is not one character");
    }
    return std::string(s);
  }

  static std::string Join(std::string_view path, std::string_view key) {
    return path.empty() ? std::string(key) : std::string(path) + "." + std::string(key);
  }
  static std::string Index(std::string_view path, size_t i) {
    return std::string(path) + "[" + std::to_string(i) + "]";
  }

 private:
  Status Mistyped(dom::element value, std::string_view path, std::string_view expected) const {
    return Error(path, "expected " + std::string(expected) + ", found " + TypeName(value.type()));
  }
  std::string name_;
};

// ---------------------------------------------------------------- model

struct VocabEntry {
  std::string_view token;
  int32_t id;
};

Status ReadVocab(const Reader& r, dom::object model, std::vector<VocabEntry>* entries) {
  ASSIGN_OR_RETURN(dom::element vocab_value, r.Required(model, "model", "vocab"));
  ASSIGN_OR_RETURN(dom::object vocab, r.Object(vocab_value, "model.vocab"));
  entries->reserve(vocab.size());
  for (dom::key_value_pair field : vocab) {
    int64_t id = 0;
    if (field.value.get(id) != simdjson::SUCCESS || id < 0 || id > kMaxTokenId) {
      return r.Error("model.vocab[" + Quote(field.key) + "]",
                     "expected an id in [0, " + std::to_string(kMaxTokenId) + "], found " +
                         (field.value.is_int64() ? std::to_string(id)
                                                 : std::string(TypeName(field.value.type()))));
    }
    entries->push_back(VocabEntry{field.key, static_cast<int32_t>(id)});
  }
  return Status::Ok();
}

// "a b" (merges.txt's form) or ["a", "b"]; model.merges[index] in messages,
// built only for one.
Status ReadMerge(const Reader& r, dom::element merge, size_t index, std::string_view* left,
                 std::string_view* right, bool* skip) {
  *skip = false;
  dom::array pair;
  if (merge.get(pair) == simdjson::SUCCESS) {
    if (pair.size() == 2 && pair.at(0).get(*left) == simdjson::SUCCESS &&
        pair.at(1).get(*right) == simdjson::SUCCESS) {
      return Status::Ok();
    }
    const std::string path = Reader::Index("model.merges", index);
    if (pair.size() != 2) {
      return r.Error(path, "expected two tokens, found " + std::to_string(pair.size()));
    }
    RETURN_IF_ERROR(r.String(pair.at(0).value_unsafe(), path + "[0]").status());
    return r.String(pair.at(1).value_unsafe(), path + "[1]").status();
  }
  ASSIGN_OR_RETURN(std::string_view line, r.String(merge, Reader::Index("model.merges", index)));
  if (line.starts_with("#version")) {
    *skip = true;
    return Status::Ok();
  }
  const size_t space = line.find(' ');
  if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
    return r.Error(Reader::Index("model.merges", index),
                   Quote(line) + " is not two tokens separated by one space");
  }
  *left = line.substr(0, space);
  *right = line.substr(space + 1);
  return Status::Ok();
}

Status ReadMerges(const Reader& r, dom::object model, TokenizerData* data) {
  ASSIGN_OR_RETURN(dom::element merges_value, r.Required(model, "model", "merges"));
  ASSIGN_OR_RETURN(dom::array merges, r.Array(merges_value, "model.merges"));
  BpeModel& bpe = data->model;
  // Three passes, so that the lookups of each can be prefetched ahead.
  struct Merge {
    std::string_view left;
    std::string_view right;
    uint32_t left_hash;
    uint32_t right_hash;
    uint32_t merged_hash;
    int32_t left_id;
    int32_t right_id;
    int32_t merged_id;
    size_t index;  // in model.merges, for messages
  };
  std::vector<Merge> list;
  list.reserve(merges.size());
  size_t index = 0;
  for (dom::element element : merges) {
    Merge m{};
    bool skip = false;
    RETURN_IF_ERROR(ReadMerge(r, element, index, &m.left, &m.right, &skip));
    m.index = index++;
    if (skip) continue;
    m.left_hash = StringIdMap::Hash(m.left);
    m.right_hash = StringIdMap::Hash(m.right);
    m.merged_hash = StringIdMap::Hash(m.right, m.left_hash);
    list.push_back(m);
  }
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < list.size(); ++i) {
    if (i + kAhead < list.size()) {
      const Merge& next = list[i + kAhead];
      bpe.vocab.Prefetch(next.left_hash);
      bpe.vocab.Prefetch(next.right_hash);
      bpe.vocab.Prefetch(next.merged_hash);
    }
    Merge& m = list[i];
    m.left_id = bpe.vocab.Find(m.left, {}, m.left_hash);
    m.right_id = bpe.vocab.Find(m.right, {}, m.right_hash);
    m.merged_id = bpe.vocab.Find(m.left, m.right, m.merged_hash);
    if (m.left_id < 0 || m.right_id < 0 || m.merged_id < 0) {
      const std::string token = m.left_id < 0    ? std::string(m.left)
                                : m.right_id < 0 ? std::string(m.right)
                                                 : std::string(m.left) + std::string(m.right);
      return r.Error(Reader::Index("model.merges", m.index),
                     "token " + Quote(token) + " is not in model.vocab");
    }
  }
  bpe.merges.Reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    if (i + kAhead < list.size())
      bpe.merges.Prefetch(list[i + kAhead].left_id, list[i + kAhead].right_id);
    bpe.merges.Insert(list[i].left_id, list[i].right_id,
                      MergeMap::Value{static_cast<int32_t>(i), list[i].merged_id});
  }
  return Status::Ok();
}

Status ReadModel(const Reader& r, dom::object root, TokenizerData* data) {
  ASSIGN_OR_RETURN(dom::element model_value, r.Required(root, "", "model"));
  ASSIGN_OR_RETURN(dom::object model, r.Object(model_value, "model"));
  ASSIGN_OR_RETURN(std::string_view type, r.StringField(model, "model", "type"));
  if (type != "BPE") return r.Unsupported("model.type", type, "BPE");

  if (std::optional<dom::element> dropout = Reader::Optional(model, "dropout")) {
    double p = 0;
    if (dropout->get(p) != simdjson::SUCCESS || p != 0.0) {
      return r.Error("model.dropout", "BPE dropout is not supported (null or 0 only)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (std::optional<dom::element> value = Reader::Optional(model, key)) {
      ASSIGN_OR_RETURN(std::string_view s, r.String(*value, Reader::Join("model", key)));
      if (!s.empty()) {
        return r.Error(Reader::Join("model", key),
                       Quote(s) + " is not supported (null only: Llama-family BPE has none)");
      }
    }
  }
  BpeModel& bpe = data->model;
  ASSIGN_OR_RETURN(bpe.fuse_unk, r.BoolOr(model, "model", "fuse_unk", false));
  ASSIGN_OR_RETURN(bpe.byte_fallback, r.BoolOr(model, "model", "byte_fallback", false));
  ASSIGN_OR_RETURN(bpe.ignore_merges, r.BoolOr(model, "model", "ignore_merges", false));

  std::vector<VocabEntry> entries;
  RETURN_IF_ERROR(ReadVocab(r, model, &entries));
  int32_t max_id = -1;
  for (const VocabEntry& e : entries) max_id = std::max(max_id, e.id);
  data->tokens.assign(static_cast<size_t>(max_id) + 1, std::string());
  data->kinds.assign(data->tokens.size(), kNoToken);
  bpe.vocab.Reset(&data->tokens, entries.size());
  for (const VocabEntry& e : entries) {
    if (data->kinds[e.id] != kNoToken) {
      return r.Error(
          "model.vocab[" + Quote(e.token) + "]",
          "id " + std::to_string(e.id) + " is also the id of " + Quote(data->tokens[e.id]));
    }
    data->tokens[e.id].assign(e.token);
    data->kinds[e.id] = kModelToken;
    if (bpe.vocab.Insert(e.id) >= 0) {
      return r.Error("model.vocab", Quote(e.token) + " appears twice");
    }
  }

  if (std::optional<dom::element> unk = Reader::Optional(model, "unk_token")) {
    ASSIGN_OR_RETURN(std::string_view unk_token, r.String(*unk, "model.unk_token"));
    bpe.unk_id = bpe.vocab.Find(unk_token);
    if (bpe.unk_id < 0) {
      return r.Error("model.unk_token", Quote(unk_token) + " is not in model.vocab");
    }
  }
  RETURN_IF_ERROR(ReadMerges(r, model, data));
  return Status::Ok();
}

// ---------------------------------------------------------------- added tokens

Status ReadAddedTokens(const Reader& r, dom::object root, TokenizerData* data) {
  std::optional<dom::element> value = Reader::Optional(root, "added_tokens");
  if (!value) return Status::Ok();
  ASSIGN_OR_RETURN(dom::array array, r.Array(*value, "added_tokens"));
  // `tokenizers` does not take the ids written here: a token in the vocab
  // has its vocab id, the others the next ids after the vocab's count, in
  // order (it warns when they differ). A file whose ids are not those is
  // refused rather than read two ways.
  int64_t next_id = static_cast<int64_t>(data->model.vocab.size());
  std::unordered_map<std::string, int32_t> seen;
  size_t i = 0;
  for (dom::element element : array) {
    const std::string path = Reader::Index("added_tokens", i++);
    ASSIGN_OR_RETURN(dom::object object, r.Object(element, path));
    AddedToken token;
    ASSIGN_OR_RETURN(dom::element id_value, r.Required(object, path, "id"));
    ASSIGN_OR_RETURN(int64_t id, r.Int(id_value, path + ".id"));
    if (id < 0 || id > kMaxTokenId) {
      return r.Error(path + ".id",
                     std::to_string(id) + " is not in [0, " + std::to_string(kMaxTokenId) + "]");
    }
    token.id = static_cast<int32_t>(id);
    ASSIGN_OR_RETURN(std::string_view content, r.StringField(object, path, "content"));
    token.content.assign(content);
    ASSIGN_OR_RETURN(token.special, r.BoolOr(object, path, "special", false));
    ASSIGN_OR_RETURN(token.single_word, r.BoolOr(object, path, "single_word", false));
    ASSIGN_OR_RETURN(token.lstrip, r.BoolOr(object, path, "lstrip", false));
    ASSIGN_OR_RETURN(token.rstrip, r.BoolOr(object, path, "rstrip", false));
    ASSIGN_OR_RETURN(token.normalized, r.BoolOr(object, path, "normalized", !token.special));
    // `tokenizers` ignores an added token with empty content.
    if (token.content.empty()) continue;

    const int32_t vocab_id = data->model.vocab.Find(token.content);
    if (vocab_id >= 0 && vocab_id != token.id) {
      return r.Error(path, Quote(token.content) + " has id " + std::to_string(token.id) +
                               " but model.vocab gives it " + std::to_string(vocab_id));
    }
    if (const auto [it, fresh] = seen.emplace(token.content, token.id); !fresh) {
      return r.Error(path, Quote(token.content) + " is already the added token with id " +
                               std::to_string(it->second));
    }
    if (vocab_id < 0 && token.id != next_id) {
      return r.Error(path, Quote(token.content) + " has id " + std::to_string(token.id) +
                               " but `tokenizers` gives it " + std::to_string(next_id) +
                               " (the next after the vocab's " +
                               std::to_string(data->model.vocab.size()) +
                               " tokens and the added ones before it)");
    }
    if (vocab_id < 0) ++next_id;
    if (static_cast<size_t>(token.id) >= data->tokens.size()) {
      data->tokens.resize(static_cast<size_t>(token.id) + 1);
      data->kinds.resize(data->tokens.size(), kNoToken);
    }
    if (vocab_id < 0 && data->kinds[token.id] != kNoToken) {
      return r.Error(path, "id " + std::to_string(token.id) + " of " + Quote(token.content) +
                               " is already " + Quote(data->tokens[token.id]));
    }
    data->tokens[token.id] = token.content;
    data->kinds[token.id] = static_cast<uint8_t>(data->kinds[token.id] | kAddedToken);
    data->added.push_back(std::move(token));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- normalizer

Status ReadNormalizer(const Reader& r, dom::element value, const std::string& path,
                      std::vector<NormalizerStep>* steps) {
  ASSIGN_OR_RETURN(dom::object object, r.Object(value, path));
  ASSIGN_OR_RETURN(std::string_view type, r.StringField(object, path, "type"));
  NormalizerStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(dom::element list_value, r.Required(object, path, "normalizers"));
    ASSIGN_OR_RETURN(dom::array list, r.Array(list_value, path + ".normalizers"));
    size_t i = 0;
    for (dom::element item : list) {
      RETURN_IF_ERROR(ReadNormalizer(r, item, Reader::Index(path + ".normalizers", i++), steps));
    }
    return Status::Ok();
  }
  if (type == "NFC") {
    step.kind = NormalizerStep::Kind::kNfc;
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::kPrepend;
    ASSIGN_OR_RETURN(std::string_view prepend, r.StringField(object, path, "prepend"));
    step.content.assign(prepend);
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::kReplace;
    ASSIGN_OR_RETURN(dom::element pattern_value, r.Required(object, path, "pattern"));
    ASSIGN_OR_RETURN(dom::object pattern, r.Object(pattern_value, path + ".pattern"));
    if (Reader::Optional(pattern, "String") == std::nullopt) {
      return r.Error(path + ".pattern", "only a String pattern is supported (not Regex)");
    }
    ASSIGN_OR_RETURN(std::string_view literal, r.StringField(pattern, path + ".pattern", "String"));
    if (literal.empty()) return r.Error(path + ".pattern.String", "is empty");
    step.pattern.assign(literal);
    ASSIGN_OR_RETURN(std::string_view content, r.StringField(object, path, "content"));
    step.content.assign(content);
  } else {
    return r.Unsupported(path + ".type", type, "NFC, Prepend, Replace, Sequence");
  }
  steps->push_back(std::move(step));
  return Status::Ok();
}

// ---------------------------------------------------------------- pre-tokenizer

Result<PrependScheme> ReadPrependScheme(const Reader& r, dom::object object,
                                        const std::string& path) {
  PrependScheme scheme = PrependScheme::kAlways;
  bool scheme_given = false;
  if (std::optional<dom::element> value = Reader::Optional(object, "prepend_scheme")) {
    ASSIGN_OR_RETURN(std::string_view s, r.String(*value, path + ".prepend_scheme"));
    scheme_given = true;
    if (s == "first") {
      scheme = PrependScheme::kFirst;
    } else if (s == "always") {
      scheme = PrependScheme::kAlways;
    } else if (s == "never") {
      scheme = PrependScheme::kNever;
    } else {
      return r.Error(path + ".prepend_scheme", Quote(s) + " is not first, always or never");
    }
  }
  // tokenizers < 0.14 wrote add_prefix_space instead.
  if (std::optional<dom::element> value = Reader::Optional(object, "add_prefix_space")) {
    ASSIGN_OR_RETURN(bool add, r.Bool(*value, path + ".add_prefix_space"));
    if (!add) {
      if (scheme_given && scheme != PrependScheme::kNever) {
        return r.Error(path, "add_prefix_space false contradicts prepend_scheme");
      }
      scheme = PrependScheme::kNever;
    }
  }
  return scheme;
}

Status ReadPreTokenizer(const Reader& r, dom::element value, const std::string& path,
                        std::vector<PreTokenizerStep>* steps) {
  ASSIGN_OR_RETURN(dom::object object, r.Object(value, path));
  ASSIGN_OR_RETURN(std::string_view type, r.StringField(object, path, "type"));
  PreTokenizerStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(dom::element list_value, r.Required(object, path, "pretokenizers"));
    ASSIGN_OR_RETURN(dom::array list, r.Array(list_value, path + ".pretokenizers"));
    size_t i = 0;
    for (dom::element item : list) {
      RETURN_IF_ERROR(
          ReadPreTokenizer(r, item, Reader::Index(path + ".pretokenizers", i++), steps));
    }
    return Status::Ok();
  }
  if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    ASSIGN_OR_RETURN(dom::element pattern_value, r.Required(object, path, "pattern"));
    ASSIGN_OR_RETURN(dom::object pattern, r.Object(pattern_value, path + ".pattern"));
    if (std::optional<dom::element> regex = Reader::Optional(pattern, "Regex")) {
      ASSIGN_OR_RETURN(std::string_view source, r.String(*regex, path + ".pattern.Regex"));
      auto compiled = Regex::Compile(source);
      if (!compiled.ok()) return r.Error(path + ".pattern.Regex", compiled.status().message());
      step.regex = std::shared_ptr<const Regex>(std::move(compiled).value());
    } else {
      ASSIGN_OR_RETURN(std::string_view literal,
                       r.StringField(pattern, path + ".pattern", "String"));
      if (literal.empty()) return r.Error(path + ".pattern.String", "is empty");
      step.literal.assign(literal);
    }
    ASSIGN_OR_RETURN(std::string_view behavior, r.StringField(object, path, "behavior"));
    if (behavior != "Isolated") {
      return r.Error(path + ".behavior", Quote(behavior) + " is not supported (Isolated only)");
    }
    ASSIGN_OR_RETURN(bool invert, r.BoolOr(object, path, "invert", false));
    if (invert) return r.Error(path + ".invert", "true is not supported");
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    ASSIGN_OR_RETURN(dom::element add_value, r.Required(object, path, "add_prefix_space"));
    ASSIGN_OR_RETURN(step.add_prefix_space, r.Bool(add_value, path + ".add_prefix_space"));
    ASSIGN_OR_RETURN(step.use_regex, r.BoolOr(object, path, "use_regex", true));
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, r.CharField(object, path, "replacement"));
    ASSIGN_OR_RETURN(step.prepend_scheme, ReadPrependScheme(r, object, path));
    ASSIGN_OR_RETURN(step.split, r.BoolOr(object, path, "split", true));
  } else {
    return r.Unsupported(path + ".type", type, "Split, ByteLevel, Metaspace, Sequence");
  }
  steps->push_back(std::move(step));
  return Status::Ok();
}

// ---------------------------------------------------------------- post-processor

Status ReadTemplate(const Reader& r, dom::object object, const std::string& path,
                    TokenizerData* data) {
  ASSIGN_OR_RETURN(dom::element single_value, r.Required(object, path, "single"));
  ASSIGN_OR_RETURN(dom::array single, r.Array(single_value, path + ".single"));
  // Absent: no piece may name a special token (a default dom::object has no
  // document to look a key up in).
  std::optional<dom::object> specials;
  if (std::optional<dom::element> value = Reader::Optional(object, "special_tokens")) {
    ASSIGN_OR_RETURN(specials, r.Object(*value, path + ".special_tokens"));
  }
  std::vector<int32_t> before;
  std::vector<int32_t> after;
  bool seen_sequence = false;
  size_t i = 0;
  for (dom::element piece_value : single) {
    const std::string piece_path = Reader::Index(path + ".single", i++);
    ASSIGN_OR_RETURN(dom::object piece, r.Object(piece_value, piece_path));
    if (std::optional<dom::element> seq_value = Reader::Optional(piece, "Sequence")) {
      ASSIGN_OR_RETURN(dom::object seq, r.Object(*seq_value, piece_path + ".Sequence"));
      ASSIGN_OR_RETURN(std::string_view id, r.StringField(seq, piece_path + ".Sequence", "id"));
      if (id != "A" || seen_sequence) {
        return r.Error(piece_path, "a single template holds sequence A once");
      }
      seen_sequence = true;
      continue;
    }
    ASSIGN_OR_RETURN(dom::element special_value, r.Required(piece, piece_path, "SpecialToken"));
    ASSIGN_OR_RETURN(dom::object special, r.Object(special_value, piece_path + ".SpecialToken"));
    ASSIGN_OR_RETURN(std::string_view name,
                     r.StringField(special, piece_path + ".SpecialToken", "id"));
    const std::string entry_path = path + ".special_tokens[" + Quote(name) + "]";
    dom::element entry_value;
    if (!specials || specials->at_key(name).get(entry_value) != simdjson::SUCCESS) {
      return r.Error(piece_path, Quote(name) + " is not in " + path + ".special_tokens");
    }
    ASSIGN_OR_RETURN(dom::object entry, r.Object(entry_value, entry_path));
    ASSIGN_OR_RETURN(dom::element ids_value, r.Required(entry, entry_path, "ids"));
    ASSIGN_OR_RETURN(dom::array ids, r.Array(ids_value, entry_path + ".ids"));
    size_t k = 0;
    for (dom::element id_value : ids) {
      const std::string id_path = Reader::Index(entry_path + ".ids", k++);
      ASSIGN_OR_RETURN(int64_t id, r.Int(id_value, id_path));
      if (id < 0 || static_cast<size_t>(id) >= data->tokens.size() || data->kinds[id] == kNoToken) {
        return r.Error(id_path, std::to_string(id) + " is not a token id");
      }
      (seen_sequence ? after : before).push_back(static_cast<int32_t>(id));
    }
  }
  if (!seen_sequence) return r.Error(path + ".single", "has no sequence $A");
  // Nested in order: this template wraps what earlier processors gave.
  data->template_prefix.insert(data->template_prefix.begin(), before.begin(), before.end());
  data->template_suffix.insert(data->template_suffix.end(), after.begin(), after.end());
  return Status::Ok();
}

Status ReadPostProcessor(const Reader& r, dom::element value, const std::string& path,
                         TokenizerData* data) {
  ASSIGN_OR_RETURN(dom::object object, r.Object(value, path));
  ASSIGN_OR_RETURN(std::string_view type, r.StringField(object, path, "type"));
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(dom::element list_value, r.Required(object, path, "processors"));
    ASSIGN_OR_RETURN(dom::array list, r.Array(list_value, path + ".processors"));
    size_t i = 0;
    for (dom::element item : list) {
      RETURN_IF_ERROR(ReadPostProcessor(r, item, Reader::Index(path + ".processors", i++), data));
    }
    return Status::Ok();
  }
  if (type == "ByteLevel") return Status::Ok();  // offsets only
  if (type == "TemplateProcessing") return ReadTemplate(r, object, path, data);
  return r.Unsupported(path + ".type", type, "TemplateProcessing, ByteLevel, Sequence");
}

// ---------------------------------------------------------------- decoder

Status ReadDecoder(const Reader& r, dom::element value, const std::string& path,
                   std::vector<DecoderStep>* steps) {
  ASSIGN_OR_RETURN(dom::object object, r.Object(value, path));
  ASSIGN_OR_RETURN(std::string_view type, r.StringField(object, path, "type"));
  DecoderStep step;
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(dom::element list_value, r.Required(object, path, "decoders"));
    ASSIGN_OR_RETURN(dom::array list, r.Array(list_value, path + ".decoders"));
    size_t i = 0;
    for (dom::element item : list) {
      RETURN_IF_ERROR(ReadDecoder(r, item, Reader::Index(path + ".decoders", i++), steps));
    }
    return Status::Ok();
  }
  if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::kByteLevel;
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::kFuse;
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    ASSIGN_OR_RETURN(dom::element pattern_value, r.Required(object, path, "pattern"));
    ASSIGN_OR_RETURN(dom::object pattern, r.Object(pattern_value, path + ".pattern"));
    if (Reader::Optional(pattern, "String") == std::nullopt) {
      return r.Error(path + ".pattern", "only a String pattern is supported (not Regex)");
    }
    ASSIGN_OR_RETURN(std::string_view literal, r.StringField(pattern, path + ".pattern", "String"));
    if (literal.empty()) return r.Error(path + ".pattern.String", "is empty");
    step.pattern.assign(literal);
    ASSIGN_OR_RETURN(std::string_view content, r.StringField(object, path, "content"));
    step.content.assign(content);
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    ASSIGN_OR_RETURN(step.content, r.CharField(object, path, "content"));
    ASSIGN_OR_RETURN(dom::element start_value, r.Required(object, path, "start"));
    ASSIGN_OR_RETURN(int64_t start, r.Int(start_value, path + ".start"));
    ASSIGN_OR_RETURN(dom::element stop_value, r.Required(object, path, "stop"));
    ASSIGN_OR_RETURN(int64_t stop, r.Int(stop_value, path + ".stop"));
    if (start < 0 || start > 1024) return r.Error(path + ".start", "is not in [0, 1024]");
    if (stop != 0) return r.Error(path + ".stop", "only 0 is supported");
    step.start = static_cast<size_t>(start);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    ASSIGN_OR_RETURN(step.replacement, r.CharField(object, path, "replacement"));
    ASSIGN_OR_RETURN(PrependScheme scheme, ReadPrependScheme(r, object, path));
    step.strip_first = scheme != PrependScheme::kNever;
  } else {
    return r.Unsupported(path + ".type", type,
                         "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence");
  }
  steps->push_back(std::move(step));
  return Status::Ok();
}

// ---------------------------------------------------------------- assembly

Status Finish(const Reader& r, TokenizerData* data) {
  const size_t vocab_size = data->tokens.size();
  BpeModel& bpe = data->model;
  bpe.special.assign(vocab_size, 0);
  data->added_by_id.assign(vocab_size, -1);
  for (size_t i = 0; i < data->added.size(); ++i) {
    AddedToken& token = data->added[i];
    if (data->added_by_id[token.id] >= 0) {
      return r.Error(Reader::Index("added_tokens", i),
                     "id " + std::to_string(token.id) + " appears twice");
    }
    data->added_by_id[token.id] = static_cast<int32_t>(i);
    bpe.special[token.id] = token.special ? 1 : 0;
    token.pattern = token.content;
    if (token.normalized) RETURN_IF_ERROR(Normalize(data->normalizer, &token.pattern));
    if (token.pattern.empty()) token.pattern = token.content;
  }
  data->raw_matcher.Build(data->added, /*normalized=*/false);
  data->normalized_matcher.Build(data->added, /*normalized=*/true);

  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    bpe.byte_ids[b] = bpe.vocab.Find(name);
  }
  bpe.bmp_char_ids.assign(0x10000, -1);
  for (size_t id = 0; id < vocab_size; ++id) {
    if ((data->kinds[id] & kModelToken) == 0 || data->tokens[id].empty()) continue;
    const std::string& token = data->tokens[id];
    size_t i = 0;
    const uint32_t cp = NextCodePoint(token, &i);
    if (i == token.size() && cp < 0x10000) bpe.bmp_char_ids[cp] = static_cast<int32_t>(id);
  }
  return Status::Ok();
}

}  // namespace

Status ParseTokenizerJson(std::string_view json, TokenizerData* data) {
  const Reader r(data->name);
  dom::parser parser;
  dom::element root_value;
  if (const simdjson::error_code error = parser.parse(json.data(), json.size()).get(root_value);
      error != simdjson::SUCCESS) {
    return InvalidArgument(data->name + ": malformed JSON: " + simdjson::error_message(error));
  }
  ASSIGN_OR_RETURN(dom::object root, r.Object(root_value, "(document)"));
  if (std::optional<dom::element> version = Reader::Optional(root, "version")) {
    ASSIGN_OR_RETURN(std::string_view v, r.String(*version, "version"));
    if (v != "1.0") return r.Error("version", Quote(v) + " is not supported (1.0 only)");
  }
  RETURN_IF_ERROR(ReadModel(r, root, data));
  RETURN_IF_ERROR(ReadAddedTokens(r, root, data));
  if (std::optional<dom::element> value = Reader::Optional(root, "normalizer")) {
    RETURN_IF_ERROR(ReadNormalizer(r, *value, "normalizer", &data->normalizer));
  }
  if (std::optional<dom::element> value = Reader::Optional(root, "pre_tokenizer")) {
    RETURN_IF_ERROR(ReadPreTokenizer(r, *value, "pre_tokenizer", &data->pre_tokenizer));
  }
  if (std::optional<dom::element> value = Reader::Optional(root, "post_processor")) {
    RETURN_IF_ERROR(ReadPostProcessor(r, *value, "post_processor", data));
  }
  std::optional<dom::element> decoder = Reader::Optional(root, "decoder");
  if (!decoder) {
    return r.Error("decoder",
                   "missing or null (decoding without a decoder, which joins tokens "
                   "with spaces, is not supported)");
  }
  RETURN_IF_ERROR(ReadDecoder(r, *decoder, "decoder", &data->decoder));
  auto stream = MakeStreamDecoder(data->decoder, "decoder");
  if (!stream.ok()) return InvalidArgument(data->name + ": " + stream.status().message());
  data->stream_decoder = std::move(stream).value();
  return Finish(r, data);
}

}  // namespace hearth::llm::tokenizer_internal
