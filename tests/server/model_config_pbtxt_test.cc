// config.pbtxt: Triton's model configurations in protobuf's text format read
// to the same ModelConfig as config.yaml; fields hearth does not implement,
// parse errors and a directory with both files refused, naming the file,
// the line and column, and the field.
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "server/model_config.h"
#include "support/test_store.h"

namespace hearth {
namespace {

struct Case {
  std::string pbtxt;
  std::string expect;  // in the error's message
};

class ModelConfigPbtxtTest : public ::testing::Test {
 protected:
  // DIR/<model>/config.pbtxt and a version 3.
  std::string Write(const std::string& model, const std::string& pbtxt) {
    const std::string dir = tmp_.File(model);
    std::filesystem::create_directories(dir + "/3");
    std::ofstream(dir + "/config.pbtxt") << pbtxt;
    std::ofstream(dir + "/3/model.safetensors") << "x";
    return dir;
  }
  // Each case's config.pbtxt is refused with its message.
  void ExpectErrors(const std::vector<Case>& cases) {
    for (const Case& c : cases) {
      auto config = LoadModelConfig(Write("m" + std::to_string(models_++), c.pbtxt));
      ASSERT_FALSE(config.ok()) << c.pbtxt;
      EXPECT_NE(config.status().message().find(c.expect), std::string::npos)
          << "got: " << config.status().message() << "\nwant: " << c.expect;
    }
  }
  testing::TempDir tmp_;
  int models_ = 0;
};

#ifndef HEARTH_HAVE_PROTOBUF

TEST_F(ModelConfigPbtxtTest, IsRefusedWithTheReasonWithoutProtobuf) {
  auto c = LoadModelConfig(Write("m", "backend: \"python\"\n"));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("m/config.pbtxt: this hearth was built without protobuf"),
            std::string::npos)
      << c.status().message();
}

#else

// Triton's python_backend example (examples/add_sub/config.pbtxt).
constexpr const char* kAddSub = R"(name: "add_sub"
backend: "python"

input [
  {
    name: "INPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
input [
  {
    name: "INPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT0"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
output [
  {
    name: "OUTPUT1"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]

instance_group [{ kind: KIND_CPU }]
)";

TEST_F(ModelConfigPbtxtTest, ReadsTritonsAddSubPythonExample) {
  auto c = LoadModelConfig(Write("add_sub", kAddSub));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->name, "add_sub");
  EXPECT_EQ(c->backend, "python");
  EXPECT_EQ(c->max_batch_size, 0);
  EXPECT_NE(c->config_path.find("add_sub/config.pbtxt"), std::string::npos);
  ASSERT_EQ(c->inputs.size(), 2u);
  EXPECT_EQ(c->inputs[0].name, "INPUT0");
  EXPECT_EQ(c->inputs[1].name, "INPUT1");
  EXPECT_EQ(c->inputs[1].dtype, DType::kF32);
  EXPECT_EQ(c->inputs[1].dims, (std::vector<int64_t>{4}));
  ASSERT_EQ(c->outputs.size(), 2u);
  EXPECT_EQ(c->outputs[1].name, "OUTPUT1");
  EXPECT_EQ(c->instance_groups, (std::vector<InstanceGroup>{{1, false, {}}}));
  EXPECT_FALSE(c->decoupled);
  EXPECT_EQ(c->version, 3u);
}

// Triton's decoupled example (examples/decoupled/repeat_config.pbtxt).
constexpr const char* kRepeat = R"(name: "repeat_int32"
backend: "python"
max_batch_size: 0
model_transaction_policy {
  decoupled: True
}
input [
  {
    name: "IN"
    data_type: TYPE_INT32
    dims: [ -1 ]
  },
  {
    name: "DELAY"
    data_type: TYPE_UINT32
    dims: [ -1 ]
  },
  {
    name: "WAIT"
    data_type: TYPE_UINT32
    dims: [ 1 ]
    optional: true
  }
]
output [
  {
    name: "OUT"
    data_type: TYPE_INT32
    dims: [ 1 ]
  },
  {
    name: "IDX"
    data_type: TYPE_INT32
    dims: [ 1 ]
  }
]
instance_group [{ count: 1 kind: KIND_CPU }]
parameters { key: "max_streams" value: { string_value: "4" } }
)";

TEST_F(ModelConfigPbtxtTest, ReadsADecoupledRepeatModel) {
  auto c = LoadModelConfig(Write("repeat_int32", kRepeat));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->decoupled);
  EXPECT_EQ(c->max_streams, 4);
  ASSERT_EQ(c->inputs.size(), 3u);
  EXPECT_EQ(c->inputs[0].dims, (std::vector<int64_t>{-1}));
  EXPECT_EQ(c->inputs[0].dtype, DType::kI32);
  EXPECT_EQ(c->inputs[1].dtype, DType::kU32);
  EXPECT_EQ(c->inputs[2].dtype, DType::kU32);
  EXPECT_FALSE(c->inputs[1].optional);
  EXPECT_TRUE(c->inputs[2].optional);
  ASSERT_EQ(c->outputs.size(), 2u);
  EXPECT_EQ(c->outputs[1].name, "IDX");
  EXPECT_EQ(c->parameters.at("max_streams"), "4");
}

// An ONNX model of Triton's examples (densenet_onnx), with dynamic batching,
// instance groups, parameters and a version policy.
constexpr const char* kOnnx = R"(name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 8
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
  }
]
instance_group [
  { count: 2 kind: KIND_GPU gpus: [ 0 ] },
  { name: "spare" count: 1 kind: KIND_GPU gpus: [ 1, 2 ] }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 1
  default_queue_policy { default_timeout_microseconds: 5000 max_queue_size: 64 }
}
parameters { key: "allow_tf32" value: { string_value: "true" } }
parameters [ { key: "standby_workers" value: { string_value: "1" } } ]
version_policy: { specific: { versions: [ 3 ] } }
)";

TEST_F(ModelConfigPbtxtTest, ReadsAnOnnxModelWithDynamicBatchingAndInstanceGroups) {
  const std::string dir = Write("densenet_onnx", kOnnx);
  std::filesystem::create_directories(dir + "/4");
  std::ofstream(dir + "/4/model.safetensors") << "x";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend, "onnxruntime");  // Triton's backend for the platform
  EXPECT_EQ(c->max_batch_size, 8);
  ASSERT_EQ(c->inputs.size(), 1u);
  EXPECT_EQ(c->inputs[0].dims, (std::vector<int64_t>{3, 224, 224}));
  EXPECT_EQ(c->instance_groups, (std::vector<InstanceGroup>{{2, true, {0}}, {1, true, {1, 2}}}));
  EXPECT_EQ(c->preferred_batch_sizes, (std::vector<int>{4, 8}));
  EXPECT_EQ(c->max_queue_delay_us, 100u);
  EXPECT_EQ(c->priority_levels, 2u);
  EXPECT_EQ(c->default_priority_level, 1u);
  EXPECT_EQ(c->default_timeout_us, 5000u);
  EXPECT_EQ(c->max_queue_size, 64u);
  EXPECT_TRUE(c->allow_tf32);
  EXPECT_EQ(c->standby_workers, 1);
  EXPECT_EQ(c->version, 3u);  // specific, not the highest (4)
}

TEST_F(ModelConfigPbtxtTest, MeansWhatTheSameConfigYamlMeans) {
  const std::string pbtxt_dir = Write("same_pbtxt", kOnnx);
  const std::string yaml_dir = tmp_.File("same_yaml");
  std::filesystem::create_directories(yaml_dir + "/3");
  std::ofstream(yaml_dir + "/3/model.safetensors") << "x";
  std::ofstream(yaml_dir + "/config.yaml") << R"(backend: onnxruntime
max_batch_size: 8
input:
  - {name: data_0, data_type: TYPE_FP32, dims: [3, 224, 224]}
output:
  - {name: fc6_1, data_type: TYPE_FP32, dims: [1000]}
instance_group:
  - {count: 2, kind: KIND_GPU, gpus: [0]}
  - {name: spare, count: 1, kind: KIND_GPU, gpus: [1, 2]}
dynamic_batching:
  preferred_batch_size: [4, 8]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 1
  max_queue_size: 64
  default_queue_policy: {default_timeout_microseconds: 5000}
parameters: {allow_tf32: "true", standby_workers: "1"}
version_policy: {specific: {versions: [3]}}
)";
  std::string text;
  {
    std::ifstream in(pbtxt_dir + "/config.pbtxt");
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  // The name in the pbtxt is the directory's.
  text.replace(text.find("densenet_onnx"), 13, "same_pbtxt");
  auto p = ParseModelConfigPbtxt(pbtxt_dir, text);
  auto y = LoadModelConfig(yaml_dir);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_TRUE(y.ok()) << y.status().ToString();
  EXPECT_EQ(p->backend, y->backend);
  EXPECT_EQ(p->max_batch_size, y->max_batch_size);
  ASSERT_EQ(p->inputs.size(), y->inputs.size());
  EXPECT_EQ(p->inputs[0].name, y->inputs[0].name);
  EXPECT_EQ(p->inputs[0].dims, y->inputs[0].dims);
  EXPECT_EQ(p->outputs[0].name, y->outputs[0].name);
  EXPECT_EQ(p->instance_groups, y->instance_groups);
  EXPECT_EQ(p->preferred_batch_sizes, y->preferred_batch_sizes);
  EXPECT_EQ(p->max_queue_delay_us, y->max_queue_delay_us);
  EXPECT_EQ(p->max_queue_size, y->max_queue_size);
  EXPECT_EQ(p->default_timeout_us, y->default_timeout_us);
  EXPECT_EQ(p->priority_levels, y->priority_levels);
  EXPECT_EQ(p->default_priority_level, y->default_priority_level);
  EXPECT_EQ(p->parameters, y->parameters);
  EXPECT_EQ(p->standby_workers, y->standby_workers);
  EXPECT_EQ(p->version, y->version);
}

TEST_F(ModelConfigPbtxtTest, EmptyMessagesAndDefaultValuesMeanTheDefaults) {
  auto c = LoadModelConfig(Write("defaults", R"(backend: "scale"
max_batch_size: 0
instance_group [ { }, { count: 2 kind: KIND_AUTO } ]
dynamic_batching { }
model_transaction_policy { }
version_policy { latest { num_versions: 1 } }
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] optional: false } ]
output [ { name: "y" data_type: TYPE_STRING dims: [ 1 ] } ]
)"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->instance_groups, (std::vector<InstanceGroup>{{1, true, {}}, {2, true, {}}}));
  EXPECT_EQ(c->max_queue_delay_us, 0u);
  EXPECT_FALSE(c->decoupled);
  EXPECT_FALSE(c->inputs[0].optional);
  EXPECT_EQ(c->outputs[0].dtype, DType::kBytes);
  EXPECT_EQ(c->version, 3u);
}

TEST_F(ModelConfigPbtxtTest, ADirectoryWithBothConfigsIsRefusedNamingBoth) {
  const std::string dir = Write("both", kAddSub);
  std::ofstream(dir + "/config.yaml") << "backend: python\n";
  auto c = LoadModelConfig(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(dir + "/config.yaml and " + dir + "/config.pbtxt"),
            std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("not both"), std::string::npos) << c.status().message();
}

constexpr const char* kHead = R"(backend: "python"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
)";

TEST_F(ModelConfigPbtxtTest, FieldsHearthDoesNotImplementAreErrorsNamingThem) {
  const std::string h = kHead;  // four lines
  const std::string no = "hearth does not implement this field of Triton's model configuration";
  ExpectErrors({
      // In Triton's configuration, not in hearth's proto: refused by the parser.
      {h + "sequence_batching {\n  max_sequence_idle_microseconds: 5000000\n  iterative_sequence: "
           "true\n}\n",
       "config.pbtxt:7:3: iterative_sequence: " + no},
      {"platform: \"ensemble\"\nensemble_scheduling { step [ { model_name: \"a\" "
       "model_namespace: \"n\" } ] }\n",
       "ensemble_scheduling.step[0].model_namespace: " + no},
      {h + "model_warmup [ { name: \"w\" batch_size: 1 } ]\n",
       "config.pbtxt:5:1: model_warmup: " + no},
      {h + "optimization { cuda { graphs: true } }\n", "config.pbtxt:5:1: optimization: " + no},
      {h + "instance_group [ { count: 1\n  rate_limiter { priority: 1 } } ]\n",
       "config.pbtxt:6:3: rate_limiter: " + no},
      // In hearth's proto, set: found by walking the set fields.
      {h + "response_cache { enable: true }\n", "config.pbtxt:5:1: response_cache: " + no},
      {"backend: \"python\"\nmax_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_FP32 "
       "dims: [ 4 ]\n    reshape { shape: [ 2, 2 ] } } ]\n"
       "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n",
       "config.pbtxt:4:5: input[0].reshape: " + no},
      {"backend: \"python\"\nmax_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_INT64 "
       "dims: [ 1 ] is_shape_tensor: true } ]\n"
       "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n",
       "config.pbtxt:3:55: input[0].is_shape_tensor: " + no},
      {"backend: \"python\"\ninput [ { name: \"x\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n"
       "output [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] },\n"
       "  { name: \"z\" data_type: TYPE_FP32 dims: [ 1 ] is_shape_tensor: true } ]\n",
       "config.pbtxt:4:48: output[1].is_shape_tensor: " + no},
      {h + "dynamic_batching { preserve_ordering: true }\n",
       "config.pbtxt:5:20: dynamic_batching.preserve_ordering: " + no},
      {h + "dynamic_batching {\n  default_queue_policy { timeout_action: DELAY }\n}\n",
       "config.pbtxt:6:26: dynamic_batching.default_queue_policy.timeout_action: " + no},
      {h + "default_model_filename: \"model.onnx\"\n",
       "config.pbtxt:5:1: default_model_filename: " + no},
      {h + "version_policy { all {} }\n",
       "config.pbtxt:5:18: version_policy.all: hearth serves one version of a model"},
      {h + "version_policy { latest { num_versions: 2 } }\n",
       "config.pbtxt:5:27: version_policy.latest.num_versions: hearth serves one version"},
      {h + "version_policy { specific { versions: [ 1, 3 ] } }\n",
       "version_policy.specific.versions: hearth serves one version of a model"},
      {"platform: \"ensemble\"\n", "ensemble_scheduling: missing (platform: ensemble)"},
      {"platform: \"caffe2_netdef\"\n",
       "config.pbtxt:1:1: platform: 'caffe2_netdef' is not a platform hearth knows"},
  });
}

TEST_F(ModelConfigPbtxtTest, ParseErrorsNameTheLineAndColumn) {
  ExpectErrors({
      {"backend: \"python\"\nmax_batch_size: eight\n", "config.pbtxt:2:17: "},
      {"backend: \"python\"\nmax_batchsize: 4\n",
       "config.pbtxt:2:1: max_batchsize: not a field of Triton's model configuration"},
      {"backend: \"python\"\ninput [ { name: \"x\" data_typ: TYPE_FP32 } ]\n",
       "config.pbtxt:2:21: data_typ: not a field of Triton's model configuration "
       "(inference.ModelInput)"},
      {"backend: \"python\"\ninput [ { name: \"x\" data_type: TYPE_FP33 } ]\n",
       "config.pbtxt:2:42: Unknown enumeration value of \"TYPE_FP33\""},
      {"backend: \"python\"\nbackend: \"python\"\n", "config.pbtxt:2:"},
      {"backend: \"python\"\ninput [ { name: \"x\"\n", "config.pbtxt:3:"},
      {"backend: \"pyth\xff\"\n", "config.pbtxt:1:"},
  });
}

TEST_F(ModelConfigPbtxtTest, HearthsChecksNameThePlaceInThePbtxt) {
  const std::string h = kHead;
  ExpectErrors({
      {"backend: \"python\"\nmax_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_FP32 "
       "dims: [ 0 ] } ]\noutput [ { name: \"y\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n",
       "config.pbtxt:3:42: input[0].dims: dimension 0 must be positive"},
      {"backend: \"python\"\nmax_batch_size: 4\ninput [ { name: \"x\" data_type: TYPE_FP32 "
       "dims: [ 4 ] } ]\n",
       "output: missing (list both input and output"},
      {h + "parameters { key: \"zygote\" value: { string_value: \"maybe\" } }\n",
       "config.pbtxt:5:14: parameters.zygote: 'maybe' is not true or false"},
      {h + "parameters { key: \"a\" value: { string_value: \"1\" } }\n"
           "parameters { key: \"a\" value: { string_value: \"2\" } }\n",
       "config.pbtxt:6:14: parameters.a: is given twice"},
      {"name: \"other\"\n" + h, "config.pbtxt:1:1: name: 'other' differs from the directory"},
      {h + "dynamic_batching {\n  preferred_batch_size: [ 8 ]\n}\n",
       "config.pbtxt:6:3: dynamic_batching.preferred_batch_size: must be in [1, "
       "max_batch_size]"},
      {h + "instance_group [ { kind: KIND_MODEL } ]\n",
       "config.pbtxt:5:20: instance_group[0].kind: 'KIND_MODEL' is not KIND_GPU or KIND_CPU"},
      {h + "parameters { key: \"max_streams\" value: { string_value: \"2\" } }\n",
       "parameters.max_streams: streams are for decoupled models"},
      {"max_batch_size: 4\n", "config.pbtxt: backend: missing"},
      {"", "config.pbtxt: backend: missing"},
      {"# a comment only\n", "config.pbtxt: backend: missing"},
      {"backend: \"python\"\nmax_batch_size: -1\n",
       "config.pbtxt:2:1: max_batch_size: must be in [0, 4096]"},
  });
}

#endif  // HEARTH_HAVE_PROTOBUF

}  // namespace
}  // namespace hearth
