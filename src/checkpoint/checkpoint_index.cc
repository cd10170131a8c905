// model.safetensors.index.json, checked on its own (what the shards hold is
// checked against it in checkpoint.cc).
#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/safetensors_format.h"
#include "checkpoint/strict_json.h"
#include "hearth/checkpoint.h"

namespace hearth {
namespace {

using Json = nlohmann::json;

// Integral floats up to here are exact ("total_size": 1.2e10 is seen in the wild).
constexpr double kMaxExactDouble = 9007199254740992.0;  // 2^53

Status IndexError(std::string_view origin, std::string_view what) {
  return InvalidArgument(std::string(origin) + ": " + std::string(what));
}

Status TensorError(std::string_view origin, std::string_view tensor, std::string_view what) {
  return IndexError(origin,
                    "weight_map: tensor " + QuoteForMessage(tensor) + ": " + std::string(what));
}

Result<Json> ParseJson(std::string_view text, std::string_view origin) {
  StrictJsonErrors errors;
  errors.invalid = [&](std::string_view what) { return IndexError(origin, what); };
  errors.duplicate = [&](size_t depth, const std::string& top_key, const std::string& key) {
    if (depth == 2 && top_key == "weight_map") return TensorError(origin, key, "listed twice");
    return IndexError(origin, "duplicate key " + QuoteForMessage(key));
  };
  return ParseStrictJson(text, errors);
}

// A shard is named relative to the checkpoint directory and is never a path:
// no '/' (nothing below or above it), no ".." (nothing that reads as a way
// out), no NUL (which would cut the name short at open).
Status CheckShardName(std::string_view origin, std::string_view tensor, const std::string& shard) {
  static constexpr std::string_view kSuffix = ".safetensors";
  const std::string quoted = "shard " + QuoteForMessage(shard);
  if (shard.find('\0') != std::string::npos)
    return TensorError(origin, tensor, quoted + " holds a NUL byte");
  if (shard.find('/') != std::string::npos)
    return TensorError(origin, tensor,
                       quoted +
                           " is not a file name: it holds '/' (shards are named "
                           "relative to the checkpoint directory, inside it)");
  if (shard.find("..") != std::string::npos)
    return TensorError(origin, tensor, quoted + " holds \"..\"");
  if (shard.size() <= kSuffix.size() || !shard.ends_with(kSuffix))
    return TensorError(origin, tensor, quoted + " does not end in .safetensors");
  return Status::Ok();
}

Result<std::optional<uint64_t>> ParseTotalSize(const Json& metadata, std::string_view origin) {
  if (metadata.is_null()) return std::optional<uint64_t>();
  if (!metadata.is_object()) return IndexError(origin, "metadata is not an object");
  auto it = metadata.find("total_size");
  if (it == metadata.end() || it->is_null()) return std::optional<uint64_t>();
  const Json& value = *it;
  if (value.is_number_unsigned()) return std::optional<uint64_t>(value.get<uint64_t>());
  if (value.is_number_integer() && value.get<int64_t>() == 0) {
    return std::optional<uint64_t>(0);  // "-0"
  }
  if (value.is_number_float()) {
    const double d = value.get<double>();
    if (std::isfinite(d) && d >= 0 && d <= kMaxExactDouble && std::floor(d) == d) {
      return std::optional<uint64_t>(static_cast<uint64_t>(d));
    }
  }
  return IndexError(origin, "metadata.total_size is not a non-negative integer");
}

}  // namespace

Result<CheckpointIndex> ParseCheckpointIndex(std::string_view json, std::string_view origin) {
  ASSIGN_OR_RETURN(Json root, ParseJson(json, origin));
  if (!root.is_object()) return IndexError(origin, "is not a JSON object");

  CheckpointIndex index;
  if (auto metadata = root.find("metadata"); metadata != root.end()) {
    ASSIGN_OR_RETURN(index.total_size, ParseTotalSize(*metadata, origin));
  }
  auto map_it = root.find("weight_map");
  if (map_it == root.end()) return IndexError(origin, "no \"weight_map\"");
  const Json& map = *map_it;
  if (!map.is_object()) return IndexError(origin, "weight_map is not an object");
  if (map.empty()) return IndexError(origin, "weight_map lists no tensors");
  if (map.size() > kMaxCheckpointTensors) {
    return IndexError(origin, "weight_map lists " + std::to_string(map.size()) +
                                  " tensors, more than the limit of " +
                                  std::to_string(kMaxCheckpointTensors));
  }

  // Shard name -> its index, assigned once all are known (sorted order).
  std::map<std::string, uint32_t, std::less<>> shards;
  for (const auto& [tensor, shard] : map.items()) {
    if (tensor.empty()) return IndexError(origin, "weight_map: empty tensor name");
    if (tensor.find('\0') != std::string::npos)
      return TensorError(origin, tensor, "the name holds a NUL byte");
    if (!shard.is_string()) return TensorError(origin, tensor, "shard name is not a string");
    const auto& name = shard.get_ref<const std::string&>();
    if (shards.find(name) != shards.end()) continue;
    RETURN_IF_ERROR(CheckShardName(origin, tensor, name));
    if (shards.size() == kMaxCheckpointShards) {
      return IndexError(origin, "weight_map names more than the limit of " +
                                    std::to_string(kMaxCheckpointShards) + " shards");
    }
    shards.emplace(name, 0);
  }
  index.shards.reserve(shards.size());
  for (auto& [name, number] : shards) {
    number = static_cast<uint32_t>(index.shards.size());
    index.shards.push_back(name);
  }
  index.weight_map.reserve(map.size());
  // items() of a nlohmann::json object run in key order: sorted already.
  for (const auto& [tensor, shard] : map.items()) {
    index.weight_map.emplace_back(tensor, shards.find(shard.get_ref<const std::string&>())->second);
  }
  return index;
}

}  // namespace hearth
