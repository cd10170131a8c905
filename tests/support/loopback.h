// Test support: TCP over loopback inside the test process, and a
// connection as a front-end's end of it sees it (server/local_peer.h).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>

#include "gtest/gtest.h"
#include "hearth/unique_fd.h"
#include "server/local_peer.h"

namespace hearth::testing {

// A socket listening on 127.0.0.1, any free port.
struct LoopbackListener {
  UniqueFd fd;
  sockaddr_in address{};
  uint16_t port = 0;

  LoopbackListener() {
    fd.Reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&address), length), 0);
    EXPECT_EQ(::listen(fd.get(), 4), 0);
    EXPECT_EQ(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length), 0);
    port = ntohs(address.sin_port);
  }

  // Accepts the next connection into `accepted`; the connection as the
  // server's end sees it.
  ClientConnection Accept(UniqueFd* accepted) const {
    accepted->Reset(::accept4(fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
    sockaddr_in peer{};
    socklen_t length = sizeof(peer);
    EXPECT_EQ(::getpeername(accepted->get(), reinterpret_cast<sockaddr*>(&peer), &length), 0);
    char text[INET_ADDRSTRLEN] = "";
    ::inet_ntop(AF_INET, &peer.sin_addr, text, sizeof(text));
    return {text, ntohs(peer.sin_port), port};
  }
};

// A connection of this process to itself: what a front-end passes on for a
// client of this process's user.
struct LoopbackLink {
  LoopbackListener listener;
  UniqueFd client_end;
  UniqueFd server_end;
  ClientConnection client;

  LoopbackLink() {
    client_end.Reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    EXPECT_EQ(::connect(client_end.get(), reinterpret_cast<const sockaddr*>(&listener.address),
                        sizeof(listener.address)),
              0);
    client = listener.Accept(&server_end);
  }
};

}  // namespace hearth::testing
