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
  if (S_ISCHR(mode)) return "a character device";
#ifndef _WIN32
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
#endif
  return "not a regular file";
}

#ifndef _WIN32
// Opens `path` read-only and close-on-exec if it is a regular file; else
// InvalidArgument naming the path and what it is, without having opened it.
// The path is resolved once, by an O_PATH open (which runs no driver's open
// and never blocks on a FIFO); that descriptor's inode is checked with fstat
// and then opened for reading through /proc/self/fd, which reopens that very
// inode rather than resolving the path again. So a file swapped in at `path`
// after the check (a device behind a symlink, by someone who can write the
// directory) is never opened. `st` receives the file's metadata.
inline Result<UniqueFd> OpenRegularFile(const std::string& path, struct stat* st) {
  UniqueFd handle(::open(path.c_str(), O_PATH | O_CLOEXEC));
  if (!handle) {
    const int err = errno;
    if (err == ELOOP) return InvalidArgument(path + ": a loop of symbolic links");
    return ErrnoError(path, err);
  }
  struct stat checked {};
  if (::fstat(handle.get(), &checked) != 0) return ErrnoError("fstat " + path, errno);
  if (!S_ISREG(checked.st_mode))
    return InvalidArgument(path + ": is " + FileTypeName(checked.st_mode) + ", not a regular file");
  const std::string reopen = "/proc/self/fd/" + std::to_string(handle.get());
  UniqueFd fd(::open(reopen.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY));
  if (!fd) return ErrnoError("open " + path + " (through " + reopen + ")", errno);
  if (::fstat(fd.get(), st) != 0) return ErrnoError("fstat " + path, errno);
  if (st->st_dev != checked.st_dev || st->st_ino != checked.st_ino)
    return InvalidArgument(path + ": changed while it was opened");
  return fd;
}
#endif

}  // namespace hearth
