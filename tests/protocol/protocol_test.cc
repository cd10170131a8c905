#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "gtest/gtest.h"
#include "protocol/messages.h"
#include "protocol/wire.h"

namespace hearth::protocol {
namespace {

Manifest SampleManifest() {
  Manifest m;
  m.model = "mlp";
  m.version = 3;
  m.device = Device::Cuda(1);
  m.arena_size = 4096;
  m.checksum = 0x0123456789abcdefull;
  m.tensors = {{"a.bias", DType::kF32, {4}, 0, 16},
               {"a.weight", DType::kBF16, {4, 8}, 256, 64},
               {"empty", DType::kI8, {0}, 512, 0}};
  return m;
}

TEST(Protocol, ManifestRoundTrips) {
  const Manifest m = SampleManifest();
  auto decoded = DecodeManifest(EncodeManifest(m));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->model, "mlp");
  EXPECT_EQ(decoded->version, 3u);
  EXPECT_EQ(decoded->device, Device::Cuda(1));
  EXPECT_EQ(decoded->checksum, m.checksum);
  ASSERT_EQ(decoded->tensors.size(), 3u);
  EXPECT_EQ(decoded->tensors[1].name, "a.weight");
  EXPECT_EQ(decoded->tensors[1].dtype, DType::kBF16);
  EXPECT_EQ(decoded->tensors[1].shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(decoded->tensors[1].offset, 256u);
}

TEST(Protocol, EveryTruncationOfAManifestIsRejected) {
  const auto bytes = EncodeManifest(SampleManifest());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto decoded = DecodeManifest(std::span(bytes.data(), n));
    EXPECT_FALSE(decoded.ok()) << "prefix of " << n << " bytes accepted";
  }
  auto longer = bytes;
  longer.push_back(std::byte{0});
  auto decoded = DecodeManifest(longer);
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("trailing"), std::string::npos);
}

TEST(Protocol, ManifestsThatLieAboutTheArenaAreRejected) {
  struct Case {
    const char* name;
    void (*mutate)(Manifest&);
    const char* expect;
  };
  const Case cases[] = {
      {"outside", [](Manifest& m) { m.tensors[1].offset = 4096; }, "outside the arena"},
      {"unaligned", [](Manifest& m) { m.tensors[1].offset = 100; }, "not aligned"},
      {"size", [](Manifest& m) { m.tensors[0].nbytes = 20; }, "do not match"},
      {"negative", [](Manifest& m) { m.tensors[0].shape = {-4}; }, "negative"},
      {"unsorted", [](Manifest& m) { std::swap(m.tensors[0].name, m.tensors[1].name); }, "sorted"},
      {"duplicate", [](Manifest& m) { m.tensors[1].name = m.tensors[0].name; }, "sorted"},
      {"overflow", [](Manifest& m) { m.tensors[0].shape = {1ll << 62, 1ll << 62}; }, "overflows"},
      {"wraparound", [](Manifest& m) { m.tensors[0].offset = ~0ull - 255; }, "outside"},
  };
  for (const Case& c : cases) {
    Manifest m = SampleManifest();
    c.mutate(m);
    auto decoded = DecodeManifest(EncodeManifest(m));
    ASSERT_FALSE(decoded.ok()) << c.name;
    EXPECT_NE(decoded.status().message().find(c.expect), std::string::npos)
        << c.name << ": " << decoded.status().message();
  }
}

TEST(Protocol, CountsLargerThanTheMessageAreRejectedBeforeAllocating) {
  PayloadWriter w;
  w.U32(0xffffffffu);
  auto decoded = DecodeModelList(w.Take());
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("more than the message can hold"), std::string::npos);
}

TEST(Protocol, StatusAndSummariesRoundTrip) {
  StoreStatus s;
  s.pid = 42;
  s.device = Device::Host();
  s.connections = 3;
  s.leases = {{7, 1000, 1000, "m", 2, 123456}};
  s.arenas = {{"m", 2, Device::Host(), 1 << 20, false, 1}};
  auto d = DecodeStatus(EncodeStatus(s));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->pid, 42);
  ASSERT_EQ(d->leases.size(), 1u);
  EXPECT_EQ(d->leases[0].since_ms, 123456);
  ASSERT_EQ(d->arenas.size(), 1u);
  EXPECT_FALSE(d->arenas[0].registered);

  ModelSummary m;
  m.name = "scale";
  m.version = 1;
  m.path = "/x.safetensors";
  m.tensor_count = 1;
  auto list = DecodeModelList(EncodeModelList({m, m}));
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[1].path, "/x.safetensors");
}

TEST(Protocol, LoadV2AndItsAnswerRoundTrip) {
  LoadRequest req{"scale", "/m/1/model.safetensors", 7, true};
  auto d = DecodeLoadV2(EncodeLoadV2(req));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->name, "scale");
  EXPECT_EQ(d->path, "/m/1/model.safetensors");
  EXPECT_EQ(d->reuse_version, 7u);
  EXPECT_TRUE(d->reuse_only);
  // A plain load-v2 (nothing to reuse) is a load with three more fields.
  auto plain = DecodeLoadV2(EncodeLoadV2({"scale", "/p", 0, false}));
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->reuse_version, 0u);
  EXPECT_FALSE(plain->reuse_only);

  ModelSummary m;
  m.name = "scale";
  m.version = 7;
  m.path = "/m/1/model.safetensors";
  for (bool reused : {false, true}) {
    auto answer = DecodeLoadedV2(EncodeLoadedV2({m, reused}));
    ASSERT_TRUE(answer.ok()) << answer.status().ToString();
    EXPECT_EQ(answer->model.version, 7u);
    EXPECT_EQ(answer->reused, reused);
  }
  EXPECT_STREQ(MessageTypeName(MessageType::kLoadV2), "load-v2");
  EXPECT_STREQ(MessageTypeName(MessageType::kLoadedV2), "loaded-v2");
  EXPECT_TRUE(IsKnownMessageType(static_cast<uint16_t>(MessageType::kLoadedV2)));
  EXPECT_FALSE(IsKnownMessageType(static_cast<uint16_t>(MessageType::kLoadedV2) + 1));
}

// Each refusal names what is wrong; a load (1.0) payload is not a load-v2
// one, nor a load-v2 payload a load one: neither decoder guesses.
TEST(Protocol, MalformedLoadV2IsRejectedNamingTheFault) {
  auto refused = [](std::vector<std::byte> payload, const std::string& says) {
    auto d = DecodeLoadV2(payload);
    ASSERT_FALSE(d.ok()) << says;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find(says), std::string::npos) << d.status().message();
  };
  refused(EncodeLoad({"scale", "/p"}), "reuse_version");
  std::vector<std::byte> trailing = EncodeLoadV2({"scale", "/p", 1, false});
  trailing.push_back(std::byte{0});
  refused(trailing, "load-v2 message has 1 trailing bytes");
  refused(EncodeLoadV2({"", "/p", 0, false}), "model name '' is empty");
  refused(EncodeLoadV2({"a@1", "/p", 0, false}), "contains '@'");
  refused(EncodeLoadV2({"scale", "", 0, false}), "empty path");
  refused(EncodeLoadV2({"scale", "/p", 0, true}), "reuse_only without a reuse_version");
  std::vector<std::byte> flags = EncodeLoadV2({"scale", "/p", 1, false});
  flags.back() = std::byte{0x82};
  refused(flags, "unknown flags 130");
  for (size_t n = 0; n < flags.size(); ++n) {
    std::vector<std::byte> cut = EncodeLoadV2({"scale", "/p", 1, true});
    cut.resize(n);
    EXPECT_FALSE(DecodeLoadV2(cut).ok()) << n << " bytes";
  }
  EXPECT_FALSE(DecodeLoad(EncodeLoadV2({"scale", "/p", 0, false})).ok());

  ModelSummary m;
  m.name = "scale";
  std::vector<std::byte> answer = EncodeLoadedV2({m, true});
  answer.back() = std::byte{2};
  auto bad = DecodeLoadedV2(answer);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("reused is 2, not 0 or 1"), std::string::npos)
      << bad.status().message();
  EXPECT_FALSE(DecodeLoadedV2(EncodeLoaded(m)).ok());
}

TEST(Protocol, ErrorsCarryCodeAndMessage) {
  Status s = DecodeError(EncodeError(NotFound("no model 'x'")));
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "no model 'x'");
}

TEST(Protocol, LargeMessagesTravelAsSeveralFrames) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  Manifest m = SampleManifest();
  m.tensors.clear();
  m.arena_size = 1ull << 40;
  for (int i = 0; i < 3000; ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "layer%05d.weight", i);
    m.tensors.push_back({name, DType::kF16, {16, 16}, static_cast<uint64_t>(i) * 512, 512});
  }
  const auto payload = EncodeManifest(m);
  ASSERT_GT(payload.size(), kMaxFramePayload * 2);
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  std::thread sender([&] { ASSERT_TRUE(SendMessage(sv[0], MessageType::kManifest, payload, pipefd[0]).ok()); });
  auto received = ReceiveMessage(sv[1]);
  sender.join();
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  EXPECT_EQ(received->type, MessageType::kManifest);
  EXPECT_TRUE(received->fd.valid());
  auto decoded = DecodeManifest(received->payload);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->tensors.size(), 3000u);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST(Protocol, AssemblerRejectsInterleavedFrames) {
  FrameAssembler a;
  std::vector<std::byte> payload(kMaxFramePayload + 10, std::byte{1});
  auto frames = EncodeFrames(MessageType::kLoad, payload);
  ASSERT_EQ(frames.size(), 2u);
  auto first = a.Add(frames[0], UniqueFd());
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(*first);
  auto other = EncodeFrames(MessageType::kStatus, {});
  auto bad = a.Add(other[0], UniqueFd());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("continuation"), std::string::npos);
}

// A peer that announces a large message and sends little of it costs what it
// sent, not what it announced; a complete message costs its size.
TEST(Protocol, AssemblerAllocatesWhatArrivesNotWhatIsAnnounced) {
  std::vector<std::byte> payload(kMaxMessageBytes, std::byte{7});
  const auto frames = EncodeFrames(MessageType::kLoad, payload);
  FrameAssembler a;
  size_t received = 0;
  for (size_t i = 0; i + 1 < frames.size(); ++i) {
    auto r = a.Add(frames[i], UniqueFd());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_FALSE(*r);
    received += frames[i].size() - kFrameHeaderBytes;
    ASSERT_TRUE(a.in_progress());
    ASSERT_GE(a.allocated_bytes(), received);
    ASSERT_LE(a.allocated_bytes(), 2 * received) << "after frame " << i;
  }
  auto done = a.Add(frames.back(), UniqueFd());
  ASSERT_TRUE(done.ok() && *done);
  EXPECT_EQ(a.allocated_bytes(), payload.size());
  Message m = a.TakeMessage();
  EXPECT_EQ(m.payload, payload);
  EXPECT_EQ(a.allocated_bytes(), 0u);
  EXPECT_FALSE(a.in_progress());
}

TEST(Protocol, AssemblerDropsABrokenMessageWhole) {
  std::vector<std::byte> payload(3 * kMaxFramePayload, std::byte{1});
  auto frames = EncodeFrames(MessageType::kLoad, payload);
  FrameAssembler a;
  ASSERT_TRUE(a.Add(frames[0], UniqueFd()).ok());
  ASSERT_GT(a.allocated_bytes(), 0u);
  ASSERT_FALSE(a.Add(frames[2], UniqueFd()).ok());  // skips a frame
  EXPECT_EQ(a.allocated_bytes(), 0u);
  EXPECT_FALSE(a.in_progress());
  // And it starts afresh with the next message.
  auto status = EncodeFrames(MessageType::kStatus, {});
  auto r = a.Add(status[0], UniqueFd());
  ASSERT_TRUE(r.ok() && *r);
  EXPECT_EQ(a.TakeMessage().type, MessageType::kStatus);
}

TEST(Protocol, ModelRefParsing) {
  EXPECT_EQ(ModelRef::Parse("mlp")->version, 0u);
  EXPECT_EQ(ModelRef::Parse("mlp@12")->version, 12u);
  EXPECT_EQ(ModelRef::Parse("a@b@3")->name, "a@b");
  EXPECT_FALSE(ModelRef::Parse("mlp@0").ok());
  EXPECT_FALSE(ModelRef::Parse("mlp@x").ok());
  EXPECT_FALSE(ModelRef::Parse("@3").ok());
}

}  // namespace
}  // namespace hearth::protocol
