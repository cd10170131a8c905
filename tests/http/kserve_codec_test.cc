// The KServe codec without sockets: parsing (JSON, nested, binary extension),
// validation against metadata, response encoding, and every error message.
#include "http/kserve_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "common/float16.h"
#include "server/request_admission.h"

namespace hearth {
namespace {

using json = nlohmann::json;

template <typename T>
std::vector<T> Values(const InferTensor& tensor) {
  std::vector<T> out(tensor.data.size() / sizeof(T));
  std::memcpy(out.data(), tensor.data.data(), tensor.data.size());
  return out;
}

template <typename T>
std::vector<std::byte> Bytes(const std::vector<T>& values) {
  std::vector<std::byte> out(values.size() * sizeof(T));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

template <typename T>
std::string RawString(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// The request as the service takes it: parsed, then its parameters applied
// (server/request_admission.h).
Result<InferRequest> Admitted(Result<InferRequest> parsed) {
  if (!parsed.ok()) return parsed;
  if (Status s = AdmitParameters(*parsed); !s.ok()) return s;
  return parsed;
}

Result<InferRequest> Parse(const std::string& body) {
  return Admitted(ParseInferRequest(body, std::nullopt, "scale", ""));
}

// Expects an InvalidArgument whose message contains every `needle`.
void ExpectError(const Status& status, std::initializer_list<std::string> needles) {
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  for (const std::string& needle : needles) {
    EXPECT_NE(status.message().find(needle), std::string::npos)
        << "'" << status.message() << "' lacks '" << needle << "'";
  }
}

void ExpectParseError(const std::string& body, std::initializer_list<std::string> needles) {
  SCOPED_TRACE(body);
  ExpectError(Parse(body).status(), needles);
}

ModelMetadata ScaleModel() {
  ModelMetadata m;
  m.name = "scale";
  m.versions = {"1"};
  m.platform = "hearth_scale";
  m.max_batch_size = 8;
  m.inputs = {{"x", DType::kF32, {-1, 4}}, {"mask", DType::kBool, {-1, 2}}};
  m.outputs = {{"y", DType::kF32, {-1, 1}}, {"argmax", DType::kI64, {-1, 1}}};
  return m;
}

ModelMetadata FixedModel() {
  ModelMetadata m;
  m.name = "fixed";
  m.versions = {"3"};
  m.platform = "hearth_mlp";
  m.max_batch_size = 0;
  m.inputs = {{"a", DType::kI32, {2, 3}}};
  m.outputs = {{"b", DType::kI32, {2, 3}}};
  return m;
}

TEST(KserveDatatype, NamesRoundTrip) {
  const std::vector<std::pair<DType, std::string>> names = {
      {DType::kBool, "BOOL"},  {DType::kU8, "UINT8"},    {DType::kI8, "INT8"},
      {DType::kI16, "INT16"},  {DType::kI32, "INT32"},   {DType::kI64, "INT64"},
      {DType::kF16, "FP16"},   {DType::kBF16, "BF16"},   {DType::kF32, "FP32"},
      {DType::kF64, "FP64"},   {DType::kBytes, "BYTES"}, {DType::kU16, "UINT16"},
      {DType::kU32, "UINT32"}, {DType::kU64, "UINT64"}};
  for (const auto& [dtype, name] : names) {
    EXPECT_EQ(KserveDatatypeName(dtype), name);
    EXPECT_EQ(ParseKserveDatatype(name), dtype);
  }
  EXPECT_EQ(KserveDatatypeName(DType::kF8E4M3), "");
  EXPECT_EQ(KserveDatatypeName(DType::kF8E5M2), "");
  EXPECT_EQ(ParseKserveDatatype("F32"), std::nullopt);
  EXPECT_EQ(ParseKserveDatatype("fp32"), std::nullopt);
}

TEST(KserveCodec, ParsesFlatJson) {
  Result<InferRequest> r = Admitted(ParseInferRequest(
      R"({"id":"req-1","parameters":{"timeout":1500,"binary_data_output":true},
          "inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":[1,2.5,-3,4e3]},
                    {"name":"m","datatype":"BOOL","shape":[2],"data":[true,false]},
                    {"name":"i","datatype":"INT64","shape":[1],"data":[-9007199254740993]},
                    {"name":"u","datatype":"UINT8","shape":[2],"data":[0,255]}],
          "outputs":[{"name":"y"},{"name":"z","parameters":{"binary_data":false}}]})",
      std::nullopt, "scale", "2"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "scale");
  EXPECT_EQ(r->version, "2");
  EXPECT_EQ(r->id, "req-1");
  EXPECT_EQ(r->timeout_us, 1500u);
  EXPECT_TRUE(r->binary_data_output);
  ASSERT_EQ(r->inputs.size(), 4u);
  EXPECT_EQ(r->inputs[0].dtype, DType::kF32);
  EXPECT_EQ(r->inputs[0].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(Values<float>(r->inputs[0]), (std::vector<float>{1, 2.5f, -3, 4000}));
  EXPECT_EQ(Values<uint8_t>(r->inputs[1]), (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(Values<int64_t>(r->inputs[2]), (std::vector<int64_t>{-9007199254740993}));
  EXPECT_EQ(Values<uint8_t>(r->inputs[3]), (std::vector<uint8_t>{0, 255}));
  ASSERT_EQ(r->outputs.size(), 2u);
  EXPECT_EQ(r->outputs[0].name, "y");
  EXPECT_TRUE(r->outputs[0].binary);  // inherits binary_data_output
  EXPECT_FALSE(r->outputs[1].binary);
}

TEST(KserveCodec, ParsesNestedJsonAndHalfTypes) {
  Result<InferRequest> r = Parse(
      R"({"inputs":[{"name":"x","datatype":"FP16","shape":[2,3],"data":[[1,2,3],[4,5,0.5]]},
                    {"name":"b","datatype":"BF16","shape":[1,1,2],"data":[[[1.5,-2]]]},
                    {"name":"d","datatype":"FP64","shape":[2],"data":[0.1,1e300]},
                    {"name":"s","datatype":"INT16","shape":[3],"data":[-32768,0,32767]},
                    {"name":"e","datatype":"INT8","shape":[0],"data":[]}]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  std::vector<float> halves;
  for (uint16_t h : Values<uint16_t>(r->inputs[0])) halves.push_back(HalfToFloat(h));
  EXPECT_EQ(halves, (std::vector<float>{1, 2, 3, 4, 5, 0.5f}));
  std::vector<float> bf;
  for (uint16_t h : Values<uint16_t>(r->inputs[1])) bf.push_back(BFloat16ToFloat(h));
  EXPECT_EQ(bf, (std::vector<float>{1.5f, -2}));
  EXPECT_EQ(Values<double>(r->inputs[2]), (std::vector<double>{0.1, 1e300}));
  EXPECT_EQ(Values<int16_t>(r->inputs[3]), (std::vector<int16_t>{-32768, 0, 32767}));
  EXPECT_TRUE(r->inputs[4].data.empty());
  EXPECT_TRUE(r->outputs.empty());
  EXPECT_FALSE(r->binary_data_output);
}

TEST(KserveCodec, UnsignedTypesTakeTheirWholeRange) {
  Result<InferRequest> r = Parse(
      R"({"inputs":[{"name":"a","datatype":"UINT16","shape":[2],"data":[0,65535]},
                    {"name":"b","datatype":"UINT32","shape":[2],"data":[1,4294967295]},
                    {"name":"c","datatype":"UINT64","shape":[3],
                     "data":[0,9223372036854775808,18446744073709551615]}]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->inputs[0].dtype, DType::kU16);
  EXPECT_EQ(Values<uint16_t>(r->inputs[0]), (std::vector<uint16_t>{0, 65535}));
  EXPECT_EQ(Values<uint32_t>(r->inputs[1]), (std::vector<uint32_t>{1, 4294967295u}));
  EXPECT_EQ(Values<uint64_t>(r->inputs[2]),
            (std::vector<uint64_t>{0, 1ull << 63, std::numeric_limits<uint64_t>::max()}));

  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"UINT16","shape":[1],"data":[65536]}]})",
                   {"input \"x\"", "out of range for UINT16"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"UINT32","shape":[1],"data":[-1]}]})",
                   {"input \"x\"", "out of range for UINT32"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"UINT64","shape":[1],"data":[18446744073709551616]}]})",
      {"input \"x\"", "out of range for UINT64"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"UINT64","shape":[1],"data":[-1]}]})",
                   {"input \"x\"", "out of range for UINT64"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"UINT64","shape":[1],"data":[1.5]}]})",
                   {"input \"x\"", "UINT64 needs integers"});

  InferResponse response;
  response.model = "scale";
  response.version = "1";
  InferTensor a("a", DType::kU16, {1});
  a.data = Bytes(std::vector<uint16_t>{65535});
  InferTensor b("b", DType::kU32, {1});
  b.data = Bytes(std::vector<uint32_t>{4294967295u});
  InferTensor c("c", DType::kU64, {2});
  c.data = Bytes(std::vector<uint64_t>{0, std::numeric_limits<uint64_t>::max()});
  response.outputs = {a, b, c};
  Result<EncodedInferResponse> encoded = EncodeInferResponse(response, {});
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  const json j = json::parse(encoded->body);
  EXPECT_EQ(j["outputs"][0]["datatype"], "UINT16");
  EXPECT_EQ(j["outputs"][0]["data"], json::parse("[65535]"));
  EXPECT_EQ(j["outputs"][1]["datatype"], "UINT32");
  EXPECT_EQ(j["outputs"][1]["data"], json::parse("[4294967295]"));
  EXPECT_EQ(j["outputs"][2]["datatype"], "UINT64");
  EXPECT_EQ(j["outputs"][2]["data"][1].get<uint64_t>(), std::numeric_limits<uint64_t>::max());
}

TEST(KserveCodec, DataErrorsNameTheInput) {
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"UINT8","shape":[1],"data":[256]}]})",
                   {"input \"x\"", "256", "out of range for UINT8"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"UINT8","shape":[1],"data":[-1]}]})",
                   {"input \"x\"", "out of range for UINT8"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"INT8","shape":[2],"data":[1,-129]}]})",
                   {"input \"x\"", "element 1", "out of range for INT8"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"INT64","shape":[1],"data":[9223372036854775808]}]})",
      {"input \"x\"", "out of range for INT64"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[1.5]}]})",
                   {"input \"x\"", "not an integer", "INT32"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"INT32","shape":[1],"data":[true]}]})",
                   {"input \"x\"", "not an integer"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[true]}]})",
                   {"input \"x\"", "not a number", "FP32"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":["1"]}]})",
                   {"input \"x\"", "not a number"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1e39]}]})",
                   {"input \"x\"", "out of range for FP32"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP16","shape":[1],"data":[70000]}]})",
                   {"input \"x\"", "out of range for FP16"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"BOOL","shape":[1],"data":[1]}]})",
                   {"input \"x\"", "not a boolean"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":[1,2,3]}]})",
                   {"input \"x\"", "3 elements", "[2,2]", "needs 4"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":[[1,2],[3]]}]})",
      {"input \"x\"", "nested data does not match shape [2,2]", "rectangular"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":[[1,2,3],[4,5,6]]}]})",
      {"input \"x\"", "does not match shape [2,2]"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[[[1],[2]]]}]})",
      {"input \"x\"", "deeper than the shape"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[[1],2]}]})",
                   {"input \"x\""});
}

TEST(KserveCodec, StructureErrors) {
  ExpectParseError("{", {"invalid JSON"});
  ExpectParseError("", {"invalid JSON"});
  ExpectParseError("[1,2]", {"must be a JSON object"});
  ExpectParseError("{}", {"'inputs' array"});
  ExpectParseError(R"({"inputs":{}})", {"'inputs' array"});
  ExpectParseError(R"({"id":5,"inputs":[]})", {"'id' must be a string"});
  ExpectParseError(R"({"inputs":[5]})", {"input #0 must be an object"});
  ExpectParseError(R"({"inputs":[{"datatype":"FP32","shape":[1],"data":[1]}]})",
                   {"input #0", "'name'"});
  ExpectParseError(R"({"inputs":[{"name":"x","shape":[1],"data":[1]}]})",
                   {"input \"x\"", "'datatype'"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"STRING","shape":[1],"data":["a"]}]})",
                   {"input \"x\"", "unsupported datatype \"STRING\""});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[-1],"data":[1]}]})",
                   {"input \"x\"", "non-negative"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":"2","data":[1]}]})",
                   {"input \"x\"", "'shape'"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[4294967296,4294967296],"data":[]}]})",
      {"input \"x\"", "more than 2^63 elements"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1]}]})",
                   {"input \"x\"", "no 'data'"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":1}]})",
                   {"input \"x\"", "'data' must be an array"});
  ExpectParseError(R"({"parameters":{"timeout":-5},"inputs":[]})", {"'timeout'"});
  ExpectParseError(R"({"parameters":{"binary_data_output":1},"inputs":[]})",
                   {"'binary_data_output' must be a boolean"});
  ExpectParseError(R"({"parameters":[],"inputs":[]})", {"'parameters' must be an object"});
  ExpectParseError(R"({"inputs":[],"outputs":[{"parameters":{}}]})", {"output #0", "'name'"});
  ExpectParseError(R"({"inputs":[],"outputs":[{"name":"y","parameters":{"binary_data":"yes"}}]})",
                   {"output \"y\"", "'binary_data' must be a boolean"});
  std::string deep(100000, '[');
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":)" + deep,
                   {"invalid JSON"});
  std::string many_dims = "[";
  for (int i = 0; i < 40; ++i) many_dims += i == 0 ? "1" : ",1";
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":)" + many_dims + R"(],"data":[1]}]})",
      {"input \"x\"", "40 dimensions"});
}

TEST(KserveCodec, BinaryExtensionWithMixedInputs) {
  const std::vector<float> x = {1.5f, -2, 3, 4};
  const std::vector<int32_t> k = {7, -8};
  const std::string header =
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"parameters":{"binary_data_size":16}},
                    {"name":"j","datatype":"INT64","shape":[2],"data":[5,6]},
                    {"name":"k","datatype":"INT32","shape":[2],"parameters":{"binary_data_size":8}}],
          "outputs":[{"name":"y","parameters":{"binary_data":true}}]})";
  const std::string body = header + RawString(x) + RawString(k);
  Result<InferRequest> r = ParseInferRequest(body, header.size(), "scale", "");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->inputs.size(), 3u);
  EXPECT_EQ(Values<float>(r->inputs[0]), x);
  EXPECT_EQ(Values<int64_t>(r->inputs[1]), (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(Values<int32_t>(r->inputs[2]), k);
  ASSERT_EQ(r->outputs.size(), 1u);
  EXPECT_TRUE(r->outputs[0].binary);

  // One byte too many, one too few, a part whose size does not fit its shape,
  // binary sizes without the header, a header past the body.
  ExpectError(ParseInferRequest(body + "x", header.size(), "scale", "").status(),
              {"binary sizes do not add up", "inputs declare 24", "25"});
  ExpectError(
      ParseInferRequest(body.substr(0, body.size() - 1), header.size(), "scale", "").status(),
      {"binary sizes do not add up", "23"});
  std::string wrong = header;
  wrong.replace(wrong.find("\"binary_data_size\":16"), 21, "\"binary_data_size\":12");
  ExpectError(ParseInferRequest(wrong + RawString(x).substr(0, 12) + RawString(k), wrong.size(),
                                "scale", "")
                  .status(),
              {"binary sizes do not add up", "input \"x\" declares 12 bytes", "needs 16"});
  ExpectError(ParseInferRequest(header, std::nullopt, "scale", "").status(),
              {"binary sizes do not add up", "no Inference-Header-Content-Length"});
  ExpectError(ParseInferRequest(body, body.size() + 1, "scale", "").status(),
              {"Inference-Header-Content-Length", "exceeds"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1],"parameters":{"binary_data_size":4}}]})",
      {"input \"x\"", "both 'data'"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":-4}}]})",
      {"input \"x\"", "'binary_data_size'"});
}

TEST(KserveCodec, SizesThatOverflowAreRefusedNamingTheTensor) {
  // 2^61 + 1 INT64 elements are 2^64 + 8 bytes: 8 once wrapped to 64 bits.
  const std::string wraps =
      R"({"inputs":[{"name":"big","datatype":"INT64","shape":[2305843009213693953],)"
      R"("parameters":{"binary_data_size":8}}]})";
  ExpectError(ParseInferRequest(wraps + std::string(8, '\0'), wraps.size(), "scale", "").status(),
              {"input \"big\"", "[2305843009213693953] of INT64", "more than 2^63 bytes"});
  // The same across dimensions, and for a smaller type.
  const std::string wraps_2d =
      R"({"inputs":[{"name":"m","datatype":"FP32","shape":[4294967296,1073741824],)"
      R"("parameters":{"binary_data_size":0}}]})";
  ExpectError(ParseInferRequest(wraps_2d, wraps_2d.size(), "scale", "").status(),
              {"input \"m\"", "of FP32", "more than 2^63 bytes"});
  // Elements past 2^63, with JSON data.
  ExpectParseError(
      R"({"inputs":[{"name":"e","datatype":"UINT8","shape":[4294967296,4294967296,2],"data":[1]}]})",
      {"input \"e\"", "more than 2^63 elements"});
  // A JSON shape the text cannot fill is reported, not allocated.
  ExpectParseError(
      R"({"inputs":[{"name":"j","datatype":"INT64","shape":[2305843009213693953],"data":[1]}]})",
      {"input \"j\"", "'data' has 1 elements", "needs 2305843009213693953"});
  // Four binary inputs of 2^62 bytes each: each matches its shape, and their
  // sum is 2^64, which wrapped to the 0 bytes that follow the JSON.
  std::string four = R"({"inputs":[)";
  for (int i = 0; i < 4; ++i) {
    four += std::string(i > 0 ? "," : "") + R"({"name":"p)" + std::to_string(i) +
            R"(","datatype":"UINT8","shape":[4611686018427387904],)"
            R"("parameters":{"binary_data_size":4611686018427387904}})";
  }
  four += "]}";
  ExpectError(ParseInferRequest(four, four.size(), "scale", "").status(),
              {"binary sizes do not add up", "more than 2^64 bytes"});

  // A response whose output shape wraps is the service's fault: Internal,
  // naming the output, never a body sized from the wrapped value.
  InferResponse response;
  response.model = "scale";
  InferTensor out;
  out.name = "huge";
  out.dtype = DType::kI64;
  out.shape = {2305843009213693953};
  out.data = Bytes(std::vector<int64_t>{1});
  response.outputs.push_back(std::move(out));
  Result<EncodedInferResponse> encoded = EncodeInferResponse(response, {});
  EXPECT_EQ(encoded.status().code(), StatusCode::kInternal);
  EXPECT_NE(encoded.status().message().find("output \"huge\""), std::string::npos)
      << encoded.status().ToString();
}

TEST(KserveCodec, TimeoutParameterIsACountOfMicroseconds) {
  auto timeout = [](const std::string& value) {
    return Admitted(ParseInferRequest(R"({"parameters":{"timeout":)" + value + R"(},"inputs":[]})",
                                      std::nullopt, "scale", ""));
  };
  // Any uint64 is kept as given, the largest too: the server saturates.
  EXPECT_EQ(timeout("0")->timeout_us, 0u);
  EXPECT_EQ(timeout("2500")->timeout_us, 2500u);
  EXPECT_EQ(timeout("9223372036854775808")->timeout_us, uint64_t{1} << 63);
  EXPECT_EQ(timeout("18446744073709551615")->timeout_us, ~uint64_t{0});
  for (const char* bad : {"-5", "1.5", "1e6", "\"100\"", "true", "null", "[1]", "-0.0"}) {
    SCOPED_TRACE(bad);
    ExpectError(timeout(bad).status(),
                {"'timeout' must be a non-negative integer of microseconds", "got"});
  }
  ExpectError(timeout("-5").status(), {"got -5"});
  ExpectError(timeout("18446744073709551616").status(), {"below 2^64", "got 18446744073709551616"});
}

TEST(KserveCodec, BinaryDataAfterTheJsonIsNeverReadAsJson) {
  // The binary part serves as the JSON parser's padding. Whatever its bytes
  // (here: the rest of a request, brackets, digits), a JSON part cut short is
  // malformed, and nothing past it is parsed. (Before the padding was made
  // whitespace, simdjson read uninitialised memory on these: a crash under
  // HEARTH_SANITIZE, and whatever that memory held otherwise.)
  const std::string tails[] = {
      R"([1,4],"parameters":{"binary_data_size":0}}]})" + std::string(64, ' '),
      std::string(100, '['),
      std::string(100, '{'),
      "345678901234567890}]}" + std::string(64, '0'),
      "\"}]}" + std::string(64, '"'),
      "}" + std::string(70, ' '),  // would close `{"inputs":[]`
      "]}" + std::string(70, '}'),
      "[1,4]",  // shorter than the padding: spaces are appended after it
      std::string("[1,4],\"pa\0@@\0\0\x80@", 16),  // what the fuzzer found
  };
  const std::string heads[] = {
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":)",
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2)",
      R"({"inputs":[],"id":"a)",
      R"({"inputs":[],"x":12)",
      R"({"inputs":[])",
  };
  for (const std::string& head : heads) {
    for (const std::string& tail : tails) {
      SCOPED_TRACE(head + " | " + tail.substr(0, 20));
      ExpectError(ParseInferRequest(head + tail, head.size(), "scale", "").status(),
                  {"invalid JSON"});
    }
  }
  // And the binary bytes reach the input as they were sent.
  std::string header =
      R"({"inputs":[{"name":"x","datatype":"UINT8","shape":[70],"parameters":{"binary_data_size":70}}]})";
  std::string binary = "]}" + std::string(68, '[');
  Result<InferRequest> r = ParseInferRequest(header + binary, header.size(), "scale", "");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(r->inputs[0].data.data()), 70), binary);
}

TEST(KserveCodec, ParsesJsonLengthHeader) {
  EXPECT_EQ(*ParseJsonLength("123"), 123u);
  EXPECT_FALSE(ParseJsonLength("").ok());
  EXPECT_FALSE(ParseJsonLength("-1").ok());
  EXPECT_FALSE(ParseJsonLength("+1").ok());
  EXPECT_FALSE(ParseJsonLength("12a").ok());
  EXPECT_FALSE(ParseJsonLength("99999999999999999999999").ok());
}

TEST(KserveCodec, BinaryInputsAreViewsIntoTheBody) {
  const std::vector<float> x = {1.5f, -2, 3, 4};
  const std::vector<int32_t> k = {7, -8};
  const std::string header =
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"parameters":{"binary_data_size":16}},
                    {"name":"j","datatype":"INT64","shape":[2],"data":[5,6]},
                    {"name":"k","datatype":"INT32","shape":[2],"parameters":{"binary_data_size":8}}]})";
  std::string body = header + RawString(x) + RawString(k);
  body.reserve(body.size() + kRequestBodyPadding);
  const char* const original = body.data();
  Result<InferRequest> r = ParseInferRequest(std::move(body), header.size(), "scale", "");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->inputs.size(), 3u);
  const TensorData& xd = r->inputs[0].data;
  const TensorData& jd = r->inputs[1].data;
  const TensorData& kd = r->inputs[2].data;
  // The binary inputs lie where the body's bytes were: nothing was copied.
  EXPECT_TRUE(xd.is_view());
  EXPECT_FALSE(xd.is_borrowed());
  EXPECT_EQ(reinterpret_cast<const char*>(xd.data()), original + header.size());
  EXPECT_EQ(kd.data(), xd.data() + 16);
  EXPECT_TRUE(kd.is_view());
  // The JSON input is decoded into bytes of its own.
  EXPECT_FALSE(jd.is_view());
  EXPECT_EQ(Values<int64_t>(r->inputs[1]), (std::vector<int64_t>{5, 6}));

  // A view keeps the body alive after the request is gone.
  InferTensor kept = r->inputs[2];
  r = Result<InferRequest>(Internal("gone"));
  EXPECT_EQ(Values<int32_t>(kept), k);

  // A body without spare capacity still parses (it is copied once to make room).
  std::string tight = header + RawString(x) + RawString(k);
  tight.shrink_to_fit();
  Result<InferRequest> copied = ParseInferRequest(tight, header.size(), "scale", "");
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  EXPECT_EQ(Values<float>(copied->inputs[0]), x);
  EXPECT_EQ(Values<int32_t>(copied->inputs[2]), k);

  // A binary input whose data is empty, and a request that is only JSON.
  const std::string empty_header =
      R"({"inputs":[{"name":"e","datatype":"FP32","shape":[0,4],"parameters":{"binary_data_size":0}}]})";
  Result<InferRequest> empty = ParseInferRequest(empty_header, empty_header.size(), "scale", "");
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->inputs[0].data.empty());
}

TEST(KserveCodec, FieldsInAnyOrder) {
  // `data` before the fields that say how to read it; parameters before names.
  Result<InferRequest> r = Parse(
      R"({"outputs":[{"parameters":{"binary_data":true},"name":"y"},{"name":"z"}],
          "inputs":[{"data":[[1,2],[3,4]],"parameters":{},"shape":[2,2],"name":"x","datatype":"INT16"},
                    {"datatype":"FP32","data":[0.5],"name":"w","shape":[1]},
                    {"name":"b","data":[true,false,true],"shape":[3],"datatype":"BOOL"}],
          "extra":{"anything":[1,"two",null,{"three":3.0e1}]},
          "parameters":{"binary_data_output":false,"other":[]},"id":"late"})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->id, "late");
  ASSERT_EQ(r->inputs.size(), 3u);
  EXPECT_EQ(r->inputs[0].name, "x");
  EXPECT_EQ(r->inputs[0].dtype, DType::kI16);
  EXPECT_EQ(Values<int16_t>(r->inputs[0]), (std::vector<int16_t>{1, 2, 3, 4}));
  EXPECT_EQ(Values<float>(r->inputs[1]), (std::vector<float>{0.5f}));
  EXPECT_EQ(Values<uint8_t>(r->inputs[2]), (std::vector<uint8_t>{1, 0, 1}));
  ASSERT_EQ(r->outputs.size(), 2u);
  EXPECT_TRUE(r->outputs[0].binary);
  EXPECT_FALSE(r->outputs[1].binary);

  // binary_data_output applies to outputs named before it.
  Result<InferRequest> late =
      Parse(R"({"outputs":[{"name":"y"}],"inputs":[],"parameters":{"binary_data_output":true}})");
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_TRUE(late->outputs[0].binary);

  // Escaped keys and names are unescaped; whitespace anywhere.
  Result<InferRequest> escaped = Parse(
      "{ \"inputs\" : [ { \"na\\u006de\" : \"\\u00e9t\\u00e9\" , \"datatype\" : \"UINT8\" ,\n"
      "  \"shape\" : [ 2 ] , \"data\" : [ 1 ,\t2 ] } ] }\n");
  ASSERT_TRUE(escaped.ok()) << escaped.status().ToString();
  EXPECT_EQ(escaped->inputs[0].name, "\xc3\xa9t\xc3\xa9");
  EXPECT_EQ(Values<uint8_t>(escaped->inputs[0]), (std::vector<uint8_t>{1, 2}));
}

TEST(KserveCodec, NestedArrays) {
  Result<InferRequest> r = Parse(
      R"({"inputs":[{"name":"a","datatype":"INT32","shape":[2,2,3],"data":[[[1,2,3],[4,5,6]],[[7,8,9],[10,11,12]]]},
                    {"name":"b","datatype":"FP64","shape":[2,0],"data":[[],[]]},
                    {"name":"c","datatype":"FP32","shape":[3,1],"data":[1,2,3]},
                    {"name":"d","datatype":"INT8","shape":[1,1,1,1],"data":[ [ [ [ -128 ] ] ] ]}]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Values<int32_t>(r->inputs[0]),
            (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_TRUE(r->inputs[1].data.empty());
  EXPECT_EQ(Values<float>(r->inputs[2]), (std::vector<float>{1, 2, 3}));  // flat for [3,1]
  EXPECT_EQ(Values<int8_t>(r->inputs[3]), (std::vector<int8_t>{-128}));

  const std::string x = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2,2],"data":)";
  ExpectParseError(x + "[[1,2],3]}]}", {"input \"x\"", "does not match shape [2,2]", "entry 1",
                                        "3 where an array belongs"});
  ExpectParseError(x + "[[1,2],[3,4],[5,6]]}]}",
                   {"input \"x\"", "does not match shape [2,2]", "more than 2 entries"});
  ExpectParseError(x + "[[1,2]]}]}", {"input \"x\"", "depth 0 has 1 entries, not 2"});
  ExpectParseError(x + "[[1,2],[3,{}]]}]}", {"input \"x\"", "deeper than the shape"});
  ExpectParseError(x + "[[1,2],[3,\"4\"]]}]}",
                   {"input \"x\"", "element 3 (\"4\") is not a number; FP32 needs numbers"});
  ExpectParseError(x + "[1,2,3,[4]]}]}", {"input \"x\"", "element 3 ([...]) is not a number"});
}

TEST(KserveCodec, NumbersOutOfRangeAndWrongTypes) {
  auto body = [](const std::string& datatype, const std::string& data) {
    return R"({"inputs":[{"name":"x","datatype":")" + datatype + R"(","shape":[1],"data":[)" +
           data + "]}]}";
  };
  struct Case {
    std::string datatype;
    std::string data;
    std::string needle;
  };
  const std::vector<Case> refused = {
      {"UINT8", "256", "(256) is out of range for UINT8"},
      {"INT8", "128", "out of range for INT8"},
      {"INT16", "-32769", "out of range for INT16"},
      {"INT32", "2147483648", "out of range for INT32"},
      {"INT64", "-9223372036854775809", "out of range for INT64"},
      {"INT64", "18446744073709551616", "out of range for INT64"},
      {"INT64", "1e2", "(1e2) is not an integer; INT64 needs integers"},
      {"INT32", "1.0", "not an integer"},
      {"INT32", "null", "(null) is not an integer"},
      {"INT32", "{\"a\":1}", "({...}) is not an integer"},
      {"FP64", "1e400", "(1e400) is out of range for FP64"},
      {"FP32", "-3.5e38", "out of range for FP32"},
      {"BF16", "3.4e38", "out of range for BF16"},
      {"FP16", "65520", "out of range for FP16"},
      {"FP16", "false", "(false) is not a number; FP16 needs numbers"},
      {"BOOL", "0", "(0) is not a boolean; BOOL needs true or false"},
      {"BOOL", "\"true\"", "is not a boolean"},
  };
  for (const Case& c : refused)
    ExpectParseError(body(c.datatype, c.data), {"input \"x\"", c.needle});

  Result<InferRequest> edges = Parse(
      R"({"inputs":[{"name":"a","datatype":"INT64","shape":[2],"data":[-9223372036854775808,9223372036854775807]},
                    {"name":"b","datatype":"FP32","shape":[3],"data":[1e-50,-0,3.4028234e38]},
                    {"name":"c","datatype":"FP16","shape":[1],"data":[65504]},
                    {"name":"d","datatype":"FP64","shape":[1],"data":[123456789012345678901234567890]}]})");
  ASSERT_TRUE(edges.ok()) << edges.status().ToString();
  EXPECT_EQ(Values<int64_t>(edges->inputs[0]),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::min(),
                                  std::numeric_limits<int64_t>::max()}));
  EXPECT_EQ(Values<float>(edges->inputs[1]), (std::vector<float>{0, -0.0f, 3.4028234e38f}));
  EXPECT_TRUE(std::signbit(Values<float>(edges->inputs[1])[1]));
  EXPECT_EQ(HalfToFloat(Values<uint16_t>(edges->inputs[2])[0]), 65504.0f);
  EXPECT_EQ(Values<double>(edges->inputs[3])[0], 123456789012345678901234567890.0);
}

TEST(KserveCodec, MalformedJsonIsRefusedWhereverItIs) {
  const std::string good_input = R"({"name":"x","datatype":"FP32","shape":[1],"data":[1]})";
  for (const std::string& body : {
           std::string(R"({"inputs":[)") + good_input + "],}",
           std::string(R"({"inputs":[)") + good_input + "]} trailing",
           std::string(R"({"inputs":[)") + good_input + R"(],"junk":[1,2,}})",
           std::string(R"({"inputs":[)") + good_input + R"(],"junk":tru})",
           std::string(R"({"inputs":[)") + good_input + R"(],"junk":01})",
           std::string(R"({"inputs":[)") + good_input + R"(],"junk":"\x"})",
           std::string(R"({"inputs":[)") + good_input + R"(],"junk":[1 2]})",
           std::string(R"({"inputs":[)") + good_input + R"(] "outputs":[]})",
           std::string(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1.]}]})"),
           std::string(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[-]}]})"),
           std::string(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1}]})"),
           std::string(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[nul]}]})"),
           std::string(R"({"inputs":[{"data":[1,,2],"name":"x","datatype":"FP32","shape":[2]}]})"),
           std::string(R"({"inputs":[{"name":"x" "datatype":"FP32","shape":[1],"data":[1]}]})"),
           std::string("{\"inputs\":[],\"id\":\"\xff\"}"),
           std::string(R"({"inputs":[]})") + "{}",
           std::string(R"({"inputs":[],"deep":)") + std::string(300, '[') + std::string(300, ']') +
               "}",
       }) {
    ExpectParseError(body, {"invalid JSON"});
  }
  // A syntax error wins over a complaint about the content, wherever it is.
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[true]}],"junk":[})",
      {"invalid JSON in the request at byte"});
  ExpectParseError(R"({"id":5,"inputs":[],"junk":x})", {"invalid JSON"});
  // ... and says where.
  const std::string late = R"({"inputs":[],"id":"a","junk":[1,2,}})";
  Result<InferRequest> r = Parse(late);
  ASSERT_FALSE(r.ok());
  const std::string at = "at byte " + std::to_string(late.find(",}") + 1) + ":";
  EXPECT_NE(r.status().message().find(at), std::string::npos) << r.status().message();
}

TEST(KserveCodec, MoreStructureErrors) {
  ExpectParseError(R"({"inputs":[],"inputs":[]})", {"'inputs' twice"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1],"data":[2]}]})",
      {"input #0 has 'data' twice"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"parameters":5}]})",
                   {"input \"x\": 'parameters' must be an object"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":5,"shape":[1],"data":[1]}]})",
                   {"input \"x\": 'datatype' must be a string"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1.5],"data":[1]}]})",
                   {"input \"x\": 'shape' must be an array of non-negative integers"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[9223372036854775808],"data":[1]}]})",
      {"non-negative integers"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":{"a":1}}]})",
                   {"'data' must be an array"});
  ExpectParseError(R"({"inputs":[],"outputs":[{"name":"y","parameters":3}]})",
                   {"output \"y\": 'parameters' must be an object"});
  ExpectParseError(R"({"inputs":[],"outputs":{}})", {"'outputs' must be an array"});
  ExpectParseError(R"({"inputs":[],"outputs":[1]})", {"output #0 must be an object"});
  ExpectParseError(R"({"parameters":{"timeout":1.5},"inputs":[]})", {"'timeout'"});
  ExpectParseError(R"({"parameters":{"timeout":18446744073709551616},"inputs":[]})", {"'timeout'"});
  // A shape that needs more elements than the body could hold: counted, not allocated.
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP64","shape":[1000000000000],"data":[1,2]}]})",
      {"'data' has 2 elements but shape [1000000000000] needs 1000000000000"});
  ExpectParseError(
      R"({"inputs":[{"name":"x","datatype":"FP64","shape":[1000000000000,1],"data":[[1],[2]]}]})",
      {"input \"x\"", "depth 0 has 2 entries, not 1000000000000"});
  ExpectParseError(R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,2,3,true]}]})",
                   {"'data' has 4 elements but shape [2] needs 2"});
}

InferRequest Request(std::vector<InferTensor> inputs, std::vector<RequestedOutput> outputs = {}) {
  InferRequest r;
  r.model = "scale";
  r.inputs = std::move(inputs);
  r.outputs = std::move(outputs);
  return r;
}

InferTensor Tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  InferTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

TEST(KserveCodec, ValidatesAgainstMetadata) {
  const ModelMetadata scale = ScaleModel();
  const InferTensor x2 = Tensor("x", DType::kF32, {2, 4});
  const InferTensor mask2 = Tensor("mask", DType::kBool, {2, 2});
  EXPECT_TRUE(ValidateInferRequest(Request({x2, mask2}), scale).ok());
  EXPECT_TRUE(
      ValidateInferRequest(Request({mask2, x2}, {{"y", true}, {"argmax", false}}), scale).ok());
  EXPECT_TRUE(
      ValidateInferRequest(
          Request({Tensor("x", DType::kF32, {8, 4}), Tensor("mask", DType::kBool, {8, 2})}), scale)
          .ok());

  ExpectError(ValidateInferRequest(Request({x2, mask2, Tensor("z", DType::kF32, {2})}), scale),
              {"unknown input \"z\"", "model \"scale\""});
  ExpectError(ValidateInferRequest(Request({x2}), scale), {"missing input \"mask\""});
  ExpectError(ValidateInferRequest(Request({x2, mask2, x2}), scale), {"duplicate input \"x\""});
  ExpectError(ValidateInferRequest(Request({Tensor("x", DType::kF64, {2, 4}), mask2}), scale),
              {"input \"x\"", "datatype FP64", "model's FP32"});
  ExpectError(ValidateInferRequest(Request({Tensor("x", DType::kF32, {2, 5}), mask2}), scale),
              {"input \"x\"", "shape [2,5]", "[-1,4]"});
  ExpectError(ValidateInferRequest(Request({Tensor("x", DType::kF32, {4}), mask2}), scale),
              {"input \"x\"", "shape [4]"});
  ExpectError(
      ValidateInferRequest(
          Request({Tensor("x", DType::kF32, {9, 4}), Tensor("mask", DType::kBool, {9, 2})}), scale),
      {"input \"x\"", "batch of 9 exceeds max_batch_size 8"});
  ExpectError(ValidateInferRequest(Request({Tensor("x", DType::kF32, {0, 4}), mask2}), scale),
              {"input \"x\"", "batch of 0"});
  ExpectError(ValidateInferRequest(Request({x2, Tensor("mask", DType::kBool, {3, 2})}), scale),
              {"disagree on the batch size", "\"x\" has 2", "\"mask\" has 3"});
  ExpectError(ValidateInferRequest(Request({x2, mask2}, {{"q", false}}), scale),
              {"unknown output \"q\""});
  ExpectError(ValidateInferRequest(Request({x2, mask2}, {{"y", false}, {"y", true}}), scale),
              {"output \"y\"", "twice"});

  const ModelMetadata fixed = FixedModel();
  EXPECT_TRUE(ValidateInferRequest(Request({Tensor("a", DType::kI32, {2, 3})}), fixed).ok());
  ExpectError(ValidateInferRequest(Request({Tensor("a", DType::kI32, {1, 2, 3})}), fixed),
              {"input \"a\"", "shape [1,2,3]", "[2,3]"});
  ExpectError(ValidateInferRequest(Request({Tensor("a", DType::kI32, {3, 2})}), fixed),
              {"shape [3,2]"});
}

InferResponse SampleResponse() {
  InferResponse r;
  r.model = "scale";
  r.version = "1";
  InferTensor y = Tensor("y", DType::kF32, {2, 1});
  y.data = Bytes(std::vector<float>{0.1f, -3e38f});
  InferTensor argmax = Tensor("argmax", DType::kI64, {2, 1});
  argmax.data = Bytes(std::vector<int64_t>{std::numeric_limits<int64_t>::max(), -1});
  InferTensor flags = Tensor("flags", DType::kBool, {3});
  flags.data = Bytes(std::vector<uint8_t>{1, 0, 1});
  InferTensor half = Tensor("half", DType::kF16, {2});
  half.data = Bytes(std::vector<uint16_t>{FloatToHalf(0.333f), FloatToHalf(-2)});
  InferTensor small = Tensor("small", DType::kU8, {1});
  small.data = Bytes(std::vector<uint8_t>{200});
  r.outputs = {y, argmax, flags, half, small};
  return r;
}

TEST(KserveCodec, EncodesJsonOutputs) {
  OutputSelection selection;
  selection.id = "abc";
  Result<EncodedInferResponse> encoded = EncodeInferResponse(SampleResponse(), selection);
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  EXPECT_FALSE(encoded->json_length.has_value());
  const json j = json::parse(encoded->body);
  EXPECT_EQ(j["model_name"], "scale");
  EXPECT_EQ(j["model_version"], "1");
  EXPECT_EQ(j["id"], "abc");
  ASSERT_EQ(j["outputs"].size(), 5u);
  const json& y = j["outputs"][0];
  EXPECT_EQ(y["name"], "y");
  EXPECT_EQ(y["datatype"], "FP32");
  EXPECT_EQ(y["shape"], json::parse("[2,1]"));
  // Floats round-trip to the same FP32 value.
  EXPECT_EQ(static_cast<float>(y["data"][0].get<double>()), 0.1f);
  EXPECT_EQ(static_cast<float>(y["data"][1].get<double>()), -3e38f);
  EXPECT_NE(encoded->body.find("[0.1,"), std::string::npos) << encoded->body;
  const json& argmax = j["outputs"][1];
  EXPECT_EQ(argmax["datatype"], "INT64");
  EXPECT_TRUE(argmax["data"][0].is_number_integer());
  EXPECT_EQ(argmax["data"][0].get<int64_t>(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(j["outputs"][2]["data"], json::parse("[true,false,true]"));
  EXPECT_EQ(j["outputs"][3]["datatype"], "FP16");
  EXPECT_EQ(static_cast<float>(j["outputs"][3]["data"][0].get<double>()),
            HalfToFloat(FloatToHalf(0.333f)));
  EXPECT_EQ(j["outputs"][3]["data"][1], -2.0);
  EXPECT_EQ(j["outputs"][4]["data"], json::parse("[200]"));
  EXPECT_FALSE(j["outputs"][0].contains("parameters"));
}

TEST(KserveCodec, EncodesBinaryOutputsAfterTheJson) {
  OutputSelection selection;
  selection.outputs = {{"argmax", false}, {"y", true}, {"flags", true}};
  Result<EncodedInferResponse> encoded = EncodeInferResponse(SampleResponse(), selection);
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  ASSERT_TRUE(encoded->json_length.has_value());
  const size_t n = *encoded->json_length;
  const json j = json::parse(encoded->body.substr(0, n));
  EXPECT_FALSE(j.contains("id"));
  ASSERT_EQ(j["outputs"].size(), 3u);
  EXPECT_EQ(j["outputs"][0]["name"], "argmax");
  EXPECT_TRUE(j["outputs"][0].contains("data"));
  EXPECT_EQ(j["outputs"][1]["name"], "y");
  EXPECT_EQ(j["outputs"][1]["parameters"]["binary_data_size"], 8);
  EXPECT_FALSE(j["outputs"][1].contains("data"));
  EXPECT_EQ(j["outputs"][2]["parameters"]["binary_data_size"], 3);
  const std::string binary = encoded->body.substr(n);
  EXPECT_EQ(binary,
            RawString(std::vector<float>{0.1f, -3e38f}) + RawString(std::vector<uint8_t>{1, 0, 1}));

  // binary_data_output with no outputs named: every output binary.
  OutputSelection all;
  all.binary_data_output = true;
  Result<EncodedInferResponse> everything = EncodeInferResponse(SampleResponse(), all);
  ASSERT_TRUE(everything.ok());
  ASSERT_TRUE(everything->json_length.has_value());
  EXPECT_EQ(everything->body.size() - *everything->json_length, 8u + 16 + 3 + 4 + 1);
}

TEST(KserveCodec, EncodeRefusesBrokenResponses) {
  OutputSelection missing;
  missing.outputs = {{"nope", false}};
  Result<EncodedInferResponse> r = EncodeInferResponse(SampleResponse(), missing);
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("\"nope\""), std::string::npos);

  InferResponse bad = SampleResponse();
  bad.outputs[0].data = Bytes(std::vector<uint8_t>{1, 2, 3, 4, 5, 6, 7});
  r = EncodeInferResponse(bad, {});
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("does not match shape [2,1]"), std::string::npos);

  InferResponse f8 = SampleResponse();
  f8.outputs[4].dtype = DType::kF8E4M3;
  r = EncodeInferResponse(f8, {});
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
}

TEST(KserveCodec, EncodesOutputsBorrowedFromTheService) {
  // What the server hands over: views into its worker's slot, valid until
  // `done` returns. The body holds its own copy of them.
  std::vector<float> slot = {0.5f, -1, 2, 4, 8, 16};
  InferResponse response;
  response.model = "scale";
  response.version = "1";
  InferTensor y = Tensor("y", DType::kF32, {2, 1});
  y.data = TensorData::Borrowed(std::as_bytes(std::span(slot).subspan(0, 2)));
  InferTensor z = Tensor("z", DType::kF32, {4});
  z.data = TensorData::Borrowed(std::as_bytes(std::span(slot).subspan(2, 4)));
  EXPECT_TRUE(y.data.is_borrowed());
  response.outputs = {y, z};
  OutputSelection selection;
  selection.outputs = {{"y", false}, {"z", true}};
  Result<EncodedInferResponse> encoded = EncodeInferResponse(response, selection);
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  std::fill(slot.begin(), slot.end(), -7.0f);  // the next batch
  ASSERT_TRUE(encoded->json_length.has_value());
  const json j = json::parse(encoded->body.substr(0, *encoded->json_length));
  EXPECT_EQ(j["outputs"][0]["data"], json::parse("[0.5,-1]"));
  EXPECT_EQ(encoded->body.substr(*encoded->json_length),
            RawString(std::vector<float>{2, 4, 8, 16}));
}

TEST(KserveCodec, MetadataAndErrors) {
  const json m = json::parse(ModelMetadataJson(ScaleModel()));
  EXPECT_EQ(m["name"], "scale");
  EXPECT_EQ(m["versions"], json::parse(R"(["1"])"));
  EXPECT_EQ(m["platform"], "hearth_scale");
  EXPECT_EQ(m["inputs"][0], json::parse(R"({"name":"x","datatype":"FP32","shape":[-1,4]})"));
  EXPECT_EQ(m["outputs"][1], json::parse(R"({"name":"argmax","datatype":"INT64","shape":[-1,1]})"));

  const json s = json::parse(ServerMetadataJson("hearth", "0.1.0", {"binary_tensor_data"}));
  EXPECT_EQ(
      s, json::parse(R"({"name":"hearth","version":"0.1.0","extensions":["binary_tensor_data"]})"));

  EXPECT_EQ(json::parse(ErrorJson("bad \"x\"\n"))["error"], "bad \"x\"\n");
  EXPECT_NO_THROW(json::parse(ErrorJson(std::string("\xff\xfe not utf-8"))));

  EXPECT_EQ(HttpStatusFor(StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFor(StatusCode::kFailedPrecondition), 400);
  EXPECT_EQ(HttpStatusFor(StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusFor(StatusCode::kResourceExhausted), 503);
  EXPECT_EQ(HttpStatusFor(StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(StatusCode::kInternal), 500);
  EXPECT_EQ(HttpStatusFor(StatusCode::kPermissionDenied), 500);
}

}  // namespace
}  // namespace hearth
