#include "server/metrics.h"

#include <cstdio>
#include <map>
#include <sstream>

namespace hearth {

std::string PrometheusText(const std::vector<std::pair<std::string, const ModelRuntime*>>& served,
                           const std::vector<StoreSample>& stores, const DriverMemory& driver) {
  std::string out;
  auto family = [&](const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  auto sample = [&](const std::string& name, const std::string& labels, double value) {
    char text[64];
    std::snprintf(text, sizeof text, "%.17g", value);
    out += name + "{" + labels + "} " + text + "\n";
  };
  auto per_model = [&](const char* name, const char* type, const char* help, auto value) {
    family(name, type, help);
    for (const auto& [model, m] : served)
      sample(name, "model=\"" + model + "\"", static_cast<double>(value(*m)));
  };
  per_model("hearth_inference_request_success", "counter", "Requests answered successfully.",
            [](const ModelRuntime& m) { return m.stats.success.load(); });
  per_model("hearth_inference_request_failure", "counter", "Requests answered with an error.",
            [](const ModelRuntime& m) { return m.stats.failure.load(); });
  per_model("hearth_inference_count", "counter", "Inferences (rows, counting every batch member).",
            [](const ModelRuntime& m) { return m.stats.rows.load(); });
  per_model("hearth_inference_exec_count", "counter", "Batches executed by workers.",
            [](const ModelRuntime& m) { return m.stats.batches.load(); });
  per_model("hearth_inference_request_duration_us", "counter",
            "Total time from request to answer of successful requests, microseconds.",
            [](const ModelRuntime& m) { return m.stats.request_us.load(); });
  per_model("hearth_inference_queue_duration_us", "counter",
            "Total time requests waited in the queue, microseconds.",
            [](const ModelRuntime& m) { return m.stats.queue_us.load(); });
  per_model("hearth_inference_compute_input_duration_us", "counter",
            "Total time copying inputs into worker slots, microseconds.",
            [](const ModelRuntime& m) { return m.stats.input_us.load(); });
  per_model("hearth_inference_compute_infer_duration_us", "counter",
            "Total time the backends ran, as measured in the workers, microseconds.",
            [](const ModelRuntime& m) { return m.stats.run_us.load(); });
  per_model("hearth_inference_worker_exchange_duration_us", "counter",
            "Total time from handing batches to workers to their answers, as the server measures "
            "it (the backends' time and the protocol's), microseconds.",
            [](const ModelRuntime& m) { return m.stats.exchange_us.load(); });
  per_model("hearth_inference_compute_output_duration_us", "counter",
            "Total time splitting outputs back into responses, microseconds.",
            [](const ModelRuntime& m) { return m.stats.output_us.load(); });
  per_model("hearth_inference_pending_request_count", "gauge",
            "Requests accepted and not yet answered.",
            [](const ModelRuntime& m) { return m.stats.pending.load(); });
  per_model("hearth_inference_queued_request_count", "gauge",
            "Requests waiting in the queue for a worker (not those whose clients went away).",
            [](const ModelRuntime& m) { return m.queue->waiting(); });
  per_model("hearth_live_sequences", "gauge",
            "Sequences of a model with sequence_batching that are live (started, not ended, not "
            "freed when idle), their state held by the server.",
            [](const ModelRuntime& m) { return m.sequences ? m.sequences->size() : 0; });
  per_model("hearth_standby_workers", "gauge",
            "Standby worker processes started and waiting (parameters.standby_workers); one that "
            "died while it waited counts until it is needed and found gone.",
            [](const ModelRuntime& m) { return m.StandbyCount(); });
  per_model("hearth_hot_spares", "gauge",
            "Hot spares ready (parameters.standby_mode: hot): worker processes started, attached "
            "and warmed up with one batch, each to take a dead worker's place at once.",
            [](const ModelRuntime& m) { return m.HotSpareCount(); });
  // Which figure it is, said in its HELP: the driver's wherever NVML
  // answered for a GPU of a served placement.
  per_model("hearth_hot_spare_device_memory_bytes", "gauge",
            driver.answered()
                ? "Device memory of the ready hot spares' processes as the NVIDIA driver accounts "
                  "it (NVML, as nvidia-smi shows it: CUDA context, library workspaces and "
                  "caching allocator included); a spare the driver does not list counts what it "
                  "reported of its own buffers when ready."
                : "Device memory the ready hot spares' backends allocated themselves, as each "
                  "reported it when ready; their CUDA contexts not included (no per-process "
                  "figures from the NVIDIA driver's NVML here).",
            [&](const ModelRuntime& m) { return m.HotSpareDeviceMemoryBytes(driver); });
  per_model("hearth_hot_spare_takeovers_total", "counter",
            "Times a hot spare took a dead worker's place.",
            [](const ModelRuntime& m) { return m.HotSpareTakeovers(); });
  family("hearth_worker_start_phase_duration_us", "counter",
         "Total time of each phase of the workers' starts, as each worker measured it "
         "(a standby's wait is none of them), microseconds.");
  std::vector<std::pair<std::string, std::map<std::string, ModelStats::PhaseTotals>>> phases;
  for (const auto& [model, m] : served) phases.emplace_back(model, m->stats.StartPhases());
  for (const auto& [model, totals] : phases)
    for (const auto& [phase, t] : totals)
      sample("hearth_worker_start_phase_duration_us",
             "model=\"" + model + "\",phase=\"" + phase + "\"", static_cast<double>(t.us));
  family("hearth_worker_start_phase_count", "counter",
         "Worker starts that reported each phase of their start.");
  for (const auto& [model, totals] : phases)
    for (const auto& [phase, t] : totals)
      sample("hearth_worker_start_phase_count", "model=\"" + model + "\",phase=\"" + phase + "\"",
             static_cast<double>(t.count));
  family("hearth_inference_batch_size", "histogram", "Rows per executed batch.");
  for (const auto& [model, m] : served) {
    uint64_t cumulative = 0;
    for (size_t b = 0; b < std::size(ModelStats::kBatchBuckets); ++b) {
      cumulative += m->stats.batch_bucket[b].load();
      sample("hearth_inference_batch_size_bucket",
             "model=\"" + model + "\",le=\"" + std::to_string(ModelStats::kBatchBuckets[b]) + "\"",
             static_cast<double>(cumulative));
    }
    sample("hearth_inference_batch_size_bucket", "model=\"" + model + "\",le=\"+Inf\"",
           static_cast<double>(m->stats.batches.load()));
    sample("hearth_inference_batch_size_sum", "model=\"" + model + "\"",
           static_cast<double>(m->stats.rows.load()));
    sample("hearth_inference_batch_size_count", "model=\"" + model + "\"",
           static_cast<double>(m->stats.batches.load()));
  }
  auto per_worker = [&](const char* name, const char* type, const char* help, auto value) {
    family(name, type, help);
    for (const auto& [model, m] : served)
      for (const auto& w : m->workers)
        sample(name,
               "model=\"" + model + "\",worker=\"" + std::to_string(w->index()) + "\",device=\"" +
                   w->placement().device_name + "\"",
               static_cast<double>(value(*w)));
  };
  per_worker("hearth_worker_restarts", "counter", "Times the worker process was replaced.",
             [](const WorkerSupervisor& w) { return w.restarts(); });
  per_worker("hearth_worker_ready", "gauge", "1 while the worker process is serving.",
             [](const WorkerSupervisor& w) { return w.ready() ? 1 : 0; });
  per_worker("hearth_worker_device_memory_bytes", "gauge",
             "Device memory the worker's backend allocated itself (its CUDA context not included).",
             [](const WorkerSupervisor& w) { return w.device_memory_bytes(); });
  per_worker("hearth_worker_streams", "gauge",
             "Streams the worker holds now (a decoupled model's; parameters.max_streams at most).",
             [](const WorkerSupervisor& w) { return w.streams_in_flight(); });
  per_model("hearth_streams_total", "counter",
            "Streams opened on a worker, a resumed one counted again.",
            [](const ModelRuntime& m) { return m.stats.streams_opened.load(); });
  per_model("hearth_streams_resumed_total", "counter",
            "Streams that went on on another worker after theirs died, from the token ids their "
            "client had (parameters.resumable).",
            [](const ModelRuntime& m) { return m.stats.streams_resumed.load(); });
  per_model("hearth_stream_responses_total", "counter", "Stream responses sent or joined.",
            [](const ModelRuntime& m) { return m.stats.stream_responses.load(); });
  per_model("hearth_generated_tokens_total", "counter",
            "Token ids in stream responses (the model's token_ids output, INT64).",
            [](const ModelRuntime& m) { return m.stats.stream_tokens.load(); });
  per_model("hearth_preemptions_total", "counter",
            "Streams the workers' engines preempted (their KV cache given back; they go on "
            "later, prefilled again).",
            [](const ModelRuntime& m) { return m.stats.preemptions.load(); });
  per_worker("hearth_kv_cache_blocks_used", "gauge",
             "Blocks of the worker's engine's KV cache in use (backend llm).",
             [](const WorkerSupervisor& w) { return w.kv_blocks_used(); });
  per_worker("hearth_kv_cache_blocks", "gauge",
             "Blocks in the worker's engine's KV cache (backend llm).",
             [](const WorkerSupervisor& w) { return w.kv_blocks_total(); });
  family("hearth_stream_first_response_seconds", "histogram",
         "From a stream's arrival to its first response (time to first token for generation; "
         "resumed streams not counted).");
  for (const auto& [model, m] : served) {
    for (size_t b = 0; b < std::size(ModelStats::kFirstResponseBuckets); ++b) {
      std::ostringstream le;
      le << ModelStats::kFirstResponseBuckets[b];
      sample("hearth_stream_first_response_seconds_bucket",
             "model=\"" + model + "\",le=\"" + le.str() + "\"",
             static_cast<double>(m->stats.first_response_bucket[b].load()));
    }
    sample("hearth_stream_first_response_seconds_bucket", "model=\"" + model + "\",le=\"+Inf\"",
           static_cast<double>(m->stats.first_response_count.load()));
    sample("hearth_stream_first_response_seconds_sum", "model=\"" + model + "\"",
           static_cast<double>(m->stats.first_response_us.load()) / 1e6);
    sample("hearth_stream_first_response_seconds_count", "model=\"" + model + "\"",
           static_cast<double>(m->stats.first_response_count.load()));
  }
  auto per_placement = [&](const char* name, const char* type, const char* help, auto value) {
    family(name, type, help);
    for (const auto& [model, m] : served)
      for (const auto& p : m->placements)
        sample(name, "model=\"" + model + "\",device=\"" + p->device_name + "\"",
               static_cast<double>(value(*p)));
  };
  per_placement("hearth_placement_workers", "gauge",
                "Workers placed on the device (instance_group, or --workers per placement).",
                [](const ModelPlacement& p) { return p.worker_count; });
  per_placement("hearth_placement_ready_workers", "gauge",
                "The placement's workers that are serving.",
                [](const ModelPlacement& p) { return p.ready_workers.load(); });
  per_placement("hearth_placement_ready", "gauge",
                "1 while the placement serves: a worker ready, and not failed.",
                [](const ModelPlacement& p) { return p.serving() ? 1 : 0; });
  per_placement("hearth_placement_failed", "gauge",
                "1 while the placement is failed: its workers died again and again without "
                "answering a batch; its work goes to the model's other placements.",
                [](const ModelPlacement& p) { return p.health.failed() ? 1 : 0; });
  per_placement("hearth_placement_failures", "counter", "Times the placement was found failed.",
                [](const ModelPlacement& p) { return p.health.times_failed(); });
  per_placement("hearth_placement_batches", "counter",
                "Batches answered by the placement's workers.",
                [](const ModelPlacement& p) { return p.batches.load(); });
  family("hearth_shared_weights_bytes", "gauge",
         "Bytes of each model's weights, held once per device in that device's store.");
  for (const auto& [model, m] : served)
    for (const auto& p : m->placements)
      sample("hearth_shared_weights_bytes",
             "model=\"" + model + "\",device=\"" + p->device_name + "\"",
             static_cast<double>(p->arena_bytes));
  family("hearth_device_memory_accounted_bytes", "gauge",
         "Shared weights counted once plus the workers' and the hot spares' own allocations, per "
         "device (contexts not included).");
  std::map<std::string, uint64_t> per_device;
  for (const auto& [model, m] : served)
    for (const auto& p : m->placements) per_device[p->device_name] += p->arena_bytes;
  for (const auto& [model, m] : served)
    for (const auto& w : m->workers)
      per_device[w->placement().device_name] += w->device_memory_bytes();
  for (const auto& [model, m] : served)
    for (const auto& p : m->placements)
      if (p->hot_spares != nullptr)
        per_device[p->device_name] += p->hot_spares->device_memory_bytes();
  for (const auto& [device, bytes] : per_device)
    sample("hearth_device_memory_accounted_bytes", "device=\"" + device + "\"",
           static_cast<double>(bytes));
  family("hearth_store_arena_bytes", "gauge",
         "Bytes of the arenas each device's store holds, as the store counts them (every model "
         "and version, unloaded ones still attached included).");
  for (const StoreSample& st : stores)
    sample("hearth_store_arena_bytes", "device=\"" + st.device + "\"",
           static_cast<double>(st.bytes));
  family("hearth_store_arenas", "gauge", "Arenas each device's store holds.");
  for (const StoreSample& st : stores)
    sample("hearth_store_arenas", "device=\"" + st.device + "\"", static_cast<double>(st.arenas));
  return out;
}

}  // namespace hearth
