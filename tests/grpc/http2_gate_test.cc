// The gRPC port's gate, with this test in grpc++'s place: it is handed each
// connection's socketpair end and reads what the gate relays. A client that
// keeps too many streams open, resets streams too fast or does not speak
// HTTP/2 is closed (and the others are not); one opening streams faster than
// its rate is paced, and loses nothing; connections past the limit wait.
#include "grpc/http2_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hearth/unique_fd.h"
#include "support/eventually.h"

namespace hearth {
namespace {

constexpr char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

std::string Frame(uint8_t type, uint8_t flags, uint32_t stream, const std::string& payload = "") {
  std::string f;
  const uint32_t n = static_cast<uint32_t>(payload.size());
  f += static_cast<char>(n >> 16);
  f += static_cast<char>(n >> 8);
  f += static_cast<char>(n);
  f += static_cast<char>(type);
  f += static_cast<char>(flags);
  f += static_cast<char>(stream >> 24);
  f += static_cast<char>(stream >> 16);
  f += static_cast<char>(stream >> 8);
  f += static_cast<char>(stream);
  return f + payload;
}
std::string Headers(uint32_t stream) { return Frame(0x1, 0x4, stream, "\x83\x86\x84"); }
std::string Reset(uint32_t stream) { return Frame(0x3, 0, stream, std::string("\0\0\0\x8", 4)); }
std::string Settings() { return Frame(0x4, 0, 0); }

// A gate whose connections this test plays grpc++ for.
class GateTest : public ::testing::Test {
 protected:
  void Open(Http2GateLimits limits) {
    auto gate = Http2Gate::Listen("127.0.0.1", 0, limits, [this](int fd) {
      std::lock_guard lock(mu_);
      adopted_.emplace_back(fd);
    });
    ASSERT_TRUE(gate.ok()) << gate.status().ToString();
    gate_ = std::move(*gate);
    gate_->Start();
  }

  UniqueFd Connect() const {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(gate_->port());
    EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  }

  // grpc++'s end of the connection accepted `k`-th.
  int Adopted(size_t k) {
    EXPECT_TRUE(Eventually([&] {
      std::lock_guard lock(mu_);
      return adopted_.size() > k;
    }));
    std::lock_guard lock(mu_);
    return adopted_.size() > k ? adopted_[k].get() : -1;
  }

  static void Send(int fd, const std::string& bytes) {
    ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }

  // Reads until `n` bytes came or the peer closed; what came.
  static std::string Read(int fd, size_t n) {
    std::string out;
    char buffer[65536];
    while (out.size() < n) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 60'000) != 1) break;
      const ssize_t got = ::recv(fd, buffer, std::min(sizeof(buffer), n - out.size()), 0);
      if (got <= 0) break;
      out.append(buffer, static_cast<size_t>(got));
    }
    return out;
  }

  // True once the peer of `fd` has closed (end of file or a reset).
  static bool Closed(int fd) {
    char buffer[65536];
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 60'000) != 1) return false;
      const ssize_t got = ::recv(fd, buffer, sizeof(buffer), 0);
      if (got <= 0) return true;
    }
  }

  std::unique_ptr<Http2Gate> gate_;
  std::mutex mu_;
  std::vector<UniqueFd> adopted_;
};

TEST_F(GateTest, BytesPassBothWaysUnchanged) {
  Open({});
  UniqueFd client = Connect();
  const std::string up = std::string(kPreface) + Settings() + Headers(1) +
                         Frame(0x0, 0x1, 1, std::string(300'000, 'x'));  // past one buffer
  std::thread writer([&] { Send(client.get(), up); });
  const int grpc = Adopted(0);
  EXPECT_EQ(Read(grpc, up.size()), up);
  writer.join();
  const std::string down = Settings() + Frame(0x1, 0x5, 1, "\x88");
  Send(grpc, down);
  EXPECT_EQ(Read(client.get(), down.size()), down);
  // The client behind grpc's "fd:N" peer is this connection.
  std::optional<ClientConnection> who = gate_->Client("fd:" + std::to_string(grpc));
  ASSERT_TRUE(who.has_value());
  EXPECT_EQ(who->address, "127.0.0.1");
  EXPECT_EQ(who->server_port, gate_->port());
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  ASSERT_EQ(::getsockname(client.get(), reinterpret_cast<sockaddr*>(&local), &length), 0);
  EXPECT_EQ(who->port, ntohs(local.sin_port));
  EXPECT_FALSE(gate_->Client("ipv4:127.0.0.1:5").has_value());
}

TEST_F(GateTest, AClientKeepingTooManyStreamsOpenIsClosed) {
  Http2GateLimits limits;
  limits.max_open_streams = 8;
  Open(limits);
  UniqueFd client = Connect();
  Send(client.get(), std::string(kPreface) + Settings());
  const int grpc = Adopted(0);
  ASSERT_EQ(Read(grpc, 24 + 9).size(), 24u + 9);
  // Streams the server ends do not count: 20 opened and answered, each
  // answer sent once its stream has reached "grpc".
  for (uint32_t s = 1; s <= 39; s += 2) {
    Send(client.get(), Headers(s));
    ASSERT_EQ(Read(grpc, 12), Headers(s));
    Send(grpc, Frame(0x1, 0x5, s, "\x88"));  // trailers-only answer: END_STREAM
  }
  // Then 9 left open: one past the limit.
  for (uint32_t s = 41; s <= 57; s += 2) Send(client.get(), Headers(s));
  EXPECT_TRUE(Closed(client.get()));
  EXPECT_TRUE(Closed(grpc));
  EXPECT_EQ(gate_->stats().closed_open_streams, 1u);
  // Another client is served.
  UniqueFd other = Connect();
  Send(other.get(), std::string(kPreface) + Headers(1));
  EXPECT_EQ(Read(Adopted(1), 24 + 12), std::string(kPreface) + Headers(1));
}

TEST_F(GateTest, RapidResetsCloseTheConnection) {
  Http2GateLimits limits;
  limits.resets_per_second = 1;
  limits.reset_burst = 10;
  limits.streams_per_second = 1e9;
  limits.stream_burst = 1e9;
  Open(limits);
  UniqueFd client = Connect();
  std::string flood = std::string(kPreface) + Settings();
  for (uint32_t s = 1; s < 200; s += 2) flood += Headers(s) + Reset(s);
  ::send(client.get(), flood.data(), flood.size(), MSG_NOSIGNAL);  // may be cut short
  EXPECT_TRUE(Closed(client.get()));
  EXPECT_EQ(gate_->stats().closed_resets, 1u);
  EXPECT_TRUE(Eventually([&] { return gate_->stats().connections == 0; }));
}

TEST_F(GateTest, AClientThatIsNotHttp2IsClosed) {
  Open({});
  UniqueFd client = Connect();
  Send(client.get(), "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_TRUE(Closed(client.get()));
  EXPECT_EQ(gate_->stats().closed_handshake, 1u);
}

TEST_F(GateTest, StreamsPastTheRateArePacedNotLost) {
  Http2GateLimits limits;
  limits.streams_per_second = 2;
  limits.stream_burst = 2;
  Open(limits);
  UniqueFd client = Connect();
  std::string up = std::string(kPreface);
  for (uint32_t s = 1; s <= 9; s += 2) up += Headers(s);  // 5 streams: 3 past the burst
  Send(client.get(), up);
  EXPECT_TRUE(Eventually([&] { return gate_->stats().paced >= 1; }));
  EXPECT_EQ(Read(Adopted(0), up.size()), up);
  EXPECT_EQ(gate_->stats().connections, 1u);
}

TEST_F(GateTest, StreamsPastTheTotalWaitForOneToEnd) {
  Http2GateLimits limits;
  limits.max_total_open_streams = 4;
  Open(limits);
  UniqueFd a = Connect();
  Send(a.get(), std::string(kPreface) + Headers(1) + Headers(3) + Headers(5));
  const int grpc_a = Adopted(0);
  ASSERT_EQ(Read(grpc_a, 24 + 3 * 12).size(), 24u + 3 * 12);
  UniqueFd b = Connect();
  Send(b.get(), std::string(kPreface) + Headers(1) + Headers(3));
  const int grpc_b = Adopted(1);
  // One of b's fits; the other waits for room.
  ASSERT_EQ(Read(grpc_b, 24 + 12), std::string(kPreface) + Headers(1));
  EXPECT_TRUE(Eventually([&] { return gate_->stats().waited_total >= 1; }));
  Send(grpc_a, Frame(0x1, 0x5, 3, "\x88"));  // grpc ends one of a's streams
  EXPECT_EQ(Read(grpc_b, 12), Headers(3));
}

TEST_F(GateTest, AClosedConnectionsStreamsAreResetInGrpc) {
  Http2GateLimits limits;
  limits.max_open_streams = 2;
  Open(limits);
  UniqueFd client = Connect();
  Send(client.get(), std::string(kPreface) + Headers(1) + Headers(3));
  const int grpc = Adopted(0);
  ASSERT_EQ(Read(grpc, 24 + 2 * 12).size(), 24u + 2 * 12);
  Send(client.get(), Headers(5));  // one past the limit: closed
  EXPECT_TRUE(Closed(client.get()));
  // grpc is told to reset the two streams it holds (never the third).
  const std::string resets = Read(grpc, 2 * 13);
  EXPECT_EQ(resets.size(), 26u);
  EXPECT_NE(resets.find(std::string("\0\0\x04\x03\0\0\0\0\x01", 9)), std::string::npos);
  EXPECT_NE(resets.find(std::string("\0\0\x04\x03\0\0\0\0\x03", 9)), std::string::npos);
  // Once grpc has ended them (or after the drain time), the connection is gone.
  Send(grpc, Frame(0x3, 0, 1, std::string("\0\0\0\x8", 4)) +
                 Frame(0x3, 0, 3, std::string("\0\0\0\x8", 4)));
  EXPECT_TRUE(Eventually([&] { return gate_->stats().connections == 0; }));
  EXPECT_TRUE(Closed(grpc));
}

TEST_F(GateTest, ConnectionsPastTheLimitWaitInTheBacklog) {
  Http2GateLimits limits;
  limits.max_connections = 2;
  Open(limits);
  UniqueFd a = Connect();
  UniqueFd b = Connect();
  UniqueFd c = Connect();  // the kernel completes it; the gate does not take it yet
  Adopted(1);
  EXPECT_TRUE(Eventually([&] { return gate_->stats().accepted == 2; }));
  // The first connection ends on both sides: its client and "grpc".
  a.Reset();
  {
    std::lock_guard lock(mu_);
    adopted_[0].Reset();
  }
  EXPECT_TRUE(Eventually([&] { return gate_->stats().accepted == 3; }));
  EXPECT_EQ(gate_->stats().connections, 2u);
  Send(c.get(), kPreface);
  EXPECT_EQ(Read(Adopted(2), 24), kPreface);
}

}  // namespace
}  // namespace hearth
