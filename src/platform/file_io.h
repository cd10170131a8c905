// Positional reads and writes of a file descriptor, and the few file
// operations whose meaning differs between the systems, for the checkpoint
// reader and writer (one code on both).
//
//   Linux    pread, pwrite, rename, mkdir(path, mode); a file with no name
//            (O_TMPFILE), named by linkat once written.
//   Windows  the descriptor's handle (_get_osfhandle) read and written with
//            an OVERLAPPED offset (safe from several threads at once);
//            rename replaces an existing target (MoveFileExA with
//            MOVEFILE_REPLACE_EXISTING), as rename(2) does; no file
//            without a name (OpenUnnamed fails with ENOTSUP).
//
// Each returns what its POSIX model returns and sets errno as it does.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>

#ifdef _WIN32
#include <fcntl.h>
#include <sys/types.h>

// Descriptors that a spawned process does not inherit, read and written as
// bytes (no text mode), as O_CLOEXEC files are on Linux; O_NOCTTY means
// nothing here.
#ifndef O_CLOEXEC
#define O_CLOEXEC (_O_BINARY | _O_NOINHERIT)
#endif
#ifndef O_NOCTTY
#define O_NOCTTY 0
#endif
#else
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#endif

namespace hearth::platform {

// OpenUnnamed(dir): a file with no name in directory `dir`, open for
// writing (0644 before the umask), that no one else can open and that
// vanishes if the process dies before NameUnnamed gives it a name. -1 with
// errno: ENOTSUP, EOPNOTSUPP, EISDIR or EINVAL where the system or file
// system has no such files (write a named temporary instead), else the
// directory's error.
// NameUnnamed(fd, path): gives that file the name `path`, which must not
// exist (through /proc/self/fd, else AT_EMPTY_PATH).
// Whether OpenUnnamed's errno says the system has no such files:
inline bool NoUnnamedFiles(int error) {
  return error == ENOTSUP || error == EOPNOTSUPP || error == EISDIR || error == EINVAL;
}

#ifdef _WIN32
ssize_t ReadAt(int fd, void* buffer, size_t size, uint64_t offset);
ssize_t WriteAt(int fd, const void* buffer, size_t size, uint64_t offset);
int RenameReplacing(const char* from, const char* to);
int MakeDirectory(const char* path);
int OpenUnnamed(const char* dir);
int NameUnnamed(int fd, const char* path);
#else
inline ssize_t ReadAt(int fd, void* buffer, size_t size, uint64_t offset) {
  return ::pread(fd, buffer, size, static_cast<off_t>(offset));
}
inline ssize_t WriteAt(int fd, const void* buffer, size_t size, uint64_t offset) {
  return ::pwrite(fd, buffer, size, static_cast<off_t>(offset));
}
inline int RenameReplacing(const char* from, const char* to) { return std::rename(from, to); }
inline int MakeDirectory(const char* path) { return ::mkdir(path, 0755); }
inline int OpenUnnamed(const char* dir) {
  return ::open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
}
inline int NameUnnamed(int fd, const char* path) {
  char proc[64];
  std::snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  if (::linkat(AT_FDCWD, proc, AT_FDCWD, path, AT_SYMLINK_FOLLOW) == 0) return 0;
  const int error = errno;
  if (::linkat(fd, "", AT_FDCWD, path, AT_EMPTY_PATH) == 0) return 0;
  if (error != ENOENT) errno = error;  // /proc's answer, unless it is not mounted
  return -1;
}
#endif

}  // namespace hearth::platform
