// The endpoints' handlers, one per endpoint, grouped by family in their own
// files (the *_endpoints.cc and infer_endpoint.cc next to this header).
// Dispatch (routes.h) calls them on the session's strand, with the method
// checked. Each answers its request on `session`: at once with Send, or
// later through Submit, StartStream or a thread of its own.
#pragma once

#include "http/openai.h"
#include "http/responses.h"
#include "http/routes.h"

namespace hearth::rest {

class Session;

// status_endpoints.cc: health, metadata, configs, statistics, metrics and workers.
void ServeLive(Session& session, const Request& request);
void ServeReady(Session& session, const Request& request);
void ServeServerMetadata(Session& session, const Request& request);
void ServeModelMetadata(Session& session, const Request& request, const Route& route);
void ServeModelReady(Session& session, const Request& request, const Route& route);
void ServeModelConfig(Session& session, const Request& request, const Route& route);
void ServeModelStatistics(Session& session, const Request& request, const Route& route);
void ServeMetrics(Session& session, const Request& request);
// GET /v2/hearth/workers: http/workers_json.h.
void ServeWorkers(Session& session, const Request& request);

// settings_endpoints.cc: Triton's log and trace settings (GET reads, POST
// changes; common/log_settings.h, common/trace_settings.h).
void ServeLogging(Session& session, const Request& request);
void ServeTraceSetting(Session& session, const Request& request, const Route& route);

// infer_endpoint.cc: KServe v2 inference.
void ServeInfer(Session& session, Request request, const Route& route);

// generate_endpoints.cc: the generate extension, answered whole or streamed.
void ServeGenerate(Session& session, Request request, const Route& route, bool stream);

// openai_endpoints.cc: the OpenAI-compatible endpoints.
void ServeOpenAi(Session& session, Request request, OpenAiEndpoint endpoint);
void ServeOpenAiModels(Session& session, const Request& request);

// repository_endpoints.cc: the model repository's index, loads and unloads.
void ServeRepositoryIndex(Session& session, const Request& request);
void ServeRepositoryControl(Session& session, const Request& request, const Route& route,
                            bool load);

// shared_memory_endpoints.cc: system and CUDA shared-memory regions.
void ServeSystemSharedMemoryRegister(Session& session, const Request& request, const Route& route);
void ServeSystemSharedMemoryUnregister(Session& session, const Request& request,
                                       const Route& route);
void ServeSystemSharedMemoryStatus(Session& session, const Request& request, const Route& route);
void ServeCudaSharedMemoryRegister(Session& session, const Request& request, const Route& route);
void ServeCudaSharedMemoryUnregister(Session& session, const Request& request, const Route& route);
void ServeCudaSharedMemoryStatus(Session& session, const Request& request, const Route& route);

}  // namespace hearth::rest
