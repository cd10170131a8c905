#include "store/socket_file.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/trusted_path.h"

namespace hearth::store {
namespace {

Status FillAddress(const std::string& path, sockaddr_un* addr) {
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr->sun_path)
    return InvalidArgument("socket path '" + path + "' is empty or longer than " +
                           std::to_string(sizeof addr->sun_path - 1) + " bytes");
  std::memcpy(addr->sun_path, path.c_str(), path.size() + 1);
  return Status::Ok();
}

const char* FileKind(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISFIFO(mode)) return "a FIFO";
  return "not a socket";
}

}  // namespace

std::string SocketFile::Within(const std::string& entry) const {
  const std::string proc = "/proc/self/fd/" + std::to_string(dir.get());
  struct stat st;
  if (proc.size() + 1 + entry.size() < sizeof(sockaddr_un::sun_path) &&
      ::stat(proc.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    return proc + "/" + entry;
  return dir_path + "/" + entry;
}

Result<SocketFile> OpenSocketFile(const std::string& path) {
  sockaddr_un addr;
  RETURN_IF_ERROR(FillAddress(path, &addr));
  const std::filesystem::path absolute = std::filesystem::absolute(path);
  SocketFile f;
  f.path = path;
  f.name = absolute.filename().string();
  f.dir_path = absolute.parent_path().string();
  if (f.name.empty() || f.name == "." || f.name == "..")
    return InvalidArgument("socket path '" + path + "' does not end in a file name");
  ASSIGN_OR_RETURN(f.dir, OpenTrustedDirectory(f.dir_path, 0750));
  return f;
}

Result<bool> CheckSocketName(const SocketFile& f) {
  struct stat st;
  if (::fstatat(f.dir.get(), f.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return false;
    return ErrnoError("checking " + f.path, errno);
  }
  if (!S_ISSOCK(st.st_mode))
    return AlreadyExists("socket path " + f.path + " exists and is " + FileKind(st.st_mode) +
                         ", not a socket; refusing to replace it");
  sockaddr_un addr;
  RETURN_IF_ERROR(FillAddress(f.Within(f.name), &addr));
  // Non-blocking: a live store whose backlog is full answers EAGAIN instead
  // of making this wait.
  UniqueFd probe(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe) return ErrnoError("socket", errno);
  if (::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 ||
      errno == EAGAIN || errno == EINPROGRESS)
    return AlreadyExists("another store is serving at " + f.path);
  return true;
}

Result<UniqueFd> BindSocket(SocketFile& f, mode_t mode) {
  const std::string temp = "." + f.name + "." + std::to_string(::getpid()) + ".new";
  ::unlinkat(f.dir.get(), temp.c_str(), 0);  // a leftover of a crashed store with our pid
  sockaddr_un addr;
  RETURN_IF_ERROR(FillAddress(f.Within(temp), &addr));
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) return ErrnoError("socket", errno);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    return ErrnoError("bind " + f.dir_path + "/" + temp, errno);
  auto fail = [&](const std::string& what, int err) {
    ::unlinkat(f.dir.get(), temp.c_str(), 0);
    return ErrnoError(what, err);
  };
  if (::fchmodat(f.dir.get(), temp.c_str(), mode & 0777, 0) != 0)
    return fail("chmod " + f.dir_path + "/" + temp, errno);
  if (::listen(fd.get(), 128) != 0) return fail("listen " + f.path, errno);
  for (int attempt = 0;; ++attempt) {
    Result<bool> stale = CheckSocketName(f);
    if (!stale.ok()) {
      ::unlinkat(f.dir.get(), temp.c_str(), 0);
      return stale.status();
    }
    if (*stale) spdlog::info("replacing the stale socket {}", f.path);
    const unsigned flags = *stale ? 0 : RENAME_NOREPLACE;
    if (::renameat2(f.dir.get(), temp.c_str(), f.dir.get(), f.name.c_str(), flags) == 0) break;
    // EEXIST: another store took the name since the check; look again once.
    if (errno != EEXIST || attempt > 0) return fail("renaming the socket into " + f.path, errno);
  }
  struct stat st;
  if (::fstatat(f.dir.get(), f.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    f.dev = st.st_dev;
    f.ino = st.st_ino;
  }
  f.bound = true;
  return fd;
}

void RemoveSocketFile(SocketFile& f) {
  if (!f.bound) return;
  f.bound = false;
  struct stat st;
  if (::fstatat(f.dir.get(), f.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      S_ISSOCK(st.st_mode) && st.st_dev == f.dev && st.st_ino == f.ino)
    ::unlinkat(f.dir.get(), f.name.c_str(), 0);
}

}  // namespace hearth::store
