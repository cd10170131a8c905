// sequence_batching read from config.yaml and from Triton's config.pbtxt to
// the same ModelConfig::sequence; its errors name the field; the workers'
// signature gains the control and state tensors.
#include <cstring>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "server/model_config.h"
#include "server/model_config_json.h"
#include "support/test_store.h"

namespace hearth {
namespace {

class SequenceConfigTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& file, const std::string& text) {
    const std::string dir = tmp_.File("m" + std::to_string(models_++));
    std::filesystem::create_directories(dir + "/1");
    std::ofstream(dir + "/" + file) << text;
    std::ofstream(dir + "/1/model.py") << "";
    return dir;
  }
  testing::TempDir tmp_;
  int models_ = 0;
};

constexpr const char* kYaml = R"(backend: python
max_batch_size: 8
input:
  - {name: INPUT, data_type: TYPE_INT32, dims: [1]}
output:
  - {name: OUTPUT, data_type: TYPE_INT32, dims: [1]}
sequence_batching:
  max_sequence_idle_microseconds: 5000000
  oldest: {max_candidate_sequences: 16, preferred_batch_size: [4], max_queue_delay_microseconds: 100}
  control_input:
    - name: START
      control: [{kind: CONTROL_SEQUENCE_START, fp32_false_true: [0, 1]}]
    - name: READY
      control: [{kind: CONTROL_SEQUENCE_READY, bool_false_true: [false, true]}]
    - name: END
      control: [{kind: CONTROL_SEQUENCE_END, int32_false_true: [0, 1]}]
    - name: CORRID
      control: [{kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64}]
  state:
    - input_name: INPUT_STATE
      output_name: OUTPUT_STATE
      data_type: TYPE_INT32
      dims: [-1]
      initial_state: [{data_type: TYPE_INT32, dims: [3], zero_data: true, name: zeros}]
)";

void ExpectSequence(const ModelConfig& c) {
  ASSERT_TRUE(c.sequence.has_value());
  const SequenceBatching& s = *c.sequence;
  EXPECT_TRUE(s.oldest);
  EXPECT_EQ(s.max_idle_us, 5000000u);
  EXPECT_EQ(c.max_sequences, 16);
  EXPECT_EQ(c.max_queue_delay_us, 100u);
  EXPECT_EQ(c.preferred_batch_sizes, (std::vector<int>{4}));
  ASSERT_EQ(s.controls.size(), 4u);
  EXPECT_EQ(s.controls[0].kind, SequenceControl::Kind::kStart);
  EXPECT_EQ(s.controls[0].dtype, DType::kF32);
  EXPECT_EQ(s.controls[0].true_value, 1.0);
  EXPECT_EQ(s.controls[1].dtype, DType::kBool);
  EXPECT_EQ(s.controls[2].kind, SequenceControl::Kind::kEnd);
  EXPECT_EQ(s.controls[2].dtype, DType::kI32);
  EXPECT_EQ(s.controls[3].kind, SequenceControl::Kind::kCorrid);
  EXPECT_EQ(s.controls[3].dtype, DType::kU64);
  ASSERT_EQ(s.states.size(), 1u);
  EXPECT_EQ(s.states[0].input, "INPUT_STATE");
  EXPECT_EQ(s.states[0].dims, (std::vector<int64_t>{-1}));
  EXPECT_EQ(s.states[0].initial_dims, (std::vector<int64_t>{3}));

  // The workers take the control and state inputs after the config's own.
  const std::vector<IoConfig> in = WorkerInputs(c);
  ASSERT_EQ(in.size(), 6u);
  EXPECT_EQ(in[1].name, "START");
  EXPECT_EQ(in[4].name, "CORRID");
  EXPECT_EQ(in[4].dims, (std::vector<int64_t>{1}));
  EXPECT_EQ(in[5].name, "INPUT_STATE");
  const std::vector<IoConfig> out = WorkerOutputs(c);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[1].name, "OUTPUT_STATE");
  // Triton's JSON of the config carries it (a Python model reads it there).
  const std::string json = ModelConfigJson(c);
  EXPECT_NE(json.find("\"sequence_batching\""), std::string::npos) << json;
  EXPECT_EQ(json.find("\"dynamic_batching\""), std::string::npos) << json;
}

TEST_F(SequenceConfigTest, ReadsEveryFieldFromYaml) {
  auto c = LoadModelConfig(Write("config.yaml", kYaml));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ExpectSequence(*c);
}

TEST_F(SequenceConfigTest, DirectIsTheDefaultAndIdleZeroIsOneSecond) {
  auto c = LoadModelConfig(Write("config.yaml", R"(backend: python
input: [{name: X, data_type: TYPE_FP32, dims: [1]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [1]}]
sequence_batching: {max_sequence_idle_microseconds: 0}
parameters: {max_sequences: "7"}
)"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_TRUE(c->sequence.has_value());
  EXPECT_FALSE(c->sequence->oldest);
  EXPECT_EQ(c->sequence->max_idle_us, 1000000u);
  EXPECT_EQ(c->max_sequences, 7);
  EXPECT_TRUE(c->sequence->controls.empty());
}

TEST_F(SequenceConfigTest, ErrorsNameTheField) {
  const std::string head = R"(backend: python
input: [{name: X, data_type: TYPE_FP32, dims: [1]}]
output: [{name: Y, data_type: TYPE_FP32, dims: [1]}]
)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"sequence_batching: {}\ndynamic_batching: {}\n", "not both"},
      {"sequence_batching: {direct: {}, oldest: {}}\n", "give one strategy"},
      {"sequence_batching: {direct: {minimum_slot_utilization: 0.5}}\n",
       "sequence_batching.direct.minimum_slot_utilization: hearth has no batch slots"},
      {"sequence_batching: {oldest: {preserve_ordering: true}}\n", "preserve_ordering"},
      {"sequence_batching: {iterative_sequence: true}\n",
       "sequence_batching.iterative_sequence: hearth does not implement"},
      {"sequence_batching: {control_input: [{name: X, control: [{kind: "
       "CONTROL_SEQUENCE_START, int32_false_true: [0, 1]}]}]}\n",
       "'X' is already an input"},
      {"sequence_batching: {control_input: [{name: S, control: [{kind: "
       "CONTROL_SEQUENCE_START}]}]}\n",
       "needs one of int32_false_true"},
      {"sequence_batching: {control_input: [{name: S, control: [{kind: "
       "CONTROL_SEQUENCE_START, int32_false_true: [0]}]}]}\n",
       "must be [false value, true value]"},
      {"sequence_batching: {control_input: [{name: C, control: [{kind: "
       "CONTROL_SEQUENCE_CORRID, data_type: TYPE_FP32}]}]}\n",
       "a correlation id is TYPE_UINT64"},
      {"sequence_batching: {control_input: [{name: A, control: [{kind: "
       "CONTROL_SEQUENCE_END, int32_false_true: [0, 1]}]}, {name: B, control: [{kind: "
       "CONTROL_SEQUENCE_END, int32_false_true: [0, 1]}]}]}\n",
       "CONTROL_SEQUENCE_END is given twice"},
      {"sequence_batching: {control_input: [{name: S, control: [{kind: BOGUS}]}]}\n",
       "'BOGUS' is not CONTROL_SEQUENCE_START"},
      {"sequence_batching: {state: [{input_name: I, output_name: Y, data_type: TYPE_FP32, "
       "dims: [1]}]}\n",
       "'Y' is already an output"},
      {"sequence_batching: {state: [{input_name: I, output_name: O, data_type: TYPE_STRING, "
       "dims: [1]}]}\n",
       "a state is a tensor of numbers"},
      {"sequence_batching: {state: [{input_name: I, output_name: O, data_type: TYPE_FP32, "
       "dims: [1], initial_state: [{data_type: TYPE_FP32, dims: [1], data_file: missing}]}]}\n",
       "initial_state[0].data_file: "},
      {"sequence_batching: {state: [{input_name: I, output_name: O, data_type: TYPE_FP32, "
       "dims: [1], initial_state: [{data_type: TYPE_FP32, dims: [1], data_file: ../x}]}]}\n",
       "is not a file name"},
      {"sequence_batching: {state: [{input_name: I, output_name: O, data_type: TYPE_FP32, "
       "dims: [1], initial_state: [{data_type: TYPE_FP32, dims: [1], zero_data: true, "
       "data_file: f}]}]}\n",
       "one of zero_data: true or data_file"},
      {"sequence_batching: {state: [{input_name: I, output_name: O, data_type: TYPE_FP32, "
       "dims: [2], initial_state: [{data_type: TYPE_FP32, dims: [3], zero_data: true}]}]}\n",
       "must be the state's dims [2]"},
      {"sequence_batching: {state: [{input_name: I, output_name: O, data_type: TYPE_FP32, "
       "dims: [1], use_growable_memory: true}]}\n",
       "use_growable_memory: hearth does not implement"},
      {"model_transaction_policy: {decoupled: true}\nsequence_batching: {}\n",
       "this model is decoupled"},
      {"parameters: {max_sequences: \"4\"}\n", "sequences are for models with sequence_batching"},
  };
  for (const auto& [tail, expect] : cases) {
    auto c = LoadModelConfig(Write("config.yaml", head + tail));
    ASSERT_FALSE(c.ok()) << tail;
    EXPECT_NE(c.status().message().find(expect), std::string::npos)
        << "got: " << c.status().message() << "\nwant: " << expect;
  }
}

TEST_F(SequenceConfigTest, AnInitialStateFromAFileOfTheModel) {
  const std::string yaml = R"(backend: python
input: [{name: X, data_type: TYPE_INT32, dims: [1]}]
output: [{name: Y, data_type: TYPE_INT32, dims: [1]}]
sequence_batching:
  state:
    - input_name: S
      output_name: T
      data_type: TYPE_INT32
      dims: [-1]
      initial_state: [{data_type: TYPE_INT32, dims: [2], data_file: start.bin}]
)";
  const std::string dir = Write("config.yaml", yaml);
  std::filesystem::create_directories(dir + "/initial_state");
  const int32_t values[2] = {7, -3};
  std::ofstream(dir + "/initial_state/start.bin", std::ios::binary)
      .write(reinterpret_cast<const char*>(values), sizeof values);
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const SequenceState& s = c->sequence->states.at(0);
  ASSERT_EQ(s.initial_data.size(), sizeof values);
  EXPECT_EQ(std::memcmp(s.initial_data.data(), values, sizeof values), 0);
  EXPECT_NE(ModelConfigJson(*c).find("\"data_file\":\"start.bin\""), std::string::npos);

  // A file of another size than the tensor's is refused, naming both.
  std::ofstream(dir + "/initial_state/start.bin", std::ios::binary) << "abc";
  auto wrong = LoadModelConfig(dir);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(
      wrong.status().message().find("has 3 bytes; the initial state [2] of TYPE_INT32 takes 8"),
      std::string::npos)
      << wrong.status().message();
}

#ifdef HEARTH_HAVE_PROTOBUF

// The same model as kYaml, in Triton's text format.
constexpr const char* kPbtxt = R"(backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  oldest {
    max_candidate_sequences: 16
    preferred_batch_size: [ 4 ]
    max_queue_delay_microseconds: 100
  }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [
    {
      input_name: "INPUT_STATE"
      output_name: "OUTPUT_STATE"
      data_type: TYPE_INT32
      dims: [ -1 ]
      initial_state: { data_type: TYPE_INT32 dims: [ 3 ] zero_data: true name: "zeros" }
    }
  ]
}
)";

TEST_F(SequenceConfigTest, ReadsTheSameFromConfigPbtxt) {
  auto c = LoadModelConfig(Write("config.pbtxt", kPbtxt));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ExpectSequence(*c);
}

TEST_F(SequenceConfigTest, PbtxtErrorsNameTheField) {
  auto c = LoadModelConfig(Write("config.pbtxt", R"(backend: "python"
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching { iterative_sequence: true }
)"));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("iterative_sequence"), std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("hearth does not implement"), std::string::npos)
      << c.status().message();
}

#endif

}  // namespace
}  // namespace hearth
