// The config parameters (config.yaml's `parameters:`) that the server reads
// for every model, whatever its backend (server/model_config.cc, which
// checks each name it reads against this list when it is compiled). They
// reach each worker's backend with the model's own: a backend that refuses
// the names it does not know lets these pass.
#pragma once

#include <algorithm>
#include <iterator>
#include <string_view>

namespace hearth {

inline constexpr std::string_view kServerModelParameters[] = {
    "allow_tf32",   "max_sequences",   "max_streams", "resumable",
    "standby_mode", "standby_workers", "zygote"};

constexpr bool IsServerModelParameter(std::string_view name) {
  return std::find(std::begin(kServerModelParameters), std::end(kServerModelParameters), name) !=
         std::end(kServerModelParameters);
}

}  // namespace hearth
