// DIR/<model>/config.pbtxt: Triton's model configuration in protobuf's text
// format (the message inference.ModelConfig of proto/model_config.proto),
// for models brought from a Triton repository. It is read with protobuf's
// TextFormat parser and written out as the config.yaml that means the same,
// which model_config.cc then reads like any other: one set of checks and
// one meaning for both forms. Every field set in the file is either one
// hearth implements (name, backend or platform, max_batch_size, input and
// output, instance_group, dynamic_batching, sequence_batching, parameters'
// string_value, model_transaction_policy, version_policy latest or
// specific, platform "ensemble" with ensemble_scheduling) or an error naming
// it; none is dropped. Fields of Triton's configuration that
// proto/model_config.proto leaves out (model_warmup, optimization, ...) are
// refused by the
// parser, named as such.
// A hearth built without protobuf refuses every config.pbtxt, saying so.
#pragma once

#include <string>
#include <vector>

#include "hearth/status.h"

namespace hearth {

struct PbtxtAsYaml {
  std::string yaml;
  // Per line of `yaml`: where in the config.pbtxt it came from, as
  // "LINE:COLUMN" (1-based), or "" where no one place did.
  std::vector<std::string> origins;
};

// `text` is the content of the config.pbtxt at `path` (which errors name,
// with the line and column, and the field).
Result<PbtxtAsYaml> PbtxtToYaml(const std::string& path, const std::string& text);

// The same for text that is no file of the user's (a load's config
// override, made from JSON): errors name `label` without a line and
// column, and the origins are empty.
Result<PbtxtAsYaml> PbtxtToYamlNamed(const std::string& label, const std::string& text);

// A model's config as Triton's JSON form (protobuf's JSON mapping of
// ModelConfig: what a repository load's "config" override gives) written
// as config.pbtxt text. A field proto/model_config.proto lacks is refused,
// named; so is everything without protobuf.
Result<std::string> ModelConfigJsonToPbtxt(const std::string& json);

}  // namespace hearth
