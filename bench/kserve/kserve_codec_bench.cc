// The KServe codec on the host: decoding an infer request of 16 x 16384 FP32
// (JSON flat, JSON nested, binary) and encoding a response of the same size
// (JSON, binary), by the functions the HTTP front-end calls.
//
//   kserve_codec_bench [--benchmark_repetitions=5 ...]   (Google Benchmark flags)
//
// Prints Google Benchmark's table: time per request and bytes/s of body. The
// request bodies are copied into a fresh string with room for the parser
// (kRequestBodyPadding) outside the timed region, as the front-end reads
// them. Numbers are printed as std::to_chars writes a float, which is what
// most clients send.
#include <benchmark/benchmark.h>

#include <charconv>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "http/kserve_codec.h"

namespace hearth {
namespace {

constexpr int64_t kRows = 16;
constexpr int64_t kCols = 16384;

std::vector<float> Values() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> values(static_cast<size_t>(kRows * kCols));
  for (float& v : values) v = normal(rng);
  return values;
}

std::string JsonBody(bool nested) {
  const std::vector<float> values = Values();
  std::string body = R"({"id":"bench","inputs":[{"name":"x","datatype":"FP32","shape":[)" +
                     std::to_string(kRows) + "," + std::to_string(kCols) + R"(],"data":[)";
  char text[32];
  for (int64_t r = 0; r < kRows; ++r) {
    if (nested) body += r == 0 ? "[" : ",[";
    for (int64_t c = 0; c < kCols; ++c) {
      if (c > 0 || (!nested && r > 0)) body += ',';
      const auto end = std::to_chars(text, text + sizeof(text), values[r * kCols + c]).ptr;
      body.append(text, end);
    }
    if (nested) body += ']';
  }
  body += "]}]}";
  return body;
}

std::string BinaryHeader() {
  return R"({"id":"bench","inputs":[{"name":"x","datatype":"FP32","shape":[)" +
         std::to_string(kRows) + "," + std::to_string(kCols) +
         R"(],"parameters":{"binary_data_size":)" + std::to_string(kRows * kCols * 4) +
         R"(}}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]})";
}

void Decode(benchmark::State& state, const std::string& body, std::optional<uint64_t> json_length) {
  for (auto _ : state) {
    state.PauseTiming();
    std::string copy;
    copy.reserve(body.size() + kRequestBodyPadding);
    copy.assign(body);
    state.ResumeTiming();
    Result<InferRequest> request = ParseInferRequest(std::move(copy), json_length, "m", "");
    if (!request.ok()) state.SkipWithError(request.status().message().c_str());
    benchmark::DoNotOptimize(request);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(body.size()));
  state.counters["body_MB"] = static_cast<double>(body.size()) / 1e6;
}

void BM_DecodeJsonFlat(benchmark::State& state) {
  static const std::string body = JsonBody(false);
  Decode(state, body, std::nullopt);
}
void BM_DecodeJsonNested(benchmark::State& state) {
  static const std::string body = JsonBody(true);
  Decode(state, body, std::nullopt);
}
void BM_DecodeBinary(benchmark::State& state) {
  static const std::string header = BinaryHeader();
  static const std::string body = [] {
    const std::vector<float> values = Values();
    return header + std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4);
  }();
  Decode(state, body, header.size());
}

void Encode(benchmark::State& state, bool binary) {
  const std::vector<float> values = Values();
  std::vector<std::byte> bytes(values.size() * 4);
  std::memcpy(bytes.data(), values.data(), bytes.size());
  InferResponse response;
  response.model = "m";
  response.version = "1";
  InferTensor y;
  y.name = "y";
  y.dtype = DType::kF32;
  y.shape = {kRows, kCols};
  y.data = std::move(bytes);
  response.outputs.push_back(std::move(y));
  OutputSelection selection;
  selection.binary_data_output = binary;
  size_t size = 0;
  for (auto _ : state) {
    Result<EncodedInferResponse> encoded = EncodeInferResponse(response, selection);
    if (!encoded.ok()) state.SkipWithError(encoded.status().message().c_str());
    size = encoded->body.size();
    benchmark::DoNotOptimize(encoded);
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(size));
  state.counters["body_MB"] = static_cast<double>(size) / 1e6;
}

void BM_EncodeJson(benchmark::State& state) { Encode(state, false); }
void BM_EncodeBinary(benchmark::State& state) { Encode(state, true); }

BENCHMARK(BM_DecodeJsonFlat)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeJsonNested)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DecodeBinary)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_EncodeJson)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EncodeBinary)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace hearth

BENCHMARK_MAIN();
