// The exchange with one worker against a fake worker on the other end of a
// socketpair, speaking the worker protocol with its own encoders. Most
// tests are plain code: what the fake worker says is queued on the socket
// before the exchange waits for it, and where time matters the exchange
// runs on a clock the test drives, so that nothing depends on how fast the
// machine is. One test runs a fake worker in a thread that reacts to what
// it is sent (the slot grown under it). Streams: stream_runner_test.cc.
#include "server/worker_exchange.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "hearth/unique_fd.h"
#include "protocol/life_lock.h"
#include "server/crash_retry.h"
#include "server/job_queue.h"

namespace hearth {
namespace {

using std::chrono::seconds;

// Time moves only as the exchange waits. What a wait finds on the socket is
// what the fake worker queued there before it: a message queued arrives
// `arrival` after the wait begins (time moves on by that much) unless the
// wait's time runs out first; with nothing queued, the wait runs out (time
// moves to its end).
class FakeClock final : public ExchangeClock {
 public:
  Clock::time_point Now() const override {
    return Clock::time_point(Clock::duration(now_ns_.load()));
  }
  Status WaitReadable(int fd, int timeout_ms) const override {
    pollfd p{fd, POLLIN, 0};
    const bool queued = ::poll(&p, 1, 0) > 0;
    if (timeout_ms < 0 && !queued)
      return Internal("a wait without end for a message the fake worker never queued");
    const auto limit = timeout_ms < 0 ? Clock::duration::max()
                                      : Clock::duration(std::chrono::milliseconds(timeout_ms));
    if (queued && arrival_ <= limit) {
      now_ns_ += arrival_.count();
      return Status::Ok();
    }
    now_ns_ += limit.count();
    return DeadlineExceeded("timeout");
  }
  void set_arrival(Clock::duration d) { arrival_ = d; }

 private:
  mutable std::atomic<Clock::rep> now_ns_{
      std::chrono::duration_cast<Clock::duration>(std::chrono::hours(1)).count()};
  Clock::duration arrival_{0};
};

// The two ends of a worker's control socket.
struct Wire {
  UniqueFd server, worker;
};

Wire Connect() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

RequestSlot MakeSlot() {
  Result<RequestSlot> slot = RequestSlot::Create("hearth-exchange-test");
  EXPECT_TRUE(slot.ok()) << slot.status().ToString();
  EXPECT_TRUE(slot->Reserve(64u << 10, 1u << 20).ok());
  return std::move(*slot);
}

// A model that does not batch, with one output of two floats that the
// server places.
const std::vector<TensorSpec> kPair = {{"y", DType::kF32, {2}}};
// A model whose one output, of any length, the worker places.
const std::vector<TensorSpec> kAnyLength = {{"tokens", DType::kF32, {-1}}};

// kPair's run: its output at 64, the worker's room from 128.
control::Run PairRun(uint64_t seq, const RequestSlot& slot) {
  control::Run run;
  run.seq = seq;
  run.rows = 1;
  run.slot_bytes = slot.size();
  run.outputs = {control::SlotTensor{64, 8, {2}}};
  run.output_placed = {1};
  run.free_offset = 128;
  return run;
}

// kAnyLength's run: the worker places its output anywhere from 128.
control::Run AnyLengthRun(uint64_t seq, const RequestSlot& slot) {
  control::Run run;
  run.seq = seq;
  run.rows = 1;
  run.slot_bytes = slot.size();
  run.outputs = {control::SlotTensor{}};
  run.output_placed = {0};
  run.free_offset = 128;
  return run;
}

// The next message on the fake worker's end, which the exchange has
// already sent (or sends within `timeout_ms`, for a worker in a thread).
control::Message Expect(int fd, control::Kind kind, int timeout_ms = 0) {
  Result<control::Message> m = control::ReceiveKind(fd, timeout_ms, {kind});
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(*m) : control::Message{};
}

void PutFloats(std::byte* at, const std::vector<float>& values) {
  std::memcpy(at, values.data(), values.size() * sizeof(float));
}

std::vector<float> GetFloats(const std::byte* at, size_t count) {
  std::vector<float> values(count);
  std::memcpy(values.data(), at, count * sizeof(float));
  return values;
}

// One float of kAnyLength's output at `offset`, present.
control::Done OneToken(uint64_t seq, uint64_t offset) {
  control::Done d;
  d.seq = seq;
  d.outputs = {control::SlotTensor{offset, 4, {1}}};
  d.present = {1};
  return d;
}

TEST(WorkerExchange, ABatchIsSentAndItsAnswerReadFromTheSlot) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  FakeClock clock;
  WorkerExchange exchange(wire.server.get(), slot, {kPair, false}, 1u << 20, clock);
  const control::Run run = PairRun(7, slot);
  ASSERT_TRUE(exchange.Send(run).ok());

  const control::Message got = Expect(wire.worker.get(), control::Kind::kRun);
  EXPECT_EQ(got.run.seq, 7u);
  ASSERT_EQ(got.run.outputs.size(), 1u);
  EXPECT_EQ(got.run.outputs[0], run.outputs[0]);
  PutFloats(slot.data() + 64, {1.5f, -2.0f});
  control::Done done;
  done.seq = 7;
  done.run_us = 42;
  done.outputs = {run.outputs[0]};
  ASSERT_TRUE(control::SendDone(wire.worker.get(), done).ok());

  const Answer answer = exchange.AwaitDone(run, clock.Now() + seconds(5));
  ASSERT_EQ(answer.ending, Ending::kAnswered) << answer.why.ToString();
  EXPECT_EQ(answer.done.run_us, 42u);
  EXPECT_TRUE(exchange.CheckAnswer(run, answer.done, 1).ok());
  EXPECT_EQ(GetFloats(slot.data() + answer.done.outputs[0].offset, 2),
            (std::vector<float>{1.5f, -2.0f}));
  // Nothing else was said to the worker.
  EXPECT_FALSE(exchange.GoneWhileIdle(0));
  pollfd p{wire.worker.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0);
}

TEST(WorkerExchange, AWorkerThatAsksForRoomGetsTheSlotGrownUnderIt) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  const uint64_t before = slot.size();
  WorkerExchange exchange(wire.server.get(), slot, {kAnyLength, false}, 1u << 20);
  const control::Run run = AnyLengthRun(3, slot);
  // Its output, past the slot it was given: 2048 floats at `before`.
  const std::vector<float> tokens(2048, 0.25f);
  const uint64_t bytes = tokens.size() * sizeof(float);
  std::optional<control::Room> room;
  off_t seen_size = 0;
  std::thread worker([&] {
    const int fd = wire.worker.get();
    const control::Message m = Expect(fd, control::Kind::kRun, 10000);
    control::Done ask;
    ask.seq = m.run.seq;
    ask.room_needed = m.run.slot_bytes + bytes;
    ASSERT_TRUE(control::SendDone(fd, ask).ok());
    room = Expect(fd, control::Kind::kRoom, 10000).room;
    // Maps the slot as a worker does, from the descriptor, at its new size.
    struct stat st {};
    ASSERT_EQ(::fstat(slot.fd(), &st), 0);
    seen_size = st.st_size;
    const uint64_t mapped = control::kSlotHeaderBytes + room->slot_bytes;
    void* p = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, slot.fd(), 0);
    ASSERT_NE(p, MAP_FAILED);
    PutFloats(static_cast<std::byte*>(p) + control::kSlotHeaderBytes + m.run.slot_bytes, tokens);
    ::munmap(p, mapped);
    control::Done done;
    done.seq = m.run.seq;
    done.outputs = {control::SlotTensor{m.run.slot_bytes, bytes, {2048}}};
    ASSERT_TRUE(control::SendDone(fd, done).ok());
  });
  ASSERT_TRUE(exchange.Send(run).ok());
  const Answer answer = exchange.AwaitDone(run, Clock::now() + std::chrono::minutes(10));
  worker.join();

  ASSERT_EQ(answer.ending, Ending::kAnswered) << answer.why.ToString();
  ASSERT_TRUE(room.has_value());
  EXPECT_EQ(room->seq, 3u);
  EXPECT_GE(slot.size(), before + bytes);
  EXPECT_EQ(room->slot_bytes, slot.size());
  EXPECT_GE(static_cast<uint64_t>(seen_size), before + bytes);
  // Inside the grown slot only: the check and the read go by its new size.
  EXPECT_TRUE(exchange.CheckAnswer(run, answer.done, 1).ok());
  EXPECT_EQ(GetFloats(slot.data() + before, tokens.size()), tokens);
}

TEST(WorkerExchange, RoomItHadOrPastTheLimitIsNoAnswer) {
  {
    Wire wire = Connect();
    RequestSlot slot = MakeSlot();
    FakeClock clock;
    WorkerExchange exchange(wire.server.get(), slot, {kAnyLength, false}, 1u << 20, clock);
    const control::Run run = AnyLengthRun(1, slot);
    ASSERT_TRUE(exchange.Send(run).ok());
    control::Done ask;
    ask.seq = 1;
    ask.room_needed = slot.size();
    ASSERT_TRUE(control::SendDone(wire.worker.get(), ask).ok());
    const Answer answer = exchange.AwaitDone(run, clock.Now() + seconds(5));
    EXPECT_EQ(answer.ending, Ending::kMalformed);
    EXPECT_NE(answer.why.message().find("asked for room it had"), std::string::npos)
        << answer.why.message();
  }
  {
    Wire wire = Connect();
    RequestSlot slot = MakeSlot();
    const uint64_t before = slot.size();
    FakeClock clock;
    WorkerExchange exchange(wire.server.get(), slot, {kAnyLength, false}, 1u << 20, clock);
    const control::Run run = AnyLengthRun(2, slot);
    ASSERT_TRUE(exchange.Send(run).ok());
    control::Done ask;
    ask.seq = 2;
    ask.room_needed = (1u << 20) + 1;
    ASSERT_TRUE(control::SendDone(wire.worker.get(), ask).ok());
    const Answer answer = exchange.AwaitDone(run, clock.Now() + seconds(5));
    EXPECT_EQ(answer.ending, Ending::kNoRoom);
    EXPECT_EQ(answer.why.code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(slot.size(), before);
    // It was never told the slot grew.
    Expect(wire.worker.get(), control::Kind::kRun);
    pollfd p{wire.worker.get(), POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 0), 0);
  }
}

TEST(WorkerExchange, AWorkerGoneBeforeTheRunDidNotGetIt) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  WorkerExchange exchange(wire.server.get(), slot, {kPair, false}, 1u << 20);
  wire.worker.Reset();
  EXPECT_TRUE(exchange.GoneWhileIdle(0));
  const Status sent = exchange.Send(PairRun(1, slot));
  EXPECT_EQ(sent.code(), StatusCode::kUnavailable) << sent.ToString();
}

TEST(WorkerExchange, AWorkerThatSpokeUnaskedIsNotSentTheRun) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  WorkerExchange exchange(wire.server.get(), slot, {kPair, false}, 1u << 20);
  control::Done stray;
  stray.seq = 99;
  ASSERT_TRUE(control::SendDone(wire.worker.get(), stray).ok());
  EXPECT_TRUE(exchange.GoneWhileIdle(0));
  EXPECT_EQ(exchange.Send(PairRun(1, slot)).code(), StatusCode::kUnavailable);
  pollfd p{wire.worker.get(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0);  // no run reached it
}

// A worker that dies with the run: the exchange says it is gone, and the
// request is retried (RetryAfterCrash) until it has taken down
// kPoisonCrashes workers; then it fails as poison and is not queued again.
TEST(WorkerExchange, AWorkerDyingMidBatchIsGoneAndItsRequestRetriedUntilPoison) {
  JobQueue queue(16);
  auto job = std::make_shared<Job>();
  job->request.id = "r1";
  std::optional<Result<InferResponse>> result;
  job->done = [&](Result<InferResponse> r) { result = std::move(r); };
  for (int crash = 1; crash <= kPoisonCrashes; ++crash) {
    Wire wire = Connect();
    RequestSlot slot = MakeSlot();
    FakeClock clock;
    WorkerExchange exchange(wire.server.get(), slot, {kPair, false}, 1u << 20, clock);
    const control::Run run = PairRun(static_cast<uint64_t>(crash), slot);
    ASSERT_TRUE(exchange.Send(run).ok());
    Expect(wire.worker.get(), control::Kind::kRun);  // it got the run, then died
    wire.worker.Reset();
    const Answer answer = exchange.AwaitDone(run, clock.Now() + seconds(5));
    ASSERT_EQ(answer.ending, Ending::kGone) << answer.why.ToString();

    RetryAfterCrash(job, queue, "m", "poison batch");
    EXPECT_EQ(job->crashes, crash);
    if (crash < kPoisonCrashes) {
      EXPECT_FALSE(result.has_value());
      ASSERT_EQ(queue.size(), 1u);
      std::vector<std::shared_ptr<Job>> again =
          queue.PopBatch(BatchPolicy{}, std::chrono::milliseconds(0));
      ASSERT_EQ(again.size(), 1u);
      EXPECT_EQ(again[0], job);
    }
  }
  EXPECT_EQ(queue.size(), 0u);
  ASSERT_TRUE(result.has_value());
  ASSERT_FALSE(result->ok());
  EXPECT_EQ(result->status().code(), StatusCode::kInternal);
  EXPECT_EQ(result->status().message(),
            "poison batch: this request took down 3 workers of 'm'; it is not retried");
}

TEST(WorkerExchange, AMalformedAnswerIsReportedNotRead) {
  RequestSlot slot = MakeSlot();
  auto answer_to = [&](auto&& say) {
    Wire wire = Connect();
    FakeClock clock;
    WorkerExchange exchange(wire.server.get(), slot, {kPair, false}, 1u << 20, clock);
    const control::Run run = PairRun(5, slot);
    EXPECT_TRUE(exchange.Send(run).ok());
    Expect(wire.worker.get(), control::Kind::kRun);
    say(wire.worker.get(), run);
    Answer a = exchange.AwaitDone(run, clock.Now() + seconds(5));
    if (a.ending == Ending::kAnswered) a.why = exchange.CheckAnswer(run, a.done, 1);
    return a;
  };

  Answer junk = answer_to(
      [](int fd, const control::Run&) { ASSERT_EQ(::send(fd, "not a message", 13, 0), 13); });
  EXPECT_EQ(junk.ending, Ending::kMalformed);
  EXPECT_NE(junk.why.message().find("magic"), std::string::npos) << junk.why.message();

  Answer response = answer_to([](int fd, const control::Run&) {
    control::Response r;
    r.id = 1;
    ASSERT_TRUE(control::SendResponse(fd, r).ok());
  });
  EXPECT_EQ(response.ending, Ending::kMalformed);  // a batch is answered by kDone only

  Answer other = answer_to([](int fd, const control::Run& run) {
    control::Done d;
    d.seq = run.seq + 1;
    d.status_code = static_cast<uint32_t>(StatusCode::kInvalidArgument);
    d.text = "no such run";
    ASSERT_TRUE(control::SendDone(fd, d).ok());
  });
  EXPECT_EQ(other.ending, Ending::kOtherRun);
  EXPECT_EQ(other.done.text, "no such run");

  // Well-formed messages whose outputs are not where they may be.
  Answer outside = answer_to([&](int fd, const control::Run& run) {
    control::Done d;
    d.seq = run.seq;
    d.outputs = {control::SlotTensor{slot.size() - 4, 8, {2}}};
    ASSERT_TRUE(control::SendDone(fd, d).ok());
  });
  ASSERT_EQ(outside.ending, Ending::kAnswered);
  EXPECT_EQ(outside.why.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.why.message().find("not where the server placed it"), std::string::npos)
      << outside.why.message();

  Answer count = answer_to([](int fd, const control::Run& run) {
    control::Done d;
    d.seq = run.seq;
    ASSERT_TRUE(control::SendDone(fd, d).ok());
  });
  ASSERT_EQ(count.ending, Ending::kAnswered);
  EXPECT_NE(count.why.message().find("answer for 0 outputs of 1"), std::string::npos)
      << count.why.message();
}

TEST(WorkerExchange, AWorkerThatPlacesAnOutputPastTheSlotIsCaught) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  FakeClock clock;
  WorkerExchange exchange(wire.server.get(), slot, {kAnyLength, false}, 1u << 20, clock);
  const control::Run run = AnyLengthRun(4, slot);
  ASSERT_TRUE(exchange.Send(run).ok());
  control::Done d;
  d.seq = 4;
  d.outputs = {control::SlotTensor{slot.size() - 4, 8, {2}}};
  ASSERT_TRUE(control::SendDone(wire.worker.get(), d).ok());
  const Answer answer = exchange.AwaitDone(run, clock.Now() + seconds(5));
  ASSERT_EQ(answer.ending, Ending::kAnswered);
  const Status checked = exchange.CheckAnswer(run, answer.done, 1);
  EXPECT_EQ(checked.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(checked.message().find("outside the slot"), std::string::npos) << checked.message();

  control::Done rank2 = answer.done;
  rank2.outputs = {control::SlotTensor{128, 8, {1, 2}}};
  EXPECT_EQ(exchange.CheckAnswer(run, rank2, 1).code(), StatusCode::kInvalidArgument);
  control::Done fits = answer.done;
  fits.outputs = {control::SlotTensor{128, 8, {2}}};
  EXPECT_TRUE(exchange.CheckAnswer(run, fits, 1).ok());
}

TEST(WorkerExchange, ABatchThatRunsPastItsTimeIsReportedAtItsDeadline) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  FakeClock clock;
  WorkerExchange exchange(wire.server.get(), slot, {kPair, false}, 1u << 20, clock);
  const control::Run run = PairRun(1, slot);
  const auto handed_over = clock.Now();
  ASSERT_TRUE(exchange.Send(run).ok());
  Expect(wire.worker.get(), control::Kind::kRun);  // and it says nothing
  const Answer answer = exchange.AwaitDone(run, handed_over + seconds(5));
  EXPECT_EQ(answer.ending, Ending::kTimedOut);
  EXPECT_EQ(clock.Now() - handed_over, seconds(5));
}

// Each message within the batch's time, but the two together past it.
TEST(WorkerExchange, ABatchHasOneDeadlineHoweverOftenItsSlotGrows) {
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  const uint64_t before = slot.size();
  FakeClock clock;
  clock.set_arrival(seconds(3));
  WorkerExchange exchange(wire.server.get(), slot, {kAnyLength, false}, 1u << 20, clock);
  const control::Run run = AnyLengthRun(1, slot);
  const auto handed_over = clock.Now();
  ASSERT_TRUE(exchange.Send(run).ok());
  control::Done ask;
  ask.seq = 1;
  ask.room_needed = before + 4;
  ASSERT_TRUE(control::SendDone(wire.worker.get(), ask).ok());
  control::Done done;
  done.seq = 1;
  done.outputs = {control::SlotTensor{before, 4, {1}}};
  ASSERT_TRUE(control::SendDone(wire.worker.get(), done).ok());

  const Answer answer = exchange.AwaitDone(run, handed_over + seconds(5));
  EXPECT_EQ(answer.ending, Ending::kTimedOut);
  EXPECT_EQ(clock.Now() - handed_over, seconds(5));
  EXPECT_GT(slot.size(), before);  // the room was served, at 3 s
  Expect(wire.worker.get(), control::Kind::kRun);
  EXPECT_EQ(Expect(wire.worker.get(), control::Kind::kRoom).room.slot_bytes, slot.size());
}

}  // namespace
}  // namespace hearth
