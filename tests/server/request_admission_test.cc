// KServe's rules for a request's parameters, as the service applies them to
// what either front-end hands on.
#include "server/request_admission.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace hearth {
namespace {

InferRequest WithParameters(Parameters parameters) {
  InferRequest request;
  request.model = "scale";
  request.parameters = std::move(parameters);
  return request;
}

void ExpectRefused(InferRequest request, const std::string& says) {
  const Status s = AdmitParameters(request);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(says), std::string::npos) << s.message();
}

TEST(RequestAdmission, TimeoutAndPriorityAreCountsOfEitherKind) {
  InferRequest request = WithParameters(
      {{"timeout", int64_t{2500}}, {"priority", uint64_t{2}}, {"sequence_id", int64_t{0}}});
  ASSERT_TRUE(AdmitParameters(request).ok());
  EXPECT_EQ(request.timeout_us, 2500u);
  EXPECT_EQ(request.priority, 2u);
  EXPECT_TRUE(request.parameters_json.empty());
  EXPECT_TRUE(request.parameters.empty());  // applied

  InferRequest largest = WithParameters({{"timeout", std::numeric_limits<uint64_t>::max()}});
  ASSERT_TRUE(AdmitParameters(largest).ok());
  EXPECT_EQ(largest.timeout_us, std::numeric_limits<uint64_t>::max());

  ExpectRefused(WithParameters({{"timeout", int64_t{-5}}}),
                "parameter 'timeout' must be a non-negative integer of microseconds, got -5");
  ExpectRefused(WithParameters({{"timeout", std::string("soon")}}), "got \"soon\"");
  ExpectRefused(WithParameters({{"timeout", JsonText{"1.5"}}}), "got 1.5");
  ExpectRefused(WithParameters({{"timeout", JsonText{"18446744073709551616"}}}),
                "below 2^64, got 18446744073709551616");
  ExpectRefused(WithParameters({{"priority", 0.5}}),
                "parameter 'priority' must be a non-negative integer");
  ExpectRefused(WithParameters({{"priority", true}}), "got true");
}

TEST(RequestAdmission, SequenceParametersAreReadAndCheckedAgainstTheModel) {
  for (const Parameter& unset :
       {Parameter{"sequence_id", int64_t{0}}, Parameter{"sequence_start", false},
        Parameter{"sequence_end", std::string()}, Parameter{"sequence_id", JsonText{"null"}},
        Parameter{"sequence_id", 0.0}, Parameter{"sequence_end", std::monostate{}},
        Parameter{"sequence_id", std::string()}}) {
    InferRequest request = WithParameters({unset});
    EXPECT_TRUE(AdmitParameters(request).ok()) << unset.name << " " << DescribeParameter(unset);
    EXPECT_TRUE(request.sequence_id.empty());
    EXPECT_FALSE(request.sequence_start || request.sequence_end);
  }
  InferRequest numbered = WithParameters({{"sequence_id", uint64_t{5}}, {"sequence_start", true}});
  ASSERT_TRUE(AdmitParameters(numbered).ok());
  EXPECT_EQ(numbered.sequence_id, "5");
  EXPECT_EQ(numbered.sequence_number, 5u);
  EXPECT_FALSE(numbered.sequence_id_is_string);
  EXPECT_TRUE(numbered.sequence_start);
  EXPECT_FALSE(numbered.sequence_end);
  EXPECT_TRUE(numbered.parameters_json.empty()) << "the model does not get them as parameters";
  InferRequest named =
      WithParameters({{"sequence_id", std::string("abc")}, {"sequence_end", true}});
  ASSERT_TRUE(AdmitParameters(named).ok());
  EXPECT_EQ(named.sequence_id, "abc");
  EXPECT_TRUE(named.sequence_id_is_string);
  EXPECT_TRUE(named.sequence_end);
  ExpectRefused(WithParameters({{"sequence_end", JsonText{"[1]"}}}),
                "parameter \"sequence_end\" must be true or false, got [1]");
  ExpectRefused(WithParameters({{"sequence_id", int64_t{-3}}}),
                "'sequence_id' must be a non-negative integer or a string, got -3");
  ExpectRefused(WithParameters({{"sequence_id", std::string(300, 'x')}}), "over the limit of 256");

  // Against the model: a model without sequence_batching refuses them; one
  // with it needs a sequence id.
  ModelMetadata plain;
  plain.name = "plain";
  InferRequest stray = WithParameters({{"sequence_start", true}});
  ASSERT_TRUE(AdmitParameters(stray).ok());
  Status refused = ValidateInferRequest(stray, plain);
  EXPECT_NE(refused.message().find("has no sequence_batching"), std::string::npos)
      << refused.message();
  EXPECT_NE(refused.message().find("this one sets sequence_start"), std::string::npos);
  ModelMetadata sequenced = plain;
  sequenced.sequence = true;
  InferRequest bare = WithParameters({});
  Status unnamed = ValidateInferRequest(bare, sequenced);
  EXPECT_NE(unnamed.message().find("must specify a non-zero or non-empty correlation ID"),
            std::string::npos)
      << unnamed.message();
  EXPECT_TRUE(ValidateInferRequest(numbered, sequenced).ok());
}

TEST(RequestAdmission, TheModelGetsEveryOtherParameterAsJson) {
  InferRequest request = WithParameters({{"temperature", 0.5},
                                         {"stop", JsonText{R"(["\n", "]"])"}},
                                         {"tag", std::string("a\"b")},
                                         {"n", int64_t{-3}},
                                         {"seed", uint64_t{9223372036854775808u}},
                                         {"echo", true},
                                         {"timeout", int64_t{7}}});
  ASSERT_TRUE(AdmitParameters(request).ok());
  EXPECT_EQ(request.parameters_json, R"({"temperature":0.5,"stop":["\n", "]"],"tag":"a\"b","n":-3,)"
                                     R"("seed":9223372036854775808,"echo":true})");
  EXPECT_EQ(request.timeout_us, 7u);
  // Admitted again (a request handed to a model's new runtime): unchanged.
  ASSERT_TRUE(AdmitParameters(request).ok());
  EXPECT_EQ(request.timeout_us, 7u);
  EXPECT_NE(request.parameters_json.find("temperature"), std::string::npos);

  ExpectRefused(WithParameters({{"temperature", std::numeric_limits<double>::quiet_NaN()}}),
                "request: parameter \"temperature\" must be a finite number");
  ExpectRefused(WithParameters({{"empty", std::monostate{}}}),
                "request: parameter \"empty\" has no value");
  // A front-end that set the model's parameters as text has none left here.
  InferRequest both = WithParameters({{"k", int64_t{1}}});
  both.parameters_json = R"({"k":1})";
  EXPECT_EQ(AdmitParameters(both).code(), StatusCode::kInternal);
}

InferRequest WithInput(Parameters parameters, DType dtype = DType::kF32) {
  InferRequest request;
  InferTensor x("x", dtype, {2, 4});
  x.parameters = std::move(parameters);
  request.inputs.push_back(std::move(x));
  return request;
}

TEST(RequestAdmission, SharedMemoryTriplesAreCheckedAndSet) {
  InferRequest request = WithInput({{"shared_memory_region", std::string("in")},
                                    {"shared_memory_offset", int64_t{16}},
                                    {"shared_memory_byte_size", uint64_t{32}}});
  EXPECT_EQ(SharedMemoryInputBytes(request), 32u);
  ASSERT_TRUE(AdmitParameters(request).ok());
  ASSERT_TRUE(request.inputs[0].shm.has_value());
  EXPECT_EQ(request.inputs[0].shm->region, "in");
  EXPECT_EQ(request.inputs[0].shm->offset, 16u);
  EXPECT_EQ(request.inputs[0].shm->byte_size, 32u);
  // The offset defaults to 0; BYTES sizes are checked once read.
  InferRequest text = WithInput(
      {{"shared_memory_region", std::string("in")}, {"shared_memory_byte_size", int64_t{5}}},
      DType::kBytes);
  ASSERT_TRUE(AdmitParameters(text).ok());
  EXPECT_EQ(text.inputs[0].shm->offset, 0u);

  ExpectRefused(WithInput({{"shared_memory_region", std::string("in")},
                           {"shared_memory_byte_size", int64_t{31}}}),
                "input \"x\": shared_memory_byte_size is 31 but shape [2,4] of FP32 needs 32");
  ExpectRefused(WithInput({{"shared_memory_region", std::string("in")}}),
                "parameter 'shared_memory_byte_size' must be given with 'shared_memory_region'");
  ExpectRefused(WithInput({{"shared_memory_offset", int64_t{0}}}),
                "need 'shared_memory_region', the region they lie in");
  ExpectRefused(
      WithInput({{"shared_memory_region", int64_t{7}}, {"shared_memory_byte_size", int64_t{32}}}),
      "parameter 'shared_memory_region' must be a string naming a registered region");
  ExpectRefused(WithInput({{"shared_memory_region", std::string("in")},
                           {"shared_memory_byte_size", int64_t{-32}}}),
                "parameter 'shared_memory_byte_size' must be a non-negative integer");
  InferRequest twice = WithInput(
      {{"shared_memory_region", std::string("in")}, {"shared_memory_byte_size", int64_t{32}}});
  twice.inputs[0].data = std::vector<std::byte>(32);
  ExpectRefused(std::move(twice), "is in shared memory and has data too; give it once");
}

TEST(RequestAdmission, OutputsTakeClassificationAndRegions) {
  InferRequest request;
  RequestedOutput y("y", true);
  y.parameters = {{"classification", int64_t{3}}, {"binary_data_size", int64_t{1}}};
  RequestedOutput z("z", true);
  z.parameters = {{"shared_memory_region", std::string("out")},
                  {"shared_memory_byte_size", int64_t{8}}};
  request.outputs = {y, z};
  ASSERT_TRUE(AdmitParameters(request).ok());
  EXPECT_EQ(request.outputs[0].class_count, 3u);
  EXPECT_FALSE(request.outputs[0].shm.has_value());
  ASSERT_TRUE(request.outputs[1].shm.has_value());
  EXPECT_EQ(request.outputs[1].shm->byte_size, 8u);

  for (const Parameter& bad :
       {Parameter{"classification", int64_t{0}}, Parameter{"classification", uint64_t{1} << 32},
        Parameter{"classification", std::string("3")}}) {
    InferRequest r;
    r.outputs.emplace_back("y", true).parameters = {bad};
    ExpectRefused(std::move(r),
                  "output \"y\": parameter 'classification' must be an integer in [1, "
                  "4294967295]");
  }
  InferRequest misnamed;
  misnamed.outputs.emplace_back("y", true).parameters = {{"class_count", int64_t{2}}};
  ExpectRefused(std::move(misnamed), "there is no parameter 'class_count'");
}

TEST(RequestAdmission, AdmitInferRequestChecksTheModelToo) {
  ModelMetadata scale;
  scale.name = "scale";
  scale.max_batch_size = 8;
  scale.inputs = {{"x", DType::kF32, {-1, 4}}};
  scale.outputs = {{"y", DType::kF32, {-1, 1}}};
  InferRequest request = WithInput({});
  request.parameters = {{"priority", int64_t{1}}};
  ASSERT_TRUE(AdmitInferRequest(request, scale).ok());
  EXPECT_EQ(request.priority, 1u);
  InferRequest wrong = WithInput({}, DType::kI32);
  const Status s = AdmitInferRequest(wrong, scale);
  EXPECT_NE(s.message().find("datatype INT32 does not match the model's FP32"), std::string::npos)
      << s.message();
}

}  // namespace
}  // namespace hearth
