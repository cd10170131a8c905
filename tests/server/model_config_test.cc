// Model repository configs: what is accepted, and errors that name the file,
// the line and the field.
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "server/model_config.h"
#include "support/test_store.h"

namespace hearth {
namespace {

class ModelConfigTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& model, const std::string& yaml, bool with_checkpoint = true) {
    const std::string dir = tmp_.File(model);
    std::filesystem::create_directories(dir + "/3");
    std::ofstream(dir + "/config.yaml") << yaml;
    if (with_checkpoint) std::ofstream(dir + "/3/model.safetensors") << "x";
    return dir;
  }
  testing::TempDir tmp_;
};

constexpr const char* kGood = R"(backend: mlp
max_batch_size: 16
input:
  - {name: input, data_type: TYPE_FP32, dims: [64]}
output:
  - {name: logits, data_type: TYPE_FP32, dims: [32]}
  - {name: argmax, data_type: TYPE_INT64, dims: [1]}
instance_group:
  - {count: 3, kind: KIND_GPU, gpus: [0]}
dynamic_batching:
  max_queue_delay_microseconds: 500
  preferred_batch_size: [8, 16]
parameters: {allow_tf32: true}
)";

TEST_F(ModelConfigTest, ReadsTritonStyleFields) {
  auto c = LoadModelConfig(Write("mlp", kGood));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend, "mlp");
  EXPECT_EQ(c->max_batch_size, 16);
  ASSERT_EQ(c->inputs.size(), 1u);
  EXPECT_EQ(c->inputs[0].dims, (std::vector<int64_t>{64}));
  ASSERT_EQ(c->outputs.size(), 2u);
  EXPECT_EQ(c->outputs[1].dtype, DType::kI64);
  EXPECT_EQ(c->instance_count, 3);
  EXPECT_TRUE(c->kind_gpu);
  EXPECT_EQ(c->max_queue_delay_us, 500u);
  EXPECT_EQ(c->preferred_batch_sizes, (std::vector<int>{8, 16}));
  EXPECT_TRUE(c->allow_tf32);
  EXPECT_EQ(c->version, 3u);
  EXPECT_NE(c->checkpoint_path.find("/3/model.safetensors"), std::string::npos);
}

TEST_F(ModelConfigTest, ErrorsNameTheFileTheLineAndTheField) {
  struct Case {
    std::string yaml;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"backend: mlp\nmax_batch_size: 16\ninput:\n  - {name: input, data_type: TYPE_FP33, dims: [64]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n",
       "config.yaml:4: input[0].data_type: 'TYPE_FP33' is not a known TYPE_*"},
      {"backend: mlp\nmax_batch_size: 16\ninput:\n  - {name: input, data_type: TYPE_FP32, dims: [0]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n",
       "config.yaml:4: input[0].dims: dimension 0 must be positive"},
      {"backend: resnet\n", "config.yaml:1: backend: 'resnet' is not one of mlp, scale"},
      {"backend: mlp\nmax_batchsize: 4\n", "config.yaml:2: max_batchsize: unknown field"},
      {"backend: mlp\nmax_batch_size: many\n", "config.yaml:2: max_batch_size: 'many' is not a valid value"},
      {"backend: mlp\ninput: [\n", "config.yaml:"},
      {"max_batch_size: 1\n", "backend: missing"},
      {"backend: mlp\nmax_batch_size: 4\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\ninstance_group:\n  - {count: 0}\n",
       "config.yaml:8: instance_group.count: must be in [1, 256]"},
      {"backend: mlp\nmax_batch_size: 4\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\ndynamic_batching:\n  preferred_batch_size: [8]\n",
       "config.yaml:8: dynamic_batching.preferred_batch_size: must be in [1, max_batch_size]"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadModelConfig(Write("m" + std::to_string(i++), c.yaml));
    ASSERT_FALSE(config.ok()) << c.yaml;
    EXPECT_NE(config.status().message().find(c.expect), std::string::npos)
        << "got: " << config.status().message() << "\nwant: " << c.expect;
  }
}

TEST_F(ModelConfigTest, VersionsAndPolicies) {
  auto missing = LoadModelConfig(Write("nov", kGood, false));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no version directory"), std::string::npos);
  const std::string dir = Write("two", std::string(kGood) + "version_policy: {specific: {versions: [1]}}\n");
  std::filesystem::create_directories(dir + "/1");
  std::ofstream(dir + "/1/model.safetensors") << "x";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 1u);
}

TEST_F(ModelConfigTest, ScanKeepsBrokenModelsWithTheirReason) {
  Write("good", kGood);
  Write("bad", "backend: nope\n");
  auto models = ScanRepository(tmp_.path());
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->size(), 2u);
  EXPECT_EQ((*models)[0].name, "bad");
  EXPECT_FALSE((*models)[0].status.ok());
  EXPECT_TRUE((*models)[1].status.ok());
  EXPECT_FALSE(ScanRepository(tmp_.File("nonexistent")).ok());
}

}  // namespace
}  // namespace hearth
