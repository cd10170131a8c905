#include "backends/engine_export.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <map>
#include <string>

#include "backends/c_engine.h"

namespace hearth {
namespace {

// Writes `s` as a function of the ABI answers it.
int ToC(const Status& s, char* error, size_t error_size) noexcept {
  if (s.ok()) return 0;
  if (error != nullptr && error_size > 0) {
    const size_t n = std::min(error_size - 1, s.message().size());
    std::memcpy(error, s.message().data(), n);
    error[n] = '\0';
  }
  return static_cast<int>(s.code());
}

// The status a C callback answered: `code` != 0, `message` NUL-terminated
// within `size` bytes (or not at all).
Status FromC(int code, const char* message, size_t size) {
  const std::string text(message, strnlen(message, size));
  if (code <= 0 || code > static_cast<int>(StatusCode::kDeviceLost))
    return Internal("the worker's sink answered status code " + std::to_string(code) + ": " + text);
  return Status(static_cast<StatusCode>(code), text);
}

// What the exception in flight says.
std::string Describe(std::exception_ptr thrown) {
  try {
    std::rethrow_exception(thrown);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is no std::exception";
  }
}

// The config's inputs or outputs as the caller gave them, checked.
Result<std::vector<IoSpec>> IoSpecs(const HearthEngineSpec* specs, size_t count,
                                    std::string_view what) {
  std::vector<IoSpec> out;
  if (count == 0) return out;
  if (specs == nullptr)
    return InvalidArgument("hearth_create_engine: null " + std::string(what) + "s");
  if (count > 4096)
    return InvalidArgument("hearth_create_engine: " + std::to_string(count) + " " +
                           std::string(what) + "s");
  out.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const HearthEngineSpec& s = specs[i];
    if (s.name == nullptr || s.rank < 0 || s.rank > 64 || (s.rank > 0 && s.dims == nullptr) ||
        s.dtype < 0 || s.dtype > 255)
      return InvalidArgument("hearth_create_engine: " + std::string(what) + " #" +
                             std::to_string(i) + " is malformed");
    out.push_back(
        {s.name, static_cast<DType>(s.dtype), std::vector<int64_t>(s.dims, s.dims + s.rank)});
  }
  return out;
}

// An exported engine: the handle the C caller holds.
struct Exported {
  std::unique_ptr<Engine> engine;
  std::string name;
  std::vector<HearthEngineSpec> inputs, outputs;  // over the engine's own specs
  // Per request held: its inputs as the engine's EngineRequest views them.
  // The bytes and shapes they point to are the caller's (valid until the
  // request ends, by the ABI); the array of them is ours, since the
  // caller's HearthEngineInput array lives for the add call only.
  std::map<uint64_t, std::vector<EngineInput>> held;
};

Exported& Of(void* handle) { return *static_cast<Exported*>(handle); }

// Runs `body` (returning Status) for the C caller: an exception becomes
// Internal naming the engine and `what`.
template <typename Body>
int Guarded(Exported& e, const char* what, char* error, size_t error_size, Body&& body) noexcept {
  try {
    return ToC(body(), error, error_size);
  } catch (...) {
    const std::exception_ptr thrown = std::current_exception();
    try {
      return ToC(Internal("engine '" + e.name + "': " + what + " threw: " + Describe(thrown)),
                 error, error_size);
    } catch (...) {  // no memory for the message
      return ToC(Status(StatusCode::kInternal, {}), error, error_size);
    }
  }
}

// For the functions that have no error to return: `fallback` if `body`
// throws, and a log line that says so.
template <typename T, typename Body>
T Answer(Exported& e, const char* what, T fallback, Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    const std::exception_ptr thrown = std::current_exception();
    try {
      spdlog::error("engine '{}': {} threw: {}", e.name, what, Describe(thrown));
    } catch (...) {
    }
    return fallback;
  }
}

// The caller's C sink as the ResponseSink the engine's Step gets. A request
// that ends here (a final response, an error, or an id the worker no longer
// holds) lets go of its inputs.
class ExportedSink final : public ResponseSink {
 public:
  ExportedSink(Exported& e, const HearthEngineSink& c) : e_(e), c_(c) {}

  Result<std::byte*> Output(uint64_t id, size_t i, std::span<const int64_t> shape,
                            uint64_t bytes) override {
    void* room = nullptr;
    std::array<char, 4096> error{};
    const int code = c_.output(c_.context, id, i, shape.data(), static_cast<int32_t>(shape.size()),
                               bytes, &room, error.data(), error.size());
    if (code != 0) return FromC(code, error.data(), error.size());
    if (room == nullptr && bytes > 0)
      return Internal("the worker's sink gave no room for output " + std::to_string(i) +
                      " of request " + std::to_string(id));
    return static_cast<std::byte*>(room);
  }

  Result<bool> End(uint64_t id, bool final, const Status& status) override {
    int32_t sent = 0;
    std::array<char, 4096> error{};
    const int code = c_.end(c_.context, id, final ? 1 : 0, static_cast<int32_t>(status.code()),
                            status.message().c_str(), &sent, error.data(), error.size());
    if (code != 0) return FromC(code, error.data(), error.size());
    if (final || !status.ok() || sent == 0) e_.held.erase(id);
    return sent != 0;
  }

 private:
  Exported& e_;
  const HearthEngineSink& c_;
};

void Destroy(void* handle) { delete &Of(handle); }  // ~Engine is noexcept

void Inputs(void* handle, const HearthEngineSpec** specs, size_t* count) {
  *specs = Of(handle).inputs.data();
  *count = Of(handle).inputs.size();
}

void Outputs(void* handle, const HearthEngineSpec** specs, size_t* count) {
  *specs = Of(handle).outputs.data();
  *count = Of(handle).outputs.size();
}

uint32_t Capacity(void* handle) {
  Exported& e = Of(handle);
  return Answer(e, "capacity", uint32_t{0}, [&] { return e.engine->capacity(); });
}

uint64_t DeviceMemoryBytes(void* handle) {
  Exported& e = Of(handle);
  return Answer(e, "device_memory_bytes", uint64_t{0},
                [&] { return e.engine->device_memory_bytes(); });
}

int32_t Busy(void* handle) {
  Exported& e = Of(handle);
  return Answer(e, "busy", int32_t{1}, [&] { return e.engine->busy() ? int32_t{1} : int32_t{0}; });
}

void Counters(void* handle, uint64_t* used, uint64_t* total, uint64_t* preemptions) {
  Exported& e = Of(handle);
  const EngineCounters c =
      Answer(e, "counters", EngineCounters{}, [&] { return e.engine->counters(); });
  *used = c.kv_blocks_used;
  *total = c.kv_blocks_total;
  *preemptions = c.preemptions;
}

void Cancel(void* handle, uint64_t id) {
  Exported& e = Of(handle);
  Answer(e, "cancel", 0, [&] {
    e.engine->Cancel(id);
    e.held.erase(id);
    return 0;
  });
}

int Add(void* handle, uint64_t id, const HearthEngineRequest* request, char* error,
        size_t error_size) {
  Exported& e = Of(handle);
  return Guarded(e, "add", error, error_size, [&]() -> Status {
    if (request == nullptr || (request->num_inputs > 0 && request->inputs == nullptr) ||
        (request->parameters_bytes > 0 && request->parameters_json == nullptr) ||
        (request->num_resume > 0 && request->resume == nullptr))
      return InvalidArgument("add: a null request, or a count without its array");
    if (e.held.count(id) != 0)
      return InvalidArgument("add: request " + std::to_string(id) + " is held");
    std::vector<EngineInput> inputs;
    inputs.reserve(request->num_inputs);
    for (size_t i = 0; i < request->num_inputs; ++i) {
      const HearthEngineInput& in = request->inputs[i];
      if (in.rank < 0 || (in.rank > 0 && in.shape == nullptr) ||
          (in.bytes > 0 && in.data == nullptr))
        return InvalidArgument("add: input " + std::to_string(i) +
                               " has a negative rank, or no shape or data");
      inputs.push_back({{static_cast<const std::byte*>(in.data), in.bytes},
                        {in.shape, static_cast<size_t>(in.rank)}});
    }
    // A map's elements stay where they are: the request's view of its
    // inputs holds while the request is held.
    const auto it = e.held.emplace(id, std::move(inputs)).first;
    const EngineRequest r{it->second,
                          {request->parameters_json, request->parameters_bytes},
                          {request->resume, request->num_resume}};
    Status s = Status::Ok();
    try {
      s = e.engine->Add(id, r);
    } catch (...) {
      e.held.erase(it);
      throw;
    }
    if (!s.ok()) e.held.erase(it);
    return s;
  });
}

int Step(void* handle, const HearthEngineSink* sink, char* error, size_t error_size) {
  Exported& e = Of(handle);
  return Guarded(e, "step", error, error_size, [&]() -> Status {
    if (sink == nullptr || sink->output == nullptr || sink->end == nullptr)
      return InvalidArgument("step: no sink, or one without its functions");
    ExportedSink s(e, *sink);
    return e.engine->Step(s);
  });
}

constexpr HearthEngineTable kTable = {
    HEARTH_ENGINE_ABI_VERSION,
    sizeof(HearthEngineTable),
    Destroy,
    Inputs,
    Outputs,
    Capacity,
    DeviceMemoryBytes,
    Add,
    Cancel,
    Step,
    Busy,
    Counters,
};

// The weights as views, checked: each well formed and on `device`.
Result<std::vector<TensorView>> Views(const HearthCudaTensor* weights, size_t num_weights,
                                      Device device) {
  std::vector<TensorView> views(num_weights);
  for (size_t i = 0; i < num_weights; ++i) {
    const HearthCudaTensor& t = weights[i];
    if (t.name == nullptr || t.rank < 0 || (t.rank > 0 && t.shape == nullptr) || t.dtype < 0 ||
        !IsStoredDType(t.dtype) ||
        (t.device_kind != static_cast<int32_t>(DeviceKind::kHost) &&
         t.device_kind != static_cast<int32_t>(DeviceKind::kCuda)) ||
        (t.nbytes > 0 && t.data == nullptr))
      return InvalidArgument("malformed weight #" + std::to_string(i));
    TensorView& v = views[i];
    v.name = t.name;
    v.dtype = static_cast<DType>(t.dtype);
    v.shape.assign(t.shape, t.shape + t.rank);
    v.data = t.data;
    v.nbytes = t.nbytes;
    v.device = Device{static_cast<DeviceKind>(t.device_kind), t.device_index};
    if (v.device != device)
      return InvalidArgument("weight '" + v.name + "' is on " + v.device.ToString() +
                             ", but the engine runs on " + device.ToString());
  }
  return views;
}

Status Create(const ExportedEngines& engines, uint32_t abi_version, const char* kind,
              const HearthCudaTensor* weights, size_t num_weights, int32_t device_kind,
              int32_t device_index, const HearthEngineOptions* c, const HearthEngineTable** table,
              void** engine) {
  if (abi_version != HEARTH_ENGINE_ABI_VERSION)
    return FailedPrecondition(std::string(engines.library) + " speaks engine ABI version " +
                              std::to_string(HEARTH_ENGINE_ABI_VERSION) + ", the caller " +
                              std::to_string(abi_version) + ": it comes from another build");
  if (kind == nullptr || c == nullptr || table == nullptr || engine == nullptr ||
      (num_weights > 0 && weights == nullptr) ||
      (c->common.num_parameters > 0 &&
       (c->common.parameter_keys == nullptr || c->common.parameter_values == nullptr)))
    return InvalidArgument("hearth_create_engine: a null argument");
  *table = nullptr;
  *engine = nullptr;
  const std::string_view name(kind);
  const ExportedEngineKind* found = nullptr;
  std::string known;
  for (const ExportedEngineKind& k : engines.kinds) {
    if (name == k.name) found = &k;
    known += (known.empty() ? "" : ", ") + std::string(k.name);
  }
  if (found == nullptr)
    return FailedPrecondition(std::string(engines.library) + " has no engine '" +
                              std::string(name) +
                              "' (its engines: " + (known.empty() ? "none" : known) + ")");
  Device device;
  if (device_kind == static_cast<int32_t>(DeviceKind::kHost) && engines.on_host) {
    device = Device::Host();
  } else if (device_kind == static_cast<int32_t>(DeviceKind::kCuda) && engines.on_cuda &&
             device_index >= 0) {
    device = Device::Cuda(device_index);
  } else {
    return InvalidArgument(std::string(engines.library) + " builds no engine on device kind " +
                           std::to_string(device_kind) + " index " + std::to_string(device_index));
  }
  ASSIGN_OR_RETURN(std::vector<TensorView> views, Views(weights, num_weights, device));

  EngineOptions options;
  options.max_batch_size = c->common.max_batch_size;
  options.allow_tf32 = c->common.allow_tf32 != 0;
  for (size_t i = 0; i < c->common.num_parameters; ++i) {
    if (c->common.parameter_keys[i] == nullptr || c->common.parameter_values[i] == nullptr)
      return InvalidArgument("hearth_create_engine: parameter #" + std::to_string(i) + " is null");
    options.parameters[c->common.parameter_keys[i]] = c->common.parameter_values[i];
  }
  options.version_dir = c->version_dir != nullptr ? c->version_dir : "";
  options.batching = c->batching != 0;
  options.max_streams = c->max_streams;
  ASSIGN_OR_RETURN(options.inputs, IoSpecs(c->inputs, c->num_inputs, "input"));
  ASSIGN_OR_RETURN(options.outputs, IoSpecs(c->outputs, c->num_outputs, "output"));

  Result<std::unique_ptr<Engine>> built = Internal("not built");
  try {
    built = found->create(views, device, options);
  } catch (...) {
    return Internal(std::string(engines.library) + ": creating engine '" + std::string(name) +
                    "' threw: " + Describe(std::current_exception()));
  }
  if (!built.ok()) return built.status();
  if (*built == nullptr)
    return Internal(std::string(engines.library) + ": engine '" + std::string(name) +
                    "' was built as null");
  return ExportEngine(std::move(built).value(), name, table, engine);
}

}  // namespace

Status ExportEngine(std::unique_ptr<Engine> engine, std::string_view name,
                    const HearthEngineTable** table, void** handle) noexcept {
  try {
    auto e = std::make_unique<Exported>();
    e->name = name;
    e->inputs = EngineSpecs(engine->inputs());
    e->outputs = EngineSpecs(engine->outputs());
    e->engine = std::move(engine);
    *table = &kTable;
    *handle = e.release();
    return Status::Ok();
  } catch (...) {
    const std::exception_ptr thrown = std::current_exception();
    try {
      return Internal("engine '" + std::string(name) +
                      "': its inputs or outputs threw: " + Describe(thrown));
    } catch (...) {
      return Status(StatusCode::kInternal, {});
    }
  }
}

int CreateExportedEngine(const ExportedEngines& engines, uint32_t abi_version, const char* kind,
                         const HearthCudaTensor* weights, size_t num_weights, int32_t device_kind,
                         int32_t device_index, const HearthEngineOptions* options,
                         const HearthEngineTable** table, void** engine, char* error,
                         size_t error_size) noexcept {
  try {
    return ToC(Create(engines, abi_version, kind, weights, num_weights, device_kind, device_index,
                      options, table, engine),
               error, error_size);
  } catch (...) {
    const std::exception_ptr thrown = std::current_exception();
    try {
      return ToC(Internal(std::string(engines.library) +
                          ": hearth_create_engine threw: " + Describe(thrown)),
                 error, error_size);
    } catch (...) {
      return ToC(Status(StatusCode::kInternal, {}), error, error_size);
    }
  }
}

}  // namespace hearth
