/* The C entry points of libhearth_backends_cuda.so.
 *
 * hearth_backends (linked into the worker) never links cuBLAS or cudart: for
 * a CUDA device it dlopen()s this library and resolves the symbols below, so
 * the worker binary starts on machines without CUDA libraries. Everything
 * crossing the boundary is a C type; no exception crosses it (each entry
 * point catches everything and reports Internal).
 *
 * Each call returns a hearth::StatusCode (0 = OK). On failure it writes a
 * NUL-terminated message of at most error_size bytes (truncated) to error.
 * abi_version must be HEARTH_CUDA_BACKEND_ABI_VERSION of the caller's build;
 * a library from another build answers FailedPrecondition.
 *
 * hearth_create_cuda_backend: on success *backend receives a heap-allocated
 * hearth::Backend* that the caller owns and deletes through its virtual
 * destructor. The library must stay loaded while any backend lives (the
 * loader never dlclose()s it). Weights are device addresses on
 * device_index; they must outlive the backend.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HEARTH_CUDA_BACKEND_ABI_VERSION 3u

typedef struct HearthCudaTensor {
  const char* name;
  int32_t dtype; /* hearth::DType */
  int32_t rank;
  const int64_t* shape;
  const void* data; /* device address */
  uint64_t nbytes;
  int32_t device_kind; /* hearth::DeviceKind */
  int32_t device_index;
} HearthCudaTensor;

typedef struct HearthCudaOptions {
  int32_t max_batch_size;
  int32_t allow_tf32;
  size_t num_parameters;
  const char* const* parameter_keys;
  const char* const* parameter_values;
} HearthCudaOptions;

typedef int (*HearthCreateCudaBackendFn)(uint32_t abi_version, const char* kind,
                                         const HearthCudaTensor* weights, size_t num_weights,
                                         int32_t device_index, const HearthCudaOptions* options,
                                         void** backend, char* error, size_t error_size);
/* cudaHostRegister(data, bytes, cudaHostRegisterDefault) / cudaHostUnregister
 * with device_index's primary context current. */
typedef int (*HearthCudaHostRegisterFn)(uint32_t abi_version, int32_t device_index, void* data,
                                        uint64_t bytes, char* error, size_t error_size);
typedef int (*HearthCudaHostUnregisterFn)(uint32_t abi_version, int32_t device_index, void* data,
                                          char* error, size_t error_size);

#define HEARTH_CUDA_BACKEND_LIBRARY "libhearth_backends_cuda.so"
#define HEARTH_CREATE_CUDA_BACKEND "hearth_create_cuda_backend"
#define HEARTH_CUDA_HOST_REGISTER "hearth_cuda_host_register"
#define HEARTH_CUDA_HOST_UNREGISTER "hearth_cuda_host_unregister"

#ifdef __cplusplus
}
#endif
