// The model repository: DIR/<model>/config.yaml (or config.pbtxt, Triton's
// text format of the same fields: server/model_config_pbtxt.h; never both)
// and DIR/<model>/<version>/
// holding the version's checkpoint, by one rule: if the version directory
// holds model.safetensors.index.json, the version directory itself is a
// sharded checkpoint directory (as save_pretrained writes it: the index and
// its shards, beside config.json and tokenizer files, which are not read);
// else its model.safetensors is the checkpoint. A numeric directory with
// neither is not a version. Config field names follow
// Triton's model configuration. A model whose directory, config or
// checkpoint is wrong is reported (file, line, field) and not served; the
// others are. Nothing in a repository can do more than fail its own model:
// every yaml-cpp and std::filesystem error is caught and returned, numbers
// are parsed with checked conversions, configs over kMaxConfigBytes and
// files that are not regular (a FIFO, a device, a directory) are refused
// without blocking, and symbolic link loops are errors, not hangs. YAML
// aliases (`*name`) and merge keys (`<<`) are refused, and so are configs of
// more than kMaxConfigNodes values, so that reading a config takes time and
// memory in proportion to its bytes.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

inline constexpr uint64_t kMaxConfigBytes = 1ull << 20;
// Values (scalars, lists and maps) in a config, counted before yaml-cpp
// builds a node for each; Triton-style configs have a few dozen.
inline constexpr size_t kMaxConfigNodes = 100000;
// parameters: at most this many, and this many bytes of keys and values
// together. They reach a worker in its setup message (protocol/worker_protocol.h).
inline constexpr size_t kMaxModelParameters = 256;
inline constexpr size_t kMaxModelParameterBytes = 64u << 10;
inline constexpr int kMaxStandbyWorkers = 8;
// Entries read from one directory (the repository, a model directory).
inline constexpr size_t kMaxDirectoryEntries = 100000;

// Inputs or outputs a config may list, the bytes of a name, and the
// dimensions of one (without the batch dimension); what the worker
// protocol carries (protocol/worker_protocol.h).
inline constexpr size_t kMaxModelTensors = 256;
inline constexpr size_t kMaxTensorNameBytes = 1024;
inline constexpr size_t kMaxModelTensorRank = 15;

// instance_group: at most this many groups, each of at most kMaxGroupInstances
// instances per GPU it names; GPU ordinals below kMaxGpuOrdinal (a
// Device's limit) and each at most once per group.
inline constexpr size_t kMaxInstanceGroups = 64;
inline constexpr int kMaxGroupInstances = 256;
inline constexpr int kMaxGpuOrdinal = 1024;

// One entry of instance_group, with Triton's meaning: `count` instances on
// each GPU it lists (on the server's default GPU when it lists none), or on
// the host for KIND_CPU. Where the instances go is server/placement.h's.
struct InstanceGroup {
  int count = 1;
  bool kind_gpu = true;  // KIND_GPU (the default) or KIND_CPU
  std::vector<int> gpus;
  friend bool operator==(const InstanceGroup&, const InstanceGroup&) = default;
};

struct IoConfig {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;  // per sample; -1: any size
  // An input a request may leave out (Triton's `optional: true`); the model
  // gets it absent. Decoupled models only: a batch needs every input of
  // every request.
  bool optional = false;
  // An input's `format` (Triton's FORMAT_NONE, FORMAT_NCHW, FORMAT_NHWC):
  // the layout of an image input, which clients read from the config; the
  // server does nothing with it. Empty: not given (FORMAT_NONE).
  std::string format{};
  // An output's `label_filename`: a file in the model's directory, one
  // label per line, read when the config is (at most kMaxLabelFileBytes).
  // Classification answers "value:index:label" where line `index` has one.
  std::string label_filename{};
  std::vector<std::string> labels{};
};

inline constexpr uint64_t kMaxLabelFileBytes = 4ull << 20;

// sequence_batching, with Triton's meaning: a request names its sequence
// (the parameters sequence_id, sequence_start, sequence_end), the requests
// of one sequence run one at a time in the order they came, and the server
// hands the model control inputs and the sequence's state as inputs it
// adds to each request (server/sequences.h).
inline constexpr size_t kMaxSequenceControls = 4;  // one per kind
inline constexpr size_t kMaxSequenceStates = 64;
// parameters.max_sequences: live sequences of one model at most (the default).
inline constexpr int kDefaultMaxSequences = 1024;
inline constexpr int kMaxMaxSequences = 1 << 20;
// A sequence's state tensors together, at most.
inline constexpr uint64_t kMaxSequenceStateBytes = 64ull << 20;

struct SequenceControl {
  enum class Kind { kStart, kReady, kEnd, kCorrid };
  Kind kind = Kind::kStart;
  std::string input;
  // Of the input: INT32, FP32 or BOOL for START, READY and END (by which of
  // int32_false_true, fp32_false_true, bool_false_true gives the values);
  // UINT64, INT64, UINT32, INT32 or BYTES for CORRID (a 32-bit type takes the
  // id's low 32 bits; BYTES, a sequence id given as a string).
  DType dtype = DType::kI32;
  double false_value = 0, true_value = 1;
};

struct SequenceState {
  std::string input, output;
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;  // per sample; -1: as the model's output gives it
  // The state a sequence starts with, of these dims: zeros (initial_state's
  // zero_data, or the state's own dims when it has no -1; where the dims
  // have a -1 and no initial_state is given, an empty tensor: that
  // dimension 0), or initial_data, read from initial_state's data_file
  // (DIR/<model>/initial_state/<file>, exactly the tensor's bytes).
  std::vector<int64_t> initial_dims;
  std::vector<std::byte> initial_data;  // empty: zeros
  std::string initial_data_file;        // as the config names it
};

struct SequenceBatching {
  bool oldest = false;  // strategy: direct (the default) or oldest
  // max_sequence_idle_microseconds (0 in a config: Triton's default, 1 s).
  uint64_t max_idle_us = 1'000'000;
  std::vector<SequenceControl> controls;
  std::vector<SequenceState> states;
};

// ensemble_scheduling (platform: ensemble), with Triton's meaning: a model
// with no workers and no weights whose requests run its steps inside the
// server (server/ensemble.h), each step a request to another model. Its
// steps' maps pair a tensor of the step's model (first) with a tensor of
// the ensemble (second): one of its inputs, or one a step produces.
inline constexpr size_t kMaxEnsembleSteps = 256;

struct EnsembleStep {
  std::string model;
  int64_t version = -1;  // -1: the version the model serves
  std::vector<std::pair<std::string, std::string>> inputs, outputs;  // in the config's order
};

// The longest a batch may wait to fill: a request waits at most this long for
// others to join it (and never past its own deadline).
inline constexpr uint64_t kMaxQueueDelayUs = 60'000'000;

struct ModelConfig {
  std::string name;
  std::string config_path;
  std::string backend;  // a kind of the workers' backend registry: mlp, scale, python, ...
  int max_batch_size = 0;
  std::vector<IoConfig> inputs, outputs;  // both empty: the backend's
  // Never empty: a config without instance_group has one default group
  // (count 1, KIND_GPU, no gpus).
  std::vector<InstanceGroup> instance_groups = {InstanceGroup{}};
  // dynamic_batching.max_queue_delay_microseconds, at most kMaxQueueDelayUs.
  uint64_t max_queue_delay_us = 0;
  std::vector<int> preferred_batch_sizes;
  uint64_t max_queue_size = 1024;
  // dynamic_batching.default_queue_policy.default_timeout_microseconds; 0 = none.
  uint64_t default_timeout_us = 0;
  // dynamic_batching.priority_levels (0: requests' levels are not bounded)
  // and default_priority_level, the level of a request that names none (0:
  // after every level a request names).
  uint64_t priority_levels = 0;
  uint64_t default_priority_level = 0;
  std::map<std::string, std::string> parameters;
  bool allow_tf32 = false;
  // parameters.standby_workers: worker processes kept started and waiting
  // on each device the model is placed on, their slow host-side start-up
  // done (program and libraries loaded, e.g. libtorch for aoti), no device
  // context and no weights yet; a worker that dies is replaced by one of its
  // device's. At most kMaxStandbyWorkers per device.
  int standby_workers = 0;
  // parameters.zygote (backend: python; on unless false): workers are forked
  // from a process per model that has imported torch, hearth and model.py
  // and never touched a device (server/zygote.h), not exec'd afresh.
  bool zygote = true;
  // parameters.standby_mode: cold (the default) keeps the standby workers
  // as above; hot keeps them fully started instead (hot spares: attached,
  // backend built, one warm-up batch run), so that one takes a dead
  // worker's place with nothing left to start. Hot needs standby_workers > 0.
  bool standby_hot = false;
  // parameters.fault_injection: a worker fails this way (abort, segv, hang,
  // cuda_illegal_address) on any batch holding an input element equal to
  // fault_on_value. Empty: off.
  std::string fault_kind;
  double fault_on_value = 0;
  // model_transaction_policy.decoupled: a request may get any number of
  // responses (a stream), and a worker holds up to parameters.max_streams
  // of them at once (1 to control::kMaxStreams; 1 by default).
  bool decoupled = false;
  int max_streams = 1;
  // parameters.resumable: a stream whose worker died goes on on another from
  // the token ids its client has (the model's token_ids output, INT64 [-1]),
  // which the model is handed back; else it ends with an error.
  bool resumable = false;
  // sequence_batching (never with dynamic_batching, as in Triton: its
  // strategy's max_queue_delay_microseconds and preferred_batch_size are
  // the batching's), and parameters.max_sequences.
  std::optional<SequenceBatching> sequence;
  int max_sequences = kDefaultMaxSequences;
  // platform: ensemble (backend empty, one default instance group, no
  // batching policy of its own): its steps, checked as a graph
  // (server/ensemble_config.h) but not yet against the models they name.
  std::optional<std::vector<EnsembleStep>> ensemble;
  uint64_t version = 0;  // the repository version served
  // DIR/<model>/<version>/model.safetensors, or, for a sharded checkpoint,
  // the version directory DIR/<model>/<version> (Checkpoint::Open takes both).
  std::string version_dir;  // DIR/<model>/<version>: model.py and the like live here
  std::string checkpoint_path;
  // Version directories above the one served that hold no checkpoint (nor,
  // for backend: python, a model.py) and so were passed over, highest first
  // (a copy not yet done, say): the server says so when it loads the model.
  // Empty under a version_policy, which names the version.
  std::vector<std::string> passed_over_versions;
};

// What the workers take and give: the config's inputs, then a sequence
// model's control inputs and state inputs; the config's outputs, then its
// state outputs. Requests name only the config's own (ModelConfig::inputs).
std::vector<IoConfig> WorkerInputs(const ModelConfig& config);
std::vector<IoConfig> WorkerOutputs(const ModelConfig& config);

// One entry of the repository that stands for a model: a directory, or a
// symbolic link (which may turn out to be a loop or dangling: then `status`
// says so and the model fails alone).
struct ModelDirectory {
  std::string name;
  std::string path;  // DIR/<name>
  Status status;     // not OK: the entry cannot be a model (its name, say)
};

// The model entries under `dir`, sorted by name; plain files are skipped.
// Fails only if `dir` itself cannot be read.
Result<std::vector<ModelDirectory>> ListModelDirectories(const std::string& dir);

struct RepositoryModel {
  std::string name;
  Status status;  // not OK: why the model is not served
  ModelConfig config;
};

// Reads every model directory under `dir` (ListModelDirectories, then
// LoadModelConfig for each). Fails only if `dir` itself cannot be read.
Result<std::vector<RepositoryModel>> ScanRepository(const std::string& dir);

// Reads DIR/<model>/config.yaml or DIR/<model>/config.pbtxt (a directory
// holding both is refused) and picks the version to serve. Never throws;
// every error names the file (and line and field where there is one; the
// line and column in a config.pbtxt).
Result<ModelConfig> LoadModelConfig(const std::string& model_dir);
// The same for a config's text, as if read from model_dir/config.yaml (the
// versions are still looked up in model_dir).
Result<ModelConfig> ParseModelConfig(const std::string& model_dir, const std::string& text);
// The same for the text of a config.pbtxt, as if read from model_dir/config.pbtxt.
Result<ModelConfig> ParseModelConfigPbtxt(const std::string& model_dir, const std::string& text);
// The same for a repository load's config override (config.pbtxt text
// made from the JSON the client sent; load_overrides.h): its errors name
// kConfigOverrideLabel, not a file, and no line, since the client wrote no
// file. The versions are looked up in model_dir (the model's directory, or
// the one its file overrides were written to).
inline constexpr const char* kConfigOverrideLabel = "the load's config override";
Result<ModelConfig> ParseModelConfigOverride(const std::string& model_dir,
                                             const std::string& pbtxt);

}  // namespace hearth
