// libhearth's worker interface (hearth_worker_*), driven from the server's
// side of the protocol in this test: a batch is read in place, outputs are
// placed by the server or by the worker, the slot grows when a worker's
// output does not fit, and every malformed request is refused.
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/hearth.h"
#include "hearth/unique_fd.h"
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
    if (data != nullptr) ::munmap(data, size);
  }
  // Queues `setup` and opens the worker's end (as a worker process does).
  void Open(const control::Setup& setup, hearth_worker** w) {
    ASSERT_TRUE(control::SendSetup(control.get(), setup).ok());
    ASSERT_EQ(hearth_worker_open(worker_control, worker_slot, 1000, w), HEARTH_OK)
        << hearth_last_error();
  }
  void Grow(uint64_t bytes) {
    if (data != nullptr) ::munmap(data, size);
    ASSERT_EQ(::ftruncate(slot.get(), static_cast<off_t>(bytes)), 0);
    data = static_cast<std::byte*>(
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, slot.get(), 0));
    ASSERT_NE(data, MAP_FAILED);
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
    ASSERT_TRUE(control::SendAck(s.control.get(), control::Ack{1, false}).ok());
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

// A decoupled model answers one request with a stream: each response is
// taken (acknowledged) before the next is written into the same room, an
// output may be absent from a response, and a cancel stops the stream.
TEST(WorkerCApi, ADecoupledModelStreamsResponsesUntilCancelled) {
  Server s;
  control::Setup setup;
  setup.max_batch_size = 0;
  setup.decoupled = true;
  ASSERT_TRUE(control::SendSetup(s.control.get(), setup).ok());

  std::thread worker([&] {
    hearth_worker* w = nullptr;
    ASSERT_EQ(hearth_worker_open(s.worker_control, s.worker_slot, 1000, &w), HEARTH_OK)
        << hearth_last_error();
    EXPECT_EQ(hearth_worker_decoupled(w), 1);
    const int64_t one[] = {1};
    hearth_tensor_spec in[] = {{"text_input", HEARTH_BYTES, 1, one}};
    hearth_tensor_spec out[] = {{"text_output", HEARTH_BYTES, 1, one},
                                {"completion_tokens", HEARTH_I64, 1, one}};
    ASSERT_EQ(hearth_worker_ready(w, in, 1, out, 2, 0, "test"), HEARTH_OK) << hearth_last_error();
    ASSERT_EQ(hearth_worker_next(w), 1) << hearth_last_error();
    EXPECT_STREQ(hearth_worker_parameters_json(w), R"({"max_tokens":3})");
    int32_t go_on = 1;
    int pieces = 0;
    while (go_on == 1) {
      const std::string piece = "tok" + std::to_string(pieces);
      std::string element(4, '\0');
      const auto len = static_cast<uint32_t>(piece.size());
      std::memcpy(element.data(), &len, 4);
      element += piece;
      void* room = nullptr;
      ASSERT_EQ(hearth_worker_output(w, 0, one, 1, element.size(), &room), HEARTH_OK)
          << hearth_last_error();
      std::memcpy(room, element.data(), element.size());
      go_on = hearth_worker_respond(w);
      ++pieces;
    }
    EXPECT_EQ(go_on, 0) << hearth_last_error();
    // The last response: the count alone.
    void* room = nullptr;
    ASSERT_EQ(hearth_worker_output(w, 1, one, 1, 8, &room), HEARTH_OK) << hearth_last_error();
    const int64_t count = pieces;
    std::memcpy(room, &count, 8);
    ASSERT_EQ(hearth_worker_done(w, HEARTH_OK, nullptr, 0), HEARTH_OK) << hearth_last_error();
    hearth_worker_close(w);
  });

  auto ready = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kReady});
  ASSERT_TRUE(ready.ok()) << ready.status().ToString();
  const std::string input = std::string("\x05\0\0\0hello", 9);
  std::memcpy(s.data, input.data(), input.size());
  control::Run run;
  run.seq = 7;
  run.rows = 1;
  run.slot_bytes = s.size;
  run.inputs = {{0, input.size(), {1}}};
  run.outputs = {{}, {}};
  run.output_placed = {0, 0};
  run.free_offset = 64;
  run.parameters_json = R"({"max_tokens":3})";
  ASSERT_TRUE(control::SendRun(s.control.get(), run).ok());
  std::vector<std::string> got;
  for (int i = 0; i < 3; ++i) {
    auto partial = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kPartial});
    ASSERT_TRUE(partial.ok()) << partial.status().ToString();
    const control::Done& d = partial->done;
    ASSERT_EQ(d.present, (std::vector<uint8_t>{1, 0}));
    ASSERT_TRUE(
        control::CheckSlotTensor(d.outputs[0], DType::kBytes, 64, s.size, s.data, "piece").ok());
    got.emplace_back(reinterpret_cast<const char*>(s.data + d.outputs[0].offset + 4),
                     d.outputs[0].bytes - 4);
    ASSERT_TRUE(control::SendAck(s.control.get(), control::Ack{7, i == 2}).ok());
  }
  EXPECT_EQ(got, (std::vector<std::string>{"tok0", "tok1", "tok2"}));
  auto done = control::ReceiveKind(s.control.get(), 5000, {control::Kind::kDone});
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  ASSERT_EQ(done->done.status_code, 0u) << done->done.text;
  ASSERT_EQ(done->done.present, (std::vector<uint8_t>{0, 1}));
  int64_t count = 0;
  std::memcpy(&count, s.data + done->done.outputs[1].offset, 8);
  EXPECT_EQ(count, 3);
  worker.join();
}

}  // namespace
}  // namespace hearth
