// The user behind a TCP connection is the uid of the client's socket,
// found in the kernel's socket table: this process's own for its own
// connections, another user's for a connection that user's process made,
// and none for an address and port that no socket here has.
#include "server/local_peer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gtest/gtest.h"
#include "hearth/unique_fd.h"
#include "support/loopback.h"

namespace hearth {
namespace {

using Listener = testing::LoopbackListener;

TEST(LocalPeer, AConnectionOfThisProcessHasItsUser) {
  Listener listener;
  UniqueFd client(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_EQ(::connect(client.get(), reinterpret_cast<const sockaddr*>(&listener.address),
                      sizeof(listener.address)),
            0);
  UniqueFd accepted;
  const ClientConnection c = listener.Accept(&accepted);
  Result<uid_t> uid = LocalPeerUid(c);
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  EXPECT_EQ(*uid, ::geteuid());
  // Another port of the same address: no such connection.
  ClientConnection other = c;
  other.port = c.port == 65535 ? 1 : c.port + 1;
  EXPECT_EQ(LocalPeerUid(other).status().code(), StatusCode::kPermissionDenied);
}

TEST(LocalPeer, NoSocketNoUser) {
  Listener listener;
  // Port 1 to the listener: nothing here connected from it.
  Result<uid_t> uid = LocalPeerUid({"127.0.0.1", 1, listener.port});
  EXPECT_EQ(uid.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(uid.status().message().find("does not come from a process on this machine"),
            std::string::npos)
      << uid.status().message();
  EXPECT_EQ(LocalPeerUid({}).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(LocalPeerUid({"not an address", 5, 6}).status().code(), StatusCode::kPermissionDenied);
}

TEST(LocalPeer, AnotherUsersConnectionHasThatUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to connect as another user";
  Listener listener;
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  int hold[2];
  ASSERT_EQ(::pipe2(hold, O_CLOEXEC), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // No CUDA and no threads of ours touched here: a plain socket as uid 12345.
    ::close(hold[1]);
    ::close(ready[0]);
    if (::setgid(12345) != 0 || ::setuid(12345) != 0) ::_exit(2);
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(s, reinterpret_cast<const sockaddr*>(&listener.address),
                  sizeof(listener.address)) != 0)
      ::_exit(3);
    char byte = 1;
    if (::write(ready[1], &byte, 1) != 1) ::_exit(4);
    // Holds the connection open until the parent has looked.
    ssize_t unused = ::read(hold[0], &byte, 1);
    (void)unused;
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(hold[0]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  UniqueFd accepted;
  const ClientConnection c = listener.Accept(&accepted);
  Result<uid_t> uid = LocalPeerUid(c);
  ::close(hold[1]);
  int status = 0;
  ::waitpid(child, &status, 0);
  ::close(ready[0]);
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  EXPECT_EQ(*uid, 12345u);
}

}  // namespace
}  // namespace hearth
