// BYTES tensors and variable dimensions in the KServe codec, without sockets:
// JSON strings and binary data into the serialised form (common/bytes_tensor.h)
// and back out, every malformed form refused naming the input, `-1` dims
// against metadata, and output bytes that are not UTF-8 written as valid JSON.
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/bytes_tensor.h"
#include "http/kserve_codec.h"

namespace hearth {
namespace {

using json = nlohmann::json;
using namespace std::string_literals;

// The serialised form of `elements`, built here by hand (not with the helper
// under test elsewhere): a 4-byte little-endian length, then the bytes.
std::string Serialised(const std::vector<std::string>& elements) {
  std::string out;
  for (const std::string& element : elements) {
    const auto n = static_cast<uint32_t>(element.size());
    const char prefix[4] = {static_cast<char>(n & 0xff), static_cast<char>((n >> 8) & 0xff),
                            static_cast<char>((n >> 16) & 0xff),
                            static_cast<char>((n >> 24) & 0xff)};
    out.append(prefix, 4);
    out += element;
  }
  return out;
}

std::string DataOf(const InferTensor& tensor) {
  return std::string(reinterpret_cast<const char*>(tensor.data.data()), tensor.data.size());
}

std::vector<std::byte> ByteVector(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return std::vector<std::byte>(p, p + text.size());
}

Result<InferRequest> Parse(const std::string& body) {
  return ParseInferRequest(body, std::nullopt, "strings", "");
}

// A request whose JSON is `header` followed by `binary`.
Result<InferRequest> ParseBinary(const std::string& header, const std::string& binary) {
  return ParseInferRequest(header + binary, header.size(), "strings", "");
}

void ExpectError(const Status& status, std::initializer_list<std::string> needles) {
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  for (const std::string& needle : needles) {
    EXPECT_NE(status.message().find(needle), std::string::npos)
        << "'" << status.message() << "' lacks '" << needle << "'";
  }
}

InferTensor BytesTensor(std::string name, std::vector<int64_t> shape,
                        const std::vector<std::string>& elements) {
  InferTensor t;
  t.name = std::move(name);
  t.dtype = DType::kBytes;
  t.shape = std::move(shape);
  t.data = ByteVector(Serialised(elements));
  return t;
}

InferResponse ResponseWith(std::vector<InferTensor> outputs) {
  InferResponse r;
  r.model = "strings";
  r.version = "1";
  r.outputs = std::move(outputs);
  return r;
}

// The JSON of an encoded response; fails the test if nlohmann (which checks
// UTF-8) cannot parse it.
json JsonOf(const EncodedInferResponse& encoded) {
  const std::string text =
      encoded.body.substr(0, encoded.json_length.value_or(encoded.body.size()));
  json parsed;
  EXPECT_NO_THROW(parsed = json::parse(text)) << text;
  return parsed;
}

const std::vector<std::string> kAwkward = {
    "",                          // empty
    "a\0b"s,                     // an embedded NUL, written \u0000
    "q\"\\/\b\f\n\r\t",          // every short escape
    "\xc3\xa9",                  // é, as \u00e9
    "\xc3\xa9\xf0\x9f\x98\x80",  // é😀: a surrogate pair
    "\xe6\x97\xa5\xe6\x9c\xac",  // 日本, raw UTF-8
};
const char* kAwkwardJson =
    R"([["","a\u0000b","q\"\\\/\b\f\n\r\t"],["\u00e9","\u00E9\ud83d\ude00","日本"]])";

TEST(KserveBytes, JsonStringsBecomeTheSerialisedForm) {
  Result<InferRequest> r =
      Parse(std::string(R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[2,3],"data":)") +
            kAwkwardJson + "}]}");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->inputs.size(), 1u);
  const InferTensor& s = r->inputs[0];
  EXPECT_EQ(s.dtype, DType::kBytes);
  EXPECT_EQ(s.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_FALSE(s.data.is_view());
  EXPECT_EQ(DataOf(s), Serialised(kAwkward));

  // Flat data, a scalar, an empty tensor, and fields in another order.
  r = Parse(R"({"inputs":[
      {"name":"flat","datatype":"BYTES","shape":[1,3],"data":["x","","yz"]},
      {"name":"scalar","datatype":"BYTES","shape":[],"data":["only"]},
      {"name":"none","datatype":"BYTES","shape":[0,2],"data":[]},
      {"data":[["p"],["q"]],"shape":[2,1],"name":"late","datatype":"BYTES"}]})");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(DataOf(r->inputs[0]), Serialised({"x", "", "yz"}));
  EXPECT_EQ(DataOf(r->inputs[1]), Serialised({"only"}));
  EXPECT_TRUE(r->inputs[2].data.empty());
  EXPECT_EQ(DataOf(r->inputs[3]), Serialised({"p", "q"}));
}

TEST(KserveBytes, JsonStringsRoundTripThroughTheEncoder) {
  Result<InferRequest> r =
      Parse(std::string(R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[2,3],"data":)") +
            kAwkwardJson + "}]}");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  Result<EncodedInferResponse> encoded = EncodeInferResponse(ResponseWith(r->inputs), {});
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  const json j = JsonOf(*encoded);
  const json& out = j["outputs"][0];
  EXPECT_EQ(out["datatype"], "BYTES");
  EXPECT_EQ(out["shape"], json::parse("[2,3]"));
  EXPECT_EQ(out["data"], json(kAwkward));
  // And read back as a request: the same bytes.
  const size_t at = encoded->body.find(",\"outputs\":");
  ASSERT_NE(at, std::string::npos);
  Result<InferRequest> again = Parse("{\"inputs\":" + encoded->body.substr(at + 11));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(DataOf(again->inputs[0]), Serialised(kAwkward));
}

TEST(KserveBytes, JsonDataErrorsNameTheInput) {
  const auto bytes_input = [](const std::string& shape, const std::string& data) {
    return R"({"inputs":[{"name":"s","datatype":"BYTES","shape":)" + shape + R"(,"data":)" + data +
           "}]}";
  };
  ExpectError(Parse(bytes_input("[2]", R"(["a",5])")).status(),
              {"input \"s\"", "element 1 (5)", "not a string; BYTES needs strings"});
  ExpectError(Parse(bytes_input("[1]", "[true]")).status(), {"input \"s\"", "not a string"});
  ExpectError(Parse(bytes_input("[1]", "[null]")).status(), {"input \"s\"", "not a string"});
  ExpectError(Parse(bytes_input("[1]", R"([{"a":"b"}])")).status(),
              {"input \"s\"", "not a string"});
  ExpectError(Parse(bytes_input("[2,1]", R"([["a"],[1.5]])")).status(),
              {"input \"s\"", "element 1 (1.5)", "not a string"});
  ExpectError(Parse(bytes_input("[1]", R"([["a"]])")).status(),
              {"input \"s\"", "deeper than the shape"});
  ExpectError(Parse(bytes_input("[2,2]", R"([["a","b"],["c"]])")).status(),
              {"input \"s\"", "rectangular"});
  ExpectError(Parse(bytes_input("[3]", R"(["a","b"])")).status(),
              {"input \"s\"", "'data' has 2 elements but shape [3] needs 3"});
  ExpectError(Parse(bytes_input("[1]", R"(["a","b"])")).status(),
              {"input \"s\"", "'data' has 2 elements but shape [1] needs 1"});
  // More elements than the text could hold: counted, never allocated.
  ExpectError(Parse(bytes_input("[1000000000000]", R"(["a"])")).status(),
              {"input \"s\"", "needs 1000000000000"});
  ExpectError(Parse(bytes_input("[1]", R"("a")")).status(),
              {"input \"s\"", "'data' must be an array"});
  // Malformed strings are malformed JSON: a bad escape, a lone surrogate
  // half, bytes that are not UTF-8.
  ExpectError(Parse(bytes_input("[1]", R"(["a\x"])")).status(), {"invalid JSON"});
  ExpectError(Parse(bytes_input("[1]", R"(["\ud800"])")).status(), {"invalid JSON"});
  ExpectError(Parse(bytes_input("[1]", "[\"\xff\"]")).status(), {"invalid JSON"});
  ExpectError(Parse(bytes_input("[1]", "[\"\xc3\"]")).status(), {"invalid JSON"});
}

TEST(KserveBytes, BinaryInputIsTheSerialisedFormUnchanged) {
  const std::string strings = Serialised({"", "\0\xff\xfe"s, "abc", std::string(300, 'z')});
  const float x[2] = {1.5f, -2};
  const std::string header =
      R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[2,2],"parameters":{"binary_data_size":)" +
      std::to_string(strings.size()) +
      R"(}},{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}]})";
  Result<InferRequest> r =
      ParseBinary(header, strings + std::string(reinterpret_cast<const char*>(x), sizeof(x)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->inputs.size(), 2u);
  EXPECT_EQ(r->inputs[0].dtype, DType::kBytes);
  EXPECT_TRUE(r->inputs[0].data.is_view());  // a view into the body: not re-encoded
  EXPECT_EQ(DataOf(r->inputs[0]), strings);
  EXPECT_EQ(r->inputs[1].data.data(), r->inputs[0].data.data() + strings.size());
  float back[2];
  std::memcpy(back, r->inputs[1].data.data(), sizeof(back));
  EXPECT_EQ(back[0], 1.5f);
  EXPECT_EQ(back[1], -2);

  // Zero elements: zero bytes.
  r = ParseBinary(
      R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[0],"parameters":{"binary_data_size":0}}]})",
      "");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->inputs[0].data.empty());
}

TEST(KserveBytes, MalformedBinaryBytesAreRefusedNamingTheInput) {
  const auto refuse = [](const std::string& shape, const std::string& binary,
                         std::initializer_list<std::string> needles) {
    SCOPED_TRACE(shape);
    const std::string header = R"({"inputs":[{"name":"s","datatype":"BYTES","shape":)" + shape +
                               R"(,"parameters":{"binary_data_size":)" +
                               std::to_string(binary.size()) + "}}]}";
    ExpectError(ParseBinary(header, binary).status(), needles);
  };
  // Too few bytes even for the length prefixes: refused before the body is read.
  refuse("[2]",
         "\x01\x00\x00\x00"
         "a\x00\x00"s,
         {"input \"s\"", "declares 7 bytes", "too few for shape [2] of BYTES"});
  refuse("[2]", Serialised({"abcdef"}) + "\x02\x00"s,
         {"input \"s\"", "BYTES element 1", "at byte 10", "truncated length prefix"});
  refuse("[2]", Serialised({"a"}) + "\x09\x00\x00\x00xy"s,
         {"input \"s\"", "BYTES element 1", "length 9", "past the end"});
  refuse("[1]",
         "\xff\xff\xff\xff"
         "abc"s,
         {"input \"s\"", "BYTES element 0", "length 4294967295", "past the end"});
  refuse("[1]", Serialised({"a"}) + "zz", {"input \"s\"", "2 trailing bytes after its 1 elements"});
  refuse("[1]", Serialised({"a", "b"}), {"input \"s\"", "too many elements: 2 where 1"});
  refuse("[1,3]", Serialised({"abcdefgh"}), {"input \"s\"", "too few elements: 1 where 3"});
  refuse("[0]", Serialised({""}), {"input \"s\"", "too many elements: 1 where 0"});

  // The sizes must still add up to the body.
  const std::string ab = Serialised({"a", "b"});
  const std::string header =
      R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[2],"parameters":{"binary_data_size":)" +
      std::to_string(ab.size()) + "}}]}";
  ExpectError(ParseBinary(header, ab + "x").status(), {"binary sizes do not add up"});
  ExpectError(
      ParseBinary(
          R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[1],"data":["a"],"parameters":{"binary_data_size":5}}]})",
          Serialised({"a"}))
          .status(),
      {"input \"s\" has both 'data' and parameter 'binary_data_size'"});
}

ModelMetadata RaggedModel() {
  ModelMetadata m;
  m.name = "ragged";
  m.versions = {"1"};
  m.platform = "hearth_python";
  m.max_batch_size = 4;
  m.inputs = {{"s", DType::kBytes, {-1, -1}}, {"ids", DType::kI64, {-1, 3, -1}}};
  m.outputs = {{"o", DType::kBytes, {-1, -1}}};
  return m;
}

InferTensor Tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  InferTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

InferRequest Request(std::vector<InferTensor> inputs) {
  InferRequest r;
  r.model = "ragged";
  r.inputs = std::move(inputs);
  return r;
}

TEST(KserveBytes, VariableDimsAcceptAnySizeAndFixedOnesMustMatch) {
  const ModelMetadata ragged = RaggedModel();
  for (const auto& [s_shape, ids_shape] :
       std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{
           {{1, 5}, {1, 3, 0}}, {{2, 1}, {2, 3, 7}}, {{4, 0}, {4, 3, 1000}}}) {
    EXPECT_TRUE(ValidateInferRequest(Request({Tensor("s", DType::kBytes, s_shape),
                                              Tensor("ids", DType::kI64, ids_shape)}),
                                     ragged)
                    .ok())
        << ShapeString(s_shape) << " " << ShapeString(ids_shape);
  }
  const InferTensor s = Tensor("s", DType::kBytes, {2, 3});
  ExpectError(ValidateInferRequest(Request({s, Tensor("ids", DType::kI64, {2, 4, 1})}), ragged),
              {"input \"ids\"", "shape [2,4,1]", "[-1,3,-1]"});
  ExpectError(ValidateInferRequest(Request({s, Tensor("ids", DType::kI64, {2, 3})}), ragged),
              {"input \"ids\"", "shape [2,3]"});
  ExpectError(ValidateInferRequest(
                  Request({Tensor("s", DType::kBytes, {2}), Tensor("ids", DType::kI64, {2, 3, 1})}),
                  ragged),
              {"input \"s\"", "shape [2]"});
  ExpectError(ValidateInferRequest(Request({Tensor("s", DType::kF32, {2, 3}),
                                            Tensor("ids", DType::kI64, {2, 3, 1})}),
                                   ragged),
              {"input \"s\"", "datatype FP32 does not match the model's BYTES"});
  ExpectError(ValidateInferRequest(Request({Tensor("s", DType::kBytes, {5, 1}),
                                            Tensor("ids", DType::kI64, {5, 3, 1})}),
                                   ragged),
              {"batch of 5 exceeds max_batch_size 4"});
  ExpectError(ValidateInferRequest(Request({Tensor("s", DType::kBytes, {1, 1}),
                                            Tensor("ids", DType::kI64, {2, 3, 1})}),
                                   ragged),
              {"disagree on the batch size"});

  // Without batching, -1 may stand anywhere, the first dimension included.
  ModelMetadata flat;
  flat.name = "flat";
  flat.inputs = {{"t", DType::kBytes, {-1, 2}}};
  for (const int64_t n : {0, 1, 9}) {
    EXPECT_TRUE(ValidateInferRequest(Request({Tensor("t", DType::kBytes, {n, 2})}), flat).ok());
  }
  ExpectError(ValidateInferRequest(Request({Tensor("t", DType::kBytes, {3, 3})}), flat),
              {"input \"t\"", "shape [3,3]", "[-1,2]"});
}

TEST(KserveBytes, EncodesBytesOutputsAsJsonStrings) {
  const std::vector<std::string> words = {"plain",
                                          "",
                                          "quote\"back\\slash\nbell\x07\x7f",
                                          "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
                                          "a\0b"s,
                                          "\xf0\x9f\x98\x80"};
  OutputSelection selection;
  selection.id = "r1";
  Result<EncodedInferResponse> encoded =
      EncodeInferResponse(ResponseWith({BytesTensor("o", {3, 2}, words)}), selection);
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  EXPECT_FALSE(encoded->json_length.has_value());
  const json j = JsonOf(*encoded);
  EXPECT_EQ(j["id"], "r1");
  EXPECT_EQ(j["outputs"][0]["datatype"], "BYTES");
  EXPECT_EQ(j["outputs"][0]["shape"], json::parse("[3,2]"));
  EXPECT_EQ(j["outputs"][0]["data"], json(words));
  // Control characters escaped, valid UTF-8 as it is.
  EXPECT_NE(encoded->body.find(R"("quote\"back\\slash\nbell\u0007)"), std::string::npos)
      << encoded->body;
  EXPECT_NE(encoded->body.find("\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e"), std::string::npos);
  EXPECT_NE(encoded->body.find(R"("a\u0000b")"), std::string::npos);

  // An empty BYTES output.
  encoded = EncodeInferResponse(ResponseWith({BytesTensor("o", {0, 4}, {})}), {});
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  EXPECT_EQ(JsonOf(*encoded)["outputs"][0]["data"], json::array());
}

TEST(KserveBytes, BytesThatAreNotUtf8StillGiveValidJson) {
  // Each byte that is not part of a valid UTF-8 sequence comes out as the
  // Latin-1 character of the same value; valid sequences as they are.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\xff", "\xc3\xbf"},                                      // not a lead byte: U+00FF
      {"a\xc3", "a\xc3\x83"},                                    // cut short at the end
      {"\xc3\x28", "\xc3\x83("},                                 // lead byte, no continuation
      {"\xc0\xaf", "\xc3\x80\xc2\xaf"},                          // overlong '/'
      {"\xe0\x80\xaf", "\xc3\xa0\xc2\x80\xc2\xaf"},              // overlong, 3 bytes
      {"\xed\xa0\x80", "\xc3\xad\xc2\xa0\xc2\x80"},              // a surrogate, U+D800
      {"\xf4\x90\x80\x80", "\xc3\xb4\xc2\x90\xc2\x80\xc2\x80"},  // past U+10FFFF
      {"\xe9\xc3\xa9", "\xc3\xa9\xc3\xa9"},                      // Latin-1 é, then UTF-8 é
      {"\x80\x80", "\xc2\x80\xc2\x80"},                          // lone continuations
      {"\xf0\x9f\x98", "\xc3\xb0\xc2\x9f\xc2\x98"},              // a 4-byte sequence cut short
  };
  std::vector<std::string> raw;
  std::vector<std::string> shown;
  for (const auto& [bytes, text] : cases) {
    raw.push_back(bytes);
    shown.push_back(text);
  }
  const InferTensor o = BytesTensor("o", {static_cast<int64_t>(raw.size())}, raw);
  Result<EncodedInferResponse> encoded = EncodeInferResponse(ResponseWith({o}), {});
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  const json j = JsonOf(*encoded);  // strict: nlohmann refuses invalid UTF-8
  EXPECT_EQ(j["outputs"][0]["data"], json(shown));
  EXPECT_NE(encoded->body.find(R"("\u00ff")"), std::string::npos) << encoded->body;
  // The same output in binary: the bytes exactly.
  OutputSelection binary;
  binary.binary_data_output = true;
  encoded = EncodeInferResponse(ResponseWith({o}), binary);
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  ASSERT_TRUE(encoded->json_length.has_value());
  EXPECT_EQ(encoded->body.substr(*encoded->json_length), Serialised(raw));
}

TEST(KserveBytes, EncodesBytesOutputsAsBinary) {
  const std::vector<std::string> words = {"", "\0\xff"s, "abc"};
  InferTensor y = Tensor("y", DType::kF32, {1});
  const float one = 1;
  y.data = ByteVector(std::string(reinterpret_cast<const char*>(&one), 4));
  OutputSelection selection;
  selection.outputs = {{"y", false}, {"o", true}};
  Result<EncodedInferResponse> encoded =
      EncodeInferResponse(ResponseWith({BytesTensor("o", {1, 3}, words), y}), selection);
  ASSERT_TRUE(encoded.ok()) << encoded.status().ToString();
  ASSERT_TRUE(encoded->json_length.has_value());
  const json j = JsonOf(*encoded);
  EXPECT_EQ(j["outputs"][0]["data"], json::parse("[1.0]"));
  EXPECT_EQ(j["outputs"][1]["name"], "o");
  EXPECT_EQ(j["outputs"][1]["datatype"], "BYTES");
  EXPECT_EQ(j["outputs"][1]["shape"], json::parse("[1,3]"));
  EXPECT_EQ(j["outputs"][1]["parameters"]["binary_data_size"], Serialised(words).size());
  EXPECT_FALSE(j["outputs"][1].contains("data"));
  EXPECT_EQ(encoded->body.substr(*encoded->json_length), Serialised(words));
}

TEST(KserveBytes, EncodeRefusesMalformedBytesOutputs) {
  // The service made these: Internal, naming the output.
  InferTensor few = BytesTensor("o", {3}, {"a", "b"});
  Result<EncodedInferResponse> r = EncodeInferResponse(ResponseWith({few}), {});
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("output \"o\""), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("too few elements"), std::string::npos);

  InferTensor broken = BytesTensor("o", {1}, {"abc"});
  broken.data = ByteVector(DataOf(broken).substr(0, 5));
  r = EncodeInferResponse(ResponseWith({broken}), {});
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_NE(r.status().message().find("past the end"), std::string::npos) << r.status().message();
  OutputSelection binary;
  binary.binary_data_output = true;
  EXPECT_EQ(EncodeInferResponse(ResponseWith({broken}), binary).status().code(),
            StatusCode::kInternal);

  InferTensor negative = BytesTensor("o", {-1}, {});
  EXPECT_EQ(EncodeInferResponse(ResponseWith({negative}), {}).status().code(),
            StatusCode::kInternal);
}

TEST(KserveBytes, OutputShapesAreTheOnesTheServiceReports) {
  // Nothing in the encoder looks at the model's dims: any shape the service
  // reports is written as it is.
  InferTensor wide = Tensor("ids", DType::kI32, {1, 0, 3});
  Result<EncodedInferResponse> r =
      EncodeInferResponse(ResponseWith({wide, BytesTensor("o", {2, 1, 1}, {"a", "b"})}), {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const json j = JsonOf(*r);
  EXPECT_EQ(j["outputs"][0]["shape"], json::parse("[1,0,3]"));
  EXPECT_EQ(j["outputs"][0]["data"], json::array());
  EXPECT_EQ(j["outputs"][1]["shape"], json::parse("[2,1,1]"));
  EXPECT_EQ(j["outputs"][1]["data"], json::parse(R"(["a","b"])"));
}

TEST(KserveBytes, MetadataShowsBytesAndVariableDims) {
  const json m = json::parse(ModelMetadataJson(RaggedModel()));
  EXPECT_EQ(m["inputs"], json::parse(R"([{"name":"s","datatype":"BYTES","shape":[-1,-1]},
                                          {"name":"ids","datatype":"INT64","shape":[-1,3,-1]}])"));
  EXPECT_EQ(m["outputs"], json::parse(R"([{"name":"o","datatype":"BYTES","shape":[-1,-1]}])"));
  EXPECT_EQ(m["max_batch_size"], 4);
}

}  // namespace
}  // namespace hearth
