// hearth-worker's loop for a decoupled model whose kind provides an Engine
// (backends/engine.h): the requests the server opens go to the engine, those
// it cancels are dropped, and the engine steps while it is busy, its
// responses written straight into the session's response ring.
#pragma once

#include "backends/engine.h"
#include "hearth/status.h"
#include "worker/session.h"

namespace hearth {

// Serves streams after session.Ready(engine's inputs and outputs) until the
// server closes the channel (OK). A request the engine refuses (Add) ends
// with that error; a Step's error ends every request the engine holds. An
// error returned is the worker's: a malformed message or a broken channel
// (report it, WorkerSession::Fail, and exit), or DeviceLost from the engine
// (exit at once: the CUDA context is gone).
Status ServeStreams(WorkerSession& session, Engine& engine);

}  // namespace hearth
