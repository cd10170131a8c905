// A config's sequence_batching (Triton's fields, read as model_config.cc
// reads the rest): its strategy, control inputs, implicit state and idle
// limit, into ModelConfig::sequence.
#pragma once

#include <yaml-cpp/yaml.h>

#include "hearth/status.h"
#include "server/model_config.h"
#include "server/model_config_yaml.h"

namespace hearth {

// Reads `node` into m.sequence, and its strategy's batching into
// m.max_queue_delay_us and m.preferred_batch_sizes. m's inputs, outputs,
// max_batch_size and decoupled are read already; every name the sequence
// adds must differ from theirs. The error names the field and its place.
Status ReadSequenceBatching(const config_yaml::Ctx& c, const YAML::Node& node, ModelConfig& m);

}  // namespace hearth
