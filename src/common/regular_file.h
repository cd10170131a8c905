// Opening a file named by a configuration (a checkpoint, a model config)
// without letting what sits at that path hurt the process: a FIFO would block
// open() forever, a device could do anything on open, a directory reads as an
// error deep inside a parser. Symbolic links are followed (checkpoint caches
// are trees of links) but what they lead to must be a regular file.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

// "a directory", "a FIFO", ...: what a file that is not regular is, for messages.
inline const char* FileTypeName(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

// Opens `path` read-only and close-on-exec if it is a regular file; else
// InvalidArgument naming the path and what it is, without having opened it
// (stat first, so a device never sees an open). The open itself is
// O_NONBLOCK, so that a FIFO swapped in after the stat cannot block it, and
// is checked again with fstat; O_NONBLOCK is cleared before returning.
// `st` receives the file's metadata.
inline Result<UniqueFd> OpenRegularFile(const std::string& path, struct stat* st) {
  struct stat before {};
  if (::stat(path.c_str(), &before) != 0) {
    const int err = errno;
    if (err == ELOOP) return InvalidArgument(path + ": a loop of symbolic links");
    return ErrnoError(path, err);
  }
  if (!S_ISREG(before.st_mode))
    return InvalidArgument(path + ": is " + FileTypeName(before.st_mode) + ", not a regular file");
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd) return ErrnoError("open " + path, errno);
  if (::fstat(fd.get(), st) != 0) return ErrnoError("fstat " + path, errno);
  if (!S_ISREG(st->st_mode) || st->st_dev != before.st_dev || st->st_ino != before.st_ino)
    return InvalidArgument(path + ": changed while it was opened (now " +
                           FileTypeName(st->st_mode) + ")");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
    return ErrnoError("fcntl " + path, errno);
  return fd;
}

}  // namespace hearth
