// Triton's load with overrides, made ready for a build: the config override
// (Triton's JSON) as config.pbtxt text, and file overrides written, with
// that config, into a new directory that then stands for the model's.
#pragma once

#include <cstdint>
#include <string>

#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

struct PreparedOverrides {
  std::string pbtxt;  // the config, as config.pbtxt text
  std::string dir;    // the model's directory made of the files; empty: none given
};

// Checks `overrides` (a config with any files; each file's path relative,
// without "." or ".." components, empty components or NUL, not the config
// file itself, at most kMaxOverridePathBytes; at most kMaxOverrideFiles
// files of kMaxOverrideBytes together; no path twice) and, when it has
// files, writes them and config.pbtxt under ROOT/<serial>/<model> (named as
// the model's directory is; ROOT and every directory made 0700, files 0600,
// nothing followed through a symbolic link). InvalidArgument naming what is
// wrong; nothing is left behind on failure.
Result<PreparedOverrides> PrepareLoadOverrides(const ModelLoadOverrides& overrides,
                                               const std::string& model, const std::string& root,
                                               uint64_t serial);

// Removes a directory PrepareLoadOverrides made (ROOT/<serial>), and what it holds.
void RemoveOverrideDirectory(const std::string& dir);

}  // namespace hearth
