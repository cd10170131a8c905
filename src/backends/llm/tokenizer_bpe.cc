// backend: llm tokenizer — the BPE model: `tokenizers`' merge_word and
// merge_all (models/bpe/{model,word}.rs), over open-addressing tables built
// once at load.
#include <algorithm>
#include <string>

#include "backends/llm/tokenizer_internal.h"

namespace hearth::llm::tokenizer_internal {
namespace {

uint64_t MixPair(uint64_t key) {
  key ^= key >> 33;
  key *= 0xFF51AFD7ED558CCDull;
  key ^= key >> 33;
  key *= 0xC4CEB9FE1A85EC53ull;
  key ^= key >> 33;
  return key;
}

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Open addressing at a load of at most 3/4.
size_t CapacityFor(size_t n) {
  size_t capacity = 16;
  while (capacity * 3 < n * 4) capacity *= 2;
  return capacity;
}

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  uint32_t len;  // bytes of the piece it covers; 0 once merged into its left neighbour
};

struct QueuedMerge {
  int32_t rank;
  int32_t pos;
  int32_t merged;
};

// std::push_heap keeps the largest on top: "larger" is the lower rank, then
// the leftmost position.
bool QueueAfter(const QueuedMerge& a, const QueuedMerge& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
}

}  // namespace

// ---------------------------------------------------------------- StringIdMap

void StringIdMap::Reset(const std::vector<std::string>* tokens, size_t expected) {
  tokens_ = tokens;
  slots_.assign(CapacityFor(expected), Slot{});
  size_ = 0;
}

void StringIdMap::Grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.empty() ? 16 : old.size() * 2, Slot{});
  const size_t mask = slots_.size() - 1;
  for (const Slot& slot : old) {
    if (slot.id < 0) continue;
    size_t i = Spread(slot.hash) & mask;
    while (slots_[i].id >= 0) i = (i + 1) & mask;
    slots_[i] = slot;
  }
}

int32_t StringIdMap::Insert(int32_t id) {
  if (4 * (size_ + 1) > 3 * slots_.size()) Grow();
  const std::string& s = (*tokens_)[id];
  const uint32_t hash = Hash(s);
  const size_t mask = slots_.size() - 1;
  size_t i = Spread(hash) & mask;
  for (; slots_[i].id >= 0; i = (i + 1) & mask) {
    if (slots_[i].hash == hash && (*tokens_)[slots_[i].id] == s) return slots_[i].id;
  }
  slots_[i] = Slot{hash, id};
  ++size_;
  return -1;
}

int32_t StringIdMap::Find(std::string_view first, std::string_view second, uint32_t hash) const {
  if (slots_.empty()) return -1;
  const size_t mask = slots_.size() - 1;
  const size_t size = first.size() + second.size();
  for (size_t i = Spread(hash) & mask; slots_[i].id >= 0; i = (i + 1) & mask) {
    if (slots_[i].hash != hash) continue;
    const std::string& token = (*tokens_)[slots_[i].id];
    if (token.size() == size && token.compare(0, first.size(), first) == 0 &&
        token.compare(first.size(), second.size(), second) == 0) {
      return slots_[i].id;
    }
  }
  return -1;
}

// ---------------------------------------------------------------- MergeMap

void MergeMap::Reserve(size_t n) {
  slots_.assign(CapacityFor(n), Slot{});
  size_ = 0;
}

void MergeMap::Grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.empty() ? 16 : old.size() * 2, Slot{});
  const size_t mask = slots_.size() - 1;
  for (const Slot& slot : old) {
    if (slot.key == ~uint64_t{0}) continue;
    size_t i = MixPair(slot.key) & mask;
    while (slots_[i].key != ~uint64_t{0}) i = (i + 1) & mask;
    slots_[i] = slot;
  }
}

void MergeMap::Insert(int32_t left, int32_t right, Value value) {
  if (4 * (size_ + 1) > 3 * slots_.size()) Grow();
  const uint64_t key = PairKey(left, right);
  const size_t mask = slots_.size() - 1;
  size_t i = MixPair(key) & mask;
  for (; slots_[i].key != ~uint64_t{0}; i = (i + 1) & mask) {
    if (slots_[i].key == key) {
      slots_[i].value = value;
      return;
    }
  }
  slots_[i] = Slot{key, value};
  ++size_;
}

void MergeMap::Prefetch(int32_t left, int32_t right) const {
  if (!slots_.empty()) {
    __builtin_prefetch(&slots_[MixPair(PairKey(left, right)) & (slots_.size() - 1)]);
  }
}

const MergeMap::Value* MergeMap::Find(int32_t left, int32_t right) const {
  if (slots_.empty()) return nullptr;
  const uint64_t key = PairKey(left, right);
  const size_t mask = slots_.size() - 1;
  for (size_t i = MixPair(key) & mask; slots_[i].key != ~uint64_t{0}; i = (i + 1) & mask) {
    if (slots_[i].key == key) return &slots_[i].value;
  }
  return nullptr;
}

// ---------------------------------------------------------------- BpeModel

void BpeModel::Tokenize(std::string_view piece, bool allow_special,
                        std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  auto allowed = [&](int32_t id) { return allow_special || special[id] == 0; };
  if (ignore_merges) {
    const int32_t id = vocab.Find(piece);
    if (id >= 0 && allowed(id)) {
      out->push_back(id);
      return;
    }
  }

  // 1. One symbol per character: its token, its bytes' fallback tokens, or unk.
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  auto add = [&](int32_t id, uint32_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back(Symbol{id, n - 1, -1, len});
  };
  int32_t unk_len = 0;  // bytes of the pending unk, 0 when none
  for (size_t i = 0; i < piece.size();) {
    const size_t start = i;
    const uint32_t cp = NextCodePoint(piece, &i);
    const auto len = static_cast<uint32_t>(i - start);
    const std::string_view ch = piece.substr(start, len);
    int32_t id = cp < bmp_char_ids.size() ? bmp_char_ids[cp] : vocab.Find(ch);
    if (id >= 0 && !allowed(id)) id = -1;
    if (id >= 0) {
      if (unk_len > 0) add(unk_id, static_cast<uint32_t>(unk_len));
      unk_len = 0;
      add(id, len);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (const char b : ch) all = all && byte_ids[static_cast<uint8_t>(b)] >= 0;
      if (all) {
        // As `tokenizers`: a pending unk stays pending across byte tokens.
        for (const char b : ch) add(byte_ids[static_cast<uint8_t>(b)], 1);
        continue;
      }
    }
    if (unk_id >= 0) {
      if (unk_len > 0 && !fuse_unk) {
        add(unk_id, static_cast<uint32_t>(unk_len));
        unk_len = 0;
      }
      unk_len += static_cast<int32_t>(len);
    }
    // No unk token: the character is dropped, as `tokenizers` drops it.
  }
  if (unk_len > 0) add(unk_id, static_cast<uint32_t>(unk_len));

  // 2. Merges, lowest rank first, leftmost among equal ranks.
  auto find_merge = [&](int32_t left, int32_t right) -> const MergeMap::Value* {
    const MergeMap::Value* value = merges.Find(left, right);
    return value != nullptr && allowed(value->merged) ? value : nullptr;
  };
  std::vector<QueuedMerge> queue;
  queue.reserve(symbols.size());
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeMap::Value* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push_back(QueuedMerge{m->rank, static_cast<int32_t>(i), m->merged});
    }
  }
  std::make_heap(queue.begin(), queue.end(), QueueAfter);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), QueueAfter);
    const QueuedMerge top = queue.back();
    queue.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    const Symbol right = symbols[left.next];
    const MergeMap::Value* current = find_merge(left.id, right.id);
    if (current == nullptr || current->merged != top.merged) continue;  // stale entry

    left.id = top.merged;
    left.len += right.len;
    const int32_t right_pos = left.next;
    left.next = right.next;
    symbols[right_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;

    if (left.prev >= 0) {
      if (const MergeMap::Value* m = find_merge(symbols[left.prev].id, left.id)) {
        queue.push_back(QueuedMerge{m->rank, left.prev, m->merged});
        std::push_heap(queue.begin(), queue.end(), QueueAfter);
      }
    }
    if (left.next >= 0) {
      if (const MergeMap::Value* m = find_merge(left.id, symbols[left.next].id)) {
        queue.push_back(QueuedMerge{m->rank, top.pos, m->merged});
        std::push_heap(queue.begin(), queue.end(), QueueAfter);
      }
    }
  }
  for (const Symbol& symbol : symbols) {
    if (symbol.len != 0) out->push_back(symbol.id);
  }
}

}  // namespace hearth::llm::tokenizer_internal
