// Checkpoints: safetensors files and Hugging Face checkpoint directories; a
// validating reader and a writer.
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
//
// A checkpoint directory is what transformers' save_pretrained writes: either
// one model.safetensors, or shards (model-00001-of-00003.safetensors, ...)
// with model.safetensors.index.json, whose "weight_map" names the shard of
// every tensor. Other files there (config.json, tokenizer files) are not read.
// The index is checked against the shards: every tensor it lists is in the
// shard it names and in no other, every tensor of a shard is listed for that
// shard, every shard it names is there, shard names are plain file names
// ending in .safetensors (never a path), and metadata.total_size, if given,
// is the sum of the tensors' bytes. All shards together are one checkpoint:
// tensors() holds every shard's tensors, sorted by name, as one file's would be.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
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

// The names save_pretrained gives a checkpoint of one file and the index of a
// sharded one.
inline constexpr std::string_view kSafetensorsFileName = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFileName = "model.safetensors.index.json";
// Limits on a checkpoint directory, besides each shard's own header limit.
inline constexpr uint64_t kMaxCheckpointIndexBytes = 64ull << 20;
inline constexpr size_t kMaxCheckpointShards = 4096;
// Tensors of all shards together, and the bytes of all their headers.
inline constexpr size_t kMaxCheckpointTensors = size_t{1} << 20;
inline constexpr uint64_t kMaxCheckpointHeaderBytes = 256ull << 20;
// Entries read from a directory without an index (to say what it holds).
inline constexpr size_t kMaxCheckpointDirectoryEntries = 100000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // first byte, relative to the start of its file's data section
  uint64_t nbytes = 0;
  uint32_t shard = 0;  // index into Checkpoint::shards(): the file holding it

  uint64_t numel() const;
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;                            // sorted by name
  std::vector<std::pair<std::string, std::string>> metadata;  // sorted by key
};

// Validates the JSON text of a header against a data section of `data_size`
// bytes. `origin` (usually the file path) prefixes every error message.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view json, uint64_t data_size,
                                                 std::string_view origin);

// What model.safetensors.index.json says, checked on its own: a JSON object
// whose "weight_map" maps each tensor name (non-empty, listed once) to a
// shard name (a file name ending in .safetensors: no '/', no "..", no NUL),
// at most kMaxCheckpointTensors tensors in at most kMaxCheckpointShards
// shards; "metadata", if present, an object whose "total_size", if present,
// is a non-negative integer. Other keys are ignored (transformers adds some).
struct CheckpointIndex {
  std::optional<uint64_t> total_size;
  std::vector<std::string> shards;  // sorted, unique
  // (tensor name, index into `shards`), sorted by name, names unique.
  std::vector<std::pair<std::string, uint32_t>> weight_map;
};

// `origin` (the index's path) prefixes every error message.
Result<CheckpointIndex> ParseCheckpointIndex(std::string_view json, std::string_view origin);

// One safetensors file of a Checkpoint.
struct CheckpointFile {
  std::string name;  // inside the checkpoint directory; the path given for a lone file
  std::string path;  // as messages name it: the directory's path, '/', name
  // Read-only, close-on-exec. Held for the first (or only) file; for the
  // other shards of a sharded checkpoint not held (invalid): see Checkpoint.
  UniqueFd fd;
  uint64_t size = 0;        // bytes, when opened
  uint64_t data_start = 0;  // 8 + header length
  uint64_t tensor_count = 0;
  std::vector<std::pair<std::string, std::string>> metadata;  // its __metadata__, sorted
  // "DEV:INODE:SIZE:MTIME:CTIME" as fstat saw it when opened (see Fingerprint).
  std::string identity;
};

// A validated checkpoint, open read-only: a safetensors file, or a checkpoint
// directory (see the top of this file). Move-only; owns its descriptors.
// Thread-safe for concurrent reads (pread).
//
// Every file is opened without trusting its path twice: resolved once to an
// O_PATH descriptor, checked with fstat to be a regular file (so a FIFO,
// device or socket is refused without ever being opened, and cannot block),
// then reopened through /proc/self/fd. The index and the shards are opened
// relative to the directory's descriptor (openat), so renaming or replacing
// the directory while it is read cannot send a shard's open elsewhere. As for
// a lone file, a symbolic link in the directory is followed (the Hugging Face
// cache is a tree of links into its blobs) but must lead to a regular file.
//
// Descriptors: a sharded checkpoint holds two, whatever its number of shards
// (up to kMaxCheckpointShards, past any usual descriptor limit): the
// directory's and the first shard's. Every other shard is closed once its
// header is checked and opened again, relative to the directory, by each
// Read; it must then still be the very file that was checked (device, inode,
// size, modification and change times), else the Read fails naming it.
class Checkpoint {
 public:
  // `path`: a safetensors file, or a directory holding model.safetensors
  // (alone: other *.safetensors files beside it and no index are an error),
  // or shards with model.safetensors.index.json.
  static Result<Checkpoint> Open(const std::string& path);

  const std::string& path() const { return path_; }
  bool is_directory() const { return is_directory_; }
  // The index read, for a sharded checkpoint; else empty.
  const std::string& index_path() const { return index_path_; }
  // The index's metadata.total_size, when it has one. It is information, as
  // for transformers: one that differs from tensor_bytes() (some published
  // checkpoints carry a wrong one) is a warning, not an error.
  std::optional<uint64_t> index_total_size() const { return index_total_size_; }
  // What is odd but harmless about the files, for the caller to show (each a
  // sentence naming the file): a metadata.total_size that is not the sum of
  // the shards' tensors.
  const std::vector<std::string>& warnings() const { return warnings_; }
  // Every file holding tensors: one, or the shards sorted by name (the
  // index's order). Never empty.
  const std::vector<CheckpointFile>& shards() const { return shards_; }

  // Of shards()[0]: the file itself for a checkpoint of one file, the first
  // shard of a sharded one. To tell whether a checkpoint has changed since it
  // was opened, compare Fingerprint()s, which cover every file.
  int fd() const { return shards_.front().fd.get(); }
  uint64_t file_size() const { return shards_.front().size; }
  uint64_t data_start() const { return shards_.front().data_start; }

  // All tensors of all shards, sorted by name (byte-wise); TensorInfo::shard
  // says which file holds each. This is the order of the manifest, the
  // arena and the checksum (hearth/checksum.h), however the tensors are
  // spread over shards.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The __metadata__ of a checkpoint of one file; empty for a sharded one,
  // whose shards each have their own (shards()[i].metadata).
  const std::vector<std::pair<std::string, std::string>>& metadata() const;
  const TensorInfo* Find(std::string_view name) const;
  // Sum of all tensors' nbytes.
  uint64_t tensor_bytes() const { return tensor_bytes_; }

  // Identifies the files read, as they were when opened: for each (the
  // index, then every shard in order) its name, device, inode, size and
  // modification and change times. Two opens of the same unchanged files give
  // the same string; rewriting, replacing or touching any of them changes
  // it. A cache of what was loaded from a checkpoint keys on this (with the
  // path); compare it with a fresh Open's. Not a hash of the bytes.
  std::string Fingerprint() const;

  // Reads `out.size()` bytes of `tensor` starting `offset_in_tensor` bytes in,
  // from the shard that holds it. Short reads and EINTR are retried; a file
  // that shrank is an error.
  Status Read(const TensorInfo& tensor, uint64_t offset_in_tensor, std::span<std::byte> out) const;

 private:
  friend class CheckpointBuilder;

  std::string path_;
  bool is_directory_ = false;
  UniqueFd directory_;  // held for a sharded checkpoint
  std::string index_path_;
  std::string index_identity_;
  std::optional<uint64_t> index_total_size_;
  std::vector<CheckpointFile> shards_;
  std::vector<TensorInfo> tensors_;
  uint64_t tensor_bytes_ = 0;
  std::vector<std::string> warnings_;
};

// Writes a safetensors file. Tensors are laid out in the order they were
// added; the header's keys are sorted. The file is written apart and renamed
// into place, so a failed write never leaves a half-written PATH: as a file
// with no name (O_TMPFILE) where the file system has them, named "PATH.tmp"
// once complete, so that even a killed writer leaves nothing; else as
// "PATH.tmp" from the start, unlinked when the write fails.
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

  // Writes a checkpoint directory as save_pretrained lays it out, into `dir`
  // (made, 0755, if missing): tensors in the order added, a new shard begun
  // whenever the next tensor would take the current one past
  // `max_shard_bytes` of tensor data (a larger tensor gets a shard of its
  // own). One shard is written as model.safetensors alone; more as
  // model-00001-of-0000N.safetensors ... and then, last,
  // model.safetensors.index.json (metadata.total_size and the weight_map).
  // Every shard gets this writer's metadata. Each file is written as Write
  // writes one; a failure leaves the files already renamed.
  Status WriteDirectory(const std::string& dir, uint64_t max_shard_bytes, int threads = 1) const;

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
