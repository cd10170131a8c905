/* The C ABI of engines in plug-in libraries (backends/engine.h's Engine,
 * for decoupled models), beside the backend entry points of
 * cuda_backend_abi.h and aoti_backend_abi.h.
 *
 * A plug-in library that provides engines exports HEARTH_CREATE_ENGINE
 * (hearth_create_engine). The symbol is optional: the loader resolves it
 * apart from the library's backend entry points, so that a library without
 * it keeps serving its kinds as backends, and its kinds then have no engine
 * (a decoupled model of theirs fails at start naming the kind).
 *
 * hearth_create_engine builds the engine of `kind` on the weights (read-only
 * host or device addresses that outlive it) and gives the library's table of
 * functions (*table, static in the library) and the engine's handle
 * (*engine), which the caller passes to every function of the table and
 * releases with table->destroy. Only C types cross the boundary and no
 * exception does. Functions that can fail return a hearth::StatusCode
 * (0 = OK) and on failure write a NUL-terminated message (truncated to
 * error_size) to error. abi_version must be HEARTH_ENGINE_ABI_VERSION of the
 * caller's build; a library from another build answers FailedPrecondition.
 * table->abi_version and table->size say which version of the table the
 * library filled: a caller reads no function past `size` bytes.
 *
 * The functions mirror hearth::Engine's members one for one, with the same
 * contracts (backends/engine.h); one thread calls them. Views handed to add
 * (inputs, parameters, resume tokens) stay valid until the request's final
 * response was sent through a sink, or until cancel.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "backends/cuda/cuda_backend_abi.h" /* HearthCudaTensor, HearthCudaOptions */

#ifdef __cplusplus
extern "C" {
#endif

#define HEARTH_ENGINE_ABI_VERSION 3u

typedef struct HearthEngineSpec {
  const char* name;
  int32_t dtype; /* hearth::DType */
  int32_t rank;
  const int64_t* dims; /* per request; -1 varies */
} HearthEngineSpec;

typedef struct HearthEngineOptions {
  HearthCudaOptions common; /* max_batch_size, allow_tf32, the config's parameters */
  const char* version_dir;
  int32_t batching;     /* the config's max_batch_size > 0: shapes have a leading 1 */
  uint32_t max_streams; /* the requests the worker holds at once */
  /* The inputs and outputs the config lists (none: the engine chooses). */
  const HearthEngineSpec* inputs;
  size_t num_inputs;
  const HearthEngineSpec* outputs;
  size_t num_outputs;
} HearthEngineOptions;

typedef struct HearthEngineInput {
  const void* data;
  uint64_t bytes;
  const int64_t* shape;
  int32_t rank;
} HearthEngineInput;

typedef struct HearthEngineRequest {
  const HearthEngineInput* inputs; /* in the engine's inputs order */
  size_t num_inputs;
  const char* parameters_json; /* a JSON object's text, or empty; not NUL-terminated */
  size_t parameters_bytes;
  const int64_t* resume; /* the token ids the client has; none for a new stream */
  size_t num_resume;
} HearthEngineRequest;

/* hearth::ResponseSink as the worker lends it to a step; valid during that
 * step only. output: *room receives room for output `index` of the response
 * being built for `id` (valid until end for it). end: sends it, `final` to
 * end the request, or with status_code != 0 and `message` (an error, always
 * final); *sent is 1 when sent, 0 when `id` is not open (cancelled: drop
 * it). An error from either ends the worker: step returns it. */
typedef struct HearthEngineSink {
  void* context;
  int (*output)(void* context, uint64_t id, size_t index, const int64_t* shape, int32_t rank,
                uint64_t bytes, void** room, char* error, size_t error_size);
  int (*end)(void* context, uint64_t id, int32_t final, int32_t status_code, const char* message,
             int32_t* sent, char* error, size_t error_size);
} HearthEngineSink;

typedef struct HearthEngineTable {
  uint32_t abi_version; /* HEARTH_ENGINE_ABI_VERSION the library was built with */
  uint32_t size;        /* sizeof(HearthEngineTable) in that version */
  void (*destroy)(void* engine);
  /* The engine's inputs and outputs: arrays it owns, valid while it lives. */
  void (*inputs)(void* engine, const HearthEngineSpec** specs, size_t* count);
  void (*outputs)(void* engine, const HearthEngineSpec** specs, size_t* count);
  uint32_t (*capacity)(void* engine);
  uint64_t (*device_memory_bytes)(void* engine);
  int (*add)(void* engine, uint64_t id, const HearthEngineRequest* request, char* error,
             size_t error_size);
  void (*cancel)(void* engine, uint64_t id);
  int (*step)(void* engine, const HearthEngineSink* sink, char* error, size_t error_size);
  int32_t (*busy)(void* engine);
  /* hearth::Engine::counters: its KV blocks in use and in all, and the
   * streams it has preempted (zeros where it has none). */
  void (*counters)(void* engine, uint64_t* kv_blocks_used, uint64_t* kv_blocks_total,
                   uint64_t* preemptions);
} HearthEngineTable;

typedef int (*HearthCreateEngineFn)(uint32_t abi_version, const char* kind,
                                    const HearthCudaTensor* weights, size_t num_weights,
                                    int32_t device_kind, int32_t device_index,
                                    const HearthEngineOptions* options,
                                    const HearthEngineTable** table, void** engine, char* error,
                                    size_t error_size);

#define HEARTH_CREATE_ENGINE "hearth_create_engine"

#ifdef __cplusplus
}
#endif
