// Directories and peers hearth may trust.
//
// A socket or run directory is trusted when it is a real directory (not a
// symlink) owned by us and writable by nobody else, and every directory above
// it is owned by us or root and writable only by its owner unless it is sticky
// (as /tmp is). Another local user can then neither rename our sockets away
// nor put theirs in their place. A peer on a Unix socket is trusted when its
// SO_PEERCRED uid is ours, root, or one the caller names.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

// Creates `dir` and any missing parents with `mode` (e.g. 0700, or 0750 for a
// store socket directory shared with a group), then checks the chain as
// described above. PermissionDenied naming the path, its owner and its mode
// when a directory in it is not trusted.
Status EnsureTrustedDirectory(const std::string& dir, mode_t mode);

// The same, returning the directory opened (O_DIRECTORY|O_NOFOLLOW) by the
// walk that checked it, so that the caller can work inside it through the
// descriptor (openat, renameat, "/proc/self/fd/N/NAME") and never resolve the
// path again.
Result<UniqueFd> OpenTrustedDirectory(const std::string& dir, mode_t mode);

// A new directory of our own, mode 0700, made with mkdtemp (an unpredictable
// name that did not exist before): `$XDG_RUNTIME_DIR/hearth/<prefix>XXXXXX`
// when $XDG_RUNTIME_DIR is set and trusted and that path is at most
// `max_length` bytes (0: no limit), else `/tmp/<prefix>XXXXXX`. A caller that
// binds sockets inside passes what sun_path leaves after its longest name.
Result<std::string> MakePrivateDirectory(std::string_view prefix, size_t max_length = 0);

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

Result<PeerCredentials> GetPeerCredentials(int fd);

// OK when the peer on the connected socket `fd` runs as our effective uid,
// as root, or as one of `trusted_uids`; else PermissionDenied naming `what`,
// the peer's pid and uid.
Status CheckPeerTrusted(int fd, std::span<const uint32_t> trusted_uids, std::string_view what);

}  // namespace hearth
