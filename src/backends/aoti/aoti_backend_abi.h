/* The C entry point of libhearth_backend_aoti.so: `backend: aoti`, an
 * AOTInductor package (model.pt2) run through libtorch's
 * AOTIModelPackageLoader on the store's tensors.
 *
 * hearth-worker never links libtorch: it dlopen()s this library for aoti
 * models only, so hearth itself runs where no libtorch is installed. Only C
 * types cross the boundary and no exception does. The call returns a
 * hearth::StatusCode (0 = OK) and on failure writes a NUL-terminated message
 * (truncated to error_size) to error; a library from another build
 * (abi_version) answers FailedPrecondition.
 *
 * On success *backend receives a heap-allocated hearth::Backend* that the
 * caller owns and deletes through its virtual destructor. The weights (host
 * or device addresses, read-only) must outlive it; the package's constants
 * are bound to them without a copy.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "backends/cuda/cuda_backend_abi.h" /* HearthCudaTensor, HearthCudaOptions */

#ifdef __cplusplus
extern "C" {
#endif

#define HEARTH_AOTI_BACKEND_ABI_VERSION 2u

typedef struct HearthAotiSpec {
  const char* name;
  int32_t dtype; /* hearth::DType */
  int32_t rank;
  const int64_t* dims; /* per sample; -1 varies */
} HearthAotiSpec;

typedef struct HearthAotiOptions {
  HearthCudaOptions common;
  const char* package_path;     /* <version dir>/model.pt2 */
  const HearthAotiSpec* inputs; /* as the config lists them; none: the package's */
  size_t num_inputs;
  const HearthAotiSpec* outputs;
  size_t num_outputs;
  int32_t batching; /* the config's max_batch_size > 0 */
} HearthAotiOptions;

typedef int (*HearthCreateAotiBackendFn)(uint32_t abi_version, const HearthCudaTensor* weights,
                                         size_t num_weights, int32_t device_kind,
                                         int32_t device_index, const HearthAotiOptions* options,
                                         void** backend, char* error, size_t error_size);

#define HEARTH_AOTI_BACKEND_LIBRARY "libhearth_backend_aoti.so"
#define HEARTH_CREATE_AOTI_BACKEND "hearth_create_aoti_backend"

#ifdef __cplusplus
}
#endif
