#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <numeric>
#include <system_error>
#include <thread>

#include "checkpoint/safetensors_format.h"
#include "hearth/checkpoint.h"
#include "platform/file_io.h"

namespace hearth {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kWriteChunkBytes = 16ull << 20;
// Each writer thread holds one chunk buffer; this bounds what a large
// `threads` argument can allocate.
constexpr size_t kMaxWriterThreads = 64;

Status TensorArgumentError(std::string_view name, std::string_view what) {
  return InvalidArgument("tensor " + QuoteForMessage(name) + ": " + std::string(what));
}

// Validates what AddTensor is given; returns the tensor's size in bytes.
Result<uint64_t> CheckNewTensor(std::string_view name, DType dtype,
                                std::span<const int64_t> shape) {
  if (name.empty()) return InvalidArgument("tensor name is empty");
  if (name == "__metadata__") return TensorArgumentError(name, "name is reserved");
  if (!IsStoredDType(static_cast<int>(dtype))) {
    return TensorArgumentError(name, "invalid dtype " + std::to_string(static_cast<int>(dtype)));
  }
  for (int64_t dim : shape) {
    if (dim < 0) {
      return TensorArgumentError(name, "shape " + FormatShape(shape) + " has a negative dimension");
    }
  }
  std::optional<uint64_t> nbytes = TensorBytes(dtype, shape);
  if (!nbytes) {
    return TensorArgumentError(name, "shape " + FormatShape(shape) + " of " +
                                         std::string(DTypeName(dtype)) + " overflows 64-bit sizes");
  }
  return *nbytes;
}

// The file a write goes to before it is renamed to PATH. Where the file
// system has them, a file with no name in PATH's directory, named PATH.tmp
// only once complete: a process killed while writing (SIGKILL, SIGINT) leaves
// nothing behind. Elsewhere PATH.tmp from the start, unlinked on failure.
class PendingFile {
 public:
  explicit PendingFile(const std::string& path) : path_(path), tmp_path_(path + ".tmp") {}
  ~PendingFile() {
    if (named_) ::unlink(tmp_path_.c_str());  // the write did not get as far as the rename
  }
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  Status Open() {
    const size_t slash = path_.find_last_of('/');
    const std::string dir = slash == std::string::npos ? "." : path_.substr(0, slash + 1);
    fd_.Reset(platform::OpenUnnamed(dir.c_str()));
    if (fd_) return Status::Ok();
    if (!platform::NoUnnamedFiles(errno)) return ErrnoError("create " + tmp_path_, errno);
    fd_.Reset(::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd_) return ErrnoError("create " + tmp_path_, errno);
    named_ = true;
    return Status::Ok();
  }

  int fd() const { return fd_.get(); }
  const std::string& tmp_path() const { return tmp_path_; }

  // Closes the file and puts it in place of PATH.
  Status Commit() {
    if (!named_) {
      ::unlink(tmp_path_.c_str());  // a leftover of an older write
      if (platform::NameUnnamed(fd_.get(), tmp_path_.c_str()) != 0) {
        return ErrnoError("name " + tmp_path_, errno);
      }
      named_ = true;
    }
    if (::close(fd_.Release()) != 0) return ErrnoError("close " + tmp_path_, errno);
    if (platform::RenameReplacing(tmp_path_.c_str(), path_.c_str()) != 0) {
      return ErrnoError("rename " + tmp_path_ + " to " + path_, errno);
    }
    named_ = false;  // PATH.tmp is PATH now
    return Status::Ok();
  }

 private:
  std::string path_, tmp_path_;
  UniqueFd fd_;
  bool named_ = false;  // PATH.tmp is this write's file
};

Status PwriteFull(int fd, const void* data, size_t size, uint64_t offset, const std::string& path) {
  const auto* bytes = static_cast<const char*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = platform::WriteAt(fd, bytes + done, size - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write " + path + " at byte " + std::to_string(offset + done), errno);
    }
    if (n == 0) return Internal("write " + path + ": pwrite wrote nothing");
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// One piece of one tensor, filled into a buffer and written with one pwrite.
struct Chunk {
  const CheckpointWriter::FillFn* fill;
  const std::string* tensor_name;
  uint64_t offset_in_tensor;
  uint64_t size;
  uint64_t file_offset;
};

// Fills and writes `chunks` on up to `threads` threads (the calling one
// included). Returns the first error; the other threads stop at their next
// chunk.
Status WriteChunks(int fd, const std::vector<Chunk>& chunks, int threads, const std::string& path,
                   const std::string& tmp_path) {
  if (chunks.empty()) return Status::Ok();
  uint64_t buffer_bytes = 0;
  for (const Chunk& chunk : chunks) buffer_bytes = std::max(buffer_bytes, chunk.size);
  const size_t workers =
      std::min({static_cast<size_t>(std::max(threads, 1)), chunks.size(), kMaxWriterThreads});

  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  Status first_error;
  auto fail = [&](Status status) {
    std::lock_guard lock(mutex);
    if (first_error.ok()) first_error = std::move(status);
    failed = true;
  };
  auto work = [&] {
    std::unique_ptr<std::byte[]> buffer(new (std::nothrow) std::byte[buffer_bytes]);
    if (!buffer) {
      fail(ResourceExhausted(path + ": cannot allocate a " + std::to_string(buffer_bytes) +
                             "-byte write buffer"));
      return;
    }
    while (!failed.load(std::memory_order_relaxed)) {
      const size_t index = next.fetch_add(1);
      if (index >= chunks.size()) return;
      const Chunk& chunk = chunks[index];
      const std::span<std::byte> out(buffer.get(), chunk.size);
      Status status = (*chunk.fill)(chunk.offset_in_tensor, out);
      if (!status.ok()) {
        fail(status.WithContext(path + ": tensor " + QuoteForMessage(*chunk.tensor_name)));
        return;
      }
      status = PwriteFull(fd, out.data(), out.size(), chunk.file_offset, tmp_path);
      if (!status.ok()) {
        fail(std::move(status));
        return;
      }
    }
  };

  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  try {
    while (pool.size() + 1 < workers) pool.emplace_back(work);
  } catch (const std::system_error&) {
    // Fewer threads than asked for only makes the write slower.
  }
  work();
  for (std::thread& thread : pool) thread.join();
  return first_error;
}

}  // namespace

void CheckpointWriter::SetMetadata(std::string key, std::string value) {
  for (auto& [existing_key, existing_value] : metadata_) {
    if (existing_key == key) {
      existing_value = std::move(value);
      return;
    }
  }
  metadata_.emplace_back(std::move(key), std::move(value));
}

Status CheckpointWriter::AddTensor(std::string name, DType dtype, std::vector<int64_t> shape,
                                   std::span<const std::byte> bytes) {
  ASSIGN_OR_RETURN(uint64_t nbytes, CheckNewTensor(name, dtype, shape));
  if (bytes.size() != nbytes) {
    return TensorArgumentError(name, std::to_string(bytes.size()) + " bytes given but " +
                                         std::string(DTypeName(dtype)) + " " + FormatShape(shape) +
                                         " needs " + std::to_string(nbytes));
  }
  return AddTensor(std::move(name), dtype, std::move(shape),
                   [bytes](uint64_t offset, std::span<std::byte> out) {
                     std::memcpy(out.data(), bytes.data() + offset, out.size());
                     return Status::Ok();
                   });
}

Status CheckpointWriter::AddTensor(std::string name, DType dtype, std::vector<int64_t> shape,
                                   FillFn fill) {
  ASSIGN_OR_RETURN(uint64_t nbytes, CheckNewTensor(name, dtype, shape));
  if (!fill) return TensorArgumentError(name, "no fill function");
  for (const Pending& existing : tensors_) {
    if (existing.name == name) return TensorArgumentError(name, "added twice");
  }
  tensors_.push_back(Pending{std::move(name), dtype, std::move(shape), nbytes, std::move(fill)});
  return Status::Ok();
}

Status CheckpointWriter::Write(const std::string& path, int threads) const {
  std::vector<uint64_t> offsets(tensors_.size());
  uint64_t data_size = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    offsets[i] = data_size;
    if (__builtin_add_overflow(data_size, tensors_[i].nbytes, &data_size)) {
      return InvalidArgument(path + ": tensors add up to more than 2^64 bytes");
    }
  }

  std::string header = "{";
  try {
    if (!metadata_.empty()) {
      Json metadata = Json::object();
      for (const auto& [key, value] : metadata_) metadata[key] = value;
      header += "\"__metadata__\":" + metadata.dump();
    }
    std::vector<size_t> by_name(tensors_.size());
    std::iota(by_name.begin(), by_name.end(), size_t{0});
    std::sort(by_name.begin(), by_name.end(),
              [&](size_t a, size_t b) { return tensors_[a].name < tensors_[b].name; });
    for (size_t i : by_name) {
      const Pending& tensor = tensors_[i];
      const Json entry = {
          {"dtype", std::string(DTypeName(tensor.dtype))},
          {"shape", tensor.shape},
          {"data_offsets", Json::array({offsets[i], offsets[i] + tensor.nbytes})},
      };
      if (header.size() > 1) header += ',';
      header += Json(tensor.name).dump() + ':' + entry.dump();
    }
  } catch (const Json::exception& e) {
    return InvalidArgument(path + ": a tensor name or metadata string is not valid UTF-8 (" +
                           e.what() + ")");
  }
  header += '}';
  // The data section starts 8-byte aligned, as the reference writer does it.
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxSafetensorsHeaderBytes) {
    return InvalidArgument(path + ": header of " + std::to_string(header.size()) +
                           " bytes exceeds the " + std::to_string(kMaxSafetensorsHeaderBytes) +
                           "-byte limit readers accept");
  }
  const uint64_t data_start = 8 + header.size();
  if (data_size > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) - data_start) {
    return InvalidArgument(path + ": " + std::to_string(data_size) +
                           " bytes of tensors exceed the largest file size");
  }

  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Pending& tensor = tensors_[i];
    for (uint64_t offset = 0; offset < tensor.nbytes; offset += kWriteChunkBytes) {
      chunks.push_back(Chunk{&tensor.fill, &tensor.name, offset,
                             std::min(kWriteChunkBytes, tensor.nbytes - offset),
                             data_start + offsets[i] + offset});
    }
  }

  PendingFile file(path);
  RETURN_IF_ERROR(file.Open());
  const std::string& tmp_path = file.tmp_path();
  if (::ftruncate(file.fd(), static_cast<off_t>(data_start + data_size)) != 0) {
    return ErrnoError("resize " + tmp_path, errno);
  }
  unsigned char length[8];
  StoreLittleEndian64(header.size(), length);
  RETURN_IF_ERROR(PwriteFull(file.fd(), length, sizeof length, 0, tmp_path));
  RETURN_IF_ERROR(PwriteFull(file.fd(), header.data(), header.size(), 8, tmp_path));
  RETURN_IF_ERROR(WriteChunks(file.fd(), chunks, threads, path, tmp_path));
  return file.Commit();
}

Status CheckpointWriter::WriteDirectory(const std::string& dir, uint64_t max_shard_bytes,
                                        int threads) const {
  if (platform::MakeDirectory(dir.c_str()) != 0 && errno != EEXIST)
    return ErrnoError("mkdir " + dir, errno);
  std::vector<std::vector<size_t>> shards;
  uint64_t shard_bytes = 0, total = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const uint64_t nbytes = tensors_[i].nbytes;
    const bool fits = shard_bytes <= max_shard_bytes && nbytes <= max_shard_bytes - shard_bytes;
    if (shards.empty() || !fits) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += nbytes;
    if (__builtin_add_overflow(total, nbytes, &total)) {
      return InvalidArgument(dir + ": tensors add up to more than 2^64 bytes");
    }
  }
  if (shards.size() <= 1) return Write(dir + "/" + std::string(kSafetensorsFileName), threads);
  if (shards.size() > 99999) {
    return InvalidArgument(dir + ": " + std::to_string(shards.size()) +
                           " shards; file names hold at most 99999");
  }

  Json weight_map = Json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    CheckpointWriter shard;
    shard.metadata_ = metadata_;
    for (size_t i : shards[s]) {
      shard.tensors_.push_back(tensors_[i]);
      weight_map[tensors_[i].name] = name;
    }
    RETURN_IF_ERROR(shard.Write(dir + "/" + name, threads));
  }
  std::string text;
  try {
    text = Json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2) + "\n";
  } catch (const Json::exception& e) {
    return InvalidArgument(dir + ": a tensor name is not valid UTF-8 (" + e.what() + ")");
  }
  const std::string path = dir + "/" + std::string(kSafetensorsIndexFileName);
  PendingFile file(path);
  RETURN_IF_ERROR(file.Open());
  RETURN_IF_ERROR(PwriteFull(file.fd(), text.data(), text.size(), 0, file.tmp_path()));
  return file.Commit();
}

}  // namespace hearth
