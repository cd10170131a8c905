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
 * hearth_attach_with_options. 3: adds HEARTH_BYTES and the worker
 * interface (hearth_worker_*). 4: adds decoupled models' streams
 * (hearth_worker_decoupled, hearth_worker_parameters_json,
 * hearth_worker_respond). 5: adds standby workers' hearth_worker_wait_start.
 * 6: adds hearth_worker_start_phase. 7: a decoupled model's worker holds
 * many streams (hearth_worker_stream_*); for it hearth_worker_next,
 * hearth_worker_respond and hearth_worker_parameters_json of version 4 no
 * longer serve (the worker and the server of one release speak one
 * protocol). 8: adds HEARTH_U16, HEARTH_U32 and HEARTH_U64. Everything
 * else of earlier versions is unchanged. */
#define HEARTH_ABI_VERSION 8

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
  HEARTH_F64 = 0,
  HEARTH_F32,
  HEARTH_F16,
  HEARTH_BF16,
  HEARTH_I64,
  HEARTH_I32,
  HEARTH_I16,
  HEARTH_I8,
  HEARTH_U8,
  HEARTH_BOOL,
  HEARTH_F8_E4M3,
  HEARTH_F8_E5M2,
  /* Since version 3: variable-length byte strings (KServe BYTES), in model
   * inputs and outputs only. Their bytes are KServe's binary form: per
   * element a 4-byte little-endian length, then that many bytes. */
  HEARTH_BYTES,
  /* Since version 8: unsigned integers, the safetensors U16, U32 and U64. */
  HEARTH_U16,
  HEARTH_U32,
  HEARTH_U64,
};

enum hearth_device_type { HEARTH_DEVICE_CPU = 0, HEARTH_DEVICE_CUDA = 1 };

typedef struct hearth_attachment hearth_attachment;

typedef struct hearth_tensor_info {
  const char* name;       /* NUL-terminated, owned by the attachment */
  int32_t dtype;          /* enum hearth_dtype */
  const char* dtype_name; /* "F32", "BF16", ... */
  int32_t ndim;
  const int64_t* shape; /* ndim entries, owned by the attachment */
  void* data;           /* read-only: host pointer, or CUDA device address */
  uint64_t offset;      /* inside the arena */
  uint64_t nbytes;
  int32_t device_type; /* enum hearth_device_type */
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
 * peer's uid and pid. hearth_attach_with_options can trust more uids.
 *
 * Windows (hearth.dll): `socket_path` is the store's pipe name (1 to 64 of
 * [A-Za-z0-9._-]; NULL or "" = $HEARTH_SOCKET, then "store"); the store
 * must run as this process's user, and no other uids can be trusted; the
 * tensors are a read-only view of a section the store shared with this
 * process. The worker interface below runs on Linux only: there
 * hearth_worker_open fails with HEARTH_ERROR_UNAVAILABLE. */
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

/* ---- Serving batches as a worker of `hearth serve` (since version 3) ----
 *
 * A model whose backend is its own program (backend: python) is served by a
 * process that `hearth serve` starts with the control socket and the
 * request slot as descriptors (--control-fd, --slot-fd). It opens a
 * worker on them, reads its setup (config, parameters), attaches its
 * weights (hearth_attach), says what it takes and gives (hearth_worker_ready),
 * then serves batches: hearth_worker_next waits for one, its inputs are
 * read in place, hearth_worker_output gives room for each output, and
 * hearth_worker_done answers. Every offset and size is checked against the
 * slot and the signature on both sides.
 *
 * One thread drives a worker. Pointers it returns are valid until the
 * batch's hearth_worker_done, and output room only until the next
 * hearth_worker_output (the slot may grow and move). */
typedef struct hearth_worker hearth_worker;

typedef struct hearth_tensor_spec {
  const char* name;
  int32_t dtype; /* enum hearth_dtype, HEARTH_BYTES included */
  int32_t ndim;
  const int64_t* dims; /* per sample, without the batch dimension; -1: any size */
} hearth_tensor_spec;

/* Takes both descriptors (closed by hearth_worker_close, or at once if this
 * fails) and reads the setup message, waiting up to timeout_ms for it. */
int32_t hearth_worker_open(int control_fd, int slot_fd, int32_t timeout_ms, hearth_worker** out);
/* The model's config in Triton's JSON form; its version directory; its
 * max_batch_size (0: it does not batch, and tensors have no batch dimension). */
const char* hearth_worker_config_json(const hearth_worker* w);
const char* hearth_worker_version_dir(const hearth_worker* w);
int32_t hearth_worker_max_batch_size(const hearth_worker* w);
/* The config's parameters; keys and values may hold NUL bytes. */
size_t hearth_worker_parameter_count(const hearth_worker* w);
int32_t hearth_worker_parameter(const hearth_worker* w, size_t index, const char** key,
                                size_t* key_size, const char** value, size_t* value_size);
/* The model is ready: its inputs and outputs, the device memory it holds
 * itself, and a line for the server's log. */
int32_t hearth_worker_ready(hearth_worker* w, const hearth_tensor_spec* inputs, size_t num_inputs,
                            const hearth_tensor_spec* outputs, size_t num_outputs,
                            uint64_t device_memory_bytes, const char* text);
/* A phase of this worker's start and how long it took (before ready, at
 * most 16): the server logs them and exports their totals in /metrics
 * (hearth_worker_start_phase_seconds_total). `name`: 1 to 32 characters of
 * a-z, 0-9, '.', '_' and '-'. */
int32_t hearth_worker_start_phase(hearth_worker* w, const char* name, uint64_t microseconds);
/* Why this worker cannot start (before ready): the model's status and log
 * show `message`. `status` is a negative hearth_status. */
int32_t hearth_worker_fail(hearth_worker* w, int32_t status, const char* message);
/* Waits for the next batch: 1 when one is current, 0 when the server has
 * gone (exit), negative on a malformed message (hearth_last_error). */
int32_t hearth_worker_next(hearth_worker* w);
/* The current batch's rows; 0 when no batch is current. */
int64_t hearth_worker_rows(const hearth_worker* w);
/* Input `index` of the current batch: its bytes (read-only) and full shape. */
int32_t hearth_worker_input(const hearth_worker* w, size_t index, const void** data,
                            uint64_t* nbytes, const int64_t** shape, int32_t* ndim);
/* Room for output `index` of full shape `shape` and `nbytes` bytes (for
 * BYTES the serialised size; else what the shape needs). */
int32_t hearth_worker_output(hearth_worker* w, size_t index, const int64_t* shape, int32_t ndim,
                             uint64_t nbytes, void** data);
/* Ends the batch: status 0 once every output was written, else a negative
 * hearth_status and a message for every request of the batch. retry_alone
 * != 0: the inputs caused it; the server runs each request alone, so that
 * only those at fault fail. */
int32_t hearth_worker_done(hearth_worker* w, int32_t status, const char* message,
                           int32_t retry_alone);
/* Decoupled models (model_transaction_policy: {decoupled: true}): 1 when
 * the worker holds streams (hearth_worker_stream_* below) instead of
 * batches. */
int32_t hearth_worker_decoupled(const hearth_worker* w);
/* Version 4's; since version 7 "" and an error: see hearth_worker_stream_*. */
const char* hearth_worker_parameters_json(const hearth_worker* w);
int32_t hearth_worker_respond(hearth_worker* w);

/* Streams (version 7): a decoupled model's worker holds up to
 * hearth_worker_stream_capacity requests at once (the config's
 * parameters.max_streams, 1 by default) and answers each with any number of
 * responses, in any order among them. One thread drives them. */
int32_t hearth_worker_stream_capacity(const hearth_worker* w);
/* Waits up to timeout_ms (0: only looks; -1: for ever) for what the server
 * says next: 1 request *id was opened; 2 request *id was cancelled (client
 * gone, deadline passed: it is already ended, send nothing more for it);
 * 3 nothing came in time; 0 the server has gone (exit); negative: a
 * malformed message (hearth_last_error). */
int32_t hearth_worker_stream_next(hearth_worker* w, int32_t timeout_ms, uint64_t* id);
/* An open request's input `index`: its bytes (read-only) and its full shape;
 * valid until the request's final response or its cancellation. */
int32_t hearth_worker_stream_input(const hearth_worker* w, uint64_t id, size_t index,
                                   const void** data, uint64_t* nbytes, const int64_t** shape,
                                   int32_t* ndim);
/* An open request's id from its client, its parameters (a JSON object's
 * text, "" for none) and, when it resumes a stream whose worker died, the
 * token ids its client already has (*resume_count 0: none). */
int32_t hearth_worker_stream_request(const hearth_worker* w, uint64_t id, const char** request_id,
                                     const char** parameters_json, const int64_t** resume,
                                     uint64_t* resume_count);
/* Room for output `index` in the response being built for request `id`, as
 * hearth_worker_output for a batch; valid until that response is sent. One
 * response is built at a time. */
int32_t hearth_worker_stream_output(hearth_worker* w, uint64_t id, size_t index,
                                    const int64_t* shape, int32_t ndim, uint64_t nbytes,
                                    void** data);
/* Sends the response built for request `id` (the outputs given room since
 * its last response; the others are absent from it). final != 0 ends the
 * request; status != 0 ends it with that error and `message`. 1: sent;
 * 2: the request is not open (cancelled): nothing was sent; 0: the server
 * has gone (exit); negative: an error (hearth_last_error). */
int32_t hearth_worker_stream_respond(hearth_worker* w, uint64_t id, int32_t final, int32_t status,
                                     const char* message);
/* A standby worker (started with --standby), its loading done, waits here
 * until the server puts it to work: 1 then (attach the weights, build the
 * model, hearth_worker_ready); 0 when the server closed the channel instead
 * (it is not needed: exit quietly); negative on an error. Never a device
 * call before this returns 1: a standby holds no device context. */
int32_t hearth_worker_wait_start(hearth_worker* w);
/* Closes the descriptors and unmaps the slot. NULL is ignored. */
void hearth_worker_close(hearth_worker* w);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
#ifdef __cplusplus
}
#endif

#endif /* HEARTH_HEARTH_H_ */
