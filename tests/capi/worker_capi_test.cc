// libhearth's worker interface (hearth_worker_*), driven from the server's
// side of the protocol in this test: a batch is read in place, outputs are
// placed by the server or by the worker, the slot grows when a worker's
// output does not fit, and every malformed request is refused.
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/hearth.h"
#include "hearth/unique_fd.h"
#include "protocol/life_lock.h"
#include "protocol/worker_protocol.h"

namespace hearth {
namespace {

// The server's end: the control socket, and the slot memfd it maps.
struct Server {
  UniqueFd control;
  int worker_control = -1, worker_slot = -1;
  UniqueFd slot;
  std::byte* data = nullptr;
  uint64_t size = 0;

  Server() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    control.Reset(sv[0]);
    worker_control = sv[1];
    slot.Reset(::memfd_create("test-slot", MFD_CLOEXEC));
    worker_slot = ::dup(slot.get());
    Grow(4096);
  }
  ~Server() {
    if (data != nullptr)
      ::munmap(data - control::kSlotHeaderBytes, control::kSlotHeaderBytes + size);
  }
  // Queues `setup` and opens the worker's end (as a worker process does).
  void Open(const control::Setup& setup, hearth_worker** w) {
    ASSERT_TRUE(control::SendSetup(control.get(), setup).ok());
    ASSERT_EQ(hearth_worker_open(worker_control, worker_slot, 1000, w), HEARTH_OK)
        << hearth_last_error();
  }
  // The slot's data after its header (the worker's life lock), as the server lays it out.
  void Grow(uint64_t bytes) {
    if (data != nullptr)
      ::munmap(data - control::kSlotHeaderBytes, control::kSlotHeaderBytes + size);
    const uint64_t file = control::kSlotHeaderBytes + bytes;
    ASSERT_EQ(::ftruncate(slot.get(), static_cast<off_t>(file)), 0);
    void* p = ::mmap(nullptr, file, PROT_READ | PROT_WRITE, MAP_SHARED, slot.get(), 0);
    ASSERT_NE(p, MAP_FAILED);
    data = static_cast<std::byte*>(p) + control::kSlotHeaderBytes;
    size = bytes;
  }
};

TEST(WorkerCApi, ServesABatchWithPlacedAndWorkerPlacedOutputs) {
  Server s;
  control::Setup setup;
  setup.max_batch_size = 4;
  setup.parameters = {{"k", std::string("v\0w", 3)}};
  setup.config_json = R"({"name":"m"})";
  setup.version_dir = "/repo/m/1";
  ASSERT_TRUE(control::SendSetup(s.control.get(), setup).ok());

  std::thread worker([&] {
    hearth_worker* w = nullptr;
    ASSERT_EQ(hearth_worker_open(s.worker_control, s.worker_slot, 1000, &w), HEARTH_OK)
        << hearth_last_error();
    EXPECT_STREQ(hearth_worker_config_json(w), R"({"name":"m"})");
    EXPECT_STREQ(hearth_worker_version_dir(w), "/repo/m/1");
    EXPECT_EQ(hearth_worker_max_batch_size(w), 4);
    ASSERT_EQ(hearth_worker_parameter_count(w), 1u);
    const char *k, *v;
    size_t kn, vn;
    ASSERT_EQ(hearth_worker_parameter(w, 0, &k, &kn, &v, &vn), HEARTH_OK);
    EXPECT_EQ(std::string(v, vn), std::string("v\0w", 3));
    const int64_t x_dims[] = {3}, y_dims[] = {1}, t_dims[] = {-1};
    hearth_tensor_spec in[] = {{"x", HEARTH_F32, 1, x_dims}};
    hearth_tensor_spec out[] = {{"y", HEARTH_F32, 1, y_dims}, {"t", HEARTH_BYTES, 1, t_dims}};
    ASSERT_EQ(hearth_worker_ready(w, in, 1, out, 2, 0, "test"), HEARTH_OK) << hearth_last_error();
    ASSERT_EQ(hearth_worker_next(w), 1) << hearth_last_error();
    EXPECT_EQ(hearth_worker_rows(w), 2);
    const void* data;
    uint64_t nbytes;
    const int64_t* shape;
    int32_t ndim;
    ASSERT_EQ(hearth_worker_input(w, 0, &data, &nbytes, &shape, &ndim), HEARTH_OK);
    ASSERT_EQ(nbytes, 24u);
    ASSERT_EQ(ndim, 2);
    const auto* x = static_cast<const float*>(data);
    // y = row sums, where the server placed it.
    const int64_t y_shape[] = {2, 1};
    void* room = nullptr;
    ASSERT_EQ(hearth_worker_output(w, 0, y_shape, 2, 8, &room), HEARTH_OK) << hearth_last_error();
    auto* y = static_cast<float*>(room);
    y[0] = x[0] + x[1] + x[2];
    y[1] = x[3] + x[4] + x[5];
    // A wrong shape is refused, naming the output.
    const int64_t bad_shape[] = {3, 1};
    EXPECT_EQ(hearth_worker_output(w, 0, bad_shape, 2, 12, &room), HEARTH_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::strstr(hearth_last_error(), "'y'"), nullptr) << hearth_last_error();
    // t: 2 rows of 1 BYTES element of 10000 bytes each: more than the slot's room.
    std::string t;
    for (int r = 0; r < 2; ++r) {
      const uint32_t len = 10000;
      t.append(reinterpret_cast<const char*>(&len), 4);
      t.append(len, static_cast<char>('a' + r));
    }
    const int64_t t_shape[] = {2, 1};
    ASSERT_EQ(hearth_worker_output(w, 1, t_shape, 2, t.size(), &room), HEARTH_OK)
        << hearth_last_error();
    std::memcpy(room, t.data(), t.size());
    ASSERT_EQ(hearth_worker_done(w, HEARTH_OK, nullptr, 0), HEARTH_OK);
    // The server goes away: next says so.
    EXPECT_EQ(hearth_worker_next(w), 0);
    hearth_worker_close(w);
  });

  auto ready = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kReady});
  ASSERT_TRUE(ready.ok()) << ready.status().ToString();
  ASSERT_EQ(ready->ready.outputs.size(), 2u);
  EXPECT_EQ(ready->ready.outputs[1].dtype, DType::kBytes);
  const float x[] = {1, 2, 3, 4, 5, 6};
  std::memcpy(s.data, x, sizeof x);
  control::Run run;
  run.seq = 1;
  run.rows = 2;
  run.slot_bytes = s.size;
  run.inputs = {{0, 24, {2, 3}}};
  run.outputs = {{64, 8, {2, 1}}, {}};
  run.output_placed = {1, 0};
  run.free_offset = 128;
  ASSERT_TRUE(control::SendRun(s.control.get(), run).ok());
  // The BYTES output needs more room: the slot grows, the worker maps it again.
  auto ask = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kDone});
  ASSERT_TRUE(ask.ok()) << ask.status().ToString();
  ASSERT_GT(ask->done.room_needed, s.size);
  s.Grow(ask->done.room_needed);
  ASSERT_TRUE(control::SendRoom(s.control.get(), control::Room{1, s.size}).ok());
  auto done = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kDone});
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  ASSERT_EQ(done->done.status_code, 0u) << done->done.text;
  ASSERT_EQ(done->done.outputs.size(), 2u);
  EXPECT_EQ(done->done.outputs[0], run.outputs[0]);
  const control::SlotTensor& t = done->done.outputs[1];
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 1}));
  ASSERT_TRUE(control::CheckSlotTensor(t, DType::kBytes, 128, s.size, s.data, "t").ok());
  float y[2];
  std::memcpy(y, s.data + 64, sizeof y);
  EXPECT_EQ(y[0], 6.0f);
  EXPECT_EQ(y[1], 15.0f);
  EXPECT_EQ(static_cast<char>(s.data[t.offset + 4]), 'a');
  EXPECT_EQ(static_cast<char>(s.data[t.offset + 10008]), 'b');
  s.control.Reset();
  worker.join();
}

TEST(WorkerCApi, AStandbyWaitsForStartOrLeavesWhenTheServerDoes) {
  {
    Server s;
    control::Setup setup;
    setup.max_batch_size = 2;
    hearth_worker* w = nullptr;
    ASSERT_NO_FATAL_FAILURE(s.Open(setup, &w));
    // Put to work: 1, and then the worker goes on as any other.
    ASSERT_TRUE(control::SendStart(s.control.get()).ok());
    EXPECT_EQ(hearth_worker_wait_start(w), 1);
    const int64_t dims[] = {3};
    hearth_tensor_spec in[] = {{"x", HEARTH_F32, 1, dims}};
    ASSERT_EQ(hearth_worker_ready(w, in, 1, in, 1, 0, ""), HEARTH_OK);
    EXPECT_TRUE(control::ReceiveKind(s.control.get(), 1000, {control::Kind::kReady}).ok());
    // Once ready, there is no start to wait for.
    EXPECT_EQ(hearth_worker_wait_start(w), HEARTH_ERROR_INVALID_ARGUMENT);
    hearth_worker_close(w);
  }
  {
    Server s;
    hearth_worker* w = nullptr;
    ASSERT_NO_FATAL_FAILURE(s.Open(control::Setup{}, &w));
    // The server lets it go: 0, exit quietly.
    s.control.Reset();
    EXPECT_EQ(hearth_worker_wait_start(w), 0);
    hearth_worker_close(w);
  }
  {
    Server s;
    hearth_worker* w = nullptr;
    ASSERT_NO_FATAL_FAILURE(s.Open(control::Setup{}, &w));
    // Anything but kStart is refused.
    ASSERT_TRUE(control::SendCredit(s.control.get(), control::Credit{1}).ok());
    EXPECT_EQ(hearth_worker_wait_start(w), HEARTH_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(hearth_last_error()).find("unexpected control message"),
              std::string::npos)
        << hearth_last_error();
    hearth_worker_close(w);
  }
}

TEST(WorkerCApi, AMalformedBatchIsRefusedAndAFailureReachesTheServer) {
  Server s;
  control::Setup setup;
  setup.max_batch_size = 2;
  hearth_worker* w = nullptr;
  ASSERT_NO_FATAL_FAILURE(s.Open(setup, &w));
  const int64_t dims[] = {3};
  hearth_tensor_spec in[] = {{"x", HEARTH_F32, 1, dims}};
  // A spec with an unknown dtype is refused before anything is sent.
  hearth_tensor_spec bad[] = {{"x", 77, 1, dims}};
  EXPECT_EQ(hearth_worker_ready(w, bad, 1, in, 1, 0, ""), HEARTH_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(hearth_worker_ready(w, in, 1, in, 1, 0, ""), HEARTH_OK);
  ASSERT_TRUE(control::ReceiveKind(s.control.get(), 1000, {control::Kind::kReady}).ok());
  // Input bytes past the slot.
  control::Run run;
  run.seq = 1;
  run.rows = 1;
  run.slot_bytes = s.size;
  run.inputs = {{4090, 12, {1, 3}}};
  run.outputs = {{}};
  run.output_placed = {0};
  run.free_offset = s.size;
  ASSERT_TRUE(control::SendRun(s.control.get(), run).ok());
  EXPECT_EQ(hearth_worker_next(w), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(hearth_last_error(), "outside the slot"), nullptr) << hearth_last_error();
  // More rows than max_batch_size.
  run.inputs = {{0, 36, {3, 3}}};
  run.rows = 3;
  ASSERT_TRUE(control::SendRun(s.control.get(), run).ok());
  EXPECT_EQ(hearth_worker_next(w), HEARTH_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::strstr(hearth_last_error(), "outside [1, 2]"), nullptr) << hearth_last_error();
  // A batch that fails, asking to be split.
  run.rows = 1;
  run.inputs = {{0, 12, {1, 3}}};
  ASSERT_TRUE(control::SendRun(s.control.get(), run).ok());
  ASSERT_EQ(hearth_worker_next(w), 1);
  ASSERT_EQ(hearth_worker_done(w, HEARTH_ERROR_INTERNAL, "ValueError: no", 1), HEARTH_OK);
  auto done = control::ReceiveKind(s.control.get(), 1000, {control::Kind::kDone});
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->done.status_code, static_cast<uint32_t>(StatusCode::kInternal));
  EXPECT_EQ(done->done.text, "ValueError: no");
  EXPECT_TRUE(done->done.retry_alone);
  hearth_worker_close(w);
}

// A batch naming a client's CUDA shared-memory region that this process
// cannot open (no GPU here; a junk handle on a GPU machine) is answered with
// the error, naming the region, to be run request by request; it is never
// handed to the model, and the next batch is served.
TEST(WorkerCApi, ABatchWhoseCudaRegionCannotBeOpenedIsAnsweredNotServed) {
  Server s;
  control::Setup setup;
  setup.max_batch_size = 2;
  hearth_worker* w = nullptr;
  ASSERT_NO_FATAL_FAILURE(s.Open(setup, &w));
  const int64_t dims[] = {3};
  hearth_tensor_spec in[] = {{"x", HEARTH_F32, 1, dims}};
  ASSERT_EQ(hearth_worker_ready(w, in, 1, in, 1, 0, ""), HEARTH_OK);
  ASSERT_TRUE(control::ReceiveKind(s.control.get(), 1000, {control::Kind::kReady}).ok());
  control::Run run;
  run.seq = 1;
  run.rows = 1;
  run.slot_bytes = s.size;
  run.inputs = {{0, 12, {1, 3}}};
  run.outputs = {{64, 12, {1, 3}}};
  run.output_placed = {1};
  run.free_offset = 128;
  control::DeviceRegion region;
  region.id = 41;
  region.name = "in-region";
  region.handle.fill(0xab);
  region.byte_size = 1024;
  run.regions = {region};
  run.copies = {{0, false, 0, 0, 12, 0}};
  ASSERT_TRUE(control::SendRun(s.control.get(), run).ok());
  control::Run plain = run;
  plain.seq = 2;
  plain.regions.clear();
  plain.copies.clear();
  // Between the two, the server says a region was unregistered: taken in
  // passing by the worker, which waits on for the next batch.
  ASSERT_TRUE(control::SendRelease(s.control.get()).ok());
  ASSERT_TRUE(control::SendRun(s.control.get(), plain).ok());
  ASSERT_EQ(hearth_worker_next(w), 1) << hearth_last_error();
  auto refused = control::ReceiveKind(s.control.get(), 1000, {control::Kind::kDone});
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->done.seq, 1u);
  EXPECT_NE(refused->done.status_code, 0u);
  EXPECT_NE(refused->done.text.find("CUDA shared-memory region 'in-region'"), std::string::npos)
      << refused->done.text;
  EXPECT_TRUE(refused->done.retry_alone);
  // The batch handed out is the second.
  void* room = nullptr;
  const int64_t shape[] = {1, 3};
  ASSERT_EQ(hearth_worker_output(w, 0, shape, 2, 12, &room), HEARTH_OK) << hearth_last_error();
  std::memset(room, 0, 12);
  ASSERT_EQ(hearth_worker_done(w, HEARTH_OK, nullptr, 0), HEARTH_OK) << hearth_last_error();
  auto served = control::ReceiveKind(s.control.get(), 1000, {control::Kind::kDone});
  ASSERT_TRUE(served.ok());
  EXPECT_EQ(served->done.seq, 2u);
  EXPECT_EQ(served->done.status_code, 0u) << served->done.text;
  // A release of some regions is taken in passing too. A compact run (the
  // bytes in regions given no room in the slot) is for workers that take
  // device addresses; this one reads host memory, and refuses it.
  const std::vector<uint64_t> gone = {41, 77};
  ASSERT_TRUE(control::SendRelease(s.control.get(), gone).ok());
  control::Run compact = run;
  compact.seq = 3;
  compact.compact = true;
  ASSERT_TRUE(control::SendRun(s.control.get(), compact).ok());
  EXPECT_LT(hearth_worker_next(w), 0);
  EXPECT_NE(
      std::string(hearth_last_error()).find("a compact run for a worker that takes no device"),
      std::string::npos)
      << hearth_last_error();
  hearth_worker_close(w);
}

}  // namespace
}  // namespace hearth

namespace hearth {
namespace {

// BYTES element `text` in KServe's form.
std::string Element(const std::string& text) {
  std::string e(4, '\0');
  const auto len = static_cast<uint32_t>(text.size());
  std::memcpy(e.data(), &len, 4);
  return e + text;
}

// A decoupled model's worker holds several streams: requests opened while
// others stream, responses for any of them in any order under the window,
// each written into the ring and, once it wraps, only over bytes credited;
// a response larger than the ring grows it; a cancelled request ends with
// a final response of its own and is no longer open; resume tokens reach
// the worker.
TEST(WorkerCApi, ADecoupledWorkerHoldsManyStreams) {
  Server s;
  s.Grow(1 << 16);
  control::Setup setup;
  setup.decoupled = true;
  setup.parameters["max_streams"] = "2";
  ASSERT_TRUE(control::SendSetup(s.control.get(), setup).ok());
  const std::string big(600, 'x');  // past the first ring's 512 bytes

  std::thread worker([&] {
    hearth_worker* w = nullptr;
    ASSERT_EQ(hearth_worker_open(s.worker_control, s.worker_slot, 1000, &w), HEARTH_OK)
        << hearth_last_error();
    EXPECT_EQ(hearth_worker_decoupled(w), 1);
    EXPECT_EQ(hearth_worker_stream_capacity(w), 2);
    const int64_t one[] = {1};
    hearth_tensor_spec in[] = {{"text_input", HEARTH_BYTES, 1, one}};
    hearth_tensor_spec out[] = {{"text_output", HEARTH_BYTES, 1, one}};
    ASSERT_EQ(hearth_worker_ready(w, in, 1, out, 1, 0, "test"), HEARTH_OK) << hearth_last_error();
    auto respond = [&](uint64_t id, const std::string& text, bool final) {
      const std::string e = Element(text);
      void* room = nullptr;
      EXPECT_EQ(hearth_worker_stream_output(w, id, 0, one, 1, e.size(), &room), HEARTH_OK)
          << hearth_last_error();
      std::memcpy(room, e.data(), e.size());
      return hearth_worker_stream_respond(w, id, final ? 1 : 0, HEARTH_OK, nullptr);
    };
    uint64_t a = 0, b = 0;
    ASSERT_EQ(hearth_worker_stream_next(w, -1, &a), 1) << hearth_last_error();
    ASSERT_EQ(hearth_worker_stream_next(w, -1, &b), 1) << hearth_last_error();
    const char *rid = nullptr, *params = nullptr;
    const int64_t* resume = nullptr;
    uint64_t resumed = 0;
    ASSERT_EQ(hearth_worker_stream_request(w, b, &rid, &params, &resume, &resumed), HEARTH_OK);
    EXPECT_STREQ(rid, "second");
    EXPECT_STREQ(params, R"({"max_tokens":3})");
    ASSERT_EQ(resumed, 2u);
    EXPECT_EQ(resume[0], 11);
    EXPECT_EQ(resume[1], 12);
    const void* data = nullptr;
    uint64_t bytes = 0;
    const int64_t* shape = nullptr;
    int32_t ndim = 0;
    ASSERT_EQ(hearth_worker_stream_input(w, a, 0, &data, &bytes, &shape, &ndim), HEARTH_OK);
    EXPECT_EQ(std::string(static_cast<const char*>(data) + 4, bytes - 4), "first");
    // Interleaved, 40 responses: the ring (512 bytes) wraps many times.
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(respond(b, "b" + std::to_string(i), false), 1) << hearth_last_error();
      EXPECT_EQ(respond(a, "a" + std::to_string(i), false), 1) << hearth_last_error();
    }
    // Larger than the ring: it grows.
    EXPECT_EQ(respond(a, big, true), 1) << hearth_last_error();
    // b is cancelled: told, and then not open.
    uint64_t id = 0;
    ASSERT_EQ(hearth_worker_stream_next(w, -1, &id), 2) << hearth_last_error();
    EXPECT_EQ(id, b);
    EXPECT_EQ(hearth_worker_stream_respond(w, b, 0, HEARTH_OK, nullptr), 2);
    ASSERT_EQ(hearth_worker_stream_next(w, -1, &id), 0);  // the server went away
    hearth_worker_close(w);
  });

  ASSERT_TRUE(control::ReceiveKind(s.control.get(), 5000, {control::Kind::kReady}).ok());
  const control::Ring ring{4096, 512, s.size};
  ASSERT_TRUE(control::SendRing(s.control.get(), ring).ok());
  const std::string first = Element("first"), second = Element("second");
  std::memcpy(s.data, first.data(), first.size());
  std::memcpy(s.data + 64, second.data(), second.size());
  const int64_t tokens[] = {11, 12};
  std::memcpy(s.data + 128, tokens, sizeof tokens);
  control::Open open;
  open.id = 1;
  open.slot_bytes = s.size;
  open.inputs = {{0, first.size(), {1}}};
  open.resume.shape = {0};
  ASSERT_TRUE(control::SendOpen(s.control.get(), open).ok());
  open.id = 2;
  open.request_id = "second";
  open.parameters_json = R"({"max_tokens":3})";
  open.inputs = {{64, second.size(), {1}}};
  open.resume = {128, sizeof tokens, {2}};
  ASSERT_TRUE(control::SendOpen(s.control.get(), open).ok());
  std::map<uint64_t, std::vector<std::string>> got;
  control::Ring now = ring;
  bool grew = false;
  while (got[1].size() < 21) {
    auto m = control::ReceiveKind(s.control.get(), 5000,
                                  {control::Kind::kResponse, control::Kind::kRingGrow});
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    if (m->kind == control::Kind::kRingGrow) {
      // Asked with every response taken; the new ring lies past the old.
      ASSERT_GE(m->ring_grow.bytes, big.size() + 4);
      s.Grow(1 << 17);
      now = control::Ring{1 << 16, m->ring_grow.bytes, s.size};
      ASSERT_TRUE(control::SendRing(s.control.get(), now).ok());
      grew = true;
      continue;
    }
    const control::Response& r = m->response;
    ASSERT_EQ(r.present, (std::vector<uint8_t>{1}));
    ASSERT_TRUE(control::CheckSlotTensor(r.outputs[0], DType::kBytes, now.offset,
                                         now.offset + now.bytes, s.data, "piece")
                    .ok());
    got[r.id].emplace_back(reinterpret_cast<const char*>(s.data + r.outputs[0].offset + 4),
                           r.outputs[0].bytes - 4);
    EXPECT_EQ(r.final, r.id == 1 && got[1].size() == 21);
    // Taken: credited at once, so that the ring's bytes are free again.
    ASSERT_TRUE(control::SendCredit(s.control.get(), control::Credit{1}).ok());
  }
  EXPECT_TRUE(grew);
  ASSERT_EQ(got[2].size(), 20u);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(got[1][static_cast<size_t>(i)], "a" + std::to_string(i));
    EXPECT_EQ(got[2][static_cast<size_t>(i)], "b" + std::to_string(i));
  }
  EXPECT_EQ(got[1][20], big);
  const std::vector<uint64_t> cancel = {2};
  ASSERT_TRUE(control::SendCancel(s.control.get(), cancel).ok());
  auto ended = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kResponse});
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  EXPECT_EQ(ended->response.id, 2u);
  EXPECT_TRUE(ended->response.final);
  s.control.Reset();
  worker.join();
}

}  // namespace
}  // namespace hearth
