// The user behind a TCP connection that a process on this machine opened,
// read from the kernel's socket table (NETLINK_SOCK_DIAG, what `ss -e`
// shows): the uid that created the client's socket. Shared memory is
// granted by it (server/shared_memory.h): a client may name only objects
// that its own user owns.
//
// Only connections whose client end is a socket in this network namespace
// have one; a client on another machine, or behind NAT into this one, has
// none. A local proxy's connections carry the proxy's user.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "hearth/status.h"

namespace hearth {

// A connection as the server's end sees it.
struct ClientConnection {
  std::string address;       // the client's IP address, numeric; empty: unknown
  uint16_t port = 0;         // the client's port
  uint16_t server_port = 0;  // the server's port that it connected to
};

// The uid of the client's socket. PermissionDenied, naming the connection,
// when no socket of this machine is the client's end (or the address is
// unknown); an error of the netlink socket itself otherwise.
Result<uid_t> LocalPeerUid(const ClientConnection& connection);

}  // namespace hearth
