// The store's socket file: its directory checked and opened once, the name
// checked for another store or a file that is not ours, the listening socket
// bound under it race-free, and the file removed if it is still ours.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth::store {

// The socket's directory, opened once by the walk that checked it. Every
// later operation on the socket file goes through this descriptor, so that
// what was checked is what is used, whatever happens to the path.
struct SocketFile {
  std::string path;  // as given, for messages and for clients
  std::string dir_path;
  std::string name;
  UniqueFd dir;
  bool bound = false;
  dev_t dev = 0;
  ino_t ino = 0;

  // A path for bind/connect that names `entry` inside the opened directory
  // without resolving dir_path again: /proc/self/fd/N/entry where /proc is
  // there and the result fits sun_path, else dir_path/entry (the directory
  // and every one above it passed the trust check, so only our uid or root
  // could change what it resolves to).
  std::string Within(const std::string& entry) const;
};

// Checks and opens (creating it 0750 if missing) the directory of `path`.
Result<SocketFile> OpenSocketFile(const std::string& path);

// Whether something is at the socket's name: nothing (false), a stale socket
// nobody answers on (true), or an error for anything else: another store that
// answers, or a file that is not a socket (never replaced: it is not ours to
// remove).
Result<bool> CheckSocketName(const SocketFile& f);

// Binds the listening socket at f.name, race-free: bind(2) cannot take a
// directory descriptor and fchmod(2) of an AF_UNIX socket does not reach the
// file bind creates, so the socket is bound under a temporary name inside the
// checked directory, given its mode there, made to listen, and only then
// renamed to its name. Nobody but our uid (or root) can touch entries of that
// directory, so the chmod reaches the file bind made; the rename replaces a
// stale socket atomically and never follows or removes anything outside the
// directory; and the name never shows a socket with the wrong mode or one
// that does not listen yet.
Result<UniqueFd> BindSocket(SocketFile& f, mode_t mode);

// Removes the socket file if it is still the one this store bound.
void RemoveSocketFile(SocketFile& f);

}  // namespace hearth::store
