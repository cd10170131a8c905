// safetensors checkpoints: a validating reader and a writer.
//
// Format: 8-byte little-endian header length N, N bytes of JSON (a map from
// tensor name to {"dtype", "shape", "data_offsets": [begin, end]}, plus an
// optional "__metadata__" map of strings to strings), then the data section.
// Offsets are relative to the start of the data section.
//
// The reader trusts nothing it has not checked: header length (<= 100 MiB and
// within the file), JSON syntax, dtype names, shapes (non-negative, product
// without overflow), byte ranges (inside the data section, equal to
// numel * dtype size, not overlapping each other) and __metadata__ (strings
// only). Every error names the file and the tensor or field at fault.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // first byte, relative to the start of the data section
  uint64_t nbytes = 0;

  uint64_t numel() const;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by name
  std::vector<std::pair<std::string, std::string>> metadata;  // sorted by key
};

// Validates the JSON text of a header against a data section of `data_size`
// bytes. `origin` (usually the file path) prefixes every error message.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t data_size,
                                                 std::string_view origin);

// A validated safetensors file, open read-only. Move-only; owns its fd.
// Thread-safe for concurrent reads (pread).
class Checkpoint {
 public:
  static Result<Checkpoint> Open(const std::string& path);

  const std::string& path() const { return path_; }
  int fd() const { return fd_.get(); }
  uint64_t file_size() const { return file_size_; }
  // Absolute file offset of the data section (8 + header length).
  uint64_t data_start() const { return data_start_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::vector<std::pair<std::string, std::string>>& metadata() const {
    return header_.metadata;
  }
  const TensorInfo* Find(std::string_view name) const;
  // Sum of all tensors' nbytes.
  uint64_t tensor_bytes() const;

  // Reads `out.size()` bytes of `tensor` starting `offset_in_tensor` bytes in.
  // Short reads and EINTR are retried; a file that shrank is an error.
  Status Read(const TensorInfo& tensor, uint64_t offset_in_tensor, std::span<std::byte> out) const;

 private:
  std::string path_;
  UniqueFd fd_;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;
  SafetensorsHeader header_;
};

// Writes a safetensors file. Tensors are laid out in the order they were
// added; the header's keys are sorted. The file is written to "PATH.tmp" and
// renamed into place, so a failed write never leaves a half-written PATH.
class CheckpointWriter {
 public:
  // Called to produce bytes [offset, offset + out.size()) of one tensor. It may
  // be called concurrently from several threads for different ranges.
  using FillFn = std::function<Status(uint64_t offset, std::span<std::byte> out)>;

  void SetMetadata(std::string key, std::string value);
  // Copies nothing: `bytes` must stay valid until Write returns.
  Status AddTensor(std::string name, DType dtype, std::vector<int64_t> shape,
                   std::span<const std::byte> bytes);
  Status AddTensor(std::string name, DType dtype, std::vector<int64_t> shape, FillFn fill);
  // A temporary buffer would be gone before Write reads it.
  Status AddTensor(std::string name, DType dtype, std::vector<int64_t> shape,
                   std::vector<std::byte>&& bytes) = delete;

  // `threads` > 1 fills and writes chunks in parallel.
  Status Write(const std::string& path, int threads = 1) const;

 private:
  struct Pending {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    uint64_t nbytes;
    FillFn fill;
  };
  std::vector<Pending> tensors_;
  std::vector<std::pair<std::string, std::string>> metadata_;
};

}  // namespace hearth
