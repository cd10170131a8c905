#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "checkpoint/safetensors_file.h"
#include "checkpoint/safetensors_format.h"
#include "checkpoint/strict_json.h"
#include "hearth/checkpoint.h"
#include "platform/file_io.h"

namespace hearth {
namespace {

using Json = nlohmann::json;

Status HeaderError(std::string_view origin, std::string_view what) {
  return InvalidArgument(std::string(origin) + ": header: " + std::string(what));
}

Status TensorError(std::string_view origin, std::string_view name, std::string_view what) {
  return InvalidArgument(std::string(origin) + ": tensor " + QuoteForMessage(name) + ": " +
                         std::string(what));
}

Status MetadataError(std::string_view origin, std::string_view what) {
  return InvalidArgument(std::string(origin) + ": __metadata__: " + std::string(what));
}

Status MetadataKeyError(std::string_view origin, std::string_view key, std::string_view what) {
  return MetadataError(origin, "key " + QuoteForMessage(key) + ": " + std::string(what));
}

// A valid header nests three levels deep (header, tensor, shape).
Result<Json> ParseJson(std::string_view text, std::string_view origin) {
  StrictJsonErrors errors;
  errors.invalid = [&](std::string_view what) { return HeaderError(origin, what); };
  errors.duplicate = [&](size_t depth, const std::string& top_key, const std::string& key) {
    if (depth == 1) return HeaderError(origin, "duplicate key " + QuoteForMessage(key));
    if (top_key == "__metadata__" && depth == 2)
      return MetadataKeyError(origin, key, "duplicate key");
    return TensorError(origin, top_key, "duplicate key " + QuoteForMessage(key));
  };
  return ParseStrictJson(text, errors);
}

// Reads one non-negative integer that fits in int64_t (a dimension).
Result<int64_t> ParseDim(const Json& value, size_t index, std::string_view origin,
                         std::string_view name) {
  const std::string where = "shape[" + std::to_string(index) + "]";
  if (value.is_number_unsigned()) {
    const auto dim = value.get<uint64_t>();
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return TensorError(origin, name, where + " = " + std::to_string(dim) + " is too large");
    }
    return static_cast<int64_t>(dim);
  }
  if (value.is_number_integer()) {
    const auto dim = value.get<int64_t>();
    if (dim < 0) {
      return TensorError(origin, name, where + " = " + std::to_string(dim) + " is negative");
    }
    return dim;  // "-0"
  }
  return TensorError(origin, name, where + " is not an integer");
}

Result<uint64_t> ParseOffset(const Json& value, std::string_view origin, std::string_view name) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() == 0) return uint64_t{0};  // "-0"
  return TensorError(origin, name, "data_offsets must be two unsigned integers");
}

const Json* FindField(const Json& entry, std::string_view field) {
  auto it = entry.find(field);
  return it == entry.end() ? nullptr : &*it;
}

Result<TensorInfo> ParseTensor(const std::string& name, const Json& entry, uint64_t data_size,
                               std::string_view origin) {
  if (!entry.is_object()) return TensorError(origin, name, "entry is not an object");
  for (const auto& [field, value] : entry.items()) {
    if (field != "dtype" && field != "shape" && field != "data_offsets") {
      return TensorError(origin, name, "unknown field " + QuoteForMessage(field));
    }
  }
  const Json* dtype_json = FindField(entry, "dtype");
  const Json* shape_json = FindField(entry, "shape");
  const Json* offsets_json = FindField(entry, "data_offsets");
  if (dtype_json == nullptr) return TensorError(origin, name, "missing 'dtype'");
  if (shape_json == nullptr) return TensorError(origin, name, "missing 'shape'");
  if (offsets_json == nullptr) return TensorError(origin, name, "missing 'data_offsets'");

  TensorInfo info;
  info.name = name;
  if (!dtype_json->is_string()) return TensorError(origin, name, "dtype is not a string");
  const auto& dtype_name = dtype_json->get_ref<const std::string&>();
  std::optional<DType> dtype = ParseDType(dtype_name);
  if (!dtype) return TensorError(origin, name, "unknown dtype " + QuoteForMessage(dtype_name));
  info.dtype = *dtype;

  if (!shape_json->is_array()) return TensorError(origin, name, "shape is not an array");
  info.shape.reserve(shape_json->size());
  for (size_t i = 0; i < shape_json->size(); ++i) {
    ASSIGN_OR_RETURN(int64_t dim, ParseDim((*shape_json)[i], i, origin, name));
    info.shape.push_back(dim);
  }
  std::optional<uint64_t> nbytes = TensorBytes(info.dtype, info.shape);
  if (!nbytes) {
    return TensorError(origin, name,
                       "shape " + FormatShape(info.shape) + " of " +
                           std::string(DTypeName(info.dtype)) + " overflows 64-bit sizes");
  }
  info.nbytes = *nbytes;

  if (!offsets_json->is_array() || offsets_json->size() != 2) {
    return TensorError(origin, name, "data_offsets must be two unsigned integers");
  }
  ASSIGN_OR_RETURN(uint64_t begin, ParseOffset((*offsets_json)[0], origin, name));
  ASSIGN_OR_RETURN(uint64_t end, ParseOffset((*offsets_json)[1], origin, name));
  const std::string range =
      "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "]";
  if (begin > end) return TensorError(origin, name, range + " are reversed");
  if (end > data_size) {
    return TensorError(
        origin, name,
        range + " run past the end of the data section (" + std::to_string(data_size) + " bytes)");
  }
  if (end - begin != info.nbytes) {
    return TensorError(origin, name,
                       range + " hold " + std::to_string(end - begin) + " bytes but " +
                           std::string(DTypeName(info.dtype)) + " " + FormatShape(info.shape) +
                           " needs " + std::to_string(info.nbytes));
  }
  info.offset = begin;
  return info;
}

Status ParseMetadata(const Json& json, std::string_view origin,
                     std::vector<std::pair<std::string, std::string>>* metadata) {
  if (!json.is_object()) return MetadataError(origin, "is not an object");
  for (const auto& [key, value] : json.items()) {
    if (!value.is_string()) return MetadataKeyError(origin, key, "value is not a string");
    metadata->emplace_back(key, value.get<std::string>());
  }
  std::sort(metadata->begin(), metadata->end());
  return Status::Ok();
}

// Tensors with no bytes overlap nothing; the others must not share a byte.
Status CheckNoOverlap(const std::vector<TensorInfo>& tensors, std::string_view origin) {
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : tensors) {
    if (t.nbytes > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  const TensorInfo* furthest = nullptr;  // the tensor seen so far that ends last
  for (const TensorInfo* t : by_offset) {
    if (furthest != nullptr && t->offset < furthest->offset + furthest->nbytes) {
      return TensorError(origin, t->name,
                         "bytes " + FormatRange(t->offset, t->nbytes) + " overlap tensor " +
                             QuoteForMessage(furthest->name) + " " +
                             FormatRange(furthest->offset, furthest->nbytes));
    }
    if (furthest == nullptr || t->offset + t->nbytes > furthest->offset + furthest->nbytes) {
      furthest = t;
    }
  }
  return Status::Ok();
}

}  // namespace

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(dim);
  return n;
}

Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t data_size,
                                                 std::string_view origin) {
  if (json.empty() || json.front() != '{') return HeaderError(origin, "does not start with '{'");
  ASSIGN_OR_RETURN(Json root, ParseJson(json, origin));
  if (!root.is_object()) return HeaderError(origin, "is not a JSON object");

  SafetensorsHeader header;
  header.tensors.reserve(root.size());
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      RETURN_IF_ERROR(ParseMetadata(entry, origin, &header.metadata));
      continue;
    }
    if (name.empty()) return HeaderError(origin, "empty tensor name");
    ASSIGN_OR_RETURN(TensorInfo info, ParseTensor(name, entry, data_size, origin));
    header.tensors.push_back(std::move(info));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  RETURN_IF_ERROR(CheckNoOverlap(header.tensors, origin));
  return header;
}

// Reads up to `size` bytes at `offset`, retrying EINTR and short reads.
// Returns fewer bytes only at end of file.
Result<size_t> PreadFull(int fd, void* buffer, size_t size, uint64_t offset,
                         const std::string& path) {
  auto* out = static_cast<char*>(buffer);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = platform::ReadAt(fd, out + done, size - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("read " + path + " at byte " + std::to_string(offset + done), errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

// `subject` is empty or "tensor 'name': ".
Status TruncatedError(const std::string& path, std::string_view subject, uint64_t offset,
                      uint64_t size, size_t got, uint64_t file_size) {
  return InvalidArgument(path + ": " + std::string(subject) + "file is truncated: reading bytes " +
                         FormatRange(offset, size) + " hit end of file at byte " +
                         std::to_string(offset + got) + " (the file had " +
                         std::to_string(file_size) + " bytes when opened)");
}

Status ReadSafetensorsHeader(CheckpointFile& file, uint32_t shard, uint64_t* header_budget,
                             std::vector<TensorInfo>* tensors) {
  const std::string& path = file.path;
  const uint64_t file_size = file.size;
  if (file_size < 8) {
    return InvalidArgument(path + ": file is " + std::to_string(file_size) +
                           " bytes, too short for the 8-byte header length");
  }

  unsigned char prefix[8];
  ASSIGN_OR_RETURN(size_t got, PreadFull(file.fd.get(), prefix, sizeof prefix, 0, path));
  if (got < sizeof prefix) return TruncatedError(path, "", 0, sizeof prefix, got, file_size);
  const uint64_t header_size = LoadLittleEndian64(prefix);
  if (header_size == 0) return InvalidArgument(path + ": header length is 0");
  if (header_size > kMaxSafetensorsHeaderBytes) {
    return InvalidArgument(path + ": header length " + std::to_string(header_size) +
                           " exceeds the limit of " + std::to_string(kMaxSafetensorsHeaderBytes) +
                           " bytes");
  }
  if (header_size > file_size - 8) {
    return InvalidArgument(path + ": header length " + std::to_string(header_size) +
                           " runs past the end of the file (" + std::to_string(file_size) +
                           " bytes)");
  }
  if (header_budget != nullptr) {
    if (header_size > *header_budget) {
      return ResourceExhausted(path + ": header length " + std::to_string(header_size) +
                               " takes the shards' headers past the limit of " +
                               std::to_string(kMaxCheckpointHeaderBytes) + " bytes in all");
    }
    *header_budget -= header_size;
  }

  std::string text(header_size, '\0');
  ASSIGN_OR_RETURN(got, PreadFull(file.fd.get(), text.data(), text.size(), 8, path));
  if (got < text.size()) return TruncatedError(path, "", 8, text.size(), got, file_size);

  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   ParseSafetensorsHeader(text, file_size - 8 - header_size, path));
  file.data_start = 8 + header_size;
  file.metadata = std::move(header.metadata);
  file.tensor_count = header.tensors.size();
  for (TensorInfo& t : header.tensors) {
    t.shard = shard;
    tensors->push_back(std::move(t));
  }
  return Status::Ok();
}

}  // namespace hearth
