// backend: llm — the generation engine (backends/engine.h) of a Hugging Face
// Llama-family checkpoint: the version directory's config.json,
// generation_config.json, tokenizer.json and tokenizer_config.json, the
// weights the worker attached, and an Executor (llm_model.h) for the device.
//
// Requests: input text_input (a prompt, BYTES [1]) or messages (the JSON
// text of an OpenAI messages list, rendered with the checkpoint's chat
// template); parameters max_tokens, temperature, top_p, top_k, seed, stop
// (a string or a list), each checked with a 400 naming it. Responses: one a
// step while a stream generates, each with text_output (the new text: whole
// UTF-8 characters, stop strings cut), token_ids (the tokens drawn since the
// last response: what a stream resumes from), and on the last one
// prompt_tokens, completion_tokens and finish_reason ("stop" or "length").
//
// Config parameters (config.yaml `parameters:`, strings): max_streams (the
// streams decoded together), kv_cache_bytes or kv_cache_fraction (the KV
// pool: bytes, or a fraction of the device memory free after the weights;
// default 64 MiB on the CPU and 0.5 on a GPU), block_size (tokens per KV
// block, 16), max_tokens_per_step (the prefill budget of one step, 2048),
// max_positions (at most the model's; default the model's, capped at
// 32768), default_max_tokens (16), gemm_engine (GPU: timed, cublaslt or
// hearth), special_text_in_messages (refuse or parse). Any other name but
// those the server reads for every model fails the model.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backends/engine.h"
#include "backends/llm/llm_model.h"

namespace hearth::llm {

// Builds the executor for the engine: the config, the weights bound to
// their roles, and the options the engine derived from the model config.
using ExecutorFactory = std::function<Result<std::unique_ptr<Executor>>(
    const ModelConfig&, const ModelWeights&, const ExecutorOptions&)>;

// Reads the version directory (options.version_dir), binds the weights and
// builds the engine with the factory's executor. Errors name the file and
// field (config.json, tokenizer.json, tokenizer_config.json) or tensor.
// The weights must outlive the engine.
Result<std::unique_ptr<Engine>> CreateLlmEngine(const std::vector<TensorView>& weights,
                                                const EngineOptions& options, bool on_gpu,
                                                const ExecutorFactory& make_executor);

}  // namespace hearth::llm
