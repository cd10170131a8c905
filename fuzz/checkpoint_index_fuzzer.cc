// Feeds ParseCheckpointIndex arbitrary model.safetensors.index.json texts and
// checks every index it accepts against the guarantees checkpoint.h makes.
//
// Input: the index's JSON text.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string_view>
#include <vector>

#include "hearth/checkpoint.h"

namespace {

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "broken guarantee: %s\n", what);
    __builtin_trap();
  }
}

void CheckAccepted(const hearth::CheckpointIndex& index) {
  Require(!index.weight_map.empty(), "at least one tensor");
  Require(index.weight_map.size() <= hearth::kMaxCheckpointTensors, "tensor limit");
  Require(!index.shards.empty() && index.shards.size() <= hearth::kMaxCheckpointShards,
          "shard limit");
  for (size_t i = 0; i < index.shards.size(); ++i) {
    const std::string& s = index.shards[i];
    Require(i == 0 || index.shards[i - 1] < s, "shards sorted and unique");
    Require(s.find('/') == std::string::npos, "no '/' in a shard name");
    Require(s.find("..") == std::string::npos, "no \"..\" in a shard name");
    Require(s.find('\0') == std::string::npos, "no NUL in a shard name");
    Require(s.size() > 12 && s.ends_with(".safetensors"), "shard name ends in .safetensors");
  }
  std::vector<bool> used(index.shards.size(), false);
  for (size_t i = 0; i < index.weight_map.size(); ++i) {
    const auto& [name, shard] = index.weight_map[i];
    Require(!name.empty() && name.find('\0') == std::string::npos, "tensor name");
    Require(i == 0 || index.weight_map[i - 1].first < name, "tensors sorted and unique");
    Require(shard < index.shards.size(), "shard index in range");
    used[shard] = true;
  }
  for (bool u : used) Require(u, "every shard holds a listed tensor");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  hearth::Result<hearth::CheckpointIndex> index = hearth::ParseCheckpointIndex(json, "fuzz");
  if (index.ok()) {
    CheckAccepted(*index);
  } else {
    Require(index.status().code() == hearth::StatusCode::kInvalidArgument, "InvalidArgument");
    Require(index.status().message().starts_with("fuzz: "), "the error names the origin");
  }
  return 0;
}
