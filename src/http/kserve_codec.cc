// The KServe codec's validation, response encoding, metadata and errors
// (parsing requests: kserve_request.cc). nlohmann::json writes the metadata
// and quotes strings; responses are written by hand.
#include "http/kserve_codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>
#include <utility>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "common/float16.h"
#include "http/kserve_codec_internal.h"
#include "server/protocol_codes.h"

namespace hearth {

namespace kserve {

std::string Quote(std::string_view text) {
  return nlohmann::json(std::string(text))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string DatatypeString(DType dtype) {
  std::string_view name = KserveDatatypeName(dtype);
  return name.empty() ? std::string(DTypeName(dtype)) : std::string(name);
}

std::string InputLabel(std::string_view name) { return "input " + Quote(name); }

}  // namespace kserve

namespace {

using json = nlohmann::json;
using kserve::DatatypeString;
using kserve::InputLabel;
using kserve::Quote;

// Appends the elements of `tensor` as JSON values; floats in their shortest
// form that reads back to the same value, non-finite values as null (JSON has
// no NaN or infinity).
template <typename T>
void AppendNumber(std::string& out, T value) {
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(value)) {
      out += "null";
      return;
    }
  }
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  out.append(buffer, result.ptr);
}

template <typename T, typename Convert>
void AppendElements(std::string& out, const std::byte* data, size_t count, Convert convert) {
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) out += ',';
    T value;
    std::memcpy(&value, data + i * sizeof(T), sizeof(T));
    AppendNumber(out, convert(value));
  }
}

// The length of the UTF-8 sequence (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF) that starts at text[i], a byte of 0x80
// or more; 0 if none does.
size_t Utf8SequenceAt(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  const auto continuation = [&](size_t k) { return (byte(k) & 0xc0) == 0x80; };
  const unsigned char lead = byte(0);
  const size_t left = text.size() - i;
  if (lead >= 0xc2 && lead <= 0xdf) return left >= 2 && continuation(1) ? 2 : 0;
  if (lead >= 0xe0 && lead <= 0xef) {
    if (left < 3 || !continuation(1) || !continuation(2)) return 0;
    if (lead == 0xe0 && byte(1) < 0xa0) return 0;  // overlong
    if (lead == 0xed && byte(1) > 0x9f) return 0;  // a surrogate
    return 3;
  }
  if (lead >= 0xf0 && lead <= 0xf4) {
    if (left < 4 || !continuation(1) || !continuation(2) || !continuation(3)) return 0;
    if (lead == 0xf0 && byte(1) < 0x90) return 0;  // overlong
    if (lead == 0xf4 && byte(1) > 0x8f) return 0;  // past U+10FFFF
    return 4;
  }
  return 0;
}

void AppendEscaped(std::string& out, unsigned char c) {
  static constexpr char kHex[] = "0123456789abcdef";
  const char escaped[] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 0xf]};
  out.append(escaped, sizeof(escaped));
}

}  // namespace

namespace kserve {

// One BYTES element as a JSON string: UTF-8 as it is (with '"', '\\' and
// the control characters escaped), and each byte that is not part of a
// valid UTF-8 sequence as \u00XX, the character of the same value in
// Latin-1, so that the JSON is always valid (docs/data-plane.md, "BYTES
// tensors").
void AppendBytesString(std::string& out, std::string_view text) {
  out += '"';
  size_t plain = 0;  // start of the run of bytes not yet appended
  size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c != '"' && c != '\\' && c < 0x80) {
      ++i;
      continue;
    }
    if (c >= 0x80) {
      if (const size_t length = Utf8SequenceAt(text, i); length > 0) {
        i += length;
        continue;
      }
    }
    out.append(text.data() + plain, i - plain);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        AppendEscaped(out, c);
        break;
    }
    plain = ++i;
  }
  out.append(text.data() + plain, text.size() - plain);
  out += '"';
}

void AppendData(std::string& out, const InferTensor& tensor, uint64_t count) {
  const std::byte* data = tensor.data.data();
  const auto same = [](auto value) { return value; };
  out += '[';
  switch (tensor.dtype) {
    case DType::kBool:
      for (size_t i = 0; i < count; ++i) {
        if (i > 0) out += ',';
        out += data[i] != std::byte{0} ? "true" : "false";
      }
      break;
    case DType::kU8:
      AppendElements<uint8_t>(out, data, count, same);
      break;
    case DType::kU16:
      AppendElements<uint16_t>(out, data, count, same);
      break;
    case DType::kU32:
      AppendElements<uint32_t>(out, data, count, same);
      break;
    case DType::kU64:
      AppendElements<uint64_t>(out, data, count, same);
      break;
    case DType::kI8:
      AppendElements<int8_t>(out, data, count, same);
      break;
    case DType::kI16:
      AppendElements<int16_t>(out, data, count, same);
      break;
    case DType::kI32:
      AppendElements<int32_t>(out, data, count, same);
      break;
    case DType::kI64:
      AppendElements<int64_t>(out, data, count, same);
      break;
    case DType::kF16:
      AppendElements<uint16_t>(out, data, count, HalfToFloat);
      break;
    case DType::kBF16:
      AppendElements<uint16_t>(out, data, count, BFloat16ToFloat);
      break;
    case DType::kF32:
      AppendElements<float>(out, data, count, same);
      break;
    case DType::kF64:
      AppendElements<double>(out, data, count, same);
      break;
    case DType::kBytes: {
      bool first = true;
      for (std::string_view element : BytesElements(tensor.data.bytes())) {
        if (!first) out += ',';
        first = false;
        AppendBytesString(out, element);
      }
      break;
    }
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      break;  // refused before encoding; see EncodeInferResponse
  }
  out += ']';
}

Result<uint64_t> CheckOutputTensor(const InferTensor& tensor) {
  const std::string_view datatype = KserveDatatypeName(tensor.dtype);
  if (datatype.empty()) {
    return Internal("output " + Quote(tensor.name) + " has datatype " +
                    std::string(DTypeName(tensor.dtype)) + ", which KServe cannot name");
  }
  const std::string label = "output " + Quote(tensor.name);
  // Internal: the service, not the client, made this output. Its shape is
  // the one the service reports, whatever dims the model declares.
  const Result<uint64_t> count = ShapeElements(tensor.shape, label);
  if (!count.ok()) return Internal(count.status().message());
  if (tensor.dtype == DType::kBytes) {
    if (Status valid = ValidateBytesTensor(tensor.data.bytes(), *count, label); !valid.ok()) {
      return Internal(valid.message());
    }
  } else {
    const Result<uint64_t> bytes = ShapeBytes(tensor.dtype, tensor.shape, label);
    if (!bytes.ok()) return Internal(bytes.status().message());
    if (tensor.data.size() != *bytes) {
      return Internal(label + " has " + std::to_string(tensor.data.size()) +
                      " bytes, which does not match shape " + ShapeString(tensor.shape) + " of " +
                      std::string(datatype));
    }
  }
  return *count;
}

}  // namespace kserve

namespace {

using kserve::AppendData;
using kserve::CheckOutputTensor;

void AppendShape(std::string& out, const std::vector<int64_t>& shape) { out += ShapeString(shape); }

}  // namespace

OutputSelection SelectionOf(const InferRequest& request) {
  return OutputSelection{request.id, request.outputs, request.binary_data_output};
}

Result<EncodedInferResponse> EncodeInferResponse(const InferResponse& response,
                                                 const OutputSelection& selection) {
  struct Chosen {
    const InferTensor* tensor;
    bool binary;
    uint64_t count = 0;  // elements, once checked
  };
  std::vector<Chosen> chosen;
  if (selection.outputs.empty()) {
    for (const InferTensor& output : response.outputs) {
      chosen.push_back({&output, selection.binary_data_output});
    }
  } else {
    for (const RequestedOutput& requested : selection.outputs) {
      const InferTensor* found = nullptr;
      for (const InferTensor& output : response.outputs) {
        if (output.name == requested.name) found = &output;
      }
      if (found == nullptr) {
        return Internal("the model did not return requested output " + Quote(requested.name));
      }
      chosen.push_back({found, requested.binary});
    }
  }
  // Checked first, so that the body can be sized once: the binary outputs
  // are then appended without the string growing (one copy each, from
  // wherever the service keeps them into the body).
  size_t binary_bytes = 0;
  size_t json_estimate = 256 + response.model.size() + response.version.size() +
                         selection.id.size() + response.id.size();
  for (Chosen& c : chosen) {
    const InferTensor& tensor = *c.tensor;
    if (tensor.shm.has_value()) {
      // Written to the region by the service: only its name goes back.
      if (KserveDatatypeName(tensor.dtype).empty()) {
        return Internal("output " + Quote(tensor.name) + " has datatype " +
                        std::string(DTypeName(tensor.dtype)) + ", which KServe cannot name");
      }
      c.binary = false;
      json_estimate +=
          256 + tensor.name.size() + tensor.shm->region.size() + 21 * tensor.shape.size();
      continue;
    }
    const Result<uint64_t> count = CheckOutputTensor(tensor);
    if (!count.ok()) return count.status();
    c.count = *count;
    // Sizes of tensors that exist in memory: these sums cannot wrap, but
    // a wrong estimate would only cost a reallocation, never a bad write.
    json_estimate += 128 + tensor.name.size() + 21 * tensor.shape.size();
    if (c.binary) {
      binary_bytes += tensor.data.size();
    } else if (tensor.dtype == DType::kBytes) {
      // Quotes and a comma for each element; its bytes as they are, unless
      // they need escapes.
      json_estimate += tensor.data.size() + 3 * *count;
    } else {
      // The longest shortest-round-trip double, "-2.2250738585072014e-308", and a comma.
      json_estimate += 25 * *count;
    }
  }
  try {
    std::string out;
    out.reserve(json_estimate + binary_bytes);
    out += "{\"model_name\":" + Quote(response.model) +
           ",\"model_version\":" + Quote(response.version);
    const std::string& id = response.id.empty() ? selection.id : response.id;
    if (!id.empty()) out += ",\"id\":" + Quote(id);
    out += ",\"outputs\":[";
    for (size_t i = 0; i < chosen.size(); ++i) {
      const InferTensor& tensor = *chosen[i].tensor;
      if (i > 0) out += ',';
      out += "{\"name\":" + Quote(tensor.name) + ",\"datatype\":\"" +
             std::string(KserveDatatypeName(tensor.dtype)) + "\",\"shape\":";
      AppendShape(out, tensor.shape);
      if (tensor.shm.has_value()) {
        // As Triton answers an output written to shared memory: no data and
        // no parameters. Triton's C++ client reads any output with
        // parameters as binary data of binary_data_size bytes.
        out += '}';
      } else if (chosen[i].binary) {
        out += ",\"parameters\":{\"binary_data_size\":" + std::to_string(tensor.data.size()) + "}}";
      } else {
        out += ",\"data\":";
        AppendData(out, tensor, chosen[i].count);
        out += '}';
      }
    }
    out += "]}";
    EncodedInferResponse encoded;
    const bool any_binary =
        std::any_of(chosen.begin(), chosen.end(), [](const Chosen& c) { return c.binary; });
    if (any_binary) {
      encoded.json_length = out.size();
      out.reserve(out.size() + binary_bytes);  // a no-op unless the estimate fell short
      for (const Chosen& c : chosen) {
        if (!c.binary) continue;
        out.append(reinterpret_cast<const char*>(c.tensor->data.data()), c.tensor->data.size());
      }
    }
    encoded.body = std::move(out);
    return encoded;
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("out of memory encoding the response");
  }
}

std::string ModelMetadataJson(const ModelMetadata& metadata) {
  auto tensors = [](const std::vector<TensorMetadata>& list) {
    json out = json::array();
    for (const TensorMetadata& tensor : list) {
      out.push_back({{"name", tensor.name},
                     {"datatype", DatatypeString(tensor.dtype)},
                     {"shape", tensor.shape}});
    }
    return out;
  };
  json out = {{"name", metadata.name},
              {"versions", metadata.versions},
              {"platform", metadata.platform},
              {"inputs", tensors(metadata.inputs)},
              {"outputs", tensors(metadata.outputs)}};
  if (metadata.max_batch_size > 0) out["max_batch_size"] = metadata.max_batch_size;
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ServerMetadataJson(std::string_view name, std::string_view version,
                               const std::vector<std::string>& extensions) {
  const json out = {
      {"name", std::string(name)}, {"version", std::string(version)}, {"extensions", extensions}};
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ErrorJson(std::string_view message) { return "{\"error\":" + Quote(message) + "}"; }

int HttpStatusFor(StatusCode code) { return ProtocolCodesFor(code).http; }

Result<uint64_t> ParseJsonLength(std::string_view value) {
  uint64_t length = 0;
  const auto result = std::from_chars(value.data(), value.data() + value.size(), length);
  if (value.empty() || result.ec != std::errc() || result.ptr != value.data() + value.size() ||
      value.front() == '-' || value.front() == '+') {
    return InvalidArgument("Inference-Header-Content-Length must be a byte count, got " +
                           Quote(value));
  }
  return length;
}

}  // namespace hearth
