// SequenceTable: a sequence's requests run one at a time in order, each with
// its control inputs and its sequence's state; the state comes back from
// the answer and leaves it; sequences end, are freed when idle, and are
// bounded. The model's queue is a list here, answered by the test.
#include "server/sequences.h"

#include <cstring>

#include "gtest/gtest.h"

namespace hearth {
namespace {

using Clock = SequenceTable::Clock;

struct Dispatched {
  InferRequest request;
  SequenceTable::Done done;
};

SequenceBatching Config() {
  SequenceBatching s;
  s.max_idle_us = 1000;
  SequenceControl start;
  start.kind = SequenceControl::Kind::kStart;
  start.input = "START";
  start.dtype = DType::kI32;
  SequenceControl end = start;
  end.kind = SequenceControl::Kind::kEnd;
  end.input = "END";
  end.dtype = DType::kF32;
  SequenceControl corrid;
  corrid.kind = SequenceControl::Kind::kCorrid;
  corrid.input = "CORRID";
  corrid.dtype = DType::kU32;
  s.controls = {start, end, corrid};
  SequenceState state;
  state.input = "IN_STATE";
  state.output = "OUT_STATE";
  state.dtype = DType::kI32;
  state.dims = {1};
  state.initial_dims = {1};
  s.states = {state};
  return s;
}

InferRequest Step(uint64_t id, bool start, bool end, int32_t value) {
  InferRequest r;
  r.model = "acc";
  r.sequence_id = std::to_string(id);
  r.sequence_number = id;
  r.sequence_start = start;
  r.sequence_end = end;
  std::vector<std::byte> bytes(4);
  std::memcpy(bytes.data(), &value, 4);
  r.inputs.emplace_back("X", DType::kI32, std::vector<int64_t>{1, 1}, std::move(bytes));
  return r;
}

template <typename T>
T Scalar(const InferRequest& r, const std::string& name) {
  for (const InferTensor& t : r.inputs) {
    if (t.name != name) continue;
    T v{};
    EXPECT_EQ(t.data.size(), sizeof(T)) << name;
    std::memcpy(&v, t.data.data(), sizeof(T));
    return v;
  }
  ADD_FAILURE() << "no input " << name;
  return T{};
}

// The model: OUT_STATE = IN_STATE + X, answered with Y = the same.
InferResponse Answer(const InferRequest& r) {
  const int32_t sum = Scalar<int32_t>(r, "IN_STATE") + Scalar<int32_t>(r, "X");
  std::vector<std::byte> bytes(4);
  std::memcpy(bytes.data(), &sum, 4);
  InferResponse response;
  response.outputs.emplace_back("Y", DType::kI32, std::vector<int64_t>{1, 1}, bytes);
  response.outputs.emplace_back("OUT_STATE", DType::kI32, std::vector<int64_t>{1, 1}, bytes);
  return response;
}

class SequencesTest : public ::testing::Test {
 protected:
  SequencesTest()
      : table_(std::make_shared<SequenceTable>("acc", Config(), 2, true, [this] { return now_; })) {
  }

  // Submits; the answer (or the refusal) lands in *got.
  Status Submit(InferRequest r, std::optional<Result<InferResponse>>* got) {
    SequenceTable::Done done = [got](Result<InferResponse> answer) { *got = std::move(answer); };
    return table_->Submit(r, done, [this](InferRequest q, SequenceTable::Done d) {
      queue_.push_back({std::move(q), std::move(d)});
    });
  }
  // Runs the oldest dispatched request through the model.
  void RunOne() {
    ASSERT_FALSE(queue_.empty());
    Dispatched d = std::move(queue_.front());
    queue_.erase(queue_.begin());
    d.done(Answer(d.request));
  }
  static int32_t Y(const std::optional<Result<InferResponse>>& got) {
    EXPECT_TRUE(got.has_value() && got->ok());
    if (!got.has_value() || !got->ok()) return -1;
    EXPECT_EQ((*got)->outputs.size(), 1u) << "the state output is the server's";
    int32_t v = 0;
    std::memcpy(&v, (*got)->outputs[0].data.data(), 4);
    return v;
  }

  Clock::time_point now_ = Clock::time_point() + std::chrono::hours(1);
  std::shared_ptr<SequenceTable> table_;
  std::vector<Dispatched> queue_;
};

TEST_F(SequencesTest, StateAndControlsFlowThroughASequence) {
  std::optional<Result<InferResponse>> a, b, c;
  ASSERT_TRUE(Submit(Step(7, true, false, 5), &a).ok());
  ASSERT_EQ(queue_.size(), 1u);
  EXPECT_EQ(Scalar<int32_t>(queue_[0].request, "START"), 1);
  EXPECT_EQ(Scalar<float>(queue_[0].request, "END"), 0.0f);
  EXPECT_EQ(Scalar<uint32_t>(queue_[0].request, "CORRID"), 7u);
  EXPECT_EQ(Scalar<int32_t>(queue_[0].request, "IN_STATE"), 0);  // zeros to start
  EXPECT_EQ(queue_[0].request.inputs.back().shape, (std::vector<int64_t>{1, 1}));
  RunOne();
  EXPECT_EQ(Y(a), 5);
  ASSERT_TRUE(Submit(Step(7, false, false, 3), &b).ok());
  EXPECT_EQ(Scalar<int32_t>(queue_[0].request, "START"), 0);
  RunOne();
  EXPECT_EQ(Y(b), 8);
  ASSERT_TRUE(Submit(Step(7, false, true, 1), &c).ok());
  EXPECT_EQ(Scalar<float>(queue_[0].request, "END"), 1.0f);
  RunOne();
  EXPECT_EQ(Y(c), 9);
  EXPECT_EQ(table_->size(), 0u) << "an ended sequence is freed";
  std::optional<Result<InferResponse>> d;
  Status after = Submit(Step(7, false, false, 1), &d);
  EXPECT_FALSE(after.ok());
  EXPECT_NE(after.message().find("must specify the START flag"), std::string::npos)
      << after.message();
}

TEST_F(SequencesTest, ASequenceRunsOneRequestAtATimeInOrder) {
  std::optional<Result<InferResponse>> got[4];
  ASSERT_TRUE(Submit(Step(1, true, false, 1), &got[0]).ok());
  ASSERT_TRUE(Submit(Step(1, false, false, 10), &got[1]).ok());
  ASSERT_TRUE(Submit(Step(1, false, false, 100), &got[2]).ok());
  // Another sequence is not held back by the first.
  ASSERT_TRUE(Submit(Step(2, true, false, 1000), &got[3]).ok());
  ASSERT_EQ(queue_.size(), 2u) << "the first sequence's later steps wait their turn";
  RunOne();  // sequence 1, step 1: dispatches step 2
  ASSERT_EQ(queue_.size(), 2u);
  RunOne();  // sequence 2
  RunOne();  // sequence 1, step 2
  RunOne();  // sequence 1, step 3
  EXPECT_EQ(Y(got[0]), 1);
  EXPECT_EQ(Y(got[1]), 11);
  EXPECT_EQ(Y(got[2]), 111);
  EXPECT_EQ(Y(got[3]), 1000);
}

TEST_F(SequencesTest, AFailedStepKeepsTheStateAndAStartResetsIt) {
  std::optional<Result<InferResponse>> a, b, c, d;
  ASSERT_TRUE(Submit(Step(3, true, false, 4), &a).ok());
  RunOne();
  ASSERT_TRUE(Submit(Step(3, false, false, 1), &b).ok());
  Dispatched failed = std::move(queue_.front());
  queue_.clear();
  failed.done(Internal("the worker crashed"));
  EXPECT_FALSE(b->ok());
  ASSERT_TRUE(Submit(Step(3, false, false, 2), &c).ok());
  RunOne();
  EXPECT_EQ(Y(c), 6);
  ASSERT_TRUE(Submit(Step(3, true, false, 2), &d).ok());
  RunOne();
  EXPECT_EQ(Y(d), 2) << "a START begins with the initial state again";
}

TEST_F(SequencesTest, LimitsIdleSequencesAndStringIds) {
  std::optional<Result<InferResponse>> got[4];
  ASSERT_TRUE(Submit(Step(1, true, false, 1), &got[0]).ok());
  RunOne();
  ASSERT_TRUE(Submit(Step(2, true, false, 1), &got[1]).ok());
  RunOne();
  Status full = Submit(Step(3, true, false, 1), &got[2]);
  EXPECT_EQ(full.code(), StatusCode::kUnavailable) << full.ToString();
  EXPECT_NE(full.message().find("max_sequences"), std::string::npos) << full.message();
  now_ += std::chrono::milliseconds(2);  // past max_sequence_idle_microseconds
  EXPECT_TRUE(Submit(Step(3, true, false, 1), &got[2]).ok()) << "idle sequences were freed";
  EXPECT_EQ(table_->size(), 1u);
  RunOne();
  InferRequest named = Step(0, true, false, 1);
  named.sequence_id = "session-a";
  named.sequence_id_is_string = true;
  Status wrong = Submit(named, &got[3]);
  EXPECT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("give sequence_id as an integer"), std::string::npos)
      << wrong.message();
}

TEST_F(SequencesTest, FailAllAnswersTheWaiting) {
  std::optional<Result<InferResponse>> a, b;
  ASSERT_TRUE(Submit(Step(1, true, false, 1), &a).ok());
  ASSERT_TRUE(Submit(Step(1, false, false, 1), &b).ok());
  table_->FailAll(Unavailable("going away"));
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->status().code(), StatusCode::kUnavailable);
  RunOne();  // the running one still answers
  EXPECT_EQ(Y(a), 1);
  EXPECT_EQ(table_->size(), 0u);
}

}  // namespace
}  // namespace hearth
