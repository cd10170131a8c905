// The server <-> worker control channel: every message round trips, and
// every malformed or oversized one is refused with a message saying what is
// wrong, before anything is allocated for it.
#include "protocol/worker_protocol.h"

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
  void Raw(const std::string& packet) {
    ASSERT_EQ(::send(a.get(), packet.data(), packet.size(), 0),
              static_cast<ssize_t>(packet.size()));
  }
};

bool Contains(const Status& s, const std::string& what) {
  return s.message().find(what) != std::string::npos;
}

TEST(WorkerProtocol, SetupRoundTripsAndCanBePeekedFirst) {
  Pair p;
  control::Setup sent;
  sent.max_batch_size = 8;
  sent.parameters = {{"gemm", "auto"},
                     {"empty", ""},
                     {"big", std::string(64 << 10, 'x')},
                     {"binary", std::string("a\0b", 3)}};
  sent.inputs = {{"text", DType::kBytes, {-1}}, {"x", DType::kF32, {4, -1}}};
  sent.outputs = {{"y", DType::kI64, {1}}};
  sent.config_json = R"({"name":"m"})";
  sent.version_dir = "/repo/m/1";
  ASSERT_TRUE(SendSetup(p.a.get(), sent).ok());
  auto peeked = PeekSetup(p.b.get(), 1000);
  ASSERT_TRUE(peeked.ok()) << peeked.status().ToString();
  EXPECT_EQ(peeked->parameters, sent.parameters);
  auto got = ReceiveKind(p.b.get(), 1000, {Kind::kSetup});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->setup.max_batch_size, 8);
  EXPECT_EQ(got->setup.parameters, sent.parameters);
  EXPECT_EQ(got->setup.inputs, sent.inputs);
  EXPECT_EQ(got->setup.outputs, sent.outputs);
  EXPECT_EQ(got->setup.config_json, sent.config_json);
  EXPECT_EQ(got->setup.version_dir, sent.version_dir);
}

TEST(WorkerProtocol, ReadyRunDoneAndRoomRoundTrip) {
  Pair p;
  Ready ready{{{"x", DType::kF32, {3}}}, {{"y", DType::kBytes, {}}}, 123, "cpu (attach 1 ms)"};
  ASSERT_TRUE(SendReady(p.a.get(), ready).ok());
  auto r = ReceiveKind(p.b.get(), 1000, {Kind::kReady});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->ready.inputs, ready.inputs);
  EXPECT_EQ(r->ready.outputs, ready.outputs);
  EXPECT_EQ(r->ready.device_memory_bytes, 123u);
  EXPECT_EQ(r->ready.text, ready.text);
  EXPECT_FALSE(r->ready.device_addresses);
  ready.device_addresses = true;
  ASSERT_TRUE(SendReady(p.a.get(), ready).ok());
  r = ReceiveKind(p.b.get(), 1000, {Kind::kReady});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->ready.device_addresses);
  EXPECT_TRUE(r->ready.phases.empty());

  control::Run run;
  run.seq = 7;
  run.rows = 2;
  run.slot_bytes = 65536;
  run.inputs = {{0, 24, {2, 3}}};
  run.outputs = {{64, 16, {2, 2}}, {}};
  run.output_placed = {1, 0};
  run.free_offset = 128;
  ASSERT_TRUE(SendRun(p.a.get(), run).ok());
  auto rr = Receive(p.b.get(), 1000);
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  ASSERT_EQ(rr->kind, Kind::kRun);
  EXPECT_EQ(rr->run.seq, 7u);
  EXPECT_EQ(rr->run.rows, 2);
  EXPECT_EQ(rr->run.inputs, run.inputs);
  EXPECT_EQ(rr->run.outputs, run.outputs);
  EXPECT_EQ(rr->run.output_placed, run.output_placed);
  EXPECT_EQ(rr->run.free_offset, 128u);

  Done done;
  done.seq = 7;
  done.status_code = 3;
  done.text = std::string(20000, 'a') + "ValueError: the last line";
  done.retry_alone = true;
  done.run_us = 42;
  done.outputs = {{128, 9, {2}}};
  ASSERT_TRUE(SendDone(p.a.get(), done).ok());
  auto d = ReceiveKind(p.b.get(), 1000, {Kind::kDone});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->done.status_code, 3u);
  EXPECT_TRUE(d->done.retry_alone);
  EXPECT_EQ(d->done.run_us, 42u);
  EXPECT_EQ(d->done.outputs, done.outputs);
  // A long error keeps its end, where a traceback says what went wrong.
  EXPECT_EQ(d->done.text.size(), kMaxTextBytes);
  EXPECT_TRUE(d->done.text.ends_with("ValueError: the last line"));

  ASSERT_TRUE(SendRelease(p.a.get()).ok());
  auto all = ReceiveKind(p.b.get(), 1000, {Kind::kRelease});
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_TRUE(all->release.ids.empty());
  const std::vector<uint64_t> ids = {4, 9, 1ull << 40};
  ASSERT_TRUE(SendRelease(p.a.get(), ids).ok());
  auto some = ReceiveKind(p.b.get(), 1000, {Kind::kRelease});
  ASSERT_TRUE(some.ok()) << some.status().ToString();
  EXPECT_EQ(some->release.ids, ids);
  EXPECT_FALSE(SendRelease(p.a.get(), std::vector<uint64_t>(kMaxReleaseIds + 1)).ok());

  ASSERT_TRUE(SendRoom(p.a.get(), Room{7, 1 << 20}).ok());
  auto room = ReceiveKind(p.b.get(), 1000, {Kind::kRoom});
  ASSERT_TRUE(room.ok());
  EXPECT_EQ(room->room.slot_bytes, 1u << 20);
}

// Inputs and outputs in clients' CUDA shared-memory regions: the regions and
// copies round trip, and a copy that names what the run lacks, or reaches
// past its region or its tensor, is refused naming it.
TEST(WorkerProtocol, DeviceCopiesRoundTripAndAreCheckedAgainstRegionsAndTensors) {
  Pair p;
  control::Run run;
  run.seq = 3;
  run.rows = 2;
  run.slot_bytes = 65536;
  run.inputs = {{0, 32, {2, 4}}};
  run.outputs = {{64, 8, {2, 1}}, {}};
  run.output_placed = {1, 0};
  run.free_offset = 128;
  DeviceRegion g;
  g.id = 41;
  g.name = "region-a";
  for (size_t i = 0; i < g.handle.size(); ++i) g.handle[i] = static_cast<uint8_t>(i * 3);
  g.device = 1;
  g.byte_size = 4096;
  run.regions = {g};
  run.copies = {{0, false, 0, 16, 16, 1024}, {0, true, 0, 4, 4, 2048}};
  ASSERT_TRUE(SendRun(p.a.get(), run).ok());
  auto rr = ReceiveKind(p.b.get(), 1000, {Kind::kRun});
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_EQ(rr->run.regions, run.regions);
  EXPECT_EQ(rr->run.copies, run.copies);
  EXPECT_FALSE(rr->run.compact);
  EXPECT_EQ(SlotRooms(run, false), (std::vector<uint64_t>{32}));
  // Compact: the bytes in regions have no room in the slot.
  run.compact = true;
  ASSERT_TRUE(SendRun(p.a.get(), run).ok());
  rr = ReceiveKind(p.b.get(), 1000, {Kind::kRun});
  ASSERT_TRUE(rr.ok()) << rr.status().ToString();
  EXPECT_TRUE(rr->run.compact);
  EXPECT_EQ(SlotRooms(run, false), (std::vector<uint64_t>{16}));
  EXPECT_EQ(SlotRooms(run, true), (std::vector<uint64_t>{4, 0}));
  run.compact = false;

  auto refused = [&](control::Run bad, const std::string& what) {
    ASSERT_TRUE(SendRun(p.a.get(), bad).ok());
    Status s = Receive(p.b.get(), 1000).status();
    EXPECT_TRUE(Contains(s, what)) << s.ToString();
  };
  control::Run bad = run;
  bad.copies[0].region = 1;
  refused(bad, "names region 1 of 1");
  bad = run;
  bad.copies[1].tensor = 1;  // an output the server did not place
  refused(bad, "output 1, which has no place in the slot");
  bad = run;
  bad.copies[0].offset = 24;  // 16 bytes at 24 of a 32-byte tensor
  refused(bad, "16 bytes at 24 of a tensor of 32");
  bad = run;
  bad.copies[0].region_offset = 4090;
  refused(bad, "at 4090 of a region of 4096");
  bad = run;
  bad.copies[0].region_offset = ~0ull - 4;  // no wrap-around
  refused(bad, "of a region of 4096");
  bad = run;
  bad.copies[0].bytes = 0;
  refused(bad, "0 bytes at");
  bad = run;
  bad.regions[0].byte_size = 0;
  refused(bad, "region 41 on device 1 of 0 bytes");
  bad = run;
  bad.copies.push_back({0, false, 0, 8, 16, 0});  // 8..24 against 16..32
  refused(bad, "two device copies of input 0 overlap at 16");

  // More than a run may carry is refused before anything is sent.
  bad = run;
  bad.regions.assign(kMaxRunRegions + 1, g);
  Status s = SendRun(p.a.get(), bad);
  EXPECT_TRUE(Contains(s, "over the limits of 64 and 1024")) << s.ToString();
  EXPECT_EQ(Receive(p.b.get(), 0).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(WorkerProtocol, OverTheLimitIsAClearErrorAndSendsNothing) {
  Pair p;
  control::Setup huge;
  huge.parameters = {{"huge", std::string(kMaxSetupBytes, 'x')}};
  Status s = SendSetup(p.a.get(), huge);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s, "over the limit of " + std::to_string(kMaxSetupBytes))) << s.message();
  EXPECT_EQ(Receive(p.b.get(), 0).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(WorkerProtocol, ReadyCarriesTheStartsPhasesWithinTheirLimits) {
  Pair p;
  Ready ready{{{"x", DType::kF32, {3}}}, {{"y", DType::kF32, {1}}}, 0, "cpu"};
  ready.phases = {{"interpreter", 81000}, {"model.py", 12}, {"first-batch_2", 0}};
  ASSERT_TRUE(SendReady(p.a.get(), ready).ok());
  auto r = ReceiveKind(p.b.get(), 1000, {Kind::kReady});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->ready.phases, ready.phases);

  for (const char* bad : {"", "Imports", "a b", "x/y", "0123456789012345678901234567890123"}) {
    SCOPED_TRACE(bad);
    EXPECT_FALSE(IsStartPhaseName(bad));
    ready.phases = {{bad, 1}};
    EXPECT_EQ(SendReady(p.a.get(), ready).code(), StatusCode::kInvalidArgument);
  }
  ready.phases.assign(kMaxStartPhases + 1, StartPhase{"setup", 1});
  const Status many = SendReady(p.a.get(), ready);
  EXPECT_TRUE(Contains(many, "17 start phases, over the limit of 16")) << many.message();
  EXPECT_EQ(Receive(p.b.get(), 0).status().code(), StatusCode::kDeadlineExceeded);  // none sent
}

TEST(WorkerProtocol, MalformedMessagesAreRefusedNamingTheFault) {
  Pair p;
  auto u32 = [](uint32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [](uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); };
  const std::string ready = u32(kMagic) + u32(static_cast<uint32_t>(Kind::kReady));

  p.Raw("junk");
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "magic"));

  p.Raw(u32(kMagic) + u32(99));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "unknown control message kind 99"));

  // 100000 input specs: refused by count, nothing allocated for them.
  p.Raw(ready + u32(100000));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "over the limit of 256"));

  // A name whose length runs past the packet.
  p.Raw(ready + u32(1) + u32(1000) + "abc");
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "runs past the end"));

  // A shape of 1000 dimensions.
  p.Raw(ready + u32(1) + u32(1) + "x" + std::string(1, '\1') + u32(1000));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "1000 dimensions"));

  // An unknown dtype.
  p.Raw(ready + u32(1) + u32(1) + "x" + std::string(1, '\x63') + u32(0));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "unknown dtype 99"));

  // A whole message with bytes after its end.
  const std::string bare_ready = ready + u32(0) + u32(0) + u64(0) + u32(0) + std::string(1, '\0');
  p.Raw(bare_ready + u32(0) + "extra");
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "5 bytes after the end"));
  // Start phases: too many, a name that is not one, a name too long.
  p.Raw(bare_ready + u32(17));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "17 start phases, over the limit of 16"));
  p.Raw(bare_ready + u32(1) + u32(1) + "A" + u64(5));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "a start phase's name is not"));
  p.Raw(bare_ready + u32(1) + u32(33) + std::string(33, 'a') + u64(5));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "a start phase's name of 33 bytes"));

  // A packet longer than any message but the setup is refused, not truncated.
  p.Raw(ready + std::string(kMaxMessageBytes + 1, 'z'));
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "over the limit"));

  // An expected kind only.
  ASSERT_TRUE(SendRoom(p.a.get(), Room{1, 1}).ok());
  EXPECT_TRUE(Contains(ReceiveKind(p.b.get(), 1000, {Kind::kDone}).status(), "unexpected"));

  // The peer gone.
  p.a.Reset();
  EXPECT_EQ(Receive(p.b.get(), 1000).status().code(), StatusCode::kUnavailable);
}

// A decoupled model's stream: partial responses with absent outputs, the
// acknowledgements, the request's parameters in the run, the setup's flag;
// and what a partial may not carry.
TEST(WorkerProtocol, StreamMessagesRoundTripAndAreChecked) {
  Pair p;
  control::Setup setup;
  setup.decoupled = true;
  ASSERT_TRUE(SendSetup(p.a.get(), setup).ok());
  auto got_setup = Receive(p.b.get(), 1000);
  ASSERT_TRUE(got_setup.ok()) << got_setup.status().ToString();
  EXPECT_TRUE(got_setup->setup.decoupled);

  control::Run run;
  run.seq = 3;
  run.parameters_json = R"({"temperature":0.5,"stop":["\n"]})";
  ASSERT_TRUE(SendRun(p.a.get(), run).ok());
  auto got_run = Receive(p.b.get(), 1000);
  ASSERT_TRUE(got_run.ok()) << got_run.status().ToString();
  EXPECT_EQ(got_run->run.parameters_json, run.parameters_json);
  run.parameters_json.assign(kMaxParametersBytes + 1, ' ');
  EXPECT_TRUE(Contains(SendRun(p.a.get(), run), "over the limit"));

  control::Done partial;
  partial.seq = 3;
  partial.outputs = {{64, 9, {1}}, {}};
  partial.present = {1, 0};
  ASSERT_TRUE(SendPartial(p.a.get(), partial).ok());
  auto got = Receive(p.b.get(), 1000);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->kind, Kind::kPartial);
  EXPECT_EQ(got->done.outputs, partial.outputs);
  EXPECT_EQ(got->done.present, partial.present);

  ASSERT_TRUE(SendAck(p.a.get(), Ack{3, true}).ok());
  auto ack = ReceiveKind(p.b.get(), 1000, {Kind::kAck});
  ASSERT_TRUE(ack.ok()) << ack.status().ToString();
  EXPECT_EQ(ack->ack.seq, 3u);
  EXPECT_TRUE(ack->ack.cancel);

  // Presence flags for some outputs only.
  partial.present = {1};
  ASSERT_TRUE(SendPartial(p.a.get(), partial).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "presence flags for 1 of 2"));
  // A partial cannot carry an error: only the last answer can.
  partial.present = {};
  partial.status_code = 13;
  ASSERT_TRUE(SendPartial(p.a.get(), partial).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "partial message with an error"));
}

TEST(WorkerProtocol, ShapesMatchTheSpecWithVariableDimensions) {
  const TensorSpec spec{"x", DType::kF32, {-1, 4}};
  const std::vector<int64_t> ok = {3, 7, 4}, zero = {3, 0, 4}, wrong_rows = {2, 7, 4},
                             wrong_dim = {3, 7, 5}, short_rank = {3, 4};
  EXPECT_TRUE(CheckShape(spec, true, 3, ok, "input").ok());
  EXPECT_TRUE(CheckShape(spec, true, 3, zero, "input").ok());
  EXPECT_FALSE(CheckShape(spec, true, 3, wrong_rows, "input").ok());
  Status s = CheckShape(spec, true, 3, wrong_dim, "input 'x'");
  EXPECT_TRUE(Contains(s, "[3,7,5]")) << s.message();
  EXPECT_TRUE(Contains(s, "[3,-1,4]")) << s.message();
  EXPECT_FALSE(CheckShape(spec, true, 3, short_rank, "input").ok());
  // Without batching there is no leading dimension.
  const std::vector<int64_t> unbatched = {9, 4};
  EXPECT_TRUE(CheckShape(spec, false, 1, unbatched, "input").ok());
}

TEST(WorkerProtocol, SlotTensorsAreCheckedAgainstTheSlotAndTheirShape) {
  const std::vector<std::byte> slot(256);
  EXPECT_TRUE(CheckSlotTensor({64, 48, {3, 4}}, DType::kF32, 0, 256, slot.data(), "t").ok());
  // Wrong byte count for the shape.
  EXPECT_TRUE(
      Contains(CheckSlotTensor({64, 40, {3, 4}}, DType::kF32, 0, 256, nullptr, "t"), "needs 48"));
  // Past the slot, including sums that would wrap.
  EXPECT_TRUE(Contains(CheckSlotTensor({240, 48, {3, 4}}, DType::kF32, 0, 256, nullptr, "t"),
                       "outside the slot"));
  const uint64_t wrap = std::numeric_limits<uint64_t>::max() - 8;
  EXPECT_FALSE(CheckSlotTensor({wrap, 48, {3, 4}}, DType::kF32, 0, 256, nullptr, "t").ok());
  EXPECT_FALSE(CheckSlotTensor({0, wrap, {3, 4}}, DType::kF32, 0, 256, nullptr, "t").ok());
  // Below the region it must be in.
  EXPECT_FALSE(CheckSlotTensor({0, 48, {3, 4}}, DType::kF32, 64, 256, nullptr, "t").ok());
}

}  // namespace
}  // namespace hearth::control
