"""Export a PyTorch model as a model version of hearth's `aoti` backend.

    python3 -m hearth.aoti export my_model.py:build --example-input-shape 16,16384 \\
        --dynamic-batch 1..64 --out repo/mymodel/1/

writes

- `repo/mymodel/1/model.pt2`: the model compiled by AOTInductor
  (`torch.export.export`, then `torch._inductor.aoti_compile_and_package`) with
  `aot_inductor.package_constants_in_so=False` and no on-disk constants
  format: the package holds no copy of the weights, only code;
- `repo/mymodel/1/model.safetensors`: every constant the package expects, under
  the names its loader's `get_constant_fqns()` returns, contiguous, in the
  dtype and shape the package was compiled for. hearth's store loads this file
  once and every worker binds the package to the store's tensors
  (`load_constants(..., user_managed=true)`), so N workers share one copy;
- `repo/mymodel/config.yaml` (`backend: aoti`, inputs, outputs, batch size,
  instance group, and `parameters.standby_workers` from `--standby-workers`,
  default 1); an existing one is kept unless `--force`.

The package's metadata (`aot_inductor.metadata`, read in C++ by
`AOTIModelPackageLoader::get_metadata()`) carries hearth's view of it, every
value a string:

- `hearth.format`: "1";
- `hearth.inputs`, `hearth.outputs`: JSON lists, in call order, of
  `{"name", "data_type": "TYPE_FP32"..., "dims"}`, dims per row: without the
  batch dimension, -1 where another dimension is dynamic, `[]` for a tensor of
  shape [batch] (config.yaml says `[1]` there, as its dims cannot be empty);
- `hearth.batch`: JSON `{"dynamic": bool, "min": int, "max": int}`, the range
  the package accepts (torch.export's, which may be narrower than asked);
  a fixed batch has min = max = the example's;
- `hearth.constants`: JSON `{fqn: {"dtype": "F32"..., "shape": [...]}}`, the
  package's constants, which are exactly model.safetensors' tensors.

Every input and output has the batch as its first dimension. With
`--dynamic-batch MIN..MAX` it is a `torch.export.Dim("batch", min=MIN,
max=MAX)` shared by all inputs and config.yaml says `max_batch_size: MAX` with
per-row dims; without it the batch is fixed to the example's, and config.yaml
says `max_batch_size: 0` (hearth does not batch requests) with the whole shape,
batch included, as dims.

How the constants' names are found: they are predicted from the exported
program (the parameters, buffers and constants whose placeholders the graph
uses, one name for tensors that are one tensor, as AOTInductor dedups them)
before compiling, since the metadata is compiled in; then checked against the
constant table of the package's generated wrapper (`constants_info_[i]
.original_fqn`, what `get_constant_fqns()` returns), and compiled again under
the package's names if they differ. The Python loader is never called here
(it was seen crashing on some machines). Before export, tensors kept as plain
module attributes become non-persistent buffers, and a tensor created inside
forward makes the exporter export again with it as a buffer, so that every
constant is named by its module path (AOTInductor would otherwise name it
`_tensor_constantN`). Parameters and buffers are made contiguous: the stored
tensors are contiguous and the package must be compiled for that layout.

The modules: `exporter` (torch.export and AOTInductor: export()), `constants`
(the package's constants, predicted and read back), `repository` (the version
directory: model.safetensors, config.yaml, the files moved into place), `cli`
(the command line), `dtypes` and `messages` (ExportError, progress on stderr).

As a library: `hearth.aoti.export(module, out, example_input_shapes, ...)`.
Needs torch >= 2.6 (torch.export and AOTInductor packaging); `import
hearth.aoti` itself imports nothing heavy.
"""

from .cli import build_module, main
from .constants import package_constants
from .exporter import export, unavailable_reason
from .messages import ExportError
from .repository import write_safetensors

__all__ = ["export", "ExportError", "unavailable_reason", "write_safetensors",
           "package_constants", "build_module", "main"]
