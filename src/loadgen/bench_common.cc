#include "loadgen/bench_common.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/checked_size.h"
#include "loadgen/cuda_shm.h"
#include "loadgen/system_shm.h"

namespace hearth::bench {
namespace {

// Every byte of the outputs' room before a checked request: NaN as FP32,
// FP16 or BF16 and -1 as any integer, which no model of a benchmark answers.
constexpr unsigned char kPoison = 0xff;
// Tensors in a slot's region start at this alignment.
constexpr uint64_t kTensorAlignment = 64;

// IEEE half from a float in a modest range (the random inputs are); values
// below the half normal range flush to zero.
uint16_t ToHalf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  if (exponent <= 0) return static_cast<uint16_t>(sign);
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) |
                               ((bits >> 13) & 0x3ff));
}

template <typename T>
void AppendRaw(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  // Nearest rank: the smallest value with at least p of the samples at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace

size_t ElementBytes(const std::string& datatype) {
  if (datatype == "FP32" || datatype == "INT32" || datatype == "UINT32") return 4;
  if (datatype == "FP64" || datatype == "INT64" || datatype == "UINT64") return 8;
  if (datatype == "FP16" || datatype == "BF16" || datatype == "INT16" || datatype == "UINT16")
    return 2;
  if (datatype == "INT8" || datatype == "UINT8" || datatype == "BOOL") return 1;
  return 0;
}

std::string ModelLabel(const BenchOptions& options) {
  return "model '" + options.model + "'" +
         (options.version.empty() ? "" : " version " + options.version);
}

Result<ModelSpec> ResolveModel(const BenchOptions& options, int64_t max_batch,
                               const std::vector<TensorMetadata>& inputs,
                               const std::vector<TensorMetadata>& outputs) {
  ModelSpec model;
  model.label = ModelLabel(options);
  const std::string& label = model.label;
  if (inputs.empty()) return InvalidArgument("metadata of " + label + " lists no inputs");
  if (max_batch == 0 && options.batch != 1)
    return InvalidArgument(label + " has no batch dimension; --batch must be 1");
  if (max_batch > 0 && options.batch > max_batch) {
    return InvalidArgument("--batch " + std::to_string(options.batch) + " exceeds " + label +
                           "'s max_batch_size " + std::to_string(max_batch));
  }
  // The request's shape: the batch in front of a batching model's dims.
  auto shape_of = [&](const TensorMetadata& tensor,
                      const char* what) -> Result<std::vector<int64_t>> {
    std::vector<int64_t> dims = tensor.dims;
    if (max_batch > 0) {
      if (dims.empty() || dims.front() != -1) {
        return InvalidArgument(std::string(what) + " '" + tensor.name + "' of batching " + label +
                               " does not start with the batch dimension -1");
      }
      dims.front() = options.batch;
    }
    return dims;
  };
  for (const TensorMetadata& tensor : inputs) {
    TensorSpec input;
    input.name = tensor.name;
    input.datatype = tensor.datatype;
    const size_t element = ElementBytes(input.datatype);
    if (element == 0) {
      return Unimplemented(
          "input '" + input.name + "' of " + label + " has datatype " + input.datatype +
          "; bench supports FP32, FP64, FP16, BF16, INT8, INT16, INT32, INT64, UINT8, UINT16, "
          "UINT32, UINT64 and BOOL");
    }
    ASSIGN_OR_RETURN(input.shape, shape_of(tensor, "input"));
    for (int64_t d : input.shape) {
      if (d < 0) {
        return Unimplemented("input '" + input.name + "' of " + label +
                             " has a variable dimension; bench needs fixed dims");
      }
    }
    ASSIGN_OR_RETURN(const uint64_t elements,
                     ShapeElements(input.shape, "input '" + input.name + "'"));
    ASSIGN_OR_RETURN(input.bytes, CountBytes(elements, element, "input '" + input.name + "'"));
    input.elements = static_cast<int64_t>(elements);
    model.inputs.push_back(std::move(input));
  }

  const bool shm = options.shared_memory != BenchSharedMemory::kNone;
  std::vector<std::string> names = options.outputs;
  if (names.empty() && shm) {
    for (const TensorMetadata& tensor : outputs) names.push_back(tensor.name);
    if (names.empty()) return InvalidArgument("metadata of " + label + " lists no outputs");
  }
  for (const std::string& name : names) {
    TensorSpec output;
    output.name = name;
    const auto it = std::find_if(outputs.begin(), outputs.end(),
                                 [&](const TensorMetadata& t) { return t.name == name; });
    // Without shared memory an unknown output is the server's to refuse (a
    // failed request); with it, its room must be known before the run.
    if (it == outputs.end()) {
      if (shm) return InvalidArgument(label + " has no output '" + name + "'");
      model.outputs.push_back(std::move(output));
      continue;
    }
    output.datatype = it->datatype;
    if (shm && options.output_shared_memory_size > 0) {
      output.bytes = options.output_shared_memory_size;
    } else if (shm) {
      const size_t element = ElementBytes(output.datatype);
      ASSIGN_OR_RETURN(output.shape, shape_of(*it, "output"));
      const bool fixed =
          std::all_of(output.shape.begin(), output.shape.end(), [](int64_t d) { return d >= 0; });
      if (element == 0 || !fixed) {
        return InvalidArgument("output '" + name + "' of " + label + " (" + output.datatype +
                               ") has no fixed size; give --output-shared-memory-size");
      }
      ASSIGN_OR_RETURN(const uint64_t elements,
                       ShapeElements(output.shape, "output '" + name + "'"));
      ASSIGN_OR_RETURN(output.bytes, CountBytes(elements, element, "output '" + name + "'"));
      output.elements = static_cast<int64_t>(elements);
      if (output.bytes == 0) {
        return InvalidArgument("output '" + name + "' of " + label +
                               " has 0 bytes; give --output-shared-memory-size");
      }
    }
    model.outputs.push_back(std::move(output));
  }
  return model;
}

std::string RandomInputBytes(const TensorSpec& input, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> small(0, 9);
  std::bernoulli_distribution coin;
  const std::string& t = input.datatype;
  std::string bytes;
  bytes.reserve(input.bytes);
  for (int64_t i = 0; i < input.elements; ++i) {
    if (t == "FP32") {
      AppendRaw(bytes, normal(rng));
    } else if (t == "FP64") {
      AppendRaw(bytes, static_cast<double>(normal(rng)));
    } else if (t == "FP16") {
      AppendRaw(bytes, ToHalf(normal(rng)));
    } else if (t == "BF16") {
      const float v = normal(rng);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      AppendRaw(bytes, static_cast<uint16_t>(bits >> 16));
    } else if (t == "BOOL") {
      AppendRaw(bytes, static_cast<uint8_t>(coin(rng)));
    } else {  // integers: small non-negative values, safe as indices
      const int v = small(rng);
      switch (ElementBytes(t)) {
        case 8:
          AppendRaw(bytes, static_cast<int64_t>(v));
          break;
        case 4:
          AppendRaw(bytes, static_cast<int32_t>(v));
          break;
        case 2:
          AppendRaw(bytes, static_cast<int16_t>(v));
          break;
        default:
          AppendRaw(bytes, static_cast<int8_t>(v));
          break;
      }
    }
  }
  return bytes;
}

// ---- shared memory (system or CUDA) ----------------------------------------------

std::string CudaRegisterBody(const RegionHandle& handle) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const std::string& in = handle.ipc_handle;
  std::string b64;
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t group = static_cast<uint32_t>(static_cast<unsigned char>(in[i])) << 16;
    if (i + 1 < in.size())
      group |= static_cast<uint32_t>(static_cast<unsigned char>(in[i + 1])) << 8;
    if (i + 2 < in.size()) group |= static_cast<unsigned char>(in[i + 2]);
    b64 += kAlphabet[(group >> 18) & 63];
    b64 += kAlphabet[(group >> 12) & 63];
    b64 += i + 1 < in.size() ? kAlphabet[(group >> 6) & 63] : '=';
    b64 += i + 2 < in.size() ? kAlphabet[group & 63] : '=';
  }
  return "{\"raw_handle\":{\"b64\":\"" + b64 +
         "\"},\"device_id\":" + std::to_string(handle.device_id) +
         ",\"byte_size\":" + std::to_string(handle.byte_size) + "}";
}

RegionFactory DefaultRegionFactory(const BenchOptions& options) {
  if (options.shared_memory == BenchSharedMemory::kCuda) {
    const int device = options.shared_memory_device;
    return [device](const std::string&, uint64_t bytes) -> Result<std::unique_ptr<ShmRegion>> {
      ASSIGN_OR_RETURN(std::unique_ptr<CudaShmRegion> region, CudaShmRegion::Create(device, bytes));
      return std::unique_ptr<ShmRegion>(std::move(region));
    };
  }
  return [](const std::string& name, uint64_t bytes) -> Result<std::unique_ptr<ShmRegion>> {
    ASSIGN_OR_RETURN(std::unique_ptr<SystemShmRegion> region,
                     SystemShmRegion::Create("/" + name, bytes));
    return std::unique_ptr<ShmRegion>(std::move(region));
  };
}

Result<std::unique_ptr<ShmSession>> ShmSession::Create(const ModelSpec& model,
                                                       const BenchOptions& options, int slots,
                                                       RegionControl* control,
                                                       const RegionFactory& factory,
                                                       std::mt19937_64& rng) {
  std::unique_ptr<ShmSession> session(new ShmSession(model, options, control));
  // One layout for every slot: the inputs, then each output's room.
  ShmSlot layout;
  uint64_t size = 0;
  auto place = [&](uint64_t bytes, const std::string& what) -> Result<ShmTensor> {
    const std::optional<uint64_t> at = CheckedAlignUp(size, kTensorAlignment);
    const std::optional<uint64_t> end = at ? CheckedAdd(*at, bytes) : std::nullopt;
    if (!end) return InvalidArgument(what + " does not fit in a shared-memory region");
    size = *end;
    return ShmTensor{*at, bytes};
  };
  for (const TensorSpec& input : model.inputs) {
    ASSIGN_OR_RETURN(ShmTensor placed, place(input.bytes, "input '" + input.name + "'"));
    layout.inputs.push_back(placed);
  }
  for (const TensorSpec& output : model.outputs) {
    ASSIGN_OR_RETURN(ShmTensor placed, place(output.bytes, "output '" + output.name + "'"));
    layout.outputs.push_back(placed);
  }
  if (size == 0) size = 1;  // inputs of 0 elements and no output: still a region
  if (size > (uint64_t{1} << 40))
    return InvalidArgument("a request slot needs " + std::to_string(size) +
                           " bytes of shared memory; bench allows at most 1 TiB");
  const std::string tag = RunTag();
  for (int i = 0; i < slots; ++i) {
    ShmSlot slot;
    slot.inputs = layout.inputs;
    slot.outputs = layout.outputs;
    slot.readback.resize(slot.outputs.size());
    slot.region = tag + "-" + std::to_string(i);
    const std::string which = "slot " + std::to_string(i + 1) + " of " + std::to_string(slots);
    Result<std::unique_ptr<ShmRegion>> made = factory(slot.region, size);
    if (!made.ok()) {
      return made.status().WithContext("making shared-memory region '" + slot.region + "' (" +
                                       std::to_string(size) + " bytes; " + which + ")");
    }
    slot.memory = std::move(*made);
    ShmRegion& memory = *slot.memory;
    for (size_t k = 0; k < model.inputs.size(); ++k) {
      const std::string bytes = RandomInputBytes(model.inputs[k], rng);
      RETURN_IF_ERROR(memory.Write(slot.inputs[k].offset, bytes.data(), bytes.size()));
    }
    for (const ShmTensor& output : slot.outputs)
      RETURN_IF_ERROR(memory.Fill(output.offset, kPoison, output.bytes));
    const RegionHandle handle = memory.Handle();
    if (Status s = control->Register(slot.region, handle); !s.ok()) {
      return Status(s.code(), "registering shared-memory region '" + slot.region + "' (" +
                                  memory.Describe() + ", " + std::to_string(size) + " bytes; " +
                                  which + "): " + s.message());
    }
    session->registered_.emplace_back(handle.kind, slot.region);
    // The server holds the region now (a system object's name has served its purpose).
    memory.Registered();
    session->slots_.push_back(std::move(slot));
  }
  return session;
}

ShmSession::~ShmSession() {
  // Before the slots (and their regions) are destroyed: a CUDA region is
  // freed only once the server has let go of it.
  for (const auto& [kind, name] : registered_) {
    // Best effort: a server that went away has forgotten its regions anyway.
    (void)control_->Unregister(kind, name);
  }
}

void ShmSession::BeforeRequest(ShmSlot& slot) const {
  slot.poison = Status::Ok();
  if (!options_.verify || !slot.first_checked) return;  // the first one's poison is in place
  for (const ShmTensor& output : slot.outputs) {
    slot.poison = slot.memory->Fill(output.offset, kPoison, output.bytes);
    if (!slot.poison.ok()) return;
  }
}

Status ShmSession::AfterResponse(ShmSlot& slot, const std::vector<OutputPlacement>& outputs,
                                 RunRecord* record) {
  const bool checked = Checked(slot);
  if (checked && !slot.poison.ok()) {
    return Status(slot.poison.code(), "writing the poison into region '" + slot.region +
                                          "' before the request: " + slot.poison.message());
  }
  for (size_t k = 0; k < model_.outputs.size(); ++k) {
    const std::string& name = model_.outputs[k].name;
    const auto it = std::find_if(outputs.begin(), outputs.end(),
                                 [&](const OutputPlacement& o) { return o.name == name; });
    if (it == outputs.end()) return Internal("the response has no output '" + name + "'");
    if (it->inline_data)
      return Internal("output '" + name + "' came back inline, not in shared memory");
    const ShmTensor& room = slot.outputs[k];
    if (!it->where_asked &&
        (!it->in_region || it->region != slot.region || it->offset != room.offset)) {
      return Internal(
          "output '" + name + "' names " +
          (it->in_region ? "region '" + it->region + "' at offset " + std::to_string(it->offset)
                         : std::string("no shared-memory region")) +
          ", not region '" + slot.region + "' at offset " + std::to_string(room.offset));
    }
    if (it->byte_size > room.bytes) {
      return Internal("output '" + name + "' claims " + std::to_string(it->byte_size) +
                      " bytes in its room of " + std::to_string(room.bytes));
    }
    if (checked) {
      std::string& bytes = slot.readback[k];
      bytes.resize(it->byte_size);
      RETURN_IF_ERROR(
          slot.memory->Read(room.offset, bytes.data(), bytes.size())
              .WithContext("reading output '" + name + "' back from region '" + slot.region + "'"));
      const bool untouched = !bytes.empty() && std::all_of(bytes.begin(), bytes.end(), [](char b) {
        return static_cast<unsigned char>(b) == kPoison;
      });
      if (untouched) {
        return Internal("output '" + name + "': the server answered, but its " +
                        std::to_string(it->byte_size) + " bytes in region '" + slot.region +
                        "' still hold the poison written before the request");
      }
    }
  }
  if (!checked) return Status::Ok();
  auto make_sample = [&]() -> Result<BenchShmSample> {
    BenchShmSample sample;
    for (size_t k = 0; k < model_.inputs.size(); ++k) {
      std::string bytes(slot.inputs[k].bytes, '\0');
      RETURN_IF_ERROR(slot.memory->Read(slot.inputs[k].offset, bytes.data(), bytes.size())
                          .WithContext("reading input '" + model_.inputs[k].name +
                                       "' back from region '" + slot.region + "'"));
      sample.inputs.push_back({model_.inputs[k].name, std::move(bytes)});
    }
    for (size_t k = 0; k < model_.outputs.size(); ++k)
      sample.outputs.push_back({model_.outputs[k].name, slot.readback[k]});
    return sample;
  };
  RETURN_IF_ERROR(record->RecordChecked(make_sample));
  slot.first_checked = true;
  return Status::Ok();
}

// ---- the record of a run --------------------------------------------------------

void RunRecord::RecordSample(Clock::time_point start, Clock::time_point done) {
  std::lock_guard lock(mu_);
  samples_.push_back({start, std::chrono::duration<double, std::milli>(done - start).count()});
}

void RunRecord::RecordError(const std::string& message) {
  std::lock_guard lock(mu_);
  if (static_cast<int>(first_errors_.size()) < options_.errors_to_print) {
    first_errors_.push_back(message);
    if (err_ != nullptr) std::fprintf(err_, "hearth bench: request failed: %s\n", message.c_str());
  }
  ++errors_;
}

Status RunRecord::RecordChecked(const std::function<Result<BenchShmSample>()>& make_sample) {
  std::lock_guard lock(mu_);
  if (!sample_) {
    ASSIGN_OR_RETURN(sample_, make_sample());
  }
  ++checked_;
  return Status::Ok();
}

void RunRecord::Summarize(Clock::time_point measure_begin, Clock::time_point measure_end,
                          BenchReport* report) {
  std::lock_guard lock(mu_);
  std::vector<double> latencies;
  double sum = 0;
  for (const Sample& s : samples_) {
    if (s.start < measure_begin || s.start >= measure_end) continue;
    latencies.push_back(s.latency_ms);
    sum += s.latency_ms;
  }
  std::sort(latencies.begin(), latencies.end());
  report->seconds = options_.seconds;
  report->requests = latencies.size();
  report->errors = errors_;
  report->first_errors = first_errors_;
  report->shm_checked = checked_;
  report->shm_sample = sample_;
  report->requests_per_s = static_cast<double>(report->requests) / report->seconds;
  report->inferences_per_s = report->requests_per_s * report->batch;
  if (!latencies.empty()) {
    report->latency_ms = {Percentile(latencies, 0.50), Percentile(latencies, 0.90),
                          Percentile(latencies, 0.99), latencies.back(),
                          sum / static_cast<double>(latencies.size())};
  }
}

std::string RunTag() {
  std::random_device device;
  char tag[64];
  std::snprintf(tag, sizeof(tag), "hearth-bench-%d-%08x", static_cast<int>(::getpid()),
                static_cast<unsigned>(device()));
  return tag;
}

}  // namespace hearth::bench
