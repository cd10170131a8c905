// What hostile clients can make a real `hearth store` hold: connections,
// descriptors sent and never read, unfinished messages, and the descriptor
// limit itself. Each case checks the bound and that the store still serves.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <regex>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "protocol/messages.h"
#include "support/raw_connection.h"
#include "support/test_store.h"

namespace hearth {
namespace {

using testing::AttachFrame;
using testing::Frame;
using testing::RawConnection;
using testing::StoreProcess;
using testing::StoreProcessOptions;
using testing::TempDir;
using Clock = std::chrono::steady_clock;

constexpr size_t kPerConnectionCap = 4;  // StoreOptions' default

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Attaches, retrying while the store is still catching up with closed
// connections (or backing off from a full descriptor table), for up to 20 s.
Result<std::unique_ptr<Attachment>> AttachWithin(const std::string& socket) {
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (;;) {
    auto a = AttachClient(socket).Attach("m");
    if (a.ok() || Clock::now() > deadline) return a;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The size of one manifest frame for model "m" of `socket`.
size_t ManifestFrameBytes(const std::string& socket) {
  auto a = AttachClient(socket).Attach("m");
  if (!a.ok()) return 0;
  return protocol::kFrameHeaderBytes + protocol::EncodeManifest((*a)->manifest()).size();
}

// Polls `pred` every 10 ms until it holds or `timeout` passes.
template <typename Pred>
bool Eventually(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// The store's own counters (status-v2), or an empty map if it did not answer.
std::map<std::string, uint64_t> Counters(const std::string& socket) {
  auto status = AttachClient(socket).GetStatus();
  return status.ok() ? status->counters : std::map<std::string, uint64_t>{};
}

uint64_t Counter(const std::string& socket, const std::string& name) {
  auto counters = Counters(socket);
  auto it = counters.find(name);
  return it == counters.end() ? 0 : it->second;
}

// Reads replies (blocking) until `count` arrived or one is not a manifest
// with a descriptor; returns how many did.
int ReadManifests(RawConnection& c, int count) {
  int got = 0;
  for (; got < count; ++got) {
    auto m = protocol::ReceiveMessage(c.fd());
    if (!m.ok() || m->type != protocol::MessageType::kManifest || !m->fd.valid()) break;
  }
  return got;
}

// Sends attach requests without reading an answer, until the socket takes no
// more or `most` were sent; returns how many were sent.
int FloodAttaches(RawConnection& c, int most) {
  const auto frame = AttachFrame("m");
  int sent = 0;
  while (sent < most && c.TrySend(frame, MSG_DONTWAIT) == 0) ++sent;
  return sent;
}

class StoreLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = dir_.File("model.safetensors");
    testing::WriteTestCheckpoint(model_, 3, 1000, 5);
    socket_ = dir_.File("run/store.sock");
  }
  std::unique_ptr<StoreProcess> Start(std::vector<std::string> args,
                                      StoreProcessOptions options = {}) {
    args.insert(args.begin(), {"--device", "cpu", "--model", "m=" + model_});
    return std::make_unique<StoreProcess>(socket_, args, options);
  }
  TempDir dir_;
  std::string model_;
  std::string socket_;
};

TEST_F(StoreLimitsTest, ConnectionsPastTheLimitAreAnsweredAndClosedAtOnce) {
  auto store = Start({"--max-connections", "4"});
  ASSERT_EQ(store->startup_error(), "");
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<RawConnection>(socket_));
    ASSERT_TRUE(held.back()->connected());
    // An answer proves the store admitted it.
    held.back()->SendRaw(protocol::EncodeFrames(protocol::MessageType::kListModels, {})[0]);
    auto m = protocol::ReceiveMessage(held.back()->fd());
    ASSERT_TRUE(m.ok() && m->type == protocol::MessageType::kModelList) << i;
  }
  // What the store holds with its 4 connections admitted, before any refusal.
  const int fds_admitted = testing::StableFdCount(store->pid());
  for (int i = 0; i < 200; ++i) {
    RawConnection extra(socket_);
    ASSERT_TRUE(extra.connected());
    const std::string error = extra.ExpectErrorAndClose();
    ASSERT_TRUE(Contains(error, "--max-connections")) << i << ": " << error;
  }
  auto refused = AttachClient(socket_).Attach("m");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
  // 200 refusals later the store holds what it held with its 4 connections
  // admitted, nothing more: a refused connection is closed just after its
  // answer (polled for).
  EXPECT_TRUE(Eventually([&] { return testing::CountFds(store->pid()) == fds_admitted; }))
      << testing::CountFds(store->pid()) << " descriptors, " << fds_admitted
      << " with the 4 connections admitted";

  held.pop_back();
  auto a = AttachWithin(socket_);
  EXPECT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE(store->alive());
}

TEST_F(StoreLimitsTest, AClientThatNeverReadsGetsNoMoreThanItsDescriptorCap) {
  auto store = Start({});
  ASSERT_EQ(store->startup_error(), "");
  const size_t frame_bytes = ManifestFrameBytes(socket_);
  ASSERT_GT(frame_bytes, 0u);
  const int fds_before = testing::StableFdCount(store->pid());

  RawConnection greedy(socket_);
  ASSERT_TRUE(greedy.connected());
  const int sent = FloodAttaches(greedy, 5000);
  ASSERT_GT(sent, static_cast<int>(4 * kPerConnectionCap));
  // The store says when it has stopped reading the connection for its cap:
  // from then on it reads nothing more of the flood, so what it holds now
  // is all it will hold.
  ASSERT_TRUE(Eventually([&] {
    auto c = Counters(socket_);
    return c["reads_paused_for_descriptors"] >= 1 && c["unread_descriptors"] == kPerConnectionCap;
  })) << store->output();
  const int fds = testing::CountFds(store->pid());
  EXPECT_LE(fds, fds_before + 1 + static_cast<int>(kPerConnectionCap));
  EXPECT_LE(greedy.UnreadBytes(), kPerConnectionCap * frame_bytes)
      << greedy.UnreadBytes() / frame_bytes << " answers wait unread";
  // Others are served meanwhile.
  EXPECT_TRUE(AttachClient(socket_).Attach("m").ok());
  // Once it reads, every request is answered: backpressure, not loss.
  EXPECT_EQ(ReadManifests(greedy, sent), sent);
  EXPECT_TRUE(store->alive());
}

TEST_F(StoreLimitsTest, UnreadDescriptorsAreCappedAcrossConnections) {
  // A descriptor limit of 48 makes the store-wide cap smaller than ten
  // connections' worth of their own caps; the store logs what it chose.
  StoreProcessOptions options;
  options.prefix = {"/usr/bin/prlimit", "--nofile=48", "--"};
  options.log_level = "info";
  if (::access(options.prefix[0].c_str(), X_OK) != 0) GTEST_SKIP() << "needs /usr/bin/prlimit";
  // Long enough that the greedy connections, which read late on purpose,
  // are never closed for it here.
  auto store =
      Start({"--unread-timeout-ms", "600000", "--attach-wait-timeout-ms", "600000"}, options);
  ASSERT_EQ(store->startup_error(), "");
  std::smatch match;
  const std::string output = store->output();
  ASSERT_TRUE(
      std::regex_search(output, match, std::regex(R"(limits: \d+ connections, (\d+) unread)")))
      << output;
  const size_t cap = std::stoul(match[1]);
  ASSERT_LT(cap, 10 * kPerConnectionCap) << "the test needs a store-wide cap below 10 x 4";
  const size_t frame_bytes = ManifestFrameBytes(socket_);
  ASSERT_GT(frame_bytes, 0u);

  std::vector<std::unique_ptr<RawConnection>> greedy;
  int sent = 0;
  for (int i = 0; i < 10; ++i) {
    greedy.push_back(std::make_unique<RawConnection>(socket_));
    ASSERT_TRUE(greedy.back()->connected());
    sent += FloodAttaches(*greedy.back(), 10);
  }
  ASSERT_EQ(sent, 100);
  ASSERT_TRUE(store->WaitForOutput("the limit; attach of m", std::chrono::seconds(20)))
      << store->output();
  // The cap is reached once the store's own count says so; from then on no
  // attach is answered until descriptors are read.
  ASSERT_TRUE(Eventually([&] {
    auto c = Counters(socket_);
    return c["unread_descriptors"] == cap && c["attaches_waiting"] >= 1;
  })) << store->output();
  size_t waiting = 0;
  for (const auto& c : greedy) waiting += c->UnreadBytes() / frame_bytes;
  EXPECT_LE(waiting, cap);
  // Requests other than attach are still answered.
  EXPECT_TRUE(AttachClient(socket_).ListModels().ok());
  // Each reads at once, as real clients do: one that waited for another to
  // read first could wait for ever, the cap being shared.
  std::vector<int> answered(greedy.size());
  std::vector<std::thread> readers;
  for (size_t i = 0; i < greedy.size(); ++i)
    readers.emplace_back([&, i] { answered[i] = ReadManifests(*greedy[i], 10); });
  for (std::thread& t : readers) t.join();
  for (size_t i = 0; i < greedy.size(); ++i) EXPECT_EQ(answered[i], 10) << "connection " << i;
  EXPECT_TRUE(AttachClient(socket_).Attach("m").ok());
}

TEST_F(StoreLimitsTest, UnfinishedMessagesStayWithinTheBudget) {
  constexpr size_t kBudget = 8u << 20;
  auto store = Start({"--max-partial-bytes", std::to_string(kBudget)});
  ASSERT_EQ(store->startup_error(), "");

  // 48 connections each announce a 16 MiB message and send 4 MiB of it:
  // 192 MiB that would all be held without the budget.
  const uint16_t attach = static_cast<uint16_t>(protocol::MessageType::kAttach);
  const uint32_t total = static_cast<uint32_t>(protocol::kMaxMessageBytes);
  std::vector<std::unique_ptr<RawConnection>> conns;
  int dropped = 0;
  for (int i = 0; i < 48; ++i) {
    conns.push_back(std::make_unique<RawConnection>(socket_));
    RawConnection& c = *conns.back();
    ASSERT_TRUE(c.connected());
    timeval timeout{10, 0};
    ::setsockopt(c.fd(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    for (uint32_t offset = 0; offset < (4u << 20); offset += protocol::kMaxFramePayload) {
      if (c.TrySend(
              Frame(protocol::kMagic, 1, attach, total, offset, protocol::kMaxFramePayload)) != 0) {
        ++dropped;
        const std::string error = c.ExpectErrorAndClose();
        EXPECT_TRUE(Contains(error, "--max-partial-bytes")) << error;
        break;
      }
    }
  }
  EXPECT_GT(dropped, 0);
  conns.clear();
  EXPECT_TRUE(AttachWithin(socket_).ok());
  // What the store itself charged: the most it ever held is the budget plus
  // the last step of the one message that went past it (a message's buffer
  // at most doubles, to at most the 4 MiB each connection sent), far below
  // the 192 MiB the connections sent; and every connection dropped was one
  // the store refused for the budget.
  auto c = Counters(socket_);
  EXPECT_LE(c["partial_bytes_peak"], kBudget + (4u << 20));
  EXPECT_GE(c["partial_rejections"], static_cast<uint64_t>(dropped));
  EXPECT_TRUE(Eventually([&] { return Counter(socket_, "partial_bytes") == 0; }));
  EXPECT_TRUE(store->alive());
}

// Past its descriptor limit the store stops polling its listener for a while
// instead of failing accept in a loop, logs about it once a second at most,
// and serves again when descriptors are free.
TEST_F(StoreLimitsTest, AcceptFailuresBackOffInsteadOfSpinning) {
  StoreProcessOptions options;
  options.prefix = {"/usr/bin/prlimit", "--nofile=32", "--"};
  if (::access(options.prefix[0].c_str(), X_OK) != 0) GTEST_SKIP() << "needs /usr/bin/prlimit";
  // A connection limit above the descriptor limit, so that accept(2) fails.
  auto store = Start({"--max-connections", "1000"}, options);
  ASSERT_EQ(store->startup_error(), "");

  std::vector<std::unique_ptr<RawConnection>> flood;
  for (int i = 0; i < 150; ++i) flood.push_back(std::make_unique<RawConnection>(socket_, true));
  // Four lines: the store has met the full descriptor table again and again.
  const std::string line = "not accepting for";
  ASSERT_TRUE(store->WaitForOutput(line, std::chrono::seconds(30), 4)) << store->output();
  flood.clear();
  auto a = AttachWithin(socket_);
  EXPECT_TRUE(a.ok()) << a.status().ToString();

  // Every failed accept paused the listener (a store that polled it again at
  // once would count failures far beyond its pauses), and every failure is a
  // log line or counted in a later line's "N similar lines left out".
  auto c = Counters(socket_);
  EXPECT_GE(c["accept_failures"], 4u);
  EXPECT_EQ(c["accept_failures"], c["accept_pauses"]);
  const std::string out = store->output();
  uint64_t logged = 0;
  std::regex pattern(R"(not accepting for (\d+) ms(?: \((\d+) similar lines left out\))?)");
  for (std::sregex_iterator it(out.begin(), out.end(), pattern), end; it != end; ++it) {
    logged += 1 + ((*it)[2].matched ? std::stoull((*it)[2]) : 0);
    const int backoff = std::stoi((*it)[1]);
    EXPECT_TRUE(backoff == 100 || backoff == 200 || backoff == 400 || backoff == 800 ||
                backoff == 1000)
        << backoff;
  }
  EXPECT_GE(logged, 4u);
  EXPECT_LE(logged, c["accept_failures"]) << out;
}

// A connection that reads every answer may still hold only so many leases.
TEST_F(StoreLimitsTest, LeasesPerConnectionAreCapped) {
  auto store = Start({"--max-leases-per-connection", "8"});
  ASSERT_EQ(store->startup_error(), "");
  RawConnection c(socket_);
  ASSERT_TRUE(c.connected());
  for (int i = 0; i < 8; ++i) {
    c.SendRaw(AttachFrame("m"));
    ASSERT_EQ(ReadManifests(c, 1), 1) << i;
  }
  for (int i = 0; i < 3; ++i) {
    c.SendRaw(AttachFrame("m"));
    auto m = protocol::ReceiveMessage(c.fd());
    ASSERT_TRUE(m.ok() && m->type == protocol::MessageType::kError) << i;
    const Status refused = protocol::DecodeError(m->payload);
    EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused.ToString();
    EXPECT_TRUE(Contains(refused.message(), "max_leases_per_connection")) << refused.message();
  }
  // The connection keeps serving, and its leases are all still there.
  c.SendRaw(protocol::EncodeFrames(protocol::MessageType::kListModels, {})[0]);
  auto list = protocol::ReceiveMessage(c.fd());
  ASSERT_TRUE(list.ok() && list->type == protocol::MessageType::kModelList);
  auto status = AttachClient(socket_).GetStatus();
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->lease_total, 8u);
  EXPECT_EQ(status->counters["lease_refusals"], 3u);
}

// A status reply lists at most --max-status-leases leases and counts them all;
// the old `status` reply is capped the same way.
TEST_F(StoreLimitsTest, TheStatusReplyListsAtMostItsCapOfLeases) {
  auto store = Start({"--max-status-leases", "3"});
  ASSERT_EQ(store->startup_error(), "");
  std::vector<std::unique_ptr<Attachment>> held;
  for (int i = 0; i < 5; ++i) {
    auto a = AttachClient(socket_).Attach("m");
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    held.push_back(std::move(*a));
  }
  auto status = AttachClient(socket_).GetStatus();
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(status->leases.size(), 3u);
  EXPECT_EQ(status->lease_total, 5u);
  ASSERT_EQ(status->arenas.size(), 1u);
  EXPECT_EQ(status->arenas[0].attached, 5u);

  RawConnection old(socket_);  // a client of protocol 1.0 asks `status`
  ASSERT_TRUE(old.connected());
  old.SendRaw(protocol::EncodeFrames(protocol::MessageType::kStatus, {})[0]);
  auto reply = protocol::ReceiveMessage(old.fd());
  ASSERT_TRUE(reply.ok() && reply->type == protocol::MessageType::kStatusReply);
  auto v1 = protocol::DecodeStatus(reply->payload);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ(v1->leases.size(), 3u);
}

// Replies queued in the store are bounded across connections: with the
// budget reached, no connection is read until peers read their answers, and
// then every request is answered.
TEST_F(StoreLimitsTest, QueuedRepliesAreBoundedAcrossConnections) {
  constexpr size_t kBudget = 64u << 10;
  auto store =
      Start({"--max-queued-bytes", std::to_string(kBudget), "--unread-timeout-ms", "600000"});
  ASSERT_EQ(store->startup_error(), "");
  const auto request = protocol::EncodeFrames(protocol::MessageType::kListModels, {})[0];
  // Each connection sends until a send has been blocked for a second (the
  // store has stopped reading it: its own 1 MiB or the shared budget). That
  // second decides only how much is sent, never what is asserted: without the
  // shared budget four connections would queue about 4 MiB.
  std::vector<std::unique_ptr<RawConnection>> conns;
  std::vector<int> sent;
  for (int i = 0; i < 4; ++i) {
    conns.push_back(std::make_unique<RawConnection>(socket_));
    RawConnection& c = *conns.back();
    ASSERT_TRUE(c.connected());
    timeval timeout{1, 0};
    ::setsockopt(c.fd(), SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    int n = 0;
    while (n < 200000 && c.TrySend(request) == 0) ++n;
    sent.push_back(n);
  }
  std::vector<int> answered(conns.size());
  std::vector<std::thread> readers;
  for (size_t i = 0; i < conns.size(); ++i)
    readers.emplace_back([&, i] {
      for (; answered[i] < sent[i]; ++answered[i]) {
        auto m = protocol::ReceiveMessage(conns[i]->fd());
        if (!m.ok() || m->type != protocol::MessageType::kModelList) break;
      }
    });
  for (std::thread& t : readers) t.join();
  for (size_t i = 0; i < conns.size(); ++i) EXPECT_EQ(answered[i], sent[i]) << "connection " << i;

  auto models = AttachClient(socket_).ListModels();
  ASSERT_TRUE(models.ok());
  const size_t reply_bytes =
      protocol::kFrameHeaderBytes + protocol::EncodeModelList(*models).size();
  auto c = Counters(socket_);
  // One reply is queued after the check that lets its request be read.
  EXPECT_LE(c["queued_bytes_peak"], kBudget + reply_bytes);
  EXPECT_GE(c["reads_paused_for_store_queued_bytes"], 1u);
  EXPECT_EQ(c["queued_bytes"], 0u);
}

// A client that never reads its descriptors cannot block every attach: while
// an attach waits for the store-wide cap, a connection that has read nothing
// for --unread-timeout-ms is closed (with a log line), and the attach is served.
TEST_F(StoreLimitsTest, AConnectionThatNeverReadsIsClosedWhileOthersWait) {
  auto store = Start({"--max-unread-descriptors", "4", "--unread-timeout-ms", "200",
                      "--attach-wait-timeout-ms", "600000"});
  ASSERT_EQ(store->startup_error(), "");
  RawConnection greedy(socket_);
  ASSERT_TRUE(greedy.connected());
  ASSERT_GT(FloodAttaches(greedy, 10), 4);
  ASSERT_TRUE(Eventually([&] { return Counter(socket_, "unread_descriptors") == 4; }));

  AttachOptions options{socket_, {}};
  options.receive_timeout = std::chrono::seconds(60);  // a failure, not a hang, if never served
  auto a = AttachClient(options).Attach("m");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_TRUE(
      store->WaitForOutput("(unread_timeout) while 1 attaches wait", std::chrono::seconds(20)))
      << store->output();
  EXPECT_EQ(Counter(socket_, "stalled_connections_closed"), 1u);
  // The greedy connection was closed: after what was sent before (and a
  // reset, for the requests the store never read) it reads end-of-file.
  int manifests = 0;
  bool closed = false;
  for (int i = 0; i < 12 && !closed; ++i) {
    auto m = protocol::ReceiveMessage(greedy.fd());
    if (m.ok()) {
      manifests += m->type == protocol::MessageType::kManifest ? 1 : 0;
    } else {
      closed = Contains(m.status().message(), "closed");
    }
  }
  EXPECT_TRUE(closed);
  EXPECT_LE(manifests, 4);
  EXPECT_TRUE(store->alive());
}

// An attach that waits for the store-wide cap longer than
// --attach-wait-timeout-ms is answered RESOURCE_EXHAUSTED.
TEST_F(StoreLimitsTest, AnAttachWaitingForTheCapIsAnsweredAfterItsBound) {
  auto store = Start({"--max-unread-descriptors", "4", "--unread-timeout-ms", "600000",
                      "--attach-wait-timeout-ms", "200"});
  ASSERT_EQ(store->startup_error(), "");
  RawConnection greedy(socket_);
  ASSERT_TRUE(greedy.connected());
  // Exactly the cap: once it reads them it asks for nothing more.
  ASSERT_EQ(FloodAttaches(greedy, 4), 4);
  ASSERT_TRUE(Eventually([&] { return Counter(socket_, "unread_descriptors") == 4; }));

  AttachOptions options{socket_, {}};
  options.receive_timeout = std::chrono::seconds(60);
  auto a = AttachClient(options).Attach("m");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().ToString();
  EXPECT_TRUE(Contains(a.status().message(), "attach_wait_timeout")) << a.status().message();
  EXPECT_EQ(Counter(socket_, "attach_wait_timeouts"), 1u);
  // The greedy client was given longer, so it was not closed: it reads them.
  EXPECT_EQ(ReadManifests(greedy, 4), 4);
  EXPECT_TRUE(AttachClient(socket_).Attach("m").ok());
}

// A "store" that accepts and never answers: the client gives up after its
// receive timeout with DEADLINE_EXCEEDED naming the socket.
TEST(AttachClientTimeout, AStoreThatNeverAnswersIsATimeoutNotAHang) {
  TempDir dir;
  const std::string path = dir.File("silent.sock");
  UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(listener.valid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener.get(), 4), 0);
  AttachOptions options{path, {}};
  options.receive_timeout = std::chrono::milliseconds(200);
  auto a = AttachClient(options).Attach("m");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kDeadlineExceeded) << a.status().ToString();
  EXPECT_TRUE(Contains(a.status().message(), path)) << a.status().message();
}

}  // namespace
}  // namespace hearth
