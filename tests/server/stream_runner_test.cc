// The server's side of a decoupled model's worker (server/stream_runner.h)
// against a fake worker on the other end of a socketpair, speaking the
// worker protocol with its own encoders and writing responses' outputs into
// the ring through the slot's mapping, as a worker does through its own.
// Plain code, no threads: what the fake worker says is queued on the socket
// before the runner reads it, and time is only ever a value a test passes.
#include "server/stream_runner.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/bytes_tensor.h"
#include "gtest/gtest.h"
#include "hearth/unique_fd.h"
#include "server/job_queue.h"

namespace hearth {
namespace {

using control::Kind;
using control::SlotTensor;

constexpr uint64_t kSlotLimit = 64u << 20;

// The two ends of a worker's control socket.
struct Wire {
  UniqueFd server, worker;
};

Wire Connect() {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

RequestSlot MakeSlot(uint64_t bytes = 64u << 10) {
  Result<RequestSlot> slot = RequestSlot::Create("hearth-stream-test");
  EXPECT_TRUE(slot.ok()) << slot.status().ToString();
  EXPECT_TRUE(slot->Reserve(bytes, kSlotLimit).ok());
  return std::move(*slot);
}

// A generator: a prompt and a token budget in; text (BYTES, any number of
// elements) and the token ids it stands for out.
const std::vector<TensorSpec> kInputs = {{"prompt", DType::kBytes, {1}},
                                         {"max_tokens", DType::kI32, {1}}};
const std::vector<TensorSpec> kOutputs = {{"text", DType::kBytes, {-1}},
                                          {"token_ids", DType::kI64, {-1}}};
constexpr size_t kText = 0, kTokenIds = 1;

StreamModel Generator(bool resumable) {
  StreamModel m;
  m.name = "gen";
  m.version = "1";
  m.inputs = kInputs;
  m.outputs = kOutputs;
  m.token_ids = resumable ? static_cast<int>(kTokenIds) : -1;
  m.counted_tokens = static_cast<int>(kTokenIds);
  return m;
}

// The next message on the fake worker's end, which the runner has sent.
control::Message Expect(int fd, Kind kind) {
  Result<control::Message> m = control::ReceiveKind(fd, 0, {kind});
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(*m) : control::Message{};
}

// Nothing (more) was sent to the worker.
bool Quiet(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

std::vector<std::byte> Elements(const std::vector<std::string>& elements) {
  std::vector<std::byte> out;
  for (const std::string& e : elements) EXPECT_TRUE(AppendBytesElement(out, e, "test").ok());
  return out;
}

std::vector<std::string> ElementsOf(std::span<const std::byte> data) {
  std::vector<std::string> out;
  for (std::string_view e : BytesElements(data)) out.emplace_back(e);
  return out;
}

template <typename T>
std::vector<std::byte> Raw(const std::vector<T>& values) {
  std::vector<std::byte> out(values.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

std::vector<int64_t> Int64s(std::span<const std::byte> data) {
  std::vector<int64_t> out(data.size() / sizeof(int64_t));
  if (!out.empty()) std::memcpy(out.data(), data.data(), out.size() * sizeof(int64_t));
  return out;
}

const InferTensor* Output(const InferResponse& r, const std::string& name) {
  for (const InferTensor& t : r.outputs)
    if (t.name == name) return &t;
  return nullptr;
}

// What a job's client was given.
struct Client {
  bool go_on = true;                     // what on_response returns
  std::vector<InferResponse> responses;  // copies of what on_response was handed
  std::optional<Result<InferResponse>> result;
  int answers = 0;  // calls of done
  StatusCode code() const {
    return result && !result->ok() ? result->status().code() : StatusCode::kOk;
  }
  std::string message() const { return result && !result->ok() ? result->status().message() : ""; }
};

// A job for the generator whose answers go to `client`; streamed (through
// on_response) or answered once.
std::shared_ptr<Job> NewJob(const std::shared_ptr<Client>& client, const std::string& id,
                            const std::string& prompt, bool streaming) {
  auto job = std::make_shared<Job>();
  job->request.model = "gen";
  job->request.id = id;
  // Not in the model's order: the runner places them by name.
  job->request.inputs.emplace_back("max_tokens", DType::kI32, std::vector<int64_t>{1},
                                   Raw(std::vector<int32_t>{16}));
  job->request.inputs.emplace_back("prompt", DType::kBytes, std::vector<int64_t>{1},
                                   Elements({prompt}));
  job->done = [client](Result<InferResponse> r) {
    ++client->answers;
    client->result = std::move(r);
  };
  if (streaming)
    job->request.on_response = [client](const InferResponse& r) {
      client->responses.push_back(r);
      return client->go_on;
    };
  return job;
}

// The fake worker's side of the ring: each response's outputs one after the
// other from where the last ended (the tests write far less than it holds).
class FakeWorker {
 public:
  FakeWorker(int fd, RequestSlot& slot) : fd_(fd), slot_(slot) {}

  void TakeRing() { SetRing(Expect(fd_, Kind::kRing).ring); }
  void SetRing(const control::Ring& ring) {
    ring_ = ring;
    written_ = 0;
  }
  const control::Ring& ring() const { return ring_; }
  uint64_t written() const { return written_; }

  // Writes `bytes` in the ring; where they lie, with `shape`.
  SlotTensor Put(std::span<const std::byte> bytes, std::vector<int64_t> shape) {
    written_ = (written_ + 63) / 64 * 64;
    EXPECT_LE(written_ + bytes.size(), ring_.bytes);
    SlotTensor t{ring_.offset + written_, bytes.size(), std::move(shape)};
    if (!bytes.empty()) std::memcpy(slot_.data() + t.offset, bytes.data(), bytes.size());
    written_ += bytes.size();
    return t;
  }

  // A response to `id` with the text elements and token ids given (each
  // absent when nullopt), its outputs written in the ring; not sent.
  control::Response Make(uint64_t id, bool final, std::optional<std::vector<std::string>> text,
                         std::optional<std::vector<int64_t>> tokens = std::nullopt) {
    control::Response r;
    r.id = id;
    r.final = final;
    r.outputs.assign(kOutputs.size(), SlotTensor{});
    r.present.assign(kOutputs.size(), 0);
    if (text) {
      r.outputs[kText] = Put(Elements(*text), {static_cast<int64_t>(text->size())});
      r.present[kText] = 1;
    }
    if (tokens) {
      r.outputs[kTokenIds] = Put(Raw(*tokens), {static_cast<int64_t>(tokens->size())});
      r.present[kTokenIds] = 1;
    }
    return r;
  }
  void Send(const control::Response& r) { ASSERT_TRUE(control::SendResponse(fd_, r).ok()); }
  void Respond(uint64_t id, bool final, std::optional<std::vector<std::string>> text,
               std::optional<std::vector<int64_t>> tokens = std::nullopt) {
    Send(Make(id, final, std::move(text), std::move(tokens)));
  }

 private:
  int fd_;
  RequestSlot& slot_;
  control::Ring ring_;
  uint64_t written_ = 0;
};

// ---------------------------------------------------------------- SlotSpace

TEST(SlotSpace, TakesTheFirstRunLongEnoughIn64ByteSteps) {
  SlotSpace space(1024);
  EXPECT_EQ(space.Take(1), 0u);
  EXPECT_EQ(space.Take(100), 64u);  // 128 bytes
  EXPECT_EQ(space.Take(64), 192u);
  EXPECT_EQ(space.taken_bytes(), 256u);
  ASSERT_TRUE(space.Give(64));
  EXPECT_EQ(space.taken_bytes(), 128u);
  EXPECT_EQ(space.Take(10), 64u);    // the first run that fits: the hole
  EXPECT_EQ(space.Take(100), 256u);  // 128: the 64 bytes left of the hole are too few
  EXPECT_EQ(space.Take(0), 128u);    // nothing takes 64 bytes all the same: they fit there
  EXPECT_EQ(space.size(), 1024u);
}

TEST(SlotSpace, GivingBackJoinsTheFreeRunsOnBothSides) {
  SlotSpace space(256);
  for (uint64_t at : {0u, 64u, 128u, 192u}) EXPECT_EQ(space.Take(64), at);
  ASSERT_TRUE(space.Give(0));
  ASSERT_TRUE(space.Give(128));
  EXPECT_FALSE(space.Take(128).has_value());  // two runs of 64, apart
  ASSERT_TRUE(space.Give(64));                // joins them: [0, 192)
  EXPECT_EQ(space.Take(192), 0u);
  EXPECT_EQ(space.taken_bytes(), 256u);
}

TEST(SlotSpace, GrowingExtendsTheLastFreeRun) {
  SlotSpace space(256);
  EXPECT_EQ(space.Take(192), 0u);
  space.Grow(512);  // [192, 256) and the new bytes are one run
  EXPECT_EQ(space.size(), 512u);
  EXPECT_EQ(space.Take(320), 192u);

  SlotSpace full(128);
  EXPECT_EQ(full.Take(128), 0u);
  full.Grow(300);  // rounded down to 64 bytes
  EXPECT_EQ(full.size(), 256u);
  full.Grow(64);  // never smaller
  EXPECT_EQ(full.size(), 256u);
  EXPECT_EQ(full.Take(128), 128u);

  SlotSpace holed(256);
  EXPECT_EQ(holed.Take(64), 0u);
  EXPECT_EQ(holed.Take(64), 64u);
  ASSERT_TRUE(holed.Give(0));  // a free run that is not the last
  holed.Grow(512);
  EXPECT_EQ(holed.Take(384), 128u);
  EXPECT_EQ(holed.Take(64), 0u);
}

TEST(SlotSpace, TakeFailsWhenFullAndGiveOnlyKnowsWhatTakeReturned) {
  SlotSpace space(128);
  EXPECT_EQ(space.Take(128), 0u);
  EXPECT_FALSE(space.Take(1).has_value());
  EXPECT_FALSE(space.Give(64));   // inside a region, not its start
  EXPECT_FALSE(space.Give(128));  // past it
  EXPECT_TRUE(space.Give(0));
  EXPECT_FALSE(space.Give(0));  // given back already
  EXPECT_EQ(space.taken_bytes(), 0u);
  EXPECT_FALSE(SlotSpace().Take(1).has_value());
  EXPECT_FALSE(SlotSpace(1024).Take(1025).has_value());
}

// ------------------------------------------------------------- StreamRunner

class StreamRunnerTest : public ::testing::Test {
 protected:
  // A runner for model_ (capacity streams, the slot at most `limit`) whose
  // worker took the ring it was sent.
  void Start(uint64_t limit = kSlotLimit, uint32_t capacity = 8) {
    runner_.emplace(model_, wire_.server.get(), slot_, capacity, limit, stats_, queue_);
    ASSERT_TRUE(runner_->Begin()) << runner_->why();
    worker_.TakeRing();
  }
  // Opens `job` on the worker: the open message it got.
  control::Open Open(const std::shared_ptr<Job>& job) {
    EXPECT_TRUE(runner_->Open(job)) << runner_->why();
    control::Open open = Expect(worker(), Kind::kOpen).open;
    if (open.inputs.size() != kInputs.size()) {
      ADD_FAILURE() << "an open message with " << open.inputs.size() << " inputs";
      open.inputs.resize(kInputs.size());  // what the test goes on to look at
    }
    return open;
  }
  // Pump(0), which must succeed: the responses it credited (0: none).
  uint32_t Pump() {
    EXPECT_TRUE(runner_->Pump(0)) << runner_->why();
    Result<control::Message> m = control::Receive(worker(), 0);
    if (!m.ok()) return 0;
    EXPECT_EQ(m->kind, Kind::kCredit);
    return m->kind == Kind::kCredit ? m->credit.responses : 0;
  }
  int worker() const { return wire_.worker.get(); }

  Wire wire_ = Connect();
  RequestSlot slot_ = MakeSlot();
  ModelStats stats_;
  JobQueue queue_{16};
  StreamModel model_ = Generator(true);
  std::optional<StreamRunner> runner_;
  FakeWorker worker_{wire_.worker.get(), slot_};
};

TEST_F(StreamRunnerTest, BeginSendsARingInsideTheSlot) {
  const uint64_t before = slot_.size();
  Start();
  const control::Ring& ring = worker_.ring();
  EXPECT_EQ(ring, runner_->ring());
  EXPECT_EQ(ring.bytes, kInitialRingBytes);
  EXPECT_EQ(ring.offset % 64, 0u);
  EXPECT_GT(slot_.size(), before);  // grown for it
  EXPECT_EQ(ring.slot_bytes, slot_.size());
  EXPECT_LE(ring.offset + ring.bytes, slot_.size());
  EXPECT_TRUE(Quiet(worker()));
}

TEST_F(StreamRunnerTest, BeginTakesAHotSparesRingAtTheSlotsStartAndNoOtherWhere) {
  ASSERT_TRUE(slot_.Reserve(2 * kInitialRingBytes, kSlotLimit).ok());
  runner_.emplace(model_, wire_.server.get(), slot_, 8, kSlotLimit, stats_, queue_);
  const control::Ring given{0, kInitialRingBytes, slot_.size()};
  ASSERT_TRUE(runner_->Begin(given)) << runner_->why();
  EXPECT_EQ(runner_->ring(), given);
  EXPECT_TRUE(Quiet(worker()));  // the spare has it already
  // Requests go after it, and responses are read from it.
  auto client = std::make_shared<Client>();
  const control::Open open = Open(NewJob(client, "r1", "hi", true));
  EXPECT_GE(open.inputs[0].offset, given.bytes);
  worker_.SetRing(given);
  worker_.Respond(open.id, false, {{"a"}});
  EXPECT_EQ(Pump(), 1u);
  ASSERT_EQ(client->responses.size(), 1u);

  Wire other = Connect();
  RequestSlot slot = MakeSlot(2 * kInitialRingBytes);
  StreamRunner elsewhere(model_, other.server.get(), slot, 8, kSlotLimit, stats_, queue_);
  EXPECT_FALSE(elsewhere.Begin(control::Ring{64, kInitialRingBytes, slot.size()}));
  EXPECT_NE(elsewhere.why().find("hot spare"), std::string::npos) << elsewhere.why();
  EXPECT_FALSE(elsewhere.malformed());
  EXPECT_TRUE(Quiet(other.worker.get()));
  // Nor one larger than the slot.
  StreamRunner too_large(model_, other.server.get(), slot, 8, kSlotLimit, stats_, queue_);
  EXPECT_FALSE(too_large.Begin(control::Ring{0, 2 * slot.size(), slot.size()}));
}

TEST_F(StreamRunnerTest, OpenPlacesEachJobsInputsInARegionOfItsOwn) {
  Start();
  auto client = std::make_shared<Client>();
  auto a = NewJob(client, "first", "Once upon a time", true);
  a->request.parameters_json = R"({"temperature": 0})";
  auto b = NewJob(client, "second", std::string(300, 'x'), false);
  const control::Open oa = Open(a);
  const control::Open ob = Open(b);
  EXPECT_NE(oa.id, ob.id);
  EXPECT_EQ(oa.request_id, "first");
  EXPECT_EQ(ob.request_id, "second");
  EXPECT_EQ(oa.parameters_json, R"({"temperature": 0})");
  EXPECT_EQ(ob.parameters_json, "");
  EXPECT_EQ(runner_->in_flight(), 2u);
  EXPECT_EQ(stats_.streams_opened.load(), 2u);

  const auto region = [&](const control::Open& open, const Job& job) {
    EXPECT_EQ(open.slot_bytes, slot_.size());
    // Not resumed: an empty resume tensor.
    EXPECT_EQ(open.resume, (SlotTensor{0, 0, {0}}));
    EXPECT_EQ(open.inputs.size(), kInputs.size());
    uint64_t lo = UINT64_MAX, hi = 0;
    for (size_t i = 0; i < open.inputs.size() && i < kInputs.size(); ++i) {
      const SlotTensor& t = open.inputs[i];
      const InferTensor& in = job.request.inputs[1 - i];  // the job holds them the other way round
      EXPECT_EQ(in.name, kInputs[i].name);
      EXPECT_EQ(t.offset % 64, 0u);
      EXPECT_EQ(t.shape, in.shape);
      EXPECT_EQ(t.bytes, in.data.size());
      EXPECT_LE(t.offset + t.bytes, slot_.size());
      EXPECT_EQ(std::memcmp(slot_.data() + t.offset, in.data.data(), t.bytes), 0) << in.name;
      lo = std::min(lo, t.offset);
      hi = std::max(hi, t.offset + t.bytes);
    }
    // Clear of the ring.
    const control::Ring& ring = worker_.ring();
    EXPECT_TRUE(hi <= ring.offset || lo >= ring.offset + ring.bytes);
    return std::pair(lo, hi);
  };
  const auto [a_lo, a_hi] = region(oa, *a);
  const auto [b_lo, b_hi] = region(ob, *b);
  EXPECT_TRUE(a_hi <= b_lo || b_hi <= a_lo)
      << "[" << a_lo << ", " << a_hi << ") and [" << b_lo << ", " << b_hi << ")";
}

TEST_F(StreamRunnerTest, AResumedStreamIsOpenedWithTheTokenIdsItsClientHas) {
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "again", "hello", true);
  job->stream = std::make_shared<StreamProgress>();
  job->stream->token_ids = {101, -2, 103};
  job->stream->responses = 2;
  const control::Open open = Open(job);
  ASSERT_EQ(open.resume.shape, (std::vector<int64_t>{3}));
  ASSERT_EQ(open.resume.bytes, 3 * sizeof(int64_t));
  EXPECT_EQ(open.resume.offset % 64, 0u);
  ASSERT_LE(open.resume.offset + open.resume.bytes, slot_.size());
  EXPECT_EQ(Int64s({slot_.data() + open.resume.offset, open.resume.bytes}),
            (std::vector<int64_t>{101, -2, 103}));
  for (const SlotTensor& in : open.inputs)  // apart from its inputs
    EXPECT_TRUE(in.offset + in.bytes <= open.resume.offset ||
                open.resume.offset + open.resume.bytes <= in.offset);
  EXPECT_EQ(stats_.streams_resumed.load(), 1u);
}

TEST_F(StreamRunnerTest, TheSlotGrowsForInputsThatDoNotFit) {
  Start();
  const uint64_t before = slot_.size();
  auto client = std::make_shared<Client>();
  const std::string prompt(before, 'p');
  auto job = NewJob(client, "long", prompt, true);
  const control::Open open = Open(job);
  EXPECT_GT(slot_.size(), before);
  EXPECT_EQ(open.slot_bytes, slot_.size());
  const SlotTensor& t = open.inputs[0];
  ASSERT_LE(t.offset + t.bytes, slot_.size());
  EXPECT_EQ(ElementsOf({slot_.data() + t.offset, t.bytes}), std::vector<std::string>{prompt});
  EXPECT_EQ(client->answers, 0);
}

TEST_F(StreamRunnerTest, AJobAtFaultIsAnsweredAndNothingSent) {
  Start(4u << 20);
  auto client = std::make_shared<Client>();
  auto params = NewJob(client, "params", "hi", true);
  params->request.parameters_json =
      "{\"p\": \"" + std::string(control::kMaxParametersBytes, 'x') + "\"}";
  EXPECT_TRUE(runner_->Open(params));
  EXPECT_EQ(client->answers, 1);
  EXPECT_EQ(client->code(), StatusCode::kInvalidArgument);
  EXPECT_NE(client->message().find("over the limit"), std::string::npos) << client->message();
  EXPECT_TRUE(Quiet(worker()));
  EXPECT_EQ(runner_->in_flight(), 0u);

  auto large = std::make_shared<Client>();
  EXPECT_TRUE(runner_->Open(NewJob(large, "large", std::string(5u << 20, 'x'), true)));
  EXPECT_EQ(large->code(), StatusCode::kResourceExhausted) << large->message();
  EXPECT_TRUE(Quiet(worker()));
  EXPECT_EQ(runner_->in_flight(), 0u);

  // The places they took are free again: the next job's inputs go where
  // the first would have.
  const control::Open open = Open(NewJob(std::make_shared<Client>(), "fine", "hi", true));
  EXPECT_EQ(worker_.ring().offset, 0u);
  EXPECT_EQ(open.inputs[0].offset, worker_.ring().bytes);
}

// Each response before the last is handed to on_response, as a copy of the
// ring's bytes; the last comes through done. One credit per Pump.
TEST_F(StreamRunnerTest, AStreamsResponsesReachItsClientAsCopiesThenTheLastThroughDone) {
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "Say hello", true);
  const control::Open open = Open(job);
  worker_.Respond(open.id, false, {{"Hel"}}, {{1, 2}});
  worker_.Respond(open.id, false, {{"lo"}}, {{3}});
  EXPECT_EQ(Pump(), 2u);
  EXPECT_TRUE(Quiet(worker()));
  // The worker writes the ring again once its responses are taken.
  std::memset(slot_.data() + worker_.ring().offset, 0xee, worker_.written());
  ASSERT_EQ(client->responses.size(), 2u);
  EXPECT_EQ(client->answers, 0);
  const std::vector<std::vector<std::string>> texts = {{"Hel"}, {"lo"}};
  const std::vector<std::vector<int64_t>> tokens = {{1, 2}, {3}};
  for (size_t i = 0; i < 2; ++i) {
    const InferResponse& r = client->responses[i];
    EXPECT_EQ(r.model, "gen");
    EXPECT_EQ(r.version, "1");
    EXPECT_EQ(r.id, "r1");
    const InferTensor* text = Output(r, "text");
    const InferTensor* ids = Output(r, "token_ids");
    ASSERT_TRUE(text != nullptr && ids != nullptr);
    EXPECT_FALSE(text->data.is_view());
    EXPECT_EQ(text->dtype, DType::kBytes);
    EXPECT_EQ(text->shape, (std::vector<int64_t>{1}));
    EXPECT_EQ(ElementsOf(text->data.bytes()), texts[i]);
    EXPECT_EQ(ids->dtype, DType::kI64);
    EXPECT_EQ(Int64s(ids->data.bytes()), tokens[i]);
  }
  EXPECT_EQ(job->stream->token_ids, (std::vector<int64_t>{1, 2, 3}));

  worker_.Respond(open.id, true, {{"!"}}, {{4}});
  EXPECT_EQ(Pump(), 1u);
  EXPECT_EQ(client->responses.size(), 2u);
  ASSERT_EQ(client->answers, 1);
  ASSERT_TRUE(client->result->ok()) << client->result->status().ToString();
  std::memset(slot_.data() + worker_.ring().offset, 0xee, worker_.written());
  const InferTensor* text = Output(**client->result, "text");
  ASSERT_NE(text, nullptr);
  EXPECT_EQ(ElementsOf(text->data.bytes()), std::vector<std::string>{"!"});
  EXPECT_EQ(Int64s(Output(**client->result, "token_ids")->data.bytes()), std::vector<int64_t>{4});
  EXPECT_EQ(job->stream->token_ids, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(job->stream->responses, 3u);
  EXPECT_EQ(runner_->in_flight(), 0u);
  EXPECT_EQ(runner_->responses(), 3u);
  EXPECT_EQ(stats_.stream_responses.load(), 3u);
  EXPECT_EQ(stats_.stream_tokens.load(), 4u);
  EXPECT_EQ(stats_.requests.load(), 1u);
  EXPECT_TRUE(Quiet(worker()));
}

TEST_F(StreamRunnerTest, ARequestNotStreamedIsAnsweredOnceWithItsTextJoined) {
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "Say hello", false);
  const control::Open open = Open(job);
  worker_.Respond(open.id, false, {{"Hel", "a"}}, {{1, 2}});
  worker_.Respond(open.id, false, {{"lo", "b"}}, {{3}});
  worker_.Respond(open.id, true, {{"!", "c"}});
  EXPECT_EQ(Pump(), 3u);
  EXPECT_TRUE(Quiet(worker()));
  ASSERT_EQ(client->answers, 1);
  ASSERT_TRUE(client->result->ok()) << client->result->status().ToString();
  const InferTensor* text = Output(**client->result, "text");
  ASSERT_NE(text, nullptr);
  EXPECT_EQ(text->shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(ElementsOf(text->data.bytes()), (std::vector<std::string>{"Hello!", "abc"}));
  // A vector of any length (token ids): its pieces one after the other.
  const InferTensor* ids = Output(**client->result, "token_ids");
  ASSERT_NE(ids, nullptr);
  EXPECT_EQ(ids->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(Int64s(ids->data.bytes()), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(job->stream->token_ids, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(runner_->in_flight(), 0u);

  // Only the outputs it asked for.
  auto asked = std::make_shared<Client>();
  auto only_text = NewJob(asked, "r2", "hi", false);
  only_text->request.outputs = {RequestedOutput("text", true)};
  const control::Open second = Open(only_text);
  worker_.Respond(second.id, true, {{"x"}}, {{9}});
  EXPECT_EQ(Pump(), 1u);
  ASSERT_TRUE(asked->result.has_value() && asked->result->ok());
  ASSERT_EQ((*asked->result)->outputs.size(), 1u);
  EXPECT_EQ((*asked->result)->outputs[0].name, "text");
}

// Kept (for a resume) only for a model that resumes; counted for any.
TEST_F(StreamRunnerTest, TokenIdsAreKeptOnlyForAModelThatResumes) {
  model_ = Generator(false);
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "hi", true);
  const control::Open open = Open(job);
  worker_.Respond(open.id, false, {{"a"}}, {{1, 2}});
  EXPECT_EQ(Pump(), 1u);
  ASSERT_EQ(client->responses.size(), 1u);
  EXPECT_EQ(Int64s(Output(client->responses[0], "token_ids")->data.bytes()),
            (std::vector<int64_t>{1, 2}));
  EXPECT_TRUE(job->stream->token_ids.empty());
  EXPECT_EQ(job->stream->responses, 1u);
  EXPECT_EQ(stats_.stream_tokens.load(), 2u);
}

TEST_F(StreamRunnerTest, AnErrorResponseIsTheJobsAnswer) {
  Start();
  auto client = std::make_shared<Client>();
  const control::Open open = Open(NewJob(client, "r1", "hi", true));
  worker_.Respond(open.id, false, {{"a"}});
  control::Response error = worker_.Make(open.id, true, std::nullopt);
  error.status_code = static_cast<uint32_t>(StatusCode::kInvalidArgument);
  error.text = "the prompt is too long";
  worker_.Send(error);
  EXPECT_EQ(Pump(), 2u);
  EXPECT_EQ(client->responses.size(), 1u);
  ASSERT_EQ(client->answers, 1);
  EXPECT_EQ(client->code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client->message(), "the prompt is too long");
  EXPECT_EQ(runner_->in_flight(), 0u);
  // The job's done counts it (the server's Counted wraps every request's):
  // the runner counting it too made one refusal two failures.
  EXPECT_EQ(stats_.failure.load(), 0u);
}

// A non-streamed request whose BYTES output changes its shape cannot be
// joined: it is answered with why, and its stream ends with the worker's
// final response (a cancel when that is still to come).
TEST_F(StreamRunnerTest, PiecesThatCannotBeJoinedAnswerTheJobAndEndItsStream) {
  Start();
  auto early = std::make_shared<Client>();
  const control::Open first = Open(NewJob(early, "early", "hi", false));
  worker_.Respond(first.id, false, {{"a"}});
  worker_.Respond(first.id, false, {{"b", "c"}});
  EXPECT_EQ(Pump(), 2u);
  ASSERT_EQ(early->answers, 1);
  EXPECT_EQ(early->code(), StatusCode::kInvalidArgument);
  EXPECT_NE(early->message().find("changed its shape"), std::string::npos) << early->message();
  const control::Message cancel = Expect(worker(), Kind::kCancel);
  EXPECT_EQ(cancel.cancel.ids, std::vector<uint64_t>{first.id});
  worker_.Respond(first.id, true, std::nullopt);
  EXPECT_EQ(Pump(), 1u);
  EXPECT_EQ(runner_->in_flight(), 0u);

  auto last = std::make_shared<Client>();
  const control::Open second = Open(NewJob(last, "last", "hi", false));
  worker_.Respond(second.id, false, {{"a"}});
  worker_.Respond(second.id, true, {{"b", "c"}});
  EXPECT_EQ(Pump(), 2u);
  ASSERT_EQ(last->answers, 1);
  EXPECT_EQ(last->code(), StatusCode::kInvalidArgument);
  // Its final response came: it is over, and nothing is cancelled.
  EXPECT_EQ(runner_->in_flight(), 0u);
  EXPECT_TRUE(Quiet(worker()));
  const control::Open third = Open(NewJob(last, "third", "hi", false));
  EXPECT_EQ(third.inputs[0].offset, second.inputs[0].offset);
}

// What a worker may not send: Pump fails, the runner's worker is to be
// killed, and the job the response was for is answered Internal.
TEST_F(StreamRunnerTest, AMalformedResponseIsCaughtAndItsJobAnswered) {
  struct Case {
    const char* name;
    // Corrupts a well-formed response; the job's inputs are at `input`.
    std::function<void(control::Response&, const SlotTensor& input, RequestSlot& slot)> corrupt;
  };
  const std::vector<Case> cases = {
      {"outside the ring, in the job's inputs", [](control::Response& r, const SlotTensor& input,
                                                   RequestSlot&) { r.outputs[kText] = input; }},
      {"past the slot",
       [](control::Response& r, const SlotTensor&, RequestSlot& slot) {
         r.outputs[kTokenIds] = SlotTensor{slot.size() - 8, 16, {2}};
       }},
      {"a shape of the wrong rank",
       [](control::Response& r, const SlotTensor&, RequestSlot&) {
         r.outputs[kTokenIds].shape = {1, 2};
       }},
      {"bytes its shape does not need", [](control::Response& r, const SlotTensor&,
                                           RequestSlot&) { r.outputs[kTokenIds].shape = {3}; }},
      {"an element longer than its bytes",
       [](control::Response& r, const SlotTensor&, RequestSlot& slot) {
         const uint32_t len = 1000;
         std::memcpy(slot.data() + r.outputs[kText].offset, &len, sizeof len);
       }},
      {"too few outputs",
       [](control::Response& r, const SlotTensor&, RequestSlot&) {
         r.outputs.pop_back();
         r.present.pop_back();
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Wire wire = Connect();
    RequestSlot slot = MakeSlot();
    ModelStats stats;
    StreamRunner runner(model_, wire.server.get(), slot, 8, kSlotLimit, stats, queue_);
    ASSERT_TRUE(runner.Begin());
    FakeWorker worker(wire.worker.get(), slot);
    worker.TakeRing();
    auto client = std::make_shared<Client>();
    ASSERT_TRUE(runner.Open(NewJob(client, "r1", "hi", true)));
    const control::Open open = Expect(wire.worker.get(), Kind::kOpen).open;
    ASSERT_EQ(open.inputs.size(), kInputs.size());
    control::Response r = worker.Make(open.id, false, {{"ab"}}, {{1, 2}});
    c.corrupt(r, open.inputs[0], slot);
    worker.Send(r);
    EXPECT_FALSE(runner.Pump(0));
    EXPECT_TRUE(runner.malformed());
    EXPECT_FALSE(runner.why().empty());
    EXPECT_TRUE(client->responses.empty());
    ASSERT_EQ(client->answers, 1);
    EXPECT_EQ(client->code(), StatusCode::kInternal);
    EXPECT_NE(client->message().find("malformed"), std::string::npos) << client->message();
    EXPECT_EQ(runner.in_flight(), 0u);
  }
}

TEST_F(StreamRunnerTest, AResponseForNoOpenRequestOrAStrayMessageIsMalformed) {
  Start();
  auto client = std::make_shared<Client>();
  const control::Open open = Open(NewJob(client, "r1", "hi", true));
  worker_.Respond(open.id + 1, false, {{"a"}});
  EXPECT_FALSE(runner_->Pump(0));
  EXPECT_TRUE(runner_->malformed());
  EXPECT_NE(runner_->why().find("not open"), std::string::npos) << runner_->why();
  // The open request is its supervisor's to give on (Abandon).
  EXPECT_EQ(client->answers, 0);
  EXPECT_EQ(runner_->in_flight(), 1u);

  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  StreamRunner runner(model_, wire.server.get(), slot, 8, kSlotLimit, stats_, queue_);
  ASSERT_TRUE(runner.Begin());
  ASSERT_TRUE(control::SendReady(wire.worker.get(), control::Ready{}).ok());
  EXPECT_FALSE(runner.Pump(0));
  EXPECT_TRUE(runner.malformed());
}

// The client goes away (on_response says so): one cancel, the job answered
// at once, and what the worker sends for it after is not read; its final
// response gives its inputs' place back.
TEST_F(StreamRunnerTest, AClientThatGoesAwayCancelsItsStream) {
  Start();
  auto gone = std::make_shared<Client>();
  gone->go_on = false;
  const control::Open a = Open(NewJob(gone, "a", "hi", true));
  worker_.Respond(a.id, false, {{"x"}});
  EXPECT_EQ(Pump(), 1u);
  const control::Message cancel = Expect(worker(), Kind::kCancel);
  EXPECT_EQ(cancel.cancel.ids, std::vector<uint64_t>{a.id});
  EXPECT_TRUE(Quiet(worker()));
  EXPECT_EQ(gone->responses.size(), 1u);
  ASSERT_EQ(gone->answers, 1);
  EXPECT_EQ(gone->code(), StatusCode::kUnavailable);
  EXPECT_EQ(runner_->in_flight(), 1u);  // until the worker ends it

  // Sent before the worker read the cancel: taken, credited, not read, not
  // even checked.
  control::Response late = worker_.Make(a.id, false, {{"y"}});
  late.outputs[kText].offset = slot_.size();
  worker_.Send(late);
  EXPECT_EQ(Pump(), 1u);
  EXPECT_FALSE(runner_->malformed());
  EXPECT_EQ(gone->responses.size(), 1u);
  EXPECT_EQ(gone->answers, 1);
  EXPECT_TRUE(Quiet(worker()));  // cancelled once

  // Its inputs' place is still its own...
  const control::Open b = Open(NewJob(std::make_shared<Client>(), "b", "hi", true));
  EXPECT_NE(b.inputs[0].offset, a.inputs[0].offset);
  // ...until its final response.
  worker_.Respond(a.id, true, std::nullopt);
  EXPECT_EQ(Pump(), 1u);
  EXPECT_EQ(gone->answers, 1);
  EXPECT_EQ(runner_->in_flight(), 1u);
  const control::Open c = Open(NewJob(std::make_shared<Client>(), "c", "hi", true));
  EXPECT_EQ(c.inputs[0].offset, a.inputs[0].offset);
  // A response for it now is for a request that is not open.
  worker_.Respond(a.id, false, {{"z"}});
  EXPECT_FALSE(runner_->Pump(0));
  EXPECT_TRUE(runner_->malformed());
}

TEST_F(StreamRunnerTest, CancelledOrPastItsDeadlineStreamsAreCancelledInOneMessage) {
  Start();
  const auto now = Clock::now();
  auto left = std::make_shared<Client>();
  auto left_job = NewJob(left, "left", "hi", true);
  left_job->request.cancelled = std::make_shared<std::atomic<bool>>(false);
  auto late = std::make_shared<Client>();
  auto late_job = NewJob(late, "late", "hi", true);
  late_job->deadline = now + std::chrono::hours(1);
  auto fine = std::make_shared<Client>();
  auto fine_job = NewJob(fine, "fine", "hi", true);
  fine_job->deadline = now + std::chrono::hours(3);
  const control::Open l = Open(left_job);
  const control::Open d = Open(late_job);
  const control::Open f = Open(fine_job);
  EXPECT_EQ(runner_->NextDeadline(), late_job->deadline);

  // Nothing is over yet.
  EXPECT_TRUE(runner_->CancelOver(now));
  EXPECT_TRUE(Quiet(worker()));

  worker_.Respond(d.id, false, {{"a"}});
  EXPECT_EQ(Pump(), 1u);
  left_job->request.cancelled->store(true);
  EXPECT_TRUE(runner_->CancelOver(now + std::chrono::hours(2)));
  const control::Message cancel = Expect(worker(), Kind::kCancel);
  EXPECT_EQ(cancel.cancel.ids, (std::vector<uint64_t>{l.id, d.id}));
  EXPECT_TRUE(Quiet(worker()));
  EXPECT_EQ(left->code(), StatusCode::kUnavailable);
  EXPECT_EQ(late->code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(late->message().find("after 1 responses"), std::string::npos) << late->message();
  EXPECT_EQ(fine->answers, 0);
  EXPECT_EQ(runner_->NextDeadline(), fine_job->deadline);

  // Once only.
  EXPECT_TRUE(runner_->CancelOver(now + std::chrono::hours(2)));
  EXPECT_TRUE(Quiet(worker()));
  EXPECT_EQ(left->answers, 1);
  EXPECT_EQ(late->answers, 1);

  // Their responses until their final ones are taken and not read.
  worker_.Respond(l.id, false, {{"b"}});
  worker_.Respond(d.id, true, {{"c"}});
  worker_.Respond(l.id, true, std::nullopt);
  EXPECT_EQ(Pump(), 3u);
  EXPECT_TRUE(left->responses.empty());
  EXPECT_EQ(late->responses.size(), 1u);
  EXPECT_EQ(left->answers, 1);
  EXPECT_EQ(late->answers, 1);
  EXPECT_EQ(runner_->in_flight(), 1u);
  EXPECT_EQ(fine->answers, 0);
  EXPECT_NE(f.id, l.id);
}

TEST_F(StreamRunnerTest, AWorkerThatAsksForALargerRingGetsOneInsideTheSlot) {
  Start();
  const control::Ring old = worker_.ring();
  ASSERT_TRUE(control::SendRingGrow(worker(), control::RingGrow{3 * kInitialRingBytes + 1}).ok());
  EXPECT_TRUE(runner_->Pump(0)) << runner_->why();
  worker_.TakeRing();
  const control::Ring ring = worker_.ring();
  EXPECT_EQ(ring, runner_->ring());
  EXPECT_GE(ring.bytes, 3 * kInitialRingBytes + 1);
  EXPECT_EQ(ring.offset % 64, 0u);
  EXPECT_EQ(ring.bytes % 64, 0u);
  EXPECT_EQ(ring.slot_bytes, slot_.size());
  EXPECT_LE(ring.offset + ring.bytes, slot_.size());
  EXPECT_TRUE(Quiet(worker()));

  // The old ring's bytes hold requests now; responses come in the new one.
  auto client = std::make_shared<Client>();
  const control::Open open = Open(NewJob(client, "r1", "hi", true));
  EXPECT_EQ(open.inputs[0].offset, old.offset);
  worker_.Respond(open.id, false, {{"big"}});
  EXPECT_EQ(Pump(), 1u);
  ASSERT_EQ(client->responses.size(), 1u);
  EXPECT_EQ(ElementsOf(Output(client->responses[0], "text")->data.bytes()),
            std::vector<std::string>{"big"});
}

TEST_F(StreamRunnerTest, TheEnginesStatisticsAreKeptAndItsPreemptionsCounted) {
  Start();
  ASSERT_TRUE(control::SendEngineStats(worker(), {10, 64, 2}).ok());
  EXPECT_TRUE(runner_->Pump(0)) << runner_->why();
  EXPECT_EQ(runner_->engine_stats(), (control::EngineStats{10, 64, 2}));
  EXPECT_EQ(stats_.preemptions.load(), 2u);
  ASSERT_TRUE(control::SendEngineStats(worker(), {3, 64, 5}).ok());
  // A count that goes down is not taken as preemptions.
  ASSERT_TRUE(control::SendEngineStats(worker(), {3, 64, 1}).ok());
  EXPECT_TRUE(runner_->Pump(0)) << runner_->why();
  EXPECT_EQ(stats_.preemptions.load(), 5u);
  EXPECT_EQ(runner_->engine_stats().kv_blocks_used, 3u);
  EXPECT_TRUE(Quiet(worker()));
}

TEST_F(StreamRunnerTest, ARingPastTheLimitIsMalformed) {
  Start(8u << 20);
  ASSERT_TRUE(control::SendRingGrow(worker(), control::RingGrow{(4u << 20) + 64}).ok());
  EXPECT_FALSE(runner_->Pump(0));
  EXPECT_TRUE(runner_->malformed());
  EXPECT_NE(runner_->why().find("limit"), std::string::npos) << runner_->why();
  EXPECT_TRUE(Quiet(worker()));
}

TEST_F(StreamRunnerTest, AStreamThatSentNothingGoesBackToTheQueueFront) {
  Start();
  auto waiting = NewJob(std::make_shared<Client>(), "waiting", "hi", true);
  ASSERT_TRUE(queue_.Push(waiting).ok());
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "hi", true);
  Open(job);
  runner_->Abandon("died");
  EXPECT_EQ(runner_->in_flight(), 0u);
  EXPECT_EQ(client->answers, 0);
  EXPECT_EQ(job->crashes, 1);
  EXPECT_EQ(job->stream->resumes, 0);
  ASSERT_EQ(queue_.size(), 2u);
  const auto next = queue_.PopBatch(BatchPolicy{}, std::chrono::milliseconds(0));
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0], job);
}

TEST_F(StreamRunnerTest, AStreamThatSentResponsesGoesOnElsewhereFromItsTokenIds) {
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "hi", true);
  const control::Open open = Open(job);
  worker_.Respond(open.id, false, {{"a"}}, {{7, 8}});
  EXPECT_EQ(Pump(), 1u);
  runner_->Abandon("died");
  EXPECT_EQ(client->answers, 0);
  EXPECT_EQ(job->crashes, 1);
  EXPECT_EQ(job->stream->resumes, 1);
  EXPECT_EQ(job->stream->token_ids, (std::vector<int64_t>{7, 8}));
  ASSERT_EQ(queue_.size(), 1u);

  // Another worker is opened it with them.
  Wire wire = Connect();
  RequestSlot slot = MakeSlot();
  StreamRunner next(model_, wire.server.get(), slot, 8, kSlotLimit, stats_, queue_);
  ASSERT_TRUE(next.Begin());
  Expect(wire.worker.get(), Kind::kRing);
  const auto again = queue_.PopBatch(BatchPolicy{}, std::chrono::milliseconds(0));
  ASSERT_EQ(again.size(), 1u);
  ASSERT_TRUE(next.Open(again[0]));
  const control::Open resumed = Expect(wire.worker.get(), Kind::kOpen).open;
  EXPECT_EQ(Int64s({slot.data() + resumed.resume.offset, resumed.resume.bytes}),
            (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(stats_.streams_resumed.load(), 1u);
}

TEST_F(StreamRunnerTest, AStreamThatSentResponsesEndsWhenTheModelCannotResume) {
  model_ = Generator(false);
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "hi", true);
  const control::Open open = Open(job);
  worker_.Respond(open.id, false, {{"a"}}, {{7}});
  EXPECT_EQ(Pump(), 1u);
  runner_->Abandon("died");
  ASSERT_EQ(client->answers, 1);
  EXPECT_EQ(client->code(), StatusCode::kInternal);
  EXPECT_NE(client->message().find("died after 1 responses"), std::string::npos)
      << client->message();
  EXPECT_NE(client->message().find("cannot resume"), std::string::npos) << client->message();
  EXPECT_EQ(queue_.size(), 0u);
}

TEST_F(StreamRunnerTest, AStreamThatTookDownTooManyWorkersFailsAsPoison) {
  Start();
  auto client = std::make_shared<Client>();
  auto job = NewJob(client, "r1", "hi", true);
  job->crashes = kPoisonCrashes - 1;
  Open(job);
  // A cancelled stream was answered already: it is neither answered nor
  // queued again.
  auto gone = std::make_shared<Client>();
  auto gone_job = NewJob(gone, "gone", "hi", true);
  gone_job->request.cancelled = std::make_shared<std::atomic<bool>>(false);
  Open(gone_job);
  gone_job->request.cancelled->store(true);
  ASSERT_TRUE(runner_->CancelOver(Clock::now()));
  Expect(worker(), Kind::kCancel);
  runner_->Abandon("died");
  ASSERT_EQ(client->answers, 1);
  EXPECT_EQ(client->code(), StatusCode::kInternal);
  EXPECT_EQ(client->message(),
            "poison stream: this request took down 3 workers of 'gen'; it is not retried");
  EXPECT_EQ(gone->answers, 1);
  EXPECT_EQ(queue_.size(), 0u);
  EXPECT_EQ(runner_->in_flight(), 0u);
}

TEST_F(StreamRunnerTest, AWorkerThatIsGoneDiedAndIsNotMalformed) {
  Start();
  auto client = std::make_shared<Client>();
  const control::Open open = Open(NewJob(client, "r1", "hi", true));
  // What it said before it went is read.
  worker_.Respond(open.id, false, {{"a"}});
  wire_.worker.Reset();
  EXPECT_FALSE(runner_->Pump(0));
  EXPECT_EQ(runner_->why(), "died");
  EXPECT_FALSE(runner_->malformed());
  EXPECT_EQ(client->responses.size(), 1u);
  EXPECT_EQ(client->answers, 0);
}

TEST_F(StreamRunnerTest, AWorkerThatSaysWhyItStopsIsNotMalformed) {
  Start();
  control::Done failed;
  failed.status_code = static_cast<uint32_t>(StatusCode::kInternal);
  failed.text = "CUDA error: out of memory";
  ASSERT_TRUE(control::SendDone(worker(), failed).ok());
  EXPECT_FALSE(runner_->Pump(0));
  EXPECT_EQ(runner_->why(), "stopped: CUDA error: out of memory");
  EXPECT_FALSE(runner_->malformed());
}

}  // namespace
}  // namespace hearth
