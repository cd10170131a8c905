// hearth-worker's loop for engines (worker/engine_loop.h) with the count
// engine, driven from the server's side of the protocol over a real
// socketpair and slot: four streams held at once and stepped together, a
// cancel among them, a resumed stream, a request the engine refuses, and
// the loop's end when the server goes away.
#include "worker/engine_loop.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hearth/unique_fd.h"
#include "protocol/life_lock.h"
#include "protocol/worker_protocol.h"
#include "worker/session.h"

namespace hearth {
namespace {

struct Server {
  UniqueFd control, slot;
  int worker_control = -1, worker_slot = -1;
  std::byte* data = nullptr;
  uint64_t size = 1 << 16;

  Server() {
    int sv[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    control.Reset(sv[0]);
    worker_control = sv[1];
    slot.Reset(::memfd_create("engine-loop-slot", MFD_CLOEXEC));
    worker_slot = ::dup(slot.get());
    // The slot's data after its header (the worker's life lock), as the server lays it out.
    const uint64_t file = control::kSlotHeaderBytes + size;
    EXPECT_EQ(::ftruncate(slot.get(), static_cast<off_t>(file)), 0);
    void* p = ::mmap(nullptr, file, PROT_READ | PROT_WRITE, MAP_SHARED, slot.get(), 0);
    EXPECT_NE(p, MAP_FAILED);
    data = static_cast<std::byte*>(p) + control::kSlotHeaderBytes;
  }
  ~Server() { ::munmap(data - control::kSlotHeaderBytes, control::kSlotHeaderBytes + size); }

  // Request `id` counting to `n` from slot offset id * 64, with `resume`
  // tokens after it.
  Status Open(uint64_t id, int64_t n, std::string parameters = "",
              std::vector<int64_t> resume = {}) {
    const uint64_t at = id * 64;
    std::memcpy(data + at, &n, sizeof n);
    control::Open open;
    open.id = id;
    open.slot_bytes = size;
    open.inputs = {{at, sizeof n, {1}}};
    open.parameters_json = std::move(parameters);
    open.resume.shape = {static_cast<int64_t>(resume.size())};
    if (!resume.empty()) {
      open.resume.offset = 8192 + at;
      open.resume.bytes = resume.size() * sizeof(int64_t);
      std::memcpy(data + open.resume.offset, resume.data(), open.resume.bytes);
    }
    return control::SendOpen(control.get(), open);
  }

  // The next response, credited at once.
  control::Response Next() {
    auto m = control::ReceiveKind(control.get(), 10000, {control::Kind::kResponse});
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {};
    EXPECT_TRUE(control::SendCredit(control.get(), control::Credit{1}).ok());
    return m->response;
  }
  int64_t Number(const control::Response& r) {
    EXPECT_EQ(r.present, (std::vector<uint8_t>{1}));
    if (r.present != std::vector<uint8_t>{1}) return -1;
    EXPECT_TRUE(control::CheckSlotTensor(r.outputs[0], DType::kI64, ring.offset,
                                         ring.offset + ring.bytes, data, "token_ids")
                    .ok());
    EXPECT_EQ(r.outputs[0].shape, (std::vector<int64_t>{1}));
    int64_t v = 0;
    std::memcpy(&v, data + r.outputs[0].offset, sizeof v);
    return v;
  }
  // The setup of a decoupled model of 4 streams, and the response ring.
  Status SendSetupAndRing() {
    control::Setup setup;
    setup.decoupled = true;
    setup.parameters["max_streams"] = "4";
    RETURN_IF_ERROR(control::SendSetup(control.get(), setup));
    ring.slot_bytes = size;
    return control::SendRing(control.get(), ring);
  }
  control::Ring ring{16384, 4096, 0};
};

// The worker's side, in a thread: the session, the engine (the count
// engine unless given), the loop.
void RunWorker(Server& s, Status* served, Engine* given = nullptr) {
  auto session = WorkerSession::Open(s.worker_control, s.worker_slot, 5000);
  ASSERT_TRUE(session.ok()) << session.status().ToString();
  std::unique_ptr<Engine> made;
  if (given == nullptr) {
    EngineOptions options;
    options.batching = false;
    options.max_streams = (*session)->stream_capacity();
    auto engine = CreateEngine("count", {}, Device::Host(), options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    made = std::move(*engine);
  }
  Engine& engine = given != nullptr ? *given : *made;
  ASSERT_TRUE((*session)->Ready(engine.inputs(), engine.outputs(), 0, "test").ok());
  *served = ServeStreams(**session, engine);
}

TEST(EngineLoop, ServesFourStreamsACancelAndAResume) {
  Server s;
  // The ring and four requests, the last resumed after the three tokens its
  // client has, are queued before the worker starts: its first step finds
  // all four.
  ASSERT_TRUE(s.SendSetupAndRing().ok());
  ASSERT_TRUE(s.Open(1, 6).ok());
  ASSERT_TRUE(s.Open(2, 6, R"({"start": 100})").ok());
  ASSERT_TRUE(s.Open(3, 50).ok());
  ASSERT_TRUE(s.Open(4, 5, R"({"start": "20"})", {20, 21, 22}).ok());
  Status served = Internal("not run");
  std::thread worker([&] { RunWorker(s, &served); });

  auto ready = control::ReceiveKind(s.control.get(), 10000, {control::Kind::kReady});
  ASSERT_TRUE(ready.ok()) << ready.status().ToString();
  EXPECT_EQ(ready->ready.streams, 4u);
  EXPECT_EQ(ready->ready.outputs, (std::vector<TensorSpec>{{"token_ids", DType::kI64, {-1}}}));

  std::map<uint64_t, std::vector<int64_t>> got;
  std::map<uint64_t, bool> final;
  // The first step: one response for each of the four, in turn.
  for (uint64_t id : {1, 2, 3, 4}) {
    control::Response r = s.Next();
    ASSERT_EQ(r.id, id);
    ASSERT_EQ(r.status_code, 0u) << r.text;
    got[id].push_back(s.Number(r));
    EXPECT_FALSE(r.final);
  }
  const std::vector<uint64_t> cancel = {3};
  ASSERT_TRUE(control::SendCancel(s.control.get(), cancel).ok());
  // The cancel's own final response comes, and nothing for 3 after it.
  bool ended3 = false;
  while (!(final[1] && final[2] && final[4] && ended3)) {
    control::Response r = s.Next();
    ASSERT_FALSE(final[r.id]) << "a response after request " << r.id << "'s final one";
    ASSERT_EQ(r.status_code, 0u) << r.text;
    if (r.id == 3 && r.final) {
      ended3 = true;
      final[3] = true;
      continue;
    }
    got[r.id].push_back(s.Number(r));
    final[r.id] = r.final;
  }
  EXPECT_EQ(got[1], (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(got[2], (std::vector<int64_t>{100, 101, 102, 103, 104, 105}));
  EXPECT_EQ(got[4], (std::vector<int64_t>{23, 24}));
  EXPECT_LT(got[3].size(), 50u);
  for (size_t k = 0; k < got[3].size(); ++k) EXPECT_EQ(got[3][k], static_cast<int64_t>(k));

  // A request the engine refuses ends with its error, and the worker goes on.
  ASSERT_TRUE(s.Open(5, 0).ok());
  control::Response refused = s.Next();
  EXPECT_EQ(refused.id, 5u);
  EXPECT_TRUE(refused.final);
  EXPECT_EQ(refused.status_code, static_cast<uint32_t>(StatusCode::kInvalidArgument));
  EXPECT_NE(refused.text.find("input n"), std::string::npos) << refused.text;
  ASSERT_TRUE(s.Open(6, 1).ok());
  control::Response one = s.Next();
  EXPECT_EQ(one.id, 6u);
  EXPECT_TRUE(one.final);
  EXPECT_EQ(s.Number(one), 0);

  s.control.Reset();  // the server goes away: the loop ends, OK
  worker.join();
  EXPECT_TRUE(served.ok()) << served.ToString();
}

// Holds every stream it is given until it is cancelled, answering none;
// its counters say how many it holds.
class HoldingEngine final : public Engine {
 public:
  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint32_t capacity() const override { return 4; }
  uint64_t device_memory_bytes() const override { return 0; }
  bool busy() const override { return !held_.empty(); }
  void Cancel(uint64_t id) override { held_.erase(id); }
  Status Add(uint64_t id, const EngineRequest&) override {
    held_.insert(id);
    return Status::Ok();
  }
  Status Step(ResponseSink&) override { return Status::Ok(); }
  EngineCounters counters() const override { return {held_.size(), 4, 0}; }

 private:
  std::vector<IoSpec> inputs_{{"n", DType::kI64, {1}}};
  std::vector<IoSpec> outputs_{{"token_ids", DType::kI64, {-1}}};
  std::set<uint64_t> held_;
};

TEST(EngineLoop, AnEngineLeftIdleByACancelTellsItsCountersAtOnce) {
  Server s;
  ASSERT_TRUE(s.SendSetupAndRing().ok());
  Status served = Internal("not run");
  HoldingEngine engine;
  std::thread worker([&] { RunWorker(s, &served, &engine); });
  ASSERT_TRUE(control::ReceiveKind(s.control.get(), 10000, {control::Kind::kReady}).ok());
  // The stats the worker sends next, past the final responses of the
  // streams cancelled (credited).
  const auto next_stats = [&]() -> control::EngineStats {
    for (;;) {
      auto m = control::ReceiveKind(s.control.get(), 10000,
                                    {control::Kind::kEngineStats, control::Kind::kResponse});
      EXPECT_TRUE(m.ok()) << m.status().ToString();
      if (!m.ok()) return control::EngineStats{};
      if (m->kind == control::Kind::kEngineStats) return m->engine_stats;
      EXPECT_TRUE(m->response.final);
      EXPECT_TRUE(control::SendCredit(s.control.get(), control::Credit{1}).ok());
    }
  };
  EXPECT_EQ(next_stats().kv_blocks_used, 0u);  // at the start
  ASSERT_TRUE(s.Open(1, 5).ok());
  ASSERT_TRUE(s.Open(2, 5).ok());
  // While busy, at most once every few dozen steps: two streams held.
  control::EngineStats busy = next_stats();
  while (busy.kv_blocks_used < 2) busy = next_stats();
  EXPECT_EQ(busy.kv_blocks_used, 2u);
  const std::vector<uint64_t> cancel = {1, 2};
  ASSERT_TRUE(control::SendCancel(s.control.get(), cancel).ok());
  // Idle now, with no step to come: the stats say so without one.
  EXPECT_EQ(next_stats().kv_blocks_used, 0u);
  s.control.Reset();
  worker.join();
  EXPECT_TRUE(served.ok()) << served.ToString();
}

}  // namespace
}  // namespace hearth
