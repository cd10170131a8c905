// The C ABI (include/hearth/hearth.h) over hearth::AttachClient.
#include <cstddef>
#include <exception>
#include <memory>
#include <string>

#include "hearth/attach.h"
#include "hearth/hearth.h"

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
