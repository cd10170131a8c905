// The checks every front-end makes of a request against the model it names,
// before the request reaches the server: part of the server's request API,
// so that the REST and gRPC front-ends answer the same errors without one
// depending on the other.
#pragma once

#include <cstddef>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

// Tensors of a request may have at most this many dimensions (the REST
// front-end walks nested `data` recursively, one level per dimension).
inline constexpr size_t kMaxTensorRank = 32;

// Every input known, present once, of the model's datatype and shape (the
// batch dimension first when max_batch_size > 0, 1..max_batch_size and the
// same for every input; a -1 among the model's dims takes any size, the
// others must match exactly), and every requested output known and named
// once. InvalidArgument naming what is wrong otherwise. The inputs' bytes
// are not looked at (an input may be in shared memory, read later).
Status ValidateInferRequest(const InferRequest& request, const ModelMetadata& metadata);

}  // namespace hearth
