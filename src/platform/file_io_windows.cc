// File operations on Windows (file_io.h).
#include <windows.h>
// after windows.h
#include <direct.h>
#include <io.h>

#include <cerrno>

#include "platform/file_io.h"

namespace hearth::platform {
namespace {

// The descriptor's handle, or null with errno EBADF.
HANDLE HandleOf(int fd) {
  const intptr_t h = ::_get_osfhandle(fd);
  if (h == -1) {
    errno = EBADF;
    return nullptr;
  }
  return reinterpret_cast<HANDLE>(h);
}

OVERLAPPED At(uint64_t offset) {
  OVERLAPPED o{};
  o.Offset = static_cast<DWORD>(offset & 0xffffffffu);
  o.OffsetHigh = static_cast<DWORD>(offset >> 32);
  return o;
}

// One call moves at most this much (DWORD counts).
DWORD Chunk(size_t size) { return static_cast<DWORD>(size < (1u << 30) ? size : (1u << 30)); }

}  // namespace

ssize_t ReadAt(int fd, void* buffer, size_t size, uint64_t offset) {
  const HANDLE h = HandleOf(fd);
  if (h == nullptr) return -1;
  OVERLAPPED o = At(offset);
  DWORD got = 0;
  if (!::ReadFile(h, buffer, Chunk(size), &got, &o)) {
    if (::GetLastError() == ERROR_HANDLE_EOF) return 0;
    errno = EIO;
    return -1;
  }
  return static_cast<ssize_t>(got);
}

ssize_t WriteAt(int fd, const void* buffer, size_t size, uint64_t offset) {
  const HANDLE h = HandleOf(fd);
  if (h == nullptr) return -1;
  OVERLAPPED o = At(offset);
  DWORD put = 0;
  if (!::WriteFile(h, buffer, Chunk(size), &put, &o)) {
    errno = ::GetLastError() == ERROR_DISK_FULL ? ENOSPC : EIO;
    return -1;
  }
  return static_cast<ssize_t>(put);
}

int RenameReplacing(const char* from, const char* to) {
  if (::MoveFileExA(from, to, MOVEFILE_REPLACE_EXISTING)) return 0;
  errno = ::GetLastError() == ERROR_ACCESS_DENIED ? EACCES : EIO;
  return -1;
}

int MakeDirectory(const char* path) { return ::_mkdir(path); }

int OpenUnnamed(const char*) {
  errno = ENOTSUP;
  return -1;
}

int NameUnnamed(int, const char*) {
  errno = ENOTSUP;
  return -1;
}

}  // namespace hearth::platform
