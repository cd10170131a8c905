// A config's ensemble_scheduling (platform: ensemble), read as
// model_config.cc reads the rest, and its checks: those of the steps as a
// graph, made when the config is read, and those against the models the
// steps name, made when the ensemble is loaded (those models must be served
// by then). Every error names the field.
#pragma once

#include <yaml-cpp/yaml.h>

#include <functional>
#include <string>
#include <vector>

#include "hearth/status.h"
#include "server/inference_api.h"
#include "server/model_config.h"
#include "server/model_config_yaml.h"

namespace hearth {

// Reads `node` (ensemble_scheduling: {step: [...]}) into m.ensemble, then
// CheckEnsembleGraph. m's inputs, outputs and max_batch_size are read already.
Status ReadEnsembleScheduling(const config_yaml::Ctx& c, const YAML::Node& node, ModelConfig& m);

// The steps as a graph of tensors: every step names a model other than the
// ensemble and maps at least one input and one output; every tensor a step
// takes is an input of the ensemble or an output of a step; no tensor is
// produced twice (by two steps, or by a step and the request); every input
// of the ensemble is taken by a step and every output produced by one; and
// no step waits, through others, on itself (a cycle).
Status CheckEnsembleGraph(const ModelConfig& m);

// A model a step names, as it is served.
struct ComposingModel {
  ModelMetadata metadata;
  // When it is an ensemble itself: every model its steps reach (through
  // ensembles of theirs too).
  std::vector<std::string> reaches;
};
using FindComposingModel = std::function<Result<ComposingModel>(const std::string& model)>;

// The steps against the models they name (`find`: the served model, or
// why none is): each is served, at the version the step asks for, neither
// decoupled nor serving sequences, has the inputs and outputs the step
// maps and gets every input it needs; its tensors agree in datatype and
// shape with the ensemble's they are mapped to (the ensemble's inputs and
// outputs, and what earlier steps produce); with batching (max_batch_size
// > 0), each batches at least as many rows; and no ensemble a step names
// reaches this one. Returns every model the ensemble reaches, sorted.
Result<std::vector<std::string>> CheckEnsembleSteps(const ModelConfig& m,
                                                    const FindComposingModel& find);

}  // namespace hearth
