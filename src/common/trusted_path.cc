#include "common/trusted_path.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "hearth/unique_fd.h"

namespace hearth {
namespace {

std::string ModeText(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

std::string Describe(const std::string& path, const struct stat& st) {
  return path + " (owner uid " + std::to_string(st.st_uid) + ", mode " + ModeText(st.st_mode) + ")";
}

// The directory itself: ours, and no one else may write it.
Status CheckOwnDirectory(const std::string& path, const struct stat& st) {
  if (!S_ISDIR(st.st_mode)) return PermissionDenied(path + " is not a directory");
  if (st.st_uid != ::geteuid() || (st.st_mode & 022) != 0)
    return PermissionDenied("directory " + Describe(path, st) +
                            " is not trusted: it must be owned by uid " +
                            std::to_string(::geteuid()) + " and not writable by group or others");
  return Status::Ok();
}

// A directory above it: ours or root's, and writable by others only if sticky.
Status CheckAncestor(const std::string& path, const struct stat& st) {
  if (!S_ISDIR(st.st_mode)) return PermissionDenied(path + " is not a directory");
  const bool owner_ok = st.st_uid == 0 || st.st_uid == ::geteuid();
  const bool write_ok = (st.st_mode & 022) == 0 || (st.st_mode & S_ISVTX) != 0;
  if (!owner_ok || !write_ok)
    return PermissionDenied(
        "directory " + Describe(path, st) +
        " is not trusted: a directory above a socket or run directory must be owned "
        "by root or uid " +
        std::to_string(::geteuid()) + " and writable only by its owner unless sticky");
  return Status::Ok();
}

// The entry `name` in `parent` that was just opened (following a symlink, if
// it is one) as the directory `opened`. A symlink above the target may be
// followed only if root or we own it: whoever owns a symlink can re-point it
// later (a sticky /tmp keeps others from removing ours, not their own), so a
// path through another user's link is theirs to redirect. Looked at after the
// open and compared with what was opened, so that an entry swapped between
// the two is caught: a non-link entry must be the very directory opened.
Status CheckAncestorEntry(int parent, const std::string& name, const std::string& path,
                          const struct stat& opened) {
  struct stat entry;
  if (::fstatat(parent, name.c_str(), &entry, AT_SYMLINK_NOFOLLOW) != 0)
    return ErrnoError("lstat " + path, errno);
  if (S_ISLNK(entry.st_mode)) {
    if (entry.st_uid != 0 && entry.st_uid != ::geteuid())
      return PermissionDenied(
          "directory " + path + " is a symbolic link owned by uid " + std::to_string(entry.st_uid) +
          ", who could re-point it; a symbolic link above a socket or run directory must be "
          "owned by root or uid " +
          std::to_string(::geteuid()));
    return Status::Ok();
  }
  if (entry.st_dev != opened.st_dev || entry.st_ino != opened.st_ino)
    return Unavailable("directory " + path + " changed while it was being checked");
  return Status::Ok();
}

std::vector<std::string> Components(const std::string& path) {
  std::vector<std::string> parts;
  size_t i = 0;
  while (i < path.size()) {
    while (i < path.size() && path[i] == '/') ++i;
    size_t j = i;
    while (j < path.size() && path[j] != '/') ++j;
    // "." adds nothing to a path; dropped so that "dir/." is checked as the
    // directory itself rather than as an ancestor.
    if (j > i && path.compare(i, j - i, ".") != 0) parts.push_back(path.substr(i, j - i));
    i = j;
  }
  return parts;
}

}  // namespace

Status EnsureTrustedDirectory(const std::string& dir, mode_t mode) {
  return OpenTrustedDirectory(dir, mode).status();
}

Result<UniqueFd> OpenTrustedDirectory(const std::string& dir_in, mode_t mode) {
  if (dir_in.empty()) return InvalidArgument("empty directory path");
  std::string dir = dir_in;
  if (dir[0] != '/') {
    char cwd[4096];
    if (::getcwd(cwd, sizeof cwd) == nullptr) return ErrnoError("getcwd", errno);
    dir = std::string(cwd) + "/" + dir;
  }
  const std::vector<std::string> parts = Components(dir);
  for (const std::string& p : parts)
    if (p == "..") return InvalidArgument("directory path " + dir_in + " contains '..'");
  UniqueFd at(::open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!at) return ErrnoError("opening /", errno);
  std::string path;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    path += "/" + parts[i];
    // Directories above may be symlinks owned by root or us (their targets
    // are checked too); the directory itself may not be one. O_PATH for those above: they need only
    // be searchable (as a 0711 home directory is), not readable.
    const int flags = O_DIRECTORY | O_CLOEXEC | (last ? O_RDONLY | O_NOFOLLOW : O_PATH);
    int fd = ::openat(at.get(), parts[i].c_str(), flags);
    if (fd < 0 && errno == ENOENT) {
      if (::mkdirat(at.get(), parts[i].c_str(), mode) != 0 && errno != EEXIST)
        return ErrnoError("creating directory " + path, errno);
      fd = ::openat(at.get(), parts[i].c_str(), flags);
    }
    if (fd < 0) {
      const int err = errno;
      if (last && (err == ELOOP || err == ENOTDIR)) {
        struct stat st;
        if (::fstatat(at.get(), parts[i].c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
            S_ISLNK(st.st_mode))
          return PermissionDenied("directory " + Describe(path, st) +
                                  " is a symbolic link; refusing it");
        return PermissionDenied(path + " is not a directory");
      }
      return ErrnoError("opening directory " + path, err);
    }
    UniqueFd next(fd);
    struct stat st;
    if (::fstat(next.get(), &st) != 0) return ErrnoError("fstat " + path, errno);
    RETURN_IF_ERROR(last ? CheckOwnDirectory(path, st) : CheckAncestor(path, st));
    if (!last) RETURN_IF_ERROR(CheckAncestorEntry(at.get(), parts[i], path, st));
    at = std::move(next);
  }
  if (parts.empty()) return InvalidArgument("refusing / as a socket or run directory");
  return at;
}

Result<std::string> MakePrivateDirectory(std::string_view prefix, size_t max_length) {
  const size_t name_length = 1 + prefix.size() + 6;  // "/<prefix>XXXXXX"
  std::string base = "/tmp";
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && xdg[0] == '/') {
    const std::string candidate = std::string(xdg) + "/hearth";
    const bool fits = max_length == 0 || candidate.size() + name_length <= max_length;
    if (fits && EnsureTrustedDirectory(candidate, 0700).ok()) base = candidate;
  }
  if (max_length != 0 && base.size() + name_length > max_length)
    return InvalidArgument("a private directory " + base + "/" + std::string(prefix) +
                           "XXXXXX would be longer than " + std::to_string(max_length) + " bytes");
  std::string templ = base + "/" + std::string(prefix) + "XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr)
    return ErrnoError("creating a private directory in " + base, errno);
  // mkdtemp made it 0700 and ours; check the chain above it too.
  if (Status s = EnsureTrustedDirectory(templ, 0700); !s.ok()) {
    ::rmdir(templ.c_str());
    return s;
  }
  return templ;
}

Result<PeerCredentials> GetPeerCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return ErrnoError("SO_PEERCRED", errno);
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

Status CheckPeerTrusted(int fd, std::span<const uint32_t> trusted_uids, std::string_view what) {
  ASSIGN_OR_RETURN(PeerCredentials peer, GetPeerCredentials(fd));
  const uid_t me = ::geteuid();
  if (peer.uid == me || peer.uid == 0 ||
      std::find(trusted_uids.begin(), trusted_uids.end(), peer.uid) != trusted_uids.end())
    return Status::Ok();
  return PermissionDenied(
      std::string(what) + " runs as uid " + std::to_string(peer.uid) + " (pid " +
      std::to_string(peer.pid) + "), which is not ours (" + std::to_string(me) +
      "), root, or a trusted store uid (--store-uid / HEARTH_STORE_UID); refusing it");
}

}  // namespace hearth
