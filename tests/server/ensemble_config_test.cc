// Ensembles (platform: ensemble): their config read from config.pbtxt and
// config.yaml, the checks of their steps as a graph, and the checks against
// the models the steps name (with a fake lookup standing for the server).
#include "server/ensemble_config.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "server/model_config.h"
#include "server/model_config_json.h"
#include "support/test_store.h"

namespace hearth {
namespace {

class EnsembleConfigTest : public ::testing::Test {
 protected:
  // DIR/<model>/ with an empty version 1 (an ensemble's).
  std::string Dir(const std::string& model) {
    const std::string dir = tmp_.File(model);
    std::filesystem::create_directories(dir + "/1");
    return dir;
  }
  Result<ModelConfig> Yaml(const std::string& text) {
    return ParseModelConfig(Dir("e" + std::to_string(models_++)), text);
  }
  void ExpectError(const std::string& text, const std::string& expect) {
    auto c = Yaml(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.status().message().find(expect), std::string::npos)
        << "got: " << c.status().message() << "\nwant: " << expect;
  }
  testing::TempDir tmp_;
  int models_ = 0;
};

// x -> pre -> (a, b) ; a -> left -> l ; b -> right -> r ; (l, r) -> join -> y
constexpr const char* kDiamond = R"(platform: ensemble
max_batch_size: 4
input: [{name: x, data_type: TYPE_FP32, dims: [4]}]
output: [{name: y, data_type: TYPE_FP32, dims: [1]}]
ensemble_scheduling:
  step:
    - model_name: pre
      model_version: -1
      input_map: {IN: x}
      output_map: {A: a, B: b}
    - model_name: left
      input_map: {IN: a}
      output_map: {OUT: l}
    - model_name: right
      input_map: {IN: b}
      output_map: {OUT: r}
    - model_name: join
      input_map: {L: l, R: r}
      output_map: {OUT: y}
)";

#ifdef HEARTH_HAVE_PROTOBUF
TEST_F(EnsembleConfigTest, PbtxtIsReadAsTritonWritesIt) {
  const std::string dir = Dir("pipeline");
  std::ofstream(dir + "/config.pbtxt") << R"(name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "LABEL" data_type: TYPE_INT64 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "preprocess"
      model_version: -1
      input_map { key: "INPUT0" value: "RAW" }
      output_map { key: "OUTPUT0" value: "features" }
    },
    {
      model_name: "classifier"
      model_version: 2
      input_map { key: "x" value: "features" }
      output_map { key: "label" value: "LABEL" }
    }
  ]
}
)";
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().message();
  ASSERT_TRUE(c->ensemble.has_value());
  EXPECT_TRUE(c->backend.empty());
  EXPECT_EQ(c->max_batch_size, 8);
  EXPECT_EQ(c->version, 1u);
  EXPECT_TRUE(c->checkpoint_path.empty());
  ASSERT_EQ(c->ensemble->size(), 2u);
  const EnsembleStep& first = (*c->ensemble)[0];
  EXPECT_EQ(first.model, "preprocess");
  EXPECT_EQ(first.version, -1);
  EXPECT_EQ(first.inputs, (std::vector<std::pair<std::string, std::string>>{{"INPUT0", "RAW"}}));
  EXPECT_EQ(first.outputs,
            (std::vector<std::pair<std::string, std::string>>{{"OUTPUT0", "features"}}));
  EXPECT_EQ((*c->ensemble)[1].version, 2);

  // Its config as Triton shows it: the platform and the steps.
  const std::string json = ModelConfigJson(*c);
  EXPECT_NE(json.find("\"platform\":\"ensemble\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"ensemble_scheduling\":{\"step\":[{\"input_map\":{\"INPUT0\":\"RAW\"}"),
            std::string::npos)
      << json;
  EXPECT_EQ(json.find("instance_group"), std::string::npos) << json;
}

TEST_F(EnsembleConfigTest, PbtxtErrorsNameThePlace) {
  const std::string dir = Dir("twice");
  std::ofstream(dir + "/config.pbtxt") << R"(platform: "ensemble"
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "m"
  input_map { key: "a" value: "x" }
  input_map { key: "a" value: "x" }
  output_map { key: "b" value: "y" } } ] }
)";
  auto c = LoadModelConfig(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("config.pbtxt:6:"), std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("is given twice"), std::string::npos) << c.status().message();
}
#endif

TEST_F(EnsembleConfigTest, YamlDiamondIsReadInOrder) {
  auto c = Yaml(kDiamond);
  ASSERT_TRUE(c.ok()) << c.status().message();
  ASSERT_EQ(c->ensemble->size(), 4u);
  EXPECT_EQ((*c->ensemble)[3].inputs,
            (std::vector<std::pair<std::string, std::string>>{{"L", "l"}, {"R", "r"}}));
}

TEST_F(EnsembleConfigTest, GraphErrorsNameTheField) {
  const std::string head = R"(platform: ensemble
input: [{name: x, data_type: TYPE_FP32, dims: [1]}]
output: [{name: y, data_type: TYPE_FP32, dims: [1]}]
ensemble_scheduling:
  step:
)";
  ExpectError(head +
                  "    - {model_name: a, input_map: {i: x}, output_map: {o: y}}\n"
                  "    - {model_name: b, input_map: {i: x}, output_map: {o: y}}\n",
              "ensemble_scheduling.step[1].output_map['o']: ensemble tensor 'y' is produced twice "
              "(also by ensemble_scheduling.step[0].output_map['o'])");
  ExpectError(head + "    - {model_name: a, input_map: {i: x}, output_map: {o: x}}\n",
              "ensemble tensor 'x' is produced twice (also by input 'x')");
  ExpectError(head + "    - {model_name: a, input_map: {i: x, j: nowhere}, output_map: {o: y}}\n",
              "ensemble_scheduling.step[0].input_map['j']: ensemble tensor 'nowhere' is never "
              "produced");
  ExpectError(head + "    - {model_name: a, input_map: {i: x}, output_map: {o: z}}\n",
              "output: 'y' is produced by no step");
  ExpectError(head +
                  "    - {model_name: a, input_map: {i: x, j: q}, output_map: {o: p}}\n"
                  "    - {model_name: b, input_map: {i: p}, output_map: {o: q}}\n"
                  "    - {model_name: c, input_map: {i: x}, output_map: {o: y}}\n",
              "ensemble_scheduling.step: steps 0 (a), 1 (b) wait on each other's outputs (a "
              "cycle)");
  ExpectError(R"(platform: ensemble
input: [{name: x, data_type: TYPE_FP32, dims: [1]}, {name: unused, data_type: TYPE_FP32, dims: [1]}]
output: [{name: y, data_type: TYPE_FP32, dims: [1]}]
ensemble_scheduling: {step: [{model_name: a, input_map: {i: x}, output_map: {o: y}}]}
)",
              "input: 'unused' is taken by no step");
  ExpectError(head + "    - {model_name: a, input_map: {i: x}}\n",
              "ensemble_scheduling.step[0].output_map: missing");
  ExpectError(head + "    - {model_name: a, input_map: {}, output_map: {o: y}}\n",
              "ensemble_scheduling.step[0].input_map: must be a non-empty map");
  ExpectError(head +
                  "    - {model_name: a, model_version: 0, input_map: {i: x}, output_map: {o: "
                  "y}}\n",
              "ensemble_scheduling.step[0].model_version: must be -1");
  ExpectError(head + "    - {model_name: a, input_map: {i: x}, output_map: {o: y}, extra: 1}\n",
              "ensemble_scheduling.step[0].extra: unknown field");
  ExpectError(std::string(kDiamond).replace(std::string(kDiamond).find("model_name: left"), 16,
                                            "model_name: e" + std::to_string(models_)),
              "names the ensemble itself (a cycle)");
}

TEST_F(EnsembleConfigTest, FieldsOfWorkersAreRefused) {
  const std::string body = R"(input: [{name: x, data_type: TYPE_FP32, dims: [1]}]
output: [{name: y, data_type: TYPE_FP32, dims: [1]}]
ensemble_scheduling: {step: [{model_name: a, input_map: {i: x}, output_map: {o: y}}]}
)";
  ExpectError("platform: ensemble\nbackend: python\n" + body,
              "backend: an ensemble has no workers");
  ExpectError("platform: ensemble\ninstance_group: [{count: 2}]\n" + body,
              "instance_group: an ensemble has no workers");
  ExpectError("platform: ensemble\ndynamic_batching: {}\n" + body, "dynamic_batching: an ensemble");
  ExpectError("backend: python\n" + body, "ensemble_scheduling: is for a model with platform");
  ExpectError("platform: onnxruntime_onnx\n" + body,
              "platform: 'onnxruntime_onnx': the only platform a config.yaml names is ensemble");
  ExpectError(
      "platform: ensemble\n"
      "input: [{name: x, data_type: TYPE_FP32, dims: [1]}]\n"
      "ensemble_scheduling: {step: [{model_name: a, input_map: {i: x}, output_map: {o: "
      "y}}]}\n",
      "output: missing");
  // An ensemble needs a version directory, as in Triton (empty).
  const std::string dir = tmp_.File("noversion");
  std::filesystem::create_directories(dir);
  auto c = ParseModelConfig(dir, "platform: ensemble\n" + body);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("no version directory"), std::string::npos)
      << c.status().message();
}

// The models of kDiamond, as the server would find them served.
class FakeRepository {
 public:
  FakeRepository() {
    Add("pre", 4, {{"IN", DType::kF32, {-1, 4}}},
        {{"A", DType::kF32, {-1, 2}}, {"B", DType::kF32, {-1, 2}}});
    Add("left", 8, {{"IN", DType::kF32, {-1, 2}}}, {{"OUT", DType::kF32, {-1, 1}}});
    Add("right", 8, {{"IN", DType::kF32, {-1, -1}}}, {{"OUT", DType::kF32, {-1, 1}}});
    Add("join", 4, {{"L", DType::kF32, {-1, 1}}, {"R", DType::kF32, {-1, 1}}},
        {{"OUT", DType::kF32, {-1, 1}}});
  }
  void Add(const std::string& name, int max_batch, std::vector<TensorMetadata> in,
           std::vector<TensorMetadata> out) {
    ComposingModel& m = models[name];
    m.metadata.name = name;
    m.metadata.versions = {"1"};
    m.metadata.max_batch_size = max_batch;
    m.metadata.inputs = std::move(in);
    m.metadata.outputs = std::move(out);
  }
  FindComposingModel Finder() const {
    return [this](const std::string& model) -> Result<ComposingModel> {
      auto it = models.find(model);
      if (it == models.end()) return NotFound("the repository has no such model");
      return it->second;
    };
  }
  std::map<std::string, ComposingModel> models;
};

TEST_F(EnsembleConfigTest, StepsAgreeingWithTheirModelsPass) {
  auto c = Yaml(kDiamond);
  ASSERT_TRUE(c.ok()) << c.status().message();
  FakeRepository repo;
  repo.models["join"].reaches = {"inner"};  // join is an ensemble of its own
  auto reaches = CheckEnsembleSteps(*c, repo.Finder());
  ASSERT_TRUE(reaches.ok()) << reaches.status().message();
  EXPECT_EQ(*reaches, (std::vector<std::string>{"inner", "join", "left", "pre", "right"}));
}

TEST_F(EnsembleConfigTest, StepsDisagreeingWithTheirModelsAreErrorsNamingTheField) {
  auto c = Yaml(kDiamond);
  ASSERT_TRUE(c.ok()) << c.status().message();
  struct Case {
    std::function<void(FakeRepository&)> change;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](FakeRepository& r) { r.models.erase("left"); },
       "ensemble_scheduling.step[1].model_name: model 'left': the repository has no such model"},
      {[](FakeRepository& r) { r.models["left"].metadata.inputs[0].name = "INPUT"; },
       "ensemble_scheduling.step[1].input_map['IN']: model 'left' has no input 'IN'"},
      {[](FakeRepository& r) { r.models["right"].metadata.outputs[0].name = "O"; },
       "ensemble_scheduling.step[2].output_map['OUT']: model 'right' has no output 'OUT'"},
      {[](FakeRepository& r) { r.models["pre"].metadata.inputs[0].dtype = DType::kI64; },
       "ensemble_scheduling.step[0].input_map['IN']: model 'pre''s input 'IN' is TYPE_INT64 but "
       "the ensemble's input 'x' is TYPE_FP32"},
      {[](FakeRepository& r) {
         r.models["left"].metadata.inputs[0].shape = {-1, 3};
       },
       "ensemble_scheduling.step[1].input_map['IN']: model 'left''s input 'IN' has shape [-1, 3] "
       "but model 'pre''s output 'A' (step 0) has shape [-1, 2]"},
      {[](FakeRepository& r) {
         r.models["join"].metadata.outputs[0].shape = {-1, 2};
       },
       "ensemble_scheduling.step[3].output_map['OUT']: model 'join''s output 'OUT' has shape "
       "[-1, 2] but the ensemble's output 'y' has shape [-1, 1]"},
      {[](FakeRepository& r) { r.models["left"].metadata.decoupled = true; },
       "ensemble_scheduling.step[1].model_name: model 'left' is decoupled"},
      {[](FakeRepository& r) { r.models["right"].metadata.sequence = true; },
       "ensemble_scheduling.step[2].model_name: model 'right' serves sequences"},
      {[](FakeRepository& r) { r.models["join"].metadata.max_batch_size = 2; },
       "model 'join' batches at most 2 rows, fewer than the ensemble's max_batch_size 4"},
      {[](FakeRepository& r) {
         r.models["join"].metadata.inputs.push_back({"EXTRA", DType::kF32, {-1, 1}});
       },
       "ensemble_scheduling.step[3].input_map: model 'join''s input 'EXTRA' is not mapped"},
      {[](FakeRepository& r) { r.models["pre"].metadata.versions = {"3"}; }, ""},
      {[name = c->name](FakeRepository& r) { r.models["join"].reaches = {name}; },
       "ensemble_scheduling.step[3].model_name: model 'join' is an ensemble whose steps reach "
       "this one (a cycle)"},
  };
  for (const Case& k : cases) {
    FakeRepository repo;
    k.change(repo);
    auto reaches = CheckEnsembleSteps(*c, repo.Finder());
    if (k.expect.empty()) {  // model_version -1 takes whichever version is served
      EXPECT_TRUE(reaches.ok()) << reaches.status().message();
      continue;
    }
    ASSERT_FALSE(reaches.ok()) << k.expect;
    EXPECT_NE(reaches.status().message().find(k.expect), std::string::npos)
        << "got: " << reaches.status().message() << "\nwant: " << k.expect;
  }
  // A step naming a version other than the served one.
  auto pinned = Yaml(std::string(kDiamond).replace(std::string(kDiamond).find("model_version: -1"),
                                                   17, "model_version: 2"));
  ASSERT_TRUE(pinned.ok()) << pinned.status().message();
  auto reaches = CheckEnsembleSteps(*pinned, FakeRepository().Finder());
  ASSERT_FALSE(reaches.ok());
  EXPECT_NE(reaches.status().message().find("ensemble_scheduling.step[0].model_version: version 2 "
                                            "of model 'pre' is not served (it serves version 1"),
            std::string::npos)
      << reaches.status().message();
}

}  // namespace
}  // namespace hearth
