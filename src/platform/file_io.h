// Positional reads and writes of a file descriptor, and the few file
// operations whose meaning differs between the systems, for the checkpoint
// reader and writer (one code on both).
//
//   Linux    pread, pwrite, rename, mkdir(path, mode).
//   Windows  the descriptor's handle (_get_osfhandle) read and written with
//            an OVERLAPPED offset (safe from several threads at once);
//            rename replaces an existing target (MoveFileExA with
//            MOVEFILE_REPLACE_EXISTING), as rename(2) does.
//
// Each returns what its POSIX model returns and sets errno as it does.
#pragma once

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
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#endif

namespace hearth::platform {

#ifdef _WIN32
ssize_t ReadAt(int fd, void* buffer, size_t size, uint64_t offset);
ssize_t WriteAt(int fd, const void* buffer, size_t size, uint64_t offset);
int RenameReplacing(const char* from, const char* to);
int MakeDirectory(const char* path);
#else
inline ssize_t ReadAt(int fd, void* buffer, size_t size, uint64_t offset) {
  return ::pread(fd, buffer, size, static_cast<off_t>(offset));
}
inline ssize_t WriteAt(int fd, const void* buffer, size_t size, uint64_t offset) {
  return ::pwrite(fd, buffer, size, static_cast<off_t>(offset));
}
inline int RenameReplacing(const char* from, const char* to) { return std::rename(from, to); }
inline int MakeDirectory(const char* path) { return ::mkdir(path, 0755); }
#endif

}  // namespace hearth::platform
