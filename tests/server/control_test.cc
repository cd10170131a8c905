// The server <-> worker control channel: the parameters message (config-sized
// data that never goes through argv) and the slot layout's checked sizes.
#include "worker/control.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <limits>

#include "gtest/gtest.h"
#include "hearth/unique_fd.h"

namespace hearth::control {
namespace {

struct Pair {
  UniqueFd a, b;
  Pair() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    a.Reset(sv[0]);
    b.Reset(sv[1]);
  }
};

TEST(ControlParameters, RoundTripIncludingLargeValuesAndEmptyOnes) {
  Pair p;
  std::map<std::string, std::string> sent = {{"gemm", "auto"},
                                             {"empty", ""},
                                             {"big", std::string(64 << 10, 'x')},
                                             {"binary", std::string("a\0b", 3)}};
  ASSERT_TRUE(SendParameters(p.a.get(), sent).ok());
  auto got = ReceiveParameters(p.b.get(), 1000);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, sent);

  ASSERT_TRUE(SendParameters(p.a.get(), {}).ok());
  auto none = ReceiveParameters(p.b.get(), 1000);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->empty());
}

TEST(ControlParameters, OverTheLimitIsAClearErrorAndSendsNothing) {
  Pair p;
  auto s = SendParameters(p.a.get(), {{"huge", std::string(kMaxParametersPayload, 'x')}});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("over the limit of " + std::to_string(kMaxParametersPayload)),
            std::string::npos)
      << s.message();
  EXPECT_EQ(ReceiveParameters(p.b.get(), 0).status().message(), "timeout");
}

TEST(ControlParameters, MalformedOrUnexpectedMessagesAreRejected) {
  Pair p;
  // A run message where the parameters should be.
  Message run;
  run.kind = Kind::kRun;
  ASSERT_TRUE(Send(p.a.get(), run).ok());
  auto wrong = ReceiveParameters(p.b.get(), 1000);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("expected the parameters message first"),
            std::string::npos);

  // A parameter whose length runs past the packet: header, then count 1 and
  // a key length of 1000 with 3 bytes behind it.
  std::string text;
  auto put32 = [&](uint32_t v) { text.append(reinterpret_cast<const char*>(&v), 4); };
  put32(1);
  put32(1000);
  text += "abc";
  std::string packet;
  auto put = [&](const auto& v) { packet.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(kMagic);
  put(static_cast<uint32_t>(Kind::kParameters));
  put(uint64_t{0});
  put(int64_t{0});
  put(uint64_t{0});
  put(uint64_t{0});
  put(uint32_t{0});
  put(static_cast<uint32_t>(text.size()));
  packet += text;
  ASSERT_EQ(::send(p.a.get(), packet.data(), packet.size(), 0),
            static_cast<ssize_t>(packet.size()));
  auto bad = ReceiveParameters(p.b.get(), 1000);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("runs past the end of the message"), std::string::npos)
      << bad.status().message();

  // A packet longer than any ordinary message is refused, not truncated.
  const std::string long_packet(8192, 'z');
  ASSERT_EQ(::send(p.a.get(), long_packet.data(), long_packet.size(), 0), 8192);
  auto too_long = Receive(p.b.get(), 1000);
  ASSERT_FALSE(too_long.ok());
  EXPECT_NE(too_long.status().message().find("over the limit"), std::string::npos)
      << too_long.status().message();

  // A parameters message is not one of the messages Receive expects.
  ASSERT_TRUE(SendParameters(p.a.get(), {}).ok());
  EXPECT_FALSE(Receive(p.b.get(), 1000).ok());
}

TEST(SlotLayout, PlacesEachTensorAlignedAndSizedForTheBatch) {
  auto l = SlotLayout::Make({{"x", 100}, {"z", 8}}, {{"y", 4}}, 3);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->input_offsets, (std::vector<uint64_t>{0, 320}));
  EXPECT_EQ(l->output_offsets, (std::vector<uint64_t>{384}));
  EXPECT_EQ(l->input_bytes_per_sample, (std::vector<uint64_t>{100, 8}));
  EXPECT_EQ(l->total, 4096u);
}

TEST(SlotLayout, OverflowIsAnErrorNamingTheTensor) {
  const uint64_t huge = uint64_t{1} << 62;
  // 2^62 bytes x 4 wraps to 0 unchecked.
  auto in = SlotLayout::Make({{"x", huge}}, {{"y", 4}}, 4);
  ASSERT_FALSE(in.ok());
  EXPECT_NE(in.status().message().find("input 'x'"), std::string::npos) << in.status().message();
  // Each fits, their sum does not.
  auto out = SlotLayout::Make({{"x", huge}}, {{"y", huge}}, 1);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("output 'y'"), std::string::npos) << out.status().message();
  // Rounding the end up to a page would pass 2^63.
  const uint64_t max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  auto rounding = SlotLayout::Make({{"x", max - 10}}, {}, 1);
  ASSERT_FALSE(rounding.ok());
  EXPECT_FALSE(SlotLayout::Make({{"x", 4}}, {}, 0).ok());
}

}  // namespace
}  // namespace hearth::control
