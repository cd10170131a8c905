// What hostile clients can make a real `hearth store` hold: connections,
// descriptors sent and never read, unfinished messages, and the descriptor
// limit itself. Each case checks the bound and that the store still serves.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <regex>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/attach.h"
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
  const int fds_before = testing::StableFdCount(store->pid());
  std::vector<std::unique_ptr<RawConnection>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(std::make_unique<RawConnection>(socket_));
    ASSERT_TRUE(held.back()->connected());
    // An answer proves the store admitted it.
    held.back()->SendRaw(protocol::EncodeFrames(protocol::MessageType::kListModels, {})[0]);
    auto m = protocol::ReceiveMessage(held.back()->fd());
    ASSERT_TRUE(m.ok() && m->type == protocol::MessageType::kModelList) << i;
  }
  for (int i = 0; i < 200; ++i) {
    RawConnection extra(socket_);
    ASSERT_TRUE(extra.connected());
    const std::string error = extra.ExpectErrorAndClose();
    ASSERT_TRUE(Contains(error, "--max-connections")) << i << ": " << error;
  }
  auto refused = AttachClient(socket_).Attach("m");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted) << refused.status().ToString();
  // 200 refusals later the store holds its 4 connections and nothing else.
  EXPECT_EQ(testing::StableFdCount(store->pid()), fds_before + 4);

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
  // Whatever the store has done with the flood, it is done once its
  // descriptor count stops moving: it holds the connection and at most the
  // cap of exports, and no more than the cap of answers wait in the socket.
  const int fds = testing::StableFdCount(store->pid());
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
  auto store = Start({}, options);
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
  testing::StableFdCount(store->pid());
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
  const long rss_before = testing::RssKiB(store->pid());
  long rss_peak = rss_before;

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
    rss_peak = std::max(rss_peak, testing::RssKiB(store->pid()));
  }
  EXPECT_GT(dropped, 0);
  // The budget, plus room for the allocator's own slack: far below 192 MiB.
  EXPECT_LT(rss_peak - rss_before, static_cast<long>(kBudget / 1024) + 40 * 1024)
      << "store RSS went from " << rss_before << " to " << rss_peak << " KiB";
  conns.clear();
  EXPECT_TRUE(AttachWithin(socket_).ok());
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
  const std::string line = "not accepting for";
  ASSERT_TRUE(store->WaitForOutput(line, std::chrono::seconds(20))) << store->output();
  const double cpu_start = testing::CpuSeconds(store->pid());
  const auto wall_start = Clock::now();
  // Three more lines: at least two seconds of the flood (one line a second).
  ASSERT_TRUE(store->WaitForOutput(line, std::chrono::seconds(30), 4)) << store->output();
  const double wall = std::chrono::duration<double>(Clock::now() - wall_start).count();
  const double cpu = testing::CpuSeconds(store->pid()) - cpu_start;

  // Every failed accept is a line or counted in the next line's "N similar
  // lines left out": the store tried about once per back-off (100 ms to 1 s),
  // not thousands of times a second.
  const std::string out = store->output();
  long failures = 0;
  std::regex pattern(R"(not accepting for \d+ ms(?: \((\d+) similar lines left out\))?)");
  for (std::sregex_iterator it(out.begin(), out.end(), pattern), end; it != end; ++it)
    failures += 1 + ((*it)[1].matched ? std::stol((*it)[1]) : 0);
  EXPECT_LE(failures, 20 + static_cast<long>(wall * 10)) << out;
  EXPECT_LT(cpu, 0.5 * wall) << cpu << " s of CPU in " << wall << " s of flood";

  flood.clear();
  auto a = AttachWithin(socket_);
  EXPECT_TRUE(a.ok()) << a.status().ToString();
}

}  // namespace
}  // namespace hearth
