#include "server/load_overrides.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <filesystem>
#include <set>
#include <string_view>

#include "hearth/unique_fd.h"
#include "server/model_config.h"
#include "server/model_config_pbtxt.h"

namespace hearth {
namespace {

Status CheckPath(const std::string& path) {
  const std::string what = "file override '" + path.substr(0, 64) + "'";
  if (path.empty()) return InvalidArgument("a file override has an empty path ('file:')");
  if (path.size() > kMaxOverridePathBytes)
    return InvalidArgument(what + ": its path is over " + std::to_string(kMaxOverridePathBytes) +
                           " bytes");
  if (path.find('\0') != std::string::npos) return InvalidArgument(what + ": its path holds NUL");
  if (path.front() == '/')
    return InvalidArgument(what + ": the path must be relative to the model's directory");
  size_t start = 0;
  for (;;) {
    const size_t end = path.find('/', start);
    const std::string_view part = std::string_view(path).substr(
        start, end == std::string::npos ? std::string::npos : end - start);
    if (part.empty() || part == "." || part == "..")
      return InvalidArgument(what + ": the path has an empty, '.' or '..' component");
    // Triton's status and words for this one (its clients check both).
    if (part.size() > NAME_MAX)
      return Internal("failed to poll from model repository: " + what +
                      ": a component of its path is " + std::to_string(part.size()) +
                      " bytes, over NAME_MAX (" + std::to_string(NAME_MAX) + ")");
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (path == "config.pbtxt" || path == "config.yaml")
    return InvalidArgument(what + ": the config comes from the 'config' override");
  return Status::Ok();
}

// Makes `dir` 0700 unless it exists as a directory (never through a link).
Status MakeDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) == 0) return Status::Ok();
  if (errno != EEXIST) return ErrnoError("making " + dir, errno);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return ErrnoError("looking at " + dir, errno);
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid())
    return PermissionDenied(dir + " is not a directory of this user's");
  return Status::Ok();
}

Status WriteFile(const std::string& path, std::string_view bytes) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) return ErrnoError("writing " + path, errno);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError("writing " + path, errno);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status WriteAll(const ModelLoadOverrides& overrides, const std::string& dir,
                const std::string& pbtxt) {
  RETURN_IF_ERROR(MakeDirectory(dir));
  RETURN_IF_ERROR(WriteFile(dir + "/config.pbtxt", pbtxt));
  for (const auto& [path, bytes] : overrides.files) {
    // Its directories first, each made here (the paths were checked).
    for (size_t slash = path.find('/'); slash != std::string::npos;
         slash = path.find('/', slash + 1))
      RETURN_IF_ERROR(MakeDirectory(dir + "/" + path.substr(0, slash)));
    RETURN_IF_ERROR(WriteFile(dir + "/" + path, bytes));
  }
  return Status::Ok();
}

}  // namespace

Result<PreparedOverrides> PrepareLoadOverrides(const ModelLoadOverrides& overrides,
                                               const std::string& model, const std::string& root,
                                               uint64_t serial) {
  if (overrides.config_json.empty())
    return InvalidArgument(
        "file overrides need the model's config too (the 'config' parameter): they stand for "
        "the whole model directory");
  if (overrides.config_json.size() > kMaxConfigBytes)
    return InvalidArgument("the config override is " +
                           std::to_string(overrides.config_json.size()) +
                           " bytes, over the limit of " + std::to_string(kMaxConfigBytes));
  if (overrides.files.size() > kMaxOverrideFiles)
    return InvalidArgument("more than " + std::to_string(kMaxOverrideFiles) + " file overrides");
  uint64_t total = 0;
  std::set<std::string> seen;
  for (const auto& [path, bytes] : overrides.files) {
    RETURN_IF_ERROR(CheckPath(path));
    if (!seen.insert(path).second)
      return InvalidArgument("file override '" + path.substr(0, 64) + "' is given twice");
    total += bytes.size();
    if (total > kMaxOverrideBytes)
      return InvalidArgument("the file overrides come to more than the limit of " +
                             std::to_string(kMaxOverrideBytes) + " bytes");
  }
  // A path that is a directory of another ("1" and "1/model.py"): refused.
  for (const std::string& path : seen) {
    for (size_t slash = path.find('/'); slash != std::string::npos;
         slash = path.find('/', slash + 1)) {
      const std::string directory = path.substr(0, slash);
      if (seen.count(directory) > 0)
        return InvalidArgument("file override '" + directory.substr(0, 64) +
                               "' is also a directory of '" + path.substr(0, 64) + "'");
    }
  }
  PreparedOverrides prepared;
  ASSIGN_OR_RETURN(prepared.pbtxt, ModelConfigJsonToPbtxt(overrides.config_json));
  // The config's fields are checked before any file is written (what needs
  // the model's files, its versions, is checked by the build).
  RETURN_IF_ERROR(PbtxtToYamlNamed(kConfigOverrideLabel, prepared.pbtxt).status());
  if (overrides.files.empty()) return prepared;
  if (model.empty() || model.find('/') != std::string::npos || model == "." || model == "..")
    return InvalidArgument("'" + model.substr(0, 64) + "' is not a model directory's name");
  RETURN_IF_ERROR(MakeDirectory(root));
  const std::string serial_dir = root + "/" + std::to_string(serial);
  RETURN_IF_ERROR(MakeDirectory(serial_dir));
  prepared.dir = serial_dir + "/" + model;
  if (Status s = WriteAll(overrides, prepared.dir, prepared.pbtxt); !s.ok()) {
    RemoveOverrideDirectory(prepared.dir);
    return s;
  }
  return prepared;
}

void RemoveOverrideDirectory(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path(), ec);
}

}  // namespace hearth
