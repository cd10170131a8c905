// The C ABI (include/hearth/hearth.h) over hearth::AttachClient.
#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "hearth/attach.h"
#include "hearth/hearth.h"
#ifndef _WIN32
#include "worker/session.h"
#endif

// enum hearth_dtype is DType's numbering.
static_assert(HEARTH_BOOL == static_cast<int>(hearth::DType::kBool));
static_assert(HEARTH_F8_E5M2 == static_cast<int>(hearth::DType::kF8E5M2));
static_assert(HEARTH_BYTES == static_cast<int>(hearth::DType::kBytes));
static_assert(HEARTH_U64 == static_cast<int>(hearth::DType::kU64));
static_assert(HEARTH_U64 + 1 == hearth::kDTypeLimit);

namespace {

thread_local std::string g_last_error;
thread_local std::string g_default_socket;

int32_t Fail(const hearth::Status& s) {
  g_last_error = s.message();
  switch (s.code()) {
    case hearth::StatusCode::kInvalidArgument:
    case hearth::StatusCode::kFailedPrecondition:
      return HEARTH_ERROR_INVALID_ARGUMENT;
    case hearth::StatusCode::kNotFound:
      return HEARTH_ERROR_NOT_FOUND;
    case hearth::StatusCode::kPermissionDenied:
      return HEARTH_ERROR_PERMISSION_DENIED;
    case hearth::StatusCode::kUnavailable:
      return HEARTH_ERROR_UNAVAILABLE;
    case hearth::StatusCode::kResourceExhausted:
      return HEARTH_ERROR_RESOURCE_EXHAUSTED;
    default:
      return HEARTH_ERROR_INTERNAL;
  }
}

int32_t FailUnexpected() {
  try {
    throw;
  } catch (const std::exception& e) {
    g_last_error = std::string("internal error: ") + e.what();
  } catch (...) {
    g_last_error = "internal error";
  }
  return HEARTH_ERROR_INTERNAL;
}

int32_t Invalid(std::string what) {
  g_last_error = std::move(what);
  return HEARTH_ERROR_INVALID_ARGUMENT;
}

}  // namespace

// A negative hearth_status from a caller, as a Status for the server.
hearth::Status FromC(int32_t status, const char* message) {
  using hearth::StatusCode;
  StatusCode code = StatusCode::kInternal;
  switch (status) {
    case HEARTH_ERROR_INVALID_ARGUMENT:
      code = StatusCode::kInvalidArgument;
      break;
    case HEARTH_ERROR_NOT_FOUND:
      code = StatusCode::kNotFound;
      break;
    case HEARTH_ERROR_PERMISSION_DENIED:
      code = StatusCode::kPermissionDenied;
      break;
    case HEARTH_ERROR_UNAVAILABLE:
      code = StatusCode::kUnavailable;
      break;
    case HEARTH_ERROR_RESOURCE_EXHAUSTED:
      code = StatusCode::kResourceExhausted;
      break;
    default:
      break;
  }
  return hearth::Status(code, message != nullptr && *message != '\0' ? message : "failed");
}

struct hearth_attachment {
  std::unique_ptr<hearth::Attachment> attachment;
};

namespace {

void Fill(const hearth::TensorView& t, hearth_tensor_info* out) {
  out->name = t.name.c_str();
  out->dtype = static_cast<int32_t>(t.dtype);
  out->dtype_name = hearth::DTypeName(t.dtype).data();
  out->ndim = static_cast<int32_t>(t.shape.size());
  out->shape = t.shape.data();
  out->data = const_cast<void*>(t.data);
  out->offset = t.offset;
  out->nbytes = t.nbytes;
  out->device_type = t.device.is_cuda() ? HEARTH_DEVICE_CUDA : HEARTH_DEVICE_CPU;
  out->device_index = t.device.index;
}

}  // namespace

extern "C" {

int32_t hearth_abi_version(void) { return HEARTH_ABI_VERSION; }

int32_t hearth_attach(const char* socket_path, const char* model, uint64_t version,
                      hearth_attachment** out) {
  hearth_attach_options options{};
  options.size = sizeof options;
  options.socket_path = socket_path;
  return hearth_attach_with_options(&options, model, version, out);
}

// Past this, options->size is taken for garbage rather than a later version.
constexpr size_t kMaxOptionsBytes = 4096;

int32_t hearth_attach_with_options(const hearth_attach_options* options, const char* model,
                                   uint64_t version, hearth_attachment** out) {
  try {
    if (out == nullptr) return Invalid("hearth_attach: out is NULL");
    *out = nullptr;
    if (model == nullptr || *model == '\0') return Invalid("hearth_attach: no model name");
    hearth::AttachOptions attach;
    if (options != nullptr) {
      // The fields of version 2; a later, larger struct is read only this far.
      constexpr size_t kVersion2 =
          offsetof(hearth_attach_options, trusted_store_uid_count) + sizeof(size_t);
      if (options->size < kVersion2)
        return Invalid(
            "hearth_attach_with_options: options->size is smaller than the options "
            "of ABI version 2 (set it to sizeof(hearth_attach_options))");
      // Fields of a later version that this library does not know: honoured
      // only if unset, so that a stricter option a newer caller asks for is
      // refused here rather than silently ignored.
      if (options->size > kMaxOptionsBytes)
        return Invalid("hearth_attach_with_options: options->size " +
                       std::to_string(options->size) + " is larger than any version's options (" +
                       std::to_string(kMaxOptionsBytes) + " bytes at most)");
      const auto* bytes = reinterpret_cast<const unsigned char*>(options);
      for (size_t at = kVersion2; at < options->size; ++at) {
        if (bytes[at] != 0)
          return Invalid("hearth_attach_with_options: options byte at offset " +
                         std::to_string(at) + " is not zero: a field this library (ABI version " +
                         std::to_string(HEARTH_ABI_VERSION) +
                         ") does not know is set; use a newer libhearth or leave it zero");
      }
      if (options->socket_path != nullptr) attach.socket_path = options->socket_path;
      if (options->trusted_store_uid_count > 0) {
        if (options->trusted_store_uids == nullptr)
          return Invalid("hearth_attach_with_options: trusted_store_uids is NULL");
        attach.trusted_store_uids.assign(
            options->trusted_store_uids,
            options->trusted_store_uids + options->trusted_store_uid_count);
      }
    }
    hearth::AttachClient client(std::move(attach));
    auto attached = client.Attach(model, version);
    if (!attached.ok()) return Fail(attached.status());
    *out = new hearth_attachment{std::move(attached).value()};
    g_last_error.clear();
    return HEARTH_OK;
  } catch (...) {
    return FailUnexpected();
  }
}

size_t hearth_tensor_count(const hearth_attachment* a) {
  return a == nullptr ? 0 : a->attachment->tensors().size();
}

int32_t hearth_tensor_info_at(const hearth_attachment* a, size_t index, hearth_tensor_info* out) {
  if (a == nullptr || out == nullptr) return Invalid("hearth_tensor_info_at: NULL argument");
  const auto& tensors = a->attachment->tensors();
  if (index >= tensors.size()) return Invalid("hearth_tensor_info_at: index out of range");
  Fill(tensors[index], out);
  return HEARTH_OK;
}

int32_t hearth_tensor_info_by_name(const hearth_attachment* a, const char* name,
                                   hearth_tensor_info* out) {
  if (a == nullptr || name == nullptr || out == nullptr)
    return Invalid("hearth_tensor_info_by_name: NULL argument");
  const hearth::TensorView* t = a->attachment->Find(name);
  if (t == nullptr) {
    g_last_error = std::string("no tensor '") + name + "' in " + a->attachment->model();
    return HEARTH_ERROR_NOT_FOUND;
  }
  Fill(*t, out);
  return HEARTH_OK;
}

const char* hearth_model_name(const hearth_attachment* a) {
  return a == nullptr ? "" : a->attachment->model().c_str();
}
uint64_t hearth_model_version(const hearth_attachment* a) {
  return a == nullptr ? 0 : a->attachment->version();
}
uint64_t hearth_checksum(const hearth_attachment* a) {
  return a == nullptr ? 0 : a->attachment->checksum();
}
int32_t hearth_device_type(const hearth_attachment* a) {
  return a != nullptr && a->attachment->device().is_cuda() ? HEARTH_DEVICE_CUDA : HEARTH_DEVICE_CPU;
}
int32_t hearth_device_index(const hearth_attachment* a) {
  return a == nullptr ? 0 : a->attachment->device().index;
}

int32_t hearth_copy_to_host(const hearth_attachment* a, size_t index, uint64_t offset, void* dst,
                            uint64_t nbytes) {
  try {
    if (a == nullptr || (dst == nullptr && nbytes > 0))
      return Invalid("hearth_copy_to_host: NULL argument");
    const auto& tensors = a->attachment->tensors();
    if (index >= tensors.size()) return Invalid("hearth_copy_to_host: index out of range");
    hearth::Status s = a->attachment->CopyToHost(tensors[index], offset,
                                                 std::span(static_cast<std::byte*>(dst), nbytes));
    return s.ok() ? HEARTH_OK : Fail(s);
  } catch (...) {
    return FailUnexpected();
  }
}

void hearth_detach(hearth_attachment* a) { delete a; }

const char* hearth_default_socket(void) {
  try {
    g_default_socket = hearth::AttachClient::DefaultSocketPath();
  } catch (...) {
    g_default_socket.clear();
  }
  return g_default_socket.c_str();
}

const char* hearth_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"

#ifdef _WIN32
// The worker interface serves `hearth serve`, which runs on Linux only
// (docs/windows.md): hearth.dll exports it so that its ABI is libhearth.so's,
// but no worker can be opened; the rest is unreachable without one.
extern "C" {

int32_t hearth_worker_open(int, int, int32_t, hearth_worker**) {
  return Fail(hearth::Unavailable("the worker interface (hearth_worker_*) runs on Linux only"));
}
const char* hearth_worker_config_json(const hearth_worker*) { return ""; }
const char* hearth_worker_version_dir(const hearth_worker*) { return ""; }
int32_t hearth_worker_max_batch_size(const hearth_worker*) { return HEARTH_ERROR_UNAVAILABLE; }
size_t hearth_worker_parameter_count(const hearth_worker*) { return 0; }
int32_t hearth_worker_parameter(const hearth_worker*, size_t, const char**, size_t*, const char**,
                                size_t*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_ready(hearth_worker*, const hearth_tensor_spec*, size_t,
                            const hearth_tensor_spec*, size_t, uint64_t, const char*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_start_phase(hearth_worker*, const char*, uint64_t) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_fail(hearth_worker*, int32_t, const char*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_next(hearth_worker*) { return HEARTH_ERROR_UNAVAILABLE; }
int64_t hearth_worker_rows(const hearth_worker*) { return 0; }
int32_t hearth_worker_input(const hearth_worker*, size_t, const void**, uint64_t*, const int64_t**,
                            int32_t*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_output(hearth_worker*, size_t, const int64_t*, int32_t, uint64_t, void**) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_done(hearth_worker*, int32_t, const char*, int32_t) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_decoupled(const hearth_worker*) { return HEARTH_ERROR_UNAVAILABLE; }
const char* hearth_worker_parameters_json(const hearth_worker*) { return ""; }
int32_t hearth_worker_respond(hearth_worker*) { return HEARTH_ERROR_UNAVAILABLE; }
int32_t hearth_worker_stream_capacity(const hearth_worker*) { return HEARTH_ERROR_UNAVAILABLE; }
int32_t hearth_worker_stream_next(hearth_worker*, int32_t, uint64_t*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_stream_input(const hearth_worker*, uint64_t, size_t, const void**, uint64_t*,
                                   const int64_t**, int32_t*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_stream_request(const hearth_worker*, uint64_t, const char**, const char**,
                                     const int64_t**, uint64_t*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_stream_output(hearth_worker*, uint64_t, size_t, const int64_t*, int32_t,
                                    uint64_t, void**) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_stream_respond(hearth_worker*, uint64_t, int32_t, int32_t, const char*) {
  return HEARTH_ERROR_UNAVAILABLE;
}
int32_t hearth_worker_wait_start(hearth_worker*) { return HEARTH_ERROR_UNAVAILABLE; }
void hearth_worker_close(hearth_worker*) {}

}  // extern "C"
#else
struct hearth_worker {
  std::unique_ptr<hearth::WorkerSession> session;
  std::vector<std::pair<std::string, std::string> > parameters;
};

namespace {

hearth::Result<std::vector<hearth::TensorSpec> > Specs(const hearth_tensor_spec* specs, size_t n,
                                                       const char* what) {
  if (n > 0 && specs == nullptr) return hearth::InvalidArgument(std::string(what) + ": NULL");
  std::vector<hearth::TensorSpec> out;
  for (size_t i = 0; i < n; ++i) {
    const hearth_tensor_spec& s = specs[i];
    const std::string at = std::string(what) + " #" + std::to_string(i);
    if (s.name == nullptr) return hearth::InvalidArgument(at + ": no name");
    if (s.ndim < 0 || s.ndim > 15 || (s.ndim > 0 && s.dims == nullptr))
      return hearth::InvalidArgument(at + ": ndim " + std::to_string(s.ndim) + " not in [0, 15]");
    if (!hearth::IsDType(s.dtype))
      return hearth::InvalidArgument(at + ": unknown dtype " + std::to_string(s.dtype));
    out.push_back({s.name, static_cast<hearth::DType>(s.dtype), {s.dims, s.dims + s.ndim}});
  }
  return out;
}

}  // namespace

extern "C" {

int32_t hearth_worker_open(int control_fd, int slot_fd, int32_t timeout_ms, hearth_worker** out) {
  try {
    if (out == nullptr) return Invalid("out is NULL");
    *out = nullptr;
    auto session = hearth::WorkerSession::Open(control_fd, slot_fd, timeout_ms);
    if (!session.ok()) return Fail(session.status());
    auto w = std::make_unique<hearth_worker>();
    w->session = std::move(session).value();
    for (const auto& kv : w->session->setup().parameters) w->parameters.push_back(kv);
    *out = w.release();
    return HEARTH_OK;
  } catch (...) {
    return FailUnexpected();
  }
}

const char* hearth_worker_config_json(const hearth_worker* w) {
  return w->session->setup().config_json.c_str();
}

const char* hearth_worker_version_dir(const hearth_worker* w) {
  return w->session->setup().version_dir.c_str();
}

int32_t hearth_worker_max_batch_size(const hearth_worker* w) {
  return w->session->setup().max_batch_size;
}

size_t hearth_worker_parameter_count(const hearth_worker* w) { return w->parameters.size(); }

int32_t hearth_worker_parameter(const hearth_worker* w, size_t index, const char** key,
                                size_t* key_size, const char** value, size_t* value_size) {
  if (index >= w->parameters.size()) return Invalid("parameter index out of range");
  const auto& [k, v] = w->parameters[index];
  *key = k.data();
  *key_size = k.size();
  *value = v.data();
  *value_size = v.size();
  return HEARTH_OK;
}

int32_t hearth_worker_ready(hearth_worker* w, const hearth_tensor_spec* inputs, size_t num_inputs,
                            const hearth_tensor_spec* outputs, size_t num_outputs,
                            uint64_t device_memory_bytes, const char* text) {
  try {
    auto in = Specs(inputs, num_inputs, "input");
    if (!in.ok()) return Fail(in.status());
    auto out = Specs(outputs, num_outputs, "output");
    if (!out.ok()) return Fail(out.status());
    hearth::Status s = w->session->Ready(std::move(in).value(), std::move(out).value(),
                                         device_memory_bytes, text != nullptr ? text : "");
    return s.ok() ? HEARTH_OK : Fail(s);
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_start_phase(hearth_worker* w, const char* name, uint64_t microseconds) {
  try {
    if (name == nullptr) return Fail(hearth::InvalidArgument("a start phase needs a name"));
    hearth::Status s = w->session->AddStartPhase(name, microseconds);
    return s.ok() ? HEARTH_OK : Fail(s);
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_fail(hearth_worker* w, int32_t status, const char* message) {
  try {
    w->session->Fail(FromC(status, message));
    return HEARTH_OK;
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_next(hearth_worker* w) {
  try {
    auto next = w->session->Next();
    if (!next.ok()) return Fail(next.status());
    return *next ? 1 : 0;
  } catch (...) {
    return FailUnexpected();
  }
}

int64_t hearth_worker_rows(const hearth_worker* w) {
  return w != nullptr && w->session->in_batch() ? w->session->rows() : 0;
}

int32_t hearth_worker_input(const hearth_worker* w, size_t index, const void** data,
                            uint64_t* nbytes, const int64_t** shape, int32_t* ndim) {
  if (w == nullptr || !w->session->in_batch()) return Invalid("no batch is current");
  if (index >= w->session->input_count()) return Invalid("input index out of range");
  const auto bytes = w->session->input(index);
  *data = bytes.data();
  *nbytes = bytes.size();
  const std::vector<int64_t>& s = w->session->input_shape(index);
  *shape = s.data();
  *ndim = static_cast<int32_t>(s.size());
  return HEARTH_OK;
}

int32_t hearth_worker_output(hearth_worker* w, size_t index, const int64_t* shape, int32_t ndim,
                             uint64_t nbytes, void** data) {
  try {
    if (ndim < 0 || ndim > 16 || (ndim > 0 && shape == nullptr)) return Invalid("bad shape");
    auto room = w->session->Output(
        index, std::span<const int64_t>(shape, static_cast<size_t>(ndim)), nbytes);
    if (!room.ok()) return Fail(room.status());
    *data = *room;
    return HEARTH_OK;
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_done(hearth_worker* w, int32_t status, const char* message,
                           int32_t retry_alone) {
  try {
    const hearth::Status s = status == HEARTH_OK ? hearth::Status::Ok() : FromC(status, message);
    hearth::Status sent = w->session->Done(s, retry_alone != 0);
    return sent.ok() ? HEARTH_OK : Fail(sent);
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_decoupled(const hearth_worker* w) {
  return w != nullptr && w->session->decoupled() ? 1 : 0;
}

const char* hearth_worker_parameters_json(const hearth_worker* w) {
  (void)w;
  return "";  // a decoupled model's requests carry theirs (hearth_worker_stream_request)
}

int32_t hearth_worker_respond(hearth_worker* w) {
  (void)w;
  return Invalid(
      "hearth_worker_respond: a decoupled model's worker holds streams now "
      "(hearth_worker_stream_*, ABI version 7)");
}

int32_t hearth_worker_stream_capacity(const hearth_worker* w) {
  return w != nullptr && w->session->decoupled()
             ? static_cast<int32_t>(w->session->stream_capacity())
             : 0;
}

int32_t hearth_worker_stream_next(hearth_worker* w, int32_t timeout_ms, uint64_t* id) {
  try {
    if (w == nullptr || id == nullptr) return Invalid("no worker, or id is NULL");
    auto e = w->session->NextStreamEvent(timeout_ms);
    if (!e.ok()) return Fail(e.status());
    *id = e->id;
    switch (e->type) {
      case hearth::WorkerSession::StreamEvent::kOpened:
        return 1;
      case hearth::WorkerSession::StreamEvent::kCancelled:
        return 2;
      case hearth::WorkerSession::StreamEvent::kNone:
        return 3;
      case hearth::WorkerSession::StreamEvent::kClosed:
        return 0;
    }
    return 0;
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_stream_input(const hearth_worker* w, uint64_t id, size_t index,
                                   const void** data, uint64_t* nbytes, const int64_t** shape,
                                   int32_t* ndim) {
  if (w == nullptr) return Invalid("no worker");
  const hearth::control::Open* open = w->session->StreamRequest(id);
  if (open == nullptr) return Invalid("request " + std::to_string(id) + " is not open");
  if (index >= open->inputs.size()) return Invalid("input index out of range");
  const auto bytes = w->session->StreamInput(id, index);
  *data = bytes.data();
  *nbytes = bytes.size();
  *shape = open->inputs[index].shape.data();
  *ndim = static_cast<int32_t>(open->inputs[index].shape.size());
  return HEARTH_OK;
}

int32_t hearth_worker_stream_request(const hearth_worker* w, uint64_t id, const char** request_id,
                                     const char** parameters_json, const int64_t** resume,
                                     uint64_t* resume_count) {
  if (w == nullptr) return Invalid("no worker");
  const hearth::control::Open* open = w->session->StreamRequest(id);
  if (open == nullptr) return Invalid("request " + std::to_string(id) + " is not open");
  *request_id = open->request_id.c_str();
  *parameters_json = open->parameters_json.c_str();
  const auto tokens = w->session->StreamResume(id);
  *resume = tokens.data();
  *resume_count = tokens.size();
  return HEARTH_OK;
}

int32_t hearth_worker_stream_output(hearth_worker* w, uint64_t id, size_t index,
                                    const int64_t* shape, int32_t ndim, uint64_t nbytes,
                                    void** data) {
  try {
    if (ndim < 0 || ndim > 16 || (ndim > 0 && shape == nullptr)) return Invalid("bad shape");
    auto room = w->session->StreamOutput(
        id, index, std::span<const int64_t>(shape, static_cast<size_t>(ndim)), nbytes);
    if (!room.ok()) return Fail(room.status());
    *data = *room;
    return HEARTH_OK;
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_stream_respond(hearth_worker* w, uint64_t id, int32_t final, int32_t status,
                                     const char* message) {
  try {
    if (w == nullptr) return Invalid("no worker");
    const hearth::Status s = status == HEARTH_OK ? hearth::Status::Ok() : FromC(status, message);
    auto sent = w->session->StreamRespond(id, final != 0, s);
    if (!sent.ok()) {
      // The server has gone: as hearth_worker_next's end.
      if (sent.status().code() == hearth::StatusCode::kUnavailable) return 0;
      return Fail(sent.status());
    }
    return *sent ? 1 : 2;
  } catch (...) {
    return FailUnexpected();
  }
}

int32_t hearth_worker_wait_start(hearth_worker* w) {
  try {
    if (w == nullptr) return Invalid("no worker");
    const hearth::Status s = w->session->WaitForStart();
    if (s.code() == hearth::StatusCode::kUnavailable) return 0;
    return s.ok() ? 1 : Fail(s);
  } catch (...) {
    return FailUnexpected();
  }
}

void hearth_worker_close(hearth_worker* w) { delete w; }

}  // extern "C"
#endif  // _WIN32
