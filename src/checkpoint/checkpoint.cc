// Checkpoint: a safetensors file or a checkpoint directory, opened and checked.
#include "hearth/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "checkpoint/safetensors_file.h"
#include "checkpoint/safetensors_format.h"
#include "common/regular_file.h"
#include "platform/file_io.h"

namespace hearth {
namespace {

// Names of other files listed in a message, at most.
constexpr size_t kMaxNamesInMessage = 4;

#ifdef _WIN32
// On Windows a path is resolved as it is opened (there is no O_PATH, and no
// descriptor of a directory): each helper takes the full path `shown` and
// ignores `dir_fd`; a directory's "descriptor" is an invalid UniqueFd. A
// file's identity is its size and times (st_ino is 0 there, and st_dev
// differs between stat and fstat).
constexpr int AT_FDCWD = -100;
constexpr int O_DIRECTORY = 0x10000000;

std::string Identity(const struct stat& st) {
  return std::to_string(st.st_size) + ":" + std::to_string(static_cast<int64_t>(st.st_mtime)) +
         ":" + std::to_string(static_cast<int64_t>(st.st_ctime));
}

Result<UniqueFd> OpenPath(int /*dir_fd*/, const std::string& /*name*/, const std::string& shown,
                          struct stat* st) {
  if (::stat(shown.c_str(), st) != 0) return ErrnoError(shown, errno);
  return UniqueFd();
}

Result<UniqueFd> Reopen(const UniqueFd& /*handle*/, const struct stat& checked, int flags,
                        const std::string& shown, struct stat* st) {
  if ((flags & O_DIRECTORY) != 0) {
    *st = checked;
    return UniqueFd();
  }
  UniqueFd fd(::open(shown.c_str(), flags | O_CLOEXEC));
  if (!fd) return ErrnoError("open " + shown, errno);
  if (::fstat(fd.get(), st) != 0) return ErrnoError("fstat " + shown, errno);
  if (!S_ISREG(st->st_mode) || Identity(*st) != Identity(checked))
    return InvalidArgument(shown + ": changed while it was opened");
  return fd;
}

Result<bool> HasEntry(int /*dir_fd*/, const std::string& /*name*/, const std::string& shown) {
  struct stat st {};
  if (::stat(shown.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  return ErrnoError("stat " + shown, errno);
}

Result<std::vector<std::string>> ListSafetensors(int /*dir_fd*/, const std::string& shown) {
  static constexpr std::string_view kSuffix = ".safetensors";
  DIR* dir = ::opendir(shown.c_str());
  if (dir == nullptr) return ErrnoError("reading the directory " + shown, errno);
  std::vector<std::string> names;
  size_t entries = 0;
  Status status;
  while (const dirent* entry = ::readdir(dir)) {
    if (++entries > kMaxCheckpointDirectoryEntries) {
      status =
          InvalidArgument(shown + ": more than " + std::to_string(kMaxCheckpointDirectoryEntries) +
                          " entries (and no " + std::string(kSafetensorsIndexFileName) + ")");
      break;
    }
    const std::string_view name = entry->d_name;
    if (name.size() > kSuffix.size() && name.ends_with(kSuffix)) names.emplace_back(name);
  }
  ::closedir(dir);
  RETURN_IF_ERROR(status);
  std::sort(names.begin(), names.end());
  return names;
}

#else
std::string Identity(const struct stat& st) {
  auto time = [](const timespec& t) {
    return std::to_string(t.tv_sec) + "." + std::to_string(t.tv_nsec);
  };
  return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino) + ":" +
         std::to_string(st.st_size) + ":" + time(st.st_mtim) + ":" + time(st.st_ctim);
}

// Resolves `name` once, relative to `dir_fd` (AT_FDCWD: the working
// directory), to an O_PATH descriptor: no driver's open runs and a FIFO
// cannot block. Symbolic links are followed. `shown` names it in messages.
Result<UniqueFd> OpenPath(int dir_fd, const std::string& name, const std::string& shown,
                          struct stat* st) {
  UniqueFd handle(::openat(dir_fd, name.c_str(), O_PATH | O_CLOEXEC));
  if (!handle) {
    const int err = errno;
    if (err == ELOOP) return InvalidArgument(shown + ": a loop of symbolic links");
    return ErrnoError(shown, err);
  }
  if (::fstat(handle.get(), st) != 0) return ErrnoError("fstat " + shown, errno);
  return handle;
}

// Opens the very inode `handle` (an O_PATH descriptor that fstat saw as
// `checked`) refers to, through /proc/self/fd, rather than resolving its
// path again: what was checked is what is opened.
Result<UniqueFd> Reopen(const UniqueFd& handle, const struct stat& checked, int flags,
                        const std::string& shown, struct stat* st) {
  const std::string reopen = "/proc/self/fd/" + std::to_string(handle.get());
  UniqueFd fd(::open(reopen.c_str(), flags | O_CLOEXEC | O_NOCTTY));
  if (!fd) return ErrnoError("open " + shown + " (through " + reopen + ")", errno);
  if (::fstat(fd.get(), st) != 0) return ErrnoError("fstat " + shown, errno);
  if (st->st_dev != checked.st_dev || st->st_ino != checked.st_ino)
    return InvalidArgument(shown + ": changed while it was opened");
  return fd;
}

// Whether the directory has an entry `name` of any kind (a dangling link
// counts: opening it then says what is wrong).
Result<bool> HasEntry(int dir_fd, const std::string& name, const std::string& shown) {
  struct stat st {};
  if (::fstatat(dir_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) return true;
  if (errno == ENOENT) return false;
  return ErrnoError("stat " + shown, errno);
}

// The *.safetensors names in the directory, sorted.
Result<std::vector<std::string>> ListSafetensors(int dir_fd, const std::string& shown) {
  static constexpr std::string_view kSuffix = ".safetensors";
  const int copy = ::fcntl(dir_fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return ErrnoError("reading the directory " + shown, errno);
  DIR* dir = ::fdopendir(copy);
  if (dir == nullptr) {
    const int err = errno;
    ::close(copy);
    return ErrnoError("reading the directory " + shown, err);
  }
  std::vector<std::string> names;
  size_t entries = 0;
  Status status;
  for (;;) {
    errno = 0;  // readdir returns nullptr both at the end and on an error
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) {
      if (errno != 0) status = ErrnoError("reading the directory " + shown, errno);
      break;
    }
    if (++entries > kMaxCheckpointDirectoryEntries) {
      status =
          InvalidArgument(shown + ": more than " + std::to_string(kMaxCheckpointDirectoryEntries) +
                          " entries (and no " + std::string(kSafetensorsIndexFileName) + ")");
      break;
    }
    const std::string_view name = entry->d_name;
    if (name.size() > kSuffix.size() && name.ends_with(kSuffix)) names.emplace_back(name);
  }
  ::closedir(dir);
  RETURN_IF_ERROR(status);
  std::sort(names.begin(), names.end());
  return names;
}
#endif

// common/regular_file.h's OpenRegularFile, relative to a directory's descriptor.
Result<UniqueFd> OpenRegularFileAt(int dir_fd, const std::string& name, const std::string& shown,
                                   struct stat* st) {
  struct stat checked {};
  ASSIGN_OR_RETURN(UniqueFd handle, OpenPath(dir_fd, name, shown, &checked));
  if (!S_ISREG(checked.st_mode))
    return InvalidArgument(shown + ": is " + FileTypeName(checked.st_mode) +
                           ", not a regular file");
  return Reopen(handle, checked, O_RDONLY, shown, st);
}

Result<CheckpointFile> OpenFileAt(int dir_fd, const std::string& name, const std::string& shown) {
  struct stat st {};
  CheckpointFile file;
  ASSIGN_OR_RETURN(file.fd, OpenRegularFileAt(dir_fd, name, shown, &st));
  file.name = name;
  file.path = shown;
  file.size = static_cast<uint64_t>(st.st_size);
  file.identity = Identity(st);
  return file;
}

std::string QuotedList(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < kMaxNamesInMessage; ++i) {
    if (i > 0) out += ", ";
    out += QuoteForMessage(names[i]);
  }
  if (names.size() > kMaxNamesInMessage) {
    out += " and " + std::to_string(names.size() - kMaxNamesInMessage) + " more";
  }
  return out;
}

}  // namespace

// Builds checkpoints; a friend of Checkpoint, so that Open's steps can fill it.
class CheckpointBuilder {
 public:
  static Result<Checkpoint> OpenFile(const std::string& path, const UniqueFd& handle,
                                     const struct stat& checked) {
    struct stat st {};
    Checkpoint checkpoint;
    checkpoint.path_ = path;
    CheckpointFile file;
    ASSIGN_OR_RETURN(file.fd, Reopen(handle, checked, O_RDONLY, path, &st));
    file.name = path;
    file.path = path;
    file.size = static_cast<uint64_t>(st.st_size);
    file.identity = Identity(st);
    RETURN_IF_ERROR(ReadSafetensorsHeader(file, 0, nullptr, &checkpoint.tensors_));
    checkpoint.shards_.push_back(std::move(file));
    RETURN_IF_ERROR(Finish(checkpoint));
    return checkpoint;
  }

  static Result<Checkpoint> OpenDirectory(const std::string& path, const UniqueFd& handle,
                                          const struct stat& checked) {
    struct stat st {};
    ASSIGN_OR_RETURN(UniqueFd dir, Reopen(handle, checked, O_RDONLY | O_DIRECTORY, path, &st));
    std::string base = path;
    while (base.size() > 1 && base.back() == '/') base.pop_back();
    const std::string prefix = base == "/" ? base : base + "/";

    Checkpoint checkpoint;
    checkpoint.path_ = path;
    checkpoint.is_directory_ = true;
    const std::string index_name(kSafetensorsIndexFileName);
    const std::string single_name(kSafetensorsFileName);
    ASSIGN_OR_RETURN(bool has_index, HasEntry(dir.get(), index_name, prefix + index_name));
    if (has_index) {
      RETURN_IF_ERROR(OpenSharded(checkpoint, dir.get(), prefix));
      RETURN_IF_ERROR(Finish(checkpoint));
      checkpoint.directory_ = std::move(dir);
      return checkpoint;
    }

    ASSIGN_OR_RETURN(std::vector<std::string> found, ListSafetensors(dir.get(), path));
    const bool has_single = std::find(found.begin(), found.end(), single_name) != found.end();
    if (found.empty()) {
      return InvalidArgument(path + ": is a directory without " + single_name + " or " +
                             index_name + ": not a safetensors checkpoint directory");
    }
    if (!has_single) {
      return InvalidArgument(path + ": has no " + single_name + " or " + index_name +
                             " (it holds " + QuotedList(found) +
                             "): give a file's own path to load it alone");
    }
    if (found.size() > 1) {
      found.erase(std::find(found.begin(), found.end(), single_name));
      return InvalidArgument(
          path + ": holds " + single_name + " and " + std::to_string(found.size()) +
          " other .safetensors file" + (found.size() == 1 ? "" : "s") + " (" + QuotedList(found) +
          ") but no " + index_name + " to say which tensors are the checkpoint's");
    }
    ASSIGN_OR_RETURN(CheckpointFile file, OpenFileAt(dir.get(), single_name, prefix + single_name));
    RETURN_IF_ERROR(ReadSafetensorsHeader(file, 0, nullptr, &checkpoint.tensors_));
    checkpoint.shards_.push_back(std::move(file));
    RETURN_IF_ERROR(Finish(checkpoint));
    return checkpoint;
  }

 private:
  static Status OpenSharded(Checkpoint& checkpoint, int dir_fd, const std::string& prefix) {
    const std::string index_name(kSafetensorsIndexFileName);
    const std::string index_path = prefix + index_name;
    checkpoint.index_path_ = index_path;

    CheckpointIndex index;
    {
      ASSIGN_OR_RETURN(CheckpointFile file, OpenFileAt(dir_fd, index_name, index_path));
      if (file.size > kMaxCheckpointIndexBytes) {
        return InvalidArgument(index_path + ": " + std::to_string(file.size) +
                               " bytes, more than the limit of " +
                               std::to_string(kMaxCheckpointIndexBytes));
      }
      std::string text(file.size, '\0');
      ASSIGN_OR_RETURN(size_t got,
                       PreadFull(file.fd.get(), text.data(), text.size(), 0, index_path));
      if (got < text.size()) return TruncatedError(index_path, "", 0, text.size(), got, file.size);
      ASSIGN_OR_RETURN(index, ParseCheckpointIndex(text, index_path));
      checkpoint.index_identity_ = std::move(file.identity);
    }
    checkpoint.index_total_size_ = index.total_size;

    // A model.safetensors beside an index that does not list it: one of the
    // two is stale, and which is not known.
    const std::string single_name(kSafetensorsFileName);
    if (!std::binary_search(index.shards.begin(), index.shards.end(), single_name)) {
      ASSIGN_OR_RETURN(bool has_single, HasEntry(dir_fd, single_name, prefix + single_name));
      if (has_single) {
        return InvalidArgument(prefix + single_name + ": is beside " + index_path +
                               ", which does not list it: one of the two is stale");
      }
    }

    // For messages: the first tensor listed for each shard, and how many.
    std::vector<const std::string*> first_listed(index.shards.size(), nullptr);
    std::vector<size_t> listed(index.shards.size(), 0);
    for (const auto& [name, shard] : index.weight_map) {
      if (first_listed[shard] == nullptr) first_listed[shard] = &name;
      ++listed[shard];
    }

    uint64_t header_budget = kMaxCheckpointHeaderBytes;
    std::vector<TensorInfo>& tensors = checkpoint.tensors_;
    for (uint32_t i = 0; i < index.shards.size(); ++i) {
      const std::string& name = index.shards[i];
      Result<CheckpointFile> file = OpenFileAt(dir_fd, name, prefix + name);
      if (!file.ok()) {
        const std::string others = listed[i] > 1 ? " and " + std::to_string(listed[i] - 1) +
                                                       " other" + (listed[i] > 2 ? "s" : "")
                                                 : "";
        return file.status().WithContext(index_path + ": shard " + QuoteForMessage(name) +
                                         ", listed for tensor " +
                                         QuoteForMessage(*first_listed[i]) + others);
      }
      RETURN_IF_ERROR(ReadSafetensorsHeader(*file, i, &header_budget, &tensors));
      if (tensors.size() > kMaxCheckpointTensors) {
        return ResourceExhausted(file->path + ": takes the shards' tensors past the limit of " +
                                 std::to_string(kMaxCheckpointTensors));
      }
      if (i > 0) file->fd.Reset();  // opened again by each Read
      checkpoint.shards_.push_back(std::move(file).value());
    }

    std::stable_sort(tensors.begin(), tensors.end(),
                     [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
    for (size_t i = 1; i < tensors.size(); ++i) {
      if (tensors[i].name == tensors[i - 1].name) {
        return InvalidArgument(checkpoint.shards_[tensors[i].shard].path + ": tensor " +
                               QuoteForMessage(tensors[i].name) + " is also in shard " +
                               QuoteForMessage(index.shards[tensors[i - 1].shard]) +
                               ": a tensor must be in one shard only");
      }
    }

    // Both lists are sorted by name: walk them side by side.
    const auto& map = index.weight_map;
    size_t t = 0, m = 0;
    while (t < tensors.size() || m < map.size()) {
      if (t == tensors.size() || (m < map.size() && map[m].first < tensors[t].name)) {
        const std::string& shard = index.shards[map[m].second];
        return InvalidArgument(index_path + ": tensor " + QuoteForMessage(map[m].first) +
                               " is listed for shard " + QuoteForMessage(shard) + ", but " +
                               prefix + shard + " does not hold it");
      }
      const TensorInfo& tensor = tensors[t];
      const std::string& holder = checkpoint.shards_[tensor.shard].path;
      if (m == map.size() || tensors[t].name < map[m].first) {
        return InvalidArgument(holder + ": tensor " + QuoteForMessage(tensor.name) +
                               " is not listed in " + index_path);
      }
      if (map[m].second != tensor.shard) {
        return InvalidArgument(holder + ": tensor " + QuoteForMessage(tensor.name) +
                               " is listed in " + index_path + " for shard " +
                               QuoteForMessage(index.shards[map[m].second]) + ", not this one");
      }
      ++t;
      ++m;
    }
    return Status::Ok();
  }

  // Sums the tensors' bytes (comparing total_size) once the tensors are known.
  static Status Finish(Checkpoint& checkpoint) {
    uint64_t total = 0;
    for (const TensorInfo& t : checkpoint.tensors_) {
      if (__builtin_add_overflow(total, t.nbytes, &total)) {
        return InvalidArgument(checkpoint.path_ + ": the tensors add up to more than 2^64 bytes");
      }
    }
    checkpoint.tensor_bytes_ = total;
    if (checkpoint.index_total_size_ && *checkpoint.index_total_size_ != total) {
      checkpoint.warnings_.push_back(
          checkpoint.index_path_ + ": metadata.total_size is " +
          std::to_string(*checkpoint.index_total_size_) + " bytes but the shards' tensors hold " +
          std::to_string(total) + " (the weight map and the shards' headers are what is used)");
    }
    return Status::Ok();
  }
};

Result<Checkpoint> Checkpoint::Open(const std::string& path) {
  // A FIFO, device or socket is refused before it could block or do anything on open.
  struct stat checked {};
  ASSIGN_OR_RETURN(UniqueFd handle, OpenPath(AT_FDCWD, path, path, &checked));
  if (S_ISDIR(checked.st_mode)) return CheckpointBuilder::OpenDirectory(path, handle, checked);
  if (!S_ISREG(checked.st_mode)) {
    return InvalidArgument(path + ": is " + FileTypeName(checked.st_mode) +
                           ", not a regular file or a checkpoint directory");
  }
  return CheckpointBuilder::OpenFile(path, handle, checked);
}

const std::vector<std::pair<std::string, std::string>>& Checkpoint::metadata() const {
  static const std::vector<std::pair<std::string, std::string>> kNone;
  return index_path_.empty() ? shards_.front().metadata : kNone;
}

const TensorInfo* Checkpoint::Find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorInfo& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

std::string Checkpoint::Fingerprint() const {
  std::string out;
  if (!index_path_.empty()) out += std::string(kSafetensorsIndexFileName) + "=" + index_identity_;
  for (const CheckpointFile& file : shards_) {
    if (!out.empty()) out += ';';
    out += file.name + "=" + file.identity;
  }
  return out;
}

Status Checkpoint::Read(const TensorInfo& tensor, uint64_t offset_in_tensor,
                        std::span<std::byte> out) const {
  if (tensor.shard >= shards_.size()) {
    return InvalidArgument(path_ + ": tensor " + QuoteForMessage(tensor.name) + ": shard " +
                           std::to_string(tensor.shard) + " is not one of its " +
                           std::to_string(shards_.size()) + " files");
  }
  const CheckpointFile& file = shards_[tensor.shard];
  if (offset_in_tensor > tensor.nbytes || out.size() > tensor.nbytes - offset_in_tensor) {
    return InvalidArgument(file.path + ": tensor " + QuoteForMessage(tensor.name) + ": read of " +
                           std::to_string(out.size()) + " bytes at offset " +
                           std::to_string(offset_in_tensor) + " is outside its " +
                           std::to_string(tensor.nbytes) + " bytes");
  }
  const uint64_t data_size = file.size - file.data_start;
  if (tensor.offset > data_size || tensor.nbytes > data_size - tensor.offset) {
    return InvalidArgument(file.path + ": tensor " + QuoteForMessage(tensor.name) +
                           " does not lie in this file's data section");
  }
  UniqueFd reopened;
  int fd = file.fd.get();
  if (fd < 0) {
    struct stat st {};
    ASSIGN_OR_RETURN(reopened, OpenRegularFileAt(directory_.get(), file.name, file.path, &st));
    if (Identity(st) != file.identity) {
      return FailedPrecondition(file.path +
                                ": changed since the checkpoint was opened (it is another file "
                                "now, or was written, truncated or touched)");
    }
    fd = reopened.get();
  }
  const uint64_t offset = file.data_start + tensor.offset + offset_in_tensor;
  ASSIGN_OR_RETURN(size_t got, PreadFull(fd, out.data(), out.size(), offset, file.path));
  if (got < out.size()) {
    return TruncatedError(file.path, "tensor " + QuoteForMessage(tensor.name) + ": ", offset,
                          out.size(), got, file.size);
  }
  return Status::Ok();
}

}  // namespace hearth
