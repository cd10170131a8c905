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
  p.Raw(bare_ready + u32(0) + u32(1) + u32(1) + "extra");
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

// Streams: the ready message's capacity and window, the ring, a request
// opened (with resume tokens) and answered, credits, cancels and a larger
// ring asked for; and what each may not carry.
TEST(WorkerProtocol, StreamMessagesRoundTripAndAreChecked) {
  Pair p;
  control::Setup setup;
  setup.decoupled = true;
  ASSERT_TRUE(SendSetup(p.a.get(), setup).ok());
  auto got_setup = Receive(p.b.get(), 1000);
  ASSERT_TRUE(got_setup.ok()) << got_setup.status().ToString();
  EXPECT_TRUE(got_setup->setup.decoupled);

  control::Ready ready;
  ready.streams = 64;
  ready.window = 128;
  ASSERT_TRUE(SendReady(p.a.get(), ready).ok());
  auto got_ready = Receive(p.b.get(), 1000);
  ASSERT_TRUE(got_ready.ok()) << got_ready.status().ToString();
  EXPECT_EQ(got_ready->ready.streams, 64u);
  EXPECT_EQ(got_ready->ready.window, 128u);
  ready.streams = 0;
  ASSERT_TRUE(SendReady(p.a.get(), ready).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "0 streams"));
  ready.streams = kMaxStreams + 1;
  ASSERT_TRUE(SendReady(p.a.get(), ready).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "streams and a window"));

  const Ring ring{1 << 20, 1 << 20, 4 << 20};
  ASSERT_TRUE(SendRing(p.a.get(), ring).ok());
  auto got_ring = ReceiveKind(p.b.get(), 1000, {Kind::kRing});
  ASSERT_TRUE(got_ring.ok()) << got_ring.status().ToString();
  EXPECT_EQ(got_ring->ring, ring);
  ASSERT_TRUE(SendRing(p.a.get(), Ring{3 << 20, 2 << 20, 4 << 20}).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "outside the slot"));

  Open open;
  open.id = 7;
  open.request_id = "r-1";
  open.slot_bytes = 4 << 20;
  open.inputs = {{0, 9, {1}}};
  open.parameters_json = R"({"temperature":0.5,"stop":["\n"]})";
  open.resume = {64, 24, {3}};
  ASSERT_TRUE(SendOpen(p.a.get(), open).ok());
  auto got_open = ReceiveKind(p.b.get(), 1000, {Kind::kOpen});
  ASSERT_TRUE(got_open.ok()) << got_open.status().ToString();
  EXPECT_EQ(got_open->open.id, 7u);
  EXPECT_EQ(got_open->open.request_id, "r-1");
  EXPECT_EQ(got_open->open.inputs, open.inputs);
  EXPECT_EQ(got_open->open.parameters_json, open.parameters_json);
  EXPECT_EQ(got_open->open.resume, open.resume);
  // Resume tokens must be INT64 [n] of n * 8 bytes, inside the slot.
  open.resume = {64, 20, {3}};
  ASSERT_TRUE(SendOpen(p.a.get(), open).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "resume tokens"));
  open.resume = {64, 16, {2, 1}};
  ASSERT_TRUE(SendOpen(p.a.get(), open).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "INT64 [n]"));
  open.resume = {};
  open.resume.shape = {0};
  open.parameters_json.assign(kMaxParametersBytes + 1, ' ');
  EXPECT_TRUE(Contains(SendOpen(p.a.get(), open), "over the limit"));

  Response response;
  response.id = 7;
  response.outputs = {{64, 9, {1}}, {}};
  response.present = {1, 0};
  ASSERT_TRUE(SendResponse(p.a.get(), response).ok());
  auto got = ReceiveKind(p.b.get(), 1000, {Kind::kResponse});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->response.id, 7u);
  EXPECT_FALSE(got->response.final);
  EXPECT_EQ(got->response.outputs, response.outputs);
  EXPECT_EQ(got->response.present, response.present);
  // Presence flags for every output, and an error is final.
  response.present = {1};
  ASSERT_TRUE(SendResponse(p.a.get(), response).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "presence flags for 1 of 2"));
  response.present = {0, 0};
  response.status_code = 13;
  ASSERT_TRUE(SendResponse(p.a.get(), response).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "an error that is not final"));

  ASSERT_TRUE(SendCredit(p.a.get(), Credit{5}).ok());
  auto credit = ReceiveKind(p.b.get(), 1000, {Kind::kCredit});
  ASSERT_TRUE(credit.ok()) << credit.status().ToString();
  EXPECT_EQ(credit->credit.responses, 5u);
  ASSERT_TRUE(SendCredit(p.a.get(), Credit{0}).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "credit message for 0"));

  const std::vector<uint64_t> ids = {3, 9};
  ASSERT_TRUE(SendCancel(p.a.get(), ids).ok());
  auto cancel = ReceiveKind(p.b.get(), 1000, {Kind::kCancel});
  ASSERT_TRUE(cancel.ok()) << cancel.status().ToString();
  EXPECT_EQ(cancel->cancel.ids, ids);
  EXPECT_TRUE(Contains(SendCancel(p.a.get(), {}), "a cancel of 0"));

  ASSERT_TRUE(SendRingGrow(p.a.get(), RingGrow{8 << 20}).ok());
  auto grow = ReceiveKind(p.b.get(), 1000, {Kind::kRingGrow});
  ASSERT_TRUE(grow.ok()) << grow.status().ToString();
  EXPECT_EQ(grow->ring_grow.bytes, 8u << 20);
  ASSERT_TRUE(SendRingGrow(p.a.get(), RingGrow{0}).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "ring-grow message for 0"));

  ASSERT_TRUE(SendEngineStats(p.a.get(), EngineStats{120, 4096, 3}).ok());
  auto stats = ReceiveKind(p.b.get(), 1000, {Kind::kEngineStats});
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->engine_stats, (EngineStats{120, 4096, 3}));
  ASSERT_TRUE(SendEngineStats(p.a.get(), EngineStats{4097, 4096, 0}).ok());
  EXPECT_TRUE(Contains(Receive(p.b.get(), 1000).status(), "4097 of 4096 KV blocks"));
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
