// Feeds ParseInferRequest arbitrary infer request bodies, JSON and binary
// extension alike, and checks every request it accepts against what
// kserve_codec.h promises; accepted requests then go through the response
// encoder, whose output must decode back to the same tensors.
//
// Input: one flags byte, then (if bit 0 is set) a 4-byte little-endian
// Inference-Header-Content-Length, then the body. With bit 1 the length
// counts back from the end of the body (the binary part's size), so that
// mutations that resize the body keep a binary request well formed; without
// it the length is taken as it is (it may exceed the body).
#include <simdjson.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/float16.h"
#include "http/kserve_codec.h"
#include "server/request_admission.h"

namespace {

using hearth::InferRequest;
using hearth::InferTensor;

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "broken guarantee: %s\n", what);
    __builtin_trap();
  }
}

uint32_t LoadLittleEndian32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

bool SameBytes(const InferTensor& a, const InferTensor& b) {
  return a.data.size() == b.data.size() &&
         (a.data.empty() || std::memcmp(a.data.data(), b.data.data(), a.data.size()) == 0);
}

// Every accepted request: its tensors are what their datatypes and shapes
// say, binary inputs lie in order in the body after the JSON and cover it.
void CheckAccepted(const InferRequest& request, const std::string& body,
                   std::optional<uint64_t> json_length) {
  Require(request.model == "m" && request.version == "v", "model and version as given");
  const size_t json_size = json_length.value_or(body.size());
  Require(json_size <= body.size(), "the JSON fits the body");
  uint64_t binary = 0;
  const std::byte* next = nullptr;
  for (const InferTensor& input : request.inputs) {
    Require(!hearth::KserveDatatypeName(input.dtype).empty(), "a datatype KServe names");
    Require(input.shape.size() <= hearth::kMaxTensorRank, "rank within the limit");
    if (input.shm.has_value()) {
      Require(input.data.empty(), "an input in shared memory has no data here");
      continue;
    }
    for (int64_t dim : input.shape) Require(dim >= 0, "non-negative dimensions");
    if (input.dtype == hearth::DType::kBytes) {
      const hearth::Result<uint64_t> count = hearth::ShapeElements(input.shape, "fuzz input");
      Require(count.ok(), "a BYTES shape with a count");
      Require(hearth::ValidateBytesTensor(input.data.bytes(), *count, "fuzz input").ok(),
              "BYTES data is exactly the shape's elements");
    } else {
      const hearth::Result<uint64_t> bytes =
          hearth::ShapeBytes(input.dtype, input.shape, "fuzz input");
      Require(bytes.ok() && *bytes == input.data.size(), "data size == shape x element size");
    }
    if (input.data.is_view()) {
      Require(!input.data.is_borrowed(), "binary inputs keep the body alive");
      // Views into the parser's copy of the body: check their order and that
      // their bytes are the body's.
      Require(next == nullptr || input.data.data() == next || input.data.empty(),
              "binary inputs follow each other");
      Require(std::memcmp(input.data.data(), body.data() + json_size + binary, input.data.size()) ==
                      0 ||
                  input.data.empty(),
              "binary input bytes are the body's");
      next = input.data.data() + input.data.size();
      binary += input.data.size();
    }
  }
  Require(binary == body.size() - json_size, "binary inputs cover the body after the JSON");
}

// Whether the JSON of these bytes reads back as a request: no NaN or
// infinity (they come back null). With `exact`, whether it reads back to the
// same bytes: also BOOL bytes that are 0 or 1 (others come back as 1) and
// BYTES elements that are UTF-8 (other bytes come back as the UTF-8 of the
// Latin-1 characters of their values).
bool JsonCanHold(const InferTensor& t, bool exact) {
  if (t.dtype == hearth::DType::kBytes) {
    if (!exact) return true;
    for (std::string_view element : hearth::BytesElements(t.data.bytes())) {
      if (!simdjson::validate_utf8(element.data(), element.size())) return false;
    }
    return true;
  }
  const std::byte* p = t.data.data();
  const size_t n = t.data.size() / hearth::DTypeSize(t.dtype);
  for (size_t i = 0; i < n; ++i) {
    double v = 0;
    switch (t.dtype) {
      case hearth::DType::kBool:
        if (exact && static_cast<uint8_t>(p[i]) > 1) return false;
        continue;
      case hearth::DType::kF16:
      case hearth::DType::kBF16: {
        uint16_t bits;
        std::memcpy(&bits, p + 2 * i, 2);
        v = t.dtype == hearth::DType::kF16 ? hearth::HalfToFloat(bits)
                                           : hearth::BFloat16ToFloat(bits);
        break;
      }
      case hearth::DType::kF32: {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        v = f;
        break;
      }
      case hearth::DType::kF64:
        std::memcpy(&v, p + 8 * i, 8);
        break;
      default:
        continue;
    }
    if (!std::isfinite(v)) return false;
  }
  return true;
}

// Echoes the inputs as outputs through the encoder: as JSON, they must parse
// back (as inputs of a new request: so the JSON is valid, whatever bytes a
// BYTES output holds) to the same bytes where JSON can say them; as binary,
// the body must carry them after the JSON.
void CheckEncoderRoundTrip(const InferRequest& request) {
  hearth::InferResponse response;
  response.model = request.model;
  response.version = request.version;
  response.outputs = request.inputs;
  bool readable = true;
  for (const InferTensor& t : response.outputs) readable = readable && JsonCanHold(t, false);
  for (const bool binary : {false, true}) {
    hearth::OutputSelection selection;
    selection.binary_data_output = binary;
    hearth::Result<hearth::EncodedInferResponse> encoded =
        hearth::EncodeInferResponse(response, selection);
    Require(encoded.ok(), "an accepted request's tensors encode");
    if (binary) {
      if (response.outputs.empty()) continue;
      Require(encoded->json_length.has_value(), "binary outputs: a JSON length");
      size_t offset = *encoded->json_length;
      for (const InferTensor& t : response.outputs) {
        Require(offset + t.data.size() <= encoded->body.size(), "binary output inside the body");
        Require(t.data.empty() ||
                    std::memcmp(encoded->body.data() + offset, t.data.data(), t.data.size()) == 0,
                "binary output bytes");
        offset += t.data.size();
      }
      Require(offset == encoded->body.size(), "nothing after the binary outputs");
      continue;
    }
    if (!readable) continue;
    // {"model_name":..,"outputs":[...]} read as a request: outputs and inputs
    // have the same fields.
    const std::string& text = encoded->body;
    const size_t at = text.find(",\"outputs\":");
    Require(at != std::string::npos, "outputs in the response");
    std::string again = "{\"inputs\":" + text.substr(at + 11);
    hearth::Result<InferRequest> parsed =
        hearth::ParseInferRequest(std::move(again), std::nullopt, "m", "v");
    if (!parsed.ok()) std::fprintf(stderr, "%s\n", parsed.status().ToString().c_str());
    Require(parsed.ok(), "an encoded response parses back");
    Require(parsed->inputs.size() == response.outputs.size(), "as many tensors back");
    for (size_t i = 0; i < parsed->inputs.size(); ++i) {
      const InferTensor& back = parsed->inputs[i];
      const InferTensor& sent = response.outputs[i];
      Require(back.name == sent.name && back.dtype == sent.dtype && back.shape == sent.shape,
              "name, datatype and shape back");
      if (JsonCanHold(sent, true))
        Require(SameBytes(back, sent), "the same values back through JSON");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  ++data;
  --size;
  std::optional<uint64_t> json_length;
  if ((flags & 1) != 0) {
    if (size < 4) return 0;
    const uint32_t value = LoadLittleEndian32(data);
    data += 4;
    size -= 4;
    json_length = (flags & 2) != 0 ? size - std::min<uint64_t>(value, size) : value;
  }
  const std::string body(reinterpret_cast<const char*>(data), size);
  hearth::Result<InferRequest> request = hearth::ParseInferRequest(body, json_length, "m", "v");
  // The service's rules for the parameters, as it applies them.
  if (request.ok()) {
    const hearth::Status admitted = hearth::AdmitParameters(*request);
    if (!admitted.ok()) request = admitted;
  }
  if (request.ok()) {
    CheckAccepted(*request, body, json_length);
    hearth::ModelMetadata metadata;
    metadata.name = "m";
    metadata.max_batch_size = 8;
    metadata.inputs = {{"x", hearth::DType::kF32, {-1, 4}}, {"s", hearth::DType::kBytes, {-1, -1}}};
    metadata.outputs = {{"y", hearth::DType::kF32, {-1, 1}}};
    (void)hearth::ValidateInferRequest(*request, metadata);
    const bool in_shared_memory =
        std::any_of(request->inputs.begin(), request->inputs.end(),
                    [](const InferTensor& input) { return input.shm.has_value(); });
    if (!in_shared_memory) CheckEncoderRoundTrip(*request);
  } else {
    const hearth::StatusCode code = request.status().code();
    Require(code == hearth::StatusCode::kInvalidArgument ||
                code == hearth::StatusCode::kResourceExhausted,
            "InvalidArgument (or ResourceExhausted when out of memory)");
    Require(!request.status().message().empty(), "the error says what is wrong");
  }
  return 0;
}
