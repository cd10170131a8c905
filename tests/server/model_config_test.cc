// Model repository configs: what is accepted, and errors that name the file,
// the line and the field.
#include "server/model_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "checkpoint/synthetic.h"
#include "gtest/gtest.h"
#include "hearth/checkpoint.h"
#include "support/test_store.h"

namespace hearth {
namespace {

class ModelConfigTest : public ::testing::Test {
 protected:
  std::string Write(const std::string& model, const std::string& yaml,
                    bool with_checkpoint = true) {
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
  ASSERT_EQ(c->instance_groups.size(), 1u);
  EXPECT_EQ(c->instance_groups[0], (InstanceGroup{3, true, {0}}));
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
      {"backend: mlp\nmax_batch_size: 16\ninput:\n  - {name: input, data_type: TYPE_FP33, dims: "
       "[64]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n",
       "config.yaml:4: input[0].data_type: 'TYPE_FP33' is not a known TYPE_*"},
      {"backend: mlp\nmax_batch_size: 16\ninput:\n  - {name: input, data_type: TYPE_FP32, dims: "
       "[0]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n",
       "config.yaml:4: input[0].dims: dimension 0 must be positive"},
      {"backend: Res/Net\n", "config.yaml:1: backend: 'Res/Net' is not a backend name"},
      {"backend: mlp\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n",
       "output: missing (list both input and output, or neither"},
      {"backend: mlp\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [-2]}\noutput:\n"
       "  - {name: y, data_type: TYPE_FP32, dims: [1]}\n",
       "config.yaml:3: input[0].dims: dimension -2 must be positive, or -1 for any size"},
      {"backend: mlp\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
       "  - {name: x, data_type: TYPE_FP32, dims: [4]}\noutput:\n"
       "  - {name: y, data_type: TYPE_FP32, dims: [1]}\n",
       "input[1].name: 'x' is listed twice"},
      {"backend: mlp\nmax_batchsize: 4\n", "config.yaml:2: max_batchsize: unknown field"},
      // A second key would silently replace (or be dropped for) the first.
      {"backend: mlp\nparameters: {allow_tf32: true}\nmax_batch_size: 4\n"
       "parameters:\n  fault_injection: {on_value: 1, kind: abort}\n",
       "config.yaml:4: parameters: is given twice (give each key once)"},
      {"backend: mlp\ndynamic_batching:\n  max_queue_delay_microseconds: 5\n"
       "  max_queue_delay_microseconds: 6\n",
       "config.yaml:4: dynamic_batching.max_queue_delay_microseconds: is given twice"},
      {"backend: python\nparameters: {zygote: maybe}\n",
       "config.yaml:2: parameters.zygote: 'maybe' is not true or false"},
      {"backend: mlp\nparameters: {allow_tf32: yes}\n",
       "config.yaml:2: parameters.allow_tf32: 'yes' is not true or false"},
      {"backend: mlp\nmax_batch_size: 4\ndynamic_batching: {max_queue_delay_microsecond: 100}\n",
       "config.yaml:3: dynamic_batching.max_queue_delay_microsecond: unknown field"},
      {"backend: mlp\nmax_batch_size: 4\ndynamic_batching:\n  default_queue_policy: "
       "{default_timeout_microseconds: 5, timeout_action: DELAY}\n",
       "dynamic_batching.default_queue_policy: must be {default_timeout_microseconds: N}"},
      {"backend: mlp\nparameters: {zygote: true}\n",
       "config.yaml:2: parameters.zygote: only backend: python forks its workers from a zygote; "
       "this model's backend is 'mlp'"},
      {"backend: mlp\nmax_batch_size: many\n",
       "config.yaml:2: max_batch_size: 'many' is not a valid value"},
      {"backend: mlp\ninput: [\n", "config.yaml:"},
      {"max_batch_size: 1\n", "backend: missing"},
      {"backend: mlp\nmax_batch_size: 4\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\ninstance_group:\n  - {count: 0}\n",
       "config.yaml:8: instance_group[0].count: must be in [1, 256]"},
      {"backend: mlp\nmax_batch_size: 4\ninput:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
       "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\ndynamic_batching:\n  "
       "preferred_batch_size: [8]\n",
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

constexpr const char* kHeader = R"(backend: mlp
max_batch_size: 4
input:
  - {name: x, data_type: TYPE_FP32, dims: [4]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
)";

TEST_F(ModelConfigTest, InstanceGroupsAreKeptAsWritten) {
  auto c = LoadModelConfig(Write("groups", std::string(kHeader) + R"(instance_group:
  - {count: 2, kind: KIND_GPU, gpus: [0, 1]}
  - {name: spare, count: 1, kind: KIND_GPU, gpus: [1]}
  - {count: 3, kind: KIND_CPU}
  - {kind: KIND_GPU}
)"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->instance_groups,
            (std::vector<InstanceGroup>{
                {2, true, {0, 1}}, {1, true, {1}}, {3, false, {}}, {1, true, {}}}));
  // No instance_group: one instance on the default GPU.
  auto bare = LoadModelConfig(Write("nogroup", kHeader));
  ASSERT_TRUE(bare.ok()) << bare.status().ToString();
  EXPECT_EQ(bare->instance_groups, (std::vector<InstanceGroup>{{1, true, {}}}));
}

TEST_F(ModelConfigTest, InstanceGroupErrorsNameTheGroupAndTheField) {
  struct Case {
    std::string groups;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"instance_group: []\n", "config.yaml:7: instance_group: must be a list of {count"},
      {"instance_group: {count: 2}\n", "config.yaml:7: instance_group: must be a list"},
      {"instance_group:\n  - {count: 1}\n  - 7\n",
       "config.yaml:9: instance_group[1]: must be {count, kind, gpus}"},
      {"instance_group:\n  - {count: 1}\n  - {count: 1, gpus: [0, 2, 0]}\n",
       "config.yaml:9: instance_group[1].gpus: lists GPU 0 twice"},
      {"instance_group:\n  - {gpus: [-1]}\n",
       "instance_group[0].gpus: -1 is not a GPU ordinal (0 to 1023)"},
      {"instance_group:\n  - {gpus: [1024]}\n",
       "instance_group[0].gpus: 1024 is not a GPU ordinal (0 to 1023)"},
      {"instance_group:\n  - {gpus: 1}\n", "instance_group[0].gpus: must be a list"},
      {"instance_group:\n  - {count: 1, kind: KIND_CPU, gpus: [0]}\n",
       "instance_group[0].gpus: a KIND_CPU group names no GPUs"},
      {"instance_group:\n  - {count: 1, kind: KIND_TPU}\n",
       "instance_group[0].kind: 'KIND_TPU' is not KIND_GPU or KIND_CPU"},
      {"instance_group:\n  - {count: 1, host_policy: x}\n",
       "instance_group[0].host_policy: unknown field"},
      {"instance_group:\n  - {count: 257}\n", "instance_group[0].count: must be in [1, 256]"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadModelConfig(Write("g" + std::to_string(i++), kHeader + c.groups));
    ASSERT_FALSE(config.ok()) << c.groups;
    EXPECT_NE(config.status().message().find(c.expect), std::string::npos)
        << "got: " << config.status().message() << "\nwant: " << c.expect;
  }
  std::string many = "instance_group:\n";
  for (int g = 0; g < 65; ++g) many += "  - {count: 1}\n";
  auto config = LoadModelConfig(Write("many", kHeader + many));
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find("instance_group: more than 64 groups"),
            std::string::npos)
      << config.status().message();
}

TEST_F(ModelConfigTest, AnyBackendNameVariableDimsStringsAndNoSignature) {
  auto c = LoadModelConfig(Write("py", R"(backend: python
max_batch_size: 4
input:
  - {name: text, data_type: TYPE_STRING, dims: [1]}
  - {name: x, data_type: TYPE_FP32, dims: [-1, 3]}
output:
  - {name: y, data_type: TYPE_STRING, dims: [-1]}
)"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->backend, "python");
  ASSERT_EQ(c->inputs.size(), 2u);
  EXPECT_EQ(c->inputs[0].dtype, DType::kBytes);
  EXPECT_EQ(c->inputs[1].dims, (std::vector<int64_t>{-1, 3}));
  EXPECT_EQ(c->outputs[0].dtype, DType::kBytes);
  EXPECT_TRUE(c->zygote);  // on unless turned off
  auto execd = LoadModelConfig(Write("execd", "backend: python\nparameters: {zygote: false}\n"));
  ASSERT_TRUE(execd.ok()) << execd.status().ToString();
  EXPECT_FALSE(execd->zygote);
  // Neither input nor output: the backend's signature is taken.
  auto bare = LoadModelConfig(Write("bare", "backend: mlp\nmax_batch_size: 2\n"));
  ASSERT_TRUE(bare.ok()) << bare.status().ToString();
  EXPECT_TRUE(bare->inputs.empty());
  EXPECT_TRUE(bare->outputs.empty());
}

TEST_F(ModelConfigTest, VersionsAndPolicies) {
  auto missing = LoadModelConfig(Write("nov", kGood, false));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no version directory"), std::string::npos);
  const std::string dir =
      Write("two", std::string(kGood) + "version_policy: {specific: {versions: [1]}}\n");
  std::filesystem::create_directories(dir + "/1");
  std::ofstream(dir + "/1/model.safetensors") << "x";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 1u);
}

TEST_F(ModelConfigTest, ScanKeepsBrokenModelsWithTheirReason) {
  Write("good", kGood);
  Write("bad", "backend: No Pe\n");
  auto models = ScanRepository(tmp_.path());
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->size(), 2u);
  EXPECT_EQ((*models)[0].name, "bad");
  EXPECT_FALSE((*models)[0].status.ok());
  EXPECT_TRUE((*models)[1].status.ok());
  EXPECT_FALSE(ScanRepository(tmp_.File("nonexistent")).ok());
}

// Each of these used to end the whole server (an uncaught exception, or an
// open() that never returns); now each fails its model with a message naming
// the path and what is wrong.
TEST_F(ModelConfigTest, HostileDirectoriesFailTheirModelWithPathAndReason) {
  namespace fs = std::filesystem;
  struct Case {
    std::string name;
    std::function<void(const std::string& dir)> make;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"bigversion",
       [](const std::string& dir) {
         fs::create_directories(dir + "/99999999999999999999999");
         std::ofstream(dir + "/99999999999999999999999/model.safetensors") << "x";
       },
       "bigversion/99999999999999999999999: version directory name '99999999999999999999999' is "
       "not a "
       "number below 2^64"},
      {"sameversion",
       [](const std::string& dir) {
         fs::create_directories(dir + "/03");
         std::ofstream(dir + "/03/model.safetensors") << "x";
       },
       "version directories"},
      {"versionloop", [](const std::string& dir) { fs::create_directory_symlink("7", dir + "/7"); },
       "versionloop/7: a loop of symbolic links"},
      {"checkpointloop",
       [](const std::string& dir) {
         fs::create_directories(dir + "/8");
         fs::create_symlink("model.safetensors", dir + "/8/model.safetensors");
       },
       "checkpointloop/8/model.safetensors: a loop of symbolic links"},
  };
  for (const Case& c : cases) {
    const std::string dir = Write(c.name, kGood);
    c.make(dir);
    auto config = LoadModelConfig(dir);
    ASSERT_FALSE(config.ok()) << c.name;
    EXPECT_NE(config.status().message().find(c.expect), std::string::npos)
        << "got: " << config.status().message() << "\nwant: " << c.expect;
  }
}

TEST_F(ModelConfigTest, ConfigThatIsNotARegularFileIsRefusedWithoutBlocking) {
  namespace fs = std::filesystem;
  const std::string as_dir = tmp_.File("dirconfig");
  fs::create_directories(as_dir + "/config.yaml");
  auto d = LoadModelConfig(as_dir);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("config.yaml: is a directory"), std::string::npos)
      << d.status().message();

  // A FIFO with no writer would block open() forever.
  const std::string as_fifo = tmp_.File("fifoconfig");
  fs::create_directories(as_fifo);
  ASSERT_EQ(::mkfifo((as_fifo + "/config.yaml").c_str(), 0600), 0);
  auto f = LoadModelConfig(as_fifo);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("config.yaml: is a FIFO"), std::string::npos)
      << f.status().message();

  const std::string missing = tmp_.File("noconfig");
  fs::create_directories(missing + "/1");
  auto m = LoadModelConfig(missing);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("noconfig/config.yaml: missing"), std::string::npos)
      << m.status().message();

  const std::string loop = tmp_.File("modelloop");
  fs::create_directory_symlink("modelloop", loop);
  auto l = LoadModelConfig(loop);
  ASSERT_FALSE(l.ok());
  EXPECT_NE(l.status().message().find("modelloop/config.yaml: a loop of symbolic links"),
            std::string::npos)
      << l.status().message();
}

TEST_F(ModelConfigTest, ConfigsOverOneMebibyteAreRefused) {
  // A comment that takes the file just past the limit; the same config just
  // below it is read.
  const std::string base = std::string(kGood) + "# ";
  const std::string over = base + std::string(kMaxConfigBytes - base.size() + 1, 'x');
  auto big = LoadModelConfig(Write("big", over));
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("over the limit of 1048576 bytes"), std::string::npos)
      << big.status().message();
  const std::string under = base + std::string(kMaxConfigBytes - base.size() - 1, 'x') + "\n";
  ASSERT_EQ(under.size(), kMaxConfigBytes);
  auto ok = LoadModelConfig(Write("justunder", under));
  EXPECT_TRUE(ok.ok()) << ok.status().ToString();
}

TEST_F(ModelConfigTest, HostileYamlIsAnErrorNotACrash) {
  const std::string io =
      "input:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
      "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n";
  struct Case {
    std::string yaml;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"backend: mlp\n? [a, b]\n: 1\n", "config.yaml:2: (top level): keys must be single values"},
      {"backend: mlp\n? {a: 1}\n: 1\n", "keys must be single values"},
      {"backend: mlp\n" + io + "parameters:\n  ? [k]\n  : v\n",
       "parameters: keys must be single values"},
      {"backend: mlp\ninput:\n  - {? [n]: x, data_type: TYPE_FP32, dims: [4]}\n" +
           io.substr(io.find("output")),
       "input[0]: keys must be single values"},
      {"backend: [mlp]\n", "backend: must be a single value"},
      // Checked numbers: no wrap-around, no silent truncation.
      {"backend: mlp\n" + io + "dynamic_batching: {max_queue_size: -1}\n",
       "dynamic_batching.max_queue_size: '-1' is not a valid value"},
      {"backend: mlp\n" + io +
           "dynamic_batching: {max_queue_delay_microseconds: 99999999999999999999}\n",
       "'99999999999999999999' is out of range"},
      {"backend: mlp\nmax_batch_size: 4294967297\n",
       "max_batch_size: '4294967297' is out of range"},
      {"backend: mlp\nmax_batch_size: 0x10\n", "max_batch_size: '0x10' is not a valid value"},
      {"backend: mlp\n" + io.substr(0, io.find("[4]")) + "[1e3]}\n" + io.substr(io.find("output")),
       "input[0].dims: '1e3' is not a valid value"},
      {"backend: mlp\n" + io + "parameters: {fault_injection: {on_value: nan, kind: abort}}\n",
       "is not a finite number"},
      {"backend: mlp\n" + io + "version_policy: [1]\n", "version_policy: only {specific"},
      {"backend: mlp\n" + io + "version_policy: {specific: [1]}\n",
       "version_policy: only {specific"},
      // Past yaml-cpp's depth limit.
      {"backend: mlp\nparameters: " + std::string(100000, '[') + "\n",
       "levels deep, past the parser's limit"},
      {std::string("backend: mlp\0\n", 14), "config.yaml:"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadModelConfig(Write("y" + std::to_string(i++), c.yaml));
    ASSERT_FALSE(config.ok()) << c.yaml.substr(0, 200);
    EXPECT_NE(config.status().message().find(c.expect), std::string::npos)
        << "got: " << config.status().message() << "\nwant: " << c.expect;
  }
}

// Aliases are refused where they are written: a model config has no use for
// them, and each one can stand for a whole subtree, so that a file of a few
// hundred bytes could stand for billions of nodes. Merge keys (`<<`) need an
// alias or merely rename a map: refused too. Anchors alone change nothing.
TEST_F(ModelConfigTest, AliasesAndMergeKeysAreRefused) {
  const std::string io =
      "input:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
      "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n";
  struct Case {
    std::string yaml;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"backend: mlp\n" + io + "parameters:\n  a: &v x\n  b: *v\n",
       "config.yaml:8: *v: aliases are not supported in model configs"},
      {"backend: &name mlp\n" + io + "parameters: {a: *name}\n",
       "config.yaml:6: *name: aliases are not supported in model configs"},
      // An alias to the sequence that holds it: a cycle in yaml-cpp's nodes.
      {"backend: mlp\n" + io + "parameters: {a: &self [*self]}\n",
       "config.yaml:6: *self: aliases are not supported"},
      {"backend: mlp\n" + io + "parameters:\n  <<: {a: x}\n",
       "config.yaml:7: parameters: merge keys (<<) are not supported in model configs"},
      {"backend: mlp\n" + io + "dynamic_batching: {<<: {max_queue_size: 4}}\n",
       "config.yaml:6: dynamic_batching: merge keys (<<) are not supported"},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto config = LoadModelConfig(Write("alias" + std::to_string(i++), c.yaml));
    ASSERT_FALSE(config.ok()) << c.yaml;
    EXPECT_NE(config.status().message().find(c.expect), std::string::npos)
        << "got: " << config.status().message() << "\nwant: " << c.expect;
  }
  // An anchor that nothing refers to, and a quoted "<<", which is a plain key.
  auto anchored =
      LoadModelConfig(Write("anchored", "backend: &b mlp\n" + io + "parameters: {'<<': x}\n"));
  ASSERT_TRUE(anchored.ok()) << anchored.status().ToString();
  EXPECT_EQ(anchored->backend, "mlp");
  EXPECT_EQ(anchored->parameters.at("<<"), "x");
}

// "Billion laughs": ten levels of nine aliases each stand for 9^10 (3.5e9)
// scalars in 400 bytes. Refused at the first alias, without expanding any.
TEST_F(ModelConfigTest, AnAliasBombIsRefusedAtItsFirstAlias) {
  std::string bomb = "backend: mlp\nparameters:\n  a: &a [x, x, x, x, x, x, x, x, x]\n";
  for (char level = 'b'; level <= 'j'; ++level) {
    const char prev = static_cast<char>(level - 1);
    bomb += std::string("  ") + level + ": &" + level + " [";
    for (int i = 0; i < 9; ++i) bomb += std::string(i ? ", " : "") + "*" + prev;
    bomb += "]\n";
  }
  auto config = LoadModelConfig(Write("bomb", bomb));
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find(
                "bomb/config.yaml:4: *a: aliases are not supported in model configs"),
            std::string::npos)
      << config.status().message();
}

// Past 100000 values (scalars, lists and maps) a config is refused before
// yaml-cpp builds its nodes; a config has a few dozen.
TEST_F(ModelConfigTest, ConfigsOfTooManyValuesAreRefused) {
  std::string many = "backend: mlp\nparameters: {k: [";
  for (int i = 0; i < 100000; ++i) many += "x,";
  many += "x]}\n";
  ASSERT_LT(many.size(), kMaxConfigBytes);
  auto config = LoadModelConfig(Write("many", many));
  ASSERT_FALSE(config.ok());
  EXPECT_NE(config.status().message().find(
                "many/config.yaml:2: more than 100000 values (lists, maps and single values)"),
            std::string::npos)
      << config.status().message();
}

// A delay past 60 s would make a lone request wait (nearly) forever, and one
// past 2^63 ns would overflow the time arithmetic: refused, naming the field.
TEST_F(ModelConfigTest, QueueDelayIsBoundedToSixtySeconds) {
  const std::string head =
      "backend: mlp\nmax_batch_size: 4\n"
      "input:\n  - {name: x, data_type: TYPE_FP32, dims: [4]}\n"
      "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
      "dynamic_batching:\n  max_queue_delay_microseconds: ";
  for (const char* value : {"60000001", "9223372036854775808", "18446744073709551615"}) {
    auto config = LoadModelConfig(Write(std::string("d") + value, head + value + "\n"));
    ASSERT_FALSE(config.ok()) << value;
    EXPECT_NE(config.status().message().find(
                  "config.yaml:8: dynamic_batching.max_queue_delay_microseconds: must be at most "
                  "60000000"),
              std::string::npos)
        << config.status().message();
  }
  auto longest = LoadModelConfig(Write("d60s", head + "60000000\n"));
  ASSERT_TRUE(longest.ok()) << longest.status().ToString();
  EXPECT_EQ(longest->max_queue_delay_us, 60000000u);
}

TEST_F(ModelConfigTest, ParametersAreBounded) {
  auto with_params = [&](const std::string& name, const std::string& params) {
    return LoadModelConfig(
        Write(name, std::string(kGood).substr(0, std::string(kGood).find("parameters")) +
                        "parameters:\n" + params));
  };
  const std::string big_value(kMaxModelParameterBytes - 4, 'v');
  auto fits = with_params("fits", "  k: " + big_value + "\n  ab: c\n");  // 64 KiB exactly
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ(fits->parameters.at("k"), big_value);
  auto over = with_params("over", "  k: " + big_value + "\n  abc: d\n");
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find(
                "parameters.abc: the parameters' names and values come to more than "
                "the limit of 65536 bytes"),
            std::string::npos)
      << over.status().message();
  std::string many;
  for (size_t i = 0; i <= kMaxModelParameters; ++i) many += "  p" + std::to_string(i) + ": 1\n";
  auto too_many = with_params("many", many);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("more than 256 parameters"), std::string::npos)
      << too_many.status().message();
}

TEST_F(ModelConfigTest, StandbyModeIsColdOrHotAndHotNeedsStandbyWorkers) {
  auto with_params = [&](const std::string& name, const std::string& params) {
    return LoadModelConfig(
        Write(name, std::string(kGood).substr(0, std::string(kGood).find("parameters")) +
                        "parameters:\n" + params));
  };
  auto cold_default = with_params("colddefault", "  standby_workers: '2'\n");
  ASSERT_TRUE(cold_default.ok()) << cold_default.status().ToString();
  EXPECT_EQ(cold_default->standby_workers, 2);
  EXPECT_FALSE(cold_default->standby_hot);
  auto cold = with_params("cold", "  standby_mode: cold\n");
  ASSERT_TRUE(cold.ok()) << cold.status().ToString();
  EXPECT_FALSE(cold->standby_hot);
  auto hot = with_params("hot", "  standby_workers: '1'\n  standby_mode: hot\n");
  ASSERT_TRUE(hot.ok()) << hot.status().ToString();
  EXPECT_TRUE(hot->standby_hot);
  EXPECT_EQ(hot->standby_workers, 1);
  // Whichever comes first in the file.
  auto hot_first = with_params("hotfirst", "  standby_mode: hot\n  standby_workers: '3'\n");
  ASSERT_TRUE(hot_first.ok()) << hot_first.status().ToString();
  EXPECT_TRUE(hot_first->standby_hot);

  auto lonely = with_params("lonely", "  standby_mode: hot\n");
  ASSERT_FALSE(lonely.ok());
  EXPECT_NE(lonely.status().message().find(
                "config.yaml:14: parameters.standby_mode: hot keeps parameters.standby_workers "
                "processes started, and parameters.standby_workers is 0"),
            std::string::npos)
      << lonely.status().message();
  auto zero = with_params("zero", "  standby_workers: '0'\n  standby_mode: hot\n");
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("parameters.standby_workers is 0"), std::string::npos)
      << zero.status().message();
  auto warm = with_params("warm", "  standby_workers: '1'\n  standby_mode: warm\n");
  ASSERT_FALSE(warm.ok());
  EXPECT_NE(warm.status().message().find(
                "config.yaml:15: parameters.standby_mode: 'warm' is not cold or hot"),
            std::string::npos)
      << warm.status().message();
  auto listed = with_params("listed", "  standby_workers: '1'\n  standby_mode: [hot]\n");
  ASSERT_FALSE(listed.ok());
  EXPECT_NE(listed.status().message().find("parameters.standby_mode: must be a single value"),
            std::string::npos)
      << listed.status().message();
}

TEST_F(ModelConfigTest, VersionDirectoryNamesAreKeptAsWritten) {
  const std::string dir = Write("padded", kGood, false);
  std::filesystem::create_directories(dir + "/007");
  std::ofstream(dir + "/007/model.safetensors") << "x";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 7u);
  EXPECT_EQ(c->checkpoint_path, dir + "/007/model.safetensors");
}

// A version directory is a sharded checkpoint when it holds the index (as
// save_pretrained writes it, config.json and all); else its model.safetensors
// is the checkpoint; with neither it is not a version.
TEST_F(ModelConfigTest, AVersionDirectoryWithAnIndexIsAShardedCheckpoint) {
  namespace fs = std::filesystem;
  const std::string dir = Write("llama", kGood);  // 3/model.safetensors
  const std::string v5 = dir + "/5";
  ASSERT_TRUE(WriteSyntheticMlp(8, 16, 4, DType::kF32, 7, v5, 1, 300).ok());
  ASSERT_TRUE(fs::exists(v5 + "/model.safetensors.index.json"));
  std::ofstream(v5 + "/config.json") << "{\"architectures\": [\"LlamaForCausalLM\"]}";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 5u);
  EXPECT_EQ(c->checkpoint_path, v5);
  Result<Checkpoint> checkpoint = Checkpoint::Open(c->checkpoint_path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->tensors().size(), 4u);
  EXPECT_GT(checkpoint->shards().size(), 1u);

  // The one-file version is still the file itself.
  std::ofstream(dir + "/config.yaml")
      << std::string(kGood) + "version_policy: {specific: {versions: [3]}}\n";
  c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->checkpoint_path, dir + "/3/model.safetensors");

  // Shards without their index are no version; asking for one names what was looked for.
  fs::create_directories(dir + "/9");
  fs::copy(v5, dir + "/9");
  fs::remove(dir + "/9/model.safetensors.index.json");
  std::ofstream(dir + "/config.yaml")
      << std::string(kGood) + "version_policy: {specific: {versions: [9]}}\n";
  c = LoadModelConfig(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("version 9 has no directory holding model.safetensors, or "
                                      "model.safetensors.index.json with its shards"),
            std::string::npos)
      << c.status().message();
}

// Version directories above the one served that hold no checkpoint are
// passed over and named (highest first), for the server to say so; those
// below it are not, nor any under a version_policy.
TEST_F(ModelConfigTest, EmptyHigherVersionDirectoriesAreNamedAsPassedOver) {
  namespace fs = std::filesystem;
  const std::string dir = Write("copying", kGood);  // 3/model.safetensors
  for (const char* v : {"1", "4", "10"}) fs::create_directories(dir + "/" + v);
  std::ofstream(dir + "/4/notes.txt") << "not a checkpoint";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 3u);
  EXPECT_EQ(c->passed_over_versions, (std::vector<std::string>{"10", "4"}));
  std::ofstream(dir + "/config.yaml")
      << std::string(kGood) + "version_policy: {specific: {versions: [3]}}\n";
  c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->passed_over_versions.empty());
}

TEST_F(ModelConfigTest, WithoutACheckpointTheErrorSaysWhatWasLookedFor) {
  const std::string dir = Write("empty", kGood, false);
  auto c = LoadModelConfig(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find(dir +
                                      ": no version directory holding model.safetensors, or "
                                      "model.safetensors.index.json with its shards (expected " +
                                      dir + "/1/model.safetensors, or " + dir +
                                      "/1/model.safetensors.index.json"),
            std::string::npos)
      << c.status().message();

  std::filesystem::create_symlink("model.safetensors.index.json",
                                  dir + "/3/model.safetensors.index.json");
  c = LoadModelConfig(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("empty/3/model.safetensors.index.json: a loop of symbolic "
                                      "links"),
            std::string::npos)
      << c.status().message();
}

TEST_F(ModelConfigTest, ListingTakesLinksAndLoopsAsModelsAndSkipsFiles) {
  namespace fs = std::filesystem;
  Write("good", kGood);
  fs::create_directory_symlink("loop", tmp_.File("loop"));
  fs::create_directory_symlink("good", tmp_.File("alias"));
  std::ofstream(tmp_.File("README")) << "not a model";
  fs::create_directories(tmp_.File("bad\x01name"));
  auto dirs = ListModelDirectories(tmp_.path());
  ASSERT_TRUE(dirs.ok()) << dirs.status().ToString();
  std::vector<std::string> names;
  for (const ModelDirectory& d : *dirs) names.push_back(d.name);
  EXPECT_EQ(names, (std::vector<std::string>{"alias", "bad\\x01name", "good", "loop"}));
  EXPECT_FALSE((*dirs)[1].status.ok());
  EXPECT_NE((*dirs)[1].status.message().find("control characters"), std::string::npos);
  auto models = ScanRepository(tmp_.path());
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->size(), 4u);
  EXPECT_TRUE((*models)[0].status.ok()) << (*models)[0].status.ToString();  // alias -> good
  EXPECT_TRUE((*models)[2].status.ok());
  EXPECT_NE((*models)[3].status.message().find("a loop of symbolic links"), std::string::npos)
      << (*models)[3].status.message();
}

}  // namespace
}  // namespace hearth

namespace hearth {
namespace {

TEST_F(ModelConfigTest, BackendLlmIsADecoupledResumableGeneratorInThreeLines) {
  auto c = LoadModelConfig(Write("llama", R"(backend: llm
instance_group: [{count: 2, kind: KIND_CPU}]
parameters: {max_streams: "64"}
)"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->decoupled);
  EXPECT_TRUE(c->resumable);
  EXPECT_EQ(c->max_batch_size, 0);
  EXPECT_EQ(c->max_streams, 64);
  // A prompt or a chat: a request gives one of them.
  ASSERT_EQ(c->inputs.size(), 2u);
  EXPECT_EQ(c->inputs[0].name, "text_input");
  EXPECT_EQ(c->inputs[1].name, "messages");
  EXPECT_TRUE(c->inputs[0].optional && c->inputs[1].optional);
  std::vector<std::string> outputs;
  for (const IoConfig& o : c->outputs) outputs.push_back(o.name);
  EXPECT_EQ(outputs, (std::vector<std::string>{"text_output", "token_ids", "prompt_tokens",
                                               "completion_tokens", "finish_reason"}));

  auto batched = LoadModelConfig(Write("llama_b", "backend: llm\nmax_batch_size: 8\n"));
  ASSERT_FALSE(batched.ok());
  EXPECT_NE(batched.status().message().find("max_streams"), std::string::npos)
      << batched.status().ToString();
  auto coupled = LoadModelConfig(
      Write("llama_c", "backend: llm\nmodel_transaction_policy: {decoupled: false}\n"));
  ASSERT_FALSE(coupled.ok());
  EXPECT_NE(coupled.status().message().find("decoupled"), std::string::npos);
}

TEST_F(ModelConfigTest, OptionalInputsAreForDecoupledModels) {
  const std::string io = R"(input:
  - {name: a, data_type: TYPE_STRING, dims: [1], optional: true}
  - {name: b, data_type: TYPE_STRING, dims: [1]}
output:
  - {name: c, data_type: TYPE_STRING, dims: [1]}
)";
  auto streams = LoadModelConfig(
      Write("opt", "backend: python\nmodel_transaction_policy: {decoupled: true}\n" + io));
  ASSERT_TRUE(streams.ok()) << streams.status().ToString();
  EXPECT_TRUE(streams->inputs[0].optional);
  EXPECT_FALSE(streams->inputs[1].optional);
  auto batches = LoadModelConfig(Write("opt_b", "backend: python\n" + io));
  ASSERT_FALSE(batches.ok());
  EXPECT_NE(batches.status().message().find("input[0].optional"), std::string::npos)
      << batches.status().ToString();
  auto output = LoadModelConfig(
      Write("opt_o",
            "backend: python\nmodel_transaction_policy: {decoupled: true}\n"
            "input: [{name: a, data_type: TYPE_STRING, dims: [1]}]\n"
            "output: [{name: c, data_type: TYPE_STRING, dims: [1], optional: true}]\n"));
  ASSERT_FALSE(output.ok());
  EXPECT_NE(output.status().message().find("unknown field 'optional'"), std::string::npos)
      << output.status().ToString();
  auto word =
      LoadModelConfig(Write("opt_w",
                            "backend: python\nmodel_transaction_policy: {decoupled: true}\n"
                            "input: [{name: a, data_type: TYPE_STRING, dims: [1], optional: yes}]\n"
                            "output: [{name: c, data_type: TYPE_STRING, dims: [1]}]\n"));
  ASSERT_FALSE(word.ok());
}

// A backend: python version directory with model.py and no checkpoint is a
// model without weights; for every other backend it is no version at all.
TEST_F(ModelConfigTest, APythonVersionWithoutACheckpointHasNoWeights) {
  const std::string py = "backend: python\nmax_batch_size: 2\n";
  const std::string dir = Write("codeonly", py, false);
  std::ofstream(dir + "/3/model.py") << "class Model: pass\n";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 3u);
  EXPECT_EQ(c->version_dir, dir + "/3");
  EXPECT_EQ(c->checkpoint_path, "");
  // The highest version wins, with or without weights.
  std::filesystem::create_directories(dir + "/2");
  std::ofstream(dir + "/2/model.safetensors") << "x";
  std::filesystem::create_directories(dir + "/4");
  std::ofstream(dir + "/4/model.safetensors") << "x";
  c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->version, 4u);
  EXPECT_EQ(c->checkpoint_path, dir + "/4/model.safetensors");

  // Another backend: model.py alone is no version.
  const std::string mlp = Write("mlpcode", kGood, false);
  std::ofstream(mlp + "/3/model.py") << "class Model: pass\n";
  auto refused = LoadModelConfig(mlp);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find(": no version directory holding model.safetensors, "
                                            "or model.safetensors.index.json with its shards ("),
            std::string::npos)
      << refused.status().message();
  EXPECT_EQ(refused.status().message().find("model.py"), std::string::npos)
      << refused.status().message();

  // backend: python with neither: the error names model.py too.
  auto empty = LoadModelConfig(Write("pyempty", py, false));
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("with its shards, or model.py (expected "),
            std::string::npos)
      << empty.status().message();
  EXPECT_NE(empty.status().message().find("/1/model.py for a model without weights)"),
            std::string::npos)
      << empty.status().message();
}

}  // namespace
}  // namespace hearth
