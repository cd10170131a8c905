/* libhearth: the C ABI of the attach client, for other languages.
 *
 * Attach a model held by a `hearth store` and read its tensors through a
 * read-only mapping. Every function returns 0 on success or a negative
 * hearth_status code; hearth_last_error() then describes the failure (per
 * thread, valid until the next call on that thread). No C++ exception ever
 * crosses this interface.
 *
 * Lifetime: a hearth_attachment owns the mapping and the lease; pointers
 * returned for its tensors are valid until hearth_detach(). Handles may be
 * used from several threads for reading.
 */
#ifndef HEARTH_HEARTH_H_
#define HEARTH_HEARTH_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

/* 1: the first interface. 2: adds hearth_attach_options and
 * hearth_attach_with_options; everything of version 1 is unchanged. */
#define HEARTH_ABI_VERSION 2

enum hearth_status {
  HEARTH_OK = 0,
  HEARTH_ERROR_INVALID_ARGUMENT = -1,
  HEARTH_ERROR_NOT_FOUND = -2,
  HEARTH_ERROR_PERMISSION_DENIED = -3,
  HEARTH_ERROR_UNAVAILABLE = -4,
  HEARTH_ERROR_RESOURCE_EXHAUSTED = -5,
  HEARTH_ERROR_INTERNAL = -6,
};

/* Same numbering as safetensors' dtype list. */
enum hearth_dtype {
  HEARTH_F64 = 0, HEARTH_F32, HEARTH_F16, HEARTH_BF16, HEARTH_I64, HEARTH_I32, HEARTH_I16,
  HEARTH_I8, HEARTH_U8, HEARTH_BOOL, HEARTH_F8_E4M3, HEARTH_F8_E5M2,
};

enum hearth_device_type { HEARTH_DEVICE_CPU = 0, HEARTH_DEVICE_CUDA = 1 };

typedef struct hearth_attachment hearth_attachment;

typedef struct hearth_tensor_info {
  const char* name;       /* NUL-terminated, owned by the attachment */
  int32_t dtype;          /* enum hearth_dtype */
  const char* dtype_name; /* "F32", "BF16", ... */
  int32_t ndim;
  const int64_t* shape;   /* ndim entries, owned by the attachment */
  void* data;             /* read-only: host pointer, or CUDA device address */
  uint64_t offset;        /* inside the arena */
  uint64_t nbytes;
  int32_t device_type;    /* enum hearth_device_type */
  int32_t device_index;
} hearth_tensor_info;

/* The ABI version this library implements (HEARTH_ABI_VERSION). */
int32_t hearth_abi_version(void);

/* Attaches `model` (version 0 = latest) from the store at `socket_path`
 * (NULL or "" = $HEARTH_SOCKET, then the default path).
 *
 * Before trusting anything it receives, the library checks who listens on
 * the socket (SO_PEERCRED): the store must run as this process's uid, as
 * root, or as a uid listed in $HEARTH_STORE_UID (comma-separated);
 * otherwise HEARTH_ERROR_PERMISSION_DENIED, naming the socket and the
 * peer's uid and pid. hearth_attach_with_options can trust more uids. */
int32_t hearth_attach(const char* socket_path, const char* model, uint64_t version,
                      hearth_attachment** out);

/* Since ABI version 2. Zero-initialise, set `size` to
 * sizeof(hearth_attach_options), then the fields wanted: the library reads
 * only the first `size` bytes, so a caller built against this header keeps
 * working with a later library that has added fields at the end; a later
 * caller's fields that this library does not know must be left zero. */
typedef struct hearth_attach_options {
  size_t size;
  const char* socket_path;            /* NULL or "": as for hearth_attach */
  const uint32_t* trusted_store_uids; /* store uids trusted besides ours, root
                                         and $HEARTH_STORE_UID */
  size_t trusted_store_uid_count;
} hearth_attach_options;

/* hearth_attach with options; `options` NULL is the same as hearth_attach
 * with the default socket. HEARTH_ERROR_INVALID_ARGUMENT if options->size
 * is smaller than the fields of version 2 or larger than 4096, if any byte
 * past version 2's fields (up to options->size) is not zero (a field of a
 * later version that this library would otherwise ignore; the error names
 * its offset), or if the uid list is NULL with a non-zero count. */
int32_t hearth_attach_with_options(const hearth_attach_options* options, const char* model,
                                   uint64_t version, hearth_attachment** out);
size_t hearth_tensor_count(const hearth_attachment* a);
int32_t hearth_tensor_info_at(const hearth_attachment* a, size_t index, hearth_tensor_info* out);
/* Looks a tensor up by name; HEARTH_ERROR_NOT_FOUND if absent. */
int32_t hearth_tensor_info_by_name(const hearth_attachment* a, const char* name,
                                   hearth_tensor_info* out);
const char* hearth_model_name(const hearth_attachment* a);
uint64_t hearth_model_version(const hearth_attachment* a);
uint64_t hearth_checksum(const hearth_attachment* a);
int32_t hearth_device_type(const hearth_attachment* a);
int32_t hearth_device_index(const hearth_attachment* a);
/* Copies bytes of a tensor to host memory (works for CUDA tensors too). */
int32_t hearth_copy_to_host(const hearth_attachment* a, size_t index, uint64_t offset, void* dst,
                            uint64_t nbytes);
/* Unmaps and ends the lease. NULL is ignored. */
void hearth_detach(hearth_attachment* a);
/* The default socket path ($HEARTH_SOCKET, ...); valid until the next call on this thread. */
const char* hearth_default_socket(void);
/* The last error on this thread, or "" if none. */
const char* hearth_last_error(void);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
#ifdef __cplusplus
}
#endif

#endif /* HEARTH_HEARTH_H_ */
