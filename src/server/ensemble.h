// An ensemble's scheduler: runs one request of a model with platform:
// ensemble (server/ensemble_config.h) through its steps, inside the server.
// A step starts as soon as every ensemble tensor it takes exists (the
// request's inputs, or what earlier steps produced); steps whose tensors are
// ready run at once, concurrently. Each step is a request to its model that
// goes through the server's own way in (`run_step`: admission, the model's
// queue, batching, statistics), as a client's would. The answer holds the
// outputs the request asked for (all the ensemble's when it names none).
//
// A step that fails fails the request, with an error naming the step, its
// model and the cause; no step starts after that, and the answer waits for
// the steps still running (they may read the request's inputs). The steps
// share the request's `cancelled` flag (one is made when the client gave
// none): the client's cancellation reaches every step, and a failing step
// sets it, which stops its siblings too. Front-ends only ever set that flag.
#pragma once

#include <functional>

#include "server/inference_api.h"
#include "server/model_config.h"

namespace hearth {

using InferDone = std::function<void(Result<InferResponse>)>;
// Runs a step's request as any other request is run; calls `done` exactly
// once, from any thread (perhaps before it returns).
using StepRunner = std::function<void(InferRequest request, InferDone done)>;

// `ensemble`'s config (ensemble set, checked) must outlive the request:
// whoever calls this holds it until `done` is called. `request` is
// admitted already (its parameters applied, its inputs checked against the
// ensemble's and in its `data`). `done` is called exactly once, from any
// thread.
void RunEnsemble(const ModelConfig& ensemble, InferRequest request, InferDone done,
                 StepRunner run_step);

}  // namespace hearth
